"""Launch backend "xla_triton": a LaunchSpec handed to XLA's own Triton custom call.

XLA's GPU compiler has a custom call, `__gpu$xla.gpu.triton`, that takes a Triton kernel as
Triton IR (TTIR) text and compiles, links and launches it like one of its own fusions: the
kernel becomes an ordinary XLA kernel launch, with none of the host work jaxlib's
`triton_kernel_call` does on every call (docs/performance.md, "Launch cost"). This module makes
that TTIR with the installed triton (ASTSource, then the "ttir" stage of `triton.compile` for an
sm_90 target, no GPU needed) and emits the custom call through `jax.ffi.ffi_call`, whose
attributes become the backend_config dictionary XLA parses (xla/service/gpu/triton_call.cc):
name (the kernel function in the TTIR), ir, num_warps, num_stages, grid_x, grid_y, grid_z.

What differs from the "triton" backend:

* The custom call's operands are the array arguments and its results the outputs; XLA passes
  the kernel one pointer per operand, then one per result, which is jax-triton 0.3.1's order,
  an aliased buffer included twice (`input_output_aliases` becomes the custom call's
  output_operand_aliases). There is no way to pass a scalar: every scalar argument is
  compiled into the TTIR as a constant (a new kernel per distinct value: a decode step for
  another cache size S, or a sequence length T, compiles anew).
* Every pointer is taken as 16-byte aligned, as jax-triton 0.3.1 does (XLA's buffers are).
* XLA compiles the TTIR with the Triton it bundles, not with pip's: its passes, its version.
  Where the two Tritons disagree on TTIR syntax XLA refuses the kernel at compile time (tensor
  descriptors, for one; no kernel here uses them).
"""
from __future__ import annotations

import functools
import inspect

import jax
import numpy as np

from gdp_jax._launch_spec import ARRAY, LaunchSpec, kernel_function

TARGET = "__gpu$xla.gpu.triton"
# The TTIR is target-independent up to the "ttir" stage; sm_90 (the H200) is the GPU this
# project runs on, and XLA compiles the rest for the device it finds.
CAPABILITY = 90

_POINTER_TYPES = {
    "bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64",
    "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64",
    "uint8": "u8", "uint16": "u16", "uint32": "u32", "uint64": "u64", "bool": "i1",
}


def _pointer(dtype) -> str:
  name = np.dtype(dtype).name
  if name not in _POINTER_TYPES:
    raise TypeError(f"xla_triton: no Triton pointer type for dtype {name}")
  return "*" + _POINTER_TYPES[name]


def _constant(x):
  """A scalar argument as the constexpr it becomes: np.float32 as the Python float of the same
  value, so the kernel computes with exactly the float32 the "triton" backend passes."""
  if isinstance(x, np.floating):
    return float(x)
  return x


def kernel_signature(spec: LaunchSpec, dtypes):
  """What ASTSource needs to compile a spec whose arrays have `dtypes`.

  Returns (signature, constexprs, pointers): signature and constexprs keyed by the kernel's
  parameter names, pointers the positions of the pointer parameters.
  """
  fn = kernel_function(spec.kernel, interpret=False)
  params = inspect.signature(fn.fn).parameters
  names = list(params)
  n_in, n_out = len(spec.args), len(spec.out_shape)
  given = dict(spec.constexprs)
  unknown = sorted(set(given) - set(names[n_in + n_out:]))
  if unknown or len(names) < n_in + n_out:
    raise TypeError(f"xla_triton: {fn.__name__} takes {names}; the launch passes {n_in} inputs, "
                    f"{n_out} outputs and the constexprs {sorted(given)}")
  dtypes = iter(dtypes)
  sig, consts, pointers = {}, {}, []
  for i, name in enumerate(names):
    if (i < n_in and spec.args[i] is ARRAY) or n_in <= i < n_in + n_out:
      dtype = next(dtypes) if i < n_in else spec.out_shape[i - n_in].dtype
      sig[name] = _pointer(dtype)
      pointers.append(i)
      continue
    if i < n_in:
      value = _constant(spec.args[i])
    elif name in given:
      value = given[name]
    elif params[name].default is not inspect.Parameter.empty:
      value = params[name].default
    else:
      raise TypeError(f"xla_triton: {fn.__name__}: no value for constexpr {name}")
    sig[name], consts[name] = "constexpr", value
  return sig, consts, tuple(pointers)


@functools.lru_cache(maxsize=None)
def _ttir(fn, signature, constexprs, pointers, num_warps, num_stages) -> tuple[str, str]:
  """(kernel name, TTIR text) of one specialization, after Triton's "ttir" stage (inlined,
  canonicalized), compiled on the host for an sm_90 target."""
  from triton.backends.compiler import GPUTarget
  from triton.compiler import ASTSource, make_backend
  from triton._C.libtriton import ir
  attrs = {(i,): [["tt.divisibility", 16]] for i in pointers}
  src = ASTSource(fn, dict(signature), dict(constexprs), attrs)
  target = GPUTarget("cuda", CAPABILITY, 32)
  backend = make_backend(target)
  options = backend.parse_options(dict(num_warps=num_warps, num_stages=num_stages))
  context = ir.context()
  ir.load_dialects(context)
  backend.load_dialects(context)
  module = src.make_ir(target, options, backend.get_codegen_implementation(options),
                       backend.get_module_map(), context)
  stages = {}
  backend.add_stages(stages, options, src.language)
  module = stages["ttir"](module, {})
  return src.name, str(module)


def ttir(spec: LaunchSpec, dtypes) -> tuple[str, str]:
  """(kernel name, TTIR text) that the custom call of `spec` carries."""
  sig, consts, pointers = kernel_signature(spec, dtypes)
  return _ttir(kernel_function(spec.kernel, interpret=False), tuple(sig.items()),
               tuple(consts.items()), pointers, spec.num_warps, spec.num_stages)


def run(spec: LaunchSpec, arrays):
  name, text = ttir(spec, [a.dtype for a in arrays])
  grid_x, grid_y, grid_z = spec.grid3
  call = jax.ffi.ffi_call(TARGET, spec.out_shape, input_output_aliases=spec.array_aliases)
  i32 = np.int32
  return tuple(call(*arrays, name=name, ir=text, num_warps=i32(spec.num_warps),
                    num_stages=i32(spec.num_stages), grid_x=i32(grid_x), grid_y=i32(grid_y),
                    grid_z=i32(grid_z)))
