"""Gated Delta Product decode, unfolded: D draft tokens of M Householder updates each.

Per request n with cache slot s = state_indices[n] and value head hv, starting from S = state[s]:

    for each draft token d in 0..D-1:
        S *= exp(g[n, d])                                  once per token, before its updates
        for j in 0..M-1 (row r = d*M + j):
            S += k_r (beta_r * (v_r - S^T k_r))^T
        o[n, d] = S^T (scale * q[n, d])                    after the token's last update
        intermediate_states[s, d] = S                      (optional, for speculative rollback)
    state[s] = S

This is the folded fused recurrent step (`fused_recurrent.py` with steps_per_token = M, query on
the last copy, decay on the first) without the fold: the caller passes q [N, D, H, K] and
g [N, D, HV] as they are, so no zero-padded copies are built, and the M - 1 read-outs per token
that the fold throws away are never computed. The arithmetic on the state is the same operation
for operation (a folded step multiplies by exp(0) = 1 exactly), so both give the same bits.

Grid: one flat axis of NV * N * HV programs; program i owns V-block i % NV of the [K, V] state of
request (i // NV) // HV, value head (i // NV) % HV, which reads key head hv // (HV // H).
Parameters are ordered inputs, outputs, constexprs; the cache and the snapshots come twice (input
and output pointer), as jax-triton 0.3.1 passes an aliased buffer and a torch launcher would.
"""
import triton
import triton.language as tl

from ._common import decode_program, l2norm_rows


@triton.jit
def gdp_decode_fwd_kernel(
    # inputs
    q,              # [N, D, H, K]
    k,              # [N, D*M, H, K]
    v,              # [N, D*M, HV, V]
    g,              # [N, D, HV] float32 log decays                  (USE_G)
    beta,           # [N, D*M, HV]                                   (USE_BETA)
    state_in,       # [S, HV, K, V] cache
    inter_in,       # [S, D, HV, K, V] per-draft-token snapshots     (STORE_INTERMEDIATE)
    state_indices,  # [N] int32 cache slot per request
    scale,          # float32
    S,              # cache slots
    # outputs
    o,              # [N, D, HV, V] in v.dtype
    state_out,      # the cache again, updated at its slots
    inter_out,      # the snapshots again                            (STORE_INTERMEDIATE)
    # sizes
    D: tl.constexpr,
    M: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    # flags
    USE_G: tl.constexpr,
    USE_BETA: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    STORE_INTERMEDIATE: tl.constexpr,
):
  i_v, i_n, i_hv, i_h = decode_program(triton.cdiv(V, BV), HV, H)
  i_n = i_n.to(tl.int64)

  o_k = tl.arange(0, BK)
  o_v = i_v * BV + tl.arange(0, BV)
  mask_k = o_k < K
  mask_v = o_v < V
  mask_h = mask_k[:, None] & mask_v[None, :]
  p_kv = o_k[:, None] * V + o_v[None, :]

  # int64: a slot times HV*K*V overflows int32 on a realistic cache (S=1024, HV=32, K=128, V=512
  # is already 2**31 elements).
  slot = tl.load(state_indices + i_n).to(tl.int64)
  # A slot outside [0, S) is padding (-1 by convention): no read, no write, output zero; an
  # out-of-range index from a caller must not reach memory outside the cache.
  if (slot < 0) | (slot >= S):
    zero = tl.zeros([BV], dtype=tl.float32).to(o.dtype.element_ty)
    for d in range(D):
      tl.store(o + ((i_n * D + d) * HV + i_hv) * V + o_v, zero, mask=mask_v)
    return

  p_state = (slot * HV + i_hv) * K * V + p_kv
  b_h = tl.load(state_in + p_state, mask=mask_h, other=0.).to(tl.float32)
  for d in range(D):
    t = i_n * D + d
    if USE_G:
      b_h *= tl.exp(tl.load(g + t * HV + i_hv).to(tl.float32))
    for j in tl.static_range(M):
      r = t * M + j
      b_k = tl.load(k + (r * H + i_h) * K + o_k, mask=mask_k, other=0.).to(tl.float32)
      if USE_QK_L2NORM:
        b_k = l2norm_rows(b_k)
      b_v = tl.load(v + (r * HV + i_hv) * V + o_v, mask=mask_v, other=0.).to(tl.float32)
      b_v -= tl.sum(b_h * b_k[:, None], 0)
      if USE_BETA:
        b_v *= tl.load(beta + r * HV + i_hv).to(tl.float32)
      b_h += b_k[:, None] * b_v[None, :]
    b_q = tl.load(q + (t * H + i_h) * K + o_k, mask=mask_k, other=0.).to(tl.float32)
    if USE_QK_L2NORM:
      b_q = l2norm_rows(b_q)
    b_o = tl.sum(b_h * (b_q * scale)[:, None], 0)
    tl.store(o + (t * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=mask_v)
    if STORE_INTERMEDIATE:
      p_int = ((slot * D + d) * HV + i_hv) * K * V + p_kv
      tl.store(inter_out + p_int, b_h.to(inter_out.dtype.element_ty), mask=mask_h)
  tl.store(state_out + p_state, b_h.to(state_out.dtype.element_ty), mask=mask_h)
