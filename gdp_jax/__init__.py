"""gdp_jax: Gated Delta Product (DeltaProduct with a decay gate) for JAX.

Entry points: `chunk_gated_delta_product` (prefill), `fused_recurrent_gated_delta_rule` (the
decode step), `gated_delta_product_decode`, `accept_draft_tokens` and `commit_replay` (decode
with draft tokens), `gated_delta_product_decode_prepare` (gates and Householder fold for the
decode step in one launch), `chunk_offsets` (where each packed sequence's chunk states start),
and `reference`, the pure jax.numpy twins of all of them. `FwdConfig` and `BwdConfig` (the
prefill's `config=` and `bwd_config=`) and `DecodeConfig` (the decode entry points' `config=`)
hold the kernels' tiles, warps and splits. `UntestedVersionsWarning` is the warning the GPU
path gives once on package versions other than those its test suite passed with
(`gdp_jax._versions.TESTED`).
"""
from importlib import metadata as _metadata

from gdp_jax._configs import DecodeConfig
from gdp_jax._prefill_bwd import BwdConfig
from gdp_jax._prefill_kernels import FwdConfig
from gdp_jax.decode import (accept_draft_tokens, commit_replay,
                            fused_recurrent_gated_delta_rule, gated_delta_product_decode)
from gdp_jax._versions import UntestedVersionsWarning
from gdp_jax.prefill import chunk_gated_delta_product
from gdp_jax.prepare import gated_delta_product_decode_prepare

try:
  __version__ = _metadata.version("gdp-jax")
except _metadata.PackageNotFoundError:  # imported from a source tree that was never installed
  __version__ = "unknown"

__all__ = [
    "BwdConfig",
    "DecodeConfig",
    "FwdConfig",
    "UntestedVersionsWarning",
    "__version__",
    "accept_draft_tokens",
    "chunk_gated_delta_product",
    "chunk_offsets",
    "commit_replay",
    "fused_recurrent_gated_delta_rule",
    "gated_delta_product_decode",
    "gated_delta_product_decode_prepare",
    "reference",
]


def __getattr__(name):
  # `reference` and `chunk_offsets` load on first use, so `import gdp_jax` stays light.
  if name == "reference":
    import importlib
    return importlib.import_module("gdp_jax.reference")
  if name == "chunk_offsets":
    from gdp_jax._common import chunk_offsets
    return chunk_offsets
  raise AttributeError(f"module 'gdp_jax' has no attribute {name!r}")
