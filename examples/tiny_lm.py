"""A small language model on `gdp_jax.flax.GatedDeltaProduct`, and a serving loop for it.

This is an example of how the pieces fit, with random weights; it is not a trained model.

    tokens -> Embed -> num_layers x [x + GatedDeltaProduct(RMSNorm(x))] -> RMSNorm -> unembed

`Engine` serves a list of requests of different lengths with a fixed number of cache slots:
requests enter free slots through a packed prefill (`cu_seqlens`, each sequence writing its
slot), then decode together, one row per slot (-1 rows are idle slots); a finished request
leaves its slot to the next. With `num_draft = D > 1` each decode step is speculative: a
drafter proposes D-1 tokens after the current one, the model verifies all D in one
`decode` call, and greedy argmax decides how many are accepted. Nothing is rolled back: the
next step passes those counts as `num_accepted`, and every layer replays each request's
accepted tokens of the last step (kept in its cache's ring) into a checkpoint of the state and
convolution inputs before running the new ones (checkpoint and replay; `replay=False` starts
from per-token snapshots instead; docs/api.md). Both compiled steps take the caches donated, so
they are updated in place.

`generate_reference` produces the same tokens the slow way, recomputing each request's whole
sequence with the prefill path for every new token and no cache at all.
"""
from __future__ import annotations

import collections
import dataclasses

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

from gdp_jax.flax import GatedDeltaProduct, reset_slots

__all__ = ["Engine", "Request", "TinyLM", "bigram_drafter", "generate_reference"]


class Block(nnx.Module):
  """Pre-norm residual block: x + GatedDeltaProduct(RMSNorm(x))."""

  def __init__(self, hidden_size: int, layer_kwargs: dict, *, param_dtype, rngs: nnx.Rngs):
    self.norm = nnx.RMSNorm(hidden_size, epsilon=1e-6, param_dtype=param_dtype, rngs=rngs)
    self.attn = GatedDeltaProduct(hidden_size=hidden_size, param_dtype=param_dtype, rngs=rngs,
                                  **layer_kwargs)


class TinyLM(nnx.Module):
  """Embedding, `num_layers` Gated Delta Product blocks, final RMSNorm, unembedding.

  Args:
    vocab_size: number of tokens.
    hidden_size: model width.
    num_layers: number of blocks.
    head_dim, expand_v, num_heads, num_v_heads, num_householder: the layers' K, V / K, H, HV, M.
    backend: the gdp_jax backend of every layer ("auto", "triton", "reference", "interpret").
    param_dtype: dtype of all parameters (activations follow it).
    rngs: `nnx.Rngs` for the random weights.
  """

  def __init__(self, vocab_size: int = 64, hidden_size: int = 32, num_layers: int = 2, *,
               head_dim: int = 8, expand_v: float = 2, num_heads: int = 2,
               num_v_heads: int | None = None, num_householder: int = 2,
               backend: str = "auto", param_dtype=jnp.float32, rngs: nnx.Rngs):
    layer_kwargs = dict(head_dim=head_dim, expand_v=expand_v, num_heads=num_heads,
                        num_v_heads=num_v_heads, num_householder=num_householder,
                        backend=backend)
    self.vocab_size = vocab_size
    self.embed = nnx.Embed(vocab_size, hidden_size, param_dtype=param_dtype, rngs=rngs)
    self.blocks = nnx.List([Block(hidden_size, layer_kwargs, param_dtype=param_dtype, rngs=rngs)
                            for _ in range(num_layers)])
    self.norm = nnx.RMSNorm(hidden_size, epsilon=1e-6, param_dtype=param_dtype, rngs=rngs)
    self.unembed = nnx.Linear(hidden_size, vocab_size, use_bias=False, param_dtype=param_dtype,
                              rngs=rngs)

  def init_caches(self, num_slots: int, *, num_draft: int | None = None, replay: bool = False,
                  dtype=jnp.float32):
    """One `GDPCache` per block, as a tuple (a pytree to donate); `GatedDeltaProduct.init_cache`
    says what num_draft and replay keep."""
    return tuple(b.attn.init_cache(num_slots, num_draft=num_draft, replay=replay, dtype=dtype)
                 for b in self.blocks)

  def hidden(self, tokens, *, cu_seqlens=None, caches=None, slots=None):
    """Prefill: final hidden states [B, T, hidden_size] (and the updated caches, with caches)."""
    x = self.embed(tokens)
    new = []
    for i, b in enumerate(self.blocks):
      if caches is None:
        x = x + b.attn(b.norm(x), cu_seqlens=cu_seqlens)
      else:
        y, c = b.attn(b.norm(x), cu_seqlens=cu_seqlens, cache=caches[i], slots=slots)
        x = x + y
        new.append(c)
    h = self.norm(x)
    return h if caches is None else (h, tuple(new))

  def __call__(self, tokens, *, cu_seqlens=None):
    """Logits [B, T, vocab_size] of a cache-free prefill (dense, or packed with cu_seqlens)."""
    return self.unembed(self.hidden(tokens, cu_seqlens=cu_seqlens))

  def decode(self, tokens, caches, slots, num_accepted=None):
    """D tokens per request [N, D] against the caches: (logits [N, D, vocab_size], caches).

    num_accepted: [N] or None, the previous step's accepted counts (`GatedDeltaProduct.decode`).
    """
    x = self.embed(tokens)
    new = []
    for b, c in zip(self.blocks, caches):
      y, c = b.attn.decode(b.norm(x), c, slots, num_accepted)
      x = x + y
      new.append(c)
    return self.unembed(self.norm(x)), tuple(new)


