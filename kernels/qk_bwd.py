"""The last step of the prefill backward for q and k (docs/algorithm.md §13.1, step 5).

chunk_o_bwd and chunk_wy_bwd leave the cotangents of the (normalised) queries and keys per value
head, [rows, HV, K] in float32 (or in the input dtype: BwdConfig.partials); the value heads
h*G .. h*G+G-1 (G = HV // H) share key head h's q and k rows, so for each row and key head:

    dy = sum over the G value heads of the rows                       (float32, in head order)
    dx = r (dy - y <y, dy>),  y = x r,  r = 1 / sqrt(|x|^2 + 1e-6)    with USE_L2NORM
    dx = dy                                                           without
    dx = 0 for rows at or past cu_seqlens[N] * M

x being the raw (unnormalised) row in the input dtype, the L2 norm's input (§4.2: the forward's
epsilon). M is the rows per token of the stream: 1 for dq on the token stream, the Householder
count for dk on the expanded stream. Rows past the limit belong to no sequence; no kernel wrote
their rows, so they are not loaded: a masked row loads as zeros, whose gradient is
exactly zero (0 - 0 <0, 0> scaled by r), and the store covers every row.

One pass that reads each buffer once and writes the gradient in its dtype; the L2 norm
needs the whole K row, so a program holds BR full rows (BK = K rounded up to a power of two).

Grid: (ceil(R / BR), H) with R rows. Parameter order: inputs, outputs, constexprs.
"""
import triton
import triton.language as tl


@triton.jit
def qk_bwd_kernel(
    # inputs
    dy_v,        # [R, HV, K] cotangent of the normalised rows per value head, float32 or input
                 # dtype (BwdConfig.partials)
    x,           # [R, H, K] the raw rows, input dtype; a placeholder when USE_L2NORM is False
    cu_seqlens,  # [N+1] int32 token-stream sequence starts; rows >= cu_seqlens[N] * M are zero
    N,           # sequences
    R,           # rows of the stream
    # outputs
    dx,          # [R, H, K] in the gradient's dtype
    # sizes
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    M: tl.constexpr,
    BR: tl.constexpr,
    BK: tl.constexpr,
    # flags
    USE_L2NORM: tl.constexpr,
):
  i_r, i_h = tl.program_id(0), tl.program_id(1)
  G: tl.constexpr = HV // H
  # int64 rows: R * HV * K passes 2**31 on long packed batches (B*T*M = 262144 rows at HV = 64,
  # K = 128).
  row = i_r.to(tl.int64) * BR + tl.arange(0, BR)
  o_k = tl.arange(0, BK)
  limit = tl.load(cu_seqlens + N).to(tl.int64) * M
  m_live = (row < limit)[:, None] & (o_k < K)[None, :]

  p_dy = dy_v + row[:, None] * (HV * K) + i_h * (G * K) + o_k[None, :]
  b_dy = tl.zeros([BR, BK], dtype=tl.float32)
  for i_g in tl.static_range(G):
    b_dy += tl.load(p_dy + i_g * K, mask=m_live, other=0.).to(tl.float32)

  p_x = row[:, None] * (H * K) + i_h * K + o_k[None, :]
  if USE_L2NORM:
    b_x = tl.load(x + p_x, mask=m_live, other=0.).to(tl.float32)
    b_r = tl.rsqrt(tl.sum(b_x * b_x, 1) + 1e-6)
    b_y = b_x * b_r[:, None]
    b_yd = tl.sum(b_y * b_dy, 1)
    b_dy = b_r[:, None] * (b_dy - b_y * b_yd[:, None])
  tl.store(dx + p_x, b_dy.to(dx.dtype.element_ty),
           mask=(row < R)[:, None] & (o_k < K)[None, :])
