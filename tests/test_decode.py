"""The decode kernel (fused recurrent step, GDP decode, draft acceptance) against the references.

One shape table and one body, run through the Triton interpreter on a CPU and through jax_triton
on a GPU (`-m gpu` adds realistic shapes). The oracle is the float64 `lax.scan` reference on the
same (rounded) inputs. Caches are poisoned: slots nobody addresses hold NaN and must come back
bit-identical, padding outputs must be exactly zero.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gdp_jax
from conftest import KERNEL_BACKEND
from gdp_jax import _configs, reference
from helpers import RTOL, assert_close, bits_equal, state_arguments

f64 = jnp.float64
# The float64 decode references, compiled once per shape: called eagerly, a lax.scan compiled
# anew on every call (the rollback checks call it dozens of times at a few shapes; those
# compiles were most of their time).
_ref_decode = jax.jit(reference.gated_delta_product_decode,
                      static_argnames=("num_householder", "scale", "use_qk_l2norm_in_kernel"))
_ref_recurrent = jax.jit(reference.fused_recurrent_gated_delta_rule,
                         static_argnames=("scale", "output_final_state", "use_qk_l2norm_in_kernel",
                                          "steps_per_token"))
_ref_commit = jax.jit(reference.commit_replay,
                      static_argnames=("steps_per_token", "use_qk_l2norm_in_kernel"))


@dataclasses.dataclass(frozen=True)
class Case:
  B: int = 2
  T: int = 5
  H: int = 1
  HV: int = 2
  K: int = 20
  V: int = 12
  dtype: str = "float32"
  use_g: bool = True
  beta: str = "head"            # "head", "elem" or "none"
  l2norm: bool = False
  init: bool = False            # dense initial state
  final: bool = True            # output_final_state (dense)
  cache: str = ""               # "", "slots" (S > N, permuted, with -1 and out of range), "plain"
  varlen: tuple = ()            # sequence lengths, packed (B == 1); slack tokens follow
  spt: int = 0                  # steps_per_token with intermediate_states (0: none)
  accepted: bool = False        # num_accepted: start from the snapshots (needs cache and spt)

  @property
  def id(self):
    s = f"B{self.B}-T{self.T}-H{self.H}-HV{self.HV}-K{self.K}-V{self.V}-{self.dtype}"
    s += "" if self.use_g else "-nog"
    s += f"-beta_{self.beta}" + ("-l2" if self.l2norm else "") + ("-h0" if self.init else "")
    s += f"-cache_{self.cache}" if self.cache else ""
    s += f"-varlen{'_'.join(map(str, self.varlen))}" if self.varlen else ""
    s += f"-spt{self.spt}" if self.spt else ""
    s += "-accepted" if self.accepted else ""
    return s


CASES = [
    Case(),
    Case(H=2, HV=4, K=16, V=8, init=True),
    Case(K=100, V=16, beta="elem", l2norm=True),
    Case(use_g=False, beta="none", init=True),
    Case(dtype="bfloat16", l2norm=True),
    Case(B=3, cache="slots", T=4, spt=2),
    Case(B=3, cache="plain", T=3, spt=1, beta="elem"),
    Case(B=1, T=12, varlen=(3, 0, 6, 1), cache="slots"),
    Case(B=1, T=9, varlen=(4, 2), init=True, l2norm=True),
    Case(B=2, T=1, H=2, HV=2, K=32, V=32),
    Case(B=4, T=6, cache="slots", spt=2, accepted=True, beta="elem"),
    Case(B=1, T=10, varlen=(4, 0, 2, 4), cache="slots", spt=2, accepted=True, l2norm=True),
]
GPU_CASES = [
    Case(B=8, T=3, H=4, HV=8, K=128, V=128, cache="slots", spt=1, l2norm=True),
    Case(B=8, T=2, H=2, HV=4, K=256, V=512, dtype="bfloat16", cache="slots", spt=2, l2norm=True),
    Case(B=1, T=300, H=4, HV=8, K=128, V=128, varlen=(100, 0, 150, 1), init=True),
    Case(B=16, T=8, H=4, HV=8, K=128, V=128, cache="slots", spt=2, accepted=True, l2norm=True),
]


def make_inputs(c: Case, seed):
  rng = np.random.default_rng(seed)
  dt = jnp.dtype(c.dtype)
  N = len(c.varlen) if c.varlen else c.B
  a = dict(
      q=rng.standard_normal((c.B, c.T, c.H, c.K)),
      k=rng.standard_normal((c.B, c.T, c.H, c.K)),
      v=rng.standard_normal((c.B, c.T, c.HV, c.V)),
  )
  if not c.l2norm:  # unnormalised keys let the state blow up and prove nothing
    a["k"] /= np.linalg.norm(a["k"], axis=-1, keepdims=True)
  a = {n: jnp.asarray(x, dt) for n, x in a.items()}
  a["g"] = jnp.asarray(-rng.exponential(0.5, (c.B, c.T, c.HV)), jnp.float32) if c.use_g else None
  if c.beta == "head":
    a["beta"] = jnp.asarray(rng.uniform(0, 2, (c.B, c.T, c.HV)), dt)
  elif c.beta == "elem":
    a["beta"] = jnp.asarray(rng.uniform(0, 2, (c.B, c.T, c.HV, c.V)), dt)
  else:
    a["beta"] = None
  kw = dict(use_qk_l2norm_in_kernel=c.l2norm, **state_arguments(rng, c, N))
  if c.cache and c.spt:
    S = kw["state"].shape[0]
    inter = np.full((S, c.T // c.spt, c.HV, c.K, c.V), np.nan, np.float32)
    if c.accepted:
      # The previous step's snapshots are read: finite where a live slot lives (the cache's
      # NaN marks the unaddressed slots), and every count 0..T // spt occurs.
      inter[:] = rng.standard_normal(inter.shape) + np.asarray(kw["state"])[:, None]
      kw["num_accepted"] = jnp.asarray(np.arange(N) % (c.T // c.spt + 1), jnp.int32)
    kw["intermediate_states"] = jnp.asarray(inter)
    kw["steps_per_token"] = c.spt
  return a, kw


def _upcast(tree):
  up = lambda x: x.astype(f64) if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) else x
  return jax.tree.map(up, tree)


def check_fused_recurrent(c: Case, backend, seed=0):
  a, kw = make_inputs(c, seed)
  out = gdp_jax.fused_recurrent_gated_delta_rule(**a, **kw, backend=backend)
  ref = _ref_recurrent(**_upcast(a), **_upcast(kw))
  tol = RTOL[c.dtype]
  o, o_ref = out[0], ref[0]
  assert o.dtype == a["v"].dtype and o.shape == (c.B, c.T, c.HV, c.V)
  pad = np.zeros(c.B if not c.varlen else len(c.varlen), bool)
  if "state_indices" in kw:
    si = np.asarray(kw["state_indices"])
    pad = (si < 0) | (si >= kw["state"].shape[0])
  # Padding sequences and slack tokens: exactly zero.
  o_np = np.asarray(o, np.float32)
  if c.varlen:
    cu = np.asarray(kw["cu_seqlens"])
    for n in np.nonzero(pad)[0]:
      assert np.all(o_np[0, cu[n]:cu[n + 1]] == 0)
    assert np.all(o_np[0, cu[-1]:] == 0)
  else:
    assert np.all(o_np[pad] == 0)
  assert_close("o", o_ref, o, tol)
  state_tol = 1e-5 if c.dtype == "float32" else 1e-2
  if "state" in kw:
    new, new_ref = np.asarray(out[1]), np.asarray(ref[1])
    live = np.zeros(new.shape[0], bool)
    si = np.asarray(kw.get("state_indices", np.arange(len(pad))))
    live[si[~pad]] = True
    assert bits_equal(new[~live], np.asarray(kw["state"])[~live]), "unaddressed slots changed"
    if "num_accepted" in kw:  # the snapshots are the state of record: the cache is not written
      assert bits_equal(new, np.asarray(kw["state"]))
    else:
      assert_close("state", new_ref[live], new[live], state_tol)
    if "intermediate_states" in kw:
      inter, inter_ref = np.asarray(out[2]), np.asarray(ref[2])
      assert bits_equal(inter[~live], np.asarray(kw["intermediate_states"])[~live])
      assert_close("intermediate_states", inter_ref[live], inter[live], state_tol)
  elif c.final:
    assert out[1].dtype == jnp.float32
    assert_close("final_state", ref[1], out[1], state_tol)
  else:
    assert out[1] is None


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_fused_recurrent(c):
  check_fused_recurrent(c, KERNEL_BACKEND)


@pytest.mark.gpu
@pytest.mark.parametrize("c", GPU_CASES, ids=lambda c: c.id)
def test_fused_recurrent_gpu(c):
  check_fused_recurrent(c, "triton", seed=1)


def gdp_inputs(N, D, M, H, HV, K, V, S, dtype, seed):
  rng = np.random.default_rng(seed)
  k = rng.standard_normal((N, D * M, H, K))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  dt = jnp.dtype(dtype)
  slots = rng.permutation(S)[:N].astype(np.int32)
  slots[N // 2] = -1
  cache = rng.standard_normal((S, HV, K, V)).astype(np.float32)
  cache[np.setdiff1d(np.arange(S), slots)] = np.nan
  return dict(
      q=jnp.asarray(rng.standard_normal((N, D, H, K)), dt), k=jnp.asarray(k, dt),
      v=jnp.asarray(rng.standard_normal((N, D * M, HV, V)), dt),
      g=jnp.asarray(-rng.exponential(0.5, (N, D, HV)), jnp.float32),
      beta=jnp.asarray(rng.uniform(0, 2, (N, D * M, HV)), dt),
      state=jnp.asarray(cache), state_indices=jnp.asarray(slots),
      intermediate_states=jnp.asarray(np.full((S, D, HV, K, V), np.nan, np.float32)))


def _live_slots(slots, S):
  """[S] bool: the cache slots some request of the batch addresses (padding -1 excluded)."""
  live = np.zeros(S, bool)
  live[slots[slots >= 0]] = True
  return live


def _two_steps(N, D, M, H, HV, K, V, S, dtype, seed):
  """Inputs of two verify steps: step one's arguments (cache and slots included) and step
  two's token inputs, drawn from the next seed."""
  a = gdp_inputs(N, D, M, H, HV, K, V, S, dtype, seed=seed)
  b = {n: x for n, x in gdp_inputs(N, D, M, H, HV, K, V, S, dtype, seed=seed + 1).items()
       if n in STEP_INPUTS}
  return a, b


