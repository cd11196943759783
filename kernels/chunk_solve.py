"""Stage 3 of the chunked prefill: Ai = (I + A)^-1 for each 64x64 expanded-chunk block of A.

I + A is unit lower triangular, and so is its inverse X. Both are split into a 4x4 grid of
16x16 blocks (ALGORITHM.md §4.5):

1. Diagonal blocks by forward substitution (vector work): X_pp = I + L_p with L_p strictly
   lower; starting from L_p = -strict_lower(A_pp), row i becomes a_i + a_i @ L_p for
   i = 2..15, where a_i is row i of the start value (rows < i are final by then). a_i is read
   again from A (an L1 hit) rather than picked out of the register tile, which would take a
   second cross-thread reduction per row. The four blocks are independent and advance
   together (four dependency chains in flight); the loop stops at the chunk's valid rows.
2. Off-diagonal blocks column by column, each column top down (ALGORITHM.md lists them by
   distance from the diagonal; any order in which every X_mq is final before it is used takes
   the same products, and this one keeps fewer tiles live, see below):
   X_pq = -X_pp @ sum_{m=q}^{p-1} A_pm @ X_mq, with float32 operands at DOT_PRECISION: "ieee"
   (exact float32 products, on the CUDA cores) or, for 16-bit outputs, "tf32x3" (three TF32
   tensor-core products, float32-level accuracy) or "tf32" (one, about 1e-3 per product).
3. All 16 blocks are stored in the output dtype (round to nearest even), the six above the
   diagonal as explicit zeros, because an output buffer under JAX is not zero-filled.

Rows of A past the sequence end are loaded as zeros, which makes those rows of X identity rows
(finite); they are not stored, since they belong to the next sequence.

chunk_kkt_solve_fwd_kernel (optional, `_PrefillConfig.fuse_kkt_solve`, off until timed) runs
stages 2 and 3 in one program: it stores Gx and the key row factors as chunk_kkt does, writes A
block by block (16x16 Gram blocks, scaled in chunk_kkt's order), and inverts it after a barrier,
reading A back while it is still in L1/L2. One warp, as the solve needs: a [64, 64] float32
Gram tile would not fit its registers, 16x16 blocks do, made one at a time by a runtime loop
(unrolled, the ten blocks held 152 to 255 registers; looped, the kernel takes the solve's 128
at K=128, 142 at K=256).
The hope (benchmarks/NOTES.md, session 6): chunk_kkt's tensor-core work fills the issue slots
the latency-bound solve leaves idle, and A's read from HBM and one launch go.

Grid: (number of expanded-chunk descriptors, HV). Program (i_d, i_hv) owns the 64x64 block of
descriptor i_d and value head i_hv; a padding descriptor (sequence -1) returns at once.

Parameter order: inputs, outputs, constexprs.
"""
import triton
import triton.language as tl

from ._common import chunk_decays, chunk_span


@triton.jit
def _load_block(p_A, i_p, i_q, n, STRIDE: tl.constexpr):
  """Block (i_p, i_q) of a 64x64 chunk, 16x16 float32, rows at or past n read as zeros."""
  o_i = tl.arange(0, 16)
  o_r = i_p * 16 + o_i
  p = p_A + o_r[:, None] * STRIDE + i_q * 16 + o_i[None, :]
  return tl.load(p, mask=(o_r < n)[:, None], other=0.).to(tl.float32)


@triton.jit
def _store_block(p_Ai, b_X, i_p, i_q, n, STRIDE: tl.constexpr):
  o_i = tl.arange(0, 16)
  o_r = i_p * 16 + o_i
  p = p_Ai + o_r[:, None] * STRIDE + i_q * 16 + o_i[None, :]
  tl.store(p, b_X.to(p_Ai.dtype.element_ty), mask=(o_r < n)[:, None])


@triton.jit
def _substitute_row(b_L, p_A, i_p, i, o_i, n, STRIDE: tl.constexpr):
  """Row i of block p's L becomes a_i + a_i @ L, a_i = -(row i of A_pp, strictly lower part);
  a row at or past n stays zero."""
  r = i_p * 16 + i
  b_a = -tl.load(p_A + r * STRIDE + i_p * 16 + o_i, mask=o_i < tl.where(r < n, i, 0), other=0.)
  b_a = b_a.to(tl.float32)
  b_a = b_a + tl.sum(b_a[:, None] * b_L, 0)
  return tl.where((o_i == i)[:, None], b_a[None, :], b_L)


