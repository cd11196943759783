"""Stages 4 and 5 of the chunked prefill: the inter-chunk state scan (h, v_new, final state),
with each chunk's WY factors formed in place.

One program carries the [K, BV] column slice of the state S of one sequence and one value head
in float32 registers, as up to four 64 x BV tiles (tiles past ceil(K/64) are compiled out; this
layout is why K <= 256), and sweeps the sequence's NX expanded chunks in order
(docs/algorithm.md §4.6, §4.7):

    S = S0 slice (zeros without an initial state, or for a padding slot)
    for e in 0..NX-1:              (one piece's chunks, below)
        if e % M == 0:  h[chunk_offset + e / M] = S        # entering state of token chunk e/M
        D = Ai @ (diag(beta) V[rows] - diag(beta 2^Gx rk) (K[rows] @ S))  # v_new = u - w S,
                                                                           # before any decay
        if USE_G:  D *= 2^(Gx_last - Gx[rows]);  S *= 2^Gx_last
        S += K[rows]^T @ D
    final state = S

D is stage 4's u - w S regrouped (w S = Ai diag(beta 2^Gx rk) K S): one [64, K] x [K, BV]
product with the keys and one [64, 64] x [64, BV] product with Ai, the key tiles loaded once for
K S and K^T D, so w and u are never written and read back (2.1 GB at B=8 T=4096 H=32). The
operand of the Ai product is formed in float32 and rounded to the input dtype, as a separate
stage 4 would round its own (one rounding fewer than w and u stored, then multiplied). The
price is a third dependent product in each chunk's chain (docs/performance.md).

The dots take Ai, K and the state in the input dtype and accumulate in float32. The checkpoint
is written in the dtype of `h` (read back by stage 6) and, with STORE_SNAPSHOT, again in the
dtype of `h_snap` (the caller's chunk_states dtype, when stage 6 cannot read that one without
losing bits).

The initial state comes from `h0` and the final state goes to `ht`: either a dense initial
state [N, HV, K, V] and a dense float32 final state, both at row n, or the state cache
[S, HV, K, V], passed twice by the caller (as `h0`, the input, and as `ht`, the aliased output),
at row state_indices[n]. A slot outside [0, S) is padding: the program reads nothing, writes no
final state, writes zero checkpoints and skips the scan (its v_new rows are left unwritten; stage
6 zeroes the output of such a sequence without reading them).

A long sequence is walked in pieces that run in parallel (docs/algorithm.md §13.3): piece p of
a sequence of NX expanded chunks covers chunks [p L, min((p+1) L, NX)), L = `piece`, a fixed
length, so the pieces follow from the sequence's own length and never from the batch; a
sequence of at most L chunks (an empty one too) is one piece, walked from S0 exactly as above.
Programs are laid out by a list of (sequence, piece) rows built by the caller. The walk is
affine in S, so three launches give every piece its entering state:

    SUMMARY: for every piece but a sequence's last, [M_p | E_p] (K x (K+V), float32) with
             S_out = M_p S_in + E_p: column blocks 0 .. ceil(K/BV)-1 walk the columns of the
             identity with the values off (M_p), the others walk V columns from zero (E_p);
             nothing else is written;
    chunk_h_chain_kernel: S_in(0) = S0, S_in(p+1) = M_p S_in(p) + E_p, in piece order;
    the walk: each piece of a split sequence from its S_in(p) (piece 0 too: the last piece
             writes the cache slot S0 came from), writing its own checkpoints and v_new rows,
             and the last piece the final state.

Grid: (NP * HV * NC,), NC = ceil(V / BV) column blocks (with SUMMARY ceil(K / BV) +
ceil(V / BV)), NP the rows of the piece list. Program i owns list row i // (HV NC), column block
(i // HV) % NC (columns BV times that onwards) and value head i % HV; a row past the list's
count returns at once. The GPU issues programs in index order, so the caller lists the pieces
longest first: with mixed lengths (packed batches) in more programs than the SMs hold at once,
short pieces then fill the last wave instead of long ones starting late (docs/performance.md,
stage 5). A list row carries the piece's row in h_start and summary, which stay in sequence
order for the chain kernel; the order changes no program's arithmetic.

Parameter order: inputs, outputs, constexprs.
"""
import triton
import triton.language as tl


