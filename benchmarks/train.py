"""Training benchmark: fwd+bwd time and peak device memory of Gated Delta Product, side by side.

Implementations (each row: loss = sum(o * do) over the layer's output o, gradients w.r.t. q, k, v,
g, beta; bf16 activations, float32 logsigmoid decays, beta = sigmoid(normal) in (0, 1), q and k
L2-normalised inside the op as the layers do; scale K**-0.5 everywhere):

  ours          gdp_jax.chunk_gated_delta_product, backend "triton":
                jax.jit(jax.value_and_grad(loss, argnums=(q, k, v, g, beta)))
  jla           jax-linear-attention 0.1.0, jla.ops.mosaic_gpu.gated_delta_product (Mosaic GPU,
                Hopper only; K and V in {64, 128}: it refuses K = 256); packed sequences as
                segment_ids [1, T]
  fla           fla-core 0.6.0 (torch), fla.ops.gated_delta_product.chunk_gated_delta_product,
                ungated (g = None): torch.autograd.grad(o, (q, k, v, beta), grad_outputs=do)
  fla_gated     the same with g (its gated backward raises on Hopper with Triton 3.6: the row
                records "refused: <message>")
  reference     gdp_jax's backend "reference" (the jnp lax.scan), first row only (slow)
  ours_ungated  ours with g = None, fla's like-for-like partner (opt-in: --only ...,ours_ungated)

Rows: B=4 T=2048 H=16 K=V=128 M=2 | the same with M=3 | B=1 T=8192 H=16 M=2 |
      8 packed sequences of random lengths, 16384 tokens, H=16 M=2 |
      B=4 T=2048 H=6 K=256 V=512 M=2 (the FLA layer's defaults)

Method. JAX cannot reset its peak-memory counter, so every (row, JAX implementation) runs in a
fresh subprocess of this script: its inputs are made on the host and copied to the device (no
device temporaries), and `memory_stats()['peak_bytes_in_use']` after the first fwd+bwd call is
that call's peak, inputs included (`inputs_bytes` is what the inputs alone hold; XLA's own
compile-time account, `memory_analysis()`, is recorded beside it). fla-core runs in one torch
subprocess per row (ungated, then gated): its peak is `torch.cuda.max_memory_allocated()` over one
call after `reset_peak_memory_stats()`, inputs included, autotuning done before. This parent
process imports neither jax nor torch, so it holds no device memory.
Times: JAX, the median over repeats of a batch of back-to-back calls timed to
block_until_ready (common.time_jax); torch, triton.testing.do_bench's median (common.time_torch)
and, where the capture works, the call replayed from a CUDA graph (its device time without its
Python launches). `kernel_ms` is the device time of the kernels alone (CUPTI, through
jax.profiler or torch.profiler: the sum of the kernels of three calls, over three), which a host
too slow to keep the GPU fed leaves unchanged while it inflates `time_ms`. All workers share one
Triton cache directory, so a worker's first call (`first_call_s`) is not a compile-time
measurement. The floor is the bytes fwd+bwd must move at least (q, k, v, g, beta and do read
once, their gradients written once) over 4.27 TB/s.
`agree` is the largest relative difference ||dX - dX_ours|| / ||dX_ours|| over 4096 sampled
entries of each gradient (the same positions in every worker), against ours (fla against
ours_ungated): a layout mistake shows as O(1), bf16 agreement as about 1e-2.

Usage (GPU, repository root on PYTHONPATH; `--out PATH` writes the results elsewhere):
  python3 benchmarks/train.py [--rows 0,3] [--only ours,jla,fla,fla_gated,reference] [--out F]
  python3 benchmarks/train.py --smoke     # CPU: tiny shapes, backend "reference" only
  python3 benchmarks/train.py --only ours,jla --bwd-config o_bk=128,o_warps=8   # ours under
      # other kernel configs (--config: FwdConfig fields, --bwd-config: BwdConfig fields)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import common  # noqa: E402

HBM_BPS = 4.27e12   # the floor's bandwidth (bytes/s), as the brief of this benchmark fixes it
IMPLS = ("ours", "jla", "fla", "fla_gated", "reference", "ours_ungated")
DEFAULT_IMPLS = ("ours", "jla", "fla", "fla_gated", "reference")
JAX_IMPLS = ("ours", "jla", "reference", "ours_ungated")
TORCH_IMPLS = ("fla", "fla_gated")
GATED = {"ours": True, "jla": True, "reference": True, "fla_gated": True, "fla": False,
         "ours_ungated": False}
# Whose gradient statistics each implementation is compared with (same function, same inputs).
PARTNER = {"jla": "ours", "reference": "ours", "fla_gated": "ours", "fla": "ours_ungated"}


def shapes(smoke: bool) -> list[dict]:
  """The rows. `N` packed sequences (B == 1) when "N" is given, with lengths drawn from `seed`."""
  if smoke:
    return [dict(B=2, T=128, H=2, K=32, V=32, M=2),
            dict(B=1, T=96, H=2, K=32, V=16, M=3),
            dict(B=1, T=192, H=2, K=32, V=32, M=2, N=3)]
  return [dict(B=4, T=2048, H=16, K=128, V=128, M=2),
          dict(B=4, T=2048, H=16, K=128, V=128, M=3),
          dict(B=1, T=8192, H=16, K=128, V=128, M=2),
          dict(B=1, T=16384, H=16, K=128, V=128, M=2, N=8),
          dict(B=4, T=2048, H=6, K=256, V=512, M=2)]


def min_bytes(s: dict, gated: bool) -> int:
  """Reads of q, k, v, beta, do (bf16) and g (float32), writes of their gradients (same dtypes)."""
  B, T, H, K, V, M = (s[n] for n in ("B", "T", "H", "K", "V", "M"))
  bf16 = 2 * (B * T * H * K + B * T * M * H * K + B * T * M * H * V + B * T * M * H)  # q k v beta
  read = bf16 + 2 * B * T * H * V + (4 * B * T * H if gated else 0)                  # + do, g
  write = bf16 + (4 * B * T * H if gated else 0)                                     # dq..dbeta, dg
  return read + write


# --------------------------------------------------------------------------------------------
# Inputs (host numpy, so neither framework makes device temporaries for them)
# --------------------------------------------------------------------------------------------


def host_inputs(s: dict, seed: int) -> dict:
  """numpy inputs of a row: bf16 (ml_dtypes) q, k, v, beta, do; float32 g; int32 packing."""
  import ml_dtypes
  import numpy as np
  B, T, H, K, V, M = (s[n] for n in ("B", "T", "H", "K", "V", "M"))
  rng = np.random.default_rng(seed)
  bf16 = ml_dtypes.bfloat16

  def normal(*shape):
    return rng.standard_normal(shape, dtype=np.float32)

  x = dict(q=normal(B, T, H, K).astype(bf16), k=normal(B, T * M, H, K).astype(bf16),
           v=normal(B, T * M, H, V).astype(bf16))
  u = rng.uniform(1.0, 5.0, (B, T, H)).astype(np.float32)
  x["g"] = (-np.log1p(np.exp(-u))).astype(np.float32)                   # logsigmoid(u) < 0
  x["beta"] = (1.0 / (1.0 + np.exp(-normal(B, T * M, H)))).astype(bf16)  # sigmoid, in (0, 1)
  x["do"] = normal(B, T, H, V).astype(bf16)
  if "N" in s:
    x.update(common.packing(common.seq_lengths(T, s["N"], seed)))
  return x


# --------------------------------------------------------------------------------------------
# Workers (subprocesses): one JAX implementation at one row, or fla-core (both variants) at a row
# --------------------------------------------------------------------------------------------


def _emit(path: str, rec: dict) -> None:
  """Appends one result line; the parent reads what a worker wrote even if it dies later."""
  with open(path, "a") as f:
    f.write(json.dumps(common._jsonable(rec)) + "\n")


def _jax_memory() -> dict:
  import jax
  try:
    st = jax.devices()[0].memory_stats() or {}
  except Exception:
    st = {}
  return {"in_use": st.get("bytes_in_use"), "peak": st.get("peak_bytes_in_use")}


SAMPLES = 4096   # gradient entries kept per input to compare implementations


def sample_index(name: str, size: int):
  """The same SAMPLES flat positions of gradient `name` in every worker."""
  import numpy as np
  seed = 1000 + ("q", "k", "v", "g", "beta").index(name)
  return np.random.default_rng(seed).integers(0, size, min(SAMPLES, size))


def _fingerprint(loss, names, grads, norm, take) -> dict:
  """loss, |dX| per gradient, and dX at `sample_index` positions (float32 lists, which the
  parent compares across implementations and then drops)."""
  fp = {"loss": float(loss)}
  for n, d in zip(names, grads):
    fp[f"d{n}_norm"] = float(norm(d))
    fp[f"d{n}_sample"] = [float(a) for a in take(d, n)]
  return fp


def jax_op(impl: str, s: dict, backend: str, configs: dict | None = None):
  """(o = op(q, k, v, g, beta, packing), names of the differentiated inputs) for a JAX impl;
  op.desc names the function it calls. configs: {"config": FwdConfig overrides, "bwd_config":
  BwdConfig overrides} for ours (and ours_ungated)."""
  M = s["M"]
  if impl in ("ours", "reference", "ours_ungated"):
    import gdp_jax
    b = "reference" if impl == "reference" else backend

    extra = {}
    if impl != "reference":
      for name, cls in (("config", gdp_jax.FwdConfig), ("bwd_config", gdp_jax.BwdConfig)):
        if configs and configs.get(name):
          extra[name] = cls(**configs[name])

    def op(q, k, v, g, beta, cu_seqlens=None, segment_ids=None):
      return gdp_jax.chunk_gated_delta_product(
          q, k, v, g, beta, num_householder=M, use_qk_l2norm_in_kernel=True,
          cu_seqlens=cu_seqlens, backend=b, **extra)[0]

    op.desc = "gdp_jax.chunk_gated_delta_product(" + ", ".join(
        [f"backend={b!r}"] + [f"{n}={c}" for n, c in extra.items()]) + ")"
  elif impl == "jla":
    jla_fn = common.jla_gated_delta_product(kernels=backend != "reference")

    def op(q, k, v, g, beta, cu_seqlens=None, segment_ids=None):
      return common.jla_call(jla_fn, q, k, v, g, beta, M, segment_ids=segment_ids)[0]

    op.desc = f"{jla_fn.__module__}.{jla_fn.__name__}"

  else:
    raise ValueError(impl)
  names = ("q", "k", "v", "g", "beta") if GATED[impl] else ("q", "k", "v", "beta")
  return op, names


# Device time per call: the kernels of KERNEL_CALLS back-to-back calls (CUPTI), summed, without
# the gaps between them, which on a GPU machine with a slow host can double the wall time.
KERNEL_CALLS = 3


def _kernel_ms(profile) -> float | str:
  try:
    return profile()["busy_us"] / KERNEL_CALLS / 1e3
  except Exception as e:             # a profiler that does not start costs the column only
    return f"{type(e).__name__}: {e}"[:200]


def jax_worker(task: dict, out: str) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np
  common.fix_triton_cache()
  impl, s, backend = task["impl"], task["shape"], task["backend"]
  rec = {"impl": impl, "backend": "reference" if impl == "reference" else backend,
         "device": str(jax.devices()[0].device_kind),
         "versions": {"jax": jax.__version__}}
  try:
    op, names = jax_op(impl, s, backend, task.get("configs"))
    rec["op"] = op.desc
    x = host_inputs(s, common.row_seed(s))
    # Only what this implementation reads goes to the device (jla packs by segment ids, the
    # others by cu_seqlens), so inputs_bytes is its inputs.
    pack = "segment_ids" if impl == "jla" else "cu_seqlens"
    dev = {k: jax.device_put(a) for k, a in x.items() if k in names or k in ("do", pack)}
    jax.block_until_ready(dev)
    rec["inputs_bytes"] = _jax_memory()["in_use"]
    f32 = jnp.float32
    packing = {pack: dev[pack]} if pack in dev else {}

    def loss(q, k, v, g, beta, do, packing):
      o = op(q, k, v, g, beta, **packing)
      return jnp.sum(o.astype(f32) * do.astype(f32))

    # Gradients w.r.t. q, k, v, g, beta (g is None, and not differentiated, when ungated).
    argnums = (0, 1, 2, 3, 4) if GATED[impl] else (0, 1, 2, 4)
    f = jax.jit(jax.value_and_grad(loss, argnums=argnums))
    args = (dev["q"], dev["k"], dev["v"], dev.get("g"), dev["beta"], dev["do"], packing)
    t0 = time.perf_counter()
    val, grads = f(*args)
    jax.block_until_ready(grads)
    rec["first_call_s"] = time.perf_counter() - t0
    rec["peak_bytes"] = _jax_memory()["peak"]
    norm = jax.jit(lambda a: jnp.sqrt(jnp.sum(jnp.square(a.astype(f32)))))

    def take(a, name):
      return np.asarray(a.reshape(-1)[sample_index(name, a.size)].astype(f32))

    rec["fingerprint"] = _fingerprint(val, names, grads, norm, take)
    rec["finite"] = all(bool(jnp.all(jnp.isfinite(gr.astype(f32)))) for gr in grads)
    del val, grads
    t = common.time_jax(lambda: f(*args))
    rec.update(time_ms=t["ms"], spread=t["spread"], batch=t["batch"], repeats=t["repeats"])
    rec["kernel_ms"] = _kernel_ms(lambda: common.profile_jax(lambda: f(*args), calls=KERNEL_CALLS))
    try:
      ma = f.lower(*args).compile().memory_analysis()
      rec["xla_memory"] = {k: getattr(ma, k, None) for k in (
          "argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
          "alias_size_in_bytes", "generated_code_size_in_bytes")}
    except Exception as e:
      rec["xla_memory"] = f"{type(e).__name__}: {e}"[:300]
  except ImportError as e:
    rec["skipped"] = f"not installed: {type(e).__name__}: {e}"[:300]
  except Exception as e:
    msg = f"{type(e).__name__}: {e}"[:800]
    if impl == "jla" and common.jla_refused(e):
      rec["refused"] = msg
    else:
      rec["error"] = msg
    traceback.print_exc()
  _emit(out, rec)


def torch_worker(task: dict, out: str) -> None:
  import numpy as np
  try:
    import torch
    common.fix_triton_cache()
    import fla as fla_pkg
    from fla.ops.gated_delta_product import chunk_gated_delta_product as fla
  except ImportError as e:
    for impl in task["impls"]:
      _emit(out, {"impl": impl, "skipped": f"not installed: {type(e).__name__}: {e}"[:300]})
    return
  s = task["shape"]
  M = s["M"]
  x = host_inputs(s, common.row_seed(s))

  def t(a, grad=False):
    if a.dtype == np.float32 or a.dtype == np.int32:
      tt = torch.from_numpy(a).cuda()
    else:                                      # bf16 through its bit pattern
      tt = torch.from_numpy(a.view(np.int16)).cuda().view(torch.bfloat16)
    return tt.requires_grad_(grad)

  torch.set_grad_enabled(True)
  cu = torch.from_numpy(x["cu_seqlens"].astype(np.int64)).cuda() if "cu_seqlens" in x else None
  base = {n: t(x[n], grad=n != "do") for n in ("q", "k", "v", "g", "beta", "do")}
  norm = lambda a: a.float().norm()                          # noqa: E731

  def take(a, name):
    i = torch.from_numpy(sample_index(name, a.numel())).cuda()
    return a.reshape(-1)[i].float().cpu().tolist()

  steps = {}
  for impl in task["impls"]:
    rec = {"impl": impl, "device": torch.cuda.get_device_name(),
           "versions": {"torch": torch.__version__, "fla": getattr(fla_pkg, "__version__", "?")}}
    names = ("q", "k", "v", "g", "beta") if GATED[impl] else ("q", "k", "v", "beta")
    inputs = [base[n] for n in names]
    g = base["g"] if GATED[impl] else None

    def step(inputs=inputs, g=g):
      o, _ = fla(base["q"], base["k"], base["v"], g, base["beta"], num_householder=M,
                 use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
      return o, torch.autograd.grad(o, inputs, grad_outputs=base["do"])

    try:
      t0 = time.perf_counter()
      step()                                   # autotunes (fwd and bwd kernels)
      torch.cuda.synchronize()
      rec["first_call_s"] = time.perf_counter() - t0
    except Exception as e:
      # The gated backward does not run on Hopper with Triton 3.6 (as of fla-core 0.6.0).
      rec["refused" if impl == "fla_gated" else "error"] = f"{type(e).__name__}: {e}"[:800]
      traceback.print_exc()
      _emit(out, rec)
      common.free_device_memory()
      continue
    try:
      torch.cuda.empty_cache()
      torch.cuda.reset_peak_memory_stats()
      rec["inputs_bytes"] = torch.cuda.memory_allocated()
      o, grads = step()
      torch.cuda.synchronize()
      rec["peak_bytes"] = torch.cuda.max_memory_allocated()
      lossv = (o.float() * base["do"].float()).sum()
      rec["fingerprint"] = _fingerprint(lossv, names, grads, norm, take)
      rec["finite"] = all(bool(torch.isfinite(gr.float()).all()) for gr in grads)
      del o, grads
      rec["time_ms"] = common.time_torch(lambda: step())
      rec["kernel_ms"] = _kernel_ms(lambda: common.profile_torch(step, calls=KERNEL_CALLS))
      steps[impl] = (rec, step)
    except Exception as e:
      rec["error"] = f"{type(e).__name__}: {e}"[:800]
      traceback.print_exc()
    _emit(out, rec)
    common.free_device_memory()
  # CUDA-graph replays last: a capture that fails (fla syncs on the host for packed inputs) may
  # leave the stream unusable for what would come after it.
  for impl, (rec, step) in steps.items():
    g_rec = {"impl": impl, "graph": True}
    try:
      g_rec["graph_ms"] = common.time_torch_graph(step, steps=1, replays=10, repeats=5)
    except Exception as e:
      g_rec["graph_error"] = f"{type(e).__name__}: {e}"[:300]
      print(f"[train] {impl} in a CUDA graph failed: {g_rec['graph_error']}", flush=True)
    _emit(out, g_rec)


def worker_main(task_json: str, out: str) -> None:
  task = json.loads(task_json)
  common.setup_env(task["smoke"])
  # One Triton cache for all workers (setup_env makes a fresh one per process): compiles and
  # fla-core's autotuning candidates are reused from worker to worker.
  os.environ["TRITON_CACHE_DIR"] = os.environ["GDP_BENCH_TRITON_CACHE"] = task["triton_cache"]
  if task["kind"] == "torch":
    torch_worker(task, out)
  else:
    jax_worker(task, out)


# --------------------------------------------------------------------------------------------
# Parent: runs the workers, merges their lines into rows, writes the JSON, prints the table
# --------------------------------------------------------------------------------------------


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--smoke", action="store_true",
                 help="CPU: tiny shapes, gdp_jax backend 'reference' only (and jla's jnp "
                      "reference in place of its kernels, when jla imports)")
  p.add_argument("--rows", default=None, help="comma-separated row numbers (default: all)")
  p.add_argument("--only", default=",".join(DEFAULT_IMPLS),
                 help=f"comma-separated implementations out of {','.join(IMPLS)}")
  p.add_argument("--ref-rows", default="0", help="rows that also run 'reference' (or 'all')")
  p.add_argument("--out", default=None,
                 help="JSON file (default benchmarks/train.json; bench_out/train_smoke.json with "
                      "--smoke)")
  p.add_argument("--budget-s", type=float, default=540.0,
                 help="start no worker after this many seconds (a started one is capped too)")
  p.add_argument("--worker-timeout-s", type=float, default=300.0)
  p.add_argument("--config", default="",
                 help="FwdConfig overrides for ours, e.g. 'solve_precision=tf32' (default: none)")
  p.add_argument("--bwd-config", default="",
                 help="BwdConfig overrides for ours, e.g. 'o_bk=128,o_warps=8' (default: none)")
  p.add_argument("--cache-dir", default=None,
                 help="Triton cache shared with an earlier run, fla-core's autotuning results "
                      "kept in it (first-call times then count no compile or autotuning)")
  p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
  return p.parse_args(argv)


def _parse_overrides(text: str) -> dict:
  """"o_bk=128,o_warps=8" -> {"o_bk": 128, "o_warps": 8}: ints where the value is digits."""
  out = {}
  for kv in filter(None, text.split(",")):
    name, _, value = kv.partition("=")
    out[name] = int(value) if value.lstrip("-").isdigit() else value
  return out


def _dist_versions() -> dict:
  """Installed versions, read from package metadata: importing jax or torch here would take
  device memory away from the workers."""
  from importlib import metadata
  out = {"python": sys.version.split()[0]}
  for key, dist in (("jax", "jax"), ("jaxlib", "jaxlib"), ("triton", "triton"),
                    ("jax_triton", "jax-triton"), ("jla", "jax-linear-attention"),
                    ("fla", "fla-core"), ("torch", "torch"), ("flax", "flax"),
                    ("numpy", "numpy"), ("gdp_jax", "gdp-jax")):
    try:
      out[key] = metadata.version(dist)
    except metadata.PackageNotFoundError:
      out[key] = None
  return out


def _git() -> dict:
  commit = common.git_commit()  # $GDP_COMMIT first: a copied tree's .git may name another commit
  return {"commit": commit.removesuffix("+dirty"), "dirty": commit.endswith("+dirty")}


class Run:
  """The output file and the workers. user_env: the environment this script started with."""

  def __init__(self, args, path, user_env):
    self.args = args
    self.path = path
    self.user_env = user_env
    self.data = {"meta": {}, "rows": []}

  def save(self):
    os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(common._jsonable(self.data), f, indent=1)
    os.replace(tmp, self.path)

  def spawn(self, task: dict, budget: common.Budget) -> list[dict]:
    """Runs one worker; returns its result lines. A worker that dies or runs past its cap leaves
    its lines so far, and the reason in an extra line."""
    fd, out = tempfile.mkstemp(prefix="gdp_train_", suffix=".jsonl")
    os.close(fd)
    cap = max(5.0, min(self.args.worker_timeout_s, budget.left() + 30.0))
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(task),
           "--worker-out", out]
    env = dict(os.environ)
    if task["kind"] == "jax" and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in self.user_env:
      env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.9"   # the worker is alone on the device
    print(f"[train] worker {task['kind']} {task.get('impl') or task.get('impls')} "
          f"{task['shape']} (cap {cap:.0f} s)", flush=True)
    t0 = time.perf_counter()
    # Its own session, so that a timeout stops it and anything it started, and nothing else.
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    extra = None
    try:
      rc = proc.wait(timeout=cap)
      if rc != 0:
        extra = f"worker exited with status {rc}"
    except subprocess.TimeoutExpired:
      extra = f"worker stopped after its cap of {cap:.0f} s"
      self._stop(proc)
    except KeyboardInterrupt:
      self._stop(proc)
      raise
    finally:
      lines = []
      with open(out) as f:
        lines = [json.loads(l) for l in f if l.strip()]
      os.unlink(out)
    for rec in lines:
      rec["worker_s"] = time.perf_counter() - t0
    if extra:
      lines.append({"worker_problem": extra})
    return lines

  @staticmethod
  def _stop(proc):
    try:
      os.killpg(proc.pid, signal.SIGTERM)
      proc.wait(timeout=20)
    except Exception:
      try:
        os.killpg(proc.pid, signal.SIGKILL)
      except Exception:
        pass


def _agree(fp: dict | None, ref: dict | None) -> float | None:
  """Largest ||dX - dX_ref|| / ||dX_ref|| over the sampled gradient entries of every input."""
  import numpy as np
  if not fp or not ref:
    return None
  worst = None
  for key, val in ref.items():
    if key.endswith("_sample") and key in fp:
      a, b = np.asarray(fp[key]), np.asarray(val)
      err = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
      worst = err if worst is None or not err <= worst else worst   # NaN wins
  return worst


COLS = [
    ("row", "row", "d"), ("shape", "shape", "s"), ("impl", "impl", "s"),
    ("time_ms", "ms", ".3f"), ("spread", "spr", ".2f"), ("graph_ms", "graph_ms", ".3f"),
    ("floor_ms", "floor_ms", ".3f"), ("time_over_floor", "/floor", ".1f"),
    ("time_over_jla", "/jla", ".2f"), ("kernel_ms", "kern_ms", ".3f"),
    ("kernel_over_jla", "kern/jla", ".2f"), ("peak_MB", "peak_MB", ".0f"),
    ("inputs_MB", "inputs_MB", ".0f"), ("peak_over_jla", "peak/jla", ".2f"),
    ("agree", "agree", ".1e"), ("first_call_s", "1st_s", ".1f"), ("status", "status", "s"),
]


def shape_text(s: dict) -> str:
  txt = f"B{s['B']} T{s['T']} H{s['H']} K{s['K']} V{s['V']} M{s['M']}"
  return txt + (f" N{s['N']}" if "N" in s else "")


def main(argv=None):
  args = parse_args(argv)
  if args.worker:
    worker_main(args.worker, args.worker_out)
    return
  user_env = dict(os.environ)
  common.setup_env(args.smoke)      # signals, FLA_CACHE_RESULTS=0, ... (inherited by workers)
  # --cache-dir: fla-core's autotuning results (and every compile) kept in a directory that a
  # first run filled, so a second run times the calls without autotuning them again.
  os.environ["FLA_CACHE_RESULTS"] = "1" if args.cache_dir else "0"
  path = args.out or os.path.join(REPO, "bench_out/train_smoke.json" if args.smoke
                                  else "benchmarks/train.json")
  run = Run(args, path, user_env)
  impls = [i for i in args.only.split(",") if i]
  bad = sorted(set(impls) - set(IMPLS))
  if bad:
    raise SystemExit(f"--only: unknown {bad}; choose from {IMPLS}")
  all_shapes = shapes(args.smoke)
  numbers = [int(i) for i in args.rows.split(",")] if args.rows else list(range(len(all_shapes)))
  ref_rows = set(numbers) if args.ref_rows == "all" else {
      int(i) for i in args.ref_rows.split(",") if i}
  backend = "reference" if args.smoke else "triton"
  configs = dict(config=_parse_overrides(args.config),
                 bwd_config=_parse_overrides(args.bwd_config))
  triton_cache = args.cache_dir or tempfile.mkdtemp(prefix="triton_cache_train_", dir="/tmp")
  if args.cache_dir:
    os.makedirs(args.cache_dir, exist_ok=True)
  run.data["meta"] = dict(
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      git=_git(), commit=common.git_commit(), versions=_dist_versions(), device=None,
      command=shlex.join([sys.executable] + sys.argv), cwd=os.getcwd(),
      pythonpath=os.environ.get("PYTHONPATH"), smoke=args.smoke, backend_ours=backend,
      floor_Bps=HBM_BPS, impls=impls, rows=numbers,
      method="one subprocess per (row, JAX implementation), one per row for fla-core; "
             "see the docstring of benchmarks/train.py", configs=configs)
  run.save()
  budget = common.Budget(args.budget_s)
  rows = []
  try:
    for i in numbers:
      s = all_shapes[i]
      tasks = []
      for impl in ("ours", "ours_ungated", "jla"):
        if impl in impls:
          tasks.append(dict(kind="jax", impl=impl))
      torch_impls = [m for m in TORCH_IMPLS if m in impls]
      if torch_impls:
        tasks.append(dict(kind="torch", impls=torch_impls))
      if "reference" in impls and i in ref_rows:
        tasks.append(dict(kind="jax", impl="reference"))
      for task in tasks:
        names = [task["impl"]] if "impl" in task else task["impls"]
        base = dict(row=i, shape=shape_text(s), **s)
        if "N" in s:
          base["seq_lengths"] = common.seq_lengths(s["T"], s["N"], common.row_seed(s))
        if args.smoke and task["kind"] == "torch":
          lines = [{"impl": n, "skipped": "smoke: no torch"} for n in names]
        elif budget.over():
          lines = [{"impl": n, "skipped": f"budget ({budget.seconds:.0f} s) spent"}
                   for n in names]
        else:
          task.update(shape=s, backend=backend, smoke=args.smoke, triton_cache=triton_cache,
                      configs=configs)
          lines = run.spawn(task, budget)
        rows += merge(base, names, lines, s, run.data["meta"])
        finish_row(rows, i)
        run.data["rows"] = strip_samples(rows)
        run.save()
  except KeyboardInterrupt:
    run.data["meta"]["interrupted"] = True
    print("[train] interrupted; partial results saved", flush=True)
  run.data["meta"]["elapsed_s"] = budget.elapsed()
  run.data["rows"] = strip_samples(rows)
  run.save()
  table = [dict(r, status=r["status"][:60]) for r in rows]
  common.print_table("fwd+bwd of loss = sum(o * do), grads w.r.t. q, k, v, g, beta (ms, MB; "
                     f"floor: bytes / {HBM_BPS / 1e12:.2f} TB/s)", table, COLS, note_chars=200)
  for r in rows:   # print_table notes errors and skips; refusals are listed here
    if "refused" in r:
      print(f"  row {r['row']} {r['impl']} refused: {r['refused'][:400]}")
  print(f"[train] done in {budget.elapsed():.1f} s; results in {path}", flush=True)


def merge(base: dict, names: list[str], lines: list[dict], s: dict, meta: dict) -> list[dict]:
  """One row per implementation of a worker, from its result lines and the shape's floor."""
  by_impl = {n: dict(base, impl=n) for n in names}
  for rec in lines:
    if "worker_problem" in rec:       # died or stopped: what it had not finished is an error
      for r in by_impl.values():
        if "time_ms" not in r and "refused" not in r:
          r.setdefault("error", rec["worker_problem"])
      continue
    r = by_impl.get(rec.get("impl"))
    if r is None:
      continue
    rec.pop("graph", None)            # a CUDA-graph line adds graph_ms to its row
    if rec.get("device") and not meta.get("device"):
      meta["device"] = rec["device"]
    r.update(rec)
  for n, r in by_impl.items():
    if not any(k in r for k in ("error", "refused", "skipped", "time_ms")):
      r["error"] = "worker returned no result"
    r["floor_ms"] = min_bytes(s, GATED[n]) / HBM_BPS * 1e3
    if r.get("time_ms"):
      r["time_over_floor"] = r["time_ms"] / r["floor_ms"]
    for k in ("peak_bytes", "inputs_bytes"):
      if r.get(k) is not None:
        r[k.replace("_bytes", "_MB")] = r[k] / 2**20
    r["status"] = ("refused: " + r["refused"] if "refused" in r else
                   "error: " + r["error"] if "error" in r else
                   "skipped: " + r["skipped"] if "skipped" in r else "ok")
  return list(by_impl.values())


