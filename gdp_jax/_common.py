"""Small jax.numpy helpers that the kernel launchers and the references share.

`BT` is the chunk length of the prefill on both streams; `chunk_offsets` and `chunk_descriptors`
index packed chunk lists on the device (docs/algorithm.md §5.3); `softplus` is the gates'
(docs/algorithm.md §8).
"""
import jax.numpy as jnp

# The solve kernel's 4x4 split of 16x16 blocks and the scan's 64-row state tiles are written for
# exactly this value; the chunk_states snapshots are taken every BT tokens.
BT = 64


def chunk_offsets(cu_seqlens, chunk_size=BT):
  """Row of each sequence's first chunk in a packed list of chunks.

  Args:
    cu_seqlens: [N+1] int sequence boundaries (may be traced).
    chunk_size: chunk length.

  Returns:
    int32 [N+1]: 0, then the running sum of ceil(L_i / chunk_size). Row chunk_offsets[i] + c
    of the packed chunk_states holds sequence i's state after its first chunk_size*c tokens.
  """
  cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
  counts = (cu[1:] - cu[:-1] + chunk_size - 1) // chunk_size
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts).astype(jnp.int32)])


def chunk_descriptors(cu_seqlens, max_chunks, chunk_size=BT):
  """Flat list of (sequence, local chunk) pairs, built on the device with static shape.

  Every chunk of every sequence appears once, in sequence order; entry j is chunk
  j - chunk_offsets[i] of sequence i. Zero-length sequences own no entry. No host sync, so it
  may run under jax.jit with a traced cu_seqlens.

  Args:
    cu_seqlens: [N+1] int sequence boundaries.
    max_chunks: static length of the list; min(T, T // chunk_size + N) always suffices for T
      packed tokens.
    chunk_size: chunk length.

  Returns:
    int32 [max_chunks, 2]: (sequence, local chunk), with (-1, 0) for padding entries.
  """
  return descriptors_from_offsets(chunk_offsets(cu_seqlens, chunk_size), max_chunks)


def owners(ends, n):
  """int32 [n]: for j = 0 .. n-1 the number of entries of the sorted int array `ends` at or
  below j, `jnp.searchsorted(ends, j, side="right")` (past repeated ends, the zero-length
  sequences), as a scatter-add and a cumulative sum: two fusions. jnp.searchsorted's default
  lowers to a loop, which on a GPU ran as about eight small kernels and copies per call (a packed
  prefill builds three such lists: 38 launches, 40 us per call on an H100)."""
  hist = jnp.zeros((n,), jnp.int32).at[ends].add(1, mode="drop")
  return jnp.cumsum(hist).astype(jnp.int32)


def descriptors_from_offsets(offs, max_entries):
  """(owner, local index) of entries 0 .. max_entries-1 of a packed list in which owner i holds
  entries offs[i] .. offs[i+1]-1: `chunk_descriptors` for any counts (the forward scan's pieces
  use it too). int32 [max_entries, 2], (-1, 0) past offs[-1]."""
  n = offs.shape[0] - 1
  j = jnp.arange(max_entries, dtype=jnp.int32)
  seq = owners(offs[1:], max_entries)
  valid = j < offs[n]
  local = j - offs[jnp.minimum(seq, n - 1)]
  return jnp.stack([jnp.where(valid, seq, -1), jnp.where(valid, local, 0)], -1).astype(jnp.int32)


def softplus(x):
  """x if x > 20 else log1p(exp(x)), torch's default threshold.

  jax.nn.softplus is logaddexp(x, 0), without the threshold; the clamp keeps exp finite (and a
  gradient through the unused branch free of inf).
  """
  return jnp.where(x > 20, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20))))
