"""Head sharding over 2 GPUs: the decode step at 2x heads on 2 GPUs vs half the heads on one GPU.

`gdp_jax.sharding.sharded(..., head_axis="model")` splits value heads over the GPUs with no
communication, so a step with HV heads on 2 GPUs should take as long as a step with HV / 2 heads
on one GPU (ratio 1.0; above 1 is the cost of the sharded launch), and half as long as HV heads
on one GPU (speedup 2.0). Each timed call is one jitted Gated Delta Product decode step with the
cache donated, threaded from call to call as in a serving loop.

    python benchmarks/sharding.py                 # GPU: needs 2 visible GPUs
    python benchmarks/sharding.py --cpu-smoke     # CPU, 2 host devices, reference backend:
                                                  # checks the plumbing, times mean nothing

Prints one table row per shape and writes $OUT/sharding.json (or ./bench_out/sharding.json).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def _args():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--cpu-smoke", action="store_true",
                 help="2 host CPU devices and the reference backend, tiny shapes")
  p.add_argument("--out", default=None, help="directory for sharding.json (default $OUT)")
  return p.parse_args()


def _inputs(rng, N, D, M, H, HV, K, V, S, dtype):
  import jax.numpy as jnp
  import numpy as np
  normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  return dict(
      q=normal(N, D, H, K).astype(dtype),
      k=(normal(N, D * M, H, K) / np.sqrt(K)).astype(dtype),
      v=normal(N, D * M, HV, V).astype(dtype),
      g=jnp.asarray(-rng.uniform(0.01, 0.3, (N, D, HV)), jnp.float32),
      beta=jnp.asarray(rng.uniform(0.1, 0.9, (N, D * M, HV)), dtype),
      state=jnp.zeros((S, HV, K, V), jnp.float32),
      state_indices=jnp.asarray(rng.permutation(S)[:N], jnp.int32))


def _step_timer(decode, x, place, M, backend):
  """Milliseconds per decode step of `decode` on inputs placed by place(name, array)."""
  import jax
  names = ("q", "k", "v", "g", "beta", "state_indices")
  args = [place(n, x[n]) for n in names]
  holder = {"state": place("state", x["state"])}

  def step(q, k, v, g, beta, state_indices, state):
    return decode(q, k, v, g, beta, num_householder=M, state=state, state_indices=state_indices,
                  backend=backend)

  # The cache is donated and threaded from step to step, as a serving loop does.
  step = jax.jit(step, donate_argnums=(6,))

  def call():
    o, holder["state"] = step(*args, holder["state"])
    return o, holder["state"]

  return common.time_jax(call, target_s=0.05, repeats=7, warmup=2)["ms"]


def main():
  a = _args()
  if a.cpu_smoke:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=2").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  import jax.numpy as jnp
  import numpy as np

  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import gdp_jax
  from gdp_jax import sharding

  if a.cpu_smoke:
    devices, backend, dtype = jax.devices()[:2], "reference", jnp.float32
    shapes = [dict(N=4, D=1, M=2, H=2, HV=4, K=16, V=16)]
  else:
    devices = [d for d in jax.devices() if d.platform == "gpu"]
    backend, dtype = "triton", jnp.bfloat16
    shapes = [dict(N=N, D=D, M=2, H=8, HV=32, K=128, V=128)
              for N, D in ((32, 1), (128, 1), (512, 1), (128, 4))]
  if len(devices) < 2:
    print(f"skipped: needs 2 GPUs, {len(devices)} visible ({jax.devices()})")
    return
  mesh = jax.make_mesh((2,), ("model",), devices=devices[:2])
  decode = gdp_jax.gated_delta_product_decode
  sharded_decode = sharding.sharded(decode, mesh, head_axis="model")
  rng = np.random.default_rng(0)
  rows = []
  for shp in shapes:
    N, D, M, H, HV, K, V = (shp[k] for k in ("N", "D", "M", "H", "HV", "K", "V"))
    S = N
    row = dict(shp, S=S, backend=backend, dtype=jnp.dtype(dtype).name)
    try:
      full = _inputs(rng, N, D, M, H, HV, K, V, S, dtype)
      half = _inputs(rng, N, D, M, H // 2, HV // 2, K, V, S, dtype)
      shard = sharded_decode.in_shardings(
          full["q"], full["k"], full["v"], full["g"], full["beta"], num_householder=M,
          state=full["state"], state_indices=full["state_indices"])
      one = lambda n, x: jax.device_put(x, devices[0])
      two = lambda n, x: jax.device_put(x, shard[n])
      row["two_gpus_ms"] = _step_timer(sharded_decode, full, two, M, backend)
      row["one_gpu_half_ms"] = _step_timer(decode, half, one, M, backend)
      row["one_gpu_full_ms"] = _step_timer(decode, full, one, M, backend)
      row["ratio_vs_half"] = row["two_gpus_ms"] / row["one_gpu_half_ms"]
      row["speedup_vs_full"] = row["one_gpu_full_ms"] / row["two_gpus_ms"]
    except Exception as e:  # one failing shape still leaves the others' numbers
      row["error"] = f"{type(e).__name__}: {e}"[:500]
    rows.append(row)
    print(json.dumps(row), flush=True)

  out_dir = a.out or os.environ.get("OUT") or "./bench_out"
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "sharding.json"), "w") as f:
    meta = dict(common.run_meta(common.versions()), device=f"2 x {devices[0].device_kind}")
    json.dump({"meta": meta, "device": str(devices[0].device_kind), "jax": jax.__version__,
               "rows": rows}, f, indent=1)
  print("\n== decode step, heads sharded over 2 devices (ms per step; ratio 1.0 = perfect)")
  print(f"{'N':>5} {'D':>2} {'HV':>4} {'2dev HV':>9} {'1dev HV/2':>10} {'1dev HV':>9} "
        f"{'ratio':>6} {'speedup':>8}")
  for r in rows:
    if "error" in r:
      print(f"{r['N']:>5} {r['D']:>2} {r['HV']:>4}  error: {r['error']}")
      continue
    print(f"{r['N']:>5} {r['D']:>2} {r['HV']:>4} {r['two_gpus_ms']:>9.4f} "
          f"{r['one_gpu_half_ms']:>10.4f} {r['one_gpu_full_ms']:>9.4f} "
          f"{r['ratio_vs_half']:>6.2f} {r['speedup_vs_full']:>8.2f}")


if __name__ == "__main__":
  main()
