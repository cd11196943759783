"""Stage 4 of the chunked prefill: the WY factors w and u of each expanded chunk.

With Ai = (I + A)^-1 the 64x64 block of stage 3 (docs/algorithm.md §4.6):

    u = Ai @ (beta[:, None] * V_chunk)                    [64, V]
    w = Ai @ (beta[:, None] * 2^Gx[:, None] * K_chunk)     [64, K]

The scaled operand is formed in float32, cast to the input dtype, multiplied by Ai (input
dtype) with float32 accumulation, and stored in the input dtype. Both factors are per value
head (they carry beta and the decay); keys come from key head hv // (HV // H). Without decay
the 2^Gx factor is dropped. Rows past the sequence end are neither read nor written.

Grid: (number of expanded-chunk descriptors, HV). Program (i_d, i_hv) owns the 64 rows of
descriptor i_d, value head i_hv, all K and V columns (in BK / BV slices); a padding descriptor
(sequence -1) returns at once.

Parameter order: inputs, outputs, constexprs.
"""
import triton
import triton.language as tl

from ._common import chunk_span


@triton.jit
def chunk_wy_fwd_kernel(
    # inputs
    k,           # [T*M, H, K]
    v,           # [T*M, HV, V]
    beta,        # [T*M, HV]
    g_cum,       # [T*M, HV] float32 Gx (log2 units); a placeholder when USE_G is False
    rk,          # [T*M, H] float32 1/|k| factors; a placeholder when USE_RNORM is False
    Ai,          # [T*M, HV, BT] in the input dtype
    cu_seqlens,  # [N+1] int32 token-stream sequence starts
    chunk_desc,  # [NXD, 2] int32 (sequence, expanded chunk within it); sequence -1 = padding
    # outputs
    w,           # [T*M, HV, K] in the input dtype
    u,           # [T*M, HV, V] in the input dtype
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
    USE_RNORM: tl.constexpr,  # keys L2-normalised by their row factors
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs, else the tensor-core default
):
  i_d, i_hv = tl.program_id(0), tl.program_id(1)
  i_h = i_hv // (HV // H)
  i_n, row0, n = chunk_span(chunk_desc, cu_seqlens, i_d, M, BT)
  if i_n < 0:
    return
  o_r = tl.arange(0, BT)
  mask_r = o_r < n

  b_Ai = tl.load(Ai + row0 * (HV * BT) + i_hv * BT + (o_r[:, None] * (HV * BT) + o_r[None, :]),
                 mask=mask_r[:, None], other=0.)
  b_beta = tl.load(beta + row0 * HV + o_r * HV + i_hv, mask=mask_r, other=0.).to(tl.float32)

  o_v = tl.arange(0, BV)
  off_v = o_r[:, None] * (HV * V) + o_v[None, :]
  p_v = v + row0 * (HV * V) + i_hv * V
  p_u = u + row0 * (HV * V) + i_hv * V
  for i_v in range(tl.cdiv(V, BV)):
    m = mask_r[:, None] & (i_v * BV + o_v < V)[None, :]
    b_v = (tl.load(p_v + (off_v + i_v * BV), mask=m, other=0.).to(tl.float32) * b_beta[:, None])
    b_u = tl.dot(b_Ai, b_v.to(b_Ai.dtype), input_precision=DOT_PRECISION)
    tl.store(p_u + (off_v + i_v * BV), b_u.to(u.dtype.element_ty), mask=m)

  b_kscale = b_beta
  if USE_G:
    b_g = tl.load(g_cum + row0 * HV + o_r * HV + i_hv, mask=mask_r, other=0.)
    b_kscale = b_beta * tl.where(mask_r, tl.exp2(b_g), 0.)
  if USE_RNORM:
    b_kscale = b_kscale * tl.load(rk + row0 * H + o_r * H + i_h, mask=mask_r, other=0.)
  o_k = tl.arange(0, BK)
  p_k = k + row0 * (H * K) + i_h * K
  p_w = w + row0 * (HV * K) + i_hv * K
  for i_k in range(tl.cdiv(K, BK)):
    m = mask_r[:, None] & (i_k * BK + o_k < K)[None, :]
    b_k = tl.load(p_k + (o_r[:, None] * (H * K) + i_k * BK + o_k[None, :]), mask=m, other=0.)
    b_k = b_k.to(tl.float32) * b_kscale[:, None]
    b_w = tl.dot(b_Ai, b_k.to(b_Ai.dtype), input_precision=DOT_PRECISION)
    tl.store(p_w + (o_r[:, None] * (HV * K) + i_k * BK + o_k[None, :]), b_w.to(w.dtype.element_ty),
             mask=m)
