"""Backward of the output and of the state update, per expanded chunk (docs/algorithm.md §13.1).

On the expanded stream (q~, do~ on each token's last copy, as in chunk_h_bwd), for expanded
chunk e with S the state entering it, dS the cotangent of the state leaving it (chunk_h_bwd's
dh), dV' from chunk_h_bwd, V' = v_new, and Dec[a, b] = 2^(G_a - G_b) for a >= b (both valid):

    dP   = (do~ V'^T) . Dec . scale                 [BT, BT]
    dq~  = dP K + scale diag(Gamma) do~ S^T
    dk   = dP^T Q~ + diag(2^(g_C - G)) V' dS^T      (the output's and the state update's parts)
    dw   = -dV' S^T                                  (W's cotangent, for chunk_wy_bwd)

and the decay's cotangent on each row (before the reverse cumulative sum, which chunk_wy_bwd
applies once it has added the WY part): every term that holds 2^(+G_a) is linear in q~_a and
every one that holds 2^(-G_b) is linear in k_b, so

    dG_a = <q~_a, dq~_a> - <k_a, dk_a>,   and the last valid row also gets
           sum_b <k_b, dk_b(state part)> + 2^g_C <S, dS>   (g_C sits in both state terms).

dP^T is accumulated as its own product (V' do~^T) instead of transposing dP: a tl.trans of a dot
result fed to another dot is miscompiled on Hopper by Triton 3.4 to 3.7.0 (FLA #640).

Grid: (expanded-chunk descriptors, HV, ceil(K / 64)). Program (i_d, i_hv, i_k) owns 64 columns
of K of one chunk and value head and loops over V; dG goes out per K block and is summed by
chunk_wy_bwd. Rows past the sequence end are neither read nor written.

Parameter order: inputs, outputs, constexprs.
"""
import triton
import triton.language as tl

from ._common import chunk_span


