"""Stage 2 of the chunked prefill: A = strictly-lower(beta * K K^T * decay) per expanded chunk.

For expanded chunk rows a, b in 0..63 of one sequence and one value head hv (docs/algorithm.md §4.4):

    A[a, b] = beta_a * <k_a, k_b> * 2^(Gx_a - Gx_b)   if a > b and both rows lie in the sequence
            = 0                                         otherwise (diagonal included).

Keys come from key head hv // (HV // H) (grouped value heads are contiguous); beta and Gx from hv.
All 64 columns of every valid row are written, zeros included, so A is fully defined there; rows
past the sequence end belong to the next sequence and are not touched.

With USE_G the decays enter as the raw token stream g, and this stage also performs stage 1
for its chunk and head (Gx, the chunk-local cumulative log2 decays, `_common.chunk_decays`) and
stores it for stages 4 and 5, instead of a separate cumsum kernel.

With USE_RNORM the keys are L2-normalised (§4.2) as float32 row factors rk = 1 / sqrt(|k|^2 +
1e-6), applied to A's rows and columns after the dot. This stage reads every key row of every
sequence anyway, so it computes rk and stores it for stages 4 to 6 (one writer per key head:
the first of its value heads), instead of a separate pass over k. |k_a|^2 is read off the
diagonal of the unscaled K K^T (exact products, float32 sums), not summed from the key tiles:
a tile that feeds a Hopper tensor-core dot and a register reduction in the same pipelined
K loop came out wrong on the H200 (bfloat16, K = 256: two slices; docs/algorithm.md §4.2).
With STORE_KN (the training forward only) the same writer also stores the normalised rows
k rk in the input dtype, which the backward kernels take, rereading its key tiles in a loop of
their own.

With SOLVE the program runs stage 3 on its tile as well (kernels/chunk_solve.py's steps and
products) and stores Ai = (I + A)^-1 in the first output's place; A never reaches memory.

Grid: (number of expanded-chunk descriptors, HV). Program (i_d, i_hv) owns the 64x64 block of
descriptor i_d and value head i_hv; a padding descriptor (sequence -1) returns at once.

Parameter order: inputs, outputs, constexprs.
"""
import triton
import triton.language as tl

from ._common import chunk_decays, chunk_span
from .chunk_solve import diag_by_columns, mm, store_block, store_diag_and_upper


@triton.jit
def _quarters(t):
  """[16, 16, 2, 2] -> its four [16, 16] slices, in the order of the flat last two axes."""
  t0, t1 = tl.split(t)
  t00, t10 = tl.split(t0)
  t01, t11 = tl.split(t1)
  return t00, t01, t10, t11


