"""Backward of the state scan: the reverse pass over the chunks (docs/algorithm.md §13.1).

The backward works on the expanded stream as Gated DeltaNet (§2.2): the query sits on the last
copy of each token (q~, zero on the other rows) and so does the output cotangent (do~); both are
read from the token stream (row r of the expanded stream is copy r % M of token r // M), never
formed in memory. For expanded chunk e of one sequence and value head, with S the state entering
it, rows a, b in 0..63, chunk-local log2 decays G (Gx), Gamma = 2^G, g_C = G of the chunk's last
valid row, T = (I + A)^-1 and Kb = diag(beta Gamma) K (so W = T Kb):

    dV'  = P^T do~ + diag(2^(g_C - G)) K dS            # dS: cotangent of the state leaving e
    dS  <- 2^g_C dS + scale (diag(Gamma) Q~)^T do~ - Kb^T (T^T dV')

P^T do~ does not depend on dS: chunk_dv_bwd computes it for every chunk in parallel beforehand,
which leaves the chain per chunk K dS, T^T dV' and the update. One program carries the [K, BV]
column slice of dS, transposed (dS^T, so that the chained operand of every dot is its left,
register operand; the kernel's docstring has the layout), in float32 from the final-state
cotangent (or zeros) back to the sequence start, and writes per chunk the dS it received (dh,
the cotangent of the state leaving the chunk, read by chunk_o_bwd) and X = T^T dV' (read by
chunk_o_bwd and chunk_wy_bwd: the cotangent of Vb = diag(beta) V, from which the WY backward
follows without T, docs/algorithm.md §13.1), both in the dtype of their buffers (the input
dtype: a bf16 dh halves the largest read of chunk_o_bwd); dS at the end is the initial-state
cotangent, in float32. An empty sequence passes dht straight to dh0.

A long sequence with few heads leaves most SMs idle while each program walks every chunk in
turn, so the walk can be split into NP pieces that run in parallel (docs/algorithm.md §13.3).
Piece p of a sequence of NX expanded chunks covers chunks [p L, min((p+1) L, NX)), L =
ceil(NX / NP) (empty past the end). dS enters the update linearly, so a piece [a, b) maps the
dS leaving it to the dS entering it affinely, dS_in(p) = Pi_p dS_out(p) + E_p, with
Pi_p = A_a A_(a+1) .. A_(b-1), A_e = 2^g_C I - Kb^T T^T diag(2^(g_C - G)) K (K x K). With
SUMMARY the kernel computes [Pi_p | E_p] for pieces 1..NP-1 (piece 0's map is never needed)
and writes nothing else: column blocks 0 .. ceil(K/BV)-1 walk the columns of the K x K identity
with the chunks' own terms (do~, P^T do~) off, giving Pi_p; the blocks after them walk V
columns of dS from zero, giving E_p. The caller chains the maps from the last piece back
(dS_out(p-1) = Pi_p dS_out(p) + E_p) and runs the kernel again without SUMMARY, each piece
from its dS_out(p) (read from `dht`), writing dh and X for its own chunks; piece 0 writes
dh0. NP = 1 is the unsplit walk: one piece from dht.

No operand of a dot is the transpose of another dot's result: Triton 3.4 to 3.7.0 miscompiles
that pattern on Hopper (FLA #640). The one transposed operand, K^T, is the
transpose of the key tile loaded for the chunk's other key product.

Grid: (N * NPL * NC * HV,), NC = ceil(V / BV) column blocks and NPL = NP pieces (with SUMMARY
NC = ceil(K / BV) + ceil(V / BV) and NPL = NP - 1). Program i owns sequence order[i // (NPL NC
HV)], piece (i // (NC HV)) % NPL (plus 1 with SUMMARY), column block (i // HV) % NC and value
head i % HV. The GPU issues programs in index order and the caller lists the sequences longest
first, so that with mixed lengths short walks fill the last wave (the forward scan's rule,
kernels/chunk_h.py). Parameter order: inputs, outputs, constexprs.
"""
import triton
import triton.language as tl

from .chunk_h import _summary_columns, _zero_state


@triton.jit
def _cols_t(p, i_t, o_c, o_v, mask_v, K: tl.constexpr, V: tl.constexpr, KT: tl.constexpr):
  """Columns KT*i_t .. of the [BV, K] transpose of a [K, V] state's column block at p."""
  o = i_t * KT + o_c
  return tl.load(p + o[None, :] * V + o_v[:, None], mask=mask_v[:, None] & (o < K)[None, :],
                 other=0.)


