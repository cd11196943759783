"""The Flax NNX layer (gdp_jax.flax), its FLA weight converter, and the example model's serving loop.

On a CPU the layer runs on the float64 references (and, at tiny shapes, on the Triton interpreter);
the oracles are (1) the layer's own prefill path for its decode path, (2) a numpy transcription of
FLA's `GatedDeltaProduct.forward` that reads FLA's state dict directly, and (3) on a GPU, FLA's
torch layer itself. The example model's engine (packed prefill into slots, speculative decode with
rollback) must produce the tokens of a cache-free, one-token-at-a-time recomputation.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx", reason="gdp_jax.flax needs the optional dependency flax")

from conftest import KERNEL_BACKEND  # noqa: E402
from examples import tiny_lm as em  # noqa: E402
from gdp_jax import flax as gflax  # noqa: E402
from helpers import RTOL, assert_close, bits_equal  # noqa: E402

f64 = jnp.float64
HIDDEN = 16
CFG = dict(hidden_size=HIDDEN, head_dim=8, expand_v=2, num_heads=2, num_v_heads=4,
           num_householder=2)


def _abstract(**cfg):
  """A layer with shapes only: skips the random init (eager init compiles op by op, slowly)."""
  return nnx.eval_shape(lambda: gflax.GatedDeltaProduct(**cfg, rngs=nnx.Rngs(0)))


def _randomize(layer, seed):
  """Sets every parameter to N(0, s^2) noise (s set per kind), so that each one matters."""
  rng = np.random.default_rng(seed)
  new = {}
  for k, shape in gflax.fla_state_dict_shapes(layer).items():
    if k.endswith("proj.weight"):
      new[k] = rng.standard_normal(shape) / math.sqrt(shape[1])
    elif k == "A_log":
      new[k] = np.log(rng.uniform(0.5, 4.0, shape))
    else:
      new[k] = rng.standard_normal(shape) * 0.5 + (1.0 if k == "o_norm.weight" else 0.0)
  return gflax.from_fla_state_dict(layer, new)


@pytest.fixture(scope="module")
def layer():
  return _randomize(_abstract(**CFG, backend="reference", param_dtype=f64), 1)


@nnx.jit
def _prefill(layer, x, cu_seqlens=None, cache=None, slots=None):
  # Jitted: eager mode would compile every primitive of the layer for every new shape.
  return layer(x, cu_seqlens=cu_seqlens, cache=cache, slots=slots)


@nnx.jit
def _decode(layer, x, cache, slots):
  return layer.decode(x, cache, slots)


@nnx.jit
def _decode_from(layer, x, cache, slots, num_accepted):
  return layer.decode(x, cache, slots, num_accepted)


def _x(shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), f64)


def _poisoned_cache(layer, S, num_draft=None, seed=3, replay=False):
  """A cache with random contents; the caller NaNs the rows nobody may touch."""
  c = layer.init_cache(S, num_draft=num_draft, replay=replay, dtype=f64)
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype), c)


def _nan_rows(cache, rows):
  return jax.tree.map(lambda a: a.at[np.asarray(rows)].set(jnp.nan), cache)


# -------------------------------------------------------------------------------------------------
# Decode against prefill, packing, continuation, speculative rollback (reference backend, float64)


def test_decode_token_by_token_matches_prefill(layer):
  B, T = 2, 7
  x = _x((B, T, HIDDEN))
  y = _prefill(layer, x)
  cache = _nan_rows(layer.init_cache(4, dtype=f64), [1])
  slots = jnp.array([3, 0], jnp.int32)
  ys = []
  for t in range(T):
    yt, cache = _decode(layer, x[:, t:t + 1], cache, slots)
    ys.append(yt)
  assert_close("decode y", y, jnp.concatenate(ys, axis=1), RTOL["float64"])
  # The same sequences prefilled into the same slots leave the same cache.
  _, pc = _prefill(layer, x, cache=_nan_rows(layer.init_cache(4, dtype=f64), [1]), slots=slots)
  for name in ("state", "conv"):
    a, b = getattr(pc, name), getattr(cache, name)
    assert_close(name, a[np.array([3, 0])], b[np.array([3, 0])], RTOL["float64"])
    assert bits_equal(a[1], b[1]) and bool(jnp.isnan(a[1]).all()), f"{name}: slot 1 was touched"


def test_packed_prefill_keeps_sequences_apart(layer):
  lens = [5, 0, 2, 6]                       # an empty sequence, one shorter than the conv kernel
  T = sum(lens) + 3                         # 3 slack tokens
  x = _x((1, T, HIDDEN), seed=1)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  slots = jnp.array([4, 0, -1, 2], jnp.int32)
  cache0 = _nan_rows(_poisoned_cache(layer, 6), [1, 3, 5])
  y, cache = _prefill(layer, x, cu_seqlens=cu, cache=cache0, slots=slots)
  for n, L in enumerate(lens):
    s = int(slots[n])
    if L == 0 or s < 0:
      continue
    bos = int(cu[n])
    # Sequence n alone, dense, continuing from its slot: the same output and the same new cache.
    one = gflax.GDPCache(cache0.state[s:s + 1], cache0.conv[s:s + 1])
    y1, c1 = _prefill(layer, x[:, bos:bos + L], cache=one)
    assert_close(f"seq{n} y", y1[0], y[0, bos:bos + L], RTOL["float64"])
    assert_close(f"seq{n} state", c1.state[0], cache.state[s], RTOL["float64"])
    assert bits_equal(c1.conv[0], cache.conv[s]), f"seq{n}: conv context differs"
  # Padding slot -1 (sequence 2) and the slack tokens: exactly zero output.
  b2 = int(cu[2])
  assert bits_equal(y[0, b2:b2 + 2], jnp.zeros((2, HIDDEN), f64)), "padding output is not zero"
  assert bits_equal(y[0, sum(lens):], jnp.zeros((3, HIDDEN), f64)), "slack output is not zero"
  # The empty sequence keeps its slot as it was; untouched slots stay NaN bit for bit.
  assert bits_equal(cache.state[0], cache0.state[0]) and bits_equal(cache.conv[0], cache0.conv[0])
  for s in (1, 3, 5):
    assert bits_equal(cache.state[s], cache0.state[s]) and bits_equal(cache.conv[s], cache0.conv[s])


def test_chunked_prefill_continues(layer):
  x = _x((2, 9, HIDDEN), seed=2)
  slots = jnp.array([1, 0], jnp.int32)
  y_all, c_all = _prefill(layer, x, cache=layer.init_cache(2, dtype=f64), slots=slots)
  cache = layer.init_cache(2, dtype=f64)
  outs = []
  for a, b in [(0, 1), (1, 3), (3, 9)]:     # pieces shorter than the conv kernel, then the rest
    y, cache = _prefill(layer, x[:, a:b], cache=cache, slots=slots)
    outs.append(y)
  assert_close("y", y_all, jnp.concatenate(outs, axis=1), RTOL["float64"])
  assert_close("state", c_all.state, cache.state, RTOL["float64"])
  assert_close("conv", c_all.conv, cache.conv, RTOL["float64"])
  assert_close("uncached", _prefill(layer, x), y_all, RTOL["float64"])


def test_speculative_decode_and_rollback(layer):
  D = 3
  x = _x((3, 2 + D + 2, HIDDEN), seed=4)
  slots = jnp.array([2, -1, 0], jnp.int32)
  y_full = _prefill(layer, x)
  cache = _nan_rows(layer.init_cache(4, num_draft=D, dtype=f64), [1, 3])
  cache = gflax.reset_slots(cache, slots)
  _, cache = _prefill(layer, x[:, :2], cache=cache, slots=slots)
  y_spec, cache = _decode(layer, x[:, 2:2 + D], cache, slots)
  assert_close("draft y", y_full[np.array([0, 2]), 2:2 + D], y_spec[np.array([0, 2])],
               RTOL["float64"])
  assert bits_equal(y_spec[1], jnp.zeros_like(y_spec[1])), "padding request output is not zero"
  accepted = jnp.array([1, 2, D], jnp.int32)       # row 1 is padding: ignored
  rolled = gflax.accept_draft_tokens(cache, slots, accepted)
  # Continue each request from its accepted prefix; it must follow the full prefill.
  for n, s, a in [(0, 2, 1), (2, 0, D)]:
    nxt = x[n:n + 1, 2 + a:2 + a + 2]
    y_next, _ = _decode(layer, nxt, rolled._replace(state_snapshots=None, conv_snapshots=None),
                             jnp.array([s], jnp.int32))
    assert_close(f"request {n} after accepting {a}", y_full[n, 2 + a:4 + a], y_next[0],
                 RTOL["float64"])
  for s in (1, 3):
    assert bool(jnp.isnan(rolled.state[s]).all()) and bool(jnp.isnan(rolled.conv[s]).all())
  with pytest.raises(ValueError, match="snapshots for D = 3"):
    _decode(layer, x[:, :1], cache, slots)
  with pytest.raises(ValueError, match="no draft-token snapshots"):
    gflax.accept_draft_tokens(layer.init_cache(2), slots[:2], accepted[:2])
  with pytest.raises(ValueError, match="slots"):
    _prefill(layer, x, slots=slots)


def test_speculative_decode_from_accepted_snapshots(layer):
  """decode(num_accepted) starts each request from its snapshots (state and convolution inputs)
  after the tokens the last step kept: it follows the full prefill and equals
  accept_draft_tokens followed by a plain decode, while the cache's state and conv stay as the
  prefill left them."""
  D = 3
  x = _x((3, 2 + 2 * D, HIDDEN), seed=8)
  slots = jnp.array([2, -1, 0], jnp.int32)
  live = np.array([0, 2])
  y_full = _prefill(layer, x)
  cache = _nan_rows(layer.init_cache(4, num_draft=D, dtype=f64), [1, 3])
  cache = gflax.reset_slots(cache, slots)
  _, cache = _prefill(layer, x[:, :2], cache=cache, slots=slots)
  # Fresh from prefill: count 0 starts from the cache itself.
  y1, c1 = _decode_from(layer, x[:, 2:2 + D], cache, slots, jnp.zeros(3, jnp.int32))
  y1_old, c1_old = _decode(layer, x[:, 2:2 + D], cache, slots)
  assert_close("step 1 y", y1_old, y1, RTOL["float64"])
  for name in ("state", "conv"):
    assert bits_equal(getattr(c1, name), getattr(cache, name)), f"{name} was written"
  accepted = jnp.array([1, 7, 2], jnp.int32)       # row 1 is padding: its count is ignored
  nxt = jnp.stack([x[n, 2 + a:2 + a + D] for n, a in enumerate([1, 1, 2])])
  y2, c2 = _decode_from(layer, nxt, c1, slots, accepted)
  rolled = gflax.accept_draft_tokens(c1_old, slots, accepted.at[1].set(1))
  y2_old, c2_old = _decode(layer, nxt, rolled, slots)
  assert_close("step 2 y", y2_old[live], y2[live], RTOL["float64"])
  assert bits_equal(y2[1], jnp.zeros_like(y2[1])), "padding request output is not zero"
  for name in ("state_snapshots", "conv_snapshots"):
    a, b = getattr(c2_old, name), getattr(c2, name)
    assert_close(name, a[np.array([2, 0])], b[np.array([2, 0])], RTOL["float64"])
  for n, a in [(0, 1), (2, 2)]:
    assert_close(f"request {n} after keeping {a}", y_full[n, 2 + a:2 + a + D], y2[n],
                 RTOL["float64"])
  for s in (1, 3):   # nobody's slots: still NaN, bit for bit
    for buf in (c2.state, c2.conv, c2.state_snapshots, c2.conv_snapshots):
      assert bool(jnp.isnan(buf[s]).all())
  with pytest.raises(ValueError, match="num_accepted"):
    _decode_from(layer, x[:, :1], layer.init_cache(4, dtype=f64), slots, accepted)


def test_layer_under_jit_with_donated_cache(layer):
  graphdef, params = nnx.split(layer)

  def step(params, cache, x, slots):
    return nnx.merge(graphdef, params).decode(x, cache, slots)

  step = jax.jit(step, donate_argnums=(1,))
  x = _x((2, 1, HIDDEN), seed=5)
  slots = jnp.array([0, 1], jnp.int32)
  y, c = step(params, layer.init_cache(2, dtype=f64), x, slots)
  y_ref, c_ref = _decode(layer, x, layer.init_cache(2, dtype=f64), slots)
  assert_close("y", y_ref, y, RTOL["float64"])
  assert_close("state", c_ref.state, c.state, RTOL["float64"])


# -------------------------------------------------------------------------------------------------
# Checkpoint and replay (init_cache(..., replay=True))


def _packed(seqs):
  """[1, T, hidden] and cu_seqlens of sequences [L_i, hidden] packed in one row."""
  cu = jnp.asarray(np.concatenate([[0], np.cumsum([len(s) for s in seqs])]), jnp.int32)
  return jnp.concatenate(seqs)[None], cu


def test_replay_decode_rolls_back_at_every_count(layer):
  """A replay cache after a step of D tokens: the next step keeping n1 = 0..D of them, then
  commit_replay keeping n2 of that step, then a step or a prefill from the commit, all follow the
  prefill of only the kept tokens (outputs, committed state and convolution window). Nobody's slots (3; 5,
  which slot -1 would wrap to) stay bit for bit, the padding row's output is exactly zero."""
  D, P, S = 3, 2, 6
  slots = jnp.array([4, 0, -1, 2, 1], jnp.int32)
  live = np.array([0, 1, 3, 4])
  n1 = np.array([0, 1, 7, 2, 3])            # row 2 is padding: its count is ignored
  n2 = np.array([3, 2, 7, 0, 1])
  x = _x((5, P + 3 * D, HIDDEN), seed=20)
  prompt, a, b, c = x[:, :P], x[:, P:P + D], x[:, P + D:P + 2 * D], x[:, P + 2 * D:]
  # The kept sequences: before step 2's tokens, through the commit, before step 3's tokens.
  kept = [jnp.concatenate([prompt[i], a[i, :n1[i]]]) for i in live]
  committed = [jnp.concatenate([k, b[i, :n2[i]]]) for k, i in zip(kept, live)]
  seqs = ([jnp.concatenate([k, b[i]]) for k, i in zip(kept, live)] + committed
          + [jnp.concatenate([k, c[i]]) for k, i in zip(committed, live)])
  xp, cu = _packed(seqs)
  y_ref, c_ref = _prefill(layer, xp, cu_seqlens=cu, cache=layer.init_cache(3 * len(live),
                          dtype=f64), slots=jnp.arange(3 * len(live), dtype=jnp.int32))
  ends = np.asarray(cu[1:])

  def last_d(j):                             # the outputs of sequence j's last D tokens
    return y_ref[0, ends[j] - D:ends[j]]

  cache = _nan_rows(_poisoned_cache(layer, S, num_draft=D, replay=True), [3, 5])
  cache = gflax.reset_slots(cache, slots)
  _, cache = _prefill(layer, prompt, cache=cache, slots=slots)
  _, cache = _decode_from(layer, a, cache, slots, jnp.zeros(5, jnp.int32))
  y2, cache = _decode_from(layer, b, cache, slots, jnp.asarray(n1, jnp.int32))
  cache = layer.commit_replay(cache, slots, jnp.asarray(n2, jnp.int32))
  y3, cache3 = _decode_from(layer, c, cache, slots, jnp.zeros(5, jnp.int32))
  y3p, _ = _prefill(layer, c, cache=cache, slots=slots)
  for j, i in enumerate(live):
    s = int(slots[i])
    tag = f"request {i} (kept {n1[i]}, then {n2[i]})"
    assert_close(f"{tag}: step 2 y", last_d(j), y2[i], RTOL["float64"])
    assert_close(f"{tag}: committed state", c_ref.state[len(live) + j], cache.state[s],
                 RTOL["float64"])
    assert_close(f"{tag}: committed conv", c_ref.conv[len(live) + j], cache.conv[s],
                 RTOL["float64"])
    assert_close(f"{tag}: step 3 y", last_d(2 * len(live) + j), y3[i], RTOL["float64"])
    assert_close(f"{tag}: prefill y", last_d(2 * len(live) + j), y3p[i], RTOL["float64"])
  for y in (y2, y3, y3p):
    assert bits_equal(y[2], jnp.zeros_like(y[2])), "padding request output is not zero"
  for s in (3, 5):
    for buf in jax.tree.leaves(cache3):
      assert bool(jnp.isnan(buf[s]).all()), f"slot {s} was touched"


