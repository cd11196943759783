"""Every ValueError of the public API, one check function per entry point.

Checks run at trace time, on shapes and dtypes, before any kernel is launched. A message names the
argument, the expected shape in spec names with the numbers filled in, what arrived, and where
useful the likely fix. Values (slot indices, accepted counts) are checked only when they are
concrete: a numpy array or a jax array outside any trace (not a `jax.core.Tracer`). Under
`jax.jit`, `vmap` or `shard_map` they are unknown at trace time and not checked; the kernels then
treat any slot outside [0, S) as padding, and repeated slots are undefined.

The dtypes each argument may have are the tuples below; any other dtype is refused with a
ValueError that lists them.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from gdp_jax._configs import DecodeConfig
from gdp_jax._prefill_bwd import BwdConfig
from gdp_jax._prefill_kernels import F32_PRECISIONS, FwdConfig

MAX_K = 256

# Queries, keys, values, decays, beta, initial_state and the gate inputs of the decode prepare.
# The kernels compute in float32 whatever the input dtype; float32 and bfloat16 are the dtypes
# measured on the GPU, float16 runs the same 16-bit paths, float64 is the references' precision
# (the chunked prefill kernels refuse it with NotImplementedError, the decode kernels accept it).
INPUT_DTYPES = ("float32", "bfloat16", "float16", "float64")
# The state cache and its draft-token snapshots: the kernels load them into float32 registers and
# round once per call when they store them back. bfloat16 halves the state traffic (measured on
# the H200 for decode and prefill; error in benchmarks/RESULTS.md and docs/performance.md); float64 is for the references
# (oracles, tests). float16 is refused: no test or measurement covers a float16 cache, and
# bfloat16 has the same size with float32's range.
STATE_DTYPES = ("float32", "bfloat16", "float64")
# `chunk_states_dtype` of the prefill snapshots (written from float32, never read back).
CHUNK_STATES_DTYPES = ("float32", "bfloat16", "float16", "float64")
# Slots, accepted counts, cu_seqlens (the kernels read them as int32).
INDEX_DTYPES = ("int32", "int64")


def _shape_str(names, dims):
  return "[" + ", ".join(names) + "] = [" + ", ".join(str(d) for d in dims) + "]"


def _expect(name, x, names, dims, note=""):
  if x is None:
    return
  shape = tuple(getattr(x, "shape", ()))
  if shape != tuple(dims):
    extra = f" ({note})" if note else ""
    raise ValueError(f"{name}: expected {_shape_str(names, dims)}{extra}, got {list(shape)}")


def _dtype_in(name, x, allowed, what):
  if x is not None and jnp.dtype(x.dtype).name not in allowed:
    raise ValueError(f"{name}: expected {what} dtype, one of {', '.join(allowed)}; got "
                     f"{jnp.dtype(x.dtype).name}")


def _floating(name, x):
  _dtype_in(name, x, INPUT_DTYPES, "an input")


def _state_dtype(name, x):
  _dtype_in(name, x, STATE_DTYPES, "a cache")


def _integer(name, x):
  _dtype_in(name, x, INDEX_DTYPES, "an index")


def _concrete(x):
  """x as a host numpy array when its values are known now, else None (a jax Tracer under jit,
  vmap or shard_map, an abstract ShapeDtypeStruct, or an array spread over other processes)."""
  if x is None or isinstance(x, (jax.core.Tracer, jax.ShapeDtypeStruct)):
    return None
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return None
  return np.asarray(x)


def _unique_slots(state_indices, S):
  """Concrete slots in [0, S) must not repeat; -1 and other slots outside [0, S) are padding."""
  idx = _concrete(state_indices)
  if idx is None:
    return
  live = np.flatnonzero((idx >= 0) & (idx < S))
  slots, counts = np.unique(idx[live], return_counts=True)
  if np.any(counts > 1):
    slot = int(slots[counts > 1][0])
    requests = np.flatnonzero(idx == slot).tolist()
    raise ValueError(
        f"state_indices: slot {slot} is used by requests {requests}; slots in [0, S) = [0, {S}) "
        "must be unique within a call (-1 and other slots outside [0, S) mark padding and may "
        "repeat)")


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
    _state_dtype("state", state)
    S = state.shape[0]
    _expect("state", state, ("S", "HV", "K", "V"), (S, HV, K, V))
    if state_indices is None and S < N:
      raise ValueError(f"state: without state_indices sequence n uses slot n, so S >= N = {N} "
                       f"is needed, got S = {S}")
  if state_indices is not None:
    _expect("state_indices", state_indices, ("N",), (N,))
    _integer("state_indices", state_indices)
    _unique_slots(state_indices, state.shape[0])
  return N


def _num_accepted(num_accepted, *, state, state_indices, intermediate_states, N):
  """The previous step's accepted counts: [N], 0..D for every request with a slot in [0, S)."""
  if num_accepted is None:
    return
  if state is None or intermediate_states is None:
    raise ValueError("num_accepted: needs the cache (state) and the previous step's snapshots "
                     "(intermediate_states), which the counts select the start states from")
  S, D = intermediate_states.shape[:2]
  _counts(num_accepted, D, S=S, state_indices=state_indices, N=N,
          hint="n >= 1 starts from the previous step's snapshot after its n-th draft token, 0 "
               "from the cache slot")