def bigram_drafter(model: TinyLM, tokens, num_draft: int):
  """A trivial drafter: the model with all its blocks skipped, run greedily from `tokens` [N].

  Returns:
    [N, num_draft] int32 draft tokens.
  """
  drafts = []
  t = tokens
  for _ in range(num_draft):
    t = jnp.argmax(model.unembed(model.norm(model.embed(t))), axis=-1).astype(jnp.int32)
    drafts.append(t)
  return jnp.stack(drafts, axis=1) if drafts else jnp.zeros((tokens.shape[0], 0), jnp.int32)


@dataclasses.dataclass(frozen=True)
class Request:
  """A prompt (token ids) and how many tokens to generate after it (>= 1)."""
  prompt: tuple[int, ...]
  max_new_tokens: int


def _prefill_step(graphdef, params, caches, tokens, cu_seqlens, slots):
  model = nnx.merge(graphdef, params)
  caches = tuple(reset_slots(c, slots) for c in caches)
  h, caches = model.hidden(tokens, cu_seqlens=cu_seqlens, caches=caches, slots=slots)
  last = h[0, jnp.maximum(cu_seqlens[1:] - 1, 0)]               # [Q, hidden]: each sequence's end
  return caches, jnp.argmax(model.unembed(last), axis=-1).astype(jnp.int32)


def _num_draft(model, cache):
  """D, the tokens per decode step that `cache` was made for (1: plain decoding)."""
  if cache.ring is not None:
    return cache.ring[0].shape[1] // model.blocks[0].attn.num_householder
  return 1 if cache.state_snapshots is None else cache.state_snapshots.shape[1]


def _decode_step(graphdef, drafter, params, caches, current, slots, prev_accepted):
  model = nnx.merge(graphdef, params)
  D = _num_draft(model, caches[0])
  drafts = drafter(model, current, D - 1)                            # [N, D-1]
  tokens = jnp.concatenate([current[:, None], drafts], axis=1)       # [N, D]
  # Each request continues after the tokens the last step kept (0: after its prefill, from the
  # cache itself): replayed into its checkpoint, or read from its snapshots; no rollback copy.
  logits, caches = model.decode(tokens, caches, slots, prev_accepted if D > 1 else None)
  preds = jnp.argmax(logits, axis=-1).astype(jnp.int32)              # [N, D]
  # Draft d+1 is accepted while it equals the model's greedy choice after token d.
  ok = jnp.cumprod((drafts == preds[:, :-1]).astype(jnp.int32), axis=1)
  num_accepted = 1 + jnp.sum(ok, axis=1).astype(jnp.int32)           # 1..D tokens kept
  return caches, tokens, preds, num_accepted


def _decode_steps(graphdef, drafter, steps, params, caches, current, slots, prev_accepted):
  """`steps` decode steps in one program, unrolled: each feeds every request the last token the
  step before kept. Returns the caches and, stacked over the steps, tokens and preds [steps, N, D]
  and num_accepted [steps, N]."""
  outs = []
  for _ in range(steps):
    caches, tokens, preds, n_acc = _decode_step(graphdef, drafter, params, caches, current,
                                                slots, prev_accepted)
    current = jnp.take_along_axis(preds, (n_acc - 1)[:, None], axis=1)[:, 0]
    prev_accepted = n_acc
    outs.append((tokens, preds, n_acc))
  return (caches,) + tuple(jnp.stack(x) for x in zip(*outs))