@triton.jit
def chunk_o_bwd_kernel(
    # inputs
    q,           # [T*M, H, K] q~ (normalised queries on each token's last copy, else 0)
    k,           # [T*M, H, K] (normalised) keys
    v_new,       # [T*M, HV, V] V' of the recomputed forward scan, input dtype
    h,           # [NXR, HV, K, V] state entering each expanded chunk, input dtype
    do,          # [T*M, HV, V] do~
    dh,          # [NXR, HV, K, V] float32 cotangent of the state leaving each chunk
    dv,          # [T*M, HV, V] float32 dV'
    g_cum,       # [T*M, HV] float32 Gx; a placeholder when USE_G is False
    cu_seqlens,  # [N+1] int32 token-stream sequence starts
    chunk_desc,  # [NXD, 2] int32 (sequence, expanded chunk within it); sequence -1 = padding
    scale,       # float32 query scale
    # outputs
    dq,          # [T*M, HV, K] float32 cotangent of q~ per value head
    dk,          # [T*M, HV, K] float32 (output and state-update parts)
    dw,          # [T*M, HV, K] float32
    dg,          # [T*M, HV, NK] float32 dG per K block; never written without USE_G
    # sizes
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    M: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    NK: tl.constexpr,  # ceil(K / BK), the grid's third axis
    # flags
    USE_G: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
  i_d, i_hv, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
  i_h = i_hv // (HV // H)
  i_n, row0, n = chunk_span(chunk_desc, cu_seqlens, i_d, M, BT)
  if i_n < 0:
    return
  dt = k.dtype.element_ty
  o_a = tl.arange(0, BT)
  mask_r = o_a < n
  o_k = i_k * BK + tl.arange(0, BK)
  mask_k = o_k < K
  m_rk = mask_r[:, None] & mask_k[None, :]
  p_h = h + (i_d.to(tl.int64) * HV + i_hv) * (K * V)
  p_dh = dh + (i_d.to(tl.int64) * HV + i_hv) * (K * V)
  row_v = (row0 + o_a) * (HV * V) + i_hv * V

  b_dqi = tl.zeros([BT, BK], dtype=tl.float32)
  b_dp = tl.zeros([BT, BT], dtype=tl.float32)
  b_dpt = tl.zeros([BT, BT], dtype=tl.float32)
  b_dks = tl.zeros([BT, BK], dtype=tl.float32)
  b_dw = tl.zeros([BT, BK], dtype=tl.float32)
  b_sds = tl.zeros([BK], dtype=tl.float32)
  for i_v in range(tl.cdiv(V, BV)):
    o_v = i_v * BV + tl.arange(0, BV)
    mask_v = o_v < V
    m_rv = mask_r[:, None] & mask_v[None, :]
    m_vr = mask_v[:, None] & mask_r[None, :]
    m_vk = mask_v[:, None] & mask_k[None, :]
    b_do = tl.load(do + row_v[:, None] + o_v[None, :], mask=m_rv, other=0.).to(dt)
    b_dot = tl.load(do + row_v[None, :] + o_v[:, None], mask=m_vr, other=0.).to(dt)
    b_vn = tl.load(v_new + row_v[:, None] + o_v[None, :], mask=m_rv, other=0.)
    b_vnt = tl.load(v_new + row_v[None, :] + o_v[:, None], mask=m_vr, other=0.)
    b_dv = tl.load(dv + row_v[:, None] + o_v[None, :], mask=m_rv, other=0.)
    b_ht = tl.load(p_h + o_k[None, :] * V + o_v[:, None], mask=m_vk, other=0.).to(dt)  # S^T
    b_dht = tl.load(p_dh + o_k[None, :] * V + o_v[:, None], mask=m_vk, other=0.)       # dS^T
    b_dqi += tl.dot(b_do, b_ht, input_precision=DOT_PRECISION)
    b_dp += tl.dot(b_do, b_vnt, input_precision=DOT_PRECISION)
    b_dpt += tl.dot(b_vn, b_dot, input_precision=DOT_PRECISION)
    b_dks += tl.dot(b_vn, b_dht.to(dt), input_precision=DOT_PRECISION)
    b_dw += tl.dot(b_dv.to(dt), b_ht, input_precision=DOT_PRECISION)
  if USE_G:
    # <S, dS> in a loop of its own: a tile that feeds a tensor-core dot and a register reduction
    # in the same pipelined loop comes out wrong on the H200 (docs/algorithm.md §4.2; here dg
    # differed between two identical bf16 runs).
    for i_v in range(tl.cdiv(V, BV)):
      o_v = i_v * BV + tl.arange(0, BV)
      m_kv = mask_k[:, None] & (o_v < V)[None, :]
      b_hs = tl.load(p_h + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
      b_dhs = tl.load(p_dh + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
      b_sds += tl.sum(b_hs.to(tl.float32) * b_dhs, 1)

  p_qk = (row0 + o_a[:, None]) * (H * K) + i_h * K + o_k[None, :]
  b_q = tl.load(q + p_qk, mask=m_rk, other=0.)
  b_k = tl.load(k + p_qk, mask=m_rk, other=0.)
  m_inc = (o_a[:, None] >= o_a[None, :]) & mask_r[:, None] & mask_r[None, :]
  m_inct = (o_a[None, :] >= o_a[:, None]) & mask_r[:, None] & mask_r[None, :]
  if USE_G:
    b_g = tl.load(g_cum + (row0 + o_a) * HV + i_hv, mask=mask_r, other=0.)
    b_g_last = tl.load(g_cum + (row0 + n - 1) * HV + i_hv)
    # Selects: off the causal side the exponent is positive and may overflow to inf.
    b_dp = tl.where(m_inc, b_dp * tl.exp2(b_g[:, None] - b_g[None, :]), 0.)
    b_dpt = tl.where(m_inct, b_dpt * tl.exp2(b_g[None, :] - b_g[:, None]), 0.)
    b_gam = tl.where(mask_r, tl.exp2(b_g), 0.)
    b_kdec = tl.where(mask_r, tl.exp2(b_g_last - b_g), 0.)
  else:
    b_dp = tl.where(m_inc, b_dp, 0.)
    b_dpt = tl.where(m_inct, b_dpt, 0.)
    b_gam = tl.where(mask_r, 1., 0.)
    b_kdec = b_gam
  b_dq = scale * (tl.dot(b_dp.to(dt), b_k, input_precision=DOT_PRECISION)
                  + b_dqi * b_gam[:, None])
  b_dks = b_dks * b_kdec[:, None]
  b_dk = scale * tl.dot(b_dpt.to(dt), b_q, input_precision=DOT_PRECISION) + b_dks

  p_out = (row0 + o_a[:, None]) * (HV * K) + i_hv * K + o_k[None, :]
  tl.store(dq + p_out, b_dq, mask=m_rk)
  tl.store(dk + p_out, b_dk, mask=m_rk)
  tl.store(dw + p_out, -b_dw, mask=m_rk)
  if USE_G:
    b_qf = b_q.to(tl.float32)
    b_kf = b_k.to(tl.float32)
    b_dg = tl.sum(b_qf * b_dq, 1) - tl.sum(b_kf * b_dk, 1)
    b_last = tl.sum(tl.sum(b_kf * b_dks, 1), 0) + tl.exp2(b_g_last) * tl.sum(b_sds, 0)
    b_dg = tl.where(o_a == n - 1, b_dg + b_last, b_dg)
    tl.store(dg + ((row0 + o_a) * HV + i_hv) * NK + i_k, b_dg, mask=mask_r)
