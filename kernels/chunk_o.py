"""Stage 6 of the chunked prefill: the output, on the token stream.

For token chunk c of a sequence (n <= 64 valid tokens), value head hv and a block of BV value
columns (docs/algorithm.md §4.8), with Q the chunk's queries, S_c = h[chunk row] the state entering
the chunk (cast to the input dtype in registers), Gu the token-stream cumulative decays, and
K_j, D_j the rows t*M + j of k and v_new for the chunk's tokens t (row stride M*H*K and M*HV*V):

    acc = (Q @ S_c) * 2^Gu[:, None]
    Dec = where(a >= b, both valid, 2^(Gu_a - Gu_b), 0)      # INCLUSIVE: a token sees its copies
    for j in 0..M-1:
        acc += cast((Q @ K_j^T) * Dec) @ D_j
    o = cast(scale * acc, o dtype)

With USE_G the decays enter as the raw token stream g and Gu is computed here for the chunk
(`_common.chunk_decays`, stage 1 on the token stream), which no other stage reads.

With USE_RNORM, q and k are L2-normalised (§4.2) by float32 row factors applied after the
dots: the key factors rk come from stage 2; the query factors are computed here (q is read by
no other stage), in a loop of their own: a q tile that feeds a Hopper tensor-core dot and a
register reduction in the same pipelined K loop came out wrong on the H200 (bfloat16, K = 256;
docs/algorithm.md §4.2). With STORE_QN (the training forward only) the programs of the first V
block and the first value head of each key head also store the normalised queries q rq in the
input dtype, which the backward kernels take.

Rows past the sequence end are neither loaded nor stored. With state indices, a sequence whose
slot is outside [0, S) is padding and its output rows are written as zeros, without reading
anything else (stage 5 skips such sequences, so their v_new rows are undefined). With ZERO_TAIL
(packed inputs) program (i_d, i_v, i_hv) also writes zeros over the i_d-th block of BT rows at or
past cu_seqlens[N]: those rows belong to no sequence, and the descriptors (at least ceil(R / BT)
of them) outnumber their blocks. That replaces a select over the whole output in XLA.

The row of `h` is the descriptor index: token-chunk descriptors are laid out in sequence order,
so descriptor i_d of sequence n, chunk c is chunk_offsets[n] + c. With H_PER_CHUNK = M (the
training forward) `h` holds the state entering every expanded chunk instead and token chunk c
reads row h_offsets[n] + M c, its first expanded chunk's, in place (no gather of every M-th).

Grid: (number of token-chunk descriptors, ceil(V / BV), HV). Program (i_d, i_v, i_hv) owns the
64 x BV outputs of descriptor i_d, value head i_hv; a padding descriptor (sequence -1) returns
at once. The descriptor count sits on axis 0, which has no 65535 cap.

Parameter order: inputs, outputs, constexprs.
"""
import triton
import triton.language as tl

from ._common import chunk_decays, chunk_span


