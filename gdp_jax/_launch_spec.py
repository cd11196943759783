"""What one kernel launch is, independent of how it runs: the description `_launch.call` builds
and every launch backend (jax-triton, the interpreter, XLA's Triton call) consumes.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from typing import Any, Callable

import jax
import numpy as np


class _Array:
  """Marks an argument position that holds an array (the arrays travel apart from the spec, as
  the traced operands of the launch)."""

  def __repr__(self):
    return "ARRAY"


ARRAY = _Array()


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
  """One launch of one @triton.jit kernel.

  The kernel's parameters are its inputs (arrays and scalars, in order), then one pointer per
  output, then its constexprs by name: the order jax-triton passes them in, which every kernel
  in gdp_kernels follows.

  Attributes:
    kernel: "module.function" inside gdp_kernels, or a @triton.jit function.
    args: the inputs in order: ARRAY where an array goes, the scalar itself otherwise
      (bool, int, or np.float32).
    grid: launch grid, 1 to 3 axes, none empty.
    out_shape: one ShapeDtypeStruct per output pointer, in the kernel's order.
    aliases: (input position, output index) pairs: that output starts as that input.
    num_warps, num_stages: compile options.
    constexprs: (name, value) pairs of the kernel's constexpr parameters.
  """
  kernel: str | Callable
  args: tuple
  grid: tuple[int, ...]
  out_shape: tuple[jax.ShapeDtypeStruct, ...]
  aliases: tuple[tuple[int, int], ...]
  num_warps: int
  num_stages: int
  constexprs: tuple[tuple[str, Any], ...]

  @property
  def array_positions(self) -> list[int]:
    return [i for i, a in enumerate(self.args) if a is ARRAY]

  def with_arrays(self, arrays) -> list:
    """The full argument list, the arrays put in their places."""
    full = list(self.args)
    for i, a in zip(self.array_positions, arrays, strict=True):
      full[i] = a
    return full

  @property
  def array_aliases(self) -> dict[int, int]:
    """The aliases counted among the array arguments only (the operands of a custom call)."""
    index = {p: n for n, p in enumerate(self.array_positions)}
    return {index[i]: o for i, o in self.aliases}

  @property
  def grid3(self) -> tuple[int, int, int]:
    return tuple(self.grid) + (1,) * (3 - len(self.grid))


def kernels_module(interpret: bool):
  """Imports gdp_kernels, making sure Triton runs in the mode asked for.

  Triton decides at decoration time whether `@triton.jit` builds an interpreted function, from
  TRITON_INTERPRET as it was when triton was first imported; one process runs one mode.
  """
  if "triton" not in sys.modules and interpret:
    os.environ["TRITON_INTERPRET"] = "1"
  mod = importlib.import_module("gdp_kernels")
  active = type(mod._common.l2norm_rows).__name__ == "InterpretedFunction"
  if active != interpret:
    if interpret:
      raise RuntimeError(
          "backend='interpret' needs TRITON_INTERPRET=1 before triton is first imported; this "
          "process imported triton in compiled mode. Set the variable at the top of the program "
          "(or in the environment) and restart.")
    raise RuntimeError(
        "the compiled backends ('triton', 'xla_triton') cannot run in a process where triton "
        "was imported with TRITON_INTERPRET=1; unset it and restart, or use "
        "backend='interpret'.")
  return mod


def kernel_function(kernel, interpret: bool):
  """The @triton.jit function a spec names, from gdp_kernels in the mode asked for."""
  mod = kernels_module(interpret)
  if not isinstance(kernel, str):
    return kernel  # a @triton.jit function given directly (tests)
  module_name, fn_name = kernel.rsplit(".", 1)
  return getattr(importlib.import_module(f"{mod.__name__}.{module_name}"), fn_name)


def is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray)) or hasattr(x, "aval")
