"""Stage 1 of the chunked prefill: chunk-local cumulative log2 decays.

For one chunk of 64 rows of a stream (token stream with M = 1, Householder-expanded stream with
M = num_householder) and every value head, writes

    g_cum[r, hv] = log2e * sum_{r' = chunk start .. r} g~[r', hv],
    g~[r', hv]   = g[r' // M, hv] if r' % M == 0 else 0,

an inclusive prefix sum that restarts at each chunk start of its own stream, counted from the
start of its own sequence (ALGORITHM.md §4.3). The interleaved g~ is never materialised: the
kernel reads g[r // M] under the mask r % M == 0.

Grid: (number of chunk descriptors,). Program `i_d` owns the 64 rows x HV heads of chunk
descriptor `i_d`; a descriptor whose sequence is -1 (padding of the static descriptor list)
returns at once.

Parameter order: inputs, outputs, constexprs (how jax_triton.triton_call passes them).
"""
import triton
import triton.language as tl

from ._common import chunk_span


@triton.jit
def chunk_cumsum_fwd_kernel(
    # inputs
    g,           # [T, HV] float32 natural-log decays of the token stream (B folded into T)
    cu_seqlens,  # [N+1] int32 token-stream sequence starts
    chunk_desc,  # [ND, 2] int32 (sequence, chunk within it) on this stream; sequence -1 = padding
    # outputs
    g_cum,       # [T*M, HV] float32 chunk-local cumulative decays in log2 units
    # sizes
    HV: tl.constexpr,
    M: tl.constexpr,    # rows per token on this stream: 1 (token stream) or num_householder
    BT: tl.constexpr,   # chunk length, 64
    BHV: tl.constexpr,  # next power of two >= HV
):
  i_n, row0, n = chunk_span(chunk_desc, cu_seqlens, tl.program_id(0), M, BT)
  if i_n < 0:
    return
  # A sequence's rows on this stream start at M * its first token, so row % M is the copy index.
  row = row0 + tl.arange(0, BT)
  o_hv = tl.arange(0, BHV)
  mask_r = tl.arange(0, BT) < n
  mask_hv = o_hv < HV
  m_g = (mask_r & (row % M == 0))[:, None] & mask_hv[None, :]
  b_g = tl.load(g + (row // M)[:, None] * HV + o_hv[None, :], mask=m_g, other=0.)
  # Scaled after the sum, so every kernel downstream can use exp2.
  b_g = tl.cumsum(b_g.to(tl.float32), axis=0) * 1.4426950216
  tl.store(g_cum + row[:, None] * HV + o_hv[None, :], b_g,
           mask=mask_r[:, None] & mask_hv[None, :])