def finish_row(rows: list[dict], i: int) -> None:
  """Ratios to jla and gradient agreement, once a row's implementations are all in."""
  mine = {r["impl"]: r for r in rows if r["row"] == i}
  jla = mine.get("jla", {})
  for r in mine.values():
    if r.get("time_ms") and jla.get("time_ms"):
      r["time_over_jla"] = r["time_ms"] / jla["time_ms"]
    if isinstance(r.get("kernel_ms"), float) and isinstance(jla.get("kernel_ms"), float):
      r["kernel_over_jla"] = r["kernel_ms"] / jla["kernel_ms"]
    if r.get("peak_bytes") and jla.get("peak_bytes"):
      r["peak_over_jla"] = r["peak_bytes"] / jla["peak_bytes"]
    partner = mine.get(PARTNER.get(r["impl"], ""), {})
    r["agree"] = _agree(r.get("fingerprint"), partner.get("fingerprint"))
    if r["agree"] is not None:
      r["agree_with"] = PARTNER[r["impl"]]


def strip_samples(rows: list[dict]) -> list[dict]:
  """The rows as saved: gradient samples are only for `agree`."""
  out = []
  for r in rows:
    r = dict(r)
    if isinstance(r.get("fingerprint"), dict):
      r["fingerprint"] = {k: v for k, v in r["fingerprint"].items() if not k.endswith("_sample")}
    out.append(r)
  return out


if __name__ == "__main__":
  main()