def _counts(num_accepted, D, *, S, state_indices, N, hint):
  """num_accepted [N], an index dtype; where concrete, 0..D for every request with a live slot."""
  _expect("num_accepted", num_accepted, ("N",), (N,))
  _integer("num_accepted", num_accepted)
  n = _concrete(num_accepted)
  idx = np.arange(N) if state_indices is None else _concrete(state_indices)
  if n is None or idx is None:
    return
  bad = np.flatnonzero((idx >= 0) & (idx < S) & ((n < 0) | (n > D)))
  if bad.size:
    i = int(bad[0])
    raise ValueError(
        f"num_accepted: expected 0..D = 0..{D} for every request with a slot in [0, S), got "
        f"{int(n[i])} for request {i} (slot {int(idx[i])}); {hint}")


RING_NAMES = ("replay_ring[0] (k)", "replay_ring[1] (v)", "replay_ring[2] (g)",
              "replay_ring[3] (beta)")


def _ring(replay_ring, *, S, R, H, HV, K, V, g_rows, g_names, beta_v, r_name="R"):
  """The four ring arrays (k, v, g, beta) of S slots and R rows (r_name in messages) each; g
  has g_rows rows, beta is [S, R, HV, V] when beta_v, [S, R, HV] when not, either when beta_v
  is None."""
  if not isinstance(replay_ring, (tuple, list)) or len(replay_ring) != 4:
    raise ValueError("replay_ring: expected a tuple (k, v, g, beta) of the previous step's "
                     f"inputs per cache slot, got {type(replay_ring).__name__}")
  rk, rv, rg, rb = replay_ring
  for name, x in zip(RING_NAMES, replay_ring):
    _floating(name, x)
  if rk is None or rv is None:
    raise ValueError("replay_ring: k and v are required; only g and beta may be None")
  _expect(RING_NAMES[0], rk, ("S", r_name, "H", "K"), (S, R, H, K))
  _expect(RING_NAMES[1], rv, ("S", r_name, "HV", "V"), (S, R, HV, V))
  _expect(RING_NAMES[2], rg, ("S",) + g_names + ("HV",), (S,) + g_rows + (HV,))
  if rb is not None:
    if beta_v or (beta_v is None and rb.ndim == 4):
      _expect(RING_NAMES[3], rb, ("S", r_name, "HV", "V"), (S, R, HV, V), "element-wise")
    else:
      _expect(RING_NAMES[3], rb, ("S", r_name, "HV"), (S, R, HV))


