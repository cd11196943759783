"""Timing, bookkeeping and environment helpers shared by the benchmarks in benchmarks/.

The benchmarks run JAX (our kernels, through jax_triton) and torch (fla-core, the baseline) in
one process on one GPU, so the environment has to be set before either is imported: see
`setup_env`. Every number is written to $OUT/<name>.json after each row, so a run that is cut
short still returns what it measured. Each file's "meta" records the date, the commit, the
command and the versions (`run_meta`), which `benchmarks/make_results.py` prints above the
file's tables in benchmarks/RESULTS.md.

Run as a script, this file prints the end-of-run summary of a GPU run:
`python3 benchmarks/common.py --summary $OUT`.
"""
from __future__ import annotations

import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

# --------------------------------------------------------------------------------------------
# Environment (call before importing jax, triton or torch)
# --------------------------------------------------------------------------------------------


def _interrupt(signum, frame):
  raise KeyboardInterrupt(f"signal {signum}")


def setup_env(cpu_smoke: bool) -> None:
  """Sets the variables that must be in place before jax/triton/torch are first imported.

  * JAX preallocates 75% of the GPU by default; torch (fla-core) needs room beside it.
  * fla-core caches autotune results on disk across runs; the machine is fresh each time and a
    stale cache would only hide tuning cost, so it is off.
  * A fresh Triton cache directory per process makes the first-call compile times honest (the
    test run before us compiles the same kernels) and gives torch-launched Triton kernels a real
    directory (importing jax_triton sets TRITON_CACHE_DIR to "", see `fix_triton_cache`).
  * The CPU smoke runs our kernels through Triton's interpreter, which must be switched on
    before triton is imported.
  """
  # gpu_run.sh caps each script with `timeout -s INT`; a shell may have started us with SIGINT
  # ignored, so both signals are bound here: they stop the run between rows, results saved.
  signal.signal(signal.SIGINT, _interrupt)
  signal.signal(signal.SIGTERM, _interrupt)
  os.environ.setdefault("PYTHONUNBUFFERED", "1")
  os.environ["FLA_CACHE_RESULTS"] = "0"
  cache = tempfile.mkdtemp(prefix="triton_cache_bench_", dir="/tmp")
  os.environ["TRITON_CACHE_DIR"] = cache
  os.environ["GDP_BENCH_TRITON_CACHE"] = cache
  if cpu_smoke:
    TIMING.update(repeats=2, warmup=1)
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  else:
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")


def fix_triton_cache() -> None:
  """Imports jax_triton now and puts TRITON_CACHE_DIR back (jax_triton sets it to "").

  Without a real directory, fla-core's kernels launched from torch fail with "Could not create
  or locate cache dir". gdp_jax._launch restores the variable too; this keeps the benchmark
  safe whatever order things are imported in.
  """
  cache = os.environ.get("GDP_BENCH_TRITON_CACHE") or "/tmp/triton_cache"
  try:
    import jax_triton  # noqa: F401
  except Exception as e:  # CPU smoke: jax_triton does not import without a GPU jax
    print(f"[env] jax_triton not imported: {type(e).__name__}: {e}")
  os.makedirs(cache, exist_ok=True)
  os.environ["TRITON_CACHE_DIR"] = cache


def out_dir(path: str | None = None) -> str:
  d = path or os.environ.get("OUT") or "./bench_out"
  os.makedirs(d, exist_ok=True)
  return d


def versions() -> dict:
  """Versions and device, as far as they import; never raises."""
  info = {"python": sys.version.split()[0]}
  for mod in ("jax", "jaxlib", "triton", "torch", "jax_triton", "fla", "numpy"):
    try:
      m = __import__(mod)
      info[mod] = getattr(m, "__version__", "?")
    except Exception as e:
      info[mod] = f"unavailable ({type(e).__name__})"
  try:
    import jax
    info["jax_backend"] = jax.default_backend()
    info["device"] = str(jax.devices()[0].device_kind)
  except Exception as e:
    info["device"] = f"unknown ({e})"
  for name in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "TRITON_CACHE_DIR", "FLA_CACHE_RESULTS",
               "XLA_FLAGS"):
    info[name] = os.environ.get(name)
  return info