def check_gdp_decode(N, D, M, H, HV, K, V, S, dtype, backend):
  a = gdp_inputs(N, D, M, H, HV, K, V, S, dtype, seed=D * 10 + M)
  o, state, inter = gdp_jax.gated_delta_product_decode(**a, num_householder=M, backend=backend)
  o_ref, state_ref, inter_ref = _ref_decode(**_upcast(a), num_householder=M)
  slots = np.asarray(a["state_indices"])
  live = _live_slots(slots, S)
  tol = RTOL[dtype]
  assert o.shape == (N, D, HV, V)
  assert np.all(np.asarray(o, np.float32)[slots < 0] == 0)
  assert_close("o", o_ref, o, tol)
  assert bits_equal(np.asarray(state)[~live], np.asarray(a["state"])[~live])
  assert_close("state", np.asarray(state_ref)[live], np.asarray(state)[live], 1e-5 if dtype == "float32" else 1e-2)
  assert_close("intermediate", np.asarray(inter_ref)[live], np.asarray(inter)[live], 1e-5 if dtype == "float32" else 1e-2)
  # The last snapshot is the state the step wrote.
  assert bits_equal(np.asarray(inter)[live, D - 1], np.asarray(state)[live])
  # Roll back to every accepted prefix length; padding slots and unaddressed slots stay put.
  for n in range(1, D + 1):
    num = jnp.full((N,), n, jnp.int32)
    rolled = gdp_jax.accept_draft_tokens(state, inter, a["state_indices"], num)
    rolled_ref = reference.accept_draft_tokens(state, inter, a["state_indices"], num)
    assert bits_equal(rolled, rolled_ref)
    assert bits_equal(np.asarray(rolled)[live], np.asarray(inter)[live, n - 1])
    assert bits_equal(np.asarray(rolled)[~live], np.asarray(a["state"])[~live])


def _case_id(c):
  return "N{}-D{}-M{}-H{}-HV{}-K{}-V{}-S{}-{}".format(*c)


GDP_CASES = [(3, 1, 2, 1, 2, 16, 8, 5, "float32"), (4, 2, 3, 2, 4, 16, 8, 6, "float32"),
             (3, 4, 1, 1, 1, 8, 8, 3, "float32"), (2, 3, 2, 1, 2, 16, 16, 4, "bfloat16")]