def _replay_step(replay_ring, g, beta, *, state, state_indices, intermediate_states,
                 num_accepted, N, R, r_name, D, H, HV, K, V, g_rows, g_names):
  """A step with replay_ring: the ring fits the step (same g and beta presence and form), needs
  the cache and the counts, excludes the snapshots."""
  if replay_ring is None:
    return
  if state is None:
    raise ValueError("replay_ring: needs the cache (state) [S, HV, K, V], whose slots hold the "
                     "checkpoints the ring is replayed into")
  if num_accepted is None:
    raise ValueError(f"replay_ring: needs num_accepted [N] = [{N}], the ring tokens each "
                     "request keeps (0 after prefill)")
  if intermediate_states is not None:
    raise ValueError("intermediate_states: not with replay_ring; the ring replaces the "
                     "snapshots")
  S = state.shape[0]
  _ring(replay_ring, S=S, R=R, H=H, HV=HV, K=K, V=V, g_rows=g_rows, g_names=g_names,
        beta_v=None if beta is None else beta.ndim == 4, r_name=r_name)
  for i, arg, step in ((2, "g", g), (3, "beta", beta)):
    if (replay_ring[i] is None) != (step is None):
      raise ValueError(
          f"{RING_NAMES[i]}: expected None exactly when the step's {arg} is None (the ring "
          f"replays what the step ran), got {'None' if replay_ring[i] is None else 'an array'} "
          f"with {arg} {'None' if step is None else 'given'}")
  _counts(num_accepted, D, S=S, state_indices=state_indices, N=N,
          hint="n replays the first n draft tokens of the ring (the previous step's), 0 none")


def check_commit_replay(state, replay_ring, state_indices, num_accepted, *,
                        steps_per_token) -> Dims:
  """Checks the arguments of `commit_replay`; returns the sizes (T = 0: no new tokens)."""
  _ndim("state", state, ("S", "HV", "K", "V"))
  _state_dtype("state", state)
  S, HV, K, V = state.shape
  _positive_int("steps_per_token", steps_per_token)
  if not isinstance(replay_ring, (tuple, list)) or len(replay_ring) != 4:
    raise ValueError("replay_ring: expected a tuple (k, v, g, beta) of the previous step's "
                     f"inputs per cache slot, got {type(replay_ring).__name__}")
  rk = replay_ring[0]
  if rk is None:
    raise ValueError("replay_ring: k and v are required; only g and beta may be None")
  _ndim(RING_NAMES[0], rk, ("S", "R", "H", "K"))
  R, H = rk.shape[1], rk.shape[2]
  if R % steps_per_token:
    raise ValueError(f"{RING_NAMES[0]}: R = {R} rows must be a multiple of steps_per_token = "
                     f"{steps_per_token} (D draft tokens of steps_per_token rows)")
  if HV % H:
    raise ValueError(f"{RING_NAMES[1]}: value heads HV = {HV} must be a multiple of key heads "
                     f"H = {H}")
  D = R // steps_per_token
  rg = replay_ring[2]
  g_rows = (R,)
  if rg is not None and getattr(rg, "ndim", 0) == 3 and rg.shape[1] == D:
    g_rows = (D,)  # one decay per draft token, applied on its first row
  _ring(replay_ring, S=S, R=R, H=H, HV=HV, K=K, V=V, g_rows=g_rows,
        g_names=("R",) if g_rows == (R,) else ("D",), beta_v=None)
  _ndim("state_indices", state_indices, ("N",))
  _integer("state_indices", state_indices)
  N = state_indices.shape[0]
  _unique_slots(state_indices, S)
  _counts(num_accepted, D, S=S, state_indices=state_indices, N=N,
          hint="n replays the first n draft tokens of the ring, 0 none")
  return Dims(N, 0, H, HV, K, V, N)


