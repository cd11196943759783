"""Batch invariance: a request's bits do not depend on what it is batched with.

A request decoded alone (N = 1, a one-slot cache) and the same request inside a batch of other
random requests, at another position and slot, beside -1 padding, must give bitwise the same
outputs, state and snapshots (docs/algorithm.md §13.2): no tile, warp or split choice may depend
on the batch. The same for the prefill: a sequence alone, in a dense batch, and packed among
others with cu_seqlens gives the same outputs, final state and chunk states, also where the
forward scan splits a long sequence into pieces (docs/algorithm.md §13.3). The interpreter runs
the checks at tiny shapes; the GPU cases (`-m gpu`) are the ones that matter, since compiled
kernels are where a batch-dependent tile changes the summation order.
"""
import jax.numpy as jnp
import numpy as np
import pytest

import gdp_jax
from conftest import KERNEL_BACKEND
from helpers import bits_equal


def _requests(rng, N, D, M, H, HV, K, V, dtype):
  k = rng.standard_normal((N, D * M, H, K))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  dt = jnp.dtype(dtype)
  return dict(q=jnp.asarray(rng.standard_normal((N, D, H, K)), dt), k=jnp.asarray(k, dt),
              v=jnp.asarray(rng.standard_normal((N, D * M, HV, V)), dt),
              g=jnp.asarray(-rng.exponential(0.5, (N, D, HV)), jnp.float32),
              beta=jnp.asarray(rng.uniform(0, 2, (N, D * M, HV)), dt))


RING = ("k", "v", "g", "beta")


def check_decode_invariance(N, positions, D, M, H, HV, K, V, dtype, backend, spec=False,
                            replay=False):
  """The request alone, then at each of `positions` in a batch of N random requests (one of
  them -1 padding, slots a random permutation of a larger cache): bitwise equal. With D > 1 the
  step keeps snapshots; with `spec` it also starts from the previous step's snapshot
  (num_accepted); with `replay` it replays its accepted ring tokens instead (no snapshots)."""
  rng = np.random.default_rng(N * 7 + D)
  mine = _requests(rng, 1, D, M, H, HV, K, V, dtype)
  my_state = rng.standard_normal((HV, K, V)).astype(np.float32)
  my_snaps = rng.standard_normal((D, HV, K, V)).astype(np.float32)
  my_ring = _requests(rng, 1, D, M, H, HV, K, V, dtype)
  my_count = D - 1 if D > 1 else 1
  kw = dict(num_householder=M, use_qk_l2norm_in_kernel=True, backend=backend)

  def run(x, state, slots, snaps, counts, ring):
    extra = {}
    if replay:
      extra["replay_ring"] = tuple(ring[n] for n in RING)
    elif D > 1:
      extra["intermediate_states"] = jnp.asarray(snaps)
    if spec or replay:
      extra["num_accepted"] = jnp.asarray(counts, jnp.int32)
    out = gdp_jax.gated_delta_product_decode(
        **x, state=jnp.asarray(state), state_indices=jnp.asarray(slots, jnp.int32), **extra, **kw)
    return [np.asarray(a) for a in out[:2 if replay else 3]]

  alone = run(mine, my_state[None], [0], my_snaps[None], [my_count], my_ring)
  for p in positions:
    S = N + 3
    x = {n: a.at[p].set(mine[n][0])
         for n, a in _requests(rng, N, D, M, H, HV, K, V, dtype).items()}
    slots = rng.permutation(S)[:N]
    slots[(p + 1) % N] = -1
    state = rng.standard_normal((S, HV, K, V)).astype(np.float32)
    snaps = rng.standard_normal((S, D, HV, K, V)).astype(np.float32)
    state[slots[p]] = my_state
    snaps[slots[p]] = my_snaps
    counts = rng.integers(0, D + 1, N)
    counts[p] = my_count
    ring = {n: a.at[slots[p]].set(my_ring[n][0])
            for n, a in _requests(rng, S, D, M, H, HV, K, V, dtype).items()}
    got = run(x, state, slots, snaps, counts, ring)
    s = slots[p]
    assert bits_equal(got[0][p], alone[0][0]), f"o differs at position {p} of {N}"
    assert bits_equal(got[1][s], alone[1][0]), f"state differs at position {p} of {N}"
    if D > 1 and not replay:
      assert bits_equal(got[2][s], alone[2][0]), f"snapshots differ at position {p} of {N}"


@pytest.mark.parametrize("D,spec", [(1, False), (3, False), (3, True)])
def test_decode_batch_invariance(D, spec):
  check_decode_invariance(5, (0, 3), D, 2, 1, 2, 8, 24, "float32", KERNEL_BACKEND, spec=spec)


def test_replay_batch_invariance():
  check_decode_invariance(5, (0, 3), 3, 2, 1, 2, 8, 24, "float32", KERNEL_BACKEND, replay=True)


@pytest.mark.parametrize("D", [3, 6])
def test_replay_block_form_batch_invariance(D):
  """bfloat16 at BV 16 (two V blocks): the new tokens' outputs in block form (D = 6 at M = 2:
  two blocks)."""
  check_decode_invariance(5, (0, 3), D, 2, 1, 2, 16, 32, "bfloat16", KERNEL_BACKEND,
                          replay=True)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [2, 64, 256])
@pytest.mark.parametrize("D,spec,dtype", [(1, False, "bfloat16"), (4, False, "float32"),
                                          (4, True, "bfloat16")])