VERSION_KEYS = ("python", "jax", "jaxlib", "triton", "torch", "jax_triton", "fla", "numpy")


def git_commit() -> str:
  """The commit being measured: $GDP_COMMIT if set (gpu_run.sh sets it where git works), else
  `git rev-parse --short HEAD` with "+dirty" for uncommitted changes to tracked files, else
  "unknown" (a copy of the working tree without .git)."""
  if os.environ.get("GDP_COMMIT"):
    return os.environ["GDP_COMMIT"]
  here = os.path.dirname(os.path.abspath(__file__))
  try:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, text=True,
                          capture_output=True, timeout=10)
    if head.returncode != 0 or not head.stdout.strip():
      return "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                           text=True, capture_output=True, timeout=10)
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
  except Exception:
    return "unknown"


def run_meta(info: dict | None = None) -> dict:
  """date, commit, command and versions of this run, for a result file's "meta"."""
  info = versions() if info is None else info
  vers = {k: info[k] for k in VERSION_KEYS
          if k in info and not str(info[k]).startswith("unavailable")}
  if "device" in info:
    vers["device"] = info["device"]
  return {"date": time.strftime("%Y-%m-%d", time.gmtime()), "commit": git_commit(),
          "command": " ".join(shlex.quote(a) for a in ["python3"] + sys.argv),
          "versions": vers}


def has_torch_cuda() -> bool:
  try:
    import torch
    return bool(torch.cuda.is_available())
  except Exception:
    return False


# --------------------------------------------------------------------------------------------
# Budget and results
# --------------------------------------------------------------------------------------------


class Budget:
  """Wall-clock budget of a script: rows past it are recorded as skipped, not run.

  gpu_run.sh also puts a hard `timeout` around each script; this softer limit lets the script
  stop between rows, so its JSON and table are complete for what ran.
  """

  def __init__(self, seconds: float):
    self.t0 = time.perf_counter()
    self.seconds = float(seconds)

  def elapsed(self) -> float:
    return time.perf_counter() - self.t0

  def left(self) -> float:
    return self.seconds - self.elapsed()

  def over(self, margin: float = 0.0) -> bool:
    return self.left() < margin


class Results:
  """Sections of rows (dicts), saved as one JSON file after every change."""

  def __init__(self, path: str, meta: dict):
    self.path = path
    # date, commit, command and versions first (from the flat version fields the scripts pass),
    # then the script's own fields, which the notebooks read under their flat names.
    self.data = {"meta": dict(run_meta(meta), **meta), "sections": {}}
    self.save()

  def add(self, section: str, row: dict) -> dict:
    self.data["sections"].setdefault(section, []).append(row)
    self.save()
    return row

  def set_meta(self, **kw) -> None:
    self.data["meta"].update(kw)
    self.save()

  def save(self) -> None:
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(_jsonable(self.data), f, indent=1, allow_nan=True)
    os.replace(tmp, self.path)


def _jsonable(x):
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, (bool, int, str)) or x is None:
    return x
  if isinstance(x, float):
    return x
  try:
    return float(x)  # numpy scalars
  except Exception:
    return str(x)


def run_row(results: Results, section: str, row: dict, body, budget: Budget | None = None,
            margin: float = 0.0) -> dict:
  """Runs `body(row)` (which fills `row` in place), records the row whatever happens.

  An exception is printed and stored in row["error"]; the next row still runs. A row that would
  start past the budget is stored with row["skipped"].
  """
  if budget is not None and budget.over(margin):
    row["skipped"] = f"budget ({budget.seconds:.0f} s) spent"
    return results.add(section, row)
  t0 = time.perf_counter()
  try:
    body(row)
  except KeyboardInterrupt:
    row["error"] = "interrupted"
    results.add(section, row)
    raise
  except Exception as e:
    row["error"] = f"{type(e).__name__}: {e}"[:800]
    print(f"[{section}] row {_row_id(row)} failed:\n{traceback.format_exc()}", flush=True)
  row["row_s"] = time.perf_counter() - t0
  return results.add(section, row)


