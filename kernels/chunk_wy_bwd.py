"""Backward of stages 2 to 4 (A, the inverse, w and u) per expanded chunk (docs/algorithm.md
§13.1), and the decay cotangent's reverse cumulative sum.

With T = (I + A)^-1, Kb = diag(beta Gamma) K, Vb = diag(beta) V, W = T Kb, U = T Vb,
V' = U - W S and A[a, b] = beta_a <k_a, k_b> 2^(G_a - G_b) (a > b, both valid), given
X = T^T dV' (chunk_h_bwd, the cotangent of Vb) and the Kb part (chunk_o_bwd: dKb = -X S^T
already added to dk_in, Gamma <dKb, k> to db_in and beta Gamma <dKb, k> to dg_in):

    dv = diag(beta) X,   dbeta += <X, v>
    dA = -T^T (dU Vb^T + dW Kb^T) T^T = -(X U^T + dKb W^T) = -X (U - W S)^T = -X V'^T
         on the strictly lower valid part
        ->  dk += (dA . beta_a Dec) K + (dA . beta_a Dec)^T K,  dbeta_a += sum_b dA <k_a, k_b> Dec,
            dG_a += sum_b (dA . A)[a, b] - sum_b (dA . A)[b, a]

so T itself is not read: X and V' carry it (the inverse applied by chunk_h_bwd on the way).

The transpose of dA . beta Dec goes through memory rather than through tl.trans: a tl.trans of
a dot result fed to another dot is miscompiled on Hopper by Triton 3.4 to 3.7.0 (FLA #640).
Other transposed operands are transposes of loaded tiles. The products take input-dtype operands
with float32 accumulation.

The per-row dbeta and dG parts of chunk_o_bwd (one column per K block) are added, and the
chunk's reverse cumulative sum turns dG (the cotangent of the chunk-local cumulative decays)
into the cotangent of each row's own log decay.

With FINISH_DK (HV == H: no value heads to sum) the program owns whole rows of the key
gradient, so it finishes dk itself instead of leaving rows per value head for qk_bwd: with
USE_L2NORM the norm's backward dx = r (dy - y <y, dy>), y = x r (x the raw key row, r its row
factor from the forward), then the cast to the gradient's dtype. <y, dy> needs the whole row
before any of it is stored; it comes without forming dy, from sums the products already give
(the row and column sums of (dA . beta Dec) . K K^T) and one loop of loads for <y, dk_in>, with
k (y rounded to the input dtype) in place of y in the other terms.

With ZERO_TAIL (packed inputs) program i_d also writes zeros over the i_d-th block of BT rows at
or past cu_seqlens[N] * M in dv, dbeta, dg and (with FINISH_DK) dk: those rows belong to no
sequence, and the descriptors (at least ceil(T*M / BT) of them) outnumber their blocks.

Grid: (expanded-chunk descriptors, HV). Parameter order: inputs, outputs, constexprs.
"""
import triton
import triton.language as tl

from ._common import chunk_span


