"""The decode prepare step in plain jax.numpy: gating and the Householder fold (docs/algorithm.md §8).

    g    = -exp(A_log) * softplus(a + dt_bias)     float32, per (token, value head)
    beta = sigmoid(b) = 1 / (1 + exp(-b))          float32, per (expanded row, value head); x2
                                                   with allow_neg_eigval
    softplus(x) = x if x > 20 else log1p(exp(x))   torch's default threshold

`decay_gate` and `beta_gate` are the gates alone, for any layout (prefill uses them on the
token stream as it is); `gated_delta_product_decode_prepare` also folds q and g into the
expanded stream the way `gdp_jax.gated_delta_product_decode` does internally.
"""
import jax.numpy as jnp

from gdp_jax._common import softplus as _softplus


def decay_gate(a, A_log, dt_bias):
  """Log decays `-exp(A_log) * softplus(a + dt_bias)`, in float32.

  Args:
    a: decay pre-activation [..., HV], any float dtype.
    A_log: [HV], log of the decay rate A (float32 parameter).
    dt_bias: [HV], added to `a` before the softplus.

  Returns:
    g [..., HV] float32, <= 0.
  """
  f32 = jnp.float32
  x = a.astype(f32) + dt_bias.astype(f32)
  return -jnp.exp(A_log.astype(f32)) * _softplus(x)


def beta_gate(b, allow_neg_eigval=False):
  """Update strengths `1 / (1 + exp(-b))`, doubled with allow_neg_eigval, in float32.

  Args:
    b: beta pre-activation, any shape and float dtype.
    allow_neg_eigval: scale to (0, 2), so that a Householder factor I - beta k k^T may have the
      eigenvalue -1 (FLA's option of the same name).

  Returns:
    beta, shaped like b, float32.
  """
  beta = 1 / (1 + jnp.exp(-b.astype(jnp.float32)))
  return beta * 2 if allow_neg_eigval else beta


def gated_delta_product_decode_prepare(q, k, v, a, b, A_log, dt_bias, *, num_householder,
                                       allow_neg_eigval=False):
  """Twin of `gdp_jax.gated_delta_product_decode_prepare`.

  Args:
    q: queries [N, D, H, K] for D draft tokens per request.
    k: keys [N, D*M, H, K]; not read (already in the folded layout).
    v: values [N, D*M, HV, V]; not read (already in the folded layout).
    a: decay pre-activation [N, D, HV].
    b: beta pre-activation [N, D*M, HV]; draft token d owns rows d*M .. d*M+M-1.
    A_log: [HV] float32.
    dt_bias: [HV] float32.
    num_householder: M.
    allow_neg_eigval: beta in (0, 2) instead of (0, 1).

  Returns:
    (q_fold [N, D*M, H, K] in q.dtype: q[:, d] on row d*M + M-1, zeros elsewhere;
     g_fold [N, D*M, HV] float32: decay_gate(a)[:, d] on row d*M, zeros elsewhere;
     beta [N, D*M, HV] float32: beta_gate(b)).
  """
  del k, v
  M = num_householder
  N, D, H, K = q.shape
  HV = a.shape[-1]
  q_fold = jnp.zeros((N, D, M, H, K), q.dtype).at[:, :, M - 1].set(q).reshape(N, D * M, H, K)
  g = decay_gate(a, A_log, dt_bias)
  g_fold = jnp.zeros((N, D, M, HV), jnp.float32).at[:, :, 0].set(g).reshape(N, D * M, HV)
  return q_fold, g_fold, beta_gate(b, allow_neg_eigval)
