"""Stage 3 of the chunked prefill: Ai = (I + A)^-1 for each 64x64 expanded-chunk block of A.

I + A is unit lower triangular, and so is its inverse X. Both are split into a 4x4 grid of
16x16 blocks (docs/algorithm.md §4.5):

1. Diagonal blocks by forward substitution, with no reduction in the chain: row i of block p
   is x_i = e_i - sum_{j<i} A_pp[i, j] x_j. The rows are [64] vectors over the chunk's columns
   (column c in block c // 16), so the four blocks advance together and each lane owns its
   columns: a step is one multiply-add per column, the dependent chain one multiply-add per
   row, and the entries of A are per-lane gathers (L1 hits) that depend on nothing computed.
   The rows are then joined into the four 16x16 tiles the products take.
2. Off-diagonal blocks column by column, each column top down (docs/algorithm.md lists them by
   distance from the diagonal; any order in which every X_mq is final before it is used takes
   the same products, and this one keeps fewer tiles live, see below):
   X_pq = -X_pp @ sum_{m=q}^{p-1} A_pm @ X_mq, with float32 operands at DOT_PRECISION: "ieee"
   (exact float32 products, on the CUDA cores) or, for 16-bit outputs, "tf32x3" (three TF32
   tensor-core products, float32-level accuracy) or "tf32" (one, about 1e-3 per product).
3. All 16 blocks are stored in the output dtype (round to nearest even), the six above the
   diagonal as explicit zeros, because an output buffer under JAX is not zero-filled.

Rows of A past the sequence end are loaded as zeros, which makes those rows of X identity rows
(finite); they are not stored, since they belong to the next sequence.

Grid: (number of expanded-chunk descriptors, HV). Program (i_d, i_hv) owns the 64x64 block of
descriptor i_d and value head i_hv; a padding descriptor (sequence -1) returns at once.

Parameter order: inputs, outputs, constexprs.
"""
import triton
import triton.language as tl

from ._common import chunk_span


@triton.jit
def _load_block(p_A, i_p, i_q, n, STRIDE: tl.constexpr):
  """Block (i_p, i_q) of a 64x64 chunk, 16x16 float32, rows at or past n read as zeros."""
  o_i = tl.arange(0, 16)
  o_r = i_p * 16 + o_i
  p = p_A + o_r[:, None] * STRIDE + i_q * 16 + o_i[None, :]
  return tl.load(p, mask=(o_r < n)[:, None], other=0.).to(tl.float32)


@triton.jit
def store_block(p_Ai, b_X, i_p, i_q, n, STRIDE: tl.constexpr):
  o_i = tl.arange(0, 16)
  o_r = i_p * 16 + o_i
  p = p_Ai + o_r[:, None] * STRIDE + i_q * 16 + o_i[None, :]
  tl.store(p, b_X.to(p_Ai.dtype.element_ty), mask=(o_r < n)[:, None])


@triton.jit
def store_diag_and_upper(p_Ai, b_X00, b_X11, b_X22, b_X33, n, STRIDE: tl.constexpr):
  """The four diagonal blocks of X, and the six above them as explicit zeros (step 3)."""
  b_0 = tl.zeros([16, 16], dtype=tl.float32)
  store_block(p_Ai, b_X00, 0, 0, n, STRIDE)
  store_block(p_Ai, b_0, 0, 1, n, STRIDE)
  store_block(p_Ai, b_0, 0, 2, n, STRIDE)
  store_block(p_Ai, b_0, 0, 3, n, STRIDE)
  store_block(p_Ai, b_X11, 1, 1, n, STRIDE)
  store_block(p_Ai, b_0, 1, 2, n, STRIDE)
  store_block(p_Ai, b_0, 1, 3, n, STRIDE)
  store_block(p_Ai, b_X22, 2, 2, n, STRIDE)
  store_block(p_Ai, b_0, 2, 3, n, STRIDE)
  store_block(p_Ai, b_X33, 3, 3, n, STRIDE)


