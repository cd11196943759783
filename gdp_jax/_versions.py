"""The package versions the GPU test suite passed with, and a warning for any other combination.

`pip install "gdp-jax[gpu]"` pins this set on Python >= 3.12 (pyproject.toml). The "triton"
backend calls `warn_if_untested()` when it first imports jax_triton; on a combination that has
not passed the GPU suite it warns once per process (an `UntestedVersionsWarning`, which
`warnings.filterwarnings("ignore", category=gdp_jax.UntestedVersionsWarning)` silences). The CPU
paths (references, interpreter) do not warn: CI runs them on whatever versions pip resolves.
"""
from __future__ import annotations

import platform
import threading
import warnings
from importlib import metadata

# What `pytest -m gpu` passed with on the H200 (README, "Install"). Python is compared by
# major.minor, the packages by their exact version.
TESTED = {
    "Python": "3.12",
    "jax": "0.11.2",
    "jaxlib": "0.11.2",
    "jax-cuda13-plugin": "0.11.2",
    "triton": "3.6.0",
    "jax-triton": "0.3.1",
}


class UntestedVersionsWarning(UserWarning):
  """The GPU path runs on package versions that have not passed gdp_jax's GPU test suite."""


_WARNED = False
_LOCK = threading.Lock()


def _python_version() -> str:
  return ".".join(platform.python_version_tuple()[:2])


def _dist_version(name: str) -> str | None:
  """The installed version of distribution `name`, or None when it is not installed."""
  try:
    return metadata.version(name)
  except metadata.PackageNotFoundError:
    return None


def found_versions() -> dict[str, str | None]:
  """The installed counterpart of every entry of TESTED (None: not installed)."""
  return {name: (_python_version() if name == "Python" else _dist_version(name))
          for name in TESTED}


def untested() -> list[str]:
  """Names of TESTED whose installed version differs (or is missing); empty when all match."""
  found = found_versions()
  return [name for name, want in TESTED.items() if found[name] != want]


def warn_if_untested() -> bool:
  """Warns once per process when the installed versions differ from TESTED; True if it warned."""
  global _WARNED
  if _WARNED:   # the common case, on every launch after the first: no lock
    return False
  with _LOCK:
    if _WARNED:
      return False
    _WARNED = True
  differ = untested()
  if not differ:
    return False
  found = found_versions()
  show = lambda d: ", ".join(f"{n} {v if v is not None else '(not installed)'}"
                             for n, v in d.items())
  warnings.warn(
      f"gdp_jax's GPU path passed its test suite with {show(TESTED)}; found {show(found)} "
      f"(differs: {', '.join(differ)}). This combination is untested: it may work, or fail "
      "to compile or run. `pip install \"gdp-jax[gpu]\"` on Python 3.12 installs the tested "
      "set.", UntestedVersionsWarning, stacklevel=2)
  return True
