"""Test setup shared by every file.

On a machine without a GPU the Triton kernels run through the interpreter, which must be switched
on before triton is first imported; float64 is enabled so the references can serve as oracles.
"""
import os

import jax

if jax.default_backend() != "gpu":
  os.environ.setdefault("TRITON_INTERPRET", "1")
jax.config.update("jax_enable_x64", True)

# Kernel backend for the CPU/GPU-agnostic test bodies: the interpreter on a CPU, jax_triton on a GPU.
KERNEL_BACKEND = "triton" if jax.default_backend() == "gpu" else "interpret"


# -------------------------------------------------------------------------------------------------
# The summary says how many GPU tests were deselected, and how to run them. pyproject's addopts
# deselect the `gpu` marker; under pytest-xdist the workers collect and deselect, so each worker
# hands its count to the controller through `workeroutput` (all workers collect the same tests).

_GPU_DESELECTED = {"count": 0}


def pytest_deselected(items):
  _GPU_DESELECTED["count"] += sum(1 for item in items if item.get_closest_marker("gpu"))


def pytest_sessionfinish(session):
  workeroutput = getattr(session.config, "workeroutput", None)   # set on xdist workers only
  if workeroutput is not None:
    workeroutput["gdp_gpu_deselected"] = _GPU_DESELECTED["count"]


import pytest as _pytest  # noqa: E402  (kept beside the hooks that need it)


@_pytest.hookimpl(optionalhook=True)   # an xdist hook: only called when xdist runs the session
def pytest_testnodedown(node, error):
  count = getattr(node, "workeroutput", {}).get("gdp_gpu_deselected", 0)
  _GPU_DESELECTED["count"] = max(_GPU_DESELECTED["count"], count)


def pytest_terminal_summary(terminalreporter):
  count = _GPU_DESELECTED["count"]
  if count:
    terminalreporter.write_line(
        f"{count} GPU test{'s' if count != 1 else ''} deselected (marker 'gpu'; run them with "
        "`pytest -m gpu` on a machine with an NVIDIA GPU)")