@triton.jit
def _store_t(p, b_h1, b_h2, o_c, o_v, mask_v, K: tl.constexpr, V: tl.constexpr,
             KT: tl.constexpr):
  """dS^T's tiles stored as the [K, V] layout's column block."""
  o = o_c
  tl.store(p + o[None, :] * V + o_v[:, None], b_h1.to(p.dtype.element_ty),
           mask=mask_v[:, None] & (o < K)[None, :])
  if K > KT:
    o = KT + o_c
    tl.store(p + o[None, :] * V + o_v[:, None], b_h2.to(p.dtype.element_ty),
             mask=mask_v[:, None] & (o < K)[None, :])


@triton.jit
def _rows(p, row, mask_r, i_t, o_c, STRIDE: tl.constexpr, K: tl.constexpr, KT: tl.constexpr):
  """[BT, KT] slice (columns KT*i_t ..) of the rows `row` of a row-major [*, STRIDE] array."""
  o = i_t * KT + o_c
  return tl.load(p + row[:, None] * STRIDE + o[None, :], mask=mask_r[:, None] & (o < K)[None, :],
                 other=0.)


@triton.jit
def _update_t(b_dh, b_decay, p_q, tok, mask_q, i_t, o_c, b_k, b_dos, b_xs,
              H: tl.constexpr, K: tl.constexpr, KT: tl.constexpr, USE_G: tl.constexpr,
              DOT_PRECISION: tl.constexpr):
  """Columns KT*i_t .. of dS^T <- decay dS^T + (scale do~^T diag(Gamma)) Q~ + (-X^T diag(beta
  Gamma)) K, both products accumulating into dS^T; b_k is the chunk's key tile i_t."""
  b_q = _rows(p_q, tok, mask_q, i_t, o_c, H * K, K, KT)
  if USE_G:
    b_dh = b_dh * b_decay
  b_dh = tl.dot(b_dos, b_q, b_dh, input_precision=DOT_PRECISION)
  b_dh = tl.dot(b_xs, b_k, b_dh, input_precision=DOT_PRECISION)
  return b_dh


