"""The jnp references against each other, against a plain float64 numpy loop, and against
results known by hand (CPU, float64).

The scan forms in gdp_jax.reference.recurrent are the oracles of every kernel test, so they are
checked here three ways: against the chunked WY twin (written independently), against the
numpy loop below (written from docs/api.md's recurrence, sharing nothing with either), and against
closed forms. Then the decode-side identities: GDP prefill = fused recurrent on the folded
stream, decode = prefill continued from the cache, snapshots = sequential decodes, rollback.
"""
import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdp_jax import reference as R
from helpers import assert_close, bits_equal, decays, keys

TOL = 1e-10  # float64 relative error (rms ratio) between two exact forms of the same math


def _jit(fn, **static):
  """fn under jax.jit with its python-valued keyword arguments fixed (one compile per call site)."""
  return jax.jit(functools.partial(fn, **static))


def _close(name, ref, out):
  """Relative error under TOL, no absolute floor: an all-zero reference (slack rows, the
  states of empty batches) must be matched exactly."""
  assert_close(name, ref, out, TOL)


# --------------------------------------------------------------------------------------------
# The plain numpy loop: docs/api.md's recurrence, one (sequence, value head, token, copy) at a time.

def np_gdp(q, k, v, g, beta, M, scale, cu, h0, live, l2norm=False):
  """float64 token loop over a packed stream.

  Args:
    q: [TT, H, K]; k: [TT*M, H, K]; v: [TT*M, HV, V]; g: [TT, HV] or None;
    beta: [TT*M, HV] or [TT*M, HV, V] or None; cu: list of N+1 ints; h0: [N, HV, K, V];
    live: N bools (False: padding, skipped, output 0).

  Returns:
    o [TT, HV, V]; final [N, HV, K, V] (h0 for padding); entering {(n, c): state after the
    first 64c tokens}; after[n] = list of states after each token of sequence n.
  """
  q = np.asarray(q, np.float64)
  k = np.asarray(k, np.float64)
  v = np.asarray(v, np.float64)
  if l2norm:
    q = q / np.sqrt(np.sum(q * q, -1, keepdims=True) + 1e-6)
    k = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + 1e-6)
  TT, H, _ = q.shape
  HV, V = v.shape[1:]
  G = HV // H
  N = len(cu) - 1
  o = np.zeros((TT, HV, V))
  final = np.array(h0, np.float64)
  entering, after = {}, [[] for _ in range(N)]
  for n in range(N):
    if not live[n]:
      continue
    hs = [np.array(h0[n, hv], np.float64) for hv in range(HV)]
    for t in range(cu[n], cu[n + 1]):
      if (t - cu[n]) % 64 == 0:
        entering[(n, (t - cu[n]) // 64)] = np.stack(hs)
      for hv in range(HV):
        h = hs[hv]
        if g is not None:
          h = np.exp(g[t, hv]) * h
        for j in range(M):
          r = t * M + j
          kr = k[r, hv // G]
          b = 1.0 if beta is None else beta[r, hv]
          h = h + np.outer(kr, b * (v[r, hv] - h.T @ kr))
        o[t, hv] = h.T @ (scale * q[t, hv // G])
        hs[hv] = h
      after[n].append(np.stack(hs))
    final[n] = np.stack(hs)
  return o, final, entering, after


# --------------------------------------------------------------------------------------------
# Inputs.

@dataclasses.dataclass(frozen=True)
class Case:
  B: int
  T: int
  H: int
  HV: int
  K: int
  V: int
  M: int
  g: bool = True
  beta: bool = True
  init: str = "none"          # "none" | "initial" | "cache"
  cu: tuple | None = None      # packed boundaries (B == 1); T may exceed cu[-1] (slack)
  slots: tuple | None = None   # state_indices for "cache" (None: slot n)
  S: int = 0                   # cache slots
  l2: bool = False             # use_qk_l2norm_in_kernel

  @property
  def id(self):
    s = f"B{self.B}-T{self.T}-H{self.H}-HV{self.HV}-K{self.K}-V{self.V}-M{self.M}"
    s += "-g" if self.g else "-nog"
    s += "-beta" if self.beta else "-nobeta"
    s += f"-{self.init}"
    if self.cu is not None:
      s += "-cu" + "_".join(map(str, self.cu))
    if self.slots is not None:
      s += "-slots" + "_".join(map(str, self.slots))
    if self.init == "cache":
      s += f"-S{self.S}"
    return s + ("-l2" if self.l2 else "")

  @property
  def N(self):
    return self.B if self.cu is None else len(self.cu) - 1


CASES = [
    Case(2, 63, 2, 4, 20, 12, 3, init="initial"),
    Case(1, 1, 1, 1, 8, 4, 1, g=False, beta=False),
    Case(1, 1, 1, 2, 8, 4, 5, init="initial"),
    Case(2, 64, 1, 2, 16, 8, 2, g=False, init="cache", slots=(3, 0), S=5),
    Case(1, 65, 2, 2, 12, 10, 5, beta=False, l2=True),
    Case(2, 130, 1, 2, 16, 8, 2, init="cache", slots=(-1, 2), S=3),
    Case(1, 150, 1, 2, 16, 8, 3, init="cache", cu=(0, 5, 5, 70, 134, 140),
         slots=(3, 1, -1, 0, 9), S=6),
    Case(1, 130, 2, 4, 12, 6, 2, init="initial", cu=(0, 64, 64, 127, 128)),
    Case(1, 66, 1, 1, 8, 8, 1, g=False, beta=False, cu=(0, 1, 66)),
    Case(1, 70, 1, 2, 10, 6, 5, init="cache", cu=(0, 30, 65), S=3, l2=True),
    Case(1, 200, 2, 2, 16, 8, 3, beta=False, init="initial", cu=(0, 0, 3, 192, 195)),
]


def _inputs(case):
  rng = np.random.default_rng(zlib.crc32(case.id.encode()))
  B, T, H, HV, K, V, M, N = case.B, case.T, case.H, case.HV, case.K, case.V, case.M, case.N
  x = {
      "q": rng.standard_normal((B, T, H, K)),
      "k": keys(rng, (B, T * M, H, K), case.l2),
      "v": rng.standard_normal((B, T * M, HV, V)),
      "g": decays(rng, (B, T, HV)) if case.g else None,
      "beta": rng.uniform(0.0, 2.0, (B, T * M, HV)) if case.beta else None,
  }
  live = [True] * N
  h0 = np.zeros((N, HV, K, V))
  if case.init == "initial":
    x["initial_state"] = 0.5 * rng.standard_normal((N, HV, K, V))
    h0 = x["initial_state"]
  elif case.init == "cache":
    cache = 0.5 * rng.standard_normal((case.S, HV, K, V))
    slots = list(range(N)) if case.slots is None else list(case.slots)
    live = [0 <= s < case.S for s in slots]
    used = {s for s in slots if 0 <= s < case.S}
    for s in range(case.S):
      if s not in used:  # poison: slots nobody addresses must come back bit-identical
        cache[s] = np.nan
    for n, s in enumerate(slots):
      if live[n]:
        h0[n] = cache[s]
    x["state"] = cache
    if case.slots is not None:
      x["state_indices"] = np.asarray(case.slots, np.int32)
  if case.cu is not None:
    x["cu_seqlens"] = np.asarray(case.cu, np.int32)
  return {n: (None if a is None else jnp.asarray(a)) for n, a in x.items()}, h0, live


def _prefill(fn, case, x, **kw):
  arrays = {n: a for n, a in x.items() if a is not None}
  static = dict(num_householder=case.M, output_final_state=case.init != "cache",
                use_qk_l2norm_in_kernel=case.l2, return_chunk_states=True, **kw)
  return _jit(fn, **static)(**arrays)


@functools.lru_cache(maxsize=None)
def _run(case):
  x, h0, live = _inputs(case)
  scan = _prefill(R.chunk_gated_delta_product, case, x)
  chunked = _prefill(R.chunk_gated_delta_product_chunked, case, x)
  return x, h0, live, scan, chunked


def _packed_cu(case):
  return list(case.cu) if case.cu is not None else [b * case.T for b in range(case.B + 1)]


def _check_cache(name, cache_in, ref, out, live_slots):
  """Addressed slots close to `ref`; every other slot bit-identical to its input (NaN poison)."""
  cache_in, out, ref = np.asarray(cache_in), np.asarray(out), np.asarray(ref)
  for s in range(cache_in.shape[0]):
    if s in live_slots:
      _close(f"{name}[slot {s}]", ref[s], out[s])
    else:
      assert bits_equal(cache_in[s], out[s]), f"{name}: untouched slot {s} changed"


def _zero_rows(case, live):
  """Token rows (flattened [B*T]) whose output must be exactly 0: slack and padding sequences."""
  cu = _packed_cu(case)
  z = np.ones(case.B * case.T, bool)
  for n in range(case.N):
    if live[n]:
      z[cu[n]:cu[n + 1]] = False
  return z


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_scan_matches_chunked(case):
  x, _, live, (o1, f1, c1), (o2, f2, c2) = _run(case)
  _close("o", o1, o2)
  zero = _zero_rows(case, live)
  for name, o in (("scan o", o1), ("chunked o", o2)):
    flat = np.asarray(o).reshape(case.B * case.T, -1)
    assert np.all(flat[zero] == 0), f"{name}: slack or padding rows are not exactly 0"
  if case.init == "cache":
    slots = case.slots or tuple(range(case.N))
    live_slots = {s for n, s in enumerate(slots) if live[n]}
    _check_cache("chunked cache", x["state"], f1, f2, live_slots)
  else:
    _close("final state", f1, f2)
  assert c1.shape == c2.shape and c1.dtype == c2.dtype
  _close("chunk_states", c1, c2)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_scan_matches_numpy_loop(case):
  x, h0, live, (o, fin, cs), _ = _run(case)
  B, T, M = case.B, case.T, case.M
  flat = lambda a, rows: None if a is None else np.asarray(a).reshape((rows,) + a.shape[2:])
  cu = _packed_cu(case)
  scale = case.K ** -0.5
  o_ref, f_ref, entering, _ = np_gdp(
      flat(x["q"], B * T), flat(x["k"], B * T * M), flat(x["v"], B * T * M), flat(x["g"], B * T),
      flat(x["beta"], B * T * M), M, scale, cu, h0, live, l2norm=case.l2)
  _close("o", o_ref, np.asarray(o).reshape(B * T, case.HV, case.V))
  if case.init == "cache":
    slots = case.slots or tuple(range(case.N))
    ref_cache = np.array(x["state"])
    for n, s in enumerate(slots):
      if live[n]:
        ref_cache[s] = f_ref[n]
    _check_cache("cache", x["state"], ref_cache, fin, {s for n, s in enumerate(slots) if live[n]})
  else:
    _close("final state", f_ref, fin)
  # chunk_states: dense [B, ceil(T/64)], packed [min(T, T//64 + N)] at chunk_offsets rows.
  rows = np.zeros((cs.shape[0] * (cs.shape[1] if case.cu is None else 1),) + cs.shape[-3:])
  offs = [0]
  for n in range(case.N):
    offs.append(offs[-1] + -(-(cu[n + 1] - cu[n]) // 64))
  for (n, c), st in entering.items():
    rows[offs[n] + c] = st
  if case.cu is None:
    rows = rows.reshape(cs.shape)
  else:
    assert cs.shape[0] == min(T, T // 64 + case.N)
    assert np.all(np.asarray(cs)[offs[-1]:] == 0), "chunk_states rows past chunk_offsets[N]"
    assert np.array_equal(np.asarray(R.chunk_offsets(x["cu_seqlens"])), offs)
  _close("chunk_states", rows, cs)


@pytest.mark.parametrize("fn", [R.chunk_gated_delta_product, R.chunk_gated_delta_product_chunked],
                         ids=["scan", "chunked"])
def test_chunk_states_dtype(fn):
  """Snapshot dtype: explicit, else the cache's, else initial_state's, else k's; o and the
  snapshots' values do not depend on it (the state is rounded only when stored)."""
  case = Case(1, 130, 1, 2, 8, 4, 2, init="cache", cu=(0, 65, 130), slots=(1, 0), S=2)
  x, _, _ = _inputs(case)
  args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
  run = jax.jit(functools.partial(fn, num_householder=2, cu_seqlens=x["cu_seqlens"]),
                static_argnames=("return_chunk_states", "chunk_states_dtype"))
  cache32 = x["state"].astype(jnp.float32)
  o, c, cs = run(*args, state=cache32, state_indices=x["state_indices"],
                 return_chunk_states=True)
  assert c.dtype == jnp.float32 and cs.dtype == jnp.float32 and o.dtype == jnp.float64
  o64, c64, cs64 = run(*args, state=cache32, state_indices=x["state_indices"],
                       return_chunk_states=True, chunk_states_dtype=jnp.float64)
  assert cs64.dtype == jnp.float64
  assert bits_equal(cs, cs64.astype(jnp.float32)), "float32 snapshots are not the rounded ones"
  o_no, c_no = run(*args, state=cache32, state_indices=x["state_indices"])
  assert bits_equal(o, o64) and bits_equal(o, o_no), "o depends on the snapshot dtype"
  assert bits_equal(c, c64) and bits_equal(c, c_no)
  # Dtype rules only: trace, do not compile.
  init32 = x["state"][::-1].astype(jnp.float32)
  shapes = jax.eval_shape(functools.partial(fn, num_householder=2, return_chunk_states=True),
                          *args, initial_state=init32, cu_seqlens=x["cu_seqlens"])
  assert shapes[2].dtype == jnp.float32
  shapes = jax.eval_shape(functools.partial(fn, num_householder=2, return_chunk_states=True),
                          *args, cu_seqlens=x["cu_seqlens"])
  assert shapes[2].dtype == x["k"].dtype


def test_gradients_of_scan_and_chunked_agree():
  """The oracle of the kernels' backward is jax.grad of the scan reference; jax.grad of the
  chunked form (a WY solve instead of a token loop) must give the same value for every input,
  with a final-state cotangent, to float64 precision: packed, an empty sequence, a sequence
  across a chunk boundary, in-kernel norms, M = 3."""
  case = Case(1, 80, 1, 2, 8, 4, 3, init="initial", cu=(0, 5, 5, 75), l2=True)
  x, _, _ = _inputs(case)
  rng = np.random.default_rng(14)
  extra = {n: x[n] for n in ("cu_seqlens",) if x.get(n) is not None}
  diff = {n: a for n, a in x.items() if a is not None and n not in extra}
  do = jnp.asarray(rng.standard_normal(x["q"].shape[:2] + (case.HV, case.V)))
  dht = jnp.asarray(rng.standard_normal((case.N, case.HV, case.K, case.V)))

  def loss(fn):
    def f(d):
      o, ht = fn(**d, **extra, num_householder=case.M, output_final_state=True,
                 use_qk_l2norm_in_kernel=case.l2)
      return jnp.sum(o * do) + jnp.sum(ht * dht)
    return jax.jit(jax.grad(f))

  g_scan = loss(R.chunk_gated_delta_product)(diff)
  g_chunked = loss(R.chunk_gated_delta_product_chunked)(diff)
  assert set(g_scan) == {"q", "k", "v", "g", "beta", "initial_state"}
  for n in g_scan:
    assert_close(f"d{n}", g_scan[n], g_chunked[n], 1e-9)


# --------------------------------------------------------------------------------------------
# Results known by hand.

def _orthonormal(rng, n, K):
  qm, _ = np.linalg.qr(rng.standard_normal((K, K)))
  return qm[:n]


@pytest.mark.parametrize("M", [1, 2])
def test_orthonormal_keys_closed_form(M):
  """g = 0, beta = 1, orthonormal keys: h^T k = 0 for every new key, so h = sum_r k_r v_r^T."""
  rng = np.random.default_rng(7)
  T, K, V = 4, 8, 5
  k = _orthonormal(rng, T * M, K)                          # [T*M, K]
  v = rng.standard_normal((T * M, V))
  q = rng.standard_normal((T, K))
  scale = 0.7
  h = np.cumsum(k[:, :, None] * v[:, None, :], axis=0)     # state after each row
  o_ref = np.einsum("tkv,tk->tv", h[M - 1::M], scale * q)
  args = (jnp.asarray(q[None, :, None]), jnp.asarray(k[None, :, None]),
          jnp.asarray(v[None, :, None]))
  for fn in (R.chunk_gated_delta_product, R.chunk_gated_delta_product_chunked):
    o, fin = _jit(fn, num_householder=M, scale=scale, output_final_state=True)(*args)
    _close(f"{fn.__module__} o", o_ref, np.asarray(o)[0, :, 0])
    _close(f"{fn.__module__} final", h[-1], np.asarray(fin)[0, 0])


def test_single_token_by_hand():
  """One token, M = 1: h = a h0 + b k (v - a h0^T k)^T, o = h^T (scale q), scale = K ** -0.5."""
  rng = np.random.default_rng(8)
  K, V = 6, 3
  h0 = rng.standard_normal((K, V))
  q, k, v = rng.standard_normal(K), keys(rng, (K,), False), rng.standard_normal(V)
  gam, b = -0.3, 1.4
  h = np.exp(gam) * h0
  h = h + b * np.outer(k, v - h.T @ k)
  o_ref = h.T @ (K ** -0.5 * q)
  j = lambda a: jnp.asarray(np.asarray(a)[None, None, None])
  args = (j(q), j(k), j(v), j(gam), j(b))
  outs = [
      _jit(R.fused_recurrent_gated_delta_rule, output_final_state=True)(
          *args, initial_state=j(h0)[0]),
      _jit(R.chunk_gated_delta_product, num_householder=1, output_final_state=True)(
          *args, initial_state=j(h0)[0]),
      _jit(R.chunk_gated_delta_product_chunked, num_householder=1, output_final_state=True)(
          *args, initial_state=j(h0)[0]),
  ]
  for o, fin in outs:
    _close("o", o_ref, np.asarray(o)[0, 0, 0])
    _close("final", h, np.asarray(fin)[0, 0])


def test_fused_recurrent_matches_numpy_loop_elementwise_beta():
  """Element-wise beta [B, T, HV, V], GVA, packed with slack, cache slots, snapshots."""
  rng = np.random.default_rng(9)
  T, H, HV, K, V, S = 40, 1, 2, 8, 6, 4
  cu = [0, 7, 7, 30, 38]
  slots = np.asarray([2, 0, -1, 3], np.int32)
  q = rng.standard_normal((1, T, H, K))
  k = keys(rng, (1, T, H, K), False)
  v = rng.standard_normal((1, T, HV, V))
  g = decays(rng, (1, T, HV))
  beta = rng.uniform(0, 2, (1, T, HV, V))
  cache = rng.standard_normal((S, HV, K, V))
  cache[1] = np.nan
  inter = np.full((S, 30, HV, K, V), np.nan)
  o, fin, inter_out = jax.jit(R.fused_recurrent_gated_delta_rule)(
      *map(jnp.asarray, (q, k, v, g, beta)), cu_seqlens=jnp.asarray(cu, jnp.int32),
      state=jnp.asarray(cache), state_indices=jnp.asarray(slots),
      intermediate_states=jnp.asarray(inter))
  # Element-wise beta: the loop below is np_gdp's with beta per column.
  live = [0 <= s < S for s in slots]
  o_ref = np.zeros((T, HV, V))
  cache_ref, inter_ref = cache.copy(), inter.copy()
  for n in range(4):
    if not live[n]:
      continue
    h = cache[slots[n]].copy()
    for i, t in enumerate(range(cu[n], cu[n + 1])):
      for hv in range(HV):
        kk = k[0, t, hv // 2]
        hh = np.exp(g[0, t, hv]) * h[hv]
        hh = hh + np.outer(kk, beta[0, t, hv] * (v[0, t, hv] - hh.T @ kk))
        o_ref[t, hv] = hh.T @ (K ** -0.5 * q[0, t, hv // 2])
        h[hv] = hh
      inter_ref[slots[n], i] = h
    cache_ref[slots[n]] = h
  _close("o", o_ref, np.asarray(o)[0])
  assert np.all(np.asarray(o)[0, cu[2]:cu[3]] == 0) and np.all(np.asarray(o)[0, cu[4]:] == 0)
  _check_cache("cache", cache, cache_ref, fin, {2, 0, 3})
  for s in range(S):
    written = {2: 7, 0: 0, 3: 8}.get(s, 0)   # tokens of the sequence on slot s
    if written:
      _close(f"snapshots[{s}]", inter_ref[s, :written], np.asarray(inter_out)[s, :written])
    assert bits_equal(inter[s, written:], np.asarray(inter_out)[s, written:]), \
        f"snapshots of slot {s} past its length changed"


def test_m1_prefill_equals_fused_recurrent():
  """M = 1 is the plain gated delta rule: prefill (both forms) = fused recurrent, same stream."""
  case = Case(1, 100, 2, 4, 12, 8, 1, init="cache", cu=(0, 3, 3, 90), slots=(4, -1, 1), S=5)
  x, _, _ = _inputs(case)
  kw = {n: x[n] for n in ("cu_seqlens", "state", "state_indices")}
  o_ref, c_ref = _jit(R.fused_recurrent_gated_delta_rule)(x["q"], x["k"], x["v"], x["g"],
                                                          x["beta"], **kw)
  for fn in (R.chunk_gated_delta_product, R.chunk_gated_delta_product_chunked):
    o, c = _jit(fn, num_householder=1)(
        x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
    _close(f"{fn.__module__} o", o_ref, o)
    _check_cache(f"{fn.__module__} cache", x["state"], c_ref, c, {4, 1})


# --------------------------------------------------------------------------------------------
# Folding, decode, snapshots, rollback.

def _fold(q, g, M):
  """Query on the last copy, decay on the first: the GDN stream equal to a GDP stream."""
  B, T, H, K = q.shape
  qf = jnp.zeros((B, T, M, H, K), q.dtype).at[:, :, M - 1].set(q).reshape(B, T * M, H, K)
  gf = None
  if g is not None:
    gf = jnp.zeros((B, T, M) + g.shape[2:], g.dtype).at[:, :, 0].set(g)
    gf = gf.reshape((B, T * M) + g.shape[2:])
  return qf, gf


@pytest.mark.parametrize("M", [2, 3])
def test_prefill_equals_fused_recurrent_on_folded_stream(M):
  case = Case(1, 140, 1, 2, 12, 8, M, init="initial", cu=(0, 70, 71, 137))
  x, _, _ = _inputs(case)
  qf, gf = _fold(x["q"], x["g"], M)
  o_ref, f_ref = _jit(R.fused_recurrent_gated_delta_rule, output_final_state=True,
                      use_qk_l2norm_in_kernel=True)(
      qf, x["k"], x["v"], gf, x["beta"], initial_state=x["initial_state"],
      cu_seqlens=M * x["cu_seqlens"])
  for fn in (R.chunk_gated_delta_product, R.chunk_gated_delta_product_chunked):
    o, f = _jit(fn, num_householder=M, output_final_state=True, use_qk_l2norm_in_kernel=True)(
        x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
        cu_seqlens=x["cu_seqlens"])
    _close(f"{fn.__module__} o", o_ref[:, M - 1::M], o)
    _close(f"{fn.__module__} final", f_ref, f)


def _decode_setup(rng, N=3, D=3, M=2, H=1, HV=2, K=8, V=6, S=5, L=9):
  slots = np.asarray([4, -1, 1], np.int32)[:N]
  cache = rng.standard_normal((S, HV, K, V))
  for s in range(S):
    if s not in slots:
      cache[s] = np.nan
  T = L + D
  x = {
      "q": rng.standard_normal((N, T, H, K)),
      "k": keys(rng, (N, T * M, H, K), False),
      "v": rng.standard_normal((N, T * M, HV, V)),
      "g": decays(rng, (N, T, HV)),
      "beta": rng.uniform(0, 2, (N, T * M, HV)),
  }
  return {n: jnp.asarray(a) for n, a in x.items()}, jnp.asarray(cache), jnp.asarray(slots)


def test_decode_equals_prefill_continuation_and_fold():
  rng = np.random.default_rng(10)
  M, D, L = 2, 3, 9
  x, cache, slots = _decode_setup(rng, M=M, D=D, L=L)
  S = cache.shape[0]
  pre = lambda t0, t1: [x["q"][:, t0:t1], x["k"][:, t0 * M:t1 * M], x["v"][:, t0 * M:t1 * M],
                        x["g"][:, t0:t1], x["beta"][:, t0 * M:t1 * M]]
  prefill = _jit(R.chunk_gated_delta_product, num_householder=M)
  o_full, cache_full = prefill(*pre(0, L + D), state=cache, state_indices=slots)
  _, cache_l = prefill(*pre(0, L), state=cache, state_indices=slots)
  inter = jnp.full((S, D) + cache.shape[1:], jnp.nan)
  o, cache_d, inter_d = _jit(R.gated_delta_product_decode, num_householder=M)(
      *pre(L, L + D), state=cache_l, state_indices=slots, intermediate_states=inter)
  live = np.asarray([0 <= s < S for s in slots])
  _close("decode o", np.asarray(o_full)[live, L:], np.asarray(o)[live])
  assert np.all(np.asarray(o)[~live] == 0), "padding request output is not exactly 0"
  _check_cache("decode cache", cache, cache_full, cache_d, {4, 1})
  _check_cache("decode snapshots (last)", inter[:, D - 1], cache_full, inter_d[:, D - 1], {4, 1})
  # The fold: GDN fused recurrent over D*M steps, snapshots every M steps.
  q, k, v, g, beta = pre(L, L + D)
  qf, gf = _fold(q, g, M)
  o_f, cache_f, inter_f = _jit(R.fused_recurrent_gated_delta_rule, steps_per_token=M)(
      qf, k, v, gf, beta, state=cache_l, state_indices=slots, intermediate_states=inter)
  _close("folded o", o, o_f[:, M - 1::M])
  _check_cache("folded cache", cache, cache_d, cache_f, {4, 1})
  for d in range(D):
    _check_cache(f"folded snapshots {d}", inter[:, d], inter_d[:, d], inter_f[:, d], {4, 1})


def test_snapshots_equal_sequential_decodes_and_rollback():
  rng = np.random.default_rng(11)
  M, D = 3, 4
  x, cache, slots = _decode_setup(rng, M=M, D=D, L=0)
  S = cache.shape[0]
  step = lambda d: [x["q"][:, d:d + 1], x["k"][:, d * M:(d + 1) * M],
                    x["v"][:, d * M:(d + 1) * M], x["g"][:, d:d + 1],
                    x["beta"][:, d * M:(d + 1) * M]]
  decode = _jit(R.gated_delta_product_decode, num_householder=M)
  inter = jnp.full((S, D) + cache.shape[1:], jnp.nan)
  o_all, cache_all, inter_all = decode(x["q"], x["k"], x["v"], x["g"], x["beta"], state=cache,
                                       state_indices=slots, intermediate_states=inter)
  seq_caches, c = [], cache
  for d in range(D):
    o_d, c = decode(*step(d), state=c, state_indices=slots)
    _close(f"o of token {d}", o_d[:, 0], o_all[:, d])
    seq_caches.append(c)
  for d in range(D):
    _check_cache(f"snapshot {d}", inter[:, d], seq_caches[d], inter_all[:, d], {4, 1})
  accept = jax.jit(R.accept_draft_tokens)
  for n in range(1, D + 1):
    acc = np.asarray([n, 1 + n % D, n], np.int32)   # slot 4 takes n, the -1 request anything
    rolled = accept(cache_all, inter_all, slots, jnp.asarray(acc))
    ref = np.array(cache_all)
    ref[4] = seq_caches[n - 1][4]
    ref[1] = seq_caches[n - 1][1]
    for s in range(S):
      assert bits_equal(ref[s], np.asarray(rolled)[s]), f"n={n}: slot {s} wrong after rollback"


# --------------------------------------------------------------------------------------------
# Descriptors and jit behaviour.

def _enumerate(lens):
  return [(i, c) for i, L in enumerate(lens) for c in range(-(-L // 64))]


def test_chunk_descriptors_match_enumeration():
  """Random batches of N = 6 sequences in T = 400 tokens (about a third empty, slack after
  cu[N]), on the expanded stream M * cu for M in 1..3, at the bound min(T, T//64 + N)."""
  rng = np.random.default_rng(12)
  N, T = 6, 400
  descs = jax.jit(R.chunk_descriptors, static_argnums=1)
  offsets = jax.jit(R.chunk_offsets)
  batches = [[0] * N, [64, 0, 0, 0, 0, 1], [0, 128, 63, 65, 0, 1], [400, 0, 0, 0, 0, 0]]
  for _ in range(30):
    lens = rng.integers(0, 130, N) * (rng.random(N) > 0.3)
    batches.append(list(np.minimum(lens, T - np.cumsum(lens) + lens).clip(0)))
  for lens in batches:
    assert sum(lens) <= T
    for M in (1, 2, 3):
      cu = M * np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
      want = _enumerate([M * L for L in lens])
      offs = np.concatenate([[0], np.cumsum([-(-M * L // 64) for L in lens])])
      assert np.array_equal(np.asarray(offsets(jnp.asarray(cu))), offs), (lens, M)
      max_chunks = min(T * M, T * M // 64 + N)
      got = np.asarray(descs(jnp.asarray(cu), max_chunks))
      assert len(want) <= max_chunks, (lens, M)
      assert [tuple(r) for r in got[:len(want)]] == want, (lens, M)
      assert np.all(got[len(want):] == [-1, 0]), (lens, M)


def test_jit_compiles_once_without_host_transfers():
  rng = np.random.default_rng(13)
  T, H, HV, K, V, M, S = 100, 1, 2, 8, 4, 2, 4
  traces = []

  def prefill(cu, slots, q, k, v, g, beta, cache):
    traces.append(1)
    o, c, cs = R.chunk_gated_delta_product(q, k, v, g, beta, num_householder=M, cu_seqlens=cu,
                                           state=cache, state_indices=slots,
                                           return_chunk_states=True)
    o2, c2, cs2 = R.chunk_gated_delta_product_chunked(
        q, k, v, g, beta, num_householder=M, cu_seqlens=cu, state=cache, state_indices=slots,
        return_chunk_states=True)
    inter = jnp.zeros((S, T) + cache.shape[1:], cache.dtype)
    o3, c3, i3 = R.fused_recurrent_gated_delta_rule(
        q, k[:, :T], v[:, :T], g, beta[:, :T], cu_seqlens=cu, state=cache, state_indices=slots,
        intermediate_states=inter)
    return o, c, cs, o2, c2, cs2, o3, c3, i3

  f = jax.jit(prefill)
  arrays = [jnp.asarray(a) for a in (
      rng.standard_normal((1, T, H, K)), keys(rng, (1, T * M, H, K), False),
      rng.standard_normal((1, T * M, HV, V)), decays(rng, (1, T, HV)),
      rng.uniform(0, 2, (1, T * M, HV)), rng.standard_normal((S, HV, K, V)))]
  cus = [(0, 10, 10, 90), (0, 64, 65, 100), (0, 0, 0, 0)]
  slot_sets = [(0, 1, 2), (3, -1, 1), (2, 0, 1)]
  cus_dev = [jnp.asarray(c, jnp.int32) for c in cus]
  slots_dev = [jnp.asarray(s, jnp.int32) for s in slot_sets]
  outs = []
  with jax.transfer_guard_device_to_host("disallow"):
    for cu, sl in zip(cus_dev, slots_dev):
      outs.append(jax.block_until_ready(f(cu, sl, *arrays)))
  assert len(traces) == 1, f"traced {len(traces)} times for one shape"
  for cu, (o, c, cs, o2, c2, cs2, o3, _, _) in zip(cus, outs):
    # The all-empty batch has all-zero results; _close then bounds the absolute error.
    _close("o", o, o2)
    assert np.all(np.asarray(o)[0, cu[-1]:] == 0), "slack tokens are not exactly 0"
    _close("cache", c, c2)
    _close("chunk_states", cs, cs2)
    assert np.all(np.isfinite(np.asarray(o3))) and np.all(np.asarray(o3)[0, cu[-1]:] == 0)
