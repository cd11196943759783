"""Token-by-token references (the oracles), written straight from the recurrence of docs/api.md.

Per (sequence, value head hv) the state h is [K, V], starting from the initial state or zeros:

    h *= exp(g_t)                                   # natural log, once per token
    for j in 0..M-1:                                # expanded row r = t*M + j
        h += k_r (beta_r * (v_r - h^T k_r))^T
    o_t = h^T (scale * q_t)

k_r and q_t come from key head hv // (HV // H). Everything is computed in
promote_types(v.dtype, float32) (float32, or float64 under float64 inputs); `o` is returned in
v.dtype. Packed sequences are walked by one `lax.scan` over all T tokens with a per-token
sequence id, so cu_seqlens and state_indices may be traced values (no host sync, static shapes).
A dense batch without a shared cache is one such scan per sequence, vmapped (T steps, not B*T).
"""
import jax
import jax.numpy as jnp

from gdp_jax._common import BT, chunk_offsets


def _compute_dtype(v):
  return jnp.promote_types(v.dtype, jnp.float32)


def _l2norm(x):
  return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _token_scan(q, k, v, g, beta, *, scale, l2norm, cu, initial_state, state, state_indices,
                intermediate_states, steps_per_token, output_final_state, chunk_rows,
                chunk_dtype, num_accepted=None):
  """Walks a packed token stream token by token; the common core of the recurrent references.

  Args:
    q: [T, H, K] queries of the packed stream.
    k: [T, M, H, K] keys, M rank-1 updates per token.
    v: [T, M, HV, V] values.
    g: [T, HV] natural-log decays, or None (no decay).
    beta: [T, M, HV, 1] or [T, M, HV, V] (element-wise), or None (= 1).
    scale: python float or scalar applied to q.
    l2norm: normalise q and k over K first.
    cu: [N+1] int32 sequence boundaries of the stream (tokens past cu[N] are slack).
    initial_state: [N, HV, K, V] or None.
    state: [S, HV, K, V] cache or None; sequence n uses slot state_indices[n] (or n).
    state_indices: [N] int32 or None.
    intermediate_states: [S, T_i, HV, K, V] or None; written at [slot, (s+1)//spt - 1] after
      local step s when (s+1) % spt == 0.
    steps_per_token: spt above.
    num_accepted: [N] int or None; with it sequence n starts from
      intermediate_states[slot, num_accepted[n] - 1] (state[slot] where the count is 0,
      counts clamped to 0..T_i) and the cache is not written.
    output_final_state: return the dense [N, HV, K, V] final state (ignored when `state`).
    chunk_rows: number of rows of the chunk_states buffer, or None for no snapshots. Row
      chunk_offsets[n] + c holds sequence n's state after its first 64c tokens.
    chunk_dtype: dtype of the snapshots.

  Returns:
    (o [T, HV, V] in v.dtype, final or None, intermediate_states or None, chunk_states or None).
  """
  cdt = _compute_dtype(v)
  T, H, K = q.shape
  M, HV, V = v.shape[1], v.shape[2], v.shape[3]
  N = cu.shape[0] - 1
  G = HV // H

  qf = q.astype(cdt)
  kf = k.astype(cdt)
  if l2norm:
    qf = _l2norm(qf)
    kf = _l2norm(kf)
  # Value head hv reads key head hv // G: repeat each key head G times in place.
  qf = jnp.repeat(qf, G, axis=1) * jnp.asarray(scale, cdt)
  kf = jnp.repeat(kf, G, axis=2)
  vf = v.astype(cdt)
  bf = None if beta is None else beta.astype(cdt)
  gf = None if g is None else g.astype(cdt)

  cu = cu.astype(jnp.int32)
  t = jnp.arange(T, dtype=jnp.int32)
  seq = jnp.searchsorted(cu[1:], t, side="right").astype(jnp.int32)
  in_seq = seq < N
  seqc = jnp.minimum(seq, N - 1)
  bos = cu[seqc]
  eos = cu[seqc + 1]
  local = t - bos
  start = local == 0
  end = t == eos - 1

  if state is not None:
    n_slots = state.shape[0]
  elif intermediate_states is not None:
    n_slots = intermediate_states.shape[0]
  else:
    n_slots = N
  slot = seqc if state_indices is None else state_indices.astype(jnp.int32)[seqc]
  live = in_seq & (slot >= 0) & (slot < n_slots)
  slot_c = jnp.clip(slot, 0, n_slots - 1)

  if num_accepted is not None:
    # The start states as they were before the scan, which rewrites the snapshots.
    n_acc = jnp.clip(num_accepted.astype(jnp.int32), 0, intermediate_states.shape[1])
    slot_n = jnp.clip(jnp.arange(N, dtype=jnp.int32) if state_indices is None
                      else state_indices.astype(jnp.int32), 0, n_slots - 1)
    snap = intermediate_states[slot_n, jnp.maximum(n_acc - 1, 0)].astype(cdt)
    init_src = jnp.where((n_acc > 0)[:, None, None, None], snap, state[slot_n].astype(cdt))
    init_idx = seqc
  elif state is not None:
    init_src, init_idx = state, slot_c
  elif initial_state is not None:
    init_src, init_idx = initial_state, seqc
  else:
    init_src, init_idx = None, None

  if state is not None:
    fin, fin_idx = state, slot
  elif output_final_state:
    fin = (jnp.zeros((N, HV, K, V), cdt) if initial_state is None
           else initial_state.astype(cdt))  # empty sequences keep their initial state
    fin_idx = seqc
  else:
    fin, fin_idx = None, None

  inter = intermediate_states
  offs = None
  if chunk_rows is not None:
    cs = jnp.zeros((chunk_rows, HV, K, V), chunk_dtype)
    offs = chunk_offsets(cu, BT)
  else:
    cs = None

  def step(carry, x):
    h, fin, inter, cs = carry
    (q_t, k_t, v_t, g_t, b_t, seqc_t, slot_t, live_t, start_t, end_t, local_t, init_t,
     fin_t) = x
    if init_src is not None:
      h0 = jnp.where(live_t, init_src[init_t].astype(cdt), 0)
    else:
      h0 = jnp.zeros_like(h)
    h = jnp.where(start_t, h0, h)
    if cs is not None:
      row = jnp.where(live_t & (local_t % BT == 0), offs[seqc_t] + local_t // BT, cs.shape[0])
      cs = cs.at[row].set(h.astype(cs.dtype), mode="drop")
    if g_t is not None:
      h = h * jnp.exp(g_t)[:, None, None]
    for j in range(M):
      kj = k_t[j]                                        # [HV, K]
      pred = jnp.sum(h * kj[:, :, None], axis=1)         # h^T k, [HV, V]
      d = v_t[j] - pred
      if b_t is not None:
        d = b_t[j] * d
      h = h + kj[:, :, None] * d[:, None, :]
    o_t = jnp.sum(h * q_t[:, :, None], axis=1)
    o_t = jnp.where(live_t, o_t, 0).astype(v.dtype)
    if inter is not None:
      ok = live_t & ((local_t + 1) % steps_per_token == 0)
      # -1 would wrap to the last slot: send unwritten updates out of range and drop them.
      s_idx = jnp.where(ok, slot_t, inter.shape[0])
      i_idx = jnp.where(ok, (local_t + 1) // steps_per_token - 1, 0)
      inter = inter.at[s_idx, i_idx].set(h.astype(inter.dtype), mode="drop")
    if fin is not None and num_accepted is None:
      f_idx = jnp.where(live_t & end_t, fin_t, fin.shape[0])
      fin = fin.at[f_idx].set(h.astype(fin.dtype), mode="drop")
    return (h, fin, inter, cs), o_t

  h_init = jnp.zeros((HV, K, V), cdt)
  xs = (qf, kf, vf, gf, bf, seqc, slot, live, start, end, local,
        init_idx if init_idx is not None else seqc,
        fin_idx if fin_idx is not None else seqc)
  (_, fin, inter, cs), o = jax.lax.scan(step, (h_init, fin, inter, cs), xs)
  return o, fin, inter, cs


def _default_scale(K, scale):
  return K ** -0.5 if scale is None else scale


def fused_recurrent_gated_delta_rule(q, k, v, g=None, beta=None, *, scale=None,
                                     initial_state=None, output_final_state=False,
                                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, state=None,
                                     state_indices=None, intermediate_states=None,
                                     num_accepted=None, replay_ring=None, steps_per_token=1):
  """Gated delta rule (M = 1), token by token. Twin of `gdp_jax.fused_recurrent_gated_delta_rule`.

  Args:
    q: queries [B, T, H, K].
    k: keys [B, T, H, K].
    v: values [B, T, HV, V]; HV % H == 0, value head hv reads key head hv // (HV // H).
    g: natural-log decays [B, T, HV], or None (no decay). Applied as h *= exp(g) before the
      token's update.
    beta: [B, T, HV] (head-wise) or [B, T, HV, V] (element-wise), or None (= 1).
    scale: query scale, default K ** -0.5.
    initial_state: [N, HV, K, V], any float dtype, or None (zeros).
    output_final_state: return the dense final state [N, HV, K, V] (float32, float64 under
      float64 inputs).
    use_qk_l2norm_in_kernel: normalise q and k rows as x / sqrt(sum(x^2) + 1e-6) first.
    cu_seqlens: [N+1] int32 boundaries of packed sequences (B == 1); tokens past cu[N] are
      slack and get o = 0. None: N = B sequences of T tokens.
    state: cache [S, HV, K, V]; sequence n reads and writes slot state_indices[n] (n when
      state_indices is None), in the cache's dtype. A slot outside [0, S) is padding: it reads
      zeros, writes nothing (no final state, no snapshots) and its outputs are exactly 0.
    state_indices: [N] int32 slots, or None.
    intermediate_states: [S, T // steps_per_token, HV, K, V] snapshot buffer, or None. After
      step s of a sequence (s counted from its start) with (s + 1) % steps_per_token == 0, the
      state is written to [slot, (s + 1) // steps_per_token - 1] in the buffer's dtype.
    num_accepted: [N] int draft tokens kept by the previous step, or None. With it (and state,
      intermediate_states) sequence n starts from intermediate_states[slot, num_accepted[n] - 1]
      (state[slot] where the count is 0; counts clamped to 0..T // steps_per_token) and the
      cache is returned unwritten.
    replay_ring: (k [S, T, H, K], v [S, T, HV, V], g [S, T, HV] or None, beta or None), the
      previous step's inputs per slot, with state, num_accepted and a dense batch: the cache
      becomes `commit_replay` of the ring (the checkpoints), the T steps run from it with
      outputs only, and the ring's live slots receive this step's k, v, g, beta.
    steps_per_token: recurrence steps per snapshot (M when decoding a folded GDP stream).

  Returns:
    (o, final_state), plus the updated intermediate_states last when one is passed, or the new
    ring last with replay_ring. o is [B, T, HV, V] in v.dtype. final_state is the updated cache
    when `state` is given, else the dense final state when output_final_state, else None.
  """
  B, T, H, K = q.shape
  HV, V = v.shape[2], v.shape[3]
  if replay_ring is not None:
    cache = commit_replay(state, replay_ring, state_indices, num_accepted,
                          steps_per_token=steps_per_token,
                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    o, _ = fused_recurrent_gated_delta_rule(
        q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        state=cache, state_indices=state_indices)
    return o, cache, _push_ring(replay_ring, state_indices, (k, v, g, beta))
  if _independent_rows(B, cu_seqlens, state, intermediate_states):
    def one(q, k, v, g, beta, h0):
      return fused_recurrent_gated_delta_rule(
          *_one_row(q, k, v, g, beta), scale=scale, initial_state=_one_row(h0)[0],
          output_final_state=output_final_state,
          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    o, fin = jax.vmap(one)(q, k, v, g, beta, initial_state)
    return o[:, 0], (None if fin is None else fin[:, 0])
  if cu_seqlens is None:
    cu = jnp.arange(B + 1, dtype=jnp.int32) * T
  else:
    cu = cu_seqlens
  BT_ = B * T
  if beta is not None:
    beta = beta.reshape(BT_, 1, HV, V if beta.ndim == 4 else 1)
  o, fin, inter, _ = _token_scan(
      q.reshape(BT_, H, K), k.reshape(BT_, 1, H, K), v.reshape(BT_, 1, HV, V),
      None if g is None else g.reshape(BT_, HV), beta,
      scale=_default_scale(K, scale), l2norm=use_qk_l2norm_in_kernel, cu=cu,
      initial_state=initial_state, state=state, state_indices=state_indices,
      intermediate_states=intermediate_states, steps_per_token=steps_per_token,
      output_final_state=output_final_state, chunk_rows=None, chunk_dtype=None,
      num_accepted=num_accepted)
  out = (o.reshape(B, T, HV, V), fin)
  if intermediate_states is not None:
    out = out + (inter,)
  return out


def _independent_rows(B, cu_seqlens, state, intermediate_states):
  """Dense rows that share no buffer are independent sequences: they can be vmapped."""
  return B > 1 and cu_seqlens is None and state is None and intermediate_states is None


def _one_row(*xs):
  """Each array as a batch of one (None stays None): the per-row call of a vmapped batch."""
  return tuple(None if x is None else x[None] for x in xs)


def _chunk_states_dtype(chunk_states_dtype, state, initial_state, k):
  if chunk_states_dtype is not None:
    return jnp.dtype(chunk_states_dtype)
  if state is not None:
    return state.dtype
  if initial_state is not None:
    return initial_state.dtype
  return k.dtype


def chunk_gated_delta_product(q, k, v, g=None, beta=None, *, num_householder, scale=None,
                              initial_state=None, output_final_state=False,
                              use_qk_l2norm_in_kernel=False, cu_seqlens=None, state=None,
                              state_indices=None, return_chunk_states=False,
                              chunk_states_dtype=None):
  """Gated Delta Product prefill, token by token. Twin of `gdp_jax.chunk_gated_delta_product`.

  Args:
    q: queries [B, T, H, K].
    k: keys of the Householder-expanded stream [B, T*M, H, K]; token t owns rows t*M .. t*M+M-1.
    v: values [B, T*M, HV, V].
    g: natural-log decays [B, T, HV], or None; token t's decay acts once, before its M updates.
    beta: [B, T*M, HV], or None (= 1).
    num_householder: M, rank-1 updates per token.
    scale: query scale, default K ** -0.5.
    initial_state: [N, HV, K, V], any float dtype, or None (zeros).
    output_final_state: return the dense final state [N, HV, K, V] (float32, float64 under
      float64 inputs).
    use_qk_l2norm_in_kernel: normalise q and k rows as x / sqrt(sum(x^2) + 1e-6) first.
    cu_seqlens: [N+1] int32 boundaries of packed sequences (B == 1), in tokens; tokens past
      cu[N] get o = 0. None: N = B sequences of T tokens.
    state: cache [S, HV, K, V]; sequence n reads and writes slot state_indices[n] (n when
      state_indices is None). A slot outside [0, S) is padding: reads zeros, writes nothing,
      its outputs and chunk_states rows are 0.
    state_indices: [N] int32 slots, or None.
    return_chunk_states: also return the state entering every 64-token chunk.
    chunk_states_dtype: dtype of those snapshots; default the cache dtype, else
      initial_state's, else k's.

  Returns:
    (o, final_state), plus chunk_states last when return_chunk_states. o is [B, T, HV, V] in
    v.dtype; final_state is the updated cache, the dense final state, or None.
    chunk_states is [B, ceil(T/64), HV, K, V] (dense) or [min(T, T//64 + N), HV, K, V]
    (cu_seqlens; row chunk_offsets(cu_seqlens)[n] + c is sequence n after its first 64c
    tokens, rows past chunk_offsets[N] are 0).
  """
  M = num_householder
  B, T, H, K = q.shape
  HV, V = v.shape[2], v.shape[3]
  if _independent_rows(B, cu_seqlens, state, None):
    cs_dtype = _chunk_states_dtype(chunk_states_dtype, state, initial_state, k)

    def one(q, k, v, g, beta, h0):
      return chunk_gated_delta_product(
          *_one_row(q, k, v, g, beta), num_householder=M, scale=scale,
          initial_state=_one_row(h0)[0], output_final_state=output_final_state,
          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
          return_chunk_states=return_chunk_states, chunk_states_dtype=cs_dtype)
    out = jax.vmap(one)(q, k, v, g, beta, initial_state)
    return tuple(None if x is None else x[:, 0] for x in out)
  BT_ = B * T
  if cu_seqlens is None:
    cu = jnp.arange(B + 1, dtype=jnp.int32) * T
    rows = B * (-(-T // BT))
  else:
    cu = cu_seqlens
    rows = min(T, T // BT + (cu.shape[0] - 1))
  o, fin, _, cs = _token_scan(
      q.reshape(BT_, H, K), k.reshape(BT_, M, H, K), v.reshape(BT_, M, HV, V),
      None if g is None else g.reshape(BT_, HV),
      None if beta is None else beta.reshape(BT_, M, HV, 1),
      scale=_default_scale(K, scale), l2norm=use_qk_l2norm_in_kernel, cu=cu,
      initial_state=initial_state, state=state, state_indices=state_indices,
      intermediate_states=None, steps_per_token=1, output_final_state=output_final_state,
      chunk_rows=rows if return_chunk_states else None,
      chunk_dtype=_chunk_states_dtype(chunk_states_dtype, state, initial_state, k))
  out = (o.reshape(B, T, HV, V), fin)
  if return_chunk_states:
    if cu_seqlens is None:
      cs = cs.reshape(B, rows // B, HV, K, V)
    out = out + (cs,)
  return out


def gated_delta_product_decode(q, k, v, g, beta, *, num_householder, state, state_indices,
                               intermediate_states=None, num_accepted=None, replay_ring=None,
                               scale=None, use_qk_l2norm_in_kernel=False):
  """D draft tokens per request against the cache. Twin of `gdp_jax.gated_delta_product_decode`.

  Written as its own loop over the D tokens and M copies (not through the folded GDN stream),
  so that the fold can be tested against it.

  Args:
    q: queries [N, D, H, K].
    k: keys [N, D*M, H, K]; draft token d owns rows d*M .. d*M+M-1.
    v: values [N, D*M, HV, V].
    g: natural-log decays [N, D, HV], or None.
    beta: [N, D*M, HV], or None (= 1).
    num_householder: M.
    state: cache [S, HV, K, V], read at and written to slot state_indices[n] in its own dtype.
    state_indices: [N] int32 slots (None: slot n); a slot outside [0, S) is padding: reads
      zeros, writes nothing, outputs 0.
    intermediate_states: [S, D, HV, K, V] or None; [slot, d] receives the state after draft
      token d (all M updates), in the buffer's dtype.
    num_accepted: [N] int or None; with it request n starts from
      intermediate_states[slot, num_accepted[n] - 1] (state[slot] where the count is 0; counts
      clamped to 0..D), and the cache is returned unwritten.
    replay_ring: (k [S, D*M, H, K], v [S, D*M, HV, V], g [S, D, HV] or None, beta
      [S, D*M, HV] or None), the previous step's inputs per slot, with num_accepted: the
      cache becomes `commit_replay` of the ring (the checkpoints), the D draft tokens run from
      it with outputs only, and the ring's live slots receive this step's k, v, g, beta.
    scale: query scale, default K ** -0.5.
    use_qk_l2norm_in_kernel: normalise q and k rows first.

  Returns:
    (o [N, D, HV, V] in v.dtype, updated state), plus the updated intermediate_states last when
    one is passed, or the new ring last with replay_ring.
  """
  M = num_householder
  if replay_ring is not None:
    cache = commit_replay(state, replay_ring, state_indices, num_accepted, steps_per_token=M,
                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    o, _ = gated_delta_product_decode(
        q, k, v, g, beta, num_householder=M, state=cache, state_indices=state_indices,
        scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return o, cache, _push_ring(replay_ring, state_indices, (k, v, g, beta))
  N, D, H, K = q.shape
  HV, V = v.shape[2], v.shape[3]
  G = HV // H
  S = state.shape[0]
  cdt = _compute_dtype(v)
  scale = _default_scale(K, scale)

  qf = q.astype(cdt)
  kf = k.astype(cdt).reshape(N, D, M, H, K)
  if use_qk_l2norm_in_kernel:
    qf = _l2norm(qf)
    kf = _l2norm(kf)
  qf = jnp.repeat(qf, G, axis=2) * jnp.asarray(scale, cdt)     # [N, D, HV, K]
  kf = jnp.repeat(kf, G, axis=3)                                # [N, D, M, HV, K]
  vf = v.astype(cdt).reshape(N, D, M, HV, V)
  bf = None if beta is None else beta.astype(cdt).reshape(N, D, M, HV)

  slots = (jnp.arange(N, dtype=jnp.int32) if state_indices is None
           else state_indices.astype(jnp.int32))
  live = (slots >= 0) & (slots < S)
  h = state[jnp.clip(slots, 0, S - 1)].astype(cdt)
  if num_accepted is not None:
    n_acc = jnp.clip(num_accepted.astype(jnp.int32), 0, D)
    snap = intermediate_states[jnp.clip(slots, 0, S - 1), jnp.maximum(n_acc - 1, 0)]
    h = jnp.where((n_acc > 0)[:, None, None, None], snap.astype(cdt), h)
  h = jnp.where(live[:, None, None, None], h, 0)
  # Padding requests scatter to row S, which mode="drop" discards (-1 would wrap to the end).
  w_slots = jnp.where(live, slots, S)
  # One lax.scan over the D tokens (M copies unrolled inside): XLA's GPU compile of the
  # unrolled chain grew past two minutes at N = 256, D = 8, M = 2.
  lead = lambda a: None if a is None else jnp.moveaxis(a, 1, 0)

  def token(h, x):
    gd, kd, vd, bd, qd = x
    if gd is not None:
      h = h * jnp.exp(gd.astype(cdt))[:, :, None, None]
    for j in range(M):
      kr = kd[:, j]                                             # [N, HV, K]
      delta = vd[:, j] - jnp.einsum("nhkv,nhk->nhv", h, kr,
                                    precision=jax.lax.Precision.HIGHEST)
      if bd is not None:
        delta = bd[:, j][:, :, None] * delta
      h = h + kr[:, :, :, None] * delta[:, :, None, :]
    o_d = jnp.einsum("nhkv,nhk->nhv", h, qd, precision=jax.lax.Precision.HIGHEST)
    snap = None if intermediate_states is None else h.astype(intermediate_states.dtype)
    return h, (jnp.where(live[:, None, None], o_d, 0).astype(v.dtype), snap)

  h, (outs, snaps) = jax.lax.scan(token, h, tuple(map(lead, (g, kf, vf, bf, qf))))
  if intermediate_states is not None:
    intermediate_states = intermediate_states.at[w_slots].set(jnp.moveaxis(snaps, 0, 1),
                                                              mode="drop")
  if num_accepted is None:
    state = state.at[w_slots].set(h.astype(state.dtype), mode="drop")
  out = (jnp.moveaxis(outs, 0, 1), state)
  if intermediate_states is not None:
    out = out + (intermediate_states,)
  return out


def accept_draft_tokens(state, intermediate_states, state_indices, num_accepted):
  """Rolls each request's slot back to the state after its last accepted draft token.

  state[s] = intermediate_states[s, n_i - 1] for every request i with slot s = state_indices[i]
  in [0, S) and n_i in [1, D]; other slots are untouched. Twin of `gdp_jax.accept_draft_tokens`.

  Args:
    state: cache [S, HV, K, V].
    intermediate_states: [S, D, HV, K, V] snapshots from `gated_delta_product_decode`.
    state_indices: [N] int32 slots (-1 or out of range: padding), or None for slot i.
    num_accepted: [N] int, accepted draft tokens per request, in 1..D.

  Returns:
    The updated cache [S, HV, K, V] in state.dtype.
  """
  S, D = intermediate_states.shape[0], intermediate_states.shape[1]
  n = num_accepted.shape[0]
  slots = (jnp.arange(n, dtype=jnp.int32) if state_indices is None
           else state_indices.astype(jnp.int32))
  acc = num_accepted.astype(jnp.int32)
  live = (slots >= 0) & (slots < S) & (acc >= 1) & (acc <= D)
  # Gather with clipped indices and discard; scatter padding to row S, which "drop" discards.
  src = intermediate_states[jnp.clip(slots, 0, S - 1), jnp.clip(acc - 1, 0, D - 1)]
  return state.at[jnp.where(live, slots, S)].set(src.astype(state.dtype), mode="drop")


def commit_replay(state, replay_ring, state_indices, num_accepted, *, steps_per_token=1,
                  use_qk_l2norm_in_kernel=False):
  """Replays each request's accepted ring tokens into its slot. Twin of `gdp_jax.commit_replay`.

  Written as the masked recurrence over all R ring rows: rows at or past
  num_accepted[i] * steps_per_token leave the state as it was (as beta = 0 and g = 0 would).

  Args:
    state: cache [S, HV, K, V].
    replay_ring: (k [S, R, H, K], v [S, R, HV, V], g, beta); g [S, R, HV] (one decay per row)
      or [S, R // steps_per_token, HV] (one per draft token, on its first row) or None; beta
      [S, R, HV], [S, R, HV, V] or None (= 1).
    state_indices: [N] int32 slots (-1 or out of range: padding, untouched).
    num_accepted: [N] int, draft tokens to replay per request (clamped to 0..R // spt).
    steps_per_token: ring rows per draft token (M for Gated Delta Product).
    use_qk_l2norm_in_kernel: normalise the key rows first.

  Returns:
    The updated cache [S, HV, K, V] in state.dtype.
  """
  rk, rv, rg, rb = replay_ring
  S, HV = state.shape[0], state.shape[1]
  R, H = rk.shape[1], rk.shape[2]
  cdt = _compute_dtype(rv)
  slots = _slots(state_indices, num_accepted.shape[0])
  live = (slots >= 0) & (slots < S)
  at = jnp.clip(slots, 0, S - 1)
  rows = jnp.clip(num_accepted.astype(jnp.int32), 0, R // steps_per_token) * steps_per_token
  kf = rk[at].astype(cdt)                                       # [N, R, H, K]
  if use_qk_l2norm_in_kernel:
    kf = _l2norm(kf)
  kf = jnp.repeat(kf, HV // H, axis=2)                          # [N, R, HV, K]
  vf = rv[at].astype(cdt)
  h = state[at].astype(cdt)
  gf = None
  if rg is not None:
    gf = rg[at].astype(cdt)                                     # [N, R or R // spt, HV]
    if gf.shape[1] != R:
      # One decay per draft token, on its first row; the other rows decay by exp(0) = 1.
      gf = jnp.zeros((gf.shape[0], R, HV), cdt).at[:, ::steps_per_token].set(gf)
  bf = None if rb is None else rb[at].astype(cdt)

  # One lax.scan over the R rows (an unrolled chain took XLA's GPU compile minutes at R = 16).
  def row(h, x):
    r, gr, kr, vr, br = x
    h_new = h if gr is None else h * jnp.exp(gr)[:, :, None, None]
    delta = vr - jnp.einsum("nhkv,nhk->nhv", h_new, kr, precision=jax.lax.Precision.HIGHEST)
    if br is not None:
      delta = delta * (br[:, :, None] if br.ndim == 2 else br)
    h_new = h_new + kr[:, :, :, None] * delta[:, :, None, :]
    return jnp.where((r < rows)[:, None, None, None], h_new, h), None

  lead = lambda a: None if a is None else jnp.moveaxis(a, 1, 0)
  h, _ = jax.lax.scan(row, h, (jnp.arange(R), *map(lead, (gf, kf, vf, bf))))
  return state.at[jnp.where(live, slots, S)].set(h.astype(state.dtype), mode="drop")


def _push_ring(ring, state_indices, rows):
  """ring[slot] = this step's rows at the live slots (mode="drop" discards padding at row S)."""
  S = ring[0].shape[0]
  slots = _slots(state_indices, rows[0].shape[0])
  w = jnp.where((slots >= 0) & (slots < S), slots, S)
  return tuple(None if r is None else r.at[w].set(x.astype(r.dtype), mode="drop")
               for r, x in zip(ring, rows))


def _slots(state_indices, N):
  return (jnp.arange(N, dtype=jnp.int32) if state_indices is None
          else state_indices.astype(jnp.int32))