@pytest.mark.parametrize("case", GDP_CASES, ids=_case_id)
def test_gdp_decode_and_accept(case):
  check_gdp_decode(*case, backend=KERNEL_BACKEND)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(64, 4, 2, 16, 32, 128, 128, 256, "float32"),
                                  (16, 2, 2, 6, 6, 256, 512, 20, "bfloat16")],
                         ids=_case_id)
def test_gdp_decode_and_accept_gpu(case):
  check_gdp_decode(*case, backend="triton")


def _start_states(a, D, M, counts):
  """[S, HV, K, V] float64: each live slot's state after its request's first counts[i] draft
  tokens of the step `a` (counts[i] = 0: the cache as it was), from the reference run on those
  tokens only; other slots keep the cache's contents (NaN where unaddressed)."""
  up = _upcast(a)
  start = np.array(up["state"])
  slots = np.asarray(a["state_indices"])
  for n in range(1, D + 1):
    rows = lambda x, per: None if x is None else x[:, :n * per]
    _, after = _ref_decode(
        rows(up["q"], 1), rows(up["k"], M), rows(up["v"], M), rows(up["g"], 1),
        rows(up["beta"], M), num_householder=M, state=up["state"],
        state_indices=a["state_indices"])
    pick = (np.asarray(counts) == n) & (slots >= 0)
    start[slots[pick]] = np.asarray(after)[slots[pick]]
  return jnp.asarray(start)


def check_speculative(N, D, M, H, HV, K, V, S, dtype, backend, seed=0):
  """Two verify steps; the second takes the first's accepted counts (num_accepted) and starts
  from its snapshots. At every count 0..D (each request a different one, every request every
  count over the rounds) it equals the reference run on only the accepted tokens of step one,
  then all of step two; the cache is not written, padding and unaddressed slots keep their
  bits. Runs under jax.jit with the cache and the snapshots donated."""
  a, b = _two_steps(N, D, M, H, HV, K, V, S, dtype, seed)
  _, state1, inter1 = gdp_jax.gated_delta_product_decode(**a, num_householder=M, backend=backend)
  step = jax.jit(lambda x, c, i, n: gdp_jax.gated_delta_product_decode(
      **x, num_householder=M, state=c, state_indices=a["state_indices"], intermediate_states=i,
      num_accepted=n, backend=backend), donate_argnums=(1, 2))
  slots = np.asarray(a["state_indices"])
  live = _live_slots(slots, S)
  tol = RTOL[dtype]
  state_tol = 1e-5 if dtype == "float32" else 1e-2
  for shift in range(D + 1):
    counts = (np.arange(N) + shift) % (D + 1)
    counts[slots < 0] = 7 * D  # a padding request's count is ignored, whatever it is
    o2, state2, inter2 = step(b, jnp.copy(state1), jnp.copy(inter1), jnp.asarray(counts, jnp.int32))
    # Count 0 starts from the cache, which step one left after all D tokens.
    start = _start_states(a, D, M, np.where(counts == 0, D, counts))
    o_ref, _, inter_ref = _ref_decode(
        **_upcast(b), num_householder=M, state=start, state_indices=a["state_indices"],
        intermediate_states=jnp.full((S, D, HV, K, V), np.nan, f64))
    assert np.all(np.asarray(o2, np.float32)[slots < 0] == 0)
    assert_close(f"o (shift {shift})", o_ref, o2, tol)
    assert_close(f"snapshots (shift {shift})", np.asarray(inter_ref)[live],
                 np.asarray(inter2)[live], state_tol)
    assert bits_equal(state2, state1), "the cache was written"
    assert bits_equal(np.asarray(inter2)[~live], np.asarray(inter1)[~live])


SPEC_CASES = [(3, 3, 2, 1, 2, 8, 8, 5, "float32"), (4, 2, 1, 2, 4, 16, 8, 6, "bfloat16")]
# The GPU cases of the snapshot step and of the replay step: the benchmark's N=64 HV=32 float32
# and K=256 V=512 bf16 with M=3.
SPEC_GPU_CASES = [(64, 4, 2, 16, 32, 128, 128, 80, "float32"),
                  (16, 3, 3, 6, 6, 256, 512, 20, "bfloat16")]


@pytest.mark.parametrize("case", SPEC_CASES, ids=_case_id)
def test_speculative_step_rolls_back_to_every_count(case):
  check_speculative(*case, backend=KERNEL_BACKEND)


@pytest.mark.gpu
@pytest.mark.parametrize("case", SPEC_GPU_CASES, ids=_case_id)
def test_speculative_step_rolls_back_to_every_count_gpu(case):
  check_speculative(*case, backend="triton", seed=3)


def test_speculative_step_equals_accept_then_decode_bitwise():
  """num_accepted gives the very bits of accept_draft_tokens followed by the plain step."""
  N, D, M, H, HV, K, V, S = 4, 3, 2, 1, 2, 8, 8, 6
  a = gdp_inputs(N, D, M, H, HV, K, V, S, "bfloat16", seed=13)
  b = {n: x for n, x in gdp_inputs(N, D, M, H, HV, K, V, S, "bfloat16", seed=14).items()
       if n in ("q", "k", "v", "g", "beta")}
  kw = dict(num_householder=M, state_indices=a["state_indices"], use_qk_l2norm_in_kernel=True,
            backend=KERNEL_BACKEND)
  _, state1, inter1 = gdp_jax.gated_delta_product_decode(
      **{n: a[n] for n in b}, state=a["state"], intermediate_states=a["intermediate_states"], **kw)
  counts = jnp.asarray([3, 1, 2, 2], jnp.int32)
  rolled = gdp_jax.accept_draft_tokens(state1, inter1, a["state_indices"], counts)
  o_old, _, inter_old = gdp_jax.gated_delta_product_decode(
      **b, state=rolled, intermediate_states=inter1, **kw)
  o_new, state_new, inter_new = gdp_jax.gated_delta_product_decode(
      **b, state=state1, intermediate_states=inter1, num_accepted=counts, **kw)
  assert bits_equal(o_old, o_new)
  assert bits_equal(inter_old, inter_new)
  assert bits_equal(state_new, state1)


STEP_INPUTS = ("q", "k", "v", "g", "beta")
RING_INPUTS = ("k", "v", "g", "beta")


def empty_ring(S, D, M, H, HV, K, V, dtype):
  """A ring fresh from prefill: NaN everywhere, so a replay that read it would show."""
  nan = lambda shape, dt: jnp.full(shape, jnp.nan, dt)
  return (nan((S, D * M, H, K), dtype), nan((S, D * M, HV, V), dtype),
          nan((S, D, HV), jnp.float32), nan((S, D * M, HV), dtype))