def _row_id(row: dict) -> str:
  keys = ("N", "HV", "D", "S", "B", "T", "H", "K", "V", "M", "BV", "num_warps", "state_dtype")
  return " ".join(f"{k}={row[k]}" for k in keys if k in row)


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


# The CPU smoke lowers these (its times mean nothing, only the plumbing is checked).
TIMING = {"repeats": 7, "warmup": 2}


def time_jax(call, *, target_s: float = 0.03, repeats: int | None = None,
             warmup: int | None = None, max_batch: int = 2000) -> dict:
  """Median time per call of `call()` (which launches JAX work and returns its outputs).

  JAX work is asynchronous and JAX's streams are not torch's, so device events are not
  available here: the clock is read around a batch of K back-to-back calls, then the last
  output is waited for. K is chosen so a batch lasts about `target_s`, which amortises the one
  synchronisation. Calls that thread a donated cache depend on each other; independent calls
  still run in order on the one compute stream, so waiting for the last waits for all. A
  per-call time that sits at the host's dispatch cost (tens of microseconds) means the step is
  launch-bound, not device-bound.

  Returns:
    {"ms": median ms per call, "spread": (max - min) / median over repeats, "batch": K,
     "repeats": repeats}.
  """
  import jax
  repeats = TIMING["repeats"] if repeats is None else repeats
  warmup = TIMING["warmup"] if warmup is None else warmup
  out = None
  for _ in range(warmup):
    out = call()
  jax.block_until_ready(out)
  t0 = time.perf_counter()
  out = call()
  jax.block_until_ready(out)
  one = max(time.perf_counter() - t0, 1e-6)
  K = int(min(max_batch, max(1, math.ceil(target_s / one))))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(K):
      out = call()
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / K)
  med = statistics.median(times)
  return {"ms": med * 1e3, "spread": (max(times) - min(times)) / med, "batch": K,
          "repeats": repeats}


def time_torch(fn, *, warmup_ms: int = 25, rep_ms: int = 100) -> float:
  """Median ms of `fn` by triton.testing.do_bench (CUDA events; it flushes L2 between calls)."""
  from triton.testing import do_bench
  try:
    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
  except TypeError:  # older signature without return_mode
    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5])[0])


def time_torch_graph(fn, *, steps: int = 16, replays: int = 20, repeats: int = 5) -> float:
  """Median ms per call of `fn`, captured `steps` times into one CUDA graph and replayed.

  Eager torch pays its Python and launch overhead on every call (about 0.2 ms for fla-core's
  decode step); a graph of many steps shows the device time, which is what a jitted JAX step
  competes with.
  """
  import torch
  s = torch.cuda.Stream()
  s.wait_stream(torch.cuda.current_stream())
  with torch.cuda.stream(s):
    for _ in range(3):  # compile and warm up outside the capture
      fn()
  torch.cuda.current_stream().wait_stream(s)
  torch.cuda.synchronize()
  graph = torch.cuda.CUDAGraph()
  with torch.cuda.graph(graph):
    for _ in range(steps):
      fn()
  graph.replay()
  torch.cuda.synchronize()
  times = []
  for _ in range(repeats):
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
      graph.replay()
    end.record()
    end.synchronize()
    times.append(start.elapsed_time(end) / (replays * steps))
  del graph
  return statistics.median(times)


# --------------------------------------------------------------------------------------------
# Kernel profiles: what the device ran, kernel by kernel (CUPTI through each framework's profiler)
# --------------------------------------------------------------------------------------------


