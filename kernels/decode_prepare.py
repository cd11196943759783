"""Decode prepare: gating and the Householder fold in one launch (docs/algorithm.md §6.2, §8).

From the per-token activations after the short conv to the folded stream the decode kernel
(`fused_recurrent` with STEPS_PER_TOKEN = M) reads. For request n, draft token d and copy
m in 0..M-1, expanded row r = d*M + m:

    q_fold[n, r] = q[n, d]                                        if m == M-1, else 0
    g_fold[n, r] = -exp(A_log) * softplus(a[n, d] + dt_bias)      if m == 0,   else 0
    beta[n, r]   = sigmoid(b[n, r])                               (times 2 if ALLOW_NEG_EIGVAL)
    softplus(x)  = x if x > 20 else log1p(exp(x))                 (torch's threshold)
    sigmoid(x)   = 1 / (1 + exp(-x))

The query reads the state after a token's last copy and the decay acts once, before its first
(docs/api.md). k and v need nothing: the expanded stream already is the folded layout, and the
kernels are GVA-native, so q and k are never repeated to HV heads. Gates are float32 whatever
the input dtype; q is copied bit for bit (loaded and stored in q's dtype, no conversion).

Grid: one flat axis of N*D programs; program i owns request i // D, draft token i % D, all M
copies and all heads: an [H, K] query tile, HV decays and [M, HV] betas. It is a pure
elementwise map, each program writing disjoint rows: deterministic, no atomics, no reductions.

Precision: the gates are meant to match the jnp reference to a few float32 ulp. On a GPU
(USE_LIBDEVICE) they call libdevice exp and log1p and a correctly rounded division: Triton's
own float32 `tl.exp` is `ex2.approx(x * log2(e))`, whose rounded product alone costs about
1e-6 relative at x = 20. Triton's interpreter cannot call libdevice (extern calls raise there);
its `tl.exp` and `tl.log` are numpy's float32 functions, and log1p is rebuilt from log.

Parameters are ordered inputs, outputs, constexprs (jax_triton.triton_call appends one pointer
per output after the inputs).
"""
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _exp(x, USE_LIBDEVICE: tl.constexpr):
  if USE_LIBDEVICE:
    return libdevice.exp(x)
  else:
    return tl.exp(x)


@triton.jit
def _log1p(y, USE_LIBDEVICE: tl.constexpr):
  if USE_LIBDEVICE:
    return libdevice.log1p(y)
  else:
    # log(1 + y) alone loses y's low bits in the rounded sum; scaling by y / (u - 1), the ratio
    # of y to what the sum kept, restores them (Goldberg, "What every computer scientist should
    # know about floating-point arithmetic", Theorem 4). u == 1 means y is below half an ulp.
    u = 1.0 + y
    um1 = u - 1.0
    return tl.where(um1 == 0.0, y, tl.log(u) * tl.div_rn(y, tl.where(um1 == 0.0, 1.0, um1)))


@triton.jit
def decode_prepare_fwd_kernel(
    # inputs
    q,          # [N, D, H, K]
    a,          # [N, D, HV] decay pre-activation
    b,          # [N, D*M, HV] beta pre-activation
    A_log,      # [HV]
    dt_bias,    # [HV]
    # outputs
    q_fold,     # [N, D*M, H, K] in q's dtype
    g_fold,     # [N, D*M, HV] float32
    beta,       # [N, D*M, HV] float32
    # sizes
    H: tl.constexpr,
    K: tl.constexpr,
    HV: tl.constexpr,
    M: tl.constexpr,
    BH: tl.constexpr,
    BK: tl.constexpr,
    BHV: tl.constexpr,
    BM: tl.constexpr,
    # flags
    ALLOW_NEG_EIGVAL: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
):
  # i_nd = n*D + d indexes rows of q and a; the expanded rows of token (n, d) are i_nd*M + m.
  # int64: a row index times H*K reaches 2**31 at realistic N*D*M*H*K.
  i_nd = tl.program_id(0).to(tl.int64)

  o_h = tl.arange(0, BH)
  o_k = tl.arange(0, BK)
  mask_q = (o_h[:, None] < H) & (o_k[None, :] < K)
  p_hk = o_h[:, None] * K + o_k[None, :]
  # No cast: the folded query is the same bits.
  b_q = tl.load(q + i_nd * H * K + p_hk, mask=mask_q, other=0.)
  b_zero = tl.zeros([BH, BK], dtype=q_fold.dtype.element_ty)
  for m in tl.static_range(M):
    p_out = q_fold + (i_nd * M + m) * H * K + p_hk
    if m == M - 1:
      tl.store(p_out, b_q, mask=mask_q)
    else:
      tl.store(p_out, b_zero, mask=mask_q)

  o_hv = tl.arange(0, BHV)
  mask_hv = o_hv < HV
  o_m = tl.arange(0, BM)
  mask_mhv = (o_m[:, None] < M) & mask_hv[None, :]
  p_mhv = (i_nd * M + o_m[:, None]) * HV + o_hv[None, :]

  b_a = tl.load(a + i_nd * HV + o_hv, mask=mask_hv, other=0.).to(tl.float32)
  b_A_log = tl.load(A_log + o_hv, mask=mask_hv, other=0.).to(tl.float32)
  b_dt = tl.load(dt_bias + o_hv, mask=mask_hv, other=0.).to(tl.float32)
  x = b_a + b_dt
  # Clamped before exp so that large x cannot overflow to inf; above 20 the select returns x.
  b_sp = tl.where(x > 20., x, _log1p(_exp(tl.minimum(x, 20.), USE_LIBDEVICE), USE_LIBDEVICE))
  b_g = -_exp(b_A_log, USE_LIBDEVICE) * b_sp
  # The decay on copy 0 only: a select, so that the zero copies are exact zeros.
  b_gm = tl.where(o_m[:, None] == 0, b_g[None, :], 0.)
  tl.store(g_fold + p_mhv, b_gm, mask=mask_mhv)

  b_b = tl.load(b + p_mhv, mask=mask_mhv, other=0.).to(tl.float32)
  # exp(-b) may overflow to inf for b < -88; 1 / inf = 0 is the right limit.
  b_beta = tl.div_rn(1.0, 1.0 + _exp(-b_b, USE_LIBDEVICE))
  if ALLOW_NEG_EIGVAL:
    b_beta = b_beta * 2.0
  tl.store(beta + p_mhv, b_beta, mask=mask_mhv)