@pytest.mark.parametrize("extra", [dict(use_short_conv=False, use_forget_gate=False),
                                   dict(conv_size=2, num_householder=3, conv_bias=True)],
                         ids=["no-conv-no-gate", "window-1-M3"])
def test_replay_other_layer_configs(extra):
  """Replay without the short convolution and the forget gate (no conv ring, ring g None), and
  with a window of one input, shorter than D: the next step and the commit follow the prefill of
  the kept tokens."""
  lay = _randomize(_abstract(**dict(CFG, **extra), backend="reference", param_dtype=f64), 24)
  D, P = 2, 3
  x = _x((2, P + 2 * D, HIDDEN), seed=25)
  slots = jnp.array([1, 0], jnp.int32)
  kept = np.array([1, 2])
  cache = lay.init_cache(2, num_draft=D, replay=True, dtype=f64)
  assert (cache.conv_ring is None) == ("use_short_conv" in extra)
  assert (cache.ring[2] is None) == ("use_forget_gate" in extra)
  _, cache = _prefill(lay, x[:, :P], cache=cache, slots=slots)
  _, cache = _decode_from(lay, x[:, P:P + D], cache, slots, jnp.zeros(2, jnp.int32))
  nxt = jnp.stack([x[i, P + n:P + n + D] for i, n in enumerate(kept)])
  y, cache = _decode_from(lay, nxt, cache, slots, jnp.asarray(kept, jnp.int32))
  cache = lay.commit_replay(cache, slots, jnp.array([2, 1], jnp.int32))
  y_full = _prefill(lay, x)
  for i, n in enumerate(kept):
    assert_close(f"request {i} y", y_full[i, P + n:P + n + D], y[i], RTOL["float64"])
  # Request 0 kept 1 + 2 tokens, request 1 2 + 1: both end at token P + 3 of x.
  _, ref = _prefill(lay, x[:, :P + 3], cache=lay.init_cache(2, dtype=f64), slots=slots)
  for name in ("state", "conv"):
    if getattr(ref, name) is not None:
      assert_close(f"committed {name}", getattr(ref, name), getattr(cache, name), RTOL["float64"])