def _kernel_summary(events: list[tuple[str, float, float]], timeline: int = 16) -> dict:
  """events: (name, start_us, duration_us). busy is the sum of durations (kernels on one stream
  do not overlap), span the first start to the last end; span - busy is time the device ran
  nothing of this work: launch latency, host work, synchronisation."""
  if not events:
    return {"kernels": [], "busy_us": 0.0, "span_us": 0.0, "timeline": []}
  per = {}
  for name, _, dur in events:
    n, t = per.get(name, (0, 0.0))
    per[name] = (n + 1, t + dur)
  start = min(e[1] for e in events)
  end = max(e[1] + e[2] for e in events)
  kernels = [{"name": k, "count": n, "us": t} for k, (n, t) in per.items()]
  kernels.sort(key=lambda r: -r["us"])
  # The last kernels in launch order with the idle time before each: where the gaps sit.
  tail = sorted(events, key=lambda e: e[1])[-timeline:]
  order = [{"name": n, "start_us": s - start, "us": d,
            "gap_us": s - (p[1] + p[2]) if p else 0.0}
           for p, (n, s, d) in zip([None] + tail[:-1], tail)]
  return {"kernels": kernels, "busy_us": sum(e[2] for e in events), "span_us": end - start,
          "timeline": order}


def profile_jax(call, *, calls: int = 1) -> dict:
  """The device kernels of `calls` runs of `call()`, from a jax.profiler trace.

  On a GPU the trace's "/device:GPU:N" plane holds one line per CUDA stream with every kernel
  (Triton kernels under their function names, XLA fusions under theirs). Without a GPU the XLA
  CPU ops stand in (events that carry an "hlo_op" stat), so the CPU smoke exercises the parsing.
  """
  import glob
  import jax
  from jax.profiler import ProfileData
  jax.block_until_ready(call())  # compiled and warm: the trace holds steady-state work only
  d = tempfile.mkdtemp(prefix="gdp_profile_")
  with jax.profiler.trace(d):
    out = None
    for _ in range(calls):
      out = call()
    jax.block_until_ready(out)
  paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
  if not paths:
    raise RuntimeError(f"jax.profiler wrote no .xplane.pb under {d}")
  data = ProfileData.from_file(paths[0])
  events, lines = [], []
  gpu = [p for p in data.planes if p.name.startswith("/device:GPU")]
  for plane in gpu:
    for line in plane.lines:
      lines.append(line.name)
      # One line per CUDA stream; the others ("XLA Ops", "XLA Modules", ...) regroup the same
      # kernels and would count them twice.
      if line.name.startswith("Stream"):
        events += [(e.name, e.start_ns / 1e3, e.duration_ns / 1e3) for e in line.events]
  if not gpu:
    for plane in data.planes:
      for line in plane.lines:
        events += [(e.name, e.start_ns / 1e3, e.duration_ns / 1e3) for e in line.events
                   if any(k == "hlo_op" for k, _ in e.stats)]
  if gpu and not events:
    raise RuntimeError(f"no kernel events on a GPU stream line; the GPU plane's lines: {lines}")
  return _kernel_summary(events)