@triton.jit
def _load_tile(p, i_t, o_k, o_v, mask_v, K: tl.constexpr, V: tl.constexpr):
  """Rows 64*i_t .. 64*i_t + 63 of a [K, V] state at p, float32, zeros past K."""
  o = i_t * 64 + o_k
  return tl.load(p + o[:, None] * V + o_v[None, :], mask=(o < K)[:, None] & mask_v[None, :],
                 other=0.).to(tl.float32)


@triton.jit
def _load_state(p, o_k, o_v, mask_v, K: tl.constexpr, V: tl.constexpr):
  """The [K, BV] slice of a [K, V] state at p as four 64-row float32 tiles (those past K are
  zeros and compiled out of every use)."""
  b_h1 = _load_tile(p, 0, o_k, o_v, mask_v, K, V)
  b_h2 = tl.zeros_like(b_h1)
  b_h3 = tl.zeros_like(b_h1)
  b_h4 = tl.zeros_like(b_h1)
  if K > 64:
    b_h2 = _load_tile(p, 1, o_k, o_v, mask_v, K, V)
  if K > 128:
    b_h3 = _load_tile(p, 2, o_k, o_v, mask_v, K, V)
  if K > 192:
    b_h4 = _load_tile(p, 3, o_k, o_v, mask_v, K, V)
  return b_h1, b_h2, b_h3, b_h4


@triton.jit
def _store_tile(p, b_h, i_t, o_k, o_v, mask_v, K: tl.constexpr, V: tl.constexpr):
  o = i_t * 64 + o_k
  tl.store(p + o[:, None] * V + o_v[None, :], b_h.to(p.dtype.element_ty),
           mask=(o < K)[:, None] & mask_v[None, :])


@triton.jit
def _store_state(p, b_h1, b_h2, b_h3, b_h4, o_k, o_v, mask_v, K: tl.constexpr, V: tl.constexpr):
  _store_tile(p, b_h1, 0, o_k, o_v, mask_v, K, V)
  if K > 64:
    _store_tile(p, b_h2, 1, o_k, o_v, mask_v, K, V)
  if K > 128:
    _store_tile(p, b_h3, 2, o_k, o_v, mask_v, K, V)
  if K > 192:
    _store_tile(p, b_h4, 3, o_k, o_v, mask_v, K, V)


@triton.jit
def _row_tile(p, row, mask_r, i_t, o_k, STRIDE: tl.constexpr, K: tl.constexpr):
  """[BT, 64] slice (columns 64*i_t ..) of the rows `row` of a row-major [*, STRIDE] array."""
  o = i_t * 64 + o_k
  return tl.load(p + row[:, None] * STRIDE + o[None, :], mask=mask_r[:, None] & (o < K)[None, :],
                 other=0.)


@triton.jit
def _rows_dot_state(p, row, mask_r, b_h1, b_h2, b_h3, b_h4, o_k, STRIDE: tl.constexpr,
                    K: tl.constexpr, DOT_PRECISION: tl.constexpr):
  """Rows `row` of a row-major [*, STRIDE] array (their first K columns) times the [K, BV] state
  held as 64-row tiles, the state rounded to the rows' dtype: [BT, BV] float32; and the row
  tiles themselves, which the scan uses again for K^T D (tiles past K are the first one again,
  never read)."""
  b_x1 = _row_tile(p, row, mask_r, 0, o_k, STRIDE, K)
  acc = tl.dot(b_x1, b_h1.to(b_x1.dtype), input_precision=DOT_PRECISION)
  b_x2 = b_x1
  b_x3 = b_x1
  b_x4 = b_x1
  if K > 64:
    b_x2 = _row_tile(p, row, mask_r, 1, o_k, STRIDE, K)
    acc += tl.dot(b_x2, b_h2.to(b_x2.dtype), input_precision=DOT_PRECISION)
  if K > 128:
    b_x3 = _row_tile(p, row, mask_r, 2, o_k, STRIDE, K)
    acc += tl.dot(b_x3, b_h3.to(b_x3.dtype), input_precision=DOT_PRECISION)
  if K > 192:
    b_x4 = _row_tile(p, row, mask_r, 3, o_k, STRIDE, K)
    acc += tl.dot(b_x4, b_h4.to(b_x4.dtype), input_precision=DOT_PRECISION)
  return acc, b_x1, b_x2, b_x3, b_x4