@triton.jit
def _mm(a, b, DOT_PRECISION: tl.constexpr):
  return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _invert(p_A, p_Ai, n, STRIDE: tl.constexpr, P: tl.constexpr):
  """Steps 1 to 3 for the chunk whose A rows start at p_A and Ai rows at p_Ai (STRIDE apart)."""
  o_i = tl.arange(0, 16)
  m_strict = o_i[:, None] > o_i[None, :]
  m_diag = o_i[:, None] == o_i[None, :]

  b_L0 = -tl.where(m_strict, _load_block(p_A, 0, 0, n, STRIDE), 0.)
  b_L1 = -tl.where(m_strict, _load_block(p_A, 1, 1, n, STRIDE), 0.)
  b_L2 = -tl.where(m_strict, _load_block(p_A, 2, 2, n, STRIDE), 0.)
  b_L3 = -tl.where(m_strict, _load_block(p_A, 3, 3, n, STRIDE), 0.)
  # Rows 0 and 1 of each L are final already. Rows at or past n are zero and stay zero, so the
  # loop stops at n; block 0 holds the most valid rows, so its count bounds all four.
  for i in range(2, tl.minimum(n, 16)):
    b_L0 = _substitute_row(b_L0, p_A, 0, i, o_i, n, STRIDE)
    b_L1 = _substitute_row(b_L1, p_A, 1, i, o_i, n, STRIDE)
    b_L2 = _substitute_row(b_L2, p_A, 2, i, o_i, n, STRIDE)
    b_L3 = _substitute_row(b_L3, p_A, 3, i, o_i, n, STRIDE)
  b_X00 = tl.where(m_diag, 1., b_L0)
  b_X11 = tl.where(m_diag, 1., b_L1)
  b_X22 = tl.where(m_diag, 1., b_L2)
  b_X33 = tl.where(m_diag, 1., b_L3)

  # Column by column, each block of A loaded just before its first product and each X block
  # stored as soon as it is final, so few 16x16 tiles are live at once: 128 registers (16
  # one-warp programs per SM), where all six A blocks loaded up front and the products taken by
  # distance from the diagonal needed 225 (8 per SM). The stage is latency-bound, so more
  # resident programs hide more of it: 80.9 against 92.5 us at B=1 T=8192 on the H200. The
  # products themselves, and so the bits, are the same in either order.
  b_0 = tl.zeros([16, 16], dtype=tl.float32)
  _store_block(p_Ai, b_X00, 0, 0, n, STRIDE)
  _store_block(p_Ai, b_0, 0, 1, n, STRIDE)
  _store_block(p_Ai, b_0, 0, 2, n, STRIDE)
  _store_block(p_Ai, b_0, 0, 3, n, STRIDE)
  _store_block(p_Ai, b_X11, 1, 1, n, STRIDE)
  _store_block(p_Ai, b_0, 1, 2, n, STRIDE)
  _store_block(p_Ai, b_0, 1, 3, n, STRIDE)
  _store_block(p_Ai, b_X22, 2, 2, n, STRIDE)
  _store_block(p_Ai, b_0, 2, 3, n, STRIDE)
  _store_block(p_Ai, b_X33, 3, 3, n, STRIDE)
  # column 0
  b_A10 = _load_block(p_A, 1, 0, n, STRIDE)
  b_X10 = -_mm(b_X11, _mm(b_A10, b_X00, P), P)
  _store_block(p_Ai, b_X10, 1, 0, n, STRIDE)
  b_A20 = _load_block(p_A, 2, 0, n, STRIDE)
  b_A21 = _load_block(p_A, 2, 1, n, STRIDE)
  b_X20 = -_mm(b_X22, _mm(b_A20, b_X00, P) + _mm(b_A21, b_X10, P), P)
  _store_block(p_Ai, b_X20, 2, 0, n, STRIDE)
  b_A30 = _load_block(p_A, 3, 0, n, STRIDE)
  b_A31 = _load_block(p_A, 3, 1, n, STRIDE)
  b_A32 = _load_block(p_A, 3, 2, n, STRIDE)
  b_X30 = -_mm(b_X33, _mm(b_A30, b_X00, P) + _mm(b_A31, b_X10, P) + _mm(b_A32, b_X20, P), P)
  _store_block(p_Ai, b_X30, 3, 0, n, STRIDE)
  # column 1
  b_X21 = -_mm(b_X22, _mm(b_A21, b_X11, P), P)
  _store_block(p_Ai, b_X21, 2, 1, n, STRIDE)
  b_X31 = -_mm(b_X33, _mm(b_A31, b_X11, P) + _mm(b_A32, b_X21, P), P)
  _store_block(p_Ai, b_X31, 3, 1, n, STRIDE)
  # column 2
  b_X32 = -_mm(b_X33, _mm(b_A32, b_X22, P), P)
  _store_block(p_Ai, b_X32, 3, 2, n, STRIDE)