def profile_torch(fn, *, calls: int = 1) -> dict:
  """The CUDA kernels of `calls` runs of `fn()`, from torch.profiler (same summary)."""
  import torch
  from torch.profiler import ProfilerActivity, profile
  fn()
  torch.cuda.synchronize()
  with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(calls):
      fn()
    torch.cuda.synchronize()
  events = [(e.name, e.time_range.start, e.time_range.end - e.time_range.start)
            for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
  return _kernel_summary(events)


def print_profile(title: str, prof: dict, per: int = 1, unit: str = "call", top: int = 12,
                  file=None, timeline: bool = False) -> None:
  """One profile as a table, times and counts divided by `per` (e.g. the steps of a loop); with
  `timeline`, also the last kernels in launch order with the idle time before each."""
  file = file or sys.stdout
  busy, span = prof["busy_us"] / per, prof["span_us"] / per
  print(f"\n-- profile {title}; per {unit}: kernels {busy:.2f} us, span {span:.2f} us, "
        f"idle {span - busy:.2f} us", file=file)
  for k in prof["kernels"][:top]:
    print(f"   {k['us'] / per:10.2f} us  {k['count'] / per:6.2f} x  {k['name'][:90]}", file=file)
  if len(prof["kernels"]) > top:
    rest = sum(k["us"] for k in prof["kernels"][top:]) / per
    print(f"   {rest:10.2f} us  (+{len(prof['kernels']) - top} more kernels)", file=file)
  if timeline and prof.get("timeline"):
    print("   last kernels in launch order: idle before, start, device time (us)", file=file)
    for e in prof["timeline"]:
      print(f"   {e['gap_us']:8.2f} {e['start_us']:10.2f} {e['us']:10.2f}  {e['name'][:70]}",
            file=file)
  file.flush()


def copy_bandwidth_jax(nbytes: int) -> dict:
  """Device-to-device bandwidth of an elementwise jnp pass, bytes read + written per second.

  `x * 2 + 1` reads and writes every element once (XLA fuses it into one kernel) and cannot be
  elided like a plain copy; the data are nonzero.
  """
  import jax
  import jax.numpy as jnp
  n = nbytes // 4
  x = jnp.arange(n, dtype=jnp.float32) * jnp.float32(1e-9) + jnp.float32(0.5)
  f = jax.jit(lambda a: a * jnp.float32(2) + jnp.float32(1))
  t = time_jax(lambda: f(x), target_s=0.05)
  del x
  return {"bytes": 2 * n * 4, "ms": t["ms"], "spread": t["spread"],
          "Bps": 2 * n * 4 / (t["ms"] * 1e-3)}


def copy_bandwidth_torch(nbytes: int) -> dict:
  """The same measurement in torch (dst.copy_(src)), as a cross-check of the JAX number."""
  import torch
  n = nbytes // 4
  src = torch.arange(n, dtype=torch.float32, device="cuda")
  dst = torch.empty_like(src)
  ms = time_torch(lambda: dst.copy_(src))
  del src, dst
  torch.cuda.empty_cache()
  return {"bytes": 2 * n * 4, "ms": ms, "Bps": 2 * n * 4 / (ms * 1e-3)}


# --------------------------------------------------------------------------------------------
# Packed rows and the jax-linear-attention baseline (shared by train.py and prefill.py)
# --------------------------------------------------------------------------------------------


def row_seed(s: dict) -> int:
  """The seed of a row's inputs and of its packed lengths (`N` sequences when "N" is given)."""
  return s["B"] * 7 + s["T"] + s["M"] + 100 * s.get("N", 0)


def seq_lengths(T: int, N: int, seed: int) -> list[int]:
  """N random positive lengths summing to T (N-1 distinct cut points in 1..T-1)."""
  import numpy as np
  cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, T), N - 1, replace=False))
  return np.diff(np.concatenate([[0], cuts, [T]])).astype(int).tolist()


def packing(lens: list[int]) -> dict:
  """Both packings of sequences of lengths `lens` (numpy int32): cu_seqlens [N+1] for ours and
  fla-core, segment_ids [1, T] for jax-linear-attention (its Mosaic path refuses cu_seqlens)."""
  import numpy as np
  return {"cu_seqlens": np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
          "segment_ids": np.repeat(np.arange(len(lens), dtype=np.int32), lens)[None]}


def jla_gated_delta_product(kernels: bool = True):
  """jax-linear-attention's Gated DeltaProduct: its Mosaic GPU kernels (Hopper only), or, with
  kernels=False, its jnp chunked reference, which takes the very same arguments: the CPU smoke
  cannot run the kernels but checks the call's layout against ours. Raises ImportError when jla
  is not installed."""
  if kernels:
    from jla.ops.mosaic_gpu.gated_delta_product import gated_delta_product
  else:
    from jla.ops.chunked import gated_delta_product
  return gated_delta_product


