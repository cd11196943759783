"""Error of bfloat16 draft-token snapshots against float32 ones, over a long speculative decode.

With `num_accepted` the snapshots are the state of record (docs/api.md): each step starts every
request from its snapshot after the tokens the last step kept, so a bfloat16 snapshot buffer
rounds the state once per step, as a bfloat16 cache does, while halving the D snapshot writes.
This decodes the same random stream twice through `gated_delta_product_decode(...,
num_accepted=...)` (float32 cache, D draft tokens per step, random accepted counts in 1..D),
with float32 and with bfloat16 snapshots, and prints the relative error of the outputs and of
the accepted state at chosen steps. The jnp reference rounds where the kernel does (when it
stores a snapshot), so this runs the reference under jit on any device; gating as in
bf16_cache_error.py (FLA's initialisation of A_log and dt_bias, beta = sigmoid(b), L2-normalised
q and k).

    python benchmarks/bf16_snapshot_error.py [--steps 300] [--D 4] [--out benchmarks/bf16_snapshot_error.json]
"""
import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from gdp_jax import reference

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bf16_cache_error import decode_stream  # noqa: E402  (the same stream and gating)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--D", type=int, default=4)
  p.add_argument("--N", type=int, default=4)
  p.add_argument("--H", type=int, default=2)
  p.add_argument("--HV", type=int, default=4)
  p.add_argument("--K", type=int, default=128)
  p.add_argument("--V", type=int, default=128)
  p.add_argument("--M", type=int, default=2)
  p.add_argument("--out", default=None)
  a = p.parse_args()
  N, H, HV, K, V, M, D, steps = a.N, a.H, a.HV, a.K, a.V, a.M, a.D, a.steps
  rng = np.random.default_rng(0)
  xs = decode_stream(rng, steps, N, D, H, HV, K, V, M)
  xs.update(
      # The counts verification gave the previous step (0 before the first: from the cache).
      n=jnp.asarray(np.concatenate([np.zeros((1, N)), rng.integers(1, D + 1, (steps - 1, N))]),
                    jnp.int32))
  slots = jnp.arange(N, dtype=jnp.int32)

  def run(snap_dtype):
    def step(snaps, x):
      o, _, snaps = reference.gated_delta_product_decode(
          x["q"], x["k"], x["v"], x["g"], x["beta"], num_householder=M,
          state=jnp.zeros((N, HV, K, V), jnp.float32), state_indices=slots,
          intermediate_states=snaps, num_accepted=x["n"], use_qk_l2norm_in_kernel=True)
      return snaps, (o.astype(jnp.float32), snaps.astype(jnp.float32))
    _, (o, snaps) = jax.jit(lambda c: jax.lax.scan(step, c, xs))(
        jnp.zeros((N, D, HV, K, V), snap_dtype))
    # The state of record after step t: the snapshot after the tokens step t + 1 starts from.
    n_next = np.concatenate([np.asarray(xs["n"])[1:], np.full((1, N), D)])
    kept = np.asarray(snaps)[np.arange(steps)[:, None], np.arange(N)[None], n_next - 1]
    return np.asarray(o, np.float64), kept.astype(np.float64)

  o32, s32 = run(jnp.float32)
  o16, s16 = run(jnp.bfloat16)
  rel = lambda r, x: float(np.linalg.norm(x - r) / np.linalg.norm(r))
  # Mean tokens a request has kept before each step (after step 1, before step 2, ...).
  tokens = np.cumsum(np.asarray(xs["n"])[1:].mean(1))
  rows = []
  print(f"bf16 vs float32 snapshots, speculative decode with D={D} (random counts 1..D), "
        f"N={N} H={H} HV={HV} K={K} V={V} M={M}, float32 cache, bf16 inputs")
  print(f"{'step':>6} {'tokens before':>13} {'o rel err':>10} {'state rel err':>14}")
  for t in sorted({1, 10, 100, steps // 2, steps}):
    if t > steps:
      continue
    r = dict(step=t, tokens_before=float(tokens[t - 2]) if t > 1 else 0.0,
             o=rel(o32[t - 1], o16[t - 1]), state=rel(s32[t - 1], s16[t - 1]))
    rows.append(r)
    print(f"{t:>6} {r['tokens_before']:>13.0f} {r['o']:>10.2e} {r['state']:>14.2e}")
  worst = dict(o=max(rel(o32[t], o16[t]) for t in range(steps)),
               state=max(rel(s32[t], s16[t]) for t in range(steps)))
  print(f"worst over all {steps} steps: o {worst['o']:.2e}, state {worst['state']:.2e}")
  if a.out:
    import common  # noqa: E402  (only for the run's meta: date, commit, command, versions)
    meta = dict(common.run_meta(common.versions()),
                title=f"bfloat16 snapshots against float32 over {steps} speculative steps of "
                      f"D = {D} (jnp reference)")
    with open(a.out, "w") as f:
      json.dump(dict(meta=meta, config=vars(a), rows=rows, worst=worst), f, indent=1)


if __name__ == "__main__":
  main()
