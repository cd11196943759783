"""Decode entry points: the fused recurrent step, Gated Delta Product decode, draft acceptance."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gdp_jax import _backends, _checks, _configs, _launch


def fused_recurrent_gated_delta_rule(
    q, k, v, g=None, beta=None, *, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, cu_seqlens=None, state=None, state_indices=None,
    intermediate_states=None, num_accepted=None, replay_ring=None, steps_per_token=1,
    config=None, backend="auto"):
  """Gated delta rule, token by token; matches `gdp_jax.reference.fused_recurrent_gated_delta_rule`.

  Per sequence and value head, with state S [K, V] in float32:
  `S *= exp(g_t); S += k_t (beta_t * (v_t - S^T k_t))^T; o_t = S^T (scale * q_t)`.

  Dtypes: q, k, v, g, beta and initial_state float32, bfloat16, float16 or float64 (float64 is
  for the reference backend); state and intermediate_states float32, bfloat16 or float64;
  state_indices, cu_seqlens and num_accepted int32 or int64. Any other dtype raises ValueError.

  Args:
    q: queries [B, T, H, K].
    k: keys [B, T, H, K].
    v: values [B, T, HV, V]; value head hv reads key head hv // (HV // H).
    g: log decays [B, T, HV] (natural log, <= 0), or None for no decay.
    beta: [B, T, HV] (head-wise) or [B, T, HV, V] (element-wise), or None for 1.
    scale: query scale; None means K ** -0.5.
    initial_state: [N, HV, K, V] or None for zeros.
    output_final_state: return the final state [N, HV, K, V] float32 (without `state`).
    use_qk_l2norm_in_kernel: normalise q and k rows, x / sqrt(sum(x^2) + 1e-6), in float32.
    cu_seqlens: [N+1] int32 starts of packed sequences (B == 1), or None for N = B sequences.
      Tokens after cu_seqlens[N] get o = 0.
    state: cache [S, HV, K, V]; sequence n reads and writes slot state_indices[n] (or n).
    state_indices: [N] slots; a slot outside [0, S) (-1 by convention) is padding: it reads
      nothing, writes nothing, and its outputs are exactly 0. Slots in [0, S) must be unique
      within a call: a repeat raises ValueError when the indices are concrete, and is undefined
      when they are traced (under jax.jit nothing checks them).
    intermediate_states: [S, T // steps_per_token, HV, K, V] snapshots: entry [slot, i] receives
      the state after step (i + 1) * steps_per_token - 1 of the sequence.
    num_accepted: [N] draft tokens kept by the previous verify step, or None. With it (and
      `state`, `intermediate_states`), sequence n starts from intermediate_states[slot,
      num_accepted[n] - 1], the previous step's snapshot, or from state[slot] where the count
      is 0, and the cache is not written (speculative decoding without a rollback copy,
      docs/api.md). Counts must lie in 0..T // steps_per_token: concrete ones are checked,
      traced ones are clamped to that range. With `replay_ring` instead of
      intermediate_states, the counts say how many of the ring's tokens to replay.
    replay_ring: (k [S, T, H, K], v [S, T, HV, V], g [S, T, HV], beta [S, T, HV] or
      [S, T, HV, V]), the previous step's inputs per cache slot, g and beta None exactly where
      the step's are; needs `state` and `num_accepted` (checkpoint and replay, docs/api.md).
      Sequence n first replays the first num_accepted[n] * steps_per_token ring rows of its
      slot into state[slot] and writes the result back (the new checkpoint; count 0 replays
      and writes nothing), then runs its T steps from there, writing outputs only. The ring's
      new content is this step's k, v, g, beta (cast to the ring's dtypes) at the live slots.
      Not with cu_seqlens or intermediate_states.
    steps_per_token: recurrence steps per draft token (M for folded Gated Delta Product decode).
    config: a `gdp_jax.DecodeConfig` (the kernel's tile), or None for the one picked
      from K and V. Results are bitwise the same for a sequence whatever its batch, under any
      one config.
    backend: "auto", "triton", "reference" or "interpret" (see README).

  Returns:
    (o, final_state), plus the updated intermediate_states last when they are given, or the
    new ring (a tuple like replay_ring) last with replay_ring. o is [B, T, HV, V] in v.dtype.
    final_state is the updated cache when `state` is given (a new array; the same buffer when
    donated under jax.jit; unchanged with num_accepted and snapshots; the checkpoints with
    replay_ring), else [N, HV, K, V] float32 when output_final_state, else None.

  Raises:
    ValueError: at trace time, for shapes or dtypes that do not fit the above; for concrete
      state_indices, also for a repeated slot; for concrete num_accepted, a count out of range.
  """
  dims = _checks.check_fused_recurrent(
      q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
      state=state, state_indices=state_indices, intermediate_states=intermediate_states,
      num_accepted=num_accepted, replay_ring=replay_ring, steps_per_token=steps_per_token)
  scale = dims.K ** -0.5 if scale is None else float(scale)
  backend = _backends.resolve(backend)
  arrays = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state,
                cu_seqlens=cu_seqlens, state=state, state_indices=state_indices,
                intermediate_states=intermediate_states, num_accepted=num_accepted)
  if replay_ring is not None:
    arrays["replay_ring"] = tuple(replay_ring)
  static = dict(scale=scale, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, steps_per_token=steps_per_token)
  config = _config(config, dims)   # checked on every backend; "reference" ignores it
  if backend == "reference":
    from gdp_jax import reference
    return _backends.call_jitted(reference.fused_recurrent_gated_delta_rule, arrays, **static)
  if replay_ring is not None:
    return _backends.call_jitted(_fused_recurrent_replay, arrays, dims=dims, backend=backend,
                                 config=config, **static)
  return _backends.call_jitted(_fused_recurrent_fwd, arrays, dims=dims, backend=backend,
                               config=config, **static)


def _fused_recurrent_replay(q, k, v, g, beta, *, replay_ring, state, state_indices,
                            num_accepted, cu_seqlens, initial_state, intermediate_states,
                            output_final_state, **kw):
  """The replay step: the kernel, then this step's inputs pushed into the ring."""
  o, new_state = _fused_recurrent_fwd(
      q, k, v, g, beta, replay_ring=replay_ring, state=state, state_indices=state_indices,
      num_accepted=num_accepted, cu_seqlens=None, initial_state=None, intermediate_states=None,
      output_final_state=False, **kw)
  return o, new_state, _push_ring(replay_ring, state_indices, (k, v, g, beta))


def _push_ring(ring, state_indices, rows):
  """ring[slot] = this step's rows at each live slot; other slots keep their bits. Traced in
  the caller's program, after the kernel that read the old ring: under jax.jit with the ring
  donated XLA scatters in place."""
  S = ring[0].shape[0]
  N = rows[0].shape[0]
  idx = (jnp.arange(N, dtype=jnp.int32) if state_indices is None
         else state_indices.astype(jnp.int32))
  # Padding (slot outside [0, S)) scatters to row S, which mode="drop" discards.
  idx = jnp.where((idx >= 0) & (idx < S), idx, S)
  return tuple(None if r is None else r.at[idx].set(x.astype(r.dtype), mode="drop")
               for r, x in zip(ring, rows))


def _config(config, dims):
  _checks.check_config("config", config, _configs.DecodeConfig)
  return _configs.decode_config(dims.K, dims.V) if config is None else config


def _fused_recurrent_fwd(q, k, v, g, beta, *, dims, backend, config, scale, initial_state,
                         output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, state,
                         state_indices, intermediate_states, num_accepted, steps_per_token,
                         replay_ring=None):
  """The kernel launch. With replay_ring it returns (o, checkpointed cache) and leaves the ring
  to the caller; dims.T == 0 (q, k, v then unused) is the commit, the replay alone."""
  B, T, H, HV, K, V, N = dims.B, dims.T, dims.H, dims.HV, dims.K, dims.V, dims.N
  replay = replay_ring is not None
  ring_k, ring_v, ring_g, ring_beta = replay_ring if replay else (None,) * 4
  use_g = (ring_g if replay else g) is not None
  beta_like = ring_beta if replay else beta
  NR = ring_k.shape[1] if replay else 1
  has_state = state is not None
  has_inter = intermediate_states is not None
  store_final = output_final_state and not has_state
  S = state.shape[0] if has_state else (intermediate_states.shape[0] if has_inter else 1)
  NI = intermediate_states.shape[1] if has_inter else 1
  f32, i32 = jnp.float32, jnp.int32
  ph = _launch.placeholder
  args = (
      q, k, v,
      ph() if g is None else g.astype(f32),
      ph() if beta is None else beta,
      ph() if initial_state is None else initial_state,
      state if has_state else ph(),
      intermediate_states if has_inter else ph(),
      ph(i32) if state_indices is None else state_indices.astype(i32),
      ph(i32) if cu_seqlens is None else cu_seqlens.astype(i32),
      ph(i32) if num_accepted is None else num_accepted.astype(i32),
      ring_k if replay else ph(),
      ring_v if replay else ph(),
      ph() if ring_g is None else ring_g,
      ph() if ring_beta is None else ring_beta,
      scale, T, S,
  )
  out_shape = (
      # No program stores o when there are no tokens (the commit): a placeholder then.
      jax.ShapeDtypeStruct((B, T, HV, V) if T else (1,), v.dtype),
      jax.ShapeDtypeStruct((N, HV, K, V) if store_final else (1,), f32),
      jax.ShapeDtypeStruct(state.shape if has_state else (1,), state.dtype if has_state else f32),
      jax.ShapeDtypeStruct(intermediate_states.shape if has_inter else (1,),
                           intermediate_states.dtype if has_inter else f32),
  )
  block = _configs.replay_block_rows(T, K, config, (q.dtype, k.dtype, v.dtype)) if replay else 0
  aliases = {}
  if has_state:
    aliases[6] = 2
  if has_inter:
    aliases[7] = 3
  o, ht, new_state, new_inter = _launch.call(
      "fused_recurrent.fused_recurrent_fwd_kernel", *args,
      grid=(-(-V // config.BV) * N * HV,), out_shape=out_shape, backend=backend,
      input_output_aliases=aliases, num_warps=config.num_warps, num_stages=config.num_stages,
      H=H, HV=HV, K=K, V=V, NI=NI, NR=NR, BK=_configs._next_pow2(K), BV=config.BV,
      STEPS_PER_TOKEN=steps_per_token,
      RING_G_STEPS=NR // ring_g.shape[1] if ring_g is not None else 1,
      USE_G=use_g, USE_BETA=beta_like is not None,
      IS_BETA_HEADWISE=beta_like is None or beta_like.ndim == 3,
      USE_QK_L2NORM=bool(use_qk_l2norm_in_kernel),
      USE_INITIAL_STATE=initial_state is not None, STORE_FINAL_STATE=store_final,
      HAS_STATE=has_state, HAS_STATE_INDICES=state_indices is not None,
      STORE_INTERMEDIATE=has_inter, IS_VARLEN=cu_seqlens is not None,
      HAS_NUM_ACCEPTED=num_accepted is not None and not replay, HAS_REPLAY=replay,
      BT=block, NC=-(-T // block) if block else 1)
  if replay:
    return o, new_state
  if cu_seqlens is not None:
    # No program owns tokens outside [cu[0], cu[N]); their outputs are defined as zero.
    t = jnp.arange(T)
    inside = (t >= cu_seqlens[0]) & (t < cu_seqlens[-1])
    o = jnp.where(inside[None, :, None, None], o, jnp.zeros((), o.dtype))
  final = new_state if has_state else (ht if store_final else None)
  return (o, final, new_inter) if has_inter else (o, final)


def gated_delta_product_decode(q, k, v, g, beta, *, num_householder, state, state_indices,
                               intermediate_states=None, num_accepted=None, replay_ring=None,
                               scale=None, use_qk_l2norm_in_kernel=False, config=None,
                               backend="auto"):
  """One decode step of Gated Delta Product for N requests of D draft tokens each.

  Folds the M Householder copies into the sequence (query on the last copy, decay on the first)
  and runs the fused recurrent step with steps_per_token = M; matches
  `gdp_jax.reference.gated_delta_product_decode`.

  Dtypes: q, k, v, g and beta float32, bfloat16, float16 or float64 (float64 is for the
  reference backend); state and intermediate_states float32, bfloat16 or float64 (a bfloat16
  cache halves the state traffic; the state is rounded to it once per call); state_indices and
  num_accepted int32 or int64. Any other dtype raises ValueError.

  Args:
    q: queries [N, D, H, K] (D = 1 for plain decode).
    k: keys [N, D*M, H, K]; draft token d owns rows d*M .. d*M+M-1.
    v: values [N, D*M, HV, V].
    g: log decays [N, D, HV], or None.
    beta: [N, D*M, HV], or None for 1.
    num_householder: M, the rank-1 updates per token.
    state: cache [S, HV, K, V]; request n reads and writes slot state_indices[n].
    state_indices: [N]; a slot outside [0, S) (-1) is padding: no read, no write, o = 0. Slots
      in [0, S) must be unique: a repeat raises ValueError when the indices are concrete, and is
      undefined when they are traced.
    intermediate_states: [S, D, HV, K, V] or None; entry [slot, d] receives the state after
      draft token d (for `accept_draft_tokens`, or for the next step's num_accepted).
    num_accepted: [N] or None: how many of its draft tokens each request kept in the previous
      step, which wrote intermediate_states. Request n then starts from
      intermediate_states[slot, num_accepted[n] - 1], or from state[slot] where the count is 0
      (a request fresh from prefill), and `state` is not written: the snapshots are the state
      of record, and `accept_draft_tokens` copies them into the cache when one is wanted
      (docs/api.md, speculative decoding without a rollback copy). Counts must lie in 0..D:
      concrete ones are checked, traced ones are clamped to 0..D. With `replay_ring` instead
      of intermediate_states, the counts say how many of the ring's draft tokens to replay.
    replay_ring: (k [S, D*M, H, K], v [S, D*M, HV, V], g [S, D, HV], beta [S, D*M, HV]), the
      previous step's inputs per cache slot (checkpoint and replay, docs/api.md), g and beta
      None exactly where the step's are; needs num_accepted, not intermediate_states. Request
      n replays the first num_accepted[n] draft tokens of ring[slot] into state[slot] and
      writes the result back (the new checkpoint; count 0, as after prefill, replays and writes
      nothing), then runs its D draft tokens from there, writing outputs only: one state read
      and one write per step whatever D. The new ring holds this step's k, v, g, beta (cast to
      the ring's dtypes) at the live slots; `commit_replay` folds accepted tokens into the
      cache when speculation ends. With bfloat16 q, k, v and D*M <= 16 the new tokens' outputs
      come from a bfloat16 copy of the checkpoint (block form, docs/api.md): within bf16
      rounding of commit_replay followed by the plain step, not bitwise.
    scale: query scale; None means K ** -0.5.
    use_qk_l2norm_in_kernel: normalise q and k rows in float32 (a zero query stays zero).
    config: a `gdp_jax.DecodeConfig`, or None for the one picked from K and V.
    backend: "auto", "triton", "reference" or "interpret".

  Returns:
    (o [N, D, HV, V] in v.dtype, updated state), plus the updated intermediate_states when given,
    or the new ring (a tuple like replay_ring) with replay_ring. With num_accepted and
    snapshots the state comes back unchanged; with the ring it holds the checkpoints.

  Raises:
    ValueError: at trace time, for shapes or dtypes that do not fit the above; for concrete
      state_indices, also for a repeated slot; for concrete num_accepted, a count outside 0..D
      for a request with a slot in [0, S).
  """
  dims = _checks.check_gdp_decode(q, k, v, g, beta, num_householder=num_householder, state=state,
                                  state_indices=state_indices,
                                  intermediate_states=intermediate_states,
                                  num_accepted=num_accepted, replay_ring=replay_ring,
                                  scale=scale)
  backend = _backends.resolve(backend)
  arrays = dict(q=q, k=k, v=v, g=g, beta=beta, state=state, state_indices=state_indices,
                intermediate_states=intermediate_states, num_accepted=num_accepted,
                replay_ring=None if replay_ring is None else tuple(replay_ring))
  static = dict(num_householder=num_householder,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
  config = _config(config, dims)   # checked on every backend; "reference" ignores it
  if backend == "reference":
    from gdp_jax import reference
    return _backends.call_jitted(reference.gated_delta_product_decode, arrays, scale=scale,
                                 **static)
  scale = dims.K ** -0.5 if scale is None else float(scale)
  return _backends.call_jitted(_gdp_decode_fold, arrays, scale=scale, dims=dims,
                               backend=backend, config=config, **static)


def _gdp_decode_fold(q, k, v, g, beta, *, num_householder, state, state_indices,
                     intermediate_states, num_accepted, replay_ring, scale,
                     use_qk_l2norm_in_kernel, dims, backend, config):
  """The fold: token t's M rows run through the fused recurrent kernel as M steps, the query
  (zeros but on the last step) and the decay (on the first) spread over them. The inputs were
  checked by the caller and this runs inside its jitted program: the launcher is called
  directly."""
  M = num_householder
  N, D, H, K = q.shape
  q_fold = jnp.zeros((N, D, M, H, K), q.dtype).at[:, :, M - 1].set(q).reshape(N, D * M, H, K)
  g_fold = None
  if g is not None:
    g_fold = jnp.zeros((N, D, M, dims.HV), jnp.float32).at[:, :, 0].set(g.astype(jnp.float32))
    g_fold = g_fold.reshape(N, D * M, dims.HV)
  fold_dims = dataclasses.replace(dims, T=D * M)
  out = _fused_recurrent_fwd(
      q_fold, k, v, g_fold, beta, dims=fold_dims, backend=backend, config=config, scale=scale,
      initial_state=None, output_final_state=False,
      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=None, state=state,
      state_indices=state_indices, intermediate_states=intermediate_states,
      num_accepted=num_accepted, steps_per_token=M, replay_ring=replay_ring)
  out = (out[0][:, M - 1::M],) + tuple(out[1:])
  if replay_ring is not None:
    # The ring keeps the unfolded inputs (one decay per draft token; the kernel applies it on
    # the token's first copy).
    out = out + (_push_ring(replay_ring, state_indices, (k, v, g, beta)),)
  return out


def accept_draft_tokens(state, intermediate_states, state_indices, num_accepted):
  """Rolls each slot back to the state after its last accepted draft token.

  `state[s] = intermediate_states[s, n - 1]` for request i with slot s = state_indices[i] and
  n = num_accepted[i] (n = D is a no-op: the decode step already wrote that state). Pure jnp:
  under jax.jit with the cache donated, XLA scatters in place.

  Values are checked when they are concrete (numpy arrays, or jax arrays outside any trace): a
  slot in [0, S) used twice, or a count outside 1..D for a request with a slot in [0, S), raises
  ValueError. Traced values (under jax.jit, vmap, shard_map) cannot be checked: there a repeated
  slot is undefined (one of the requests' snapshots wins), and a count outside 1..D leaves that
  slot as the decode step wrote it. Padding requests (slot outside [0, S)) change nothing, and
  their counts are ignored.

  Args:
    state: cache [S, HV, K, V], float32, bfloat16 or float64.
    intermediate_states: [S, D, HV, K, V] snapshots written by the decode step, float32,
      bfloat16 or float64 (cast to state.dtype).
    state_indices: [N] int32 or int64 slots (-1: padding).
    num_accepted: [N] int32 or int64 accepted draft tokens per request, 1..D.

  Returns:
    The updated cache, [S, HV, K, V] in state.dtype.

  Raises:
    ValueError: for shapes or dtypes that do not fit the above; for concrete values, a repeated
      slot or a count outside 1..D.
  """
  _checks.check_accept(state, intermediate_states, state_indices, num_accepted)
  return _backends.call_jitted(_accept, dict(
      state=state, intermediate_states=intermediate_states, state_indices=state_indices,
      num_accepted=num_accepted))


def _accept(state, intermediate_states, state_indices, num_accepted):
  S, D = intermediate_states.shape[:2]
  idx = state_indices.astype(jnp.int32)
  n = num_accepted.astype(jnp.int32)
  valid = (idx >= 0) & (idx < S) & (n >= 1) & (n <= D)
  # jnp reads index -1 as the last slot: gather from a clipped index, then drop invalid rows by
  # scattering them to S, out of bounds.
  rows = intermediate_states[jnp.where(valid, idx, 0), jnp.where(valid, n - 1, 0)]
  return state.at[jnp.where(valid, idx, S)].set(rows.astype(state.dtype), mode="drop")


def commit_replay(state, replay_ring, state_indices, num_accepted, *, steps_per_token=1,
                  use_qk_l2norm_in_kernel=False, config=None, backend="auto"):
  """Folds each request's accepted ring tokens into its cache slot, ending speculation.

  The replay of a replay step without its new tokens: request i with slot s = state_indices[i]
  applies the first num_accepted[i] tokens of ring[s] to state[s] (state updates only) and
  writes the result back. Call it before a plain decode step (or any use of the cache as the
  state after all accepted tokens); afterwards the ring is spent, and a later replay step must
  pass count 0. Runs the decode kernel with no new tokens, so it gives the bits that the next
  replay step would have started from.

  Args:
    state: cache [S, HV, K, V], float32, bfloat16 or float64.
    replay_ring: (k [S, R, H, K], v [S, R, HV, V], g, beta) as returned by the last replay
      step, R = D * steps_per_token rows per slot; g [S, R, HV] (one decay per row, the
      fused-recurrent ring) or [S, D, HV] (one per draft token, the Gated Delta Product ring),
      or None; beta [S, R, HV], [S, R, HV, V] or None.
    state_indices: [N] int32 or int64 slots (-1: padding, nothing read or written).
    num_accepted: [N] int32 or int64 accepted draft tokens per request, 0..D (0: no change).
    steps_per_token: ring rows per draft token (M for Gated Delta Product).
    use_qk_l2norm_in_kernel: as in the step that filled the ring.
    config: a `gdp_jax.DecodeConfig`, or None for the one picked from K and V.
    backend: "auto", "triton", "reference" or "interpret".

  Returns:
    The updated cache, [S, HV, K, V] in state.dtype (the same buffer when donated under
    jax.jit on a GPU).

  Raises:
    ValueError: for shapes or dtypes that do not fit the above; for concrete values, a
      repeated slot or a count outside 0..D.
  """
  dims = _checks.check_commit_replay(state, replay_ring, state_indices, num_accepted,
                                     steps_per_token=steps_per_token)
  backend = _backends.resolve(backend)
  arrays = dict(state=state, replay_ring=tuple(replay_ring), state_indices=state_indices,
                num_accepted=num_accepted)
  static = dict(steps_per_token=steps_per_token, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
  config = _config(config, dims)   # checked on every backend; "reference" ignores it
  if backend == "reference":
    from gdp_jax import reference
    return _backends.call_jitted(reference.commit_replay, arrays, **static)
  return _backends.call_jitted(_commit_replay, arrays, dims=dims, backend=backend,
                               config=config, **static)


def _commit_replay(state, replay_ring, state_indices, num_accepted, *, dims, backend, config,
                   steps_per_token, use_qk_l2norm_in_kernel):
  ph = _launch.placeholder
  _, new_state = _fused_recurrent_fwd(
      ph(), ph(), ph(), None, None, dims=dims, backend=backend, config=config, scale=1.0,
      initial_state=None, output_final_state=False,
      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=None, state=state,
      state_indices=state_indices, intermediate_states=None, num_accepted=num_accepted,
      steps_per_token=steps_per_token, replay_ring=replay_ring)
  return new_state
