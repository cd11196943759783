"""Launch backend "interpret": a LaunchSpec run by Triton's interpreter on the CPU, inside
`jax.pure_callback`, through thin numpy adapters (no torch needed, bf16 included).
"""
from __future__ import annotations

import threading

import jax
import numpy as np

from gdp_jax._launch_spec import LaunchSpec, kernel_function

# Triton's interpreter patches triton.language globals while a kernel runs, so two launches on
# different threads (one pure_callback per device under shard_map) corrupt each other.
_INTERPRET_LOCK = threading.Lock()


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


def _skip_repatching_in_device_calls():
  """Saves the interpreter re-patching triton.language on every @triton.jit helper call.

  A launch patches triton.language's builtins for the interpreter (and restores them after the
  grid), but triton 3.6 to 3.9 also patches on every call of a device function inside the
  kernel: `inspect.getmembers` over tl, tl.tensor and tl.math each time, which is a no-op once
  they are patched and was 16% of the interpreter's time in a gradient test. Once the modules
  the helper sees are patched (their `load` no longer a builtin) the helper runs as rewritten,
  errors wrapped as the interpreter wraps them. The dtype lookup the interpreter builds a dict
  for on every call (another 7%) is memoised.
  """
  import triton.language as tl
  from triton.runtime import interpreter as ti
  call = ti.InterpretedFunction.__call__
  if getattr(call, "_once", False):
    return

  def __call__(self, *args, **kwargs):
    # The modules the interpreter would patch for this function (tl or tl.core: triton's own
    # helpers such as tl.zeros see tl.core), each still holding builtins or already patched;
    # found once per function, as a module's globals keep their modules.
    if not hasattr(self, "_gdp_langs"):
      self._gdp_langs = [v for v in self.fn.__globals__.values() if v is tl or v is tl.core]
    if any(tl.core.is_builtin(m.load) for m in self._gdp_langs):
      return call(self, *args, **kwargs)
    fn = self.rewrite()
    try:
      return fn(*args, **kwargs)
    except Exception as e:
      raise ti.InterpreterError(repr(e)) from e

  __call__._once = True
  ti.InterpretedFunction.__call__ = __call__

  np_dtype, cache = ti._get_np_dtype, {}

  def _get_np_dtype(tt_dtype):
    # By the scalar type's name: block and pointer types define __eq__ without __hash__.
    scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
    if isinstance(scalar, tl.pointer_type):
      return np.dtype(np.uint64)
    if scalar.name not in cache:
      cache[scalar.name] = np_dtype(scalar)
    return cache[scalar.name]

  ti._get_np_dtype = _get_np_dtype


def run(spec: LaunchSpec, arrays):
  fn = kernel_function(spec.kernel, interpret=True)
  _round_bf16_to_nearest_even()
  _widen_bf16_dot_operands()
  _skip_repatching_in_device_calls()
  inv = {o: i for i, o in spec.aliases}
  constexprs = dict(spec.constexprs)

  def host(*arrays):
    full = spec.with_arrays([np.ascontiguousarray(np.asarray(a)) for a in arrays])
    outs = [np.array(full[inv[j]], copy=True, order="C") if j in inv else _poison(s)
            for j, s in enumerate(spec.out_shape)]
    # The interpreter types Python floats as fp32 itself and cannot convert numpy scalars.
    ptr = lambda x: (_HostPointer(x) if isinstance(x, np.ndarray)
                     else float(x) if isinstance(x, np.floating) else x)
    with _INTERPRET_LOCK:
      fn[spec.grid](*[ptr(a) for a in full], *[_HostPointer(o) for o in outs], **constexprs)
    return tuple(outs)

  return tuple(jax.pure_callback(host, spec.out_shape, *arrays, vmap_method="sequential"))