class Engine:
  """Serves requests with `num_slots` cache slots (greedy decoding, optional speculation).

  Args:
    model: the `TinyLM`.
    num_slots: S, requests decoded at once.
    num_draft: D tokens verified per decode step (1: plain decoding; D > 1: the current token
      and D-1 drafts).
    max_prefill_tokens: P, the packed token buffer of one prefill call (longest prompt allowed).
    max_prefill_seqs: Q, sequences per prefill call (default: num_slots).
    drafter: `drafter(model, tokens [N], n) -> [N, n]` int32, traced inside the decode step.
    cache_dtype: dtype of the recurrent states.
    replay: with num_draft > 1, checkpoint-and-replay caches (`init_cache(..., replay=True)`);
      False keeps per-token snapshots.
    steps_per_call: decode steps per jitted call (unrolled), between which the host reads the
      tokens, retires finished requests and admits waiting ones. A small-batch step is bound by
      launches and by the host: each call ends in a device-to-host read, and a `lax.fori_loop`
      of steps costs about twice as much per step as the same steps unrolled (22.6 against
      10.3 us on the H200 at N = 1, docs/performance.md "Launch cost"). Requests that finish
      inside a call leave their slot's remaining steps of that call unused, and admission waits
      for the call to end: a few steps per call is the compromise.
  """

  def __init__(self, model: TinyLM, *, num_slots: int, num_draft: int = 1,
               max_prefill_tokens: int = 64, max_prefill_seqs: int | None = None,
               drafter=bigram_drafter, cache_dtype=jnp.float32, steps_per_call: int = 4,
               replay: bool = True):
    if steps_per_call < 1:
      raise ValueError(f"steps_per_call: expected an int >= 1, got {steps_per_call!r}")
    self.num_slots = num_slots
    self.steps_per_call = int(steps_per_call)
    self.num_draft = num_draft
    self.max_prefill_tokens = max_prefill_tokens
    self.max_prefill_seqs = max_prefill_seqs or num_slots
    self.graphdef, self.params = nnx.split(model)
    # Checkpoint and replay is the faster speculative step: one state read and one write per
    # step whatever D, against one read and D snapshot writes. On the H200 (N = 256, HV = 16,
    # K = V = 128, M = 2, D = 4, float32 cache) its kernel step takes 0.321 ms with bfloat16
    # activations against 0.463 ms for the snapshot step (0.441 ms with float32 activations;
    # benchmarks/decode_replay.json, docs/performance.md).
    self.replay = replay and num_draft > 1
    self.caches = model.init_caches(num_slots, num_draft=num_draft if num_draft > 1 else None,
                                    replay=self.replay, dtype=cache_dtype)
    # Caches are argument 1 of both (after params): donated, so XLA updates them in place.
    self._prefill = jax.jit(lambda p, c, t, cu, s: _prefill_step(self.graphdef, p, c, t, cu, s),
                            donate_argnums=(1,))
    self._decode = jax.jit(
        lambda p, c, cur, s, n: _decode_steps(self.graphdef, drafter, self.steps_per_call, p, c,
                                              cur, s, n),
        donate_argnums=(1,))

  def _admit(self, waiting, free, outputs, active, current, accepted):
    """Packs waiting requests into free slots and prefills them in one call."""
    P, Q = self.max_prefill_tokens, self.max_prefill_seqs
    tokens = np.zeros((1, P), np.int32)
    cu = [0]
    slots = []
    admitted = []
    while waiting and free and len(slots) < Q and cu[-1] + len(waiting[0][1].prompt) <= P:
      rid, req = waiting.popleft()
      slot = free.pop(0)
      tokens[0, cu[-1]:cu[-1] + len(req.prompt)] = req.prompt
      cu.append(cu[-1] + len(req.prompt))
      slots.append(slot)
      admitted.append((rid, req, slot))
    if not admitted:
      return 0
    # Unused entries: empty sequences on slot -1, which read and write nothing.
    cu += [cu[-1]] * (Q - len(slots))
    slots += [-1] * (Q - len(slots))
    self.caches, first = self._prefill(self.params, self.caches, jnp.asarray(tokens),
                                       jnp.asarray(cu, jnp.int32), jnp.asarray(slots, jnp.int32))
    first = np.asarray(first)
    for j, (rid, req, slot) in enumerate(admitted):
      outputs[rid].append(int(first[j]))
      current[slot] = first[j]
      accepted[slot] = 0  # the first decode step starts from the prefilled cache
      if len(outputs[rid]) >= req.max_new_tokens:
        free.append(slot)
      else:
        active[slot] = (rid, req)
    return len(admitted)

  def generate(self, requests):
    """Greedy continuations of every request, in request order.

    Returns:
      (outputs, stats): outputs[i] is the list of max_new_tokens generated token ids of
      requests[i]; stats counts prefill calls, decode steps and accepted tokens per step
      (`accepted`: a list with one entry per (decode step, active request)).

    Raises:
      ValueError: for an empty prompt, max_new_tokens < 1, or a prompt longer than
        max_prefill_tokens.
    """
    for i, r in enumerate(requests):
      if not r.prompt or r.max_new_tokens < 1:
        raise ValueError(f"requests[{i}]: needs a non-empty prompt and max_new_tokens >= 1")
      if len(r.prompt) > self.max_prefill_tokens:
        raise ValueError(f"requests[{i}]: prompt of {len(r.prompt)} tokens exceeds "
                         f"max_prefill_tokens = {self.max_prefill_tokens}")
    waiting = collections.deque(enumerate(requests))
    free = list(range(self.num_slots))
    active = {}                                      # slot -> (request id, request)
    outputs = [[] for _ in requests]
    current = np.zeros((self.num_slots,), np.int32)  # the last token of each slot, not yet fed
    # Tokens the last decode step kept per slot: the next step replays them (or starts from
    # their snapshots).
    accepted = np.zeros((self.num_slots,), np.int32)
    stats = {"prefill_calls": 0, "decode_steps": 0, "accepted": [], "slot_trace": []}
    while waiting or active:
      if waiting and free:
        stats["prefill_calls"] += bool(self._admit(waiting, free, outputs, active, current,
                                                   accepted))
      if not active:
        continue
      slots = np.array([s if s in active else -1 for s in range(self.num_slots)], np.int32)
      self.caches, tokens, preds, n_acc = self._decode(
          self.params, self.caches, jnp.asarray(current), jnp.asarray(slots),
          jnp.asarray(accepted))
      tokens, preds, n_acc = np.asarray(tokens), np.asarray(preds), np.asarray(n_acc)
      accepted[:] = n_acc[-1]
      for i in range(self.steps_per_call):
        if not active:
          break
        stats["decode_steps"] += 1
        stats["slot_trace"].append([active[s][0] if s in active else -1
                                    for s in range(self.num_slots)])
        for slot in sorted(active):
          rid, req = active[slot]
          n = int(n_acc[i, slot])
          stats["accepted"].append(n)
          # Kept: the accepted drafts, then the model's own token after the last accepted one.
          new = [int(t) for t in tokens[i, slot, 1:n]] + [int(preds[i, slot, n - 1])]
          outputs[rid].extend(new[:req.max_new_tokens - len(outputs[rid])])
          current[slot] = preds[i, slot, n - 1]
          if len(outputs[rid]) >= req.max_new_tokens:
            del active[slot]
            free.append(slot)
    return outputs, stats


def generate_reference(model: TinyLM, requests, *, max_len: int | None = None):
  """Greedy continuations by recomputing each whole sequence, one new token at a time.

  Every step runs the cache-free prefill on prompt + generated tokens (padded to `max_len`, the
  sequence marked with cu_seqlens) and takes the argmax at its last token.

  Returns:
    outputs[i]: the generated token ids of requests[i].
  """
  max_len = max_len or max(len(r.prompt) + r.max_new_tokens for r in requests)
  graphdef, params = nnx.split(model)

  @jax.jit
  def next_token(params, tokens, length):
    m = nnx.merge(graphdef, params)
    h = m.hidden(tokens, cu_seqlens=jnp.stack([jnp.int32(0), length]))
    return jnp.argmax(m.unembed(h[0, length - 1]), axis=-1)

  outputs = []
  for r in requests:
    seq = list(r.prompt)
    out = []
    for _ in range(r.max_new_tokens):
      buf = np.zeros((1, max_len), np.int32)
      buf[0, :len(seq)] = seq
      t = int(next_token(params, jnp.asarray(buf), jnp.int32(len(seq))))
      out.append(t)
      seq.append(t)
    outputs.append(out)
  return outputs