@triton.jit
def chunk_solve_fwd_kernel(
    # inputs
    A,           # [T*M, HV, BT] float32 strictly lower blocks from stage 2
    cu_seqlens,  # [N+1] int32 token-stream sequence starts
    chunk_desc,  # [NXD, 2] int32 (sequence, expanded chunk within it); sequence -1 = padding
    # outputs
    Ai,          # [T*M, HV, BT] in the input dtype, (I + A)^-1 per chunk
    # sizes
    HV: tl.constexpr,
    M: tl.constexpr,
    BT: tl.constexpr,  # 64: the 4x4 split of 16x16 blocks is written out below
    DOT_PRECISION: tl.constexpr,  # of the off-diagonal products: "ieee", "tf32x3" or "tf32"
):
  i_d, i_hv = tl.program_id(0), tl.program_id(1)
  i_n, row0, n = chunk_span(chunk_desc, cu_seqlens, i_d, M, BT)
  if i_n < 0:
    return
  _invert(A + row0 * (HV * BT) + i_hv * BT, Ai + row0 * (HV * BT) + i_hv * BT, n, HV * BT,
          DOT_PRECISION)


@triton.jit
def _rows(p, i_p, n, STRIDE: tl.constexpr):
  """Rows 16*i_p .. 16*i_p + 15 of a column at p (rows STRIDE apart) as float32, zeros at or
  past n."""
  o_r = i_p * 16 + tl.arange(0, 16)
  return tl.load(p + o_r * STRIDE, mask=o_r < n, other=0.).to(tl.float32)


@triton.jit
def _gram(p_k, i_p, i_q, n, STRIDE_K: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
          GRAM_PRECISION: tl.constexpr):
  """K_p K_q^T for the 16-row blocks p and q of a chunk's keys (rows STRIDE_K apart), float32;
  key rows at or past n read as zeros."""
  o_i = tl.arange(0, 16)
  o_k = tl.arange(0, BK)
  r_p = i_p * 16 + o_i
  r_q = i_q * 16 + o_i
  acc = tl.zeros([16, 16], dtype=tl.float32)
  for i_k in range(tl.cdiv(K, BK)):
    m_k = i_k * BK + o_k < K
    b_p = tl.load(p_k + r_p[:, None] * STRIDE_K + i_k * BK + o_k[None, :],
                  mask=(r_p < n)[:, None] & m_k[None, :], other=0.)
    b_q = tl.load(p_k + r_q[:, None] * STRIDE_K + i_k * BK + o_k[None, :],
                  mask=(r_q < n)[:, None] & m_k[None, :], other=0.)
    acc += tl.dot(b_p, tl.trans(b_q), input_precision=GRAM_PRECISION)
  return acc


@triton.jit
def _a_block(b_A, p_A, i_p, i_q, n, p_rk, p_g, p_be, STRIDE: tl.constexpr,
             STRIDE_V: tl.constexpr, USE_G: tl.constexpr, USE_RNORM: tl.constexpr):
  """Block (p, q) of A from its Gram block b_A, stored at p_A: scaled as chunk_kkt scales A, in
  its order (key row factors, decays 2^(Gx_a - Gx_b) behind a select, since above the diagonal
  the exponent may overflow, then beta_a), zero unless row a lies in the sequence and a > b.
  The factors, decays and betas are read by rows from p_rk, p_g, p_be (STRIDE_V apart)."""
  o_i = tl.arange(0, 16)
  o_a = i_p * 16 + o_i
  m = (o_a < n)[:, None] & (o_a[:, None] > (i_q * 16 + o_i)[None, :])
  if USE_RNORM:
    b_A = b_A * (_rows(p_rk, i_p, n, STRIDE_V)[:, None]
                 * _rows(p_rk, i_q, n, STRIDE_V)[None, :])
  if USE_G:
    b_A = b_A * tl.where(m, tl.exp2(_rows(p_g, i_p, n, STRIDE_V)[:, None]
                                    - _rows(p_g, i_q, n, STRIDE_V)[None, :]), 0.)
  b_A = tl.where(m, b_A * _rows(p_be, i_p, n, STRIDE_V)[:, None], 0.)
  _store_block(p_A, b_A, i_p, i_q, n, STRIDE)