def test_replay_cache_errors(layer):
  x = _x((2, 3, HIDDEN), seed=21)
  slots = jnp.array([0, 1], jnp.int32)
  cache = layer.init_cache(2, num_draft=3, replay=True, dtype=f64)
  with pytest.raises(ValueError, match=r"num_accepted: a replay cache needs .* \[N\] = \[2\]"):
    _decode(layer, x, cache, slots)
  with pytest.raises(ValueError, match=r"replay ring holds D = 3 .* got x of shape \[2, 2, 16\]"):
    _decode_from(layer, x[:, :2], cache, slots, jnp.zeros(2, jnp.int32))
  with pytest.raises(ValueError, match=r"commit_replay\(cache, slots, num_accepted\)"):
    gflax.accept_draft_tokens(cache, slots, jnp.ones(2, jnp.int32))
  with pytest.raises(ValueError, match="no replay ring"):
    layer.commit_replay(layer.init_cache(2, num_draft=3, dtype=f64), slots,
                        jnp.ones(2, jnp.int32))
  with pytest.raises(ValueError, match="num_draft: replay=True needs D"):
    layer.init_cache(2, replay=True)
  with pytest.raises(ValueError, match="num_accepted: expected 0..D = 0..3"):
    layer.commit_replay(cache, slots, jnp.array([1, 4], jnp.int32))


