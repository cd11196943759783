"""Every notebook runs top to bottom in a fresh kernel, and says what it claims.

The kernel is this interpreter (a temporary kernelspec named python3 on JUPYTER_PATH), so the
notebooks see the package as installed here, whatever `python` comes first on PATH. The
performance notebook runs twice: without benchmark files (it must say so and plot nothing) and
with small benchmark files in the benchmarks' JSON layout (it must plot).
"""
import collections
import datetime
import json
import pathlib
import re
import sys

import jax
import pytest

nbformat = pytest.importorskip("nbformat", reason="the test extra installs nbformat")
nbclient = pytest.importorskip("nbclient", reason="the test extra installs nbclient")
pytest.importorskip("ipykernel", reason="the test extra installs ipykernel")
pytest.importorskip("matplotlib", reason="the test extra installs matplotlib")
pytest.importorskip("flax.nnx", reason="the notebooks use gdp_jax.flax")

from helpers import RTOL  # noqa: E402

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"


@pytest.fixture
def run_notebook(tmp_path, monkeypatch):
  spec = tmp_path / "jupyter" / "kernels" / "python3"
  spec.mkdir(parents=True)
  (spec / "kernel.json").write_text(json.dumps({
      # -X faulthandler: a kernel that crashes prints its Python stack into the captured stderr.
      "argv": [sys.executable, "-X", "faulthandler", "-m", "ipykernel_launcher", "-f",
               "{connection_file}"],
      "display_name": "Python 3 (tests)", "language": "python"}))
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
  # On a GPU this process already holds JAX's default 75% of the memory (jax.default_backend()
  # below starts it); a kernel that asked for 75% more would fail to start its client.
  monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

  def run(name, env=None):
    for k, v in (env or {}).items():
      monkeypatch.setenv(k, v)          # the kernel inherits the environment
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=300,
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    try:
      client.execute()                  # raises CellExecutionError on the first failing cell
    finally:
      print(f"{name}: seconds per code cell:", _cell_seconds(nb))
    texts, images = [], 0
    for cell in nb.cells:
      for out in cell.get("outputs", []):
        if out.output_type == "stream":
          texts.append(out.text)
        elif out.output_type in ("execute_result", "display_data"):
          images += "image/png" in out.data
          texts.append(out.data.get("text/plain", ""))
    return "".join(texts), images

  return run


def _cell_seconds(nb):
  """Wall time of each code cell that started, from nbclient's timing metadata (where a slow
  machine spends its time; a cell cut short counts to now)."""
  now = datetime.datetime.now(datetime.timezone.utc)
  out = []
  for cell in nb.cells:
    t = cell.get("metadata", {}).get("execution", {})
    if cell.cell_type == "code" and "iopub.status.busy" in t:
      start = datetime.datetime.fromisoformat(t["iopub.status.busy"])
      end = t.get("iopub.status.idle")
      out.append(round(((datetime.datetime.fromisoformat(end) if end else now) - start)
                       .total_seconds(), 1))
  return out


def _checks(text, pattern):
  """Values of `pattern`'s group on every line that has it."""
  return [m.group(1) for m in re.finditer(pattern, text)]


@pytest.mark.slow  # a whole notebook in a kernel of its own: 20 to 30 s
def test_quickstart(run_notebook):
  text, _ = run_notebook("quickstart.ipynb")
  errors = [float(x) for x in re.findall(r"\d\.\de[-+]\d\d", text)]   # every printed rel err
  assert len(errors) == 14, text
  assert max(errors) < 1e-5, text      # float32 inputs against the float64 scan reference
  for claim in ("final state stays zero: True", "untouched (still zero):   True",
                "compiled once for both packings: True", "ValueError: k: expected"):
    assert claim in text, text


