"""Backward of the output and of the state update, per expanded chunk (docs/algorithm.md §13.1).

On the expanded stream (q~, do~ on each token's last copy, read from the token stream as in
chunk_h_bwd), for expanded chunk e with S the state entering it, dS the cotangent of the state
leaving it (chunk_h_bwd's dh), X = T^T dV' from chunk_h_bwd, V' = v_new, Kb = diag(beta Gamma) K,
and Dec[a, b] = 2^(G_a - G_b) for a >= b (both valid):

    dP   = (do~ V'^T) . Dec . scale                 [BT, BT]
    dq~  = dP K + scale diag(Gamma) do~ S^T
    dk   = dP^T Q~ + diag(2^(g_C - G)) V' dS^T      (the output's and the state update's parts)
         + diag(beta Gamma) dKb,  dKb = T^T dW = -X S^T   (W = T Kb enters V' = U - W S only)
    dbeta_a's part Gamma_a <dKb_a, k_a>

and the decay's cotangent on each row (before the reverse cumulative sum, which chunk_wy_bwd
applies once it has added the rest of the WY part): every term of the output and state parts
that holds 2^(+G_a) is linear in q~_a and every one that holds 2^(-G_b) is linear in k_b, while
Kb holds 2^(+G_a) linear in k_a, so

    dG_a = <q~_a, dq~_a> - <k_a, dk_a(output, state)> + beta_a Gamma_a <dKb_a, k_a>, and the
           last valid row also gets sum_b <k_b, dk_b(state part)> + 2^g_C <S, dS> (g_C sits in
           both state terms).

Two patterns that Triton 3.4 to 3.7.0 miscompiles on Hopper are avoided: a tl.trans of a dot
result fed to another dot (FLA #640), so dP^T goes through memory (the decayed dP, rounded to
the input dtype as the dq~ product takes it, is stored to a scratch tile of the program's own
and read back transposed, as chunk_wy_bwd does for dA) rather than through tl.trans; and a
loaded tile that feeds both a dot and a register reduction in one pipelined loop
(docs/algorithm.md §4.2), so <S, dS> is the trace of the product dS S^T accumulated beside the
others. Transposed operands are transposes of loaded tiles.

Grid: (NK * expanded-chunk descriptors, HV), NK = ceil(K / BK), the K block fastest: program
(i_d * NK + i_k, i_hv) owns BK columns of K of one chunk and value head and loops over V in
steps of BV; each forms dP itself (one program per chunk and head walking the K blocks lost on
the H200: docs/performance.md, Training). The NK programs of one chunk and head are adjacent, so
that the later ones may find do~, V' and dV' (read by each) in L2 instead of HBM. dG goes out
per K block and is summed by chunk_wy_bwd. Rows past the sequence end are neither read nor
written; dq~ goes out on the token stream (the last copies only: every other row of dq~ is
zero).

Parameter order: inputs, outputs, constexprs.
"""
import triton
import triton.language as tl

from ._common import chunk_span