def jla_call(fn, q, k, v, g, beta, M, segment_ids=None, output_final_state=False):
  """`fn` (from jla_gated_delta_product) computing what our rows compute.

  FLA's layout: q [B, T, H, K], k [B, T*M, H, K], v [B, T*M, H, V], g [B, T, H] (natural log,
  required), beta [B, T*M, H]; q and k L2-normalised inside the op; scale None = K**-0.5;
  packed sequences as segment_ids [B, T]. Its final state is [B, H, K, V]: with segment_ids, the
  state of each row's last sequence.
  """
  return fn(q, k, v, g, beta, num_householder=M, use_qk_l2norm=True, segment_ids=segment_ids,
            output_final_state=output_final_state)


def jla_refused(e: BaseException) -> bool:
  """jla's Mosaic path validates its inputs first and raises a ValueError naming what it does
  not support (K = 256, no Hopper GPU): a refusal, not a failure of the benchmark."""
  return isinstance(e, ValueError) and "mosaic_gpu gated_delta_product" in str(e)


# --------------------------------------------------------------------------------------------
# Comparison and conversion
# --------------------------------------------------------------------------------------------


def to_numpy_f32(x):
  """A jax array or torch tensor as a float32 numpy array on the host."""
  import numpy as np
  if type(x).__module__.startswith("torch"):
    return x.detach().float().cpu().numpy()
  import jax.numpy as jnp
  return np.asarray(jnp.asarray(x).astype(jnp.float32))


def _as_jax(x):
  """A jax array (device-resident where possible) viewing a jax array or a torch tensor."""
  import jax
  import jax.numpy as jnp
  if type(x).__module__.startswith("torch"):
    import torch
    torch.cuda.synchronize()  # the dlpack view is read on JAX's stream
    try:
      return jax.dlpack.from_dlpack(x.detach().contiguous())
    except Exception:
      return jnp.asarray(x.detach().float().cpu().numpy())
  return jnp.asarray(x)


def rel_err(out, ref) -> float:
  """||out - ref|| / ||ref||, the relative error; NaN if either holds a non-finite value.

  Computed on the device in float32: the tensors compared here reach a gigabyte, too slow to
  ship to the host, and a float32 sum is ample for an error ratio read to two digits.
  """
  import jax.numpy as jnp
  a = _as_jax(out).astype(jnp.float32)
  b = _as_jax(ref).astype(jnp.float32)
  if a.shape != b.shape:
    raise ValueError(f"rel_err: shapes differ, {a.shape} vs {b.shape}")
  if not bool(jnp.all(jnp.isfinite(a)) & jnp.all(jnp.isfinite(b))):
    return float("nan")
  num = float(jnp.sqrt(jnp.sum(jnp.square(a - b))))
  den = float(jnp.sqrt(jnp.sum(jnp.square(b))))
  return num / den if den > 0 else num


def worst(*errs) -> float:
  """The largest error, NaN if any is NaN (Python's max would depend on the order)."""
  errs = [float(e) for e in errs]
  return float("nan") if any(math.isnan(e) for e in errs) else max(errs)


def to_torch(x):
  """A jax array as a torch CUDA tensor that owns its memory (a clone of a dlpack view).

  The clone matters: the JAX buffer may be donated or freed later. Falls back to a host round
  trip (bf16 through its bit pattern, which numpy cannot hold as a float) if dlpack fails.
  """
  import torch
  try:
    return torch.from_dlpack(x).clone()
  except Exception:
    import jax
    import jax.numpy as jnp
    import numpy as np
    if x.dtype == jnp.bfloat16:
      bits = np.asarray(jax.lax.bitcast_convert_type(x, jnp.int16))
      return torch.from_numpy(bits).cuda().view(torch.bfloat16)
    return torch.from_numpy(np.asarray(x)).cuda()


def free_device_memory() -> None:
  import gc
  gc.collect()
  try:
    import torch
    if torch.cuda.is_available():
      torch.cuda.empty_cache()
  except Exception:
    pass


