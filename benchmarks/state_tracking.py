"""Runs notebooks/state_tracking.ipynb (the S3 word problem, one GDP layer, M = 1 against M = 2)
as a script and records what it found: accuracy inside and past the training length, the share
of right signs, the last training losses, the wall time, and the figure.

The notebook's code cells run in order in one namespace (its own source, not a copy), with
matplotlib on the Agg backend and GDP_FIGURE_DIR set to the output folder, so the figure lands
there as state_tracking.png beside state_tracking.json.

Usage (GPU: the full configuration on backend "triton"; GDP_STATE_TRACKING / GDP_BACKEND /
GDP_ST_* override as in the notebook):
  python3 benchmarks/state_tracking.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

NOTEBOOK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "notebooks",
                        "state_tracking.ipynb")


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--out", default=None)
  args = p.parse_args()
  out = common.out_dir(args.out)
  os.environ.setdefault("MPLBACKEND", "Agg")
  os.environ["GDP_FIGURE_DIR"] = out
  with open(NOTEBOOK) as f:
    cells = [("".join(c["source"])) for c in json.load(f)["cells"] if c["cell_type"] == "code"]
  ns: dict = {"__name__": "state_tracking"}
  t0 = time.perf_counter()
  for src in cells:
    exec(compile(src, NOTEBOOK, "exec"), ns)   # noqa: S102 - the repository's own notebook
  wall = time.perf_counter() - t0

  import numpy as np
  L = ns["CFG"]["train_len"]
  rows = []
  for M, r in ns["results"].items():
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
              config=ns["CFG"], wall_s=round(wall, 1), chance=1 / 6)
  result = {"meta": meta, "rows": rows}
  if os.path.exists(os.path.join(out, "state_tracking.png")):
    result["figure"] = "state_tracking.png"
  with open(os.path.join(out, "state_tracking.json"), "w") as f:
    json.dump(result, f, indent=1)
  for r in rows:
    print(r)
  print(f"wall {wall:.1f} s; wrote {out}/state_tracking.json")


if __name__ == "__main__":
  main()