@triton.jit
def _zero_state(i_v, V: tl.constexpr, BV: tl.constexpr):
  """Column block i_v of a [K, V] state at zero: o_k (the rows of a 64-row tile), o_v and
  mask_v (the block's columns), and four 64 x BV float32 zero tiles (those past K are compiled
  out of every use)."""
  o_k = tl.arange(0, 64)
  o_v = i_v * BV + tl.arange(0, BV)
  mask_v = o_v < V
  b_h1 = tl.zeros([64, BV], dtype=tl.float32)
  b_h2 = tl.zeros([64, BV], dtype=tl.float32)
  b_h3 = tl.zeros([64, BV], dtype=tl.float32)
  b_h4 = tl.zeros([64, BV], dtype=tl.float32)
  return o_k, o_v, mask_v, b_h1, b_h2, b_h3, b_h4


@triton.jit
def _identity_tile(i_t, o_k, o_v, mask_v):
  """Rows 64*i_t .. 64*i_t + 63 of the identity, columns o_v (zeros where mask_v is off)."""
  o = i_t * 64 + o_k
  return tl.where((o[:, None] == o_v[None, :]) & mask_v[None, :], 1., 0.)


@triton.jit
def _summary_columns(i_v, o_k, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
  """The columns of column block i_v of a split scan's summary (docs/algorithm.md §13.3), which
  walks [I | 0] through a piece to get its affine map [M | E] (K x (K+V)): blocks
  0 .. ceil(K/BV)-1 carry columns of M (K of them), started from the identity and walked without
  the chunks' own terms; the blocks after them carry columns of E (V of them), started from zero
  and walked with those terms. Both scans use it: the forward's terms are the values, the
  backward's q~, do~ and P^T do~.

  Returns local (a block of E), o_v (its columns within M or E), mask_v (the columns that
  exist), mask_l (the columns that take the chunks' own terms) and the state's four 64-row
  float32 tiles at the start (tiles past K are zeros, compiled out of every use)."""
  # The scalar flag enters the masks as a bound (the interpreter mistypes a block mask & a
  # scalar one).
  NKB: tl.constexpr = (K + BV - 1) // BV
  local = i_v >= NKB
  o_v = tl.where(local, i_v - NKB, i_v) * BV + tl.arange(0, BV)
  mask_v = o_v < tl.where(local, V, K)
  mask_l = o_v < tl.where(local, V, 0)
  mask_i = o_v < tl.where(local, 0, K)
  b_h1 = _identity_tile(0, o_k, o_v, mask_i)
  b_h2 = tl.zeros_like(b_h1)
  b_h3 = tl.zeros_like(b_h1)
  b_h4 = tl.zeros_like(b_h1)
  if K > 64:
    b_h2 = _identity_tile(1, o_k, o_v, mask_i)
  if K > 128:
    b_h3 = _identity_tile(2, o_k, o_v, mask_i)
  if K > 192:
    b_h4 = _identity_tile(3, o_k, o_v, mask_i)
  return local, o_v, mask_v, mask_l, b_h1, b_h2, b_h3, b_h4


@triton.jit
def chunk_h_fwd_kernel(
    # inputs
    k,              # [T*M, H, K] expanded-stream keys
    g_cum,          # [T*M, HV] float32 Gx (log2 units); a placeholder when USE_G is False
    h0,             # [N, HV, K, V] initial state, or [S, HV, K, V] cache; placeholder if unused
    state_indices,  # [N] int32 slot per sequence; a placeholder without HAS_STATE_INDICES
    cu_seqlens,     # [N+1] int32 token-stream sequence starts
    chunk_offsets,  # [N+1] int32 first row of each sequence in h
    pieces,         # [NP, 3] int32 (sequence, piece, row in h_start and summary) in launch
                    # order; (-1, 0, row) past the end
    piece,          # expanded chunks per piece
    h_start,        # [NP, HV, K, V] float32 state entering each piece of a split sequence
                    # (chunk_h_chain_kernel); a placeholder when no sequence can split
    stride_s,       # elements between rows (sequences or slots) of h0 and ht
    stride_hv,      # elements between heads of h0 and ht; the [K, V] part is contiguous
    S,              # slots of the cache: a slot outside [0, S) is padding
    rk,             # [T*M, H] float32 1/|k| row factors (USE_RNORM; else a placeholder)
    v,              # [T*M, HV, V] values, input dtype
    beta,           # [T*M, HV] float32
    Ai,             # [T*M, HV, BT] (I + A)^-1 of stage 3, input dtype
    # outputs
    h,              # [NCR, HV, K, V] entering state of every token chunk, read by stage 6
    h_snap,         # [NCR, HV, K, V] the same in the chunk_states dtype (placeholder unless
                    # STORE_SNAPSHOT)
    v_new,          # [T*M, HV, V] input dtype
    ht,             # final state: [N, HV, K, V] float32 or the cache (aliased to h0);
                    # placeholder unless STORE_FINAL_STATE
    summary,        # [NP, HV, K, K+V] float32 [M_p | E_p] of each piece; placeholder unless
                    # SUMMARY (then every output before it is a placeholder)
    # sizes
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    M: tl.constexpr,
    BT: tl.constexpr,  # 64; the state tiles are 64 rows of K whatever BT is
    BV: tl.constexpr,
    # flags
    USE_G: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    STORE_FINAL_STATE: tl.constexpr,
    HAS_STATE_INDICES: tl.constexpr,
    STORE_SNAPSHOT: tl.constexpr,
    USE_RNORM: tl.constexpr,  # keys L2-normalised by their row factors, applied after dots
    SUMMARY: tl.constexpr,    # write each piece's affine map instead of walking it
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs, else the tensor-core default
):
  NC: tl.constexpr = (V + BV - 1) // BV + SUMMARY * ((K + BV - 1) // BV)
  i_r = tl.program_id(0)
  i_hv = i_r % HV
  i_v = (i_r // HV) % NC
  p_row = pieces + (i_r // (HV * NC)) * 3
  i_h = i_hv // (HV // H)
  i_n = tl.load(p_row)
  i_p = tl.load(p_row + 1).to(tl.int64)
  i_j = tl.load(p_row + 2).to(tl.int64)
  if i_n < 0:
    return
  # int64 throughout: row * HV*V, chunk * HV*K*V and slot * HV*K*V overflow int32 (a cache of
  # S=1024, HV=32, K=128, V=512 is already 2**31 elements).
  bos = tl.load(cu_seqlens + i_n).to(tl.int64)
  eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
  n_x = tl.cdiv((eos - bos) * M, BT)
  c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
  bos_x = bos * M
  len_x = (eos - bos) * M
  # This program's piece: expanded chunks [e_lo, e_hi). An empty sequence is one empty piece.
  n_pieces = tl.maximum(tl.cdiv(n_x, piece), 1)
  e_lo = i_p * piece
  e_hi = tl.minimum(e_lo + piece, n_x)
  last = i_p == n_pieces - 1

  o_k, o_v, mask_v, b_h1, b_h2, b_h3, b_h4 = _zero_state(i_v, V, BV)
  mask_l = mask_v   # the columns that read values
  if SUMMARY:
    # M_p's columns from the identity with the values off, E_p's from zero with them.
    local, o_v, mask_v, mask_l, b_h1, b_h2, b_h3, b_h4 = _summary_columns(i_v, o_k, K, V, BV)

  if HAS_STATE_INDICES:
    i_s = tl.load(state_indices + i_n).to(tl.int64)
    # Padding (-1, or any slot outside the cache): read nothing, write no final state; its
    # checkpoints are defined as zeros (each piece writes those of its own token chunks).
    if (i_s < 0) | (i_s >= S):
      if not SUMMARY:
        for i_c in range(tl.cdiv(e_lo, M), tl.cdiv(e_hi, M)):
          p_h = h + ((c0 + i_c) * HV + i_hv) * (K * V)
          _store_state(p_h, b_h1, b_h2, b_h3, b_h4, o_k, o_v, mask_v, K, V)
          if STORE_SNAPSHOT:
            p_hs = h_snap + ((c0 + i_c) * HV + i_hv) * (K * V)
            _store_state(p_hs, b_h1, b_h2, b_h3, b_h4, o_k, o_v, mask_v, K, V)
      return
  else:
    i_s = i_n.to(tl.int64)

  if SUMMARY:
    if last:
      return  # the state leaving a sequence's last piece enters no other piece
  else:
    if n_pieces > 1:
      # Piece 0 too: the last piece writes the cache slot, which no piece may read meanwhile.
      b_h1, b_h2, b_h3, b_h4 = _load_state(h_start + (i_j * HV + i_hv) * (K * V),
                                           o_k, o_v, mask_v, K, V)
    else:
      if USE_INITIAL_STATE:
        b_h1, b_h2, b_h3, b_h4 = _load_state(h0 + i_s * stride_s + i_hv * stride_hv, o_k, o_v,
                                             mask_v, K, V)

  p_k = k + i_h * K
  for i_e in range(e_lo, e_hi):
    if not SUMMARY:
      if i_e % M == 0:
        # Every M-th expanded chunk starts a token chunk (64cM is row 64c*M).
        p_h = h + ((c0 + i_e // M) * HV + i_hv) * (K * V)
        _store_state(p_h, b_h1, b_h2, b_h3, b_h4, o_k, o_v, mask_v, K, V)
        if STORE_SNAPSHOT:
          p_hs = h_snap + ((c0 + i_e // M) * HV + i_hv) * (K * V)
          _store_state(p_hs, b_h1, b_h2, b_h3, b_h4, o_k, o_v, mask_v, K, V)

    o_r = i_e * BT + tl.arange(0, BT)
    mask_r = o_r < len_x
    row = bos_x + o_r
    if USE_RNORM:
      b_rk = tl.load(rk + row * H + i_h, mask=mask_r, other=0.)
    if USE_G:
      b_g = tl.load(g_cum + row * HV + i_hv, mask=mask_r, other=0.)
    off_v = row[:, None] * (HV * V) + i_hv * V + o_v[None, :]
    # The key tiles are loaded once, for K S here and (transposed) K^T D below.
    b_ks, b_k1, b_k2, b_k3, b_k4 = _rows_dot_state(p_k, row, mask_r, b_h1, b_h2, b_h3, b_h4,
                                                   o_k, H * K, K, DOT_PRECISION)
    b_beta = tl.load(beta + row * HV + i_hv, mask=mask_r, other=0.).to(tl.float32)
    b_kscale = b_beta
    if USE_G:
      b_kscale = b_kscale * tl.exp2(b_g)
    if USE_RNORM:
      b_kscale = b_kscale * b_rk
    b_x = (tl.load(v + off_v, mask=mask_r[:, None] & mask_l[None, :], other=0.).to(tl.float32)
           * b_beta[:, None] - b_ks * b_kscale[:, None])
    b_Ai = tl.load(Ai + row[:, None] * (HV * BT) + i_hv * BT + tl.arange(0, BT)[None, :],
                   mask=mask_r[:, None], other=0.)
    b_v = tl.dot(b_Ai, b_x.to(b_Ai.dtype), input_precision=DOT_PRECISION)
    if not SUMMARY:
      # Stored before the decay scaling below: stage 6 applies its own decays.
      # Offsets and mask of their own, not the v load's: this store belongs to a later stage
      # of the pipeliner than that load, which would otherwise carry the load's [BT, BV] int64
      # offsets and mask from iteration to iteration for it (one copy per stage in flight).
      p_vn = v_new + (row * (HV * V) + i_hv * V)
      tl.store(p_vn[:, None] + o_v[None, :], b_v.to(v_new.dtype.element_ty),
               mask=(row < bos_x + len_x)[:, None] & (o_v < V)[None, :])

    if USE_G:
      i_last = tl.minimum(i_e * BT + BT, len_x) - 1
      b_g_last = tl.load(g_cum + (bos_x + i_last) * HV + i_hv)
      b_v = b_v * tl.where(mask_r, tl.exp2(b_g_last - b_g), 0.)[:, None]
      b_decay = tl.exp2(b_g_last)
      b_h1 *= b_decay
      if K > 64:
        b_h2 *= b_decay
      if K > 128:
        b_h3 *= b_decay
      if K > 192:
        b_h4 *= b_decay
    if USE_RNORM:
      b_v = b_v * b_rk[:, None]  # normalised K^T D = K^T (diag(1/|k|) D)
    b_v = b_v.to(k.dtype.element_ty)

    b_h1 += tl.dot(tl.trans(b_k1), b_v, input_precision=DOT_PRECISION)
    if K > 64:
      b_h2 += tl.dot(tl.trans(b_k2), b_v, input_precision=DOT_PRECISION)
    if K > 128:
      b_h3 += tl.dot(tl.trans(b_k3), b_v, input_precision=DOT_PRECISION)
    if K > 192:
      b_h4 += tl.dot(tl.trans(b_k4), b_v, input_precision=DOT_PRECISION)

  if SUMMARY:
    # [M_p | E_p] side by side in one row of K + V columns.
    p_s = summary + (i_j * HV + i_hv) * (K * (K + V))
    _store_state(p_s, b_h1, b_h2, b_h3, b_h4, o_k, o_v + tl.where(local, K, 0), mask_v, K,
                 K + V)
  else:
    if STORE_FINAL_STATE:
      if last:
        p_ht = ht + i_s * stride_s + i_hv * stride_hv
        _store_state(p_ht, b_h1, b_h2, b_h3, b_h4, o_k, o_v, mask_v, K, V)


@triton.jit
def _map_tile(p_s, i_t, b_h1, b_h2, b_h3, b_h4, o_k, o_v, mask_v, K: tl.constexpr,
              V: tl.constexpr, DOT_PRECISION: tl.constexpr):
  """Rows 64*i_t .. of M S + E, with [M | E] a row-major [K, K+V] map at p_s and S the [K, BV]
  state held as 64-row float32 tiles: a [64, BV] float32 tile."""
  W: tl.constexpr = K + V
  acc = _load_tile(p_s + K, i_t, o_k, o_v, mask_v, K, W)
  acc += tl.dot(_load_tile(p_s, i_t, o_k, o_k, o_k < K, K, W), b_h1,
                input_precision=DOT_PRECISION)
  if K > 64:
    acc += tl.dot(_load_tile(p_s + 64, i_t, o_k, o_k, 64 + o_k < K, K, W), b_h2,
                  input_precision=DOT_PRECISION)
  if K > 128:
    acc += tl.dot(_load_tile(p_s + 128, i_t, o_k, o_k, 128 + o_k < K, K, W), b_h3,
                  input_precision=DOT_PRECISION)
  if K > 192:
    acc += tl.dot(_load_tile(p_s + 192, i_t, o_k, o_k, 192 + o_k < K, K, W), b_h4,
                  input_precision=DOT_PRECISION)
  return acc


@triton.jit
def chunk_h_chain_kernel(
    # inputs
    h0,             # [N, HV, K, V] initial state, or [S, HV, K, V] cache; placeholder if unused
    state_indices,  # [N] int32 slot per sequence; a placeholder without HAS_STATE_INDICES
    cu_seqlens,     # [N+1] int32 token-stream sequence starts
    piece_offsets,  # [N+1] int32 first row of each sequence in the piece list
    piece,          # expanded chunks per piece
    stride_s,       # elements between rows (sequences or slots) of h0
    stride_hv,      # elements between heads of h0
    S,              # slots of the cache: a slot outside [0, S) is padding
    summary,        # [NP, HV, K, K+V] float32 [M_p | E_p] (chunk_h_fwd_kernel with SUMMARY)
    # outputs
    h_start,        # [NP, HV, K, V] float32 state entering each piece of a split sequence
    # sizes
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    M: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
    # flags
    USE_INITIAL_STATE: tl.constexpr,
    HAS_STATE_INDICES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # float32 products: "ieee", or "tf32x3" on the tensor cores
):
  """The chain of the forward split (docs/algorithm.md §13.3): S_in(0) = the initial state,
  S_in(p+1) = M_p S_in(p) + E_p, in piece order, in float32, one program per (sequence, value
  head, V block). Sequences of one piece and padding sequences are left to the walk, which
  reads no h_start row of theirs.

  Grid: (N * HV, ceil(V / BV)). Parameter order: inputs, outputs, constexprs."""
  i_nh, i_v = tl.program_id(0), tl.program_id(1)
  i_n = i_nh // HV
  i_hv = i_nh % HV
  bos = tl.load(cu_seqlens + i_n).to(tl.int64)
  eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
  n_pieces = tl.cdiv(tl.cdiv((eos - bos) * M, BT), piece)
  skip = n_pieces < 2
  if HAS_STATE_INDICES:
    i_s = tl.load(state_indices + i_n).to(tl.int64)
    skip = skip | (i_s < 0) | (i_s >= S)
  else:
    i_s = i_n.to(tl.int64)
  if skip:
    return

  o_k, o_v, mask_v, b_h1, b_h2, b_h3, b_h4 = _zero_state(i_v, V, BV)
  if USE_INITIAL_STATE:
    b_h1, b_h2, b_h3, b_h4 = _load_state(h0 + i_s * stride_s + i_hv * stride_hv, o_k, o_v,
                                         mask_v, K, V)
  j0 = tl.load(piece_offsets + i_n).to(tl.int64)
  _store_state(h_start + (j0 * HV + i_hv) * (K * V), b_h1, b_h2, b_h3, b_h4, o_k, o_v, mask_v,
               K, V)
  for i_p in range(1, n_pieces):
    p_s = summary + ((j0 + i_p - 1) * HV + i_hv) * (K * (K + V))
    b_n1 = _map_tile(p_s, 0, b_h1, b_h2, b_h3, b_h4, o_k, o_v, mask_v, K, V, DOT_PRECISION)
    b_n2 = b_h2
    b_n3 = b_h3
    b_n4 = b_h4
    if K > 64:
      b_n2 = _map_tile(p_s, 1, b_h1, b_h2, b_h3, b_h4, o_k, o_v, mask_v, K, V, DOT_PRECISION)
    if K > 128:
      b_n3 = _map_tile(p_s, 2, b_h1, b_h2, b_h3, b_h4, o_k, o_v, mask_v, K, V, DOT_PRECISION)
    if K > 192:
      b_n4 = _map_tile(p_s, 3, b_h1, b_h2, b_h3, b_h4, o_k, o_v, mask_v, K, V, DOT_PRECISION)
    b_h1, b_h2, b_h3, b_h4 = b_n1, b_n2, b_n3, b_n4
    _store_state(h_start + ((j0 + i_p) * HV + i_hv) * (K * V), b_h1, b_h2, b_h3, b_h4, o_k, o_v,
                 mask_v, K, V)
