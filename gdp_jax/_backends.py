"""Resolves the `backend` argument of every entry point, and runs each call as one jit program.

"auto" runs the Triton kernels through jax_triton on a GPU and the jnp references elsewhere;
"triton" forces the kernels, "xla_triton" launches the same kernels through XLA's own Triton
custom call (GPU only, opt-in: cheaper per launch, scalars compiled in; gdp_jax/_launch.py),
"reference" the references, and "interpret" runs the very same Triton kernels on the CPU
through Triton's interpreter.
"""
from __future__ import annotations

import functools

import jax

BACKENDS = ("auto", "triton", "xla_triton", "reference", "interpret")


def resolve(backend: str) -> str:
  """Returns one of "triton", "xla_triton", "reference", "interpret"."""
  if backend not in BACKENDS:
    raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
  if backend == "auto":
    return "triton" if jax.default_backend() == "gpu" else "reference"
  if backend in ("triton", "xla_triton") and jax.default_backend() != "gpu":
    raise NotImplementedError(
        f"backend={backend!r} needs a CUDA GPU visible to JAX (jax.default_backend() is "
        f"{jax.default_backend()!r}); use backend='interpret' to run the same kernels on the "
        "CPU, or backend='reference'.")
  return backend


@functools.lru_cache(maxsize=None)
def _jitted(fn, static):
  return jax.jit(lambda arrays: fn(**arrays, **dict(static)))


def call_jitted(fn, arrays, **static):
  """fn(**arrays, **static) as one jax.jit program per (fn, static arguments).

  An eager call then runs one compiled program instead of dispatching each jnp op on its own
  (which on a GPU means an XLA compilation per op and shape: minutes for a notebook), and under
  an outer jax.jit it inlines. `arrays` maps names to arrays or None; `static` values must be
  hashable. Block configs travel among the static arguments (no module state), so another
  config traces anew instead of reusing a program built under the old one."""
  return _jitted(fn, tuple(sorted(static.items())))(arrays)
