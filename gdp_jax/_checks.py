"""Every ValueError of the public API, one check function per entry point.

Checks run at trace time, on shapes and dtypes only, before any kernel is launched. A message
names the argument, the expected shape in spec names with the numbers filled in, what arrived,
and where useful the likely fix. Slot indices cannot be checked at trace time: the kernels treat
any slot outside [0, S) as padding instead.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

MAX_K = 256


def _shape_str(names, dims):
  return "[" + ", ".join(names) + "] = [" + ", ".join(str(d) for d in dims) + "]"


def _expect(name, x, names, dims, note=""):
  if x is None:
    return
  shape = tuple(getattr(x, "shape", ()))
  if shape != tuple(dims):
    extra = f" ({note})" if note else ""
    raise ValueError(f"{name}: expected {_shape_str(names, dims)}{extra}, got {list(shape)}")


def _floating(name, x):
  if x is not None and not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{name}: expected a floating dtype, got {x.dtype}")


def _integer(name, x):
  if x is not None and not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{name}: expected an integer dtype (int32), got {x.dtype}")


def _ndim(name, x, names):
  if x is not None and getattr(x, "ndim", None) != len(names):
    shape = list(getattr(x, "shape", ()))
    raise ValueError(f"{name}: expected {len(names)} dims [{', '.join(names)}], got {shape}")


def _positive_int(name, x):
  if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1:
    raise ValueError(f"{name}: expected a positive int, got {x!r}")


@dataclasses.dataclass(frozen=True)
class Dims:
  """Sizes in spec names, as read off validated inputs."""
  B: int
  T: int
  H: int
  HV: int
  K: int
  V: int
  N: int


def _heads(q_name, q, v_name, v):
  _ndim(q_name, q, ("B", "T", "H", "K"))
  _ndim(v_name, v, ("B", "T", "HV", "V"))
  _floating(q_name, q)
  _floating(v_name, v)
  B, T, H, K = q.shape
  HV, V = v.shape[2], v.shape[3]
  if K > MAX_K:
    raise ValueError(f"{q_name}: K = {K} exceeds the supported maximum K <= {MAX_K}")
  if HV % H != 0:
    raise ValueError(f"{v_name}: value heads HV = {HV} must be a multiple of query/key heads "
                     f"H = {H} (grouped like GQA)")
  return B, T, H, K, HV, V


def _common_state(B, T, HV, K, V, *, scale, initial_state, cu_seqlens, state, state_indices):
  if scale is not None and not isinstance(scale, (int, float, np.floating, np.integer)):
    raise ValueError(f"scale: expected a Python number or None, got {type(scale).__name__}")
  if cu_seqlens is not None:
    _ndim("cu_seqlens", cu_seqlens, ("N+1",))
    _integer("cu_seqlens", cu_seqlens)
    if B != 1:
      raise ValueError(f"cu_seqlens: packed sequences need B == 1, got B = {B}; flatten the "
                       "batch into one row of T tokens first")
    if cu_seqlens.shape[0] < 2:
      raise ValueError(f"cu_seqlens: expected [N+1] with N >= 1, got {list(cu_seqlens.shape)}")
    N = cu_seqlens.shape[0] - 1
  else:
    N = B
  if state_indices is not None and state is None:
    raise ValueError("state_indices: given without state; pass the cache [S, HV, K, V] as state")
  if state is not None and initial_state is not None:
    raise ValueError("state: given together with initial_state; the cache replaces it (sequence "
                     "n reads and writes state[state_indices[n]]), pass one of them")
  if initial_state is not None:
    _expect("initial_state", initial_state, ("N", "HV", "K", "V"), (N, HV, K, V))
    _floating("initial_state", initial_state)
  if state is not None:
    _ndim("state", state, ("S", "HV", "K", "V"))
    _floating("state", state)
    S = state.shape[0]
    _expect("state", state, ("S", "HV", "K", "V"), (S, HV, K, V))
    if state_indices is None and S < N:
      raise ValueError(f"state: without state_indices sequence n uses slot n, so S >= N = {N} "
                       f"is needed, got S = {S}")
  if state_indices is not None:
    _expect("state_indices", state_indices, ("N",), (N,))
    _integer("state_indices", state_indices)
  return N


def check_fused_recurrent(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, state,
                          state_indices, intermediate_states, steps_per_token) -> Dims:
  """Checks the arguments of `fused_recurrent_gated_delta_rule`."""
  B, T, H, K, HV, V = _heads("q", q, "v", v)
  _expect("k", k, ("B", "T", "H", "K"), (B, T, H, K))
  _floating("k", k)
  _expect("v", v, ("B", "T", "HV", "V"), (B, T, HV, V))
  _expect("g", g, ("B", "T", "HV"), (B, T, HV))
  _floating("g", g)
  if beta is not None:
    if beta.ndim == 4:
      _expect("beta", beta, ("B", "T", "HV", "V"), (B, T, HV, V), "element-wise")
    else:
      _expect("beta", beta, ("B", "T", "HV"), (B, T, HV), "head-wise; or [B, T, HV, V]")
    _floating("beta", beta)
  N = _common_state(B, T, HV, K, V, scale=scale, initial_state=initial_state,
                    cu_seqlens=cu_seqlens, state=state, state_indices=state_indices)
  _positive_int("steps_per_token", steps_per_token)
  if intermediate_states is not None:
    _floating("intermediate_states", intermediate_states)
    _ndim("intermediate_states", intermediate_states, ("S", "T // steps_per_token", "HV", "K", "V"))
    S = state.shape[0] if state is not None else intermediate_states.shape[0]
    _expect("intermediate_states", intermediate_states,
            ("S", "T // steps_per_token", "HV", "K", "V"), (S, T // steps_per_token, HV, K, V),
            f"steps_per_token={steps_per_token}")
    if state is None and S < N:
      raise ValueError(f"intermediate_states: without state sequence n uses slot n, so S >= N = "
                       f"{N} is needed, got S = {S}")
  return Dims(B, T, H, HV, K, V, N)


def _expanded_stream(q, k, v, g, beta, M, batch, tokens, token):
  """q one row per token, k, v, beta M rows per token (the Householder-expanded stream), g one
  per token; `batch`, `tokens` name the leading dims ("B", "T" or "N", "D"), `token` the unit."""
  _positive_int("num_householder", M)
  rows = f"{tokens}*M"
  _ndim("q", q, (batch, tokens, "H", "K"))
  _ndim("v", v, (batch, rows, "HV", "V"))
  B, T, H, K = q.shape
  _expect("k", k, (batch, rows, "H", "K"), (B, T * M, H, K), f"M={M} rows per {token}")
  _floating("k", k)
  B, T, H, K, HV, V = _heads("q", q, "v", v)
  _expect("v", v, (batch, rows, "HV", "V"), (B, T * M, HV, V), f"M={M} rows per {token}")
  _expect("g", g, (batch, tokens, "HV"), (B, T, HV), f"one log decay per {token}")
  _floating("g", g)
  _expect("beta", beta, (batch, rows, "HV"), (B, T * M, HV), f"M={M} rows per {token}")
  _floating("beta", beta)
  return B, T, H, K, HV, V


def check_prefill(q, k, v, g, beta, *, num_householder, scale, initial_state, cu_seqlens, state,
                  state_indices, chunk_states_dtype) -> Dims:
  """Checks the arguments of `chunk_gated_delta_product`."""
  B, T, H, K, HV, V = _expanded_stream(q, k, v, g, beta, num_householder, "B", "T", "token")
  N = _common_state(B, T, HV, K, V, scale=scale, initial_state=initial_state,
                    cu_seqlens=cu_seqlens, state=state, state_indices=state_indices)
  if chunk_states_dtype is not None and not jnp.issubdtype(chunk_states_dtype, jnp.floating):
    raise ValueError(f"chunk_states_dtype: expected a floating dtype, got {chunk_states_dtype}")
  return Dims(B, T, H, HV, K, V, N)


def check_gdp_decode(q, k, v, g, beta, *, num_householder, state, state_indices,
                     intermediate_states, scale) -> Dims:
  """Checks the arguments of `gated_delta_product_decode` (T is D, the draft tokens)."""
  N, D, H, K, HV, V = _expanded_stream(q, k, v, g, beta, num_householder, "N", "D",
                                       "draft token")
  if state is None:
    raise ValueError("state: the decode step needs the cache [S, HV, K, V]")
  if state_indices is None:
    raise ValueError(f"state_indices: the decode step needs [N] = [{N}] cache slots (-1: padding)")
  _common_state(N, D, HV, K, V, scale=scale, initial_state=None, cu_seqlens=None, state=state,
                state_indices=state_indices)
  if intermediate_states is not None:
    _floating("intermediate_states", intermediate_states)
    _expect("intermediate_states", intermediate_states, ("S", "D", "HV", "K", "V"),
            (state.shape[0], D, HV, K, V))
  return Dims(N, D, H, HV, K, V, N)


def check_accept(state, intermediate_states, state_indices, num_accepted):
  """Checks the arguments of `accept_draft_tokens`."""
  _ndim("state", state, ("S", "HV", "K", "V"))
  _floating("state", state)
  S, HV, K, V = state.shape
  _ndim("intermediate_states", intermediate_states, ("S", "D", "HV", "K", "V"))
  D = intermediate_states.shape[1]
  _expect("intermediate_states", intermediate_states, ("S", "D", "HV", "K", "V"), (S, D, HV, K, V))
  _floating("intermediate_states", intermediate_states)
  _ndim("state_indices", state_indices, ("N",))
  _integer("state_indices", state_indices)
  N = state_indices.shape[0]
  _expect("num_accepted", num_accepted, ("N",), (N,))
  _integer("num_accepted", num_accepted)


def check_decode_prepare(q, k, v, a, b, A_log, dt_bias, *, num_householder, allow_neg_eigval):
  """Checks the arguments of `gated_delta_product_decode_prepare`; returns the sizes."""
  _positive_int("num_householder", num_householder)
  M = num_householder
  _ndim("q", q, ("N", "D", "H", "K"))
  _ndim("v", v, ("N", "D*M", "HV", "V"))
  N, D, H, K, HV, V = _heads("q", q, "v", v)
  _expect("k", k, ("N", "D*M", "H", "K"), (N, D * M, H, K), f"M={M} rows per draft token")
  _floating("k", k)
  _expect("v", v, ("N", "D*M", "HV", "V"), (N, D * M, HV, V), f"M={M} rows per draft token")
  _expect("a", a, ("N", "D", "HV"), (N, D, HV), "one decay pre-activation per draft token")
  _floating("a", a)
  _expect("b", b, ("N", "D*M", "HV"), (N, D * M, HV), f"M={M} rows per draft token")
  _floating("b", b)
  _expect("A_log", A_log, ("HV",), (HV,))
  _floating("A_log", A_log)
  _expect("dt_bias", dt_bias, ("HV",), (HV,))
  _floating("dt_bias", dt_bias)
  if not isinstance(allow_neg_eigval, (bool, np.bool_)):
    raise ValueError(f"allow_neg_eigval: expected a Python bool, got {type(allow_neg_eigval).__name__}")
  return N, D, M, H, K, HV