@triton.jit
def chunk_o_fwd_kernel(
    # inputs
    q,              # [T, H, K]
    k,              # [T*M, H, K]
    v_new,          # [T*M, HV, V] from stage 5, input dtype
    h,              # [NCR, HV, K, V] entering state of every token chunk (any float dtype);
                    # with H_PER_CHUNK = M, of every expanded chunk
    h_offsets,      # [N+1] int32 first row of each sequence in h; a placeholder when
                    # H_PER_CHUNK is 1
    g,              # [T, HV] float32 natural-log decays; a placeholder when USE_G is False
    rk,             # [T*M, H] float32 1/|k| row factors; a placeholder when USE_RNORM is False
    state_indices,  # [N] int32 slot per sequence; a placeholder without HAS_STATE_INDICES
    cu_seqlens,     # [N+1] int32 token-stream sequence starts
    chunk_desc,     # [NCD, 2] int32 (sequence, token chunk within it); sequence -1 = padding
    S,              # slots of the cache: a slot outside [0, S) is padding
    N,              # sequences (ZERO_TAIL)
    R,              # rows of the token stream, T (ZERO_TAIL)
    scale,          # float32 query scale
    # outputs
    o,              # [T, HV, V] in v.dtype
    qn,             # [T, H, K] q rq in q's dtype; never written unless STORE_QN
    # sizes
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    M: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    H_PER_CHUNK: tl.constexpr,  # rows of h per token chunk: 1, or M
    # flags
    USE_G: tl.constexpr,
    HAS_STATE_INDICES: tl.constexpr,
    USE_RNORM: tl.constexpr,  # q and k L2-normalised by row factors, applied after the dots
    STORE_QN: tl.constexpr,   # with USE_RNORM: store the normalised queries too
    ZERO_TAIL: tl.constexpr,  # packed: zero the rows past cu_seqlens[N]
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs, else the tensor-core default
):
  i_d, i_v, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
  i_h = i_hv // (HV // H)
  o_t = tl.arange(0, BT)
  o_v = i_v * BV + tl.arange(0, BV)
  mask_v = o_v < V
  if ZERO_TAIL:
    r_z = tl.load(cu_seqlens + N).to(tl.int64) + i_d * BT + o_t
    tl.store(o + r_z[:, None] * (HV * V) + i_hv * V + o_v[None, :],
             tl.zeros([BT, BV], dtype=o.dtype.element_ty),
             mask=(r_z < R)[:, None] & mask_v[None, :])
  # Token chunks: M = 1 rows per token. t0 is int64 (token * HV*V overflows int32).
  i_n, t0, n = chunk_span(chunk_desc, cu_seqlens, i_d, 1, BT)
  if i_n < 0:
    return

  mask_t = o_t < n
  m_tv = mask_t[:, None] & mask_v[None, :]
  p_o = o + t0 * (HV * V) + i_hv * V + (o_t[:, None] * (HV * V) + o_v[None, :])

  if HAS_STATE_INDICES:
    i_s = tl.load(state_indices + i_n)
    # A padding sequence's output is zero, whatever its length.
    if (i_s < 0) | (i_s >= S):
      tl.store(p_o, tl.zeros([BT, BV], dtype=tl.float32).to(o.dtype.element_ty), mask=m_tv)
      return

  o_k = tl.arange(0, BK)
  p_q = q + t0 * (H * K) + i_h * K + (o_t[:, None] * (H * K) + o_k[None, :])
  if H_PER_CHUNK == 1:
    i_hr = i_d.to(tl.int64)
  else:
    i_hr = (tl.load(h_offsets + i_n).to(tl.int64)
            + tl.load(chunk_desc + 2 * i_d + 1).to(tl.int64) * H_PER_CHUNK)
  p_h = h + (i_hr * HV + i_hv) * (K * V) + (o_k[:, None] * V + o_v[None, :])

  b_o = tl.zeros([BT, BV], dtype=tl.float32)
  for i_k in range(tl.cdiv(K, BK)):
    mask_k = i_k * BK + o_k < K
    b_q = tl.load(p_q + i_k * BK, mask=mask_t[:, None] & mask_k[None, :], other=0.)
    b_h = tl.load(p_h + i_k * BK * V, mask=mask_k[:, None] & mask_v[None, :], other=0.)
    # Cast in registers: float32 -> input dtype rounds like a store would, so o does not
    # depend on the dtype h was kept in.
    b_o += tl.dot(b_q, b_h.to(b_q.dtype), input_precision=DOT_PRECISION)

  if USE_RNORM:
    b_ss = tl.zeros([BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
      mask_k = i_k * BK + o_k < K
      b_qf = tl.load(p_q + i_k * BK, mask=mask_t[:, None] & mask_k[None, :], other=0.)
      b_qf = b_qf.to(tl.float32)
      b_ss += tl.sum(b_qf * b_qf, 1)
    b_rq = tl.math.rsqrt(b_ss + 1e-6)
    b_o = b_o * b_rq[:, None]
    if STORE_QN:
      if (i_v == 0) & (i_hv % (HV // H) == 0):
        p_qn = qn + t0 * (H * K) + i_h * K + (o_t[:, None] * (H * K) + o_k[None, :])
        for i_k in range(tl.cdiv(K, BK)):
          m_tk = mask_t[:, None] & (i_k * BK + o_k < K)[None, :]
          b_qf = tl.load(p_q + i_k * BK, mask=m_tk, other=0.).to(tl.float32)
          tl.store(p_qn + i_k * BK, (b_qf * b_rq[:, None]).to(qn.dtype.element_ty), mask=m_tk)
  m_A = (o_t[:, None] >= o_t[None, :]) & mask_t[:, None] & mask_t[None, :]
  if USE_G:
    b_g = chunk_decays(g, t0, n, i_hv, HV, 1, BT)
    b_o = b_o * tl.exp2(b_g)[:, None]
    # A select, not a product: above the diagonal Gu_a - Gu_b > 0 may overflow exp2 to inf.
    b_dec = tl.where(m_A, tl.exp2(b_g[:, None] - b_g[None, :]), 0.)
  else:
    b_dec = tl.where(m_A, 1., 0.)

  for j in tl.static_range(M):
    # Copy j of token t is expanded row t*M + j: a row stride of M*H*K (keys), M*HV*V (values).
    p_k = k + (t0 * M + j) * (H * K) + i_h * K + (o_t[None, :] * (M * H * K) + o_k[:, None])
    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
      mask_k = i_k * BK + o_k < K
      b_q = tl.load(p_q + i_k * BK, mask=mask_t[:, None] & mask_k[None, :], other=0.)
      b_kt = tl.load(p_k + i_k * BK, mask=mask_k[:, None] & mask_t[None, :], other=0.)
      b_A += tl.dot(b_q, b_kt, input_precision=DOT_PRECISION)
    b_A = b_A * b_dec
    if USE_RNORM:
      b_rk = tl.load(rk + (t0 * M + j) * H + o_t * (M * H) + i_h, mask=mask_t, other=0.)
      b_A = b_A * (b_rq[:, None] * b_rk[None, :])
    p_d = (v_new + (t0 * M + j) * (HV * V) + i_hv * V
           + (o_t[:, None] * (M * HV * V) + o_v[None, :]))
    b_d = tl.load(p_d, mask=m_tv, other=0.)
    b_o += tl.dot(b_A.to(b_d.dtype), b_d, input_precision=DOT_PRECISION)

  tl.store(p_o, (scale * b_o).to(o.dtype.element_ty), mask=m_tv)
