"""Test setup shared by every file.

On a machine without a GPU the Triton kernels run through the interpreter, which must be switched
on before triton is first imported; float64 is enabled so the references can serve as oracles.
Hypothesis runs derandomized.
"""
import os

import hypothesis
import jax

if jax.default_backend() != "gpu":
  os.environ.setdefault("TRITON_INTERPRET", "1")
jax.config.update("jax_enable_x64", True)

# Kernel backend for the CPU/GPU-agnostic test bodies: the interpreter on a CPU, jax_triton on a GPU.
KERNEL_BACKEND = "triton" if jax.default_backend() == "gpu" else "interpret"

# Property tests draw the same examples on every run (derandomized, no example database), so
# CI's shapes and time do not change from run to run; each test fixes its own max_examples.
hypothesis.settings.register_profile("gdp", derandomize=True, database=None)
hypothesis.settings.load_profile("gdp")


# -------------------------------------------------------------------------------------------------
# `pytest -m gpu --launch=xla_triton` runs the whole GPU suite with every kernel launch that asks
# for backend "triton" handed to XLA's Triton custom call instead (gdp_jax/_launch.py): the same
# tests, the same expectations, the other launch path. The switch is made once per process,
# before any test traces, so no jit cache holds programs of both paths.

def pytest_addoption(parser):
  parser.addoption("--launch", choices=("jax_triton", "xla_triton"), default="jax_triton",
                   help="launch path of backend 'triton' kernels in the GPU tests")


# The launch path this process runs backend "triton" kernels through ("jax_triton" or
# "xla_triton"), for the tests whose expectation depends on the compiler (tests/test_torch_launch.py).
LAUNCH = {"path": "jax_triton"}


def pytest_configure(config):
  LAUNCH["path"] = config.getoption("--launch")
  if LAUNCH["path"] != "xla_triton":
    return
  from gdp_jax import _backends, _launch
  call, resolve = _launch.call, _backends.resolve

  def call_through_xla(*args, backend, **kwargs):
    return call(*args, backend="xla_triton" if backend == "triton" else backend, **kwargs)

  # At the entry points too, so that launchers which choose by backend (the output stage's
  # pipeline depth, gdp_jax/_prefill_kernels.py) see "xla_triton"; the launch-level switch
  # catches the tests that call internal launchers with backend "triton".
  def resolve_to_xla(backend):
    resolved = resolve(backend)
    return "xla_triton" if resolved == "triton" else resolved

  _backends.resolve = resolve_to_xla
  _launch.call = call_through_xla


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
  # Only when the marker expression left them out: under `-m gpu -k ...` the GPU tests that -k
  # deselects are no news.
  if count and "not gpu" in (terminalreporter.config.option.markexpr or ""):
    terminalreporter.write_line(
        f"{count} GPU test{'s' if count != 1 else ''} deselected (marker 'gpu'; run them with "
        "`pytest -m gpu` on a machine with an NVIDIA GPU)")
