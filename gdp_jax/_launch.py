"""The one place through which every Triton kernel is launched.

`call` checks a launch, describes it as a `LaunchSpec` (gdp_jax/_launch_spec.py) and hands it
to one of three backends, same grid, same arguments, same output shapes:

* "triton": `jax_triton.triton_call` on a GPU (gdp_jax/_launch_jax_triton.py), the default;
* "xla_triton": XLA's own Triton custom call on a GPU, its scalar arguments compiled in as
  constants (gdp_jax/_launch_xla_triton.py); opt-in, cheaper per launch;
* "interpret": Triton's interpreter on the CPU inside `jax.pure_callback`
  (gdp_jax/_launch_interpret.py).

What holds for every backend lives here: the argument checks, the typing of scalars, an empty
grid that launches nothing, the rule that a launch is not differentiable, and its batching
under `jax.vmap` (one launch per element).
"""
from __future__ import annotations

import importlib
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gdp_jax._launch_spec import ARRAY, LaunchSpec, is_array

# backend -> the module whose `run(spec, arrays)` launches a spec (imported on first use: the
# GPU modules import jax_triton or triton's compiler, which a CPU run does not need).
BACKEND_MODULES = {
    "triton": "gdp_jax._launch_jax_triton",
    "xla_triton": "gdp_jax._launch_xla_triton",
    "interpret": "gdp_jax._launch_interpret",
}


def placeholder(dtype=jnp.float32) -> jax.Array:
  """Stands for an optional pointer argument that is absent (a constexpr flag turns it off):
  triton_call cannot pass None, since a pytree drops it."""
  return jnp.zeros((1,), dtype)


def _scalar(x):
  """Scalars typed the way every backend takes them: a Python float would be typed fp64 by
  jax-triton, so floats go as np.float32; numpy integers would be taken for arrays, so
  integers go as Python ints."""
  if isinstance(x, (bool, np.bool_)):
    return bool(x)
  if isinstance(x, (int, np.integer)):
    return int(x)
  if isinstance(x, (float, np.floating)):
    return np.float32(x)
  raise TypeError(f"unsupported scalar argument {x!r} of type {type(x).__name__}")


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
    backend: "triton", "xla_triton" or "interpret".
    input_output_aliases: {position in args: output index}; the output starts as a copy of that
      input (or is that buffer, when donated under jit on the GPU).
    num_warps, num_stages: compile options (ignored by the interpreter).
    **constexprs: the kernel's constexpr parameters.

  Returns:
    A tuple of output arrays. Outputs that are not aliased start uninitialised on the GPU and as
    NaN (or the integer minimum) in the interpreter, so an unwritten element shows.
  """
  grid = tuple(int(g) for g in grid)
  if not grid or len(grid) > 3 or any(g < 0 for g in grid):
    raise ValueError(f"grid: expected 1 to 3 non-negative axes, got {grid}")
  if len(grid) > 1 and max(grid[1:]) > 65535:
    raise ValueError(f"grid: axes 1 and 2 are capped at 65535 by CUDA, got {grid}")
  args = [a if is_array(a) else _scalar(a) for a in args]
  aliases = dict(input_output_aliases or {})
  out_shape = tuple(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in out_shape)
  for i, j in aliases.items():
    if not is_array(args[i]):
      raise ValueError(f"input_output_aliases: argument {i} is a scalar")
    # An output aliased to the wrong argument would be written through that argument's buffer.
    if (args[i].shape, args[i].dtype) != (out_shape[j].shape, out_shape[j].dtype):
      raise ValueError(
          f"input_output_aliases: argument {i} is {args[i].dtype}{list(args[i].shape)}, output "
          f"{j} is {out_shape[j].dtype}{list(out_shape[j].shape)}")
  if backend not in BACKEND_MODULES:
    raise ValueError(
        f"backend: expected one of {tuple(BACKEND_MODULES)} for a kernel launch, got {backend!r}")
  if any(g == 0 for g in grid):
    return _no_launch(args, out_shape, aliases)
  spec = LaunchSpec(
      kernel=kernel, args=tuple(ARRAY if is_array(a) else a for a in args), grid=grid,
      out_shape=out_shape, aliases=tuple(sorted(aliases.items())), num_warps=int(num_warps),
      num_stages=int(num_stages), constexprs=tuple(sorted(constexprs.items())))
  run = importlib.import_module(BACKEND_MODULES[backend]).run

  @jax.custom_batching.custom_vmap
  def batchable(*arrays):
    return tuple(run(spec, arrays))

  # jax-triton's and XLA's Triton calls have no batching rule (jax.vmap raises inside them),
  # and a kernel's grid knows nothing of a vmapped axis: each element launches once, in turn.
  @batchable.def_vmap
  def _one_at_a_time(axis_size, in_batched, *arrays):
    del axis_size
    if not any(in_batched):
      return batchable(*arrays), (False,) * len(spec.out_shape)
    batched = [a for a, b in zip(arrays, in_batched) if b]

    def one(elements):
      it = iter(elements)
      return batchable(*[next(it) if b else a for a, b in zip(arrays, in_batched)])

    outs = jax.lax.map(one, batched)
    return outs, (True,) * len(outs)

  # Differentiating a launch would otherwise fail inside a backend with a message about its
  # internals; say what is true here instead, at trace time.
  @jax.custom_jvp
  def launch(*arrays):
    return batchable(*arrays)

  launch.defjvp(_forward_only)
  return tuple(launch(*[a for a in args if is_array(a)]))


def _forward_only(primals, tangents):
  raise NotImplementedError(
      "gdp_jax's Triton kernels are differentiable only through chunk_gated_delta_product "
      "without a state cache and without chunk snapshots: jax.grad / jax.vjp with respect to "
      "q, k, v, g, beta and initial_state (and the final state's cotangent with "
      "output_final_state=True). The state cache (state, state_indices), return_chunk_states "
      "and the decode entry points are forward-only, and so is the backward itself: forward "
      "mode (jax.jvp, jax.jacfwd) and derivatives of a gradient (jax.hessian, a grad of a "
      "grad) are not supported. For those use backend='reference', the pure jax.numpy twins.")


def _no_launch(args, out_shape, aliases):
  """An empty grid writes nothing: aliased outputs keep their input, the rest are zeros."""
  inv = {o: i for i, o in aliases.items()}
  return tuple(args[inv[j]] if j in inv else jnp.zeros(s.shape, s.dtype)
               for j, s in enumerate(out_shape))
