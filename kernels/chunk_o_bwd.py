"""Backward of the output and of the state update, per expanded chunk (docs/algorithm.md §13.1).

On the expanded stream (q~, do~ on each token's last copy, read from the token stream as in
chunk_h_bwd), for expanded chunk e with S the state entering it, dS the cotangent of the state
leaving it (chunk_h_bwd's dh), X = T^T dV' from chunk_h_bwd, V' = v_new, Kb = diag(beta Gamma) K,
and Dec[a, b] = 2^(G_a - G_b) for a >= b (both valid):

    dP^T = (V' do~^T) . Dec^T . scale               [BT, BQ]: key rows, query columns
    dq~^T = K^T dP^T + scale S do~^T diag(Gamma)
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

The queries are the chunk's BQ query rows (_common.query_rows: BT / M whole tokens where M
divides BT), so dq~ and dP have BQ rows, not BT rows of which M - 1 in M are zero. dP is formed
transposed, as V' do~^T, where it is the left operand of dk's product and the right operand of
dq~^T's, so it is never transposed: Triton 3.4 to 3.7.0 miscompiles on Hopper a tl.trans of a
dot result fed to another dot (FLA #640). A loaded tile that feeds both a dot and a register
reduction in one pipelined loop is avoided too (docs/algorithm.md §4.2), so <S, dS> is summed in
a second V loop that loads S and dS again. Transposed operands are transposes of
loaded tiles.

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

from ._common import chunk_span, query_block, query_rows


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
    dq,          # [T, HV, K] cotangent of q per value head, float32 or input dtype
    dk,          # [T*M, HV, K] (output, state-update and Kb parts), float32 or input dtype
    db,          # [T*M, HV, NK] float32 dbeta's part Gamma <dKb, k> per K block
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
  BQ: tl.constexpr = query_block(M, BT)
  o_a = tl.arange(0, BT)
  mask_r = o_a < n
  r_q, mask_q, tok = query_rows(row0, n, M, BT, BQ)
  p_h = h + (i_d.to(tl.int64) * HV + i_hv) * (K * V)
  p_dh = dh + (i_d.to(tl.int64) * HV + i_hv) * (K * V)
  row_v = (row0 + o_a) * (HV * V) + i_hv * V
  tok_v = tok * (HV * V) + i_hv * V
  o_k = i_k * BK + tl.arange(0, BK)
  mask_k = o_k < K
  b_dqi = tl.zeros([BK, BQ], dtype=tl.float32)   # S do~^T
  b_dpt = tl.zeros([BT, BQ], dtype=tl.float32)   # V' do~^T: dP^T before the decay
  b_dks = tl.zeros([BT, BK], dtype=tl.float32)
  b_xs = tl.zeros([BT, BK], dtype=tl.float32)
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
    b_dot = tl.trans(b_do)
    b_dqi += tl.dot(b_h, b_dot, input_precision=DOT_PRECISION)
    b_dpt += tl.dot(b_vn, b_dot, input_precision=DOT_PRECISION)
    b_dks += tl.dot(b_vn, tl.trans(b_dh), input_precision=DOT_PRECISION)
    b_xs += tl.dot(b_x, b_ht, input_precision=DOT_PRECISION)
  b_dpt, b_gam, b_gam_q, b_kdec, b_g_last = _decayed_dpt(b_dpt, g_cum, row0, n, r_q, mask_q,
                                                         i_hv, HV, BT, BQ, USE_G)
  # <S, dS> (dG's last row only) in a V loop of its own: the tiles, just read above, come from
  # L2 and feed only this sum. As the trace of a [BK, BK] product in the loop above it took
  # 17 to 19 us more of the kernel's 370 (docs/performance.md, Training).
  b_acc = tl.zeros([BK, BV], dtype=tl.float32)
  if USE_G:
    for i_v in range(tl.cdiv(V, BV)):
      o_v = i_v * BV + tl.arange(0, BV)
      m_kv = mask_k[:, None] & (o_v < V)[None, :]
      b_acc += (tl.load(p_h + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.).to(dt)
                .to(tl.float32)
                * tl.load(p_dh + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.).to(dt)
                .to(tl.float32))
  b_sds = tl.sum(tl.sum(b_acc, 1), 0)
  _store_k_block(q, k, beta, dq, dk, db, dg, b_dpt.to(dt), b_dqi, b_dks, b_xs, b_sds, b_gam,
                 b_gam_q, b_kdec, b_g_last, scale, row0, n, tok, r_q, mask_q, i_h, i_hv, i_k,
                 H, HV, K, BT, BK, BQ, NK, USE_G, DOT_PRECISION)


@triton.jit
def _decayed_dpt(b_dpt, g_cum, row0, n, r_q, mask_q, i_hv, HV: tl.constexpr, BT: tl.constexpr,
                 BQ: tl.constexpr, USE_G: tl.constexpr):
  """dP^T (key rows b, query columns j) with the decay and the causal masks applied, the row
  factors Gamma = 2^G, the query factors Gamma at the query rows, the key row factors
  2^(g_C - G) and g_C (0. without USE_G)."""
  o_a = tl.arange(0, BT)
  mask_r = o_a < n
  m_inc = (r_q[None, :] >= o_a[:, None]) & mask_r[:, None] & mask_q[None, :]
  if USE_G:
    b_g = tl.load(g_cum + (row0 + o_a) * HV + i_hv, mask=mask_r, other=0.)
    b_g_last = tl.load(g_cum + (row0 + n - 1) * HV + i_hv)
    b_gq = b_g
    if BQ < BT:
      b_gq = tl.load(g_cum + (row0 + r_q) * HV + i_hv, mask=mask_q, other=0.)
    # Selects: off the causal side the exponent is positive and may overflow to inf.
    b_dpt = tl.where(m_inc, b_dpt * tl.exp2(b_gq[None, :] - b_g[:, None]), 0.)
    b_gam = tl.where(mask_r, tl.exp2(b_g), 0.)
    b_gam_q = tl.where(mask_q, tl.exp2(b_gq), 0.)
    b_kdec = tl.where(mask_r, tl.exp2(b_g_last - b_g), 0.)
  else:
    b_g_last = 0.
    b_dpt = tl.where(m_inc, b_dpt, 0.)
    b_gam = tl.where(mask_r, 1., 0.)
    b_gam_q = tl.where(mask_q, 1., 0.)
    b_kdec = b_gam
  return b_dpt, b_gam, b_gam_q, b_kdec, b_g_last


@triton.jit
def _store_k_block(q, k, beta, dq, dk, db, dg, b_dpt, b_dqi, b_dks, b_xs, b_sds, b_gam,
                   b_gam_q, b_kdec, b_g_last, scale, row0, n, tok, r_q, mask_q, i_h, i_hv, i_k,
                   H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                   BK: tl.constexpr, BQ: tl.constexpr, NK: tl.constexpr,
                   USE_G: tl.constexpr, DOT_PRECISION: tl.constexpr):
  """dq~, dk, dbeta's and dG's parts of K block i_k from the products accumulated over V
  (b_xs = X S^T = -dKb; b_dpt the decayed dP^T in the input dtype)."""
  o_a = tl.arange(0, BT)
  mask_r = o_a < n
  o_k = i_k * BK + tl.arange(0, BK)
  mask_k = o_k < K
  m_rk = mask_r[:, None] & mask_k[None, :]
  b_q = tl.load(q + tok[:, None] * (H * K) + i_h * K + o_k[None, :],
                mask=mask_q[:, None] & mask_k[None, :], other=0.)
  b_k = tl.load(k + (row0 + o_a[:, None]) * (H * K) + i_h * K + o_k[None, :], mask=m_rk,
                other=0.)
  # dq~^T = scale (K^T dP^T + S do~^T diag(Gamma_q)): dP^T as the right operand, untransposed.
  b_dqt = scale * (tl.dot(tl.trans(b_k), b_dpt, input_precision=DOT_PRECISION)
                   + b_dqi * b_gam_q[None, :])
  b_dks = b_dks * b_kdec[:, None]
  b_dk = scale * tl.dot(b_dpt, b_q, input_precision=DOT_PRECISION) + b_dks

  b_kf = b_k.to(tl.float32)
  b_bg = tl.load(beta + (row0 + o_a) * HV + i_hv, mask=mask_r, other=0.) * b_gam
  b_kx = tl.sum(b_kf * b_xs, 1)   # -<k, dKb>
  tl.store(db + ((row0 + o_a) * HV + i_hv) * NK + i_k, -b_gam * b_kx, mask=mask_r)
  if USE_G:
    b_qd = tl.sum(tl.trans(b_q).to(tl.float32) * b_dqt, 0)   # <q~_j, dq~_j>
    if BQ < BT:
      # onto the query rows j M + M - 1 of the chunk
      b_qd = tl.sum(tl.where(o_a[:, None] == r_q[None, :], b_qd[None, :], 0.), 1)
    b_dg = b_qd - tl.sum(b_kf * b_dk, 1) - b_bg * b_kx
    b_last = tl.sum(tl.sum(b_kf * b_dks, 1), 0) + tl.exp2(b_g_last) * b_sds
    b_dg = tl.where(o_a == n - 1, b_dg + b_last, b_dg)
    tl.store(dg + ((row0 + o_a) * HV + i_hv) * NK + i_k, b_dg, mask=mask_r)
  tl.store(dk + (row0 + o_a[:, None]) * (HV * K) + i_hv * K + o_k[None, :],
           (b_dk - b_xs * b_bg[:, None]).to(dk.dtype.element_ty), mask=m_rk)
  tl.store(dq + tok[None, :] * (HV * K) + i_hv * K + o_k[:, None],
           b_dqt.to(dq.dtype.element_ty), mask=mask_k[:, None] & mask_q[None, :])