def check_replay_ring(ring, old, x, slots, live):
  """The new ring holds the step's inputs at the live slots, bit for bit; other slots keep the
  old ring's bits."""
  for name, r, r_old in zip(RING_INPUTS, ring, old):
    assert r.dtype == r_old.dtype and r.shape == r_old.shape, name
    step_rows = np.asarray(x[name].astype(r.dtype))[slots >= 0]
    assert bits_equal(np.asarray(r)[slots[slots >= 0]], step_rows), f"ring {name}: not the step's"
    assert bits_equal(np.asarray(r)[~live], np.asarray(r_old)[~live]), f"ring {name}: slot changed"


def check_replay(N, D, M, H, HV, K, V, S, dtype, backend, seed=0):
  """Checkpoint and replay. Step one starts after prefill (counts 0, a NaN ring). Step two
  replays each request's first counts[i] tokens of step one (every count 0..D over the rounds)
  and equals the reference run on only those tokens of step one, then all of step two; its
  checkpoints are the states after the accepted tokens. commit_replay then folds a second set
  of counts of step two into the cache and equals the reference on those tokens. The replay
  step stores commit_replay's checkpoint bits, and its outputs are those of commit_replay
  followed by a plain step: bit for bit in the interpreter for the token loop, to rounding
  compiled, and within the dtype's tolerance in block form (bfloat16 inputs at BV >= 16, where
  the new tokens' outputs come from a bfloat16 copy of the checkpoint, docs/api.md). Padding
  outputs are 0, padding and unaddressed slots keep their bits (cache and ring). Under jax.jit
  with the cache and the ring donated."""
  a, b = _two_steps(N, D, M, H, HV, K, V, S, dtype, seed)
  xa = {n: a[n] for n in STEP_INPUTS}
  cache = a["state"]
  slots = np.asarray(a["state_indices"])
  live = _live_slots(slots, S)
  kw = dict(num_householder=M, state_indices=a["state_indices"], backend=backend)
  step = jax.jit(lambda x, c, r, n: gdp_jax.gated_delta_product_decode(
      **x, state=c, num_accepted=n, replay_ring=r, **kw), donate_argnums=(1, 2))
  commit = jax.jit(lambda c, r, n: gdp_jax.commit_replay(
      c, r, a["state_indices"], n, steps_per_token=M, backend=backend), donate_argnums=(0,))
  plain = jax.jit(lambda x, c: gdp_jax.gated_delta_product_decode(**x, state=c, **kw))
  tol = RTOL[dtype]
  state_tol = 1e-5 if dtype == "float32" else 1e-2
  block_form = _configs.replay_block_rows(D * M, K, _configs.decode_config(K, V),
                                          (xa["q"].dtype, xa["k"].dtype, xa["v"].dtype)) > 0
  counts_of = lambda shift: np.where(slots < 0, 7 * D, (np.arange(N) + shift) % (D + 1))

  ring0 = empty_ring(S, D, M, H, HV, K, V, a["k"].dtype)
  o1, state1, ring1 = step(xa, jnp.copy(cache), tuple(map(jnp.copy, ring0)),
                           jnp.asarray(counts_of(0) * 0, jnp.int32))
  o_ref = _ref_decode(**_upcast(xa), num_householder=M, state=_upcast(cache),
                      state_indices=slots)[0]
  assert_close("o (first step)", o_ref, o1, tol)
  assert bits_equal(state1, cache), "count 0 wrote the cache"
  check_replay_ring(ring1, ring0, xa, slots, live)
  for shift in range(D + 1):
    counts = jnp.asarray(counts_of(shift), jnp.int32)
    o2, state2, ring2 = step(b, jnp.copy(state1), tuple(map(jnp.copy, ring1)), counts)
    start = _start_states(a, D, M, np.asarray(counts))
    o_ref = _ref_decode(**_upcast(b), num_householder=M, state=start, state_indices=slots)[0]
    assert np.all(np.asarray(o2, np.float32)[slots < 0] == 0)
    assert_close(f"o (shift {shift})", o_ref, o2, tol)
    assert_close(f"checkpoints (shift {shift})", np.asarray(start)[live],
                 np.asarray(state2)[live], state_tol)
    assert bits_equal(np.asarray(state2)[~live], np.asarray(cache)[~live])
    check_replay_ring(ring2, ring1, b, slots, live)
    # The step is the commit followed by a plain step: the same checkpoint bits, and outputs
    # to rounding (another compiled program: on the H200 at K=256 V=512 bf16 M=3 some bf16
    # outputs came out one rounding apart; bitwise in the interpreter and at K=V=128 float32).
    committed = commit(jnp.copy(state1), ring1, counts)
    o_plain, _ = plain(b, committed)
    assert bits_equal(committed, state2)
    assert_close(f"o against commit + plain step (shift {shift})", o_plain, o2, tol)
    if backend == "interpret" and not block_form:
      assert bits_equal(o_plain, o2)
    # Ending speculation: fold the accepted tokens of step two into the cache.
    counts2 = counts_of(shift + 1)
    state3 = commit(jnp.copy(state2), ring2, jnp.asarray(counts2, jnp.int32))
    want = _start_states(dict(b, state=start, state_indices=a["state_indices"]), D, M, counts2)
    assert_close(f"committed state (shift {shift})", np.asarray(want)[live],
                 np.asarray(state3)[live], state_tol)
    assert bits_equal(np.asarray(state3)[~live], np.asarray(cache)[~live])


REPLAY_CASES = SPEC_CASES + [(3, 2, 3, 1, 1, 8, 16, 4, "float32"),
                (2, 4, 2, 1, 1, 100, 80, 3, "float32"),  # K, V not powers of two, 5 V blocks
                # The new tokens in block form (bfloat16, BV 16): 8 steps (W full), then 6 with
                # K = 20 (a masked dot) and 2 V blocks, then 3 with 4 value heads on 2 key heads.
                (3, 4, 2, 1, 2, 16, 16, 5, "bfloat16"), (2, 3, 2, 1, 1, 20, 32, 3, "bfloat16"),
                (3, 3, 1, 2, 4, 16, 16, 4, "bfloat16"),
                (2, 5, 2, 1, 2, 16, 16, 4, "bfloat16")]  # 10 steps: a block of 8, one of 2
# The GPU replay cases: the snapshot step's, and the benchmark's shape in bfloat16 (block form:
# one block at D = 4, two at D = 8).
REPLAY_GPU_CASES = SPEC_GPU_CASES + [(64, 4, 2, 16, 32, 128, 128, 80, "bfloat16"),
                                     (64, 8, 2, 16, 32, 128, 128, 80, "bfloat16")]