@pytest.mark.slow  # a whole notebook in a kernel of its own: 20 to 30 s
def test_serving(run_notebook):
  text, images = run_notebook("serving.ipynb")
  assert images == 2, text              # state norms, slot occupancy + acceptance
  assert "same tokens as the recomputation: True" in text, text
  claims = _checks(text, r"(?:exactly zero|still NaN\)|unchanged|idle row output zero):\s+(\w+)")
  assert claims == ["True"] * 4, text
  errors = [float(x) for x in re.findall(r"\d\.\de[-+]\d\d", text)]   # every printed rel err
  # backend "auto": the float64-capable references on a CPU; the float32 kernels on a GPU,
  # where packed-vs-alone and rollback comparisons are held to the float32 threshold.
  tol = RTOL["float32"] if jax.default_backend() == "gpu" else 1e-6
  assert len(errors) == 10 and max(errors) < tol, text


def test_performance_without_results(run_notebook, tmp_path):
  empty = tmp_path / "no_results"
  empty.mkdir()
  text, images = run_notebook("performance.ipynb", {"GDP_BENCH_DIR": str(empty)})
  assert images == 0
  assert text.count("MISSING:") == 2, text
  assert "No decode plots" in text and "No prefill plots" in text


def _bench_files(folder):
  """Small decode.json / prefill.json in the layout benchmarks/common.Results writes."""
  meta = {"device": "test data", "jax": "x", "triton": "x", "copy_Bps": 4.0e12}
  decode = [dict(N=N, HV=16, D=D, S=N, state_dtype="float32", cfg="BV32w4",
                 ours_ms=0.02 + N * 1e-3, ours_loop_ms=0.01 + N * 1e-3, fla_ms=0.03 + N * 1e-3,
                 fla_graph_ms=0.012 + N * 1e-3, TBps_loop=0.1 * N ** 0.5, err_ref=1e-7)
            for N in (1, 8, 64) for D in (1, 4)]
  decode.append(dict(decode[0], state_dtype="bfloat16"))
  best = [dict(N=256, HV=16, D=1, S=256, BV=64, num_warps=8, loop_ms=0.1, default_loop_ms=0.12)]
  prefill = [dict(B=1, T=T, H=6, K=256, V=512, M=2, ours_ms=T * 1e-4, fla_ms=T * 1.2e-4,
                  ours_over_floor=3.0, err_ref_o=1e-3) for T in (4096, 16384)]
  (folder / "decode.json").write_text(json.dumps(
      {"meta": meta, "sections": {"decode": decode, "sweep_best": best}}))
  (folder / "prefill.json").write_text(json.dumps(
      {"meta": meta, "sections": {"prefill": prefill}}))


def test_performance_plots_results(run_notebook, tmp_path):
  folder = tmp_path / "results"
  folder.mkdir()
  _bench_files(folder)
  text, images = run_notebook("performance.ipynb", {"GDP_BENCH_DIR": str(folder)})
  assert "MISSING" not in text, text
  assert images == 3, text              # decode time + bandwidth, sweep, prefill
  assert text.count("loaded ") == 2, text


@pytest.mark.slow  # a whole notebook in a kernel of its own: 20 to 30 s
def test_state_tracking(run_notebook):
  # The small configuration on any device (CI's; on a GPU its layer runs the Triton kernels
  # forward and backward): both trainings, M = 1 and M = 2, lower the loss, and the figure shows.
  # JAX_LOG_COMPILES=1: the kernel logs every XLA compilation to its stderr, captured here.
  text, images = run_notebook("state_tracking.ipynb",
                              {"GDP_STATE_TRACKING": "small", "JAX_LOG_COMPILES": "1"})
  assert images == 1, text
  assert _checks(text, r"M=\d: loss [\d.]+ -> [\d.]+ .*; fell: (\w+)") == ["True", "True"], text
  # One compilation per model of the training scan (every chunk of steps reuses it) and of the
  # evaluation forward (every length is read off one long evaluation).
  compiled = collections.Counter(re.findall(r"Finished XLA compilation of jit\((\w+)\)", text))
  assert (compiled["train_steps"], compiled["predict"]) == (2, 2), compiled