@triton.jit
def chunk_wy_bwd_kernel(
    # inputs
    k,           # [T*M, H, K] (normalised) keys, input dtype
    v,           # [T*M, HV, V] values, input dtype
    v_new,       # [T*M, HV, V] V' of the recomputed forward scan, input dtype
    beta,        # [T*M, HV] float32
    g_cum,       # [T*M, HV] float32 Gx; a placeholder when USE_G is False
    dx,          # [T*M, HV, V] X = T^T dV' from chunk_h_bwd, input dtype
    dk_in,       # [T*M, HV, K] from chunk_o_bwd, float32 or input dtype (BwdConfig.partials)
    db_in,       # [T*M, HV, NK] float32 from chunk_o_bwd
    dg_in,       # [T*M, HV, NK] float32 from chunk_o_bwd; a placeholder when USE_G is False
    x,           # [T*M, H, K] raw keys; a placeholder unless FINISH_DK and USE_L2NORM
    rk,          # [T*M, H] float32 key row factors; a placeholder unless FINISH_DK and USE_L2NORM
    cu_seqlens,  # [N+1] int32 token-stream sequence starts
    chunk_desc,  # [NXD, 2] int32 (sequence, expanded chunk within it); sequence -1 = padding
    N,           # sequences
    R,           # rows of the expanded stream, T*M
    # outputs
    dk,          # [T*M, HV, K] per value head, float32 or input dtype (BwdConfig.partials);
                 # with FINISH_DK the key gradient in its dtype
    dv,          # [T*M, HV, V] in the dtype of v's cotangent (the last use: no float32 copy)
    dbeta,       # [T*M, HV] float32
    dg,          # [T*M, HV] float32 cotangent of each row's log decay; unwritten without USE_G
    dA_scratch,  # [T*M, HV, BT] (dA . beta Dec) in the input dtype (read only as a dot operand),
                 # written and read back transposed
    # sizes
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    M: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    NK: tl.constexpr,
    # flags
    USE_G: tl.constexpr,
    FINISH_DK: tl.constexpr,   # HV == H: dk finished here (norm backward, cast)
    USE_L2NORM: tl.constexpr,
    ZERO_TAIL: tl.constexpr,   # packed: zero the rows past cu_seqlens[N] * M
    DOT_PRECISION: tl.constexpr,
):
  i_d, i_hv = tl.program_id(0), tl.program_id(1)
  i_h = i_hv // (HV // H)
  o_a = tl.arange(0, BT)
  if ZERO_TAIL:
    _zero_tail_block(dk, dv, dbeta, dg, cu_seqlens, N, R, i_d, i_hv, o_a, HV, K, V, M, BT, BK,
                     BV, USE_G, FINISH_DK)
  i_n, row0, n = chunk_span(chunk_desc, cu_seqlens, i_d, M, BT)
  if i_n < 0:
    return
  dt = k.dtype.element_ty
  mask_r = o_a < n
  row = row0 + o_a
  m_rr = mask_r[:, None] & mask_r[None, :]
  b_beta = tl.load(beta + row * HV + i_hv, mask=mask_r, other=0.)
  if USE_G:
    b_g = tl.load(g_cum + row * HV + i_hv, mask=mask_r, other=0.)

  # dv and <X, v> in a loop of their own: a loaded tile that feeds both a pipelined dot and a
  # register reduction is the pattern of docs/algorithm.md §4.2; the dot's loop reads X again.
  b_db = tl.zeros([BT], dtype=tl.float32)
  p_vv = row0 * (HV * V) + i_hv * V
  for i_v in range(tl.cdiv(V, BV)):
    o_v = i_v * BV + tl.arange(0, BV)
    m_rv = mask_r[:, None] & (o_v < V)[None, :]
    p_rv = p_vv + o_a[:, None] * (HV * V) + o_v[None, :]
    b_x = tl.load(dx + p_rv, mask=m_rv, other=0.).to(tl.float32)
    b_db += tl.sum(b_x * tl.load(v + p_rv, mask=m_rv, other=0.).to(tl.float32), 1)
    tl.store(dv + p_rv, (b_x * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_rv)
  b_xv = tl.zeros([BT, BT], dtype=tl.float32)
  for i_v in range(tl.cdiv(V, BV)):
    o_v = i_v * BV + tl.arange(0, BV)
    m_rv = mask_r[:, None] & (o_v < V)[None, :]
    b_x = tl.load(dx + p_vv + o_a[:, None] * (HV * V) + o_v[None, :], mask=m_rv,
                  other=0.).to(dt)
    b_vnt = tl.load(v_new + p_vv + o_a[None, :] * (HV * V) + o_v[:, None],
                    mask=(o_v < V)[:, None] & mask_r[None, :], other=0.).to(dt)
    b_xv += tl.dot(b_x, b_vnt, input_precision=DOT_PRECISION)

  b_kk = tl.zeros([BT, BT], dtype=tl.float32)
  o_kr = row0 * (H * K) + i_h * K   # the chunk's first key row
  p_k = k + o_kr
  p_kv = row0 * (HV * K) + i_hv * K
  for i_k in range(tl.cdiv(K, BK)):
    o_k = i_k * BK + tl.arange(0, BK)
    m_rk = mask_r[:, None] & (o_k < K)[None, :]
    m_kr = (o_k < K)[:, None] & mask_r[None, :]
    b_k = tl.load(p_k + o_a[:, None] * (H * K) + o_k[None, :], mask=m_rk, other=0.)
    # K^T from a second, transposed load: with tl.trans(b_k) here, dG differed between two
    # identical bf16 runs on the H200 (Triton 3.6) while dq, dk and dv did not, which points at
    # K K^T, the one product that reaches only dbeta and dG (docs/algorithm.md §4.2).
    b_kt = tl.load(p_k + o_a[None, :] * (H * K) + o_k[:, None], mask=m_kr, other=0.)
    b_kk += tl.dot(b_k, b_kt, input_precision=DOT_PRECISION)

  # dA = -X V'^T on the strictly lower valid part.
  m_lo = (o_a[:, None] > o_a[None, :]) & m_rr
  if USE_G:
    # A select: above the diagonal the exponent may overflow to inf.
    b_dA = tl.where(m_lo, -b_xv * tl.exp2(b_g[:, None] - b_g[None, :]), 0.)   # dA . Dec
  else:
    b_dA = tl.where(m_lo, -b_xv, 0.)
  b_db += tl.sum(b_dA * b_kk, 1)
  b_dAm = b_dA * b_beta[:, None]
  if USE_G or (FINISH_DK and USE_L2NORM):
    b_dGa = b_dAm * b_kk       # dA . A: dG_a += its row sum - its column sum
  # dbeta and dG are complete here: stored before the dk loops, which need none of their
  # vectors (column sums: 16 registers each).
  for i_k in tl.static_range(NK):
    b_db += tl.load(db_in + (row * HV + i_hv) * NK + i_k, mask=mask_r, other=0.)
  tl.store(dbeta + row * HV + i_hv, b_db, mask=mask_r)
  if USE_G:
    b_dgr = tl.sum(b_dGa, 1) - tl.sum(b_dGa, 0)
    for i_k in tl.static_range(NK):
      b_dgr += tl.load(dg_in + (row * HV + i_hv) * NK + i_k, mask=mask_r, other=0.)
    b_dgr = tl.where(mask_r, b_dgr, 0.)
    tl.store(dg + row * HV + i_hv, tl.cumsum(b_dgr, 0, reverse=True), mask=mask_r)

  # (dA . beta Dec)^T K goes through memory: the transpose of a dot result fed to another dot
  # is miscompiled on Hopper by Triton 3.4 to 3.7.0 (FLA #640). The barrier makes this
  # program's stores visible to all its threads before they read the transpose.
  p_s = dA_scratch + row0 * (HV * BT) + i_hv * BT
  tl.store(p_s + o_a[:, None] * (HV * BT) + o_a[None, :], b_dAm.to(dA_scratch.dtype.element_ty),
           mask=mask_r[:, None])
  tl.debug_barrier()
  b_dAmt = tl.load(p_s + o_a[None, :] * (HV * BT) + o_a[:, None], mask=mask_r[None, :],
                   other=0.)

  if FINISH_DK and USE_L2NORM and K <= 2 * BK:
    # Whole rows of dk fit in registers (two [BT, BK] float32 tiles): dk is formed once, <y, dy>
    # taken from it, and dk_in and the raw keys are read once, not twice as below.
    b_r = tl.load(rk + row * H + i_h, mask=mask_r, other=0.)
    o_k = tl.arange(0, BK)
    m_rk = mask_r[:, None] & (o_k < K)[None, :]
    b_dk1 = _dk_block(p_k, dk_in, p_kv, b_dAm, b_dAmt, o_a, o_k, m_rk, H, HV, K, DOT_PRECISION)
    b_x1 = tl.load(x + o_kr + o_a[:, None] * (H * K) + o_k[None, :], mask=m_rk, other=0.)
    b_yd = tl.sum(b_dk1 * b_x1.to(tl.float32), 1)
    if K > BK:
      o_k2 = BK + o_k
      m_rk2 = mask_r[:, None] & (o_k2 < K)[None, :]
      b_dk2 = _dk_block(p_k, dk_in, p_kv, b_dAm, b_dAmt, o_a, o_k2, m_rk2, H, HV, K,
                        DOT_PRECISION)
      b_x2 = tl.load(x + o_kr + o_a[:, None] * (H * K) + o_k2[None, :], mask=m_rk2, other=0.)
      b_yd += tl.sum(b_dk2 * b_x2.to(tl.float32), 1)
    b_yd = b_yd * b_r   # <y, dy>, y = x r
    b_rr = b_r * b_r
    tl.store(dk + p_kv + o_a[:, None] * (HV * K) + o_k[None, :],
             (b_r[:, None] * b_dk1 - b_x1.to(tl.float32) * (b_rr * b_yd)[:, None]).to(
                 dk.dtype.element_ty), mask=m_rk)
    if K > BK:
      tl.store(dk + p_kv + o_a[:, None] * (HV * K) + o_k2[None, :],
               (b_r[:, None] * b_dk2 - b_x2.to(tl.float32) * (b_rr * b_yd)[:, None]).to(
                   dk.dtype.element_ty), mask=m_rk2)
  else:
    if FINISH_DK and USE_L2NORM:
      # <y, dy> per row without forming dy = dk_in + (dA . beta Dec) K + (dA . beta Dec)^T K:
      # with y taken as k (y rounded to the input dtype) in the last two terms, they are the row
      # and the column sums of (dA . beta Dec) . K K^T (K K^T symmetric). Only <y, dk_in> needs a
      # loop, of loads and no products. The rounding of y to k moves <y, dy> by about the input
      # dtype's epsilon relative, as the rounding of dA . beta Dec in the products already did.
      b_r = tl.load(rk + row * H + i_h, mask=mask_r, other=0.)
      b_yd = tl.sum(b_dGa, 1) + tl.sum(b_dGa, 0)
      for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_rk = mask_r[:, None] & (o_k < K)[None, :]
        b_y = tl.load(x + o_kr + o_a[:, None] * (H * K) + o_k[None, :], mask=m_rk,
                      other=0.).to(tl.float32) * b_r[:, None]
        b_dki = tl.load(dk_in + p_kv + o_a[:, None] * (HV * K) + o_k[None, :], mask=m_rk,
                        other=0.).to(tl.float32)
        b_yd += tl.sum(b_dki * b_y, 1)
    for i_k in range(tl.cdiv(K, BK)):
      o_k = i_k * BK + tl.arange(0, BK)
      m_rk = mask_r[:, None] & (o_k < K)[None, :]
      b_dk = _dk_block(p_k, dk_in, p_kv, b_dAm, b_dAmt, o_a, o_k, m_rk, H, HV, K, DOT_PRECISION)
      if FINISH_DK and USE_L2NORM:
        b_y = tl.load(x + o_kr + o_a[:, None] * (H * K) + o_k[None, :], mask=m_rk,
                      other=0.).to(tl.float32) * b_r[:, None]
        b_dk = b_r[:, None] * (b_dk - b_y * b_yd[:, None])
      tl.store(dk + p_kv + o_a[:, None] * (HV * K) + o_k[None, :], b_dk.to(dk.dtype.element_ty),
               mask=m_rk)


@triton.jit
def _dk_block(p_k, dk_in, p_kv, b_dAm, b_dAmt, o_a, o_k, m_rk, H: tl.constexpr, HV: tl.constexpr,
              K: tl.constexpr, DOT_PRECISION: tl.constexpr):
  """dk of the chunk's rows on columns o_k, float32: dk_in + (dA . beta Dec) K
  + (dA . beta Dec)^T K."""
  b_k = tl.load(p_k + o_a[:, None] * (H * K) + o_k[None, :], mask=m_rk, other=0.)
  dt = b_k.dtype
  b_dk = tl.load(dk_in + p_kv + o_a[:, None] * (HV * K) + o_k[None, :], mask=m_rk,
                 other=0.).to(tl.float32)
  b_dk += tl.dot(b_dAm.to(dt), b_k, input_precision=DOT_PRECISION)
  b_dk += tl.dot(b_dAmt.to(dt), b_k, input_precision=DOT_PRECISION)
  return b_dk


@triton.jit
def _zero_tail_block(dk, dv, dbeta, dg, cu_seqlens, N, R, i_d, i_hv, o_a, HV: tl.constexpr,
                     K: tl.constexpr, V: tl.constexpr, M: tl.constexpr, BT: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr,
                     FINISH_DK: tl.constexpr):
  """Zeros over value head i_hv of block i_d of the rows at or past cu_seqlens[N] * M."""
  row = tl.load(cu_seqlens + N).to(tl.int64) * M + i_d * BT + o_a
  mask_r = row < R
  zero = tl.zeros([BT], dtype=tl.float32)
  tl.store(dbeta + row * HV + i_hv, zero, mask=mask_r)
  if USE_G:
    tl.store(dg + row * HV + i_hv, zero, mask=mask_r)
  for i_v in range(tl.cdiv(V, BV)):
    o_v = i_v * BV + tl.arange(0, BV)
    tl.store(dv + row[:, None] * (HV * V) + i_hv * V + o_v[None, :],
             tl.zeros([BT, BV], dtype=dv.dtype.element_ty),
             mask=mask_r[:, None] & (o_v < V)[None, :])
  if FINISH_DK:
    for i_k in range(tl.cdiv(K, BK)):
      o_k = i_k * BK + tl.arange(0, BK)
      tl.store(dk + row[:, None] * (HV * K) + i_hv * K + o_k[None, :],
               tl.zeros([BT, BK], dtype=dk.dtype.element_ty),
               mask=mask_r[:, None] & (o_k < K)[None, :])
