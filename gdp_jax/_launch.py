"""The one place through which every Triton kernel is launched.

Two ways to run a kernel, same grid, same arguments, same output shapes:

* "triton": `jax_triton.triton_call` on a GPU.
* "interpret": Triton's interpreter on the CPU, inside `jax.pure_callback`, driving the kernel
  with thin numpy adapters (no torch needed, bf16 included).

Every quirk of jax-triton 0.3.1 lives here and nowhere else:

* it passes array arguments and scalars positionally, then one pointer per output, then the
  metaparameters as constexprs; kernels therefore order parameters inputs, outputs, constexprs;
* `None` cannot be passed (a pytree drops it): callers pass a placeholder array plus a flag;
* a Python float is typed fp64, so floats go as `np.float32`; numpy integers would be taken
  for arrays, so integers go as Python ints;
* `input_output_aliases` counts array arguments only (scalars are not operands of the custom
  call), and an aliased buffer reaches the kernel twice: once among the inputs, once among the
  outputs (0.4 passes it once and renamed `out_shape`; we pin <0.4 until that is tested);
* importing it sets TRITON_CACHE_DIR to "", which breaks Triton kernels launched from torch in
  the same process (the side-by-side benchmarks): the variable is put back after the import;
* it emits the legacy custom call `triton_kernel_call`, which XLA cannot capture into a CUDA
  graph (command buffer), so every kernel of a jitted decode loop is a separate host launch.
  Newer jaxlibs also register `triton_kernel_call_ffi`, the same serialized kernel call as an
  FFI attribute, which can be captured. With GDP_TRITON_CALL_TARGET=ffi in the environment
  (read at the first launch) our kernels lower to that target instead (0.4 does this itself).
  Opt-in. Measured on an H200 (2026-11-30) it changed nothing: 9.4 us per decode step at N = 1
  with either target, 8.7 us with XLA command buffers (docs/performance.md).
"""
from __future__ import annotations

import importlib
import os
import sys
import threading
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gdp_jax import _versions

# Triton's interpreter patches triton.language globals while a kernel runs, so two launches on
# different threads (one pure_callback per device under shard_map) corrupt each other.
_INTERPRET_LOCK = threading.Lock()

def _kernels_module(interpret: bool):
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
        "backend='triton' cannot run in a process where triton was imported with "
        "TRITON_INTERPRET=1; unset it and restart, or use backend='interpret'.")
  return mod


def _resolve_kernel(name, interpret: bool):
  mod = _kernels_module(interpret)
  if not isinstance(name, str):
    return name  # a @triton.jit function given directly (tests)
  module_name, fn_name = name.rsplit(".", 1)
  return getattr(importlib.import_module(f"{mod.__name__}.{module_name}"), fn_name)


def placeholder(dtype=jnp.float32) -> jax.Array:
  """Stands for an optional pointer argument that is absent (a constexpr flag turns it off):
  triton_call cannot pass None, since a pytree drops it."""
  return jnp.zeros((1,), dtype)


def _scalar(x):
  """Scalars as jax-triton 0.3.1 types them correctly (see the module docstring)."""
  if isinstance(x, (bool, np.bool_)):
    return bool(x)
  if isinstance(x, (int, np.integer)):
    return int(x)
  if isinstance(x, (float, np.floating)):
    return np.float32(x)
  raise TypeError(f"unsupported scalar argument {x!r} of type {type(x).__name__}")


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray)) or hasattr(x, "aval")