def test_replay_matches_snapshots_under_jit_with_donated_cache(layer):
  """Speculative steps with random accepted counts: the replay cache, stepped by a jax.jit that
  donates it, gives the snapshot cache's outputs; commit_replay and accept_draft_tokens then
  leave the same state and convolution window."""
  D, S, steps = 3, 4, 4
  graphdef, params = nnx.split(layer)

  def step(params, cache, x, slots, num_accepted):
    return nnx.merge(graphdef, params).decode(x, cache, slots, num_accepted)

  step = jax.jit(step, donate_argnums=(1,))
  slots = jnp.array([3, -1, 1], jnp.int32)
  live = np.array([0, 2])
  rng = np.random.default_rng(22)
  snap = gflax.reset_slots(_poisoned_cache(layer, S, num_draft=D), slots)
  replay = gflax.reset_slots(_poisoned_cache(layer, S, num_draft=D, replay=True), slots)
  prompt = _x((3, 4, HIDDEN), seed=23)
  _, snap = _prefill(layer, prompt, cache=snap, slots=slots)
  _, replay = _prefill(layer, prompt, cache=replay, slots=slots)
  n = jnp.zeros(3, jnp.int32)
  for t in range(steps):
    x = _x((3, D, HIDDEN), seed=30 + t)
    y_snap, snap = _decode_from(layer, x, snap, slots, n)
    old = replay
    y, replay = step(params, replay, x, slots, n)
    assert old.state.is_deleted() and old.ring[1].is_deleted(), "the cache was not donated"
    assert_close(f"step {t} y", y_snap[live], y[live], RTOL["float64"])
    n = jnp.asarray(rng.integers(1, D + 1, 3), jnp.int32)
  rolled = gflax.accept_draft_tokens(snap, slots, n)
  committed = layer.commit_replay(replay, slots, n)
  for name in ("state", "conv"):
    a, b = getattr(rolled, name), getattr(committed, name)
    assert_close(name, a[np.array([3, 1])], b[np.array([3, 1])], RTOL["float64"])


