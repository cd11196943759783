"""Runs notebooks/state_tracking.ipynb (the S3 word problem, one GDP layer, M = 1 against M = 2)
as a script and records what it found: accuracy inside and past the training length, the share
of right signs, the last training losses, the wall time, where it went, and the figure.

The notebook's code cells run in order in one namespace (its own source, not a copy), with
matplotlib on the Agg backend and GDP_FIGURE_DIR set to the output folder, so the figure lands
there as state_tracking.png beside state_tracking.json.

Every line is flushed as it is printed, so a run stopped by a wall-clock cap still shows where
its time went: the notebook's own lines (model builds, the lowering and XLA compile of the
training scan and of the evaluation forward, a loss per chunk of training steps), then one line
per cell with its time, the XLA compilations it caused (jax_log_compiles) and the Triton kernels
jax-triton compiled in it. Interrupted (SIGINT, e.g. `timeout -s INT`), it prints the same
summary for the cells it ran and writes the JSON file without rows.

Usage (GPU: the full configuration on backend "triton"; GDP_STATE_TRACKING / GDP_BACKEND /
GDP_ST_* override as in the notebook, GDP_ST_PROGRESS=0 drops the per-chunk lines):
  python3 benchmarks/state_tracking.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

T0 = time.perf_counter()
sys.stdout.reconfigure(line_buffering=True)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

NOTEBOOK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "notebooks",
                        "state_tracking.ipynb")


def say(message):
  print(f"[script {time.perf_counter() - T0:6.1f} s] {message}", flush=True)


class XlaCompiles(logging.Handler):
  """Collects jax_log_compiles' "Finished XLA compilation of NAME in T sec" records (and keeps
  them off the console)."""

  PREFIX = "Finished XLA compilation of "

  def __init__(self):
    super().__init__()
    self.seen: list[tuple[str, float]] = []

  def emit(self, record):
    msg = record.getMessage()
    if msg.startswith(self.PREFIX):
      name, _, rest = msg[len(self.PREFIX):].rpartition(" in ")
      try:
        self.seen.append((name, float(rest.split()[0])))
      except ValueError:
        self.seen.append((name, 0.0))


def triton_kernels() -> int:
  if "jax_triton" not in sys.modules:
    return 0
  from gdp_jax import _launch_jax_triton
  return _launch_jax_triton.compiled_kernels()


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--out", default=None)
  args = p.parse_args()
  out = common.out_dir(args.out)
  os.environ.setdefault("MPLBACKEND", "Agg")
  os.environ.setdefault("GDP_ST_PROGRESS", "1")
  os.environ["GDP_FIGURE_DIR"] = out
  import jax
  say(f"imported jax {jax.__version__}; devices: {jax.devices()}")
  jax.config.update("jax_log_compiles", True)
  xla = XlaCompiles()
  jax_logger = logging.getLogger("jax")
  jax_logger.addHandler(xla)
  jax_logger.propagate = False      # counted, not printed (one record per compilation)

  with open(NOTEBOOK) as f:
    cells = [("".join(c["source"])) for c in json.load(f)["cells"] if c["cell_type"] == "code"]
  ns: dict = {"__name__": "state_tracking"}
  phases, interrupted = [], None
  t0 = time.perf_counter()
  for i, src in enumerate(cells):
    t, n_xla, n_triton = time.perf_counter(), len(xla.seen), triton_kernels()
    try:
      exec(compile(src, NOTEBOOK, "exec"), ns)   # noqa: S102 - the repository's own notebook
    except KeyboardInterrupt:
      interrupted = i
    new = xla.seen[n_xla:]
    phase = dict(cell=i, first_line=src.strip().splitlines()[0][:60],
                 seconds=round(time.perf_counter() - t, 2), xla_compiles=len(new),
                 xla_compile_s=round(sum(s for _, s in new), 2),
                 triton_kernels=triton_kernels() - n_triton)
    phases.append(phase)
    slow = ", ".join(f"{n} {s:.1f} s" for n, s in sorted(new, key=lambda x: -x[1])[:3])
    say(f"code cell {i} ({phase['first_line']!r}){' INTERRUPTED' if interrupted == i else ''}: "
        f"{phase['seconds']:.1f} s; XLA compilations {len(new)} ({phase['xla_compile_s']:.1f} s"
        f"{'; slowest ' + slow if slow else ''}); Triton kernels compiled "
        f"{phase['triton_kernels']}")
    if interrupted is not None:
      break
  wall = time.perf_counter() - t0
  compiles = dict(xla=len(xla.seen), xla_s=round(sum(s for _, s in xla.seen), 1),
                  triton_kernels=triton_kernels())
  say(f"in all: {wall:.1f} s in the cells; XLA compilations {compiles['xla']} "
      f"({compiles['xla_s']} s), Triton kernels compiled {compiles['triton_kernels']}")

  import numpy as np
  rows = []
  results = ns.get("results", {}) if interrupted is None else {}   # complete ones only
  for M, r in results.items():
    L = ns["CFG"]["train_len"]
    rows.append({
        "M": M, "backend": ns["BACKEND"], "size": ns["SIZE"],
        "acc_1_to_train_len": float(r["acc"][:L].mean()),
        "acc_past_train_len": float(r["acc"][L:].mean()),
        "acc_at_eval_len": float(r["acc"][-1]),
        "right_sign_past_train_len": float(r["sign"]),
        "loss_last_100_steps": float(np.mean(r["losses"][-100:])),
    })
  meta = common.run_meta()
  meta.update(title="the S3 word problem, one GDP layer (notebooks/state_tracking.ipynb)",
              config=ns.get("CFG"), wall_s=round(wall, 1), chance=1 / 6, compiles=compiles,
              phases=phases,
              notes=[f"compilations: XLA {compiles['xla']} ({compiles['xla_s']} s), Triton "
                     f"kernels {compiles['triton_kernels']}"])
  if interrupted is not None:
    meta["interrupted"] = f"in code cell {interrupted}"
  result = {"meta": meta, "rows": rows}
  if os.path.exists(os.path.join(out, "state_tracking.png")):
    result["figure"] = "state_tracking.png"
  with open(os.path.join(out, "state_tracking.json"), "w") as f:
    json.dump(result, f, indent=1)
  for r in rows:
    print(r)
  say(f"wall {wall:.1f} s; wrote {out}/state_tracking.json")
  if interrupted is not None:
    # Without the interpreter's teardown: after an interrupted compilation it can crash there.
    sys.stdout.flush()
    os._exit(130)


if __name__ == "__main__":
  main()