def test_decode_batch_invariance_gpu(N, D, spec, dtype):
  check_decode_invariance(N, sorted({0, N // 2, N - 1}), D, 2, 16, 16, 128, 128, dtype,
                          "triton", spec=spec)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [2, 64, 256])
def test_replay_batch_invariance_gpu(N):
  check_decode_invariance(N, sorted({0, N // 2, N - 1}), 4, 2, 16, 16, 128, 128, "float32",
                          "triton", replay=True)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [2, 64, 256])
@pytest.mark.parametrize("D", [4, 8])
def test_replay_block_form_batch_invariance_gpu(N, D):
  check_decode_invariance(N, sorted({0, N // 2, N - 1}), D, 2, 16, 16, 128, 128, "bfloat16",
                          "triton", replay=True)


def _sequence(rng, L, M, H, HV, K, V):
  k = rng.standard_normal((1, L * M, H, K))
  return dict(q=rng.standard_normal((1, L, H, K)), k=k,
              v=rng.standard_normal((1, L * M, HV, V)),
              g=-rng.exponential(0.05, (1, L, HV)), beta=rng.uniform(0, 2, (1, L * M, HV)),
              h0=rng.standard_normal((1, HV, K, V)))


def _prefill(seqs, M, dense, backend, config=None):
  """The sequences as one dense batch (all of one length) or packed with cu_seqlens, under
  `config` (a FwdConfig; None: the default)."""
  bf16 = jnp.bfloat16
  cat = lambda n, axis: np.concatenate([s[n] for s in seqs], axis)
  axis = 0 if dense else 1
  x = dict(q=jnp.asarray(cat("q", axis), bf16), k=jnp.asarray(cat("k", axis), bf16),
           v=jnp.asarray(cat("v", axis), bf16), g=jnp.asarray(cat("g", axis), jnp.float32),
           beta=jnp.asarray(cat("beta", axis), bf16))
  kw = dict(num_householder=M, initial_state=jnp.asarray(cat("h0", 0), jnp.float32),
            output_final_state=True, use_qk_l2norm_in_kernel=True, return_chunk_states=True,
            chunk_states_dtype=jnp.float32)
  cu = None
  if not dense:
    cu = np.concatenate([[0], np.cumsum([s["q"].shape[1] for s in seqs])]).astype(np.int32)
    kw["cu_seqlens"] = jnp.asarray(cu)
  o, final, chunks = gdp_jax.chunk_gated_delta_product(**x, **kw, config=config, backend=backend)
  return np.asarray(o), np.asarray(final), np.asarray(chunks), cu


def check_prefill_invariance(M, H, HV, K, V, L, lengths, backend, config=None):
  """A sequence of L tokens alone, at row 2 of a dense batch of 4, and packed third among
  `lengths` (whose third entry is L): bitwise the same o, final state and chunk states."""
  rng = np.random.default_rng(HV)
  mine = _sequence(rng, L, M, H, HV, K, V)
  run = lambda seqs, dense: _prefill(seqs, M, dense, backend, config)
  o1, f1, c1, _ = run([mine], True)
  NC = -(-L // 64)

  dense = [_sequence(rng, L, M, H, HV, K, V) for _ in range(3)]
  dense.insert(2, mine)
  o, f, c, _ = run(dense, True)
  assert bits_equal(o[2], o1[0]), "dense batch: o differs"
  assert bits_equal(f[2], f1[0]), "dense batch: final state differs"
  assert bits_equal(c[2], c1[0]), "dense batch: chunk states differ"

  packed = [mine if i == 2 else _sequence(rng, n, M, H, HV, K, V) for i, n in enumerate(lengths)]
  o, f, c, cu = run(packed, False)
  row0 = int(np.asarray(gdp_jax.chunk_offsets(jnp.asarray(cu)))[2])
  assert bits_equal(o[0, cu[2]:cu[3]], o1[0]), "packed: o differs"
  assert bits_equal(f[2], f1[0]), "packed: final state differs"
  assert bits_equal(c[row0:row0 + NC], c1[0]), "packed: chunk states differ"


@pytest.mark.parametrize("L", [100, 64])
def test_prefill_batch_invariance(L):
  """The forward scan split into pieces of two expanded chunks: a sequence of 100 tokens (four
  chunks at M = 2: two pieces wherever it sits) and one of 64 (exactly one piece: alone or in a
  dense batch the walk is not split at all, packed beside longer ones it runs in the split
  launches) give the same bits alone, in a dense batch and packed."""
  check_prefill_invariance(2, 1, 2, 16, 16, L, [30, 0, L, 130, 1, 64], KERNEL_BACKEND,
                           config=gdp_jax.FwdConfig(h_piece=2))


@pytest.mark.gpu
@pytest.mark.parametrize("L", [300, 2500])
@pytest.mark.parametrize("HV", [4, 16])
def test_prefill_batch_invariance_gpu(HV, L):
  """A sequence alone, at row 2 of a dense batch of 4, and packed third among nine (starting
  137 tokens in, not on a chunk boundary of the stream): bitwise the same o, final state and
  chunk states. 300 tokens are one piece of the forward scan; 2500 (79 expanded chunks at
  M = 2) are two under the default pieces of 2048 tokens, so the summary, chain and split
  walk run in all three calls. The other sequences change every launch's grid, which must
  change nothing."""
  check_prefill_invariance(2, min(4, HV), HV, 128, 128, L,
                           [100, 37, L, 0, 64, 500, 1, 130, 77], "triton")