@triton.jit
def chunk_kkt_solve_fwd_kernel(
    # inputs
    k,           # [T*M, H, K] expanded-stream keys
    beta,        # [T*M, HV]
    g,           # [T, HV] float32 natural-log decays per token; a placeholder without USE_G
    cu_seqlens,  # [N+1] int32 token-stream sequence starts
    chunk_desc,  # [NXD, 2] int32 (sequence, expanded chunk within it); sequence -1 = padding
    # outputs
    Ai,          # [T*M, HV, BT] in k's dtype, (I + A)^-1 per chunk
    A,           # [T*M, HV, BT] float32: A as chunk_kkt writes it, read back by this program
    g_cum,       # [T*M, HV] float32 Gx, as chunk_kkt stores it; unwritten without USE_G
    rk,          # [T*M, H] float32 key row factors, as chunk_kkt; unwritten without USE_RNORM
    rk_v,        # [T*M, HV] float32: the same factors per value head, each program its own rows
                 # (rk has one writer per key head); unwritten without USE_RNORM
    # sizes
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    M: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    # flags
    USE_G: tl.constexpr,
    USE_RNORM: tl.constexpr,
    GRAM_PRECISION: tl.constexpr,  # of K K^T: "ieee" for float32 keys, else the tensor cores'
    DOT_PRECISION: tl.constexpr,   # of the solve's products, as in chunk_solve_fwd_kernel
):
  i_d, i_hv = tl.program_id(0), tl.program_id(1)
  i_h = i_hv // (HV // H)
  i_n, row0, n = chunk_span(chunk_desc, cu_seqlens, i_d, M, BT)
  if i_n < 0:
    return
  p_k = k + row0 * (H * K) + i_h * K
  p_A = A + row0 * (HV * BT) + i_hv * BT
  p_rk = rk_v + row0 * HV + i_hv
  p_g = g_cum + row0 * HV + i_hv
  p_be = beta + row0 * HV + i_hv
  o_r = tl.arange(0, BT)
  if USE_G:
    tl.store(p_g + o_r * HV, chunk_decays(g, row0, n, i_hv, HV, M, BT), mask=o_r < n)
  # Stores by other lanes of this program (decays, key factors, A's rows) must be visible before
  # they are read back by rows: a barrier after each.
  tl.debug_barrier()
  # Diagonal blocks first: their Gram blocks also give the key factors (|k|^2 off the diagonal,
  # exact products and float32 sums, as chunk_kkt takes it), which the other blocks need.
  o_i = tl.arange(0, 16)
  for i_p in range(0, 4):
    b_D = _gram(p_k, i_p, i_p, n, H * K, K, BK, GRAM_PRECISION)
    if USE_RNORM:
      b_rk = tl.math.rsqrt(tl.sum(tl.where(o_i[:, None] == o_i[None, :], b_D, 0.), 1) + 1e-6)
      tl.store(p_rk + (i_p * 16 + o_i) * HV, b_rk, mask=i_p * 16 + o_i < n)
      tl.debug_barrier()
    _a_block(b_D, p_A, i_p, i_p, n, p_rk, p_g, p_be, HV * BT, HV, USE_G, USE_RNORM)
  if USE_RNORM:
    if i_hv % (HV // H) == 0:
      tl.store(rk + row0 * H + (o_r * H + i_h), tl.load(p_rk + o_r * HV, mask=o_r < n),
               mask=o_r < n)
  for i_p in range(1, 4):
    for i_q in range(0, i_p):
      _a_block(_gram(p_k, i_p, i_q, n, H * K, K, BK, GRAM_PRECISION), p_A, i_p, i_q, n, p_rk,
               p_g, p_be, HV * BT, HV, USE_G, USE_RNORM)
  tl.debug_barrier()
  _invert(p_A, Ai + row0 * (HV * BT) + i_hv * BT, n, HV * BT, DOT_PRECISION)
