"""Resolves the `backend` argument of every entry point.

"auto" runs the Triton kernels through jax_triton on a GPU and the jnp references elsewhere;
"triton" forces the kernels, "reference" the references, and "interpret" runs the very same
Triton kernels on the CPU through Triton's interpreter.
"""
from __future__ import annotations

import jax

BACKENDS = ("auto", "triton", "reference", "interpret")


def resolve(backend: str) -> str:
  """Returns one of "triton", "reference", "interpret"."""
  if backend not in BACKENDS:
    raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
  if backend == "auto":
    return "triton" if jax.default_backend() == "gpu" else "reference"
  if backend == "triton" and jax.default_backend() != "gpu":
    raise NotImplementedError(
        "backend='triton' needs a CUDA GPU visible to JAX (jax.default_backend() is "
        f"{jax.default_backend()!r}); use backend='interpret' to run the same kernels on the "
        "CPU, or backend='reference'.")
  return backend
