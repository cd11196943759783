"""Stage 1 of the chunked prefill: chunk-local cumulative log2 decays.

For one chunk of 64 rows of a stream (token stream with M = 1, Householder-expanded stream with
M = num_householder) and one value head, writes

    g_cum[r, hv] = log2e * sum_{r' = chunk start .. r} g~[r', hv],
    g~[r', hv]   = g[r' // M, hv] if r' % M == 0 else 0,

an inclusive prefix sum that restarts at each chunk start of its own stream, counted from the
start of its own sequence (ALGORITHM.md §4.3), computed by `_common.chunk_decays`, the same
code chunk_kkt and chunk_o run for the stage they fold in. The pipeline uses this kernel only
for the fused scan + output, which needs Gu inside the scan.

Grid: (number of chunk descriptors, HV). Program (i_d, i_hv) owns the 64 rows of chunk
descriptor i_d, value head i_hv; a descriptor whose sequence is -1 (padding of the static
descriptor list) returns at once.

Parameter order: inputs, outputs, constexprs (how jax_triton.triton_call passes them).
"""
import triton
import triton.language as tl

from ._common import chunk_decays, chunk_span


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
):
  i_d, i_hv = tl.program_id(0), tl.program_id(1)
  i_n, row0, n = chunk_span(chunk_desc, cu_seqlens, i_d, M, BT)
  if i_n < 0:
    return
  o_r = tl.arange(0, BT)
  b_g = chunk_decays(g, row0, n, i_hv, HV, M, BT)
  tl.store(g_cum + (row0 + o_r) * HV + i_hv, b_g, mask=o_r < n)