@pytest.mark.parametrize("case", REPLAY_CASES, ids=_case_id)
def test_replay_step_equals_accepted_tokens_then_new(case):
  check_replay(*case, backend=KERNEL_BACKEND)


@pytest.mark.gpu
@pytest.mark.parametrize("case", REPLAY_GPU_CASES, ids=_case_id)
def test_replay_step_equals_accepted_tokens_then_new_gpu(case):
  check_replay(*case, backend="triton", seed=3)


@pytest.mark.parametrize("spt,beta,l2norm", [(1, "elem", True), (2, "head", False)])
def test_fused_recurrent_replay(spt, beta, l2norm):
  check_fused_recurrent_replay(spt, beta, l2norm, "float32", V=8)


@pytest.mark.parametrize("spt,beta,l2norm,T", [(1, "elem", True, 4), (2, "head", False, 4),
                                               (1, "elem", True, 12)])
def test_fused_recurrent_replay_block_form(spt, beta, l2norm, T):
  """bfloat16 inputs at BV 16: the new steps' outputs in block form (12 steps: two blocks)."""
  assert _configs.replay_block_rows(T, 16, _configs.decode_config(16, 16), ["bfloat16"] * 3)
  check_fused_recurrent_replay(spt, beta, l2norm, "bfloat16", V=16, T=T)


