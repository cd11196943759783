"""Pure jax.numpy twins of the gdp_jax entry points (same signatures minus `backend`).

The token-by-token `lax.scan` forms in `recurrent` are the oracles; `chunk_gated_delta_product`
here is the scan form, `chunk_gated_delta_product_chunked` the chunked WY form of the prefill.
`chunk_offsets` and `chunk_descriptors` index packed chunk lists on the device.
"""
from gdp_jax._common import chunk_descriptors
from gdp_jax._common import chunk_offsets
from gdp_jax.reference.chunked import chunk_gated_delta_product as chunk_gated_delta_product_chunked
from gdp_jax.reference.prepare import beta_gate
from gdp_jax.reference.prepare import decay_gate
from gdp_jax.reference.prepare import gated_delta_product_decode_prepare
from gdp_jax.reference.recurrent import accept_draft_tokens
from gdp_jax.reference.recurrent import chunk_gated_delta_product
from gdp_jax.reference.recurrent import commit_replay
from gdp_jax.reference.recurrent import fused_recurrent_gated_delta_rule
from gdp_jax.reference.recurrent import gated_delta_product_decode

__all__ = [
    "accept_draft_tokens",
    "beta_gate",
    "decay_gate",
    "chunk_descriptors",
    "chunk_gated_delta_product",
    "chunk_gated_delta_product_chunked",
    "chunk_offsets",
    "commit_replay",
    "fused_recurrent_gated_delta_rule",
    "gated_delta_product_decode",
    "gated_delta_product_decode_prepare",
]
