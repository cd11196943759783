"""Decode prepare: gating and the Householder fold as one Triton launch (docs/algorithm.md §6.2, §8).

Between the short convolution and the recurrence a Gated Delta Product layer only gates and
reshapes. `gated_delta_product_decode_prepare` does all of it for a decode step in one kernel,
and returns what `fused_recurrent_gated_delta_rule(..., steps_per_token=M)` takes besides k and
v, which are already in the expanded (= folded) layout and pass unchanged:

    q_fold, g_fold, beta = gated_delta_product_decode_prepare(
        q, k, v, a, b, A_log, dt_bias, num_householder=M)
    o, state, inter = fused_recurrent_gated_delta_rule(
        q_fold, k, v, g_fold, beta, state=state, state_indices=slots,
        intermediate_states=inter, steps_per_token=M)
    o = o[:, M - 1::M]                           # [N, D, HV, V]

This equals `gated_delta_product_decode(q, k, v, g, beta, ...)` with
g = reference.prepare.decay_gate(a, A_log, dt_bias) and beta = reference.prepare.beta_gate(b),
up to the few ulp by which the kernel's gates may differ from jnp's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from gdp_jax import _backends, _checks, _configs, _launch


def gated_delta_product_decode_prepare(q, k, v, a, b, A_log, dt_bias, *, num_householder,
                                       allow_neg_eigval=False, backend="auto"):
  """Gates and folds one decode step's activations for the fused recurrent kernel.

  Per request n and draft token d, with expanded row r = d*M + m for copy m in 0..M-1:
  `q_fold[n, r] = q[n, d]` if m == M-1 else 0 (the query reads the state after the token's last
  update); `g_fold[n, r] = -exp(A_log) * softplus(a[n, d] + dt_bias)` if m == 0 else 0 (the decay
  acts once, before the first update); `beta[n, r] = sigmoid(b[n, r])`, doubled with
  allow_neg_eigval; softplus(x) = x if x > 20 else log1p(exp(x)). Gates are computed in float32.
  Matches `gdp_jax.reference.prepare.gated_delta_product_decode_prepare` bit for bit in q_fold and
  the zeros, and to a few float32 ulp (relative 1e-6) in the gates.

  One Triton program per (request, draft token) covers all heads and copies. k and v are only
  checked: the expanded stream is already the folded layout, and the kernels are GVA-native, so
  nothing is repeated to HV heads or copied.

  Args:
    q: queries [N, D, H, K] (D = 1 for plain decode), after the short conv.
    k: keys [N, D*M, H, K]; draft token d owns rows d*M .. d*M+M-1. Checked, not read.
    v: values [N, D*M, HV, V]; HV % H == 0. Checked, not read.
    a: decay pre-activation [N, D, HV], any float dtype.
    b: beta pre-activation [N, D*M, HV], any float dtype.
    A_log: [HV], log of the decay rate (a float32 parameter; other float dtypes are upcast).
    dt_bias: [HV], added to a before the softplus.
    num_householder: M, the rank-1 updates per token.
    allow_neg_eigval: beta in (0, 2) instead of (0, 1).
    backend: "auto", "triton", "reference" or "interpret" (see README).

  Returns:
    (q_fold [N, D*M, H, K] in q.dtype, g_fold [N, D*M, HV] float32, beta [N, D*M, HV] float32),
    ready for `fused_recurrent_gated_delta_rule(q_fold, k, v, g_fold, beta,
    steps_per_token=M, ...)`, whose output rows M-1, 2M-1, ... are the draft tokens' outputs.

  Raises:
    ValueError: at trace time, for shapes or dtypes that do not fit the above.
  """
  N, D, M, H, K, HV = _checks.check_decode_prepare(q, k, v, a, b, A_log, dt_bias,
                                     num_householder=num_householder,
                                     allow_neg_eigval=allow_neg_eigval)
  backend = _backends.resolve(backend)
  if backend == "reference":
    from gdp_jax.reference import prepare as reference_prepare
    return _backends.call_jitted(
        reference_prepare.gated_delta_product_decode_prepare,
        dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias), num_householder=M,
        allow_neg_eigval=bool(allow_neg_eigval))
  BH, BK = _configs._next_pow2(H), _configs._next_pow2(K)
  f32 = jnp.float32
  out_shape = (
      jax.ShapeDtypeStruct((N, D * M, H, K), q.dtype),
      jax.ShapeDtypeStruct((N, D * M, HV), f32),
      jax.ShapeDtypeStruct((N, D * M, HV), f32),
  )
  cfg = _configs.decode_prepare_config(H, K)
  q_fold, g_fold, beta = _launch.call(
      "decode_prepare.decode_prepare_fwd_kernel", q, a, b, A_log, dt_bias,
      grid=(N * D,), out_shape=out_shape, backend=backend, num_warps=cfg.num_warps,
      num_stages=cfg.num_stages,
      H=H, K=K, HV=HV, M=M, BH=BH, BK=BK, BHV=_configs._next_pow2(HV),
      BM=_configs._next_pow2(M), ALLOW_NEG_EIGVAL=bool(allow_neg_eigval),
      # Triton's interpreter cannot call libdevice (see the kernel's docstring).
      USE_LIBDEVICE=backend != "interpret")
  return q_fold, g_fold, beta