@pytest.mark.parametrize("variant", ["default", "plain", "replay"])
def test_kernel_backend_matches_reference(variant):
  """The same layer on the Triton kernels (interpreter on a CPU) and on the references; "replay"
  decodes twice through a replay cache (keeping 1 and 2 tokens of the first step) and commits."""
  cfg = dict(hidden_size=16, head_dim=16, expand_v=1, num_heads=1, num_v_heads=2,
             num_householder=2)
  if variant == "plain":
    cfg.update(use_forget_gate=False, allow_neg_eigval=False, use_output_gate=False,
               conv_bias=True, num_householder=3)
  lay = _randomize(_abstract(**cfg, backend="reference"), 7)
  x = _x((1, 10, 16), seed=6).astype(jnp.float32)
  cu = jnp.array([0, 3, 10], jnp.int32)
  slots = jnp.array([2, 0], jnp.int32)
  replay = variant == "replay"
  names = (("prefill y", "decode y", "step 2 y", "state", "committed state", "committed conv")
           if replay else ("prefill y", "decode y", "state", "snapshots", "conv snapshots"))
  outs = {}
  for backend in ("reference", KERNEL_BACKEND):
    lay.backend = backend
    cache = lay.init_cache(3, num_draft=2, replay=replay)
    y, c = _prefill(lay, x, cu_seqlens=cu, cache=cache, slots=slots)
    if replay:
      yd, c = _decode_from(lay, x[0, :4].reshape(2, 2, 16), c, slots, jnp.zeros(2, jnp.int32))
      y2, c = _decode_from(lay, x[0, 4:8].reshape(2, 2, 16), c, slots, jnp.array([1, 2]))
      done = lay.commit_replay(c, slots, jnp.array([2, 1], jnp.int32))
      outs[backend] = (y, yd, y2, c.state, done.state, done.conv)
    else:
      yd, c = _decode(lay, x[0, :4].reshape(2, 2, 16), c, slots)
      outs[backend] = (y, yd, c.state, c.state_snapshots, c.conv_snapshots)
  for name, ref, out in zip(names, outs["reference"], outs[KERNEL_BACKEND]):
    assert_close(name, ref, out, 1e-4)


@pytest.mark.parametrize("backend", [KERNEL_BACKEND])
def test_layer_trains_on_the_kernels(backend):
  """nnx.grad of a loss through the layer on the Triton kernels (the interpreter on a CPU)
  equals the reference backend's parameter gradients (float32 inputs, packed sequences)."""
  cfg = dict(hidden_size=16, head_dim=16, expand_v=1, num_heads=1, num_v_heads=2,
             num_householder=2)
  lay = _randomize(_abstract(**cfg, backend="reference"), 11)
  x = _x((1, 12, 16), seed=12).astype(jnp.float32)
  cu = jnp.array([0, 5, 12], jnp.int32)
  target = _x((1, 12, 16), seed=13).astype(jnp.float32)

  def loss(model):
    return jnp.mean((model(x, cu_seqlens=cu) - target) ** 2)

  grads = {}
  for b in ("reference", backend):
    lay.backend = b
    grads[b] = nnx.state(nnx.jit(nnx.grad(loss))(lay), nnx.Param)
  ref, out = (jax.tree.leaves(grads[b]) for b in ("reference", backend))
  assert len(ref) == len(out) and len(ref) > 5
  for i, (r, o) in enumerate(zip(ref, out)):
    assert_close(f"param gradient {i}", r, o, 1e-4)
  assert any(float(jnp.max(jnp.abs(r))) > 0 for r in ref)