def check_fused_recurrent_replay(spt, beta, l2norm, dtype, V, T=4):
  """The fused recurrent entry point with a ring (g per recurrence step, element-wise beta)
  against its reference twin, then commit_replay of the new ring; slot -1 is padding. Ring
  and inputs in `dtype` (g float32); the checkpoints are float32 sums of the same rounded
  rows, so they meet float32's tolerance whatever the dtype."""
  B, H, HV, K, S = 3, 1, 2, 16, 5
  rng = np.random.default_rng(spt)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  bshape = lambda lead: lead + ((HV, V) if beta == "elem" else (HV,))
  x = dict(q=rng.standard_normal((B, T, H, K)), k=unit(rng.standard_normal((B, T, H, K))),
           v=rng.standard_normal((B, T, HV, V)), g=-rng.exponential(0.5, (B, T, HV)),
           beta=rng.uniform(0, 2, bshape((B, T))))
  x = {n: jnp.asarray(y, jnp.float32 if n == "g" else dtype) for n, y in x.items()}
  ring = (unit(rng.standard_normal((S, T, H, K))), rng.standard_normal((S, T, HV, V)),
          -rng.exponential(0.5, (S, T, HV)), rng.uniform(0, 2, bshape((S, T))))
  ring = tuple(jnp.asarray(r, jnp.float32 if i == 2 else dtype) for i, r in enumerate(ring))
  slots = jnp.asarray([4, -1, 1], jnp.int32)
  live = np.isin(np.arange(S), [4, 1])
  cache = jnp.asarray(np.where(live[:, None, None, None],
                               rng.standard_normal((S, HV, K, V)), np.nan), jnp.float32)
  counts = jnp.asarray([T // spt, 5, 1], jnp.int32)
  kw = dict(state_indices=slots, num_accepted=counts, steps_per_token=spt,
            use_qk_l2norm_in_kernel=l2norm)
  o, state, new_ring = gdp_jax.fused_recurrent_gated_delta_rule(
      **x, state=cache, replay_ring=ring, **kw, backend=KERNEL_BACKEND)
  o_ref, state_ref, ring_ref = _ref_recurrent(
      **_upcast(x), state=_upcast(cache), replay_ring=_upcast(ring), **kw)
  assert np.all(np.asarray(o, np.float32)[1] == 0)
  assert_close("o", o_ref, o, RTOL[dtype])
  assert_close("checkpoints", np.asarray(state_ref)[live], np.asarray(state)[live], 1e-5)
  assert bits_equal(np.asarray(state)[~live], np.asarray(cache)[~live])
  check_replay_ring(new_ring, ring, x, np.asarray(slots), live)
  committed = gdp_jax.commit_replay(state, new_ring, slots, counts, steps_per_token=spt,
                                    use_qk_l2norm_in_kernel=l2norm, backend=KERNEL_BACKEND)
  want = _ref_commit(_upcast(state), _upcast(new_ring), slots, counts,
                     steps_per_token=spt, use_qk_l2norm_in_kernel=l2norm)
  assert_close("committed", np.asarray(want)[live], np.asarray(committed)[live], 1e-5)
  assert bits_equal(np.asarray(committed)[~live], np.asarray(cache)[~live])


def check_replay_donation(N, D, M, H, HV, K, V, S, backend, donated):
  """Under jax.jit with the cache and the ring donated, the step updates them in their own
  buffers (`donated`: the names whose buffers must be kept)."""
  a = gdp_inputs(N, D, M, H, HV, K, V, S, "float32", seed=21)
  cache = jnp.nan_to_num(a["state"])
  ring = tuple(jnp.nan_to_num(r) for r in empty_ring(S, D, M, H, HV, K, V, jnp.float32))
  step = jax.jit(lambda x, c, r, n: gdp_jax.gated_delta_product_decode(
      **x, num_householder=M, state=c, state_indices=a["state_indices"], num_accepted=n,
      replay_ring=r, backend=backend), donate_argnums=(1, 2))
  x = {n: a[n] for n in STEP_INPUTS}
  ptrs = dict(state=cache.unsafe_buffer_pointer(),
              **{f"ring {n}": r.unsafe_buffer_pointer() for n, r in zip(RING_INPUTS, ring)})
  _, new_cache, new_ring = step(x, cache, ring, jnp.ones((N,), jnp.int32))
  got = dict(state=new_cache.unsafe_buffer_pointer(),
             **{f"ring {n}": r.unsafe_buffer_pointer() for n, r in zip(RING_INPUTS, new_ring)})
  for name in donated:
    assert got[name] == ptrs[name], f"the donated {name} was copied"


def test_replay_donated_buffers_kept():
  """On the CPU: XLA's scatter updates the donated ring in place whatever the backend, and the
  reference twin's cache too. (The interpreter returns its outputs through a host callback,
  which copies: the kernel's own in-place cache update is checked on the GPU.)"""
  rings = [f"ring {n}" for n in RING_INPUTS]
  check_replay_donation(3, 2, 2, 1, 2, 8, 8, 5, "reference", ["state"] + rings)
  check_replay_donation(3, 2, 2, 1, 2, 8, 8, 5, KERNEL_BACKEND, rings)


@pytest.mark.gpu
def test_replay_donated_buffers_kept_gpu():
  check_replay_donation(64, 4, 2, 16, 32, 128, 128, 80, "triton",
                        ["state"] + [f"ring {n}" for n in RING_INPUTS])


def test_replay_checks():
  N, D, M, H, HV, K, V, S = 3, 2, 2, 1, 2, 8, 8, 4
  a = gdp_inputs(N, D, M, H, HV, K, V, S, "float32", seed=0)
  a.pop("intermediate_states")
  ring = empty_ring(S, D, M, H, HV, K, V, jnp.float32)
  slots = np.asarray(a["state_indices"])  # request N // 2 is padding
  zeros = jnp.zeros((N,), jnp.int32)
  call = lambda **kw: gdp_jax.gated_delta_product_decode(
      **{**a, "num_accepted": zeros, "replay_ring": ring, **kw}, num_householder=M,
      backend="reference")
  call()
  bad_k = (ring[0][:, :D],) + ring[1:]
  with pytest.raises(ValueError, match=r"replay_ring\[0\] \(k\): expected \[S, D\*M, H, K\] = "
                     r"\[4, 4, 1, 8\]"):
    call(replay_ring=bad_k)
  with pytest.raises(ValueError,
                     match=r"replay_ring\[2\] \(g\): expected \[S, D, HV\] = \[4, 2, 2\]"):
    call(replay_ring=ring[:2] + (ring[2][:, :1],) + ring[3:])
  with pytest.raises(ValueError, match=r"replay_ring\[3\] \(beta\): expected None exactly"):
    call(beta=None)
  with pytest.raises(ValueError, match="replay_ring: expected a tuple"):
    call(replay_ring=ring[:3])
  with pytest.raises(ValueError, match="replay_ring: needs num_accepted"):
    call(num_accepted=None)
  with pytest.raises(ValueError, match="intermediate_states: not with replay_ring"):
    call(intermediate_states=jnp.zeros((S, D, HV, K, V)))
  for bad in (D + 1, -1):
    counts = np.zeros(N, np.int32)
    counts[0] = bad
    with pytest.raises(ValueError, match=r"num_accepted: expected 0\.\.D = 0\.\.2"):
      call(num_accepted=jnp.asarray(counts))
  counts = np.zeros(N, np.int32)
  counts[slots < 0] = 99  # a padding request may carry any count
  call(num_accepted=jnp.asarray(counts))
  with pytest.raises(ValueError, match="cu_seqlens: not with replay_ring"):
    gdp_jax.fused_recurrent_gated_delta_rule(
        a["q"].reshape(1, N * D, H, K), a["k"][:, ::M].reshape(1, N * D, H, K),
        a["v"][:, ::M].reshape(1, N * D, HV, V), state=a["state"], num_accepted=zeros,
        replay_ring=ring, cu_seqlens=jnp.arange(N + 1, dtype=jnp.int32) * D,
        backend="reference")
  commit = lambda ring=ring, counts=zeros, spt=M: gdp_jax.commit_replay(
      a["state"], ring, a["state_indices"], counts, steps_per_token=spt, backend="reference")
  commit()
  with pytest.raises(ValueError, match=r"replay_ring\[1\] \(v\): expected \[S, R, HV, V\]"):
    commit(ring=(ring[0], ring[1][:, :, :1]) + ring[2:])
  with pytest.raises(ValueError, match="must be a multiple of steps_per_token = 3"):
    commit(spt=3)
  with pytest.raises(ValueError, match=r"num_accepted: expected 0\.\.D = 0\.\.2"):
    commit(counts=jnp.asarray([3, 0, 0], jnp.int32))


def test_num_accepted_checks():
  N, D, M, H, HV, K, V, S = 3, 2, 2, 1, 2, 8, 8, 4
  a = gdp_inputs(N, D, M, H, HV, K, V, S, "float32", seed=0)
  slots = np.asarray(a["state_indices"])  # request N // 2 is padding
  call = lambda **kw: gdp_jax.gated_delta_product_decode(
      **{**a, **kw}, num_householder=M, backend="reference")
  for bad in (D + 1, -1):
    counts = np.zeros(N, np.int32)
    counts[0] = bad
    with pytest.raises(ValueError, match=r"num_accepted: expected 0\.\.D = 0\.\.2"):
      call(num_accepted=jnp.asarray(counts))
  counts = np.zeros(N, np.int32)
  counts[slots < 0] = 99  # a padding request may carry any count
  call(num_accepted=jnp.asarray(counts))
  with pytest.raises(ValueError, match="num_accepted: expected"):
    call(num_accepted=jnp.zeros((N + 1,), jnp.int32))
  with pytest.raises(ValueError, match="num_accepted: expected an index dtype"):
    call(num_accepted=jnp.zeros((N,), jnp.float32))
  with pytest.raises(ValueError, match="num_accepted: needs"):
    call(num_accepted=jnp.zeros((N,), jnp.int32), intermediate_states=None)
  with pytest.raises(ValueError, match="num_accepted: needs"):
    gdp_jax.fused_recurrent_gated_delta_rule(
        a["q"], a["k"][:, :D], a["v"][:, :D], num_accepted=jnp.zeros((N,), jnp.int32),
        output_final_state=True, backend="reference")


def test_config_argument():
  """A config overrides the tile (the sweep's way in); anything else is refused."""
  a = gdp_inputs(2, 1, 2, 1, 2, 8, 24, 3, "float32", seed=4)
  kw = dict(num_householder=2, backend=KERNEL_BACKEND)
  o, _, _ = gdp_jax.gated_delta_product_decode(
      **a, **kw, config=_configs.DecodeConfig(BV=8, num_warps=1))
  o_ref = _ref_decode(**_upcast(a), num_householder=2)[0]
  assert_close("o", o_ref, o, RTOL["float32"])
  with pytest.raises(ValueError, match="config: expected"):
    gdp_jax.gated_delta_product_decode(**a, **kw, config=dict(BV=8, num_warps=1))


def test_traced_num_accepted_out_of_range_is_clamped():
  """Under jit nothing checks the counts: below 0 reads the cache slot (as 0), above D the last
  snapshot (as D), in the kernel and the reference alike; nothing outside the buffers."""
  N, D, M, H, HV, K, V, S = 2, 2, 1, 1, 1, 4, 4, 3
  a = gdp_inputs(N, D, M, H, HV, K, V, S, "float32", seed=2)
  a["state_indices"] = jnp.asarray([0, 2], jnp.int32)
  a["state"] = jnp.nan_to_num(a["state"])
  a["intermediate_states"] = jnp.asarray(
      np.random.default_rng(0).standard_normal((S, D, HV, K, V)), jnp.float32)
  for backend in (KERNEL_BACKEND, "reference"):
    run = jax.jit(lambda n: gdp_jax.gated_delta_product_decode(
        **a, num_householder=M, num_accepted=n, backend=backend))
    out = run(jnp.asarray([-5, D + 9], jnp.int32))
    want = run(jnp.asarray([0, D], jnp.int32))
    for x, y in zip(out, want):
      assert bits_equal(x, y) if backend != "reference" else np.allclose(x, y)


def test_accept_skips_invalid_counts_and_slots():
  S, D, HV, K, V = 4, 3, 1, 2, 2
  rng = np.random.default_rng(0)
  state = jnp.asarray(rng.standard_normal((S, HV, K, V)), jnp.float32)
  inter = jnp.asarray(rng.standard_normal((S, D, HV, K, V)), jnp.float32)
  slots = jnp.asarray([0, -1, 2, 9], jnp.int32)
  num = jnp.asarray([0, 1, 4, 2], jnp.int32)  # 0 and 4 are outside 1..D
  # Concrete counts outside 1..D are refused (tests/test_checks.py); traced ones cannot be
  # checked, and a live slot with such a count keeps its post-decode state.
  assert bits_equal(jax.jit(gdp_jax.accept_draft_tokens)(state, inter, slots, num), state)
  assert bits_equal(jax.jit(reference.accept_draft_tokens)(state, inter, slots, num), state)


def test_decode_matches_prefill_continuation():
  """Prefill L tokens into a cache, then decode one: equals prefill of L+1 tokens (references)."""
  rng = np.random.default_rng(3)
  L, M, H, HV, K, V = 7, 2, 1, 2, 8, 4
  k = rng.standard_normal((1, (L + 1) * M, H, K))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  q = jnp.asarray(rng.standard_normal((1, L + 1, H, K)))
  k = jnp.asarray(k)
  v = jnp.asarray(rng.standard_normal((1, (L + 1) * M, HV, V)))
  g = jnp.asarray(-rng.exponential(0.5, (1, L + 1, HV)))
  beta = jnp.asarray(rng.uniform(0, 2, (1, (L + 1) * M, HV)))
  o_all, _ = reference.chunk_gated_delta_product(q, k, v, g, beta, num_householder=M)
  cache = jnp.zeros((2, HV, K, V), f64)
  slots = jnp.asarray([1], jnp.int32)
  _, cache = gdp_jax.chunk_gated_delta_product(
      q[:, :L], k[:, :L * M], v[:, :L * M], g[:, :L], beta[:, :L * M], num_householder=M,
      state=cache, state_indices=slots, backend="reference")
  o_step, _ = gdp_jax.gated_delta_product_decode(
      q[:, L:], k[:, L * M:], v[:, L * M:], g[:, L:], beta[:, L * M:], num_householder=M,
      state=cache.astype(jnp.float32), state_indices=slots, backend=KERNEL_BACKEND)
  assert_close("o", o_all[:, L:], o_step, 1e-5)


def check_decode_loop(N, M, H, HV, K, V, S, steps, backend):
  """A lax.scan of decode steps with the cache carried equals the same steps one by one."""
  rng = np.random.default_rng(5)
  ks = rng.standard_normal((steps, N, M, H, K))
  ks /= np.linalg.norm(ks, axis=-1, keepdims=True)
  xs = dict(q=jnp.asarray(rng.standard_normal((steps, N, 1, H, K)), jnp.float32),
            k=jnp.asarray(ks, jnp.float32),
            v=jnp.asarray(rng.standard_normal((steps, N, M, HV, V)), jnp.float32),
            g=jnp.asarray(-rng.exponential(0.5, (steps, N, 1, HV)), jnp.float32),
            beta=jnp.asarray(rng.uniform(0, 1, (steps, N, M, HV)), jnp.float32))
  slots = jnp.asarray(rng.permutation(S)[:N], jnp.int32)
  cache0 = jnp.asarray(rng.standard_normal((S, HV, K, V)), jnp.float32)

  def step(cache, x):
    o, cache = gdp_jax.gated_delta_product_decode(
        x["q"], x["k"], x["v"], x["g"], x["beta"], num_householder=M, state=cache,
        state_indices=slots, backend=backend)
    return cache, o

  cache_loop, o_loop = jax.jit(lambda c: jax.lax.scan(step, c, xs), donate_argnums=0)(cache0.copy())
  cache = cache0
  for i in range(steps):
    cache, o = step(cache, jax.tree.map(lambda x: x[i], xs))
    assert bits_equal(o_loop[i], o)
  assert bits_equal(cache_loop, cache)


def test_jitted_decode_loop_equals_steps():
  check_decode_loop(N=2, M=2, H=1, HV=2, K=8, V=8, S=3, steps=4, backend=KERNEL_BACKEND)


@pytest.mark.gpu
def test_jitted_decode_loop_equals_steps_gpu():
  check_decode_loop(N=32, M=2, H=8, HV=16, K=128, V=128, S=64, steps=64, backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_donated_step_keeps_buffer_and_is_deterministic(dtype):
  N, D, M, H, HV, K, V, S = 64, 1, 2, 8, 16, 128, 128, 512
  a = gdp_inputs(N, D, M, H, HV, K, V, S, "float32", seed=11)
  a.pop("intermediate_states")
  cache = a.pop("state").astype(dtype)
  cache = jnp.where(jnp.isnan(cache), 0, cache)
  step = jax.jit(lambda a, c: gdp_jax.gated_delta_product_decode(
      **a, num_householder=M, state=c, backend="triton"), donate_argnums=1)
  ptr = cache.unsafe_buffer_pointer()
  c1 = cache.copy()
  o1, new1 = step(a, cache)
  assert new1.unsafe_buffer_pointer() == ptr, "the donated cache was copied"
  o2, new2 = step(a, c1)
  assert bits_equal(o1, o2) and bits_equal(new1, new2), "two identical steps differ"


def check_prefill_then_decode(lengths, steps, M, H, HV, K, V, dtype, backend):
  """Prefill packed prompts into cache slots, decode `steps` tokens each: the outputs of both
  phases equal the reference prefill of every whole sequence (prompt + decoded tokens)."""
  rng = np.random.default_rng(7)
  N, dt = len(lengths), jnp.dtype(dtype)
  total = [L + steps for L in lengths]
  seqs = []
  for L in total:
    k = rng.standard_normal((1, L * M, H, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    seqs.append(dict(q=jnp.asarray(rng.standard_normal((1, L, H, K)), dt), k=jnp.asarray(k, dt),
                     v=jnp.asarray(rng.standard_normal((1, L * M, HV, V)), dt),
                     g=jnp.asarray(-rng.exponential(0.3, (1, L, HV)), jnp.float32),
                     beta=jnp.asarray(rng.uniform(0, 1, (1, L * M, HV)), dt)))
  rows = lambda name, x, a, b: x[:, a * (1 if name in ("q", "g") else M):b * (1 if name in ("q", "g") else M)]
  prompt = {n: jnp.concatenate([rows(n, s[n], 0, L) for s, L in zip(seqs, lengths)], 1) for n in seqs[0]}
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
  slots = jnp.asarray(rng.permutation(N + 2)[:N], jnp.int32)
  cache = jnp.zeros((N + 2, HV, K, V), jnp.float32)
  o_pre, cache = jax.jit(lambda x, c: gdp_jax.chunk_gated_delta_product(
      **x, num_householder=M, cu_seqlens=cu, state=c, state_indices=slots, backend=backend))(prompt, cache)
  step = jax.jit(lambda x, c: gdp_jax.gated_delta_product_decode(
      **x, num_householder=M, state=c, state_indices=slots, backend=backend), donate_argnums=1)
  o_dec = []
  for s in range(steps):
    x = {n: jnp.concatenate([rows(n, q[n], L + s, L + s + 1) for q, L in zip(seqs, lengths)], 0)
         for n in seqs[0]}
    o, cache = step(x, cache)
    o_dec.append(o)
  tol = RTOL[dtype]
  for i, (s, L) in enumerate(zip(seqs, lengths)):
    o_ref, final_ref = reference.chunk_gated_delta_product(**_upcast(s), num_householder=M,
                                                           output_final_state=True)
    assert_close(f"prefill o of sequence {i}", o_ref[:, :L], o_pre[:, cu[i]:cu[i + 1]], tol)
    assert_close(f"decoded o of sequence {i}", o_ref[:, L:],
                 jnp.stack([o[i] for o in o_dec], 1).reshape(1, steps, HV, V), tol)
    assert_close(f"final state of sequence {i}", final_ref[0], cache[slots[i]],
                 1e-5 if dtype == "float32" else 1e-2)


def test_prefill_then_decode():
  check_prefill_then_decode((9, 4), steps=3, M=2, H=1, HV=2, K=16, V=16, dtype="float32",
                            backend=KERNEL_BACKEND)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_then_decode_gpu(dtype):
  check_prefill_then_decode((1000, 77, 64), steps=16, M=2, H=4, HV=8, K=128, V=128, dtype=dtype,
                            backend="triton")


@pytest.mark.slow
@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(N=st.integers(1, 4), D=st.integers(1, 4), M=st.integers(1, 3), H=st.sampled_from([1, 2]),
       G=st.sampled_from([1, 2, 3]), K=st.integers(4, 40), V=st.integers(2, 24),
       spare=st.integers(0, 24), dtype=st.sampled_from(["float32", "bfloat16"]))
def test_gdp_decode_random_shapes(N, D, M, H, G, K, V, spare, dtype):
  """Random shapes, caches far larger than the batch (S up to N + 24), permuted slots with -1."""
  check_gdp_decode(N, D, M, H, H * G, K, V, N + spare, dtype, backend=KERNEL_BACKEND)


@pytest.mark.gpu
def test_cache_past_int32_offsets_gpu():
  """A cache of more than 2**31 elements (S=1100, HV=32, K=128, V=512, bf16: 4.6 GB): a slot
  near the end is read and written where it lives, which needs int64 slot offsets."""
  N, D, M, H, HV, K, V, S = 2, 1, 2, 8, 32, 128, 512, 1100
  assert S * HV * K * V > 2 ** 31
  a = gdp_inputs(N, D, M, H, HV, K, V, 4, "bfloat16", seed=31)
  for n in ("state", "state_indices", "intermediate_states"):
    a.pop(n)
  slots = jnp.asarray([S - 1, 3], jnp.int32)
  cache = jax.random.normal(jax.random.key(0), (S, HV, K, V), jnp.bfloat16)
  before = cache[slots].astype(jnp.float32)
  neighbour = cache[S - 2].astype(jnp.float32)
  step = jax.jit(lambda a, c: gdp_jax.gated_delta_product_decode(
      **a, num_householder=M, state=c, state_indices=slots, backend="triton"), donate_argnums=1)
  o, cache = step(a, cache)
  o_ref, small_ref = _ref_decode(
      **_upcast(a), num_householder=M, state=before.astype(f64),
      state_indices=jnp.arange(N, dtype=jnp.int32))
  assert_close("o", o_ref, o, 1e-2)
  assert_close("state at the far slot", small_ref, cache[slots], 1e-2)
  assert bits_equal(cache[S - 2].astype(jnp.float32), neighbour)


def check_vmap_decode(N, D, M, H, HV, K, V, S, dtype, backend):
  """jax.vmap over independent caches (one per model of an ensemble): a speculative step with
  intermediate states, under jit, equals each element's own step; each element launches the
  kernel once (gdp_jax/_launch.py). Slots no request addresses come back bit-identical."""
  E = 2
  per = [gdp_inputs(N, D, M, H, HV, K, V, S, dtype, seed=40 + e) for e in range(E)]
  step = lambda a: gdp_jax.gated_delta_product_decode(**a, num_householder=M, backend=backend)
  got = jax.jit(jax.vmap(step))(jax.tree.map(lambda *x: jnp.stack(x), *per))
  for e, a in enumerate(per):
    want = step(a)
    live = _live_slots(np.asarray(a["state_indices"]), S)
    assert_close(f"o[{e}]", want[0], got[0][e], 1e-6)
    for i, name in ((1, "state"), (2, "intermediate_states")):
      assert_close(f"{name}[{e}]", np.asarray(want[i])[live], np.asarray(got[i][e])[live], 1e-6)
      assert bits_equal(np.asarray(got[i][e])[~live], np.asarray(a[name])[~live])


def test_vmap_over_caches():
  check_vmap_decode(3, 2, 2, 1, 2, 16, 8, 5, "float32", KERNEL_BACKEND)


@pytest.mark.gpu
def test_vmap_over_caches_gpu():
  check_vmap_decode(64, 4, 2, 16, 32, 128, 128, 96, "bfloat16", KERNEL_BACKEND)