@triton.jit
def chunk_o_bwd_kernel(
    # inputs
    q,           # [T, H, K] (normalised) queries, input dtype
    k,           # [T*M, H, K] (normalised) keys
    v_new,       # [T*M, HV, V] V' of the recomputed forward scan, input dtype
    h,           # [NXR, HV, K, V] state entering each expanded chunk, input dtype
    do,          # [T, HV, V] output cotangent, input dtype
    dh,          # [NXR, HV, K, V] cotangent of the state leaving each chunk, input dtype
    dx,          # [T*M, HV, V] X = T^T dV', input dtype
    g_cum,       # [T*M, HV] float32 Gx; a placeholder when USE_G is False
    beta,        # [T*M, HV] float32
    cu_seqlens,  # [N+1] int32 token-stream sequence starts
    chunk_desc,  # [NXD, 2] int32 (sequence, expanded chunk within it); sequence -1 = padding
    scale,       # float32 query scale
    # outputs
    dq,          # [T, HV, K] float32 cotangent of q per value head
    dk,          # [T*M, HV, K] float32 (output, state-update and Kb parts)
    db,          # [T*M, HV, NK] float32 dbeta's part Gamma <dKb, k> per K block
    dg,          # [T*M, HV, NK] float32 dG per K block; never written without USE_G
    dp_scratch,  # [T*M, HV, NK, BT] the decayed dP in the input dtype (read only as a dot
                 # operand), one tile per program, written and read back transposed
    # sizes
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    M: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    NK: tl.constexpr,  # ceil(K / BK): K blocks per chunk and head, the grid's fastest
    # flags
    USE_G: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
  i_d, i_k = tl.program_id(0) // NK, tl.program_id(0) % NK
  i_hv = tl.program_id(1)
  i_h = i_hv // (HV // H)
  i_n, row0, n = chunk_span(chunk_desc, cu_seqlens, i_d, M, BT)
  if i_n < 0:
    return
  dt = k.dtype.element_ty
  o_a = tl.arange(0, BT)
  mask_r = o_a < n
  p_h = h + (i_d.to(tl.int64) * HV + i_hv) * (K * V)
  p_dh = dh + (i_d.to(tl.int64) * HV + i_hv) * (K * V)
  row = row0 + o_a
  row_v = row * (HV * V) + i_hv * V
  tok = row // M
  mask_q = mask_r & (row % M == M - 1)
  tok_v = tok * (HV * V) + i_hv * V
  o_k = i_k * BK + tl.arange(0, BK)
  mask_k = o_k < K
  b_dqi = tl.zeros([BT, BK], dtype=tl.float32)
  b_dp = tl.zeros([BT, BT], dtype=tl.float32)
  b_dks = tl.zeros([BT, BK], dtype=tl.float32)
  b_xs = tl.zeros([BT, BK], dtype=tl.float32)
  b_sds = tl.zeros([BK, BK], dtype=tl.float32)
  for i_v in range(tl.cdiv(V, BV)):
    o_v = i_v * BV + tl.arange(0, BV)
    mask_v = o_v < V
    m_rv = mask_r[:, None] & mask_v[None, :]
    m_kv = mask_k[:, None] & mask_v[None, :]
    b_do = tl.load(do + tok_v[:, None] + o_v[None, :], mask=mask_q[:, None] & mask_v[None, :],
                   other=0.).to(dt)
    b_vn = tl.load(v_new + row_v[:, None] + o_v[None, :], mask=m_rv, other=0.).to(dt)
    b_x = tl.load(dx + row_v[:, None] + o_v[None, :], mask=m_rv, other=0.).to(dt)
    b_h = tl.load(p_h + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.).to(dt)    # S
    b_dh = tl.load(p_dh + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.).to(dt)  # dS
    b_ht = tl.trans(b_h)
    b_dqi += tl.dot(b_do, b_ht, input_precision=DOT_PRECISION)
    b_dp += tl.dot(b_do, tl.trans(b_vn), input_precision=DOT_PRECISION)
    b_dks += tl.dot(b_vn, tl.trans(b_dh), input_precision=DOT_PRECISION)
    b_xs += tl.dot(b_x, b_ht, input_precision=DOT_PRECISION)
    if USE_G:
      b_sds += tl.dot(b_dh, b_ht, input_precision=DOT_PRECISION)
  b_dp, b_gam, b_kdec, b_g_last = _decayed_dp(b_dp, g_cum, row0, n, i_hv, HV, BT, USE_G)
  # dP^T through memory: the transpose of a dot result fed to another dot is miscompiled on
  # Hopper by Triton 3.4 to 3.7.0 (FLA #640). The barrier makes this program's stores visible
  # to all its threads before they read the transpose. Rows past n are not stored; the columns
  # past n are zeros, and the transposed load reads only stored rows.
  b_dp = b_dp.to(dt)
  p_s = dp_scratch + ((row0 * HV + i_hv) * NK + i_k) * BT
  tl.store(p_s + o_a[:, None] * (HV * NK * BT) + o_a[None, :],
           b_dp.to(dp_scratch.dtype.element_ty), mask=mask_r[:, None])
  tl.debug_barrier()
  b_dpt = tl.load(p_s + o_a[None, :] * (HV * NK * BT) + o_a[:, None], mask=mask_r[None, :],
                  other=0.).to(dt)
  o_kk = tl.arange(0, BK)
  b_sds = tl.sum(tl.sum(tl.where(o_kk[:, None] == o_kk[None, :], b_sds, 0.), 1), 0)
  _store_k_block(q, k, beta, dq, dk, db, dg, b_dp, b_dpt, b_dqi, b_dks, b_xs, b_sds, b_gam,
                 b_kdec, b_g_last, scale, row0, n, tok, mask_q, i_h, i_hv, i_k,
                 H, HV, K, BT, BK, NK, USE_G, DOT_PRECISION)


@triton.jit
def _decayed_dp(b_dp, g_cum, row0, n, i_hv, HV: tl.constexpr, BT: tl.constexpr,
                USE_G: tl.constexpr):
  """dP with the decay and the causal masks applied, the query row factors Gamma = 2^G, the
  key row factors 2^(g_C - G) and g_C (0. without USE_G)."""
  o_a = tl.arange(0, BT)
  mask_r = o_a < n
  m_inc = (o_a[:, None] >= o_a[None, :]) & mask_r[:, None] & mask_r[None, :]
  if USE_G:
    b_g = tl.load(g_cum + (row0 + o_a) * HV + i_hv, mask=mask_r, other=0.)
    b_g_last = tl.load(g_cum + (row0 + n - 1) * HV + i_hv)
    # Selects: off the causal side the exponent is positive and may overflow to inf.
    b_dp = tl.where(m_inc, b_dp * tl.exp2(b_g[:, None] - b_g[None, :]), 0.)
    b_gam = tl.where(mask_r, tl.exp2(b_g), 0.)
    b_kdec = tl.where(mask_r, tl.exp2(b_g_last - b_g), 0.)
  else:
    b_g_last = 0.
    b_dp = tl.where(m_inc, b_dp, 0.)
    b_gam = tl.where(mask_r, 1., 0.)
    b_kdec = b_gam
  return b_dp, b_gam, b_kdec, b_g_last


@triton.jit
def _store_k_block(q, k, beta, dq, dk, db, dg, b_dp, b_dpt, b_dqi, b_dks, b_xs, b_sds, b_gam,
                   b_kdec, b_g_last, scale, row0, n, tok, mask_q, i_h, i_hv, i_k,
                   H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                   BK: tl.constexpr, NK: tl.constexpr, USE_G: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
  """dq~, dk, dbeta's and dG's parts of K block i_k from the products accumulated over V
  (b_xs = X S^T = -dKb)."""
  dt = k.dtype.element_ty
  o_a = tl.arange(0, BT)
  mask_r = o_a < n
  o_k = i_k * BK + tl.arange(0, BK)
  mask_k = o_k < K
  m_rk = mask_r[:, None] & mask_k[None, :]
  b_q = tl.load(q + tok[:, None] * (H * K) + i_h * K + o_k[None, :],
                mask=mask_q[:, None] & mask_k[None, :], other=0.)
  b_k = tl.load(k + (row0 + o_a[:, None]) * (H * K) + i_h * K + o_k[None, :], mask=m_rk,
                other=0.)
  b_dq = scale * (tl.dot(b_dp.to(dt), b_k, input_precision=DOT_PRECISION)
                  + b_dqi * b_gam[:, None])
  b_dks = b_dks * b_kdec[:, None]
  b_dk = scale * tl.dot(b_dpt.to(dt), b_q, input_precision=DOT_PRECISION) + b_dks

  b_kf = b_k.to(tl.float32)
  b_bg = tl.load(beta + (row0 + o_a) * HV + i_hv, mask=mask_r, other=0.) * b_gam
  b_kx = tl.sum(b_kf * b_xs, 1)   # -<k, dKb>
  tl.store(db + ((row0 + o_a) * HV + i_hv) * NK + i_k, -b_gam * b_kx, mask=mask_r)
  if USE_G:
    b_qf = b_q.to(tl.float32)
    b_dg = tl.sum(b_qf * b_dq, 1) - tl.sum(b_kf * b_dk, 1) - b_bg * b_kx
    b_last = tl.sum(tl.sum(b_kf * b_dks, 1), 0) + tl.exp2(b_g_last) * b_sds
    b_dg = tl.where(o_a == n - 1, b_dg + b_last, b_dg)
    tl.store(dg + ((row0 + o_a) * HV + i_hv) * NK + i_k, b_dg, mask=mask_r)
  tl.store(dk + (row0 + o_a[:, None]) * (HV * K) + i_hv * K + o_k[None, :],
           b_dk - b_xs * b_bg[:, None], mask=m_rk)
  # dq~ stored after the dG reductions that read it rather than before them: 252 registers and
  # no spill at sm_90 against 254 and 56 B (bf16, K = V = 128; 254 and none against 255 and
  # 120 B at BK 128, 8 warps).
  tl.store(dq + tok[:, None] * (HV * K) + i_hv * K + o_k[None, :], b_dq,
           mask=mask_q[:, None] & mask_k[None, :])
