"""Error of a bfloat16 decode state cache against a float32 one, over many decode steps.

The decode kernel loads the cache, runs the step's M Householder updates in float32 registers and
rounds once when it stores the state back; the jnp reference rounds at exactly the same point (once
per call), so this measurement runs the reference under jit on any device. It decodes the same
random token stream twice, through a float32 cache and through a bfloat16 cache, and prints the
relative error of the outputs and of the state at chosen steps, for a realistic gating
(FLA's layer initialisation of A_log and dt_bias, beta = sigmoid(b), L2-normalised q and k).

    python benchmarks/bf16_cache_error.py [--steps 1000] [--out benchmarks/bf16_cache_error.json]

With --out, the rows go to a JSON file whose "meta" (date, commit, command, versions) lets
benchmarks/make_results.py put them in benchmarks/RESULTS.md.
"""
import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from gdp_jax import reference


def decode_stream(rng, steps, N, D, H, HV, K, V, M):
  """`steps` decode steps of N requests with D tokens each, bf16 q, k, v and the layers' gating:
  FLA's initialisation A ~ U(0, 16), dt log-uniform in [1e-3, 1e-1], dt_bias = softplus^-1(dt),
  g = decay_gate(a), beta = sigmoid(b), a and b standard normal."""
  A_log = jnp.asarray(np.log(rng.uniform(0, 16, HV)), jnp.float32)
  dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), HV))
  dt_bias = jnp.asarray(dt + np.log(-np.expm1(-dt)), jnp.float32)
  return dict(
      q=jnp.asarray(rng.standard_normal((steps, N, D, H, K)), jnp.bfloat16),
      k=jnp.asarray(rng.standard_normal((steps, N, D * M, H, K)), jnp.bfloat16),
      v=jnp.asarray(rng.standard_normal((steps, N, D * M, HV, V)), jnp.bfloat16),
      g=reference.decay_gate(jnp.asarray(rng.standard_normal((steps, N, D, HV)), jnp.float32),
                             A_log, dt_bias),
      beta=reference.beta_gate(jnp.asarray(rng.standard_normal((steps, N, D * M, HV)),
                                           jnp.float32)),
  )


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--steps", type=int, default=1000)
  p.add_argument("--N", type=int, default=4)
  p.add_argument("--H", type=int, default=2)
  p.add_argument("--HV", type=int, default=4)
  p.add_argument("--K", type=int, default=128)
  p.add_argument("--V", type=int, default=128)
  p.add_argument("--M", type=int, default=2)
  p.add_argument("--out", default=None)
  a = p.parse_args()
  N, H, HV, K, V, M, steps = a.N, a.H, a.HV, a.K, a.V, a.M, a.steps
  rng = np.random.default_rng(0)
  xs = decode_stream(rng, steps, N, 1, H, HV, K, V, M)
  slots = jnp.arange(N, dtype=jnp.int32)

  def run(cache_dtype):
    def step(cache, x):
      o, cache = reference.gated_delta_product_decode(
          x["q"], x["k"], x["v"], x["g"], x["beta"], num_householder=M, state=cache,
          state_indices=slots, use_qk_l2norm_in_kernel=True)
      return cache, (o.astype(jnp.float32), cache.astype(jnp.float32))
    _, (o, states) = jax.jit(lambda c: jax.lax.scan(step, c, xs))(
        jnp.zeros((N, HV, K, V), cache_dtype))
    return np.asarray(o, np.float64), np.asarray(states, np.float64)

  o32, s32 = run(jnp.float32)
  o16, s16 = run(jnp.bfloat16)
  rel = lambda r, x: float(np.linalg.norm(x - r) / np.linalg.norm(r))
  rows = []
  print(f"bf16 vs float32 decode cache, N={N} H={H} HV={HV} K={K} V={V} M={M}, bf16 inputs")
  print(f"{'step':>6} {'o rel err':>10} {'state rel err':>14} {'|state|':>9}")
  for t in sorted({1, 10, 100, 300, steps // 2, steps}):
    if t > steps:
      continue
    r = dict(step=t, o=rel(o32[t - 1], o16[t - 1]), state=rel(s32[t - 1], s16[t - 1]),
             state_norm=float(np.linalg.norm(s32[t - 1]) / np.sqrt(N * HV)))
    rows.append(r)
    print(f"{t:>6} {r['o']:>10.2e} {r['state']:>14.2e} {r['state_norm']:>9.2f}")
  worst = dict(o=max(rel(o32[t], o16[t]) for t in range(steps)),
               state=max(rel(s32[t], s16[t]) for t in range(steps)))
  print(f"worst over all {steps} steps: o {worst['o']:.2e}, state {worst['state']:.2e}")
  if a.out:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import common  # noqa: E402  (only for the run's meta: date, commit, command, versions)
    meta = dict(common.run_meta(common.versions()),
                title=f"bfloat16 decode cache against float32 over {steps} steps (jnp reference)")
    with open(a.out, "w") as f:
      json.dump(dict(meta=meta, config=vars(a), rows=rows, worst=worst), f, indent=1)


if __name__ == "__main__":
  main()
