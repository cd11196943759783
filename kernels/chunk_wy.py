"""Stage 4 of the chunked prefill: the WY factors w and u of each expanded chunk.

With Ai = (I + A)^-1 the 64x64 block of stage 3 (ALGORITHM.md §4.6):

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


@triton.jit
def chunk_wy_fwd_kernel(
    # inputs
    k,           # [T*M, H, K]
    v,           # [T*M, HV, V]
    beta,        # [T*M, HV]
    g_cum,       # [T*M, HV] float32 Gx (log2 units); a placeholder when USE_G is False
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
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs, else the tensor-core default
):
  i_d, i_hv = tl.program_id(0), tl.program_id(1)
  i_h = i_hv // (HV // H)
  i_n = tl.load(chunk_desc + 2 * i_d)
  if i_n < 0:
    return
  i_c = tl.load(chunk_desc + 2 * i_d + 1)
  # int64: row * HV*V and row * H*K overflow int32 on long packed batches.
  bos = tl.load(cu_seqlens + i_n).to(tl.int64) * M
  eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64) * M

  o_r = i_c * BT + tl.arange(0, BT)
  o_c = tl.arange(0, BT)
  mask_r = o_r < eos - bos
  row = bos + o_r

  b_Ai = tl.load(Ai + row[:, None] * (HV * BT) + i_hv * BT + o_c[None, :],
                 mask=mask_r[:, None], other=0.)
  b_beta = tl.load(beta + row * HV + i_hv, mask=mask_r, other=0.).to(tl.float32)

  o_v = tl.arange(0, BV)
  for i_v in range(tl.cdiv(V, BV)):
    mask_v = i_v * BV + o_v < V
    m = mask_r[:, None] & mask_v[None, :]
    p_v = v + row[:, None] * (HV * V) + i_hv * V + i_v * BV + o_v[None, :]
    b_v = (tl.load(p_v, mask=m, other=0.).to(tl.float32) * b_beta[:, None]).to(b_Ai.dtype)
    b_u = tl.dot(b_Ai, b_v, input_precision=DOT_PRECISION)
    p_u = u + row[:, None] * (HV * V) + i_hv * V + i_v * BV + o_v[None, :]
    tl.store(p_u, b_u.to(u.dtype.element_ty), mask=m)

  b_kscale = b_beta
  if USE_G:
    b_g = tl.load(g_cum + row * HV + i_hv, mask=mask_r, other=0.)
    b_kscale = b_beta * tl.where(mask_r, tl.exp2(b_g), 0.)
  o_k = tl.arange(0, BK)
  for i_k in range(tl.cdiv(K, BK)):
    mask_k = i_k * BK + o_k < K
    m = mask_r[:, None] & mask_k[None, :]
    p_k = k + row[:, None] * (H * K) + i_h * K + i_k * BK + o_k[None, :]
    b_k = (tl.load(p_k, mask=m, other=0.).to(tl.float32) * b_kscale[:, None]).to(b_Ai.dtype)
    b_w = tl.dot(b_Ai, b_k, input_precision=DOT_PRECISION)
    p_w = w + row[:, None] * (HV * K) + i_hv * K + i_k * BK + o_k[None, :]
    tl.store(p_w, b_w.to(w.dtype.element_ty), mask=m)