def test_layer_passes_its_prefill_configs(layer):
  """prefill_config and prefill_bwd_config reach the prefill's config= and bwd_config=: checked
  there on every backend (a bad one raises, naming the argument), ignored by the references."""
  import gdp_jax
  lay = _randomize(_abstract(**CFG, backend="reference", param_dtype=f64,
                             prefill_config=gdp_jax.FwdConfig(h_piece=0),
                             prefill_bwd_config=gdp_jax.BwdConfig(h_split=1)), 1)
  x = _x((2, 5, HIDDEN), seed=8)
  assert bits_equal(_prefill(lay, x), _prefill(layer, x))
  lay.prefill_config = gdp_jax.FwdConfig(h_piece=-2)
  with pytest.raises(ValueError, match=r"config: FwdConfig.h_piece: expected an int >= -1"):
    _prefill(lay, x)
  lay.prefill_config, lay.prefill_bwd_config = None, gdp_jax.FwdConfig()
  with pytest.raises(ValueError, match=r"bwd_config: expected a gdp_jax.BwdConfig or None"):
    _prefill(lay, x)


# -------------------------------------------------------------------------------------------------
# FLA weights: names and shapes as written in fla/layers/gated_deltaproduct.py


def _fla_layout(hidden_size=2048, expand_v=2, head_dim=256, num_heads=6, num_v_heads=None,
                use_output_gate=True, use_short_conv=True, conv_size=4, conv_bias=False,
                use_forget_gate=True, num_householder=2, **_):
  """FLA's `GatedDeltaProduct(...).state_dict()` names and shapes, read off its __init__."""
  HV = num_v_heads or num_heads
  key_dim = num_heads * head_dim
  value_dim = HV * int(head_dim * expand_v)
  M = num_householder
  out = {"q_proj.weight": (key_dim, hidden_size), "k_proj.weight": (key_dim * M, hidden_size),
         "v_proj.weight": (value_dim * M, hidden_size), "b_proj.weight": (HV * M, hidden_size)}
  if use_forget_gate:
    out.update({"a_proj.weight": (HV, hidden_size), "A_log": (HV,), "dt_bias": (HV,)})
  if use_short_conv:
    for name, width in (("q", key_dim), ("k", key_dim * M), ("v", value_dim * M)):
      out[f"{name}_conv1d.weight"] = (width, 1, conv_size)      # nn.Conv1d, groups = width
      if conv_bias:
        out[f"{name}_conv1d.bias"] = (width,)
  if use_output_gate:
    out["g_proj.weight"] = (value_dim, hidden_size)
  out["o_norm.weight"] = (int(head_dim * expand_v),)              # FusedRMSNormGated / RMSNorm
  out["o_proj.weight"] = (hidden_size, value_dim)
  return out


LAYOUTS = [
    pytest.param(dict(hidden_size=24, head_dim=8, num_heads=3), id="defaults-small"),
    pytest.param(dict(hidden_size=16, head_dim=4, num_heads=2, num_v_heads=6, expand_v=1.5,
                      num_householder=3, conv_bias=True, conv_size=3), id="gva-M3-bias"),
    pytest.param(dict(hidden_size=8, head_dim=4, num_heads=1, use_forget_gate=False,
                      use_output_gate=False, use_short_conv=False, num_householder=1),
                 id="plain-deltanet"),
]


@pytest.mark.parametrize("cfg", LAYOUTS)
def test_converter_round_trip(cfg):
  lay = _abstract(**cfg, backend="reference")
  layout = _fla_layout(**cfg)
  assert gflax.fla_state_dict_shapes(lay) == layout
  rng = np.random.default_rng(0)
  sd = {"model.layers.3.attn." + k: rng.standard_normal(s).astype(np.float32)
        for k, s in layout.items()}
  gflax.from_fla_state_dict(lay, sd, prefix="model.layers.3.attn.")
  back = gflax.to_fla_state_dict(lay, prefix="model.layers.3.attn.")
  assert sorted(back) == sorted(sd)
  for k in sd:
    assert back[k].shape == sd[k].shape and np.array_equal(back[k], sd[k]), k
  # Torch's [out, in] arrives transposed in Flax's [in, out] kernel.
  assert np.array_equal(np.asarray(lay.q_proj.kernel[...]), sd["model.layers.3.attn.q_proj.weight"].T)


def test_converter_errors():
  lay = _randomize(_abstract(**CFG, backend="reference"), 0)
  sd = gflax.to_fla_state_dict(lay)
  missing = dict(sd)
  del missing["dt_bias"]
  with pytest.raises(ValueError, match="dt_bias"):
    gflax.from_fla_state_dict(lay, missing)
  with pytest.raises(ValueError, match="q_conv1d.bias"):
    gflax.from_fla_state_dict(lay, {**sd, "q_conv1d.bias": np.zeros(16)})
  bad = {**sd, "k_proj.weight": sd["k_proj.weight"][:, :-1]}
  with pytest.raises(ValueError, match="k_proj.weight"):
    gflax.from_fla_state_dict(lay, bad)


