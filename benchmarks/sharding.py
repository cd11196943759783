"""Scaling over 2 GPUs: the training step and the decode step on 1 GPU and on 2 GPUs.

Every step is timed on one GPU, then (with two GPUs visible) on two, the same global problem
split over them by `gdp_jax.sharding.sharded` in each of its two ways:

  batch   sequences (and cache slots) over the mesh axis "data"
  heads   value heads over the mesh axis "model"

Parts (--parts, default all):

  op      fwd+bwd of chunk_gated_delta_product: jax.jit of jax.vjp, the output's cotangent an
          input (so no loss reduction runs across the GPUs), gradients w.r.t. q, k, v, g, beta;
          bf16, q and k L2-normalised in the op (train.py's rows 0 and 4)
  model   one SGD step of the example model (examples/sharded_lm.py: TinyLM, 2 layers, bf16
          parameters and activations), parameters replicated and donated, XLA summing their
          gradients over the GPUs
  decode  one gated_delta_product_decode step with the float32 cache donated and threaded from
          call to call, as a serving loop runs it; under "batch" each request's slot lies on
          its own GPU

Each row: ms per step (common.time_jax), and on 2 GPUs `speedup` = 1-GPU ms / 2-GPU ms and
`efficiency` = speedup / 2 (1.00: perfect strong scaling). On one GPU only the 1-GPU rows run,
so the script doubles as a smoke test of a single H200.

    python3 benchmarks/sharding.py [--parts op,model,decode] [--out DIR]
    python3 benchmarks/sharding.py --cpu-smoke      # 2 host CPU devices, backend "reference",
                                                    # tiny shapes: checks the plumbing only

Writes $OUT/sharding.json (or DIR, or ./bench_out) after every row.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import common  # noqa: E402

PARTS = ("op", "model", "decode")


def _args():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
  p.add_argument("--cpu-smoke", action="store_true",
                 help="2 host CPU devices and the reference backend, tiny shapes")
  p.add_argument("--out", default=None, help="directory for sharding.json (default $OUT)")
  a = p.parse_args()
  a.parts = [x for x in a.parts.split(",") if x]
  bad = [x for x in a.parts if x not in PARTS]
  if bad:
    p.error(f"--parts: unknown {bad}; expected a subset of {PARTS}")
  return a


def shapes(smoke: bool) -> dict:
  """The rows of each part."""
  if smoke:
    return dict(op=[dict(B=2, T=64, H=2, HV=4, K=16, V=16, M=2)],
                model=[dict(B=2, T=32, hidden=32, layers=2, H=2, HV=4, K=8, expand_v=2, M=2,
                            vocab=64)],
                decode=[dict(N=4, D=1, H=2, HV=4, K=16, V=16, M=2),
                        dict(N=4, D=2, H=2, HV=4, K=16, V=16, M=2)])
  return dict(
      op=[dict(B=4, T=2048, H=16, HV=16, K=128, V=128, M=2),
          dict(B=4, T=2048, H=6, HV=6, K=256, V=512, M=2)],
      model=[dict(B=8, T=1024, hidden=1024, layers=2, H=8, HV=8, K=128, expand_v=1, M=2,
                  vocab=4096)],
      decode=[dict(N=N, D=D, H=8, HV=32, K=128, V=128, M=2)
              for N, D in ((32, 1), (128, 1), (512, 1), (128, 4))])


# --------------------------------------------------------------------------------------------
# One timed step per part: returns a callable that runs one step on the given layout.
# --------------------------------------------------------------------------------------------

def _placer(jax, mesh, shardings, device):
  """put(name, x): onto `device` without a mesh, else into the wrapper's layout."""
  if mesh is None:
    return lambda n, x: jax.device_put(x, device)
  return lambda n, x: jax.device_put(x, shardings[n])