def check_fused_recurrent(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, state,
                          state_indices, intermediate_states, num_accepted, replay_ring,
                          steps_per_token) -> Dims:
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
    _state_dtype("intermediate_states", intermediate_states)
    _ndim("intermediate_states", intermediate_states, ("S", "T // steps_per_token", "HV", "K", "V"))
    S = state.shape[0] if state is not None else intermediate_states.shape[0]
    _expect("intermediate_states", intermediate_states,
            ("S", "T // steps_per_token", "HV", "K", "V"), (S, T // steps_per_token, HV, K, V),
            f"steps_per_token={steps_per_token}")
    if state is None and S < N:
      raise ValueError(f"intermediate_states: without state sequence n uses slot n, so S >= N = "
                       f"{N} is needed, got S = {S}")
  if replay_ring is not None:
    if cu_seqlens is not None:
      raise ValueError("cu_seqlens: not with replay_ring; the ring holds T steps per slot, so "
                       "the step takes a dense [B, T] batch")
    if T % steps_per_token:
      raise ValueError(f"q: T = {T} must be a multiple of steps_per_token = {steps_per_token} "
                       "with replay_ring")
    _replay_step(replay_ring, g, beta, state=state, state_indices=state_indices,
                 intermediate_states=intermediate_states, num_accepted=num_accepted, N=N, R=T,
                 r_name="T", D=T // steps_per_token, H=H, HV=HV, K=K, V=V, g_rows=(T,),
                 g_names=("T",))
  else:
    _num_accepted(num_accepted, state=state, state_indices=state_indices,
                  intermediate_states=intermediate_states, N=N)
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


def _int_rule(what, ok):
  # True == 1 passes isinstance(x, int): a bool is refused wherever an int is meant.
  return what, lambda x: isinstance(x, int) and not isinstance(x, bool) and ok(x)


def _pow2(lo):
  return _int_rule(f"a power of two >= {lo}", lambda x: x >= lo and x & (x - 1) == 0)


def _choice(*values):
  return f"one of {', '.join(map(repr, values))}", lambda x: isinstance(x, str) and x in values


# What each field of a kernel config may hold, as (what is expected, test). Tile extents go to
# tl.arange, which takes powers of two; in the chunked kernels they are dot operand extents too,
# and tl.dot's smallest is 16. Triton refuses warps other than powers of two, and a program has at
# most 1024 threads (32 warps). Values outside these the kernels cannot compile; values inside
# may still exceed a GPU's registers or shared memory, which only compiling tells.
_WARPS = _int_rule("1, 2, 4, 8, 16 or 32", lambda x: x in (1, 2, 4, 8, 16, 32))
_STAGES = _int_rule("an int >= 1", lambda x: x >= 1)
_TILE = _pow2(16)
_PRECISION16 = _choice("tf32x3", "ieee", "tf32")   # dots on 16-bit inputs ("tf32": the default)
_F32 = _choice(*F32_PRECISIONS)   # float32 inputs: float32-level products only
_COUNT = _int_rule("an int >= 0", lambda x: x >= 0)
_POSITIVE = _int_rule("an int >= 1", lambda x: x >= 1)
_BIT = ("0 or 1", lambda x: isinstance(x, int) and x in (0, 1))
_CONFIG_FIELDS = {
    DecodeConfig: dict(BV=_pow2(1), num_warps=_WARPS, num_stages=_STAGES),
    FwdConfig: dict(
        kkt_bk=_TILE, kkt_warps=_WARPS, solve_warps=_WARPS, solve_precision=_PRECISION16,
        kkt_solve=_int_rule("-1 (by dtype), 0 or 1", lambda x: x in (-1, 0, 1)),
        f32_precision=_F32, h_bv_wide=_TILE, h_bv_big_k=_TILE,
        h_piece=_int_rule("an int >= -1 (-1: from the request's shape, 0: never split, n > 0: "
                          "pieces of n expanded chunks)", lambda x: x >= -1),
        h_split_programs=_COUNT, h_chain_precision=_PRECISION16, h_chain_bv=_int_rule(
            "0 (the walk's) or a power of two >= 16",
            lambda x: x == 0 or (x >= 16 and x & (x - 1) == 0)),
        h_warps=_WARPS,
        h_stages=_STAGES, h_stages_f32=_STAGES, o_bk=_TILE, o_bv=_TILE, o_warps=_WARPS,
        o_stages=_STAGES),
    BwdConfig: dict(
        h_bv=_TILE, h_bv_big_k=_TILE, h_warps=_WARPS, h_stages=_STAGES,
        h_split=_int_rule("an int >= 0 (0: from the number of programs, 1: never split, n > 1: "
                          "n pieces per sequence)", lambda x: x >= 0),
        h_split_min_programs=_COUNT, h_split_programs=_POSITIVE, h_split_max=_POSITIVE,
        o_bk=_TILE, o_bv=_TILE, o_warps=_WARPS, o_stages=_STAGES, wy_warps=_WARPS,
        wy_stages=_STAGES,
        # qk_bwd's rows per program, qk_block // BK, must be a power of two too.
        qk_block=_pow2(16), qk_warps=_WARPS,
        finish_dk=_BIT, partials=_choice("float32", "input"), f32_precision=_F32),
}


def config_fields(cls) -> tuple[str, ...]:
  """The field names of a kernel config class (a NamedTuple or a dataclass)."""
  if dataclasses.is_dataclass(cls):
    return tuple(f.name for f in dataclasses.fields(cls))
  return cls._fields


def check_config(name, config, cls):
  """`config`, the argument called `name`, is None or a `cls` (DecodeConfig, FwdConfig or
  BwdConfig, exported from gdp_jax) whose every field holds a value the kernels can take."""
  if config is None:
    return
  if type(config) is not cls:
    raise ValueError(f"{name}: expected a gdp_jax.{cls.__name__} or None, got "
                     f"{type(config).__name__}")
  rules = _CONFIG_FIELDS[cls]
  for field in config_fields(cls):
    value = getattr(config, field)
    what, ok = rules[field]
    if not ok(value):
      raise ValueError(f"{name}: {cls.__name__}.{field}: expected {what}, got {value!r}")


def check_prefill(q, k, v, g, beta, *, num_householder, scale, initial_state, cu_seqlens, state,
                  state_indices, chunk_states_dtype, config, bwd_config) -> Dims:
  """Checks the arguments of `chunk_gated_delta_product`."""
  check_config("config", config, FwdConfig)
  check_config("bwd_config", bwd_config, BwdConfig)
  B, T, H, K, HV, V = _expanded_stream(q, k, v, g, beta, num_householder, "B", "T", "token")
  N = _common_state(B, T, HV, K, V, scale=scale, initial_state=initial_state,
                    cu_seqlens=cu_seqlens, state=state, state_indices=state_indices)
  if chunk_states_dtype is not None:
    try:
      name = jnp.dtype(chunk_states_dtype).name
    except TypeError:
      name = repr(chunk_states_dtype)
    if name not in CHUNK_STATES_DTYPES:
      raise ValueError(f"chunk_states_dtype: expected None or one of "
                       f"{', '.join(CHUNK_STATES_DTYPES)}; got {name}")
  return Dims(B, T, H, HV, K, V, N)


def check_gdp_decode(q, k, v, g, beta, *, num_householder, state, state_indices,
                     intermediate_states, num_accepted, replay_ring, scale) -> Dims:
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
    _state_dtype("intermediate_states", intermediate_states)
    _expect("intermediate_states", intermediate_states, ("S", "D", "HV", "K", "V"),
            (state.shape[0], D, HV, K, V))
  if replay_ring is not None:
    M = num_householder
    _replay_step(replay_ring, g, beta, state=state, state_indices=state_indices,
                 intermediate_states=intermediate_states, num_accepted=num_accepted, N=N,
                 R=D * M, r_name="D*M", D=D, H=H, HV=HV, K=K, V=V, g_rows=(D,),
                 g_names=("D",))
  else:
    _num_accepted(num_accepted, state=state, state_indices=state_indices,
                  intermediate_states=intermediate_states, N=N)
  return Dims(N, D, H, HV, K, V, N)


def check_accept(state, intermediate_states, state_indices, num_accepted):
  """Checks the arguments of `accept_draft_tokens`; values only where concrete."""
  _ndim("state", state, ("S", "HV", "K", "V"))
  _state_dtype("state", state)
  S, HV, K, V = state.shape
  _ndim("intermediate_states", intermediate_states, ("S", "D", "HV", "K", "V"))
  D = intermediate_states.shape[1]
  _expect("intermediate_states", intermediate_states, ("S", "D", "HV", "K", "V"), (S, D, HV, K, V))
  _state_dtype("intermediate_states", intermediate_states)
  _ndim("state_indices", state_indices, ("N",))
  _integer("state_indices", state_indices)
  N = state_indices.shape[0]
  _expect("num_accepted", num_accepted, ("N",), (N,))
  _integer("num_accepted", num_accepted)
  _unique_slots(state_indices, S)
  idx, n = _concrete(state_indices), _concrete(num_accepted)
  if idx is not None and n is not None:
    # Padding requests (slot outside [0, S)) are ignored, whatever their count.
    bad = np.flatnonzero((idx >= 0) & (idx < S) & ((n < 1) | (n > D)))
    if bad.size:
      i = int(bad[0])
      raise ValueError(
          f"num_accepted: expected 1..D = 1..{D} for every request with a slot in [0, S), got "
          f"{int(n[i])} for request {i} (slot {int(idx[i])}); the snapshots hold the states "
          "after draft tokens 1..D only (a padding request, slot -1, may carry any count)")


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