@triton.jit
def diag_by_columns(p_A, n, STRIDE: tl.constexpr, DIAG_ONLY: tl.constexpr):
  """The four diagonal 16x16 blocks of X = (I + A)^-1 (step 1 of the module docstring), as
  [16, 16] tiles (X_00, X_11, X_22, X_33). Row r of A at p_A + r * STRIDE holds its 64 entries,
  or with DIAG_ONLY only the 16 of its diagonal block (chunk_kkt's fused solve)."""
  o_c = tl.arange(0, 64)
  base = (o_c // 16) * 16
  col0 = 0 if DIAG_ONLY else base
  loc = o_c % 16
  xs = ()
  for i in tl.static_range(16):
    x = tl.where(loc == i, 1., 0.)
    # A row at or past n reads zeros: an identity row, finite and never stored.
    live = base + i < n
    for j in tl.static_range(i):
      a = tl.load(p_A + (base + i) * STRIDE + col0 + j, mask=live, other=0.).to(tl.float32)
      x = x - a * xs[j]
    xs = xs + (x,)
  # [64 columns, 16 rows] by joining: the join order makes the flat index of the trailing four
  # axes 8 b0 + 4 b1 + 2 b2 + b3 = i.
  y0 = tl.join(tl.join(tl.join(xs[0], xs[8]), tl.join(xs[4], xs[12])),
               tl.join(tl.join(xs[2], xs[10]), tl.join(xs[6], xs[14])))
  y1 = tl.join(tl.join(tl.join(xs[1], xs[9]), tl.join(xs[5], xs[13])),
               tl.join(tl.join(xs[3], xs[11]), tl.join(xs[7], xs[15])))
  t = tl.reshape(tl.join(y0, y1), [2, 2, 16, 16])  # (c // 32, c // 16 % 2, c % 16, i)
  t = tl.permute(t, [3, 2, 0, 1])                  # (i, c % 16, c // 32, c // 16 % 2)
  t_even, t_odd = tl.split(t)
  b_X00, b_X22 = tl.split(t_even)
  b_X11, b_X33 = tl.split(t_odd)
  return b_X00, b_X11, b_X22, b_X33


@triton.jit
def mm(a, b, DOT_PRECISION: tl.constexpr):
  return tl.dot(a, b, input_precision=DOT_PRECISION)


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
  p_A = A + row0 * (HV * BT) + i_hv * BT
  p_Ai = Ai + row0 * (HV * BT) + i_hv * BT

  b_X00, b_X11, b_X22, b_X33 = diag_by_columns(p_A, n, HV * BT, False)

  # Column by column, each block of A loaded just before its first product and each X block
  # stored as soon as it is final, so few 16x16 tiles are live at once. The stage is
  # latency-bound, so more resident programs hide more of it: 80.9 against 92.5 us at B=1
  # T=8192 on the H200 (all six A blocks loaded up front, products by distance from the
  # diagonal). The products themselves, and so the bits, are the same in either order.
  P: tl.constexpr = DOT_PRECISION
  store_diag_and_upper(p_Ai, b_X00, b_X11, b_X22, b_X33, n, HV * BT)
  # column 0
  b_A10 = _load_block(p_A, 1, 0, n, HV * BT)
  b_X10 = -mm(b_X11, mm(b_A10, b_X00, P), P)
  store_block(p_Ai, b_X10, 1, 0, n, HV * BT)
  b_A20 = _load_block(p_A, 2, 0, n, HV * BT)
  b_A21 = _load_block(p_A, 2, 1, n, HV * BT)
  b_X20 = -mm(b_X22, mm(b_A20, b_X00, P) + mm(b_A21, b_X10, P), P)
  store_block(p_Ai, b_X20, 2, 0, n, HV * BT)
  b_A30 = _load_block(p_A, 3, 0, n, HV * BT)
  b_A31 = _load_block(p_A, 3, 1, n, HV * BT)
  b_A32 = _load_block(p_A, 3, 2, n, HV * BT)
  b_X30 = -mm(b_X33, mm(b_A30, b_X00, P) + mm(b_A31, b_X10, P) + mm(b_A32, b_X20, P), P)
  store_block(p_Ai, b_X30, 3, 0, n, HV * BT)
  # column 1
  b_X21 = -mm(b_X22, mm(b_A21, b_X11, P), P)
  store_block(p_Ai, b_X21, 2, 1, n, HV * BT)
  b_X31 = -mm(b_X33, mm(b_A31, b_X11, P) + mm(b_A32, b_X21, P), P)
  store_block(p_Ai, b_X31, 3, 1, n, HV * BT)
  # column 2
  b_X32 = -mm(b_X33, mm(b_A32, b_X22, P), P)
  store_block(p_Ai, b_X32, 3, 2, n, HV * BT)