def call(
    kernel,
    *args,
    grid: tuple[int, ...],
    out_shape: Sequence[jax.ShapeDtypeStruct],
    backend: str,
    input_output_aliases: dict[int, int] | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    **constexprs,
) -> tuple[jax.Array, ...]:
  """Launches `gdp_kernels.<kernel>` on `grid`.

  Args:
    kernel: "module.function" inside gdp_kernels, e.g. "fused_recurrent.fused_recurrent_fwd_kernel",
      or a @triton.jit function.
    *args: the kernel's inputs in order: arrays, and scalars (ints, floats).
    grid: static launch grid, at most 3 axes (axes 1 and 2 are capped at 65535 by CUDA).
    out_shape: one ShapeDtypeStruct per output pointer, in the kernel's order.
    backend: "triton" or "interpret".
    input_output_aliases: {position in args: output index}; the output starts as a copy of that
      input (or is that buffer, when donated under jit on the GPU).
    num_warps, num_stages: compile options (ignored by the interpreter).
    **constexprs: the kernel's constexpr parameters.

  Returns:
    A tuple of output arrays. Outputs that are not aliased start uninitialised on the GPU and as
    NaN (or the integer minimum) in the interpreter, so an unwritten element shows.
  """
  grid = tuple(int(g) for g in grid)
  if len(grid) > 3 or any(g < 0 for g in grid):
    raise ValueError(f"grid: expected at most 3 non-negative axes, got {grid}")
  if len(grid) > 1 and max(grid[1:]) > 65535:
    raise ValueError(f"grid: axes 1 and 2 are capped at 65535 by CUDA, got {grid}")
  args = [a if _is_array(a) else _scalar(a) for a in args]
  aliases = dict(input_output_aliases or {})
  out_shape = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in out_shape]
  for i, j in aliases.items():
    if not _is_array(args[i]):
      raise ValueError(f"input_output_aliases: argument {i} is a scalar")
    # An output aliased to the wrong argument would be written through that argument's buffer.
    if (args[i].shape, args[i].dtype) != (out_shape[j].shape, out_shape[j].dtype):
      raise ValueError(
          f"input_output_aliases: argument {i} is {args[i].dtype}{list(args[i].shape)}, output "
          f"{j} is {out_shape[j].dtype}{list(out_shape[j].shape)}")
  if backend not in ("triton", "interpret"):
    raise ValueError(
        f"backend: expected 'triton' or 'interpret' for a kernel launch, got {backend!r}")
  if any(g == 0 for g in grid):
    return _no_launch(args, out_shape, aliases)
  positions = [i for i, a in enumerate(args) if _is_array(a)]
  template = [None if i in positions else a for i, a in enumerate(args)]

  # Differentiating a launch would otherwise fail inside jax-triton or pure_callback with a
  # message about their internals; say what is true here instead, at trace time.
  @jax.custom_jvp
  def launch(*arrays):
    full = list(template)
    for i, a in zip(positions, arrays):
      full[i] = a
    if backend == "interpret":
      return _interpret(kernel, full, grid, out_shape, aliases, constexprs)
    return _jax_triton(kernel, full, grid, out_shape, aliases, num_warps, num_stages, constexprs)

  launch.defjvp(_forward_only)
  return tuple(launch(*[args[i] for i in positions]))


def _forward_only(primals, tangents):
  raise NotImplementedError(
      "gdp_jax's Triton kernels are differentiable only through chunk_gated_delta_product "
      "without a state cache and without chunk snapshots: jax.grad / jax.vjp with respect to "
      "q, k, v, g, beta and initial_state (and the final state's cotangent with "
      "output_final_state=True). The state cache (state, state_indices), return_chunk_states "
      "and the decode entry points are forward-only; for gradients through those use "
      "backend='reference', the pure jax.numpy twins.")


def _no_launch(args, out_shape, aliases):
  """An empty grid writes nothing: aliased outputs keep their input, the rest are zeros."""
  inv = {o: i for i, o in aliases.items()}
  return tuple(args[inv[j]] if j in inv else jax.numpy.zeros(s.shape, s.dtype)
               for j, s in enumerate(out_shape))


_CALL_TARGET = None  # the custom call target chosen at the first launch


def _jax_triton_module():
  global _CALL_TARGET
  _versions.warn_if_untested()
  if "jax_triton" not in sys.modules:
    before = os.environ.get("TRITON_CACHE_DIR")
    import jax_triton  # imports only where jax has GPU support
    if before is None:
      os.environ.pop("TRITON_CACHE_DIR", None)
    else:
      os.environ["TRITON_CACHE_DIR"] = before
  if _CALL_TARGET is None:
    target = os.environ.get("GDP_TRITON_CALL_TARGET", "legacy")
    if target == "ffi":
      _lower_to_ffi_target(sys.modules["jax_triton.triton_lib"])
    elif target != "legacy":
      raise ValueError(f"GDP_TRITON_CALL_TARGET: expected 'legacy' or 'ffi', got {target!r}")
    _CALL_TARGET = target
  return sys.modules["jax_triton"]


_FFI_LOCK = threading.Lock()


def _lower_to_ffi_target(triton_lib):
  """Re-registers jax_triton 0.3.1's CUDA lowering so that it emits `triton_kernel_call_ffi`.

  Its lowering builds the serialized kernel call and hands it to
  `jax.ffi.ffi_lowering("triton_kernel_call", api_version=2, backend_config=...)`; the FFI
  target takes the same bytes as the `opaque` attribute of an api_version=4 call. Only the name
  `jax` inside jax_triton.triton_lib is swapped, for the duration of one lowering.
  """
  import functools
  from jax.interpreters import mlir

  def ffi_lowering(name, *, api_version, backend_config, operand_output_aliases):
    del name, api_version
    rule = jax.ffi.ffi_lowering("triton_kernel_call_ffi", api_version=4,
                                operand_output_aliases=operand_output_aliases)
    return lambda ctx, *args: rule(ctx, *args, opaque=backend_config)

  class _Jax:  # the real jax, but for jax.ffi.ffi_lowering
    ffi = type("ffi", (), {"ffi_lowering": staticmethod(ffi_lowering)})

    def __getattr__(self, name):
      return getattr(jax, name)

  legacy = functools.partial(triton_lib.triton_kernel_call_lowering, triton_lib.get_cuda_backend)

  def lowering(ctx, *args, **params):
    with _FFI_LOCK:
      saved, triton_lib.jax = triton_lib.jax, _Jax()
      try:
        return legacy(ctx, *args, **params)
      finally:
        triton_lib.jax = saved

  mlir.register_lowering(triton_lib.triton_kernel_call_p, lowering, platform="cuda")