# -------------------------------------------------------------------------------------------------
# Against FLA's forward, transcribed in numpy from fla/layers/gated_deltaproduct.py


def _fla_forward_numpy(sd, cfg, x):
  """FLA's GatedDeltaProduct.forward (no cache, no mask) in float64 numpy, from its state dict."""
  H, K = cfg["num_heads"], cfg["head_dim"]
  HV = cfg.get("num_v_heads") or H
  V = int(K * cfg.get("expand_v", 2))
  M = cfg["num_householder"]
  B, T, _ = x.shape
  silu = lambda a: a / (1 + np.exp(-a))                           # noqa: E731
  sigmoid = lambda a: 1 / (1 + np.exp(-a))                        # noqa: E731

  def lin(name, a):
    return a @ sd[f"{name}.weight"].T

  def short_conv(name, a):                                        # torch Conv1d, causal part
    w = sd[f"{name}.weight"][:, 0, :]                             # [C, W]
    W = w.shape[1]
    pad = np.concatenate([np.zeros((B, W - 1, a.shape[-1])), a], axis=1)
    return silu(sum(pad[:, i:i + T] * w[:, i] for i in range(W)))

  q = short_conv("q_conv1d", lin("q_proj", x)).reshape(B, T, H, K)
  k = short_conv("k_conv1d", lin("k_proj", x)).reshape(B, T, M, H, K).reshape(B, T * M, H, K)
  v = short_conv("v_conv1d", lin("v_proj", x)).reshape(B, T, M, HV, V).reshape(B, T * M, HV, V)
  q, k = (np.repeat(a, HV // H, axis=2) for a in (q, k))
  beta = (sigmoid(lin("b_proj", x)) * 2).reshape(B, T, M, HV).reshape(B, T * M, HV)
  a = lin("a_proj", x) + sd["dt_bias"]
  g = -np.exp(sd["A_log"]) * np.where(a > 20, a, np.log1p(np.exp(np.minimum(a, 20))))
  l2 = lambda u: u / np.sqrt((u * u).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
  q, k = l2(q) * K ** -0.5, l2(k)
  o = np.zeros((B, T, HV, V))
  for b in range(B):
    for h in range(HV):
      S = np.zeros((K, V))
      for t in range(T):
        S = S * np.exp(g[b, t, h])
        for j in range(M):
          kk = k[b, t * M + j, h]
          S = S + np.outer(kk, beta[b, t * M + j, h] * (v[b, t * M + j, h] - S.T @ kk))
        o[b, t, h] = S.T @ q[b, t, h]
  gate = lin("g_proj", x).reshape(B, T, HV, V)
  o = o / np.sqrt((o * o).mean(-1, keepdims=True) + cfg.get("norm_eps", 1e-5))
  o = o * sd["o_norm.weight"] * silu(gate)
  return lin("o_proj", o.reshape(B, T, HV * V))


def test_matches_fla_forward_transcription():
  cfg = dict(CFG, num_householder=3)
  lay = _abstract(**cfg, backend="reference", param_dtype=f64)
  rng = np.random.default_rng(11)
  sd = {k: rng.standard_normal(s) * (0.4 if "proj" in k else 0.6)
        for k, s in _fla_layout(**cfg).items()}
  sd["A_log"] = np.log(rng.uniform(0.5, 4.0, sd["A_log"].shape))
  gflax.from_fla_state_dict(lay, sd)
  x = rng.standard_normal((2, 6, HIDDEN))
  assert_close("y", _fla_forward_numpy(sd, cfg, x), _prefill(lay, jnp.asarray(x)), RTOL["float64"])


# -------------------------------------------------------------------------------------------------
# FLA's torch layer itself (GPU only: its kernels are Triton on CUDA)


@pytest.mark.gpu
@pytest.mark.parametrize("T,packed", [(100, False), (16, False), (150, True)],
                         ids=["chunk", "fused_recurrent", "varlen"])
def test_matches_fla_torch_layer(T, packed):
  pytest.importorskip("fla", reason="FLA (fla-core + flash-linear-attention) is not installed")
  fla_layers = pytest.importorskip(
      "fla.layers.gated_deltaproduct",
      reason="fla.layers comes with flash-linear-attention, not with fla-core alone")
  torch = pytest.importorskip("torch", reason="FLA's layer is a torch module")
  import os
  cfg = dict(hidden_size=64, head_dim=32, expand_v=2, num_heads=2, num_v_heads=4,
             num_householder=2)
  jlay = _randomize(_abstract(**cfg, backend=KERNEL_BACKEND,
                              precision=jax.lax.Precision.HIGHEST), 3)
  sd = gflax.to_fla_state_dict(jlay)
  # FLA's chunked path (inputs over 64 tokens, or packed) refuses float32: it runs in bf16 there.
  chunked = packed or T > 64
  tdtype = torch.bfloat16 if chunked else torch.float32
  tlay = fla_layers.GatedDeltaProduct(**cfg, layer_idx=0).cuda()
  tlay.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()})
  tlay = tlay.to(tdtype).eval()
  x = np.random.default_rng(0).standard_normal((1 if packed else 2, T, 64)).astype(np.float32)
  cu = np.array([0, 37, 38, 150], np.int32) if packed else None
  y = _prefill(jlay, jnp.asarray(x), cu_seqlens=None if cu is None else jnp.asarray(cu))
  # jax_triton clears TRITON_CACHE_DIR on import; torch-launched Triton kernels need it back.
  if not os.environ.get("TRITON_CACHE_DIR"):
    os.environ["TRITON_CACHE_DIR"] = os.path.expanduser("~/.triton/cache")
  with torch.no_grad():
    kwargs = {} if cu is None else {"cu_seqlens": torch.from_numpy(cu).long().cuda()}
    yt = tlay(torch.from_numpy(x).cuda().to(tdtype), **kwargs)[0].float().cpu().numpy()
  # FLA's kernels use tf32 dots and its own l2norm/RMSNorm rounding: float32 with slack; its
  # chunked path runs the whole layer in bf16 (weights too), hence the bf16-level tolerance.
  assert_close("y vs FLA", yt, y, 3e-2 if chunked else 5e-3)


# -------------------------------------------------------------------------------------------------
# The example model: slots, packed prefill, speculative decoding, against recomputation


def _sometimes_wrong_drafter(model, tokens, n):
  """The bigram drafter, made wrong on some tokens so that drafts are both kept and rejected."""
  drafts = em.bigram_drafter(model, tokens, n)
  return jnp.where((drafts + tokens[:, None]) % 3 == 0, (drafts + 1) % model.vocab_size, drafts)


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "snapshots"])
def test_example_engine_matches_recomputation(replay):
  model = em.TinyLM(vocab_size=32, hidden_size=32, num_layers=2, head_dim=8, num_heads=2,
                    num_v_heads=4, num_householder=2, backend="reference", param_dtype=f64,
                    rngs=nnx.Rngs(0))
  rng = np.random.default_rng(1)
  shapes = [(5, 7), (9, 3), (3, 10), (12, 6), (7, 1), (4, 8)]  # (prompt length, new tokens)
  reqs = [em.Request(tuple(int(t) for t in rng.integers(0, 32, L)), n) for L, n in shapes]
  ref = em.generate_reference(model, reqs)
  # Two decode steps per jitted call (the default is 4): steps still unrolled in one program and
  # requests still finishing inside a call, at half the decode step's compile (most of the time).
  engine = em.Engine(model, num_slots=3, num_draft=3, max_prefill_tokens=24, max_prefill_seqs=2,
                     drafter=_sometimes_wrong_drafter, cache_dtype=f64, replay=replay,
                     steps_per_call=2)
  assert (engine.caches[0].ring is not None) == replay
  out, stats = engine.generate(reqs)
  assert out == ref
  assert [len(o) for o in out] == [n for _, n in shapes]
  # Requests entered and left slots over time (6 requests, 3 slots), and verification both
  # rejected (1 token kept) and accepted drafts (2 and all 3 kept).
  assert stats["prefill_calls"] >= 2
  assert set(stats["accepted"]) == {1, 2, 3}, stats["accepted"]
  seen = {rid for row in stats["slot_trace"] for rid in row if rid >= 0}
  assert seen == {0, 1, 2, 3, 5}           # request 4 wants one token: done after its prefill
  # A second run reuses the compiled steps and the (donated, rewritten) caches.
  assert engine.generate(reqs[:2])[0] == ref[:2]


