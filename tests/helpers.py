"""Comparison helpers shared by the tests."""
import jax
import jax.numpy as jnp
import numpy as np

# Relative-error tolerances (docs/algorithm.md §10.3), keyed by the dtype the kernel computed in.
RTOL = {"float64": 1e-10, "float32": 1e-5, "bfloat16": 1e-2, "float16": 5e-3}


def err_ratio(ref, out) -> float:
  """||out - ref|| / ||ref|| in float64, the metric of fla's tests (rms ratio)."""
  ref = np.asarray(ref, np.float64)
  out = np.asarray(out, np.float64)
  if ref.size == 0:  # e.g. a batch whose requests are all padding: nothing to compare
    return 0.0
  den = np.sqrt(np.mean(ref ** 2))
  num = np.sqrt(np.mean((ref - out) ** 2))
  return float(num / den) if den > 0 else float(num)


def assert_close(name, ref, out, ratio):
  """Passes if max|ref - out| <= 1e-6 (tiny tensors) or the rms ratio is under `ratio`."""
  ref = np.asarray(jnp.asarray(ref, jnp.float64) if isinstance(ref, jax.Array) else ref, np.float64)
  out = np.asarray(jnp.asarray(out, jnp.float64) if isinstance(out, jax.Array) else out, np.float64)
  assert ref.shape == out.shape, f"{name}: shape {out.shape} != reference {ref.shape}"
  assert np.all(np.isfinite(out)), f"{name}: {np.sum(~np.isfinite(out))} non-finite values"
  assert np.all(np.isfinite(ref)), f"{name}: reference has non-finite values"
  diff = float(np.max(np.abs(ref - out))) if ref.size else 0.0
  r = err_ratio(ref, out)
  assert diff <= 1e-6 or r < ratio, f"{name}: ratio {r:.3e} >= {ratio:.1e} (max abs diff {diff:.3e})"


def bits_equal(a, b) -> bool:
  """Bitwise equality that treats NaN payloads as values (NaN != NaN otherwise)."""
  a = np.asarray(a)
  b = np.asarray(b)
  if a.shape != b.shape or a.dtype != b.dtype:
    return False
  return a.tobytes() == b.tobytes()


def state_arguments(rng, c, N):
  """The keyword arguments for a test case's sequences and state, poisoned where unaddressed.

  c carries T, HV, K, V, varlen (packed sequence lengths, or ()), init (dense initial state),
  cache ("" none, "plain" slot n for sequence n, "slots": S > N permuted slots with a -1 and, for
  N > 2, an out-of-range one) and final (output_final_state without a cache). Unaddressed slots
  hold NaN, so a stray write or read shows.
  """
  kw = {}
  if c.varlen:
    cu = np.concatenate([[0], np.cumsum(c.varlen)])
    assert cu[-1] <= c.T
    kw["cu_seqlens"] = jnp.asarray(cu, jnp.int32)
  if c.init:
    kw["initial_state"] = jnp.asarray(rng.standard_normal((N, c.HV, c.K, c.V)), jnp.float32)
  if c.cache:
    S = N + 3 if c.cache == "slots" else N
    cache = rng.standard_normal((S, c.HV, c.K, c.V)).astype(np.float32)
    if c.cache == "slots":
      slots = rng.permutation(S)[:N].astype(np.int32)
      slots[0] = -1
      if N > 2:
        slots[-1] = S + 7  # out of range: padding too, and must not be written
      cache[np.setdiff1d(np.arange(S), slots)] = np.nan
      kw["state_indices"] = jnp.asarray(slots)
    kw["state"] = jnp.asarray(cache, jnp.float32)
  else:
    kw["output_final_state"] = c.final
  return kw
