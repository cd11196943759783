"""What the tests share: the comparison helpers (relative error, bitwise equality), float64
upcasts, random inputs, and the prefill's case table entries and their inputs."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Relative-error tolerances (docs/algorithm.md §10.3), keyed by the dtype the kernel computed in.
RTOL = {"float64": 1e-10, "float32": 1e-5, "bfloat16": 1e-2, "float16": 5e-3}


def _f64(x) -> np.ndarray:
  return np.asarray(jnp.asarray(x, jnp.float64) if isinstance(x, jax.Array) else x, np.float64)


def err_ratio(ref, out) -> float:
  """||out - ref|| / ||ref|| in float64, the metric of fla's tests (rms ratio); the rms error
  itself where the reference is all zeros."""
  ref, out = _f64(ref), _f64(out)
  if ref.size == 0:  # e.g. a batch whose requests are all padding: nothing to compare
    return 0.0
  den = np.sqrt(np.mean(ref ** 2))
  num = np.sqrt(np.mean((ref - out) ** 2))
  return float(num / den) if den > 0 else float(num)


def assert_close(name, ref, out, rtol, *, atol=0.0):
  """Passes if out and ref are finite, of one shape, and rms(out - ref) <= rtol * rms(ref) + atol.

  The criterion is relative: ||out - ref|| / ||ref|| over the whole tensor, in float64. `atol`
  is an absolute floor on the rms error, for a reference that may be (near) zero, where a ratio
  says nothing; a test that passes one says why. With atol = 0 an all-zero reference passes only
  an all-zero result.
  """
  ref, out = _f64(ref), _f64(out)
  assert ref.shape == out.shape, f"{name}: shape {out.shape} != reference {ref.shape}"
  assert np.all(np.isfinite(out)), f"{name}: {np.sum(~np.isfinite(out))} non-finite values"
  assert np.all(np.isfinite(ref)), f"{name}: reference has non-finite values"
  if ref.size == 0:
    return
  err = float(np.sqrt(np.mean((ref - out) ** 2)))
  den = float(np.sqrt(np.mean(ref ** 2)))
  diff = float(np.max(np.abs(ref - out)))
  assert err <= rtol * den + atol, (
      f"{name}: ratio {err / den if den else float('inf'):.3e} > {rtol:.1e}"
      + (f" (absolute floor {atol:.1e})" if atol else "")
      + f"; rms error {err:.3e}, max abs diff {diff:.3e}")


def float32_again(cases, config, suffix):
  """pytest params (case, config): every case under the default config (None), then the float32
  cases again under `config`, their ids ending in "-" + suffix."""
  return ([pytest.param(c, None, id=c.id) for c in cases]
          + [pytest.param(c, config, id=f"{c.id}-{suffix}") for c in cases
             if c.dtype == "float32"])


def spy_launches(monkeypatch, record=lambda kernel, args, kwargs: kernel) -> list:
  """Records every kernel launch through gdp_jax._launch.call as record(kernel, args, kwargs)
  (None: not kept) in the list returned; the launches still run. A second spy in the same test
  replaces the first rather than wrapping it, so each list holds only its own launches."""
  from gdp_jax import _launch
  seen, call = [], getattr(_launch.call, "__wrapped__", _launch.call)

  def spy(kernel, *args, **kwargs):
    item = record(kernel, args, kwargs)
    if item is not None:
      seen.append(item)
    return call(kernel, *args, **kwargs)

  spy.__wrapped__ = call
  monkeypatch.setattr(_launch, "call", spy)
  return seen


def bits_equal(a, b) -> bool:
  """Bitwise equality that treats NaN payloads as values (NaN != NaN otherwise)."""
  a = np.asarray(a)
  b = np.asarray(b)
  if a.shape != b.shape or a.dtype != b.dtype:
    return False
  return a.tobytes() == b.tobytes()


def upcast(tree):
  """Every floating array of a pytree in float64 (the references as oracles)."""
  floating = lambda x: isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)
  return jax.tree.map(lambda x: x.astype(jnp.float64) if floating(x) else x, tree)


# --- random inputs ---------------------------------------------------------------------------


def keys(rng, shape, l2):
  """Unit rows; with `l2` (the in-kernel norm will normalise) rows of random length instead."""
  x = rng.standard_normal(shape)
  if l2:
    return x * rng.uniform(0.3, 3.0, shape[:-1] + (1,))
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def decays(rng, shape):
  """Log decays from about -1e-3 down to -20, a quarter of them exact zeros, some exactly -20."""
  g = -np.exp(rng.uniform(np.log(1e-3), np.log(20.0), shape))
  g[rng.random(shape) < 0.25] = 0.0
  g[rng.random(shape) < 0.05] = -20.0
  return g


# --- the prefill's cases ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PrefillCase:
  """One prefill call: shapes, dtype and which optional inputs and outputs it has."""
  B: int = 1
  T: int = 65
  H: int = 1
  HV: int = 2
  K: int = 16
  V: int = 16
  M: int = 2
  dtype: str = "float32"
  use_g: bool = True
  use_beta: bool = True
  l2norm: bool = False
  init: bool = False            # dense initial state
  final: bool = True            # output_final_state (dense; ignored with a cache)
  cache: str = ""               # "", "slots" (S > N, permuted, -1 and out of range), "plain"
  varlen: tuple = ()            # sequence lengths, packed (B == 1); slack tokens follow
  chunk_states: bool = False    # return_chunk_states
  states_dtype: str = ""        # chunk_states_dtype ("" = None)
  # Mean of the per-token log decays' magnitude. At 0.5 a chunk forgets all but e^-29 of its
  # entering state, which hides errors in anything that carries a state across chunks (the
  # forward scan's pieces: docs/algorithm.md §13.3); 0.005 keeps e^-0.3 of it.
  decay: float = 0.5

  @property
  def id(self):
    s = f"B{self.B}-T{self.T}-H{self.H}-HV{self.HV}-K{self.K}-V{self.V}-M{self.M}-{self.dtype}"
    s += "" if self.use_g else "-nog"
    s += "" if self.use_beta else "-nobeta"
    s += ("-l2" if self.l2norm else "") + ("-h0" if self.init else "")
    s += "" if self.final or self.cache else "-nofinal"
    s += f"-cache_{self.cache}" if self.cache else ""
    s += f"-varlen{'_'.join(map(str, self.varlen))}" if self.varlen else ""
    s += "-cs" + (f"_{self.states_dtype}" if self.states_dtype else "") if self.chunk_states else ""
    s += f"-decay{self.decay:g}" if self.decay != 0.5 else ""
    return s

  @property
  def N(self):
    return len(self.varlen) if self.varlen else self.B


def prefill_inputs(c: PrefillCase, seed):
  """Public-API arguments for case c: (array arguments, keyword arguments)."""
  rng = np.random.default_rng(seed)
  dt = jnp.dtype(c.dtype)
  q = rng.standard_normal((c.B, c.T, c.H, c.K))
  k = rng.standard_normal((c.B, c.T * c.M, c.H, c.K))
  if not c.l2norm:  # unnormalised keys with beta near 2 blow the state up and prove nothing
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
  a = dict(q=jnp.asarray(q, dt), k=jnp.asarray(k, dt),
           v=jnp.asarray(rng.standard_normal((c.B, c.T * c.M, c.HV, c.V)), dt))
  if c.use_g:
    g = -rng.exponential(c.decay, (c.B, c.T, c.HV))
    g[rng.random(g.shape) < 0.1] = 0.       # exact zeros
    g[rng.random(g.shape) < 0.03] = -20.    # strong decays
    a["g"] = jnp.asarray(g, jnp.float32)
  else:
    a["g"] = None
  a["beta"] = (jnp.asarray(rng.uniform(0, 2, (c.B, c.T * c.M, c.HV)), dt) if c.use_beta
               else None)
  kw = dict(num_householder=c.M, use_qk_l2norm_in_kernel=c.l2norm,
            return_chunk_states=c.chunk_states,
            chunk_states_dtype=jnp.dtype(c.states_dtype) if c.states_dtype else None)
  kw.update(state_arguments(rng, c, c.N))
  return a, kw


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


def padding(kw, N) -> np.ndarray:
  """[N] bools: which sequences of a call with keyword arguments kw are padding (a slot outside
  [0, S))."""
  if "state_indices" not in kw:
    return np.zeros(N, bool)
  si = np.asarray(kw["state_indices"])
  return (si < 0) | (si >= kw["state"].shape[0])
