"""The decode step: gated delta rule, walked token by token (docs/algorithm.md §6.1).

Per (sequence n, value head hv), starting from S = initial state, cache slot, or zeros:

    for each step t of the sequence:
        S *= exp(g_t)                              (natural log, no cumsum)
        d  = beta_t * (v_t - S^T k_t)              beta head-wise (scalar) or per V column
        S += k_t d^T
        o_t = S^T (scale * q_t)

Grid: one flat axis of NV * N * HV programs (CUDA caps axes 1 and 2 at 65535; N * HV reaches
that at N = 4096, HV = 16). Program i owns V-block i % NV of the [K, V] state of sequence
n = (i // NV) // HV, value head hv = (i // NV) % HV, for the whole walk: the state never leaves
registers between steps. Value head hv reads key/query head hv // (HV // H).

Gated Delta Product decode reaches this kernel by folding the M Householder copies into the
sequence (query on the last copy, decay on the first): STEPS_PER_TOKEN = M then tells where one
draft token ends, and a snapshot of the state is stored there for speculative rollback.

Speculative decoding without a rollback copy (HAS_NUM_ACCEPTED, docs/api.md): sequence i, whose
previous verify step kept n = num_accepted[i] draft tokens, starts from that step's snapshot
inter[slot, n-1] (n = 0: from the cache slot), and the cache slot is not written: the snapshots
are the state of record. The program reads its [K, BV] start tile before it stores any snapshot,
and no other program touches that tile, so reading and rewriting the snapshots in place is safe.

Speculative decoding by checkpoint and replay (HAS_REPLAY, docs/api.md): the cache slot is a
checkpoint, and a ring holds the previous step's NR recurrence-step inputs (k, v, g, beta) per
slot. Sequence i first replays the first num_accepted[i] * STEPS_PER_TOKEN ring rows of its slot
into the checkpoint (state updates only; the loop bound skips the rejected rows), stores the
result as the new checkpoint, then walks its T new steps storing outputs only: one state read
and at most one state write, whatever the draft length. Ring g holds one decay per
RING_G_STEPS rows (M for Gated Delta Product: one per draft token, on its first copy). The
kernel only reads the ring; the caller writes the new rows after it. T = 0 is the commit: the
replay and the checkpoint, no outputs. With BT > 0 (bfloat16 inputs, `replay_block_rows` in
gdp_jax/_configs.py) the T new steps' outputs come from the checkpoint in block form instead of
the token loop (`replay_new_tokens`): the replay and the checkpoint stay as they are.

Parameters are ordered inputs, outputs, constexprs (jax_triton.triton_call appends one pointer
per output after the inputs). Optional inputs arrive as placeholders switched off by a flag,
since triton_call cannot pass None. A buffer updated in place (the cache, the snapshots) comes
twice, as an input and as an output pointer: jax-triton 0.3.1 passes an aliased buffer that way,
and a torch launcher passes the same tensor twice.
"""
import triton
import triton.language as tl

from ._common import decode_program, l2norm_rows