def op_step(jax, jnp, np, gdp_jax, sharded, shp, mesh, layout, device, backend, dtype):
  """fwd+bwd of the prefill: one jitted vjp, the cotangent of o given."""
  B, T, H, HV, K, V, M = (shp[k] for k in ("B", "T", "H", "HV", "K", "V", "M"))
  rng = np.random.default_rng(0)
  normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  x = dict(q=normal(B, T, H, K).astype(dtype), k=normal(B, T * M, H, K).astype(dtype),
           v=normal(B, T * M, HV, V).astype(dtype),
           g=jax.nn.log_sigmoid(normal(B, T, HV)),
           beta=jax.nn.sigmoid(normal(B, T * M, HV)).astype(dtype))
  names = ("q", "k", "v", "g", "beta")
  op = gdp_jax.chunk_gated_delta_product
  kw = dict(num_householder=M, use_qk_l2norm_in_kernel=True, backend=backend)
  if mesh is not None:
    op = sharded(op, mesh, **layout)
  put = _placer(jax, mesh, None if mesh is None else op.in_shardings(**x, **kw), device)
  args = [put(n, x[n]) for n in names]
  do = put("v", normal(B, T, HV, V).astype(dtype))   # o is laid out like v

  @jax.jit
  def step(q, k, v, g, beta, do):
    _, pull = jax.vjp(lambda *a: op(*a, **kw)[0], q, k, v, g, beta)
    return pull(do)

  return lambda: step(*args, do)


