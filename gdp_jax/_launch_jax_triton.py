"""Launch backend "triton": a LaunchSpec through `jax_triton.triton_call` (jax-triton 0.3.1).

Every quirk of jax-triton 0.3.1 lives here and nowhere else:

* it passes array arguments and scalars positionally, then one pointer per output, then the
  metaparameters as constexprs; kernels therefore order parameters inputs, outputs, constexprs;
* `None` cannot be passed (a pytree drops it): callers pass a placeholder array plus a flag;
* a Python float is typed fp64, so floats go as `np.float32`; numpy integers would be taken
  for arrays, so integers go as Python ints (`_launch._scalar`);
* `input_output_aliases` counts array arguments only (scalars are not operands of the custom
  call), and an aliased buffer reaches the kernel twice: once among the inputs, once among the
  outputs (0.4 passes it once and renamed `out_shape`; we pin <0.4 until that is tested);
* importing it sets TRITON_CACHE_DIR to "", which breaks Triton kernels launched from torch in
  the same process (the side-by-side benchmarks): the variable is put back after the import;
* it emits the custom call `triton_kernel_call`, which jaxlib launches from the host on every
  call and XLA does not capture into a CUDA graph (docs/performance.md, "Launch cost");
* it compiles each kernel specialization (dtypes, constexprs, warps, stages) once per process, at
  lowering, into a module-level dict, and never on disk: `compiled_kernels` counts them.
"""
from __future__ import annotations

import os
import sys

from gdp_jax import _versions
from gdp_jax._launch_spec import LaunchSpec, kernel_function


def _jax_triton():
  _versions.warn_if_untested()
  if "jax_triton" not in sys.modules:
    before = os.environ.get("TRITON_CACHE_DIR")
    import jax_triton  # imports only where jax has GPU support
    if before is None:
      os.environ.pop("TRITON_CACHE_DIR", None)
    else:
      os.environ["TRITON_CACHE_DIR"] = before
  return sys.modules["jax_triton"]


def compiled_kernels() -> int:
  """How many Triton kernels jax-triton has compiled in this process (0 before its import):
  what benchmarks read to tell the Triton compiles of a first call from XLA's."""
  lib = sys.modules.get("jax_triton.triton_lib")
  return len(lib._COMPILED_KERNEL_CACHE) if lib is not None else 0


def run(spec: LaunchSpec, arrays):
  return tuple(_jax_triton().triton_call(
      *spec.with_arrays(arrays),
      kernel=kernel_function(spec.kernel, interpret=False),
      out_shape=list(spec.out_shape),
      grid=spec.grid,
      num_warps=spec.num_warps,
      num_stages=spec.num_stages,
      input_output_aliases=spec.array_aliases,
      **dict(spec.constexprs),
  ))