@triton.jit
def _solve_tile(b_A, p_Ai, n, HV: tl.constexpr, BT: tl.constexpr, P: tl.constexpr):
  """Stage 3 on this program's A tile (kernels/chunk_solve.py, the same steps and products):
  stores Ai = (I + A)^-1 at p_Ai, rows at or past n untouched.

  The diagonal blocks' substitution gathers entries of A per lane, which a register tile cannot
  give, so they go through memory: Ai's own rows, reinterpreted as float32, hold the 16 entries
  of each row's diagonal block until the inverse overwrites them. Those bytes are this program's
  and stay in cache; A itself is never written, nor read back.
  """
  o_r = tl.arange(0, BT)
  STRIDE: tl.constexpr = HV * BT
  DS: tl.constexpr = STRIDE * p_Ai.dtype.element_ty.primitive_bitwidth // 32
  p_D = p_Ai.to(tl.pointer_type(tl.float32))
  m_D = ((o_r[:, None] // 16) == (o_r[None, :] // 16)) & (o_r < n)[:, None]
  tl.store(p_D + (o_r[:, None] * DS + o_r[None, :] % 16), b_A, mask=m_D)
  tl.debug_barrier()
  b_X00, b_X11, b_X22, b_X33 = diag_by_columns(p_D, n, DS, True)
  # Every lane has read its entries before any overwrites them.
  tl.debug_barrier()
  # The lower blocks, cut from the tile: (i, j, p // 2, p % 2, q // 2, q % 2) for block (p, q).
  t = tl.permute(tl.reshape(b_A, [2, 2, 16, 2, 2, 16]), [2, 5, 0, 1, 3, 4])
  t_even, t_odd = tl.split(t)          # q % 2 = 0, 1
  t_q0, t_q2 = tl.split(t_even)         # q // 2 = 0, 1
  t_q1, _ = tl.split(t_odd)
  _, b_A10, b_A20, b_A30 = _quarters(t_q0)
  _, _, b_A21, b_A31 = _quarters(t_q1)
  _, _, _, b_A32 = _quarters(t_q2)
  store_diag_and_upper(p_Ai, b_X00, b_X11, b_X22, b_X33, n, STRIDE)
  b_X10 = -mm(b_X11, mm(b_A10, b_X00, P), P)
  store_block(p_Ai, b_X10, 1, 0, n, STRIDE)
  b_X20 = -mm(b_X22, mm(b_A20, b_X00, P) + mm(b_A21, b_X10, P), P)
  store_block(p_Ai, b_X20, 2, 0, n, STRIDE)
  b_X30 = -mm(b_X33, mm(b_A30, b_X00, P) + mm(b_A31, b_X10, P) + mm(b_A32, b_X20, P), P)
  store_block(p_Ai, b_X30, 3, 0, n, STRIDE)
  b_X21 = -mm(b_X22, mm(b_A21, b_X11, P), P)
  store_block(p_Ai, b_X21, 2, 1, n, STRIDE)
  b_X31 = -mm(b_X33, mm(b_A31, b_X11, P) + mm(b_A32, b_X21, P), P)
  store_block(p_Ai, b_X31, 3, 1, n, STRIDE)
  b_X32 = -mm(b_X33, mm(b_A32, b_X22, P), P)
  store_block(p_Ai, b_X32, 3, 2, n, STRIDE)


@triton.jit
def chunk_kkt_fwd_kernel(
    # inputs
    k,           # [T*M, H, K] expanded-stream keys
    beta,        # [T*M, HV]
    g,           # [T, HV] float32 natural-log decays per token; a placeholder when USE_G is False
    cu_seqlens,  # [N+1] int32 token-stream sequence starts
    chunk_desc,  # [NXD, 2] int32 (sequence, expanded chunk within it); sequence -1 = padding
    # outputs
    A,           # [T*M, HV, BT] float32 A; with SOLVE, (I + A)^-1 in its own dtype instead
    g_cum,       # [T*M, HV] float32 Gx (log2 units) of every sequence row; unwritten without USE_G
    rk,          # [T*M, H] float32 1/|k| row factors; never written when USE_RNORM is False
    kn,          # [T*M, H, K] k rk in k's dtype; never written unless STORE_KN
    # sizes
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    M: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    # flags
    USE_G: tl.constexpr,
    USE_RNORM: tl.constexpr,  # keys L2-normalised by row factors computed here
    STORE_KN: tl.constexpr,   # with USE_RNORM: store the normalised keys too
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs, else the tensor-core default
    SOLVE: tl.constexpr,          # stage 3 here too: A is never written
    SOLVE_PRECISION: tl.constexpr,  # with SOLVE, chunk_solve's DOT_PRECISION
):
  i_d, i_hv = tl.program_id(0), tl.program_id(1)
  i_h = i_hv // (HV // H)
  i_n, row0, n = chunk_span(chunk_desc, cu_seqlens, i_d, M, BT)
  if i_n < 0:
    return
  o_r = tl.arange(0, BT)
  mask_r = o_r < n
  o_k = tl.arange(0, BK)
  p_k = k + row0 * (H * K) + i_h * K

  b_A = tl.zeros([BT, BT], dtype=tl.float32)
  for i_k in range(tl.cdiv(K, BK)):
    mask_k = i_k * BK + o_k < K
    b_k = tl.load(p_k + (o_r[:, None] * (H * K) + i_k * BK + o_k[None, :]),
                  mask=mask_r[:, None] & mask_k[None, :], other=0.)
    b_A += tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PRECISION)

  if USE_RNORM:
    b_ss = tl.sum(tl.where(o_r[:, None] == o_r[None, :], b_A, 0.), 1)
    b_rk = tl.math.rsqrt(b_ss + 1e-6)
    if i_hv % (HV // H) == 0:
      tl.store(rk + row0 * H + (o_r * H + i_h), b_rk, mask=mask_r)
      if STORE_KN:
        for i_k in range(tl.cdiv(K, BK)):
          o_kk = i_k * BK + o_k
          m_rk = mask_r[:, None] & (o_kk < K)[None, :]
          b_k = tl.load(p_k + (o_r[:, None] * (H * K) + o_kk[None, :]), mask=m_rk, other=0.)
          tl.store(kn + row0 * (H * K) + i_h * K + (o_r[:, None] * (H * K) + o_kk[None, :]),
                   (b_k.to(tl.float32) * b_rk[:, None]).to(kn.dtype.element_ty), mask=m_rk)
    b_A = b_A * (b_rk[:, None] * b_rk[None, :])
  b_beta = tl.load(beta + row0 * HV + (o_r * HV + i_hv), mask=mask_r, other=0.).to(tl.float32)
  m_A = (o_r[:, None] > o_r[None, :]) & mask_r[:, None]
  if USE_G:
    b_g = chunk_decays(g, row0, n, i_hv, HV, M, BT)
    tl.store(g_cum + row0 * HV + (o_r * HV + i_hv), b_g, mask=mask_r)
    # A select, not a product: above the diagonal Gx_a - Gx_b > 0 may overflow exp2 to inf.
    b_A = b_A * tl.where(m_A, tl.exp2(b_g[:, None] - b_g[None, :]), 0.)
  b_A = tl.where(m_A, b_A * b_beta[:, None], 0.)
  p_A = A + row0 * (HV * BT) + i_hv * BT
  if SOLVE:
    _solve_tile(b_A, p_A, n, HV, BT, SOLVE_PRECISION)
  else:
    tl.store(p_A + (o_r[:, None] * (HV * BT) + o_r[None, :]), b_A, mask=mask_r[:, None])