# --------------------------------------------------------------------------------------------
# Printing
# --------------------------------------------------------------------------------------------


def fmt(v, spec: str) -> str:
  if v is None:
    return "-"
  if isinstance(v, float) and math.isnan(v):
    return "nan"
  try:
    return format(v, spec)
  except (TypeError, ValueError):
    return str(v)


def print_table(title: str, rows: list[dict], cols: list[tuple[str, str, str]],
                file=None, note_chars: int = 300) -> None:
  """Prints rows as an aligned table; cols are (key, header, format spec).

  Rows with an "error" or "skipped" entry get it printed after the table, one line per distinct
  message with the row numbers it applies to (a kernel that fails fails on many rows).
  """
  file = file or sys.stdout
  print(f"\n== {title}", file=file)
  cells = [["#"] + [h for _, h, _ in cols]]
  notes = {}
  for i, r in enumerate(rows):
    cells.append([str(i)] + [fmt(r.get(k), f) for k, _, f in cols])
    for key in ("error", "skipped"):
      if r.get(key):
        notes.setdefault(f"{key}: {str(r[key])[:note_chars]}", []).append(str(i))
  widths = [max(len(c[j]) for c in cells) for j in range(len(cells[0]))]
  for c in cells:
    print("  ".join(s.rjust(w) for s, w in zip(c, widths)), file=file)
  for msg, idx in notes.items():
    print(f"  rows {','.join(idx)}: {msg}", file=file)
  file.flush()


# --------------------------------------------------------------------------------------------
# End-of-run summary (gpu_run.sh prints it last, where a capped log still shows it)
# --------------------------------------------------------------------------------------------


def _load(path):
  try:
    with open(path) as f:
      return json.load(f)
  except Exception as e:
    print(f"(no {os.path.basename(path)}: {type(e).__name__}: {e})")
    return None


def summary(d: str) -> None:
  print("\n######## SUMMARY ########")
  for what, name in (("tests", "gpu_tests.log"), ("notebooks", "notebooks.log")):
    log = os.path.join(d, name)
    if not os.path.exists(log):
      continue
    with open(log, errors="replace") as f:
      lines = f.read().splitlines()
    bad = [l for l in lines if l.startswith(("FAILED", "ERROR", "[gpu_run]"))]
    # pytest's closing line, e.g. "3 failed, 40 passed, 192 deselected in 95.1s" (-q drops
    # the "=" framing), which pytest still prints when interrupted by the step's timeout.
    closing = re.compile(r"\d+ (passed|failed|errors?|skipped|deselected)\b.* in [\d.]+s")
    tail = [l for l in lines if closing.search(l)]
    print(f"{what}:", tail[-1].strip("= ") if tail else f"(no pytest closing line in {name})")
    for l in bad[:20]:
      print("  " + l[:200])
    if len(bad) > 20:
      print(f"  ... {len(bad) - 20} more")
  dec = _load(os.path.join(d, "decode.json"))
  if dec:
    m = dec["meta"]
    s = dec["sections"]
    bw = m.get("copy_Bps")
    print(f"copy bandwidth (jax, r+w): {fmt(bw and bw / 1e12, '.2f')} TB/s;"
          f" torch {fmt(m.get('copy_Bps_torch') and m['copy_Bps_torch'] / 1e12, '.2f')} TB/s;"
          f" decode first call: lower {fmt(m.get('compile_lower_s'), '.2f')} s,"
          f" compile {fmt(m.get('compile_xla_s'), '.2f')} s,"
          f" run {fmt(m.get('compile_first_run_s'), '.3f')} s")
    print_table("decode (ms per step; loop = 16 steps in one jit / one CUDA graph)",
                s.get("decode", []), DECODE_SUMMARY_COLS, note_chars=160)
    best = s.get("sweep_best", [])
    if best:
      print_table("decode config sweep: best per shape", best, SWEEP_BEST_COLS, note_chars=160)
    launch = s.get("launch", [])
    if launch:
      print_table("launch cost per launch backend (us per step; per launch for 'bump')",
                  launch, LAUNCH_SUMMARY_COLS, note_chars=160)
  pre = _load(os.path.join(d, "prefill.json"))
  if pre:
    m = pre["meta"]
    print(f"prefill first call: lower {fmt(m.get('compile_lower_s'), '.2f')} s, compile "
          f"{fmt(m.get('compile_xla_s'), '.2f')} s, run {fmt(m.get('compile_first_run_s'), '.3f')}"
          f" s; reference scan {fmt(m.get('ref_scan_ms'), '.1f')} ms"
          f" ({fmt(m.get('ref_over_ours'), '.0f')}x ours), chunked reference"
          f" {fmt(m.get('ref_chunked_ms'), '.2f')} ms")
    rows = [dict(r, jla_ms="refuses") if "jla_refused" in r else r
            for r in pre["sections"].get("prefill", [])]
    print_table("prefill (ms)", rows, PREFILL_SUMMARY_COLS, note_chars=160)


