"""Chunked (WY) reference of the Gated Delta Product prefill.

The prefill runs Gated DeltaNet on the Householder-expanded stream (docs/algorithm.md §4): per
expanded chunk of 64 rows, with chunk-local cumulative log-decays Gx (the decay of token t sits
on its copy 0),

    A  = strict_lower(beta_a <k_a, k_b> exp(Gx_a - Gx_b))
    u  = (I + A)^-1 (beta V),   w = (I + A)^-1 (beta exp(Gx) K)
    D  = u - w S0               (the per-row deltas, v_new)
    S1 = exp(Gx_last) S0 + sum_r exp(Gx_last - Gx_r) k_r d_r^T

then reads out on the token stream per 64-token chunk c, from the checkpoint S_c (the state
after expanded chunk cM), with the INCLUSIVE causal mask over the M copies of each token.
Natural logs throughout (the kernels' base 2 is a speed detail). Everything is computed in
promote_types(v.dtype, float32). This module shares no recurrence code with recurrent.py.
"""
import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular

from gdp_jax._common import BT, chunk_descriptors, chunk_offsets

_HI = jax.lax.Precision.HIGHEST


def _l2norm(x):
  return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def chunk_gated_delta_product(q, k, v, g=None, beta=None, *, num_householder, scale=None,
                              initial_state=None, output_final_state=False,
                              use_qk_l2norm_in_kernel=False, cu_seqlens=None, state=None,
                              state_indices=None, return_chunk_states=False,
                              chunk_states_dtype=None):
  """Gated Delta Product prefill in the chunked WY form; same contract as the scan reference.

  Args:
    q: queries [B, T, H, K].
    k: keys of the Householder-expanded stream [B, T*M, H, K]; token t owns rows t*M .. t*M+M-1.
    v: values [B, T*M, HV, V].
    g: natural-log decays [B, T, HV], or None.
    beta: [B, T*M, HV], or None (= 1).
    num_householder: M.
    scale: query scale, default K ** -0.5.
    initial_state: [N, HV, K, V], any float dtype, or None (zeros).
    output_final_state: return the dense final state [N, HV, K, V] (float32, float64 under
      float64 inputs).
    use_qk_l2norm_in_kernel: normalise q and k rows as x / sqrt(sum(x^2) + 1e-6) first.
    cu_seqlens: [N+1] int32 token boundaries of packed sequences (B == 1), or None.
    state: cache [S, HV, K, V] read and written at state_indices[n] (n when None); a slot
      outside [0, S) reads zeros, writes nothing, gets o = 0 and zero chunk_states rows.
    state_indices: [N] int32 slots, or None.
    return_chunk_states: also return the states entering every 64-token chunk.
    chunk_states_dtype: their dtype; default the cache dtype, else initial_state's, else k's.

  Returns:
    (o [B, T, HV, V] in v.dtype, final_state), plus chunk_states last when
    return_chunk_states: [B, ceil(T/64), HV, K, V] dense, [min(T, T//64 + N), HV, K, V] with
    cu_seqlens (row chunk_offsets(cu_seqlens)[n] + c; rows past chunk_offsets[N] are 0).
  """
  M = num_householder
  B, T, H, K = q.shape
  HV, V = v.shape[2], v.shape[3]
  G = HV // H
  cdt = jnp.promote_types(v.dtype, jnp.float32)
  scale = K ** -0.5 if scale is None else scale
  dense = cu_seqlens is None
  cu = (jnp.arange(B + 1, dtype=jnp.int32) * T if dense
        else jnp.asarray(cu_seqlens).astype(jnp.int32))
  N = cu.shape[0] - 1
  TT = B * T          # packed token length
  R = TT * M          # packed expanded length
  use_g = g is not None

  qf = q.reshape(TT, H, K).astype(cdt)
  kf = k.reshape(R, H, K).astype(cdt)
  if use_qk_l2norm_in_kernel:
    qf = _l2norm(qf)
    kf = _l2norm(kf)
  qf = jnp.repeat(qf, G, axis=1) * jnp.asarray(scale, cdt)     # [TT, HV, K]
  kf = jnp.repeat(kf, G, axis=1)                                # [R, HV, K]
  vf = v.reshape(R, HV, V).astype(cdt)
  bf = jnp.ones((R, HV), cdt) if beta is None else beta.reshape(R, HV).astype(cdt)
  gf = g.reshape(TT, HV).astype(cdt) if use_g else None

  # Slots and padding per sequence.
  if state is not None:
    n_slots = state.shape[0]
    slots = (jnp.arange(N, dtype=jnp.int32) if state_indices is None
             else state_indices.astype(jnp.int32))
  else:
    n_slots = N
    slots = jnp.arange(N, dtype=jnp.int32)
  live_seq = (slots >= 0) & (slots < n_slots)
  if state is not None:
    s0_all = state[jnp.clip(slots, 0, n_slots - 1)].astype(cdt)
  elif initial_state is not None:
    s0_all = initial_state.astype(cdt)
  else:
    s0_all = jnp.zeros((N, HV, K, V), cdt)
  s0_all = jnp.where(live_seq[:, None, None, None], s0_all, 0)

  # ---- expanded stream: per-chunk WY factors (stages 1b to 4) ----
  cux = M * cu
  nx = min(R, R // BT + N)
  dx = chunk_descriptors(cux, nx)
  sx = jnp.clip(dx[:, 0], 0, N - 1)
  lx = dx[:, 1]
  a = jnp.arange(BT, dtype=jnp.int32)
  rows = (cux[sx] + BT * lx)[:, None] + a[None, :]                   # [nx, 64]
  rvalid = (dx[:, 0] >= 0)[:, None] & (rows < cux[sx + 1][:, None])
  rows_c = jnp.where(rvalid, rows, 0)
  m3 = rvalid[:, :, None]
  Kx = jnp.where(m3[..., None], kf[rows_c], 0).transpose(0, 2, 1, 3)   # [nx, HV, 64, K]
  Vx = jnp.where(m3[..., None], vf[rows_c], 0).transpose(0, 2, 1, 3)   # [nx, HV, 64, V]
  Bx = jnp.where(m3, bf[rows_c], 0).transpose(0, 2, 1)                 # [nx, HV, 64]
  if use_g:
    # The decay of token t sits on its copy 0 (row t*M): M*cu keeps row % M == copy index.
    first = rvalid & (rows % M == 0)
    gx = jnp.where(first[:, :, None], gf[rows_c // M], 0).transpose(0, 2, 1)
    Gx = jnp.cumsum(gx, axis=-1)                                       # [nx, HV, 64]
  else:
    Gx = jnp.zeros((nx, HV, BT), cdt)

  vmask = rvalid[:, None, :]
  strict = (a[:, None] > a[None, :])[None, None] & vmask[..., :, None] & vmask[..., None, :]
  kk = jnp.einsum("nhak,nhbk->nhab", Kx, Kx, precision=_HI)
  # Select, not multiply: above the diagonal exp(Gx_a - Gx_b) can overflow.
  A = jnp.where(strict, Bx[..., :, None] * kk * jnp.exp(Gx[..., :, None] - Gx[..., None, :]), 0)
  eye = jnp.eye(BT, dtype=cdt)
  Ai = solve_triangular(eye + A, jnp.broadcast_to(eye, A.shape), lower=True,
                        unit_diagonal=True)
  U = jnp.einsum("nhab,nhbv->nhav", Ai, Bx[..., None] * Vx, precision=_HI)
  W = jnp.einsum("nhab,nhbk->nhak", Ai, (Bx * jnp.exp(Gx))[..., None] * Kx, precision=_HI)

  # ---- stage 5: state scan over expanded chunks, checkpoints every M chunks ----
  offs = chunk_offsets(cu)
  nc = min(TT, TT // BT + N)
  lens_x = cux[1:] - cux[:-1]
  nx_seq = (lens_x + BT - 1) // BT                  # expanded chunks per sequence
  h_buf = jnp.zeros((nc, HV, K, V), cdt)
  if state is not None:
    fin, fin_idx = state, jnp.where(live_seq, slots, n_slots)
  elif output_final_state:
    fin, fin_idx = s0_all, jnp.arange(N, dtype=jnp.int32)
  else:
    fin, fin_idx = None, None

  def chunk_step(carry, x):
    S, h_buf, fin = carry
    seq, loc, w, u, kx, gxc, rv = x
    ok = seq >= 0
    sc = jnp.clip(seq, 0, N - 1)
    live = ok & live_seq[sc]
    S = jnp.where(loc == 0, s0_all[sc], S)
    ck = jnp.where(live & (loc % M == 0), offs[sc] + loc // M, nc)
    h_buf = h_buf.at[ck].set(S, mode="drop")
    dlt = u - jnp.einsum("hak,hkv->hav", w, S, precision=_HI)            # v_new rows
    if use_g:
      last = gxc[:, -1]             # invalid rows carry zero decay, so the last entry is the total
      dec = jnp.where(rv[None, :], jnp.exp(last[:, None] - gxc), 0)
      S = jnp.exp(last)[:, None, None] * S
      upd = dlt * dec[..., None]
    else:
      upd = dlt
    S = S + jnp.einsum("hak,hav->hkv", kx, upd, precision=_HI)
    if fin is not None:
      f = jnp.where(ok & (loc == nx_seq[sc] - 1), fin_idx[sc], fin.shape[0])
      fin = fin.at[f].set(S.astype(fin.dtype), mode="drop")
    return (S, h_buf, fin), dlt

  S_init = jnp.zeros((HV, K, V), cdt)
  (_, h_buf, fin), vnew = jax.lax.scan(
      chunk_step, (S_init, h_buf, fin), (dx[:, 0], lx, W, U, Kx, Gx, rvalid))
  # Back to the row layout, so the token stage can pick copy j of token t at row t*M + j.
  vnew_rows = jnp.zeros((R, HV, V), cdt).at[jnp.where(rvalid, rows, R)].set(
      vnew.transpose(0, 2, 1, 3), mode="drop")

  # ---- stage 6: output on the token stream ----
  dt_ = chunk_descriptors(cu, nc)
  st = jnp.clip(dt_[:, 0], 0, N - 1)
  toks = (cu[st] + BT * dt_[:, 1])[:, None] + a[None, :]                # [nc, 64]
  tvalid = (dt_[:, 0] >= 0)[:, None] & (toks < cu[st + 1][:, None])
  toks_c = jnp.where(tvalid, toks, 0)
  Q = jnp.where(tvalid[:, :, None, None], qf[toks_c], 0).transpose(0, 2, 1, 3)  # [nc, HV, 64, K]
  if use_g:
    Gu = jnp.cumsum(jnp.where(tvalid[:, :, None], gf[toks_c], 0), axis=1).transpose(0, 2, 1)
  else:
    Gu = jnp.zeros((nc, HV, BT), cdt)
  tmask = tvalid[:, None, :]
  incl = (a[:, None] >= a[None, :])[None, None] & tmask[..., :, None] & tmask[..., None, :]
  dec = jnp.where(incl, jnp.exp(Gu[..., :, None] - Gu[..., None, :]), 0)
  # Descriptor j is row j of h_buf: both lists are the chunks in sequence order.
  acc = jnp.einsum("nhak,nhkv->nhav", Q, h_buf, precision=_HI) * jnp.exp(Gu)[..., None]
  for j in range(M):
    r = M * toks_c + j
    Kj = jnp.where(tvalid[:, :, None, None], kf[r], 0).transpose(0, 2, 1, 3)
    Dj = jnp.where(tvalid[:, :, None, None], vnew_rows[r], 0).transpose(0, 2, 1, 3)
    P = jnp.einsum("nhak,nhbk->nhab", Q, Kj, precision=_HI) * dec
    acc = acc + jnp.einsum("nhab,nhbv->nhav", P, Dj, precision=_HI)
  out_ok = tvalid & live_seq[st][:, None]
  o = jnp.zeros((TT, HV, V), v.dtype).at[jnp.where(out_ok, toks, TT)].set(
      acc.transpose(0, 2, 1, 3).astype(v.dtype), mode="drop")

  out = (o.reshape(B, T, HV, V), fin)
  if return_chunk_states:
    if chunk_states_dtype is not None:
      cs_dtype = jnp.dtype(chunk_states_dtype)
    elif state is not None:
      cs_dtype = state.dtype
    elif initial_state is not None:
      cs_dtype = initial_state.dtype
    else:
      cs_dtype = k.dtype
    cs = h_buf.astype(cs_dtype)
    if dense:
      ncd = -(-T // BT)
      cs = cs[:B * ncd].reshape(B, ncd, HV, K, V)
    out = out + (cs,)
  return out
