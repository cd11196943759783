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