@triton.jit
def fused_recurrent_fwd_kernel(
    # inputs
    q,              # [B, T, H, K]
    k,              # [B, T, H, K]
    v,              # [B, T, HV, V]
    g,              # [B, T, HV] float32 log decays                  (USE_G)
    beta,           # [B, T, HV] or [B, T, HV, V]                    (USE_BETA)
    h0,             # [N, HV, K, V] initial state                    (USE_INITIAL_STATE)
    state_in,       # [S, HV, K, V] cache                            (HAS_STATE)
    inter_in,       # [S, NI, HV, K, V] per-draft-token snapshots    (STORE_INTERMEDIATE)
    state_indices,  # [N] int32 cache slot per sequence               (HAS_STATE_INDICES)
    cu_seqlens,     # [N+1] int32 sequence starts, B == 1             (IS_VARLEN)
    num_accepted,   # [N] int32 draft tokens kept by the previous step   (HAS_NUM_ACCEPTED,
                    #                                                      HAS_REPLAY)
    ring_k,         # [S, NR, H, K] previous step's keys                  (HAS_REPLAY)
    ring_v,         # [S, NR, HV, V]                                      (HAS_REPLAY)
    ring_g,         # [S, NR // RING_G_STEPS, HV] log decays              (HAS_REPLAY, USE_G)
    ring_beta,      # [S, NR, HV] or [S, NR, HV, V]                       (HAS_REPLAY, USE_BETA)
    scale,          # float32
    T,              # tokens per sequence of the (packed) stream
    S,              # cache slots (of `state_in`, else of `inter_in`)
    # outputs
    o,              # [B, T, HV, V] in v.dtype
    ht,             # [N, HV, K, V] float32 final state             (STORE_FINAL_STATE)
    state_out,      # the cache again, updated at its slots          (HAS_STATE)
    inter_out,      # the snapshots again                            (STORE_INTERMEDIATE)
    # sizes
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    NI: tl.constexpr,
    NR: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    STEPS_PER_TOKEN: tl.constexpr,
    RING_G_STEPS: tl.constexpr,
    # flags
    USE_G: tl.constexpr,
    USE_BETA: tl.constexpr,
    IS_BETA_HEADWISE: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    STORE_FINAL_STATE: tl.constexpr,
    HAS_STATE: tl.constexpr,
    HAS_STATE_INDICES: tl.constexpr,
    STORE_INTERMEDIATE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    HAS_NUM_ACCEPTED: tl.constexpr,
    HAS_REPLAY: tl.constexpr,
    BT: tl.constexpr,       # > 0: the replay step's new tokens in block form, BT steps a block
    NC: tl.constexpr,       # blocks: cdiv(T, BT), 1 or 2
):
  i_v, i_n, i_hv, i_h = decode_program(triton.cdiv(V, BV), HV, H)

  # int64 throughout: a token offset times HV*V, or a slot times HV*K*V (S=1024, HV=32, K=128,
  # V=512 is already 2**31 cache elements), overflows int32.
  if IS_VARLEN:
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
  else:
    bos = i_n.to(tl.int64) * T
    eos = bos + T
  if HAS_STATE_INDICES:
    slot = tl.load(state_indices + i_n).to(tl.int64)
  else:
    slot = i_n.to(tl.int64)
  # A slot outside [0, S) is padding (-1 by convention): it must read and write nothing, and an
  # out-of-range index from a caller must not reach memory outside the cache.
  is_pad = (slot < 0) | (slot >= S)

  o_k = tl.arange(0, BK)
  o_v = i_v * BV + tl.arange(0, BV)
  mask_k = o_k < K
  mask_v = o_v < V
  mask_h = mask_k[:, None] & mask_v[None, :]
  p_kv = o_k[:, None] * V + o_v[None, :]  # offsets inside one [K, V] state

  if HAS_STATE or STORE_INTERMEDIATE:
    if is_pad:
      zero = tl.zeros([BV], dtype=tl.float32).to(o.dtype.element_ty)
      for s in range(0, eos - bos):
        tl.store(o + ((bos + s) * HV + i_hv) * V + o_v, zero, mask=mask_v)
      return

  b_h = tl.zeros([BK, BV], dtype=tl.float32)
  if HAS_STATE:
    p_state = (slot * HV + i_hv) * K * V + p_kv
    if HAS_REPLAY:
      b_h = tl.load(state_in + p_state, mask=mask_h, other=0.).to(tl.float32)
      # Clamped to 0..NR // STEPS_PER_TOKEN: a traced count out of range must not read outside
      # the ring.
      n_acc = tl.minimum(tl.maximum(tl.load(num_accepted + i_n).to(tl.int64), 0),
                         NR // STEPS_PER_TOKEN)
      # The token loop below without queries and outputs, over ring rows r of this slot.
      for s in range(0, n_acc * STEPS_PER_TOKEN):
        r = slot * NR + s
        b_k = tl.load(ring_k + (r * H + i_h) * K + o_k, mask=mask_k, other=0.).to(tl.float32)
        b_v = tl.load(ring_v + (r * HV + i_hv) * V + o_v, mask=mask_v, other=0.).to(tl.float32)
        if USE_QK_L2NORM:
          b_k = l2norm_rows(b_k)
        if USE_G:
          # Rows between two decays (the M - 1 later copies of a token) decay by exp(0) = 1.
          b_g = tl.load(ring_g + (slot * (NR // RING_G_STEPS) + s // RING_G_STEPS) * HV + i_hv)
          b_h *= tl.exp(tl.where(s % RING_G_STEPS == 0, b_g.to(tl.float32), 0.))
        b_v -= tl.sum(b_h * b_k[:, None], 0)
        if USE_BETA:
          if IS_BETA_HEADWISE:
            b_v *= tl.load(ring_beta + r * HV + i_hv).to(tl.float32)
          else:
            b_v *= tl.load(ring_beta + (r * HV + i_hv) * V + o_v, mask=mask_v,
                           other=0.).to(tl.float32)
        b_h += b_k[:, None] * b_v[None, :]
      if n_acc > 0:
        tl.store(state_out + p_state, b_h.to(state_out.dtype.element_ty), mask=mask_h)
        # The new tokens start from the checkpoint as stored, so that this step equals the
        # commit followed by a plain step bit for bit, whatever the cache dtype.
        b_h = b_h.to(state_out.dtype.element_ty).to(tl.float32)
    elif HAS_NUM_ACCEPTED:
      # Clamped to 0..NI: a traced count out of range must not read outside the snapshots.
      n_acc = tl.minimum(tl.maximum(tl.load(num_accepted + i_n).to(tl.int64), 0), NI)
      if n_acc > 0:
        p_acc = ((slot * NI + n_acc - 1) * HV + i_hv) * K * V + p_kv
        b_h = tl.load(inter_in + p_acc, mask=mask_h, other=0.).to(tl.float32)
      else:
        b_h = tl.load(state_in + p_state, mask=mask_h, other=0.).to(tl.float32)
    else:
      b_h = tl.load(state_in + p_state, mask=mask_h, other=0.).to(tl.float32)
  elif USE_INITIAL_STATE:
    b_h = tl.load(h0 + (i_n.to(tl.int64) * HV + i_hv) * K * V + p_kv, mask=mask_h,
                  other=0.).to(tl.float32)

  if BT > 0:
    replay_new_tokens(b_h, q, k, v, g, beta, o, bos, T, scale, i_h, i_hv, o_k, o_v, mask_k,
                      mask_v, H, HV, K, V, BT, NC, USE_G, USE_BETA, IS_BETA_HEADWISE,
                      USE_QK_L2NORM)
    return

  for s in range(0, eos - bos):
    t = bos + s
    b_q = tl.load(q + (t * H + i_h) * K + o_k, mask=mask_k, other=0.).to(tl.float32)
    b_k = tl.load(k + (t * H + i_h) * K + o_k, mask=mask_k, other=0.).to(tl.float32)
    b_v = tl.load(v + (t * HV + i_hv) * V + o_v, mask=mask_v, other=0.).to(tl.float32)
    if USE_QK_L2NORM:
      b_q = l2norm_rows(b_q)
      b_k = l2norm_rows(b_k)
    b_q = b_q * scale
    if USE_G:
      b_h *= tl.exp(tl.load(g + t * HV + i_hv).to(tl.float32))
    b_v -= tl.sum(b_h * b_k[:, None], 0)
    if USE_BETA:
      if IS_BETA_HEADWISE:
        b_v *= tl.load(beta + t * HV + i_hv).to(tl.float32)
      else:
        b_v *= tl.load(beta + (t * HV + i_hv) * V + o_v, mask=mask_v, other=0.).to(tl.float32)
    b_h += b_k[:, None] * b_v[None, :]
    b_o = tl.sum(b_h * b_q[:, None], 0)
    tl.store(o + (t * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=mask_v)
    if STORE_INTERMEDIATE:
      # After the last of a draft token's STEPS_PER_TOKEN steps; the mask, not a branch, keeps the
      # loop body uniform.
      i_tok = (s + 1) // STEPS_PER_TOKEN - 1
      p_int = ((slot * NI + i_tok) * HV + i_hv) * K * V + p_kv
      tl.store(inter_out + p_int, b_h.to(inter_out.dtype.element_ty),
               mask=mask_h & ((s + 1) % STEPS_PER_TOKEN == 0))

  if HAS_STATE:
    # With num_accepted the last snapshot is the state after the step; with the replay the
    # checkpoint was stored before the new tokens.
    if not (HAS_NUM_ACCEPTED or HAS_REPLAY):
      tl.store(state_out + p_state, b_h.to(state_out.dtype.element_ty), mask=mask_h)
  elif STORE_FINAL_STATE:
    tl.store(ht + (i_n.to(tl.int64) * HV + i_hv) * K * V + p_kv, b_h, mask=mask_h)


@triton.jit
def replay_new_tokens(b_h, q, k, v, g, beta, o, bos, T, scale, i_h, i_hv, o_k, o_v, mask_k,
                      mask_v, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, BT: tl.constexpr, NC: tl.constexpr, USE_G: tl.constexpr,
                      USE_BETA: tl.constexpr, IS_BETA_HEADWISE: tl.constexpr,
                      USE_QK_L2NORM: tl.constexpr):
  """The outputs of the replay step's T new steps from the checkpoint b_h, in block (WY) form
  (docs/algorithm.md §13.4), in NC blocks of BT steps (NC = 1 or 2): no state after the
  checkpoint is needed, so only a [2 BT, BV] forward substitution per block is serial, and the
  products over K run on bfloat16 tensor cores. S0 = b_h rounded to bfloat16 once: the outputs
  leave in bfloat16, and the checkpoint was stored from b_h before this."""
  b_s = b_h.to(tl.bfloat16)
  b_d, b_r, b_gc, g_end = replay_block(
      b_s, q, k, v, g, beta, o, bos, 0, tl.minimum(T, BT), scale, i_h, i_hv, o_k, o_v, mask_k,
      mask_v, None, None, None, 0., H, HV, K, V, BT, False, USE_G, USE_BETA, IS_BETA_HEADWISE,
      USE_QK_L2NORM)
  if NC > 1:
    replay_block(b_s, q, k, v, g, beta, o, bos, BT, T - BT, scale, i_h, i_hv, o_k, o_v, mask_k,
                 mask_v, b_d, b_r, b_gc, g_end, H, HV, K, V, BT, True, USE_G, USE_BETA,
                 IS_BETA_HEADWISE, USE_QK_L2NORM)


@triton.jit
def replay_block(b_s, q, k, v, g, beta, o, bos, c0, n, scale, i_h, i_hv, o_k, o_v, mask_k,
                 mask_v, b_dp, b_rp, b_gp, g0, H: tl.constexpr, HV: tl.constexpr,
                 K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, HAS_PREV: tl.constexpr,
                 USE_G: tl.constexpr, USE_BETA: tl.constexpr, IS_BETA_HEADWISE: tl.constexpr,
                 USE_QK_L2NORM: tl.constexpr):
  """Steps c0 .. c0+n-1 (n <= BT) of the new tokens from the checkpoint S0 = b_s (bfloat16).

  With G_s the inclusive cumsum of g from the first new step and c_sr = exp(G_s - G_r), the
  token loop's
  d_s = beta_s (v_s - exp(G_s) S0^T k_s - sum_{r<s} c_sr (k_s.k_r) d_r),
  o_s = scale (exp(G_s) S0^T q_s + sum_{r<=s} c_sr (q_s.k_r) d_r).
  Rows i of the [2 BT] block W: i < BT is step c0+i's key, BT + s is step c0+s's query; past
  n, zero. W S0 and W W^T are bfloat16 dots (float32 accumulation). HAS_PREV: the steps r
  before c0 are the previous block's, whose d_r (b_dp, key rows), key norms (b_rp) and G_r
  (b_gp) it returned; g0 is its G at its end. Returns the same for this block.
  """
  o_i = tl.arange(0, 2 * BT)
  o_j = tl.arange(0, 2 * BT)
  s_i = o_i % BT
  is_k = o_i < BT
  live = s_i < n
  t_i = bos + c0 + s_i
  p_w = (t_i * H + i_h)[:, None] * K + o_k[None, :]
  m_w = live[:, None] & mask_k[None, :]
  b_w = tl.where(is_k[:, None], tl.load(k + p_w, mask=m_w & is_k[:, None], other=0.),
                 tl.load(q + p_w, mask=m_w & ~is_k[:, None], other=0.))
  b_x = tl.dot(b_w, b_s)                              # [2 BT, BV]: S0^T k_s, S0^T q_s
  b_a = tl.dot(b_w, tl.trans(b_w))                    # [2 BT, 2 BT]: k_s.k_r, q_s.k_r
  b_r = tl.full([2 * BT], 1., tl.float32)
  if USE_QK_L2NORM:
    # The rows' norms from the diagonal of the Gram matrix, applied to the products: a float32
    # copy of W to normalise cost 15 registers (143 against 128, sm_90), and the dots keep
    # the inputs' own bits.
    diag = o_i[:, None] == o_j[None, :]
    r_i = 1. / tl.sqrt(tl.sum(tl.where(diag, b_a, 0.), 1) + 1e-6)
    b_r = 1. / tl.sqrt(tl.sum(tl.where(diag, b_a, 0.), 0) + 1e-6)
    b_x *= r_i[:, None]
    b_a *= r_i[:, None] * b_r[None, :]

  # G_i: the decays of the new steps up to c0 + s_i, summed over the key rows.
  b_gk = tl.zeros([2 * BT], dtype=tl.float32)
  if USE_G:
    b_gk = tl.load(g + (bos + c0 + o_j) * HV + i_hv, mask=o_j < n, other=0.)
  b_gc = g0 + tl.sum(tl.where(o_j[None, :] <= s_i[:, None], b_gk[None, :], 0.), 1)
  # Row i takes key column r < s_i (a key row) or r <= s_i (a query row); key rows enter with
  # a minus sign (the residual), query rows with the scale.
  causal = o_j[None, :] < tl.where(is_k, s_i, s_i + 1)[:, None]
  f_i = tl.where(is_k, -1., scale)
  b_c = tl.where(causal, f_i[:, None] * tl.exp(tl.where(causal, b_gc[:, None] - b_gc[None, :],
                                                        0.)) * b_a, 0.)
  # U starts as v_s - exp(G_s) S0^T k_s (key rows) and scale exp(G_s) S0^T q_s (query rows);
  # step s reads d_s = beta_s U[s], final once the steps r < s are in, and adds C[:, s] d_s.
  p_v = (t_i * HV + i_hv)[:, None] * V + o_v[None, :]
  m_v = (is_k & live)[:, None] & mask_v[None, :]
  b_u = tl.load(v + p_v, mask=m_v, other=0.).to(tl.float32)
  b_u += (f_i * tl.exp(b_gc))[:, None] * b_x
  if HAS_PREV:
    # The previous block's steps r, all before this block's: their keys reloaded (a Gram
    # block against this block's rows), their d_r added column by column.
    p_p = ((bos + c0 - BT + s_i) * H + i_h)[:, None] * K + o_k[None, :]
    b_wp = tl.load(k + p_p, mask=is_k[:, None] & mask_k[None, :], other=0.)
    b_ap = tl.dot(b_w, tl.trans(b_wp))
    if USE_QK_L2NORM:
      b_ap *= r_i[:, None] * b_rp[None, :]
    b_cp = f_i[:, None] * tl.exp(tl.where(o_j[None, :] < BT, b_gc[:, None] - b_gp[None, :],
                                          0.)) * b_ap
    for r in tl.static_range(BT):
      b_dr = tl.sum(tl.where(o_i[:, None] == r, b_dp, 0.), 0)
      b_u += tl.sum(tl.where(o_j[None, :] == r, b_cp, 0.), 1)[:, None] * b_dr[None, :]
  if USE_BETA:
    if IS_BETA_HEADWISE:
      b_b = tl.load(beta + t_i * HV + i_hv, mask=is_k & live, other=0.).to(tl.float32)[:, None]
    else:
      b_b = tl.load(beta + p_v, mask=m_v, other=0.).to(tl.float32)
  for s in range(0, n):
    row = o_i[:, None] == s
    if USE_BETA:
      b_d = tl.sum(tl.where(row, b_b * b_u, 0.), 0)
    else:
      b_d = tl.sum(tl.where(row, b_u, 0.), 0)
    b_cs = tl.sum(tl.where(o_j[None, :] == s, b_c, 0.), 1)
    b_u += b_cs[:, None] * b_d[None, :]
  tl.store(o + p_v, b_u.to(o.dtype.element_ty),
           mask=(~is_k & live)[:, None] & mask_v[None, :])
  if USE_BETA:
    b_u *= b_b
  return tl.where(is_k[:, None], b_u, 0.), b_r, b_gc, g0 + tl.sum(b_gk, 0)
