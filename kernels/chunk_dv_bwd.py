"""The chunk-local part of dV', for every expanded chunk at once (docs/algorithm.md §13.1).

In the reverse scan (chunk_h_bwd) dV' = P^T do~ + diag(2^(g_C - G)) K dS, and only the second
term depends on dS. The first, with

    P^T[b, a] = scale <k_b, q~_a> 2^(G_a - G_b)   for a >= b, both valid (else 0),

is computed here by one program per (expanded chunk, value head), all in parallel, so that the
scan's sequential chain per chunk loses the [BT, BT] product over K, its decay matrix and
P^T do~. q~ and do~ are read from the token stream (row r is copy r % M of token r // M; only
the last copy holds them). Output in the dtype of `dv_local` (the input dtype).

Grid: (expanded-chunk descriptors, HV). Parameter order: inputs, outputs, constexprs.
"""
import triton
import triton.language as tl

from ._common import chunk_span, query_block, query_rows


@triton.jit
def chunk_dv_local_kernel(
    # inputs
    q,           # [T, H, K] (normalised) queries, input dtype
    k,           # [T*M, H, K] (normalised) keys
    do,          # [T, HV, V] output cotangent, input dtype
    g_cum,       # [T*M, HV] float32 Gx; a placeholder when USE_G is False
    cu_seqlens,  # [N+1] int32 token-stream sequence starts
    chunk_desc,  # [NXD, 2] int32 (sequence, expanded chunk within it); sequence -1 = padding
    scale,       # float32 query scale
    # outputs
    dv_local,    # [T*M, HV, V] P^T do~, input dtype
    # sizes
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    M: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    # flags
    USE_G: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
  i_d, i_hv = tl.program_id(0), tl.program_id(1)
  i_h = i_hv // (HV // H)
  i_n, row0, n = chunk_span(chunk_desc, cu_seqlens, i_d, M, BT)
  if i_n < 0:
    return
  dt = k.dtype.element_ty
  BQ: tl.constexpr = query_block(M, BT)
  o_a = tl.arange(0, BT)
  mask_r = o_a < n
  row = row0 + o_a
  r_q, mask_q, tok = query_rows(row0, n, M, BT, BQ)

  # P^T = K Q~^T (key rows b, query columns j), the queries loaded transposed.
  b_pt = tl.zeros([BT, BQ], dtype=tl.float32)
  for i_k in range(tl.cdiv(K, BK)):
    o_k = i_k * BK + tl.arange(0, BK)
    mask_k = o_k < K
    b_k = tl.load(k + row[:, None] * (H * K) + i_h * K + o_k[None, :],
                  mask=mask_r[:, None] & mask_k[None, :], other=0.)
    b_qt = tl.load(q + tok[None, :] * (H * K) + i_h * K + o_k[:, None],
                   mask=mask_k[:, None] & mask_q[None, :], other=0.)
    b_pt += tl.dot(b_k, b_qt, input_precision=DOT_PRECISION)
  m_pt = (r_q[None, :] >= o_a[:, None]) & mask_r[:, None] & mask_q[None, :]
  if USE_G:
    b_g = tl.load(g_cum + row * HV + i_hv, mask=mask_r, other=0.)
    b_gq = b_g
    if BQ < BT:
      b_gq = tl.load(g_cum + (row0 + r_q) * HV + i_hv, mask=mask_q, other=0.)
    # A select: above the diagonal G_a - G_b > 0 may overflow exp2 to inf.
    b_pt = tl.where(m_pt, b_pt * tl.exp2(b_gq[None, :] - b_g[:, None]), 0.)
  else:
    b_pt = tl.where(m_pt, b_pt, 0.)
  b_pt = (b_pt * scale).to(dt)

  for i_v in range(tl.cdiv(V, BV)):
    o_v = i_v * BV + tl.arange(0, BV)
    mask_v = o_v < V
    b_do = tl.load(do + tok[:, None] * (HV * V) + i_hv * V + o_v[None, :],
                   mask=mask_q[:, None] & mask_v[None, :], other=0.).to(dt)
    b_dv = tl.dot(b_pt, b_do, input_precision=DOT_PRECISION)
    tl.store(dv_local + row[:, None] * (HV * V) + i_hv * V + o_v[None, :],
             b_dv.to(dv_local.dtype.element_ty), mask=mask_r[:, None] & mask_v[None, :])