@pytest.mark.gpu
def test_example_engine_on_kernels_matches_reference_gpu():
  """The served example on the Triton kernels (prefill, decode with drafts, rollback) generates
  the tokens of the step-by-step recomputation on the jnp references, same float32 weights."""
  kw = dict(vocab_size=32, hidden_size=64, num_layers=2, head_dim=32, num_heads=2,
            num_v_heads=4, num_householder=2, param_dtype=jnp.float32)
  model = em.TinyLM(**kw, backend="triton", rngs=nnx.Rngs(0))
  ref_model = em.TinyLM(**kw, backend="reference", rngs=nnx.Rngs(0))
  rng = np.random.default_rng(2)
  shapes = [(70, 7), (9, 5), (130, 10), (12, 6), (7, 1)]  # prompts past one 64-token chunk
  reqs = [em.Request(tuple(int(t) for t in rng.integers(0, 32, L)), n) for L, n in shapes]
  ref = em.generate_reference(ref_model, reqs)
  engine = em.Engine(model, num_slots=3, num_draft=3, max_prefill_tokens=256,
                     max_prefill_seqs=2, drafter=_sometimes_wrong_drafter,
                     cache_dtype=jnp.float32)
  out, stats = engine.generate(reqs)
  assert out == ref
  assert max(stats["accepted"]) > 1, stats["accepted"]   # drafts were kept, not only rejected