@triton.jit
def chunk_h_bwd_kernel(
    # inputs
    q,              # [T, H, K] (normalised) queries, input dtype: q~ on each token's last copy
    k,              # [T*M, H, K] (normalised) keys, input dtype
    g_cum,          # [T*M, HV] float32 Gx (log2 units); a placeholder when USE_G is False
    beta,           # [T*M, HV] float32
    Ai,             # [T*M, HV, BT] (I + A)^-1, input dtype
    do,             # [T, HV, V] output cotangent, input dtype: do~ on each last copy
    dv_local,       # [T*M, HV, V] P^T do~ (chunk_dv_bwd), input dtype
    dht,            # [N, NP, HV, K, V] float32 cotangent of the state leaving each piece (the
                    # final-state cotangent at NP = 1); placeholder unless USE_DHT
    cu_seqlens,     # [N+1] int32 token-stream sequence starts
    chunk_offsets,  # [N+1] int32 first row of each sequence in dh (expanded chunks)
    order,          # [N] int32 the sequences in launch order
    scale,          # float32 query scale
    # outputs
    dh,             # [NXR, HV, K, V] cotangent of the state leaving each chunk, input dtype;
                    # placeholder with SUMMARY
    dx,             # [T*M, HV, V] X = T^T dV', input dtype; placeholder with SUMMARY
    dh0,            # [N, HV, K, V] float32 initial-state cotangent; placeholder unless USE_DH0
    summary,        # [N, NP-1, HV, K, K+V] float32 [Pi | E] of pieces 1..NP-1; placeholder
                    # unless SUMMARY
    # sizes
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    M: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
    NP: tl.constexpr,   # pieces per sequence
    # flags
    USE_G: tl.constexpr,
    USE_DHT: tl.constexpr,
    USE_DH0: tl.constexpr,
    SUMMARY: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
  """The reverse pass carrying dS^T, [BV, K] in float32 as one [BV, KT] tile (two at K > 128;
  KT = 64 up to K = 64, else 128), and dV'^T:

      X^T   = (P^T do~)^T T + ((dS^T K^T) diag(2^(g_C - G))) T     (= dV'^T T)
      dS^T <- 2^g_C dS^T + (scale do~^T diag(Gamma)) Q~ - (X^T diag(beta Gamma)) K

  The chained operand (dS^T, then dS^T K^T, then X^T) is always a dot's left operand, which
  Hopper's wgmma takes from registers; the right operands (K^T, T, Q~, K) are tiles loaded for
  the chunk, K^T the transpose of the key tile that K's own product reads. The row scalings
  sit on the register operands' columns or on the result, so loaded tiles reach the dots as
  loaded; (P^T do~)^T, off the chain, is a left operand as loaded, so the pipeliner stages it in
  shared memory with the others. With KT = 128 a chunk takes five products at K <= 128
  (carrying dS in 64-row tiles took seven: docs/performance.md, Training). do~, P^T do~, X, dh,
  dht, dh0 and the summary are read and written transposed, in their usual layouts. The dots' M
  is BV: below wgmma's 64 (BV = 32, BwdConfig.h_bv_big_k's default at K > 128) Triton compiles
  them to mma.sync."""
  KT: tl.constexpr = 64 if K <= 64 else 128
  # With M dividing BT (and at least 16 tokens per chunk, a dot's minimum), every chunk holds
  # BQ = BT / M whole tokens.
  COMPACT_Q: tl.constexpr = (BT % M == 0) and (BT // M >= 16)
  BQ: tl.constexpr = BT // M if COMPACT_Q else BT
  NC: tl.constexpr = (V + BV - 1) // BV + SUMMARY * ((K + BV - 1) // BV)
  NPL: tl.constexpr = NP - SUMMARY
  i_r = tl.program_id(0)
  i_hv = i_r % HV
  i_v = (i_r // HV) % NC
  i_p = (i_r // (HV * NC)) % NPL + SUMMARY
  i_n = tl.load(order + i_r // (HV * NC * NPL))
  i_h = i_hv // (HV // H)
  bos = tl.load(cu_seqlens + i_n).to(tl.int64)
  eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
  len_x = (eos - bos) * M
  bos_x = bos * M
  n_x = tl.cdiv(len_x, BT)
  c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
  # This program's piece: chunks [e_lo, e_hi), empty past the sequence's end.
  n_piece = tl.cdiv(n_x, NP)
  e_lo = tl.minimum(i_p * n_piece, n_x)
  e_hi = tl.minimum(e_lo + n_piece, n_x)

  o_k, o_v, mask_v, _, _, _, _ = _zero_state(i_v, V, BV)
  o_c = tl.arange(0, KT)
  o_a = tl.arange(0, BT)
  o_j = tl.arange(0, BQ)
  mask_l = mask_v   # the columns that see the chunks' own terms (q~, do~, P^T do~)
  b_dh1 = tl.zeros([BV, KT], dtype=tl.float32)
  b_dh2 = tl.zeros([BV, KT], dtype=tl.float32)
  if SUMMARY:
    # Pi's columns from the identity without the chunks' own terms, E's from zero with them.
    local, o_v, mask_v, mask_l, _, _, _, _ = _summary_columns(i_v, o_k, K, V, BV)
    # The identity's columns o_v are rows o_v of dS^T.
    mask_i = o_v < tl.where(local, 0, K)
    b_dh1 = tl.where((o_v[:, None] == o_c[None, :]) & mask_i[:, None], 1., 0.)
    b_dh2 = tl.where((o_v[:, None] == KT + o_c[None, :]) & mask_i[:, None], 1., 0.)
  if USE_DHT:
    p_t = dht + ((i_n.to(tl.int64) * NP + i_p) * HV + i_hv) * (K * V)
    b_dh1 = _cols_t(p_t, 0, o_c, o_v, mask_v, K, V, KT)
    if K > KT:
      b_dh2 = _cols_t(p_t, 1, o_c, o_v, mask_v, K, V, KT)

  p_q = q + i_h * K
  p_k = k + i_h * K
  for i_r in range(0, e_hi - e_lo):
    i_e = e_hi - 1 - i_r
    if not SUMMARY:
      _store_t(dh + ((c0 + i_e) * HV + i_hv) * (K * V), b_dh1, b_dh2, o_c, o_v, mask_v, K, V,
               KT)

    o_r = i_e * BT + o_a
    mask_r = o_r < len_x
    row = bos_x + o_r
    if COMPACT_Q:
      # The chunk holds BQ whole tokens (it starts on one): q~ and do~ as their BQ rows, not
      # BT rows of which M - 1 in M are zero.
      r_q = i_e * BT + o_j * M + (M - 1)   # each token's last copy, in the sequence
      mask_q = r_q < len_x
      tok = bos + i_e * BQ + o_j
    else:
      tok = row // M
      mask_q = mask_r & (row % M == M - 1)
    if SUMMARY:
      # Pi's columns read no q~ (nor do~, P^T do~: mask_l).
      mask_q = mask_q & (o_j < tl.where(local, BQ, 0))
    off_v = row[None, :] * (HV * V) + i_hv * V + o_v[:, None]
    b_beta = tl.load(beta + row * HV + i_hv, mask=mask_r, other=0.)
    if USE_G:
      b_g = tl.load(g_cum + row * HV + i_hv, mask=mask_r, other=0.)
      i_last = tl.minimum(i_e * BT + BT, len_x) - 1
      b_g_last = tl.load(g_cum + (bos_x + i_last) * HV + i_hv)
      b_gam = tl.where(mask_r, tl.exp2(b_g), 0.)
      b_kdec = tl.where(mask_r, tl.exp2(b_g_last - b_g), 0.)
      b_decay = tl.exp2(b_g_last)
      b_gam_q = b_gam
      if COMPACT_Q:
        b_gam_q = tl.where(mask_q, tl.exp2(tl.load(g_cum + (bos_x + r_q) * HV + i_hv,
                                                   mask=mask_q, other=0.)), 0.)
    else:
      b_gam = tl.where(mask_r, 1., 0.)
      b_kdec = b_gam
      b_decay = 1.
      b_gam_q = tl.where(mask_q, 1., 0.)
    b_do = tl.load(do + tok[None, :] * (HV * V) + i_hv * V + o_v[:, None],
                   mask=mask_l[:, None] & mask_q[None, :], other=0.)
    b_dos = (b_do.to(tl.float32) * (scale * b_gam_q)[None, :]).to(k.dtype.element_ty)

    # dS^T rounded to the input dtype for the tensor cores.
    b_k1 = _rows(p_k, row, mask_r, 0, o_c, H * K, K, KT)
    b_k2 = b_k1
    b_sk = tl.dot(b_dh1.to(b_dos.dtype), tl.trans(b_k1), input_precision=DOT_PRECISION)
    if K > KT:
      b_k2 = _rows(p_k, row, mask_r, 1, o_c, H * K, K, KT)
      b_sk = tl.dot(b_dh2.to(b_dos.dtype), tl.trans(b_k2), b_sk, input_precision=DOT_PRECISION)
    b_ai = tl.load(Ai + row[:, None] * (HV * BT) + i_hv * BT + o_a[None, :],
                   mask=mask_r[:, None], other=0.)
    b_dvl = tl.load(dv_local + off_v, mask=mask_l[:, None] & mask_r[None, :], other=0.)
    # X^T = dV'^T T as (P^T do~)^T T + (dS^T K^T diag(2^(g_C - G))) T: P^T do~ as a dot operand,
    # which the pipeliner stages in shared memory like the other tiles, rather than a sum in
    # registers before one dot, for which it carried a register copy into the next iteration
    # (docs/performance.md, Training).
    b_x = tl.dot(b_dvl, b_ai, input_precision=DOT_PRECISION)
    b_x = tl.dot((b_sk * b_kdec[None, :]).to(b_ai.dtype), b_ai, b_x,
                 input_precision=DOT_PRECISION)
    if not SUMMARY:
      # Offsets and mask of their own, not the dv_local load's: this store belongs to the
      # pipeliner's next stage, which would otherwise carry that load's [BV, BT] int64 offsets
      # and mask for it from one iteration to the next (96 registers at BV 64).
      p_x = dx + (row * (HV * V) + i_hv * V)
      tl.store(p_x[None, :] + o_v[:, None], b_x.to(dx.dtype.element_ty),
               mask=(o_v < V)[:, None] & (row < bos_x + len_x)[None, :])
    b_xs = (b_x * (-(b_beta * b_gam))[None, :]).to(b_dos.dtype)
    b_dh1 = _update_t(b_dh1, b_decay, p_q, tok, mask_q, 0, o_c, b_k1, b_dos, b_xs, H, K, KT,
                      USE_G, DOT_PRECISION)
    if K > KT:
      b_dh2 = _update_t(b_dh2, b_decay, p_q, tok, mask_q, 1, o_c, b_k2, b_dos, b_xs, H, K, KT,
                        USE_G, DOT_PRECISION)

  if SUMMARY:
    # [Pi | E] side by side in one row of K + V columns.
    p_s = summary + ((i_n.to(tl.int64) * (NP - 1) + i_p - 1) * HV + i_hv) * (K * (K + V))
    _store_t(p_s, b_dh1, b_dh2, o_c, o_v + tl.where(local, K, 0), mask_v, K, K + V, KT)
  if USE_DH0:
    # dS entering the sequence: what piece 0 ends with.
    _store_t(dh0 + (i_n.to(tl.int64) * HV + i_hv) * (K * V), b_dh1, b_dh2, o_c, o_v,
             o_v < tl.where(i_p == 0, V, 0), K, V, KT)