DECODE_SUMMARY_COLS = [
    ("N", "N", "d"), ("HV", "HV", "d"), ("D", "D", "d"), ("S", "S", "d"),
    ("state_dtype", "st", "s"), ("cfg", "cfg", "s"),
    ("ours_ms", "ours", ".4f"), ("ours_loop_ms", "ours_loop", ".4f"),
    ("TBps_loop", "TB/s", ".2f"), ("frac_copy", "/copy", ".2f"),
    ("fla_ms", "fla", ".4f"), ("fla_graph_ms", "fla_graph", ".4f"),
    ("ours_over_fla_graph", "loop/graph", ".2f"),
    ("err_ref", "err_ref", ".1e"), ("err_fla", "err_fla", ".1e"),
]
LAUNCH_SUMMARY_COLS = [
    ("kernel", "kernel", "s"), ("N", "N", "d"), ("backend", "backend", "s"),
    ("loop", "loop", "s"), ("us", "us", ".2f"), ("same_bits_as_triton", "bits=triton", ""),
    ("err_ref", "err_ref", ".1e"),
]
SWEEP_BEST_COLS = [
    ("N", "N", "d"), ("HV", "HV", "d"), ("D", "D", "d"), ("BV", "BV", "d"),
    ("num_warps", "warps", "d"), ("num_stages", "stages", "d"), ("loop_ms", "loop_ms", ".4f"),
    ("default_cfg", "default", "s"), ("default_loop_ms", "default_ms", ".4f"),
    ("err_ref", "err_ref", ".1e"),
]
PREFILL_SUMMARY_COLS = [
    ("B", "B", "d"), ("T", "T", "d"), ("H", "H", "d"), ("K", "K", "d"), ("V", "V", "d"),
    ("M", "M", "d"), ("N", "N", "d"), ("ours_ms", "ours", ".3f"), ("jla_ms", "jla", ".3f"),
    ("ours_over_jla", "ours/jla", ".2f"), ("jla_err", "err_jla_o", ".1e"),
    ("fla_ms", "fla", ".3f"), ("ours_over_fla", "ours/fla", ".2f"),
    ("fla_graph_ms", "fla_graph", ".3f"),
    ("ours_over_fla_graph", "ours/graph", ".2f"), ("flop_floor_ms", "flop_fl", ".3f"),
    ("byte_floor_ms", "byte_fl", ".3f"), ("ours_over_floor", "/floor", ".1f"),
    ("err_fla_o", "err_fla_o", ".1e"), ("err_fla_state", "err_fla_h", ".1e"),
    ("err_ref_o", "err_ref_o", ".1e"),
]


if __name__ == "__main__":
  if len(sys.argv) == 3 and sys.argv[1] == "--summary":
    summary(sys.argv[2])
  else:
    print("usage: python3 benchmarks/common.py --summary OUT_DIR", file=sys.stderr)
    sys.exit(2)
