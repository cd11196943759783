"""The launch module end to end, on a tiny kernel that updates rows of an aliased cache.

On a CPU it runs through Triton's interpreter inside jax.pure_callback; on a GPU (`-m gpu`)
through jax_triton and through XLA's Triton custom call, where the donated cache must also keep
its device buffer.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import triton
import triton.language as tl

from gdp_jax import _launch
from helpers import bits_equal


@triton.jit
def _scaled_row_update_kernel(
    x,          # [N, D] rows to add
    idx,        # [N] int32 cache rows (outside [0, S): skipped)
    cache_in,   # [S, D]
    scale, S,
    y,          # [N, D] = scale * x (fresh output)
    cache_out,  # [S, D], cache_in updated at idx
    D: tl.constexpr,
    BD: tl.constexpr,
):
  i = tl.program_id(0)
  o = tl.arange(0, BD)
  m = o < D
  b_x = tl.load(x + i * D + o, mask=m).to(tl.float32)
  tl.store(y + i * D + o, (b_x * scale).to(y.dtype.element_ty), mask=m)
  row = tl.load(idx + i).to(tl.int64)
  if (row >= 0) & (row < S):
    b_c = tl.load(cache_in + row * D + o, mask=m).to(tl.float32)
    tl.store(cache_out + row * D + o, (b_c + b_x).to(cache_out.dtype.element_ty), mask=m)


def _run(x, idx, cache, scale, backend):
  N, D = x.shape
  return _launch.call(
      _scaled_row_update_kernel, x, idx, cache, scale, cache.shape[0], grid=(N,),
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(cache.shape, cache.dtype)],
      backend=backend, input_output_aliases={2: 1}, D=D, BD=triton.next_power_of_2(D))


def _case(dtype, seed=0):
  rng = np.random.default_rng(seed)
  S, N, D = 7, 3, 10
  x = jnp.asarray(rng.standard_normal((N, D)), dtype)
  cache = rng.standard_normal((S, D)).astype(np.float32)
  cache[[0, 2, 6]] = np.nan  # rows nobody addresses must come back bit-identical
  idx = jnp.asarray([5, -1, 1], jnp.int32)
  return x, idx, jnp.asarray(cache, dtype)


def _check(x, idx, cache, y, new_cache, scale):
  np.testing.assert_array_equal(np.asarray(y, np.float32),
                                np.asarray((x.astype(jnp.float32) * np.float32(scale)).astype(x.dtype), np.float32))
  expect = np.asarray(cache, np.float32).copy()
  for i, r in enumerate(np.asarray(idx)):
    if 0 <= r < cache.shape[0]:
      expect[r] = np.asarray((cache[r].astype(jnp.float32) + x[i].astype(jnp.float32)).astype(cache.dtype), np.float32)
  assert bits_equal(np.asarray(new_cache, np.float32), expect)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_aliased_cache_interpret(dtype):
  x, idx, cache = _case(dtype)
  y, new_cache = jax.jit(lambda x, i, c: _run(x, i, c, 0.5, "interpret"))(x, idx, cache)
  _check(x, idx, cache, y, new_cache, 0.5)


def test_interpret_poisons_fresh_outputs():
  # A program that skips its row must leave NaN behind, so a test can catch it.
  x, idx, cache = _case(jnp.float32)
  y, _ = _launch.call(
      _scaled_row_update_kernel, x, idx, cache, 1.0, cache.shape[0], grid=(1,),
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(cache.shape, cache.dtype)],
      backend="interpret", input_output_aliases={2: 1}, D=x.shape[1], BD=16)
  assert np.all(np.isfinite(np.asarray(y[0]))) and np.all(np.isnan(np.asarray(y[1:])))


def test_launch_rejects_bad_grid():
  x, idx, cache = _case(jnp.float32)
  with pytest.raises(ValueError, match="grid"):
    _launch.call(_scaled_row_update_kernel, x, idx, cache, 1.0, 7, grid=(1, 70000),
                 out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)], backend="interpret", D=10, BD=16)


def test_launch_rejects_alias_of_another_shape():
  # An output aliased to the wrong argument (a launcher's argument list shifted) would be
  # written through a buffer of another size.
  x, idx, cache = _case(jnp.float32)
  with pytest.raises(ValueError, match="input_output_aliases: argument 0"):
    _launch.call(_scaled_row_update_kernel, x, idx, cache, 1.0, cache.shape[0], grid=(1,),
                 out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype),
                            jax.ShapeDtypeStruct(cache.shape, cache.dtype)],
                 backend="interpret", input_output_aliases={0: 1}, D=x.shape[1], BD=16)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "xla_triton"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_aliased_cache_gpu_donated(dtype, backend):
  x, idx, cache = _case(dtype)
  expect_cache = cache.copy()
  step = jax.jit(lambda x, i, c: _run(x, i, c, 0.5, backend), donate_argnums=2)
  ptr = cache.unsafe_buffer_pointer()
  y, new_cache = step(x, idx, cache)
  assert new_cache.unsafe_buffer_pointer() == ptr, "the donated cache moved to another buffer"
  _check(x, idx, expect_cache, y, new_cache, 0.5)


def test_differentiating_a_launch_says_forward_only():
  x, idx, cache = _case(jnp.float32)
  loss = lambda x: _run(x, idx, cache, 0.5, "interpret")[0].sum()
  # A launch outside the prefill's training path (here a cache update) says what is
  # differentiable and where gradients through it are found.
  with pytest.raises(NotImplementedError, match="forward-only.*backend='reference'"):
    jax.grad(loss)(x)
  # The forward pass under jit is untouched by the rule.
  y, new_cache = jax.jit(lambda x: _run(x, idx, cache, 0.5, "interpret"))(x)
  _check(x, idx, cache, y, new_cache, 0.5)


def _vmap_case(dtype, E=3):
  cases = [_case(dtype, seed=e) for e in range(E)]
  xs = jnp.stack([c[0] for c in cases])
  caches = jnp.stack([c[2] for c in cases])
  idx = jnp.asarray([[5, -1, 1], [0, 6, -1], [2, 2 + 7, 3]][:E], jnp.int32)  # 9: out of range
  return cases, xs, idx, caches


def _check_vmapped(xs, idx, caches, ys, new_caches, scale):
  for e in range(xs.shape[0]):
    _check(xs[e], idx[e], caches[e], ys[e], new_caches[e], scale)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_vmap_launches_once_per_element_interpret(dtype):
  _, xs, idx, caches = _vmap_case(dtype)
  run = lambda x, i, c: _run(x, i, c, 0.5, "interpret")
  ys, new_caches = jax.jit(jax.vmap(run))(xs, idx, caches)
  _check_vmapped(xs, idx, caches, ys, new_caches, 0.5)
  # Some arguments unbatched (one cache shared by every element: each gets its own copy back),
  # and vmap nested in vmap.
  ys, new_caches = jax.vmap(run, in_axes=(0, 0, None))(xs, idx, caches[0])
  _check_vmapped(xs, idx, jnp.broadcast_to(caches[0], caches.shape), ys, new_caches, 0.5)
  ys, new_caches = jax.vmap(jax.vmap(run))(xs[:, None], idx[:, None], caches[:, None])
  _check_vmapped(xs, idx, caches, ys[:, 0], new_caches[:, 0], 0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "xla_triton"])
def test_vmap_launches_once_per_element_gpu(backend):
  _, xs, idx, caches = _vmap_case(jnp.float32)
  ys, new_caches = jax.jit(jax.vmap(lambda x, i, c: _run(x, i, c, 0.5, backend)))(xs, idx, caches)
  _check_vmapped(xs, idx, caches, ys, new_caches, 0.5)