def _jax_triton(kernel, args, grid, out_shape, aliases, num_warps, num_stages, constexprs):
  jt = _jax_triton_module()
  fn = _resolve_kernel(kernel, interpret=False)
  array_pos = {i: n for n, i in enumerate(i for i, a in enumerate(args) if _is_array(a))}
  return tuple(jt.triton_call(
      *args,
      kernel=fn,
      out_shape=out_shape,
      grid=grid,
      num_warps=num_warps,
      num_stages=num_stages,
      input_output_aliases={array_pos[i]: o for i, o in aliases.items()},
      **constexprs,
  ))


class _HostPointer:
  """The part of a torch tensor's interface that Triton's interpreter uses.

  The interpreter copies every tensor argument to the host through `untyped_storage()` and back
  afterwards; our buffers already live on the host, so those steps are identities and the
  kernel reads and writes the numpy memory directly. `dtype` is a string ('bfloat16', ...),
  which Triton maps to its own type by name.
  """

  def __init__(self, array: np.ndarray):
    self.array = array
    self.dtype = str(array.dtype)

  def data_ptr(self) -> int:
    return self.array.ctypes.data

  def untyped_storage(self):
    return self

  def cpu(self):
    return self

  def new_empty(self, *_, **__):
    return self

  def set_(self, *_):
    return self

  def storage_offset(self) -> int:
    return 0

  def size(self):
    return self.array.shape

  def stride(self):
    return tuple(s // self.array.itemsize for s in self.array.strides)

  def copy_(self, other):
    if other is not self:
      np.copyto(self.array, other.array)


def _poison(s: jax.ShapeDtypeStruct) -> np.ndarray:
  dt = np.dtype(s.dtype)
  if np.issubdtype(dt, np.integer):
    return np.full(s.shape, np.iinfo(dt).min, dt)
  return np.full(s.shape, np.nan, dt)


def _round_bf16_to_nearest_even():
  """Makes the interpreter round float32 -> bfloat16 to nearest even, as the GPU does.

  Triton's interpreter (3.6 to 3.9) truncates the mantissa in that cast, so a bf16 store would
  differ from the compiled kernel's in the last bit and interpreter tests could not compare bf16
  outputs bit for bit. ml_dtypes (a jax dependency) does the correctly rounded cast.
  """
  import ml_dtypes
  import triton.language as tl
  from triton.runtime import interpreter as ti
  cast = ti.InterpreterBuilder.cast_impl
  if getattr(cast, "_rne", False):
    return

  def cast_impl(self, src, dst_type):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
      return ti.TensorHandle(src.data.astype(ml_dtypes.bfloat16).view(np.uint16), dst_type.scalar)
    return cast(self, src, dst_type)

  cast_impl._rne = True
  ti.InterpreterBuilder.cast_impl = cast_impl


def _widen_bf16_dot_operands():
  """Makes the interpreter multiply bfloat16 operands as numbers, not as bit patterns.

  The interpreter keeps bfloat16 tensors as uint16 bits and its dot hands those straight to
  np.matmul (triton 3.9), so a bf16 tl.dot returns garbage. A bf16 product is exact in float32,
  so widening the operands first gives the tensor-core result up to summation order.
  """
  import triton.language as tl
  from triton.runtime import interpreter as ti
  dot = ti.InterpreterBuilder.create_dot
  if getattr(dot, "_widened", False):
    return

  def widen(x):
    if x.dtype.scalar == tl.bfloat16:
      return ti.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
    return x

  def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    return dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

  create_dot._widened = True
  ti.InterpreterBuilder.create_dot = create_dot


def _interpret(kernel, args, grid, out_shape, aliases, constexprs):
  fn = _resolve_kernel(kernel, interpret=True)
  _round_bf16_to_nearest_even()
  _widen_bf16_dot_operands()
  positions = [i for i, a in enumerate(args) if _is_array(a)]
  inv = {o: i for i, o in aliases.items()}

  def host(*arrays):
    full = list(args)
    for i, a in zip(positions, arrays):
      full[i] = np.ascontiguousarray(np.asarray(a))
    outs = [np.array(full[inv[j]], copy=True, order="C") if j in inv else _poison(s)
            for j, s in enumerate(out_shape)]
    # The interpreter types Python floats as fp32 itself and cannot convert numpy scalars.
    ptr = lambda x: (_HostPointer(x) if isinstance(x, np.ndarray)
                     else float(x) if isinstance(x, np.floating) else x)
    with _INTERPRET_LOCK:
      fn[grid](*[ptr(a) for a in full], *[_HostPointer(o) for o in outs], **constexprs)
    return tuple(outs)

  return tuple(jax.pure_callback(host, tuple(out_shape), *[args[i] for i in positions],
                                 vmap_method="sequential"))