def model_step(jax, jnp, np, shp, mesh, device, backend, dtype):
  """One SGD step of the example model, tokens split over "data", ops over "model"."""
  import flax.nnx as nnx
  sys.path.insert(0, REPO)
  from examples import sharded_lm as sl
  from examples import tiny_lm as em
  model = em.TinyLM(vocab_size=shp["vocab"], hidden_size=shp["hidden"],
                    num_layers=shp["layers"], head_dim=shp["K"], expand_v=shp["expand_v"],
                    num_heads=shp["H"], num_v_heads=shp["HV"], num_householder=shp["M"],
                    backend=backend, param_dtype=dtype, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  tokens = jnp.asarray(np.random.default_rng(0).integers(
      0, shp["vocab"], (shp["B"], shp["T"] + 1)), jnp.int32)
  # A tiny step: the timed loop runs many steps and the parameters should stay finite.
  step = sl.train_step(graphdef, mesh, learning_rate=1e-4)
  if mesh is None:
    holder = {"p": jax.device_put(params, device)}
    tokens = jax.device_put(tokens, device)
  else:
    holder = {"p": jax.device_put(params, sl.replicated(mesh))}
    tokens = jax.device_put(tokens, sl.batch_sharding(mesh))

  def call():
    holder["p"], loss = step(holder["p"], tokens)   # params donated: threaded through
    return loss
  return call


def decode_step(jax, jnp, np, gdp_jax, sharded, shp, mesh, layout, device, backend, dtype):
  """One decode step with the cache donated and threaded from call to call."""
  N, D, H, HV, K, V, M = (shp[k] for k in ("N", "D", "H", "HV", "K", "V", "M"))
  S = N
  rng = np.random.default_rng(0)
  normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  # Slots shuffled within each half, so that under "batch" request n's slot lies on its GPU.
  half = S // 2
  slots = np.concatenate([rng.permutation(half), half + rng.permutation(S - half)])
  x = dict(q=normal(N, D, H, K).astype(dtype),
           k=(normal(N, D * M, H, K) / np.sqrt(K)).astype(dtype),
           v=normal(N, D * M, HV, V).astype(dtype),
           g=jnp.asarray(-rng.uniform(0.01, 0.3, (N, D, HV)), jnp.float32),
           beta=jnp.asarray(rng.uniform(0.1, 0.9, (N, D * M, HV)), dtype),
           state=jnp.zeros((S, HV, K, V), jnp.float32),
           state_indices=jnp.asarray(slots, jnp.int32))
  op = gdp_jax.gated_delta_product_decode
  if mesh is not None:
    op = sharded(op, mesh, **layout)
  shard = None if mesh is None else op.in_shardings(
      x["q"], x["k"], x["v"], x["g"], x["beta"], num_householder=M, state=x["state"],
      state_indices=x["state_indices"])
  put = _placer(jax, mesh, shard, device)
  names = ("q", "k", "v", "g", "beta", "state_indices")
  args = [put(n, x[n]) for n in names]
  holder = {"state": put("state", x["state"])}

  def one(q, k, v, g, beta, state_indices, state):
    return op(q, k, v, g, beta, num_householder=M, state=state, state_indices=state_indices,
              backend=backend)

  step = jax.jit(one, donate_argnums=(6,))

  def call():
    o, holder["state"] = step(*args, holder["state"])
    return o, holder["state"]
  return call


# --------------------------------------------------------------------------------------------

def main():
  a = _args()
  common.setup_env(a.cpu_smoke)
  if a.cpu_smoke:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=2").strip()
  import jax
  import jax.numpy as jnp
  import numpy as np

  sys.path.insert(0, REPO)
  import gdp_jax
  from gdp_jax.sharding import sharded

  if a.cpu_smoke:
    devices, backend, dtype = jax.devices()[:2], "reference", jnp.float32
  else:
    devices = [d for d in jax.devices() if d.platform == "gpu"]
    backend, dtype = "triton", jnp.bfloat16
    if not devices:
      raise SystemExit(f"no GPU visible ({jax.devices()}); use --cpu-smoke on a CPU")
  n_dev = min(2, len(devices))
  layouts = [("1 GPU", 1, None)]
  if n_dev == 2:
    layouts += [("2 GPUs, batch", 2, dict(batch_axis="data")),
                ("2 GPUs, heads", 2, dict(head_axis="model"))]
  else:
    print(f"# one device visible ({devices[0].device_kind}): the 1-GPU rows only", flush=True)

  out = common.out_dir(a.out)
  path = os.path.join(out, "sharding.json")
  meta = dict(common.run_meta(common.versions()), title="scaling over 2 GPUs: training step "
              "and decode step, 1 GPU against 2", device=f"{n_dev} x {devices[0].device_kind}",
              smoke=a.cpu_smoke)
  rows = []

  def save():
    with open(path, "w") as f:
      json.dump({"meta": meta, "rows": rows}, f, indent=1)

  table = shapes(a.cpu_smoke)
  for part in a.parts:
    for shp in table[part]:
      base = None
      for name, gpus, layout in layouts:
        row = dict(part=part, layout=name, gpus=gpus, **shp, backend=backend,
                   dtype=jnp.dtype(dtype).name)
        try:
          mesh = None
          if layout is not None:
            # examples/sharded_lm.py's mesh: ("data", "model") with Auto axes, one of size 2.
            mesh_shape = (2, 1) if "batch_axis" in layout else (1, 2)
            mesh = jax.make_mesh(mesh_shape, ("data", "model"), devices=devices[:2],
                                 axis_types=(jax.sharding.AxisType.Auto,) * 2)
          if part == "op":
            call = op_step(jax, jnp, np, gdp_jax, sharded, shp, mesh, layout, devices[0],
                           backend, dtype)
          elif part == "model":
            call = model_step(jax, jnp, np, shp, mesh, devices[0], backend, dtype)
          else:
            call = decode_step(jax, jnp, np, gdp_jax, sharded, shp, mesh, layout, devices[0],
                               backend, dtype)
          t = common.time_jax(call, target_s=0.05)
          row.update(ms=t["ms"], spread=t["spread"])
          if gpus == 1:
            base = t["ms"]
          elif base is not None:
            row["speedup"] = base / t["ms"]
            row["efficiency"] = row["speedup"] / gpus
        except Exception as e:  # one failing row still leaves the others' numbers
          row["error"] = f"{type(e).__name__}: {e}"[:500]
          traceback.print_exc()
        rows.append(row)
        save()
        print(json.dumps(row), flush=True)

  print(f"\n== ms per step on 1 and {n_dev} device(s) (efficiency 1.00 = perfect scaling)")
  for r in rows:
    shape = " ".join(f"{k}={r[k]}" for k in ("B", "T", "N", "D", "H", "HV", "K", "V", "M")
                     if k in r)
    if "error" in r:
      print(f"{r['part']:>6} {r['layout']:<14} {shape:<40} error: {r['error']}")
      continue
    eff = f"{r['speedup']:.2f}x  eff {r['efficiency']:.2f}" if "speedup" in r else ""
    print(f"{r['part']:>6} {r['layout']:<14} {shape:<40} {r['ms']:9.3f} ms  {eff}")
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
