"""The training path of the chunked prefill: a `jax.custom_vjp` whose backward runs Triton kernels.

`chunk_gated_delta_product_train` has the signature of `_prefill_kernels._chunk_gated_delta_product_fwd`
(without `return_residuals`) plus `bwd_config`, the backward kernels' BwdConfig. Without a state cache and chunk snapshots it is differentiable with respect to q, k, v, g, beta
and initial_state (with the final state's cotangent when output_final_state); otherwise it is
the plain forward, whose launches refuse differentiation with a message naming what is
differentiable.

The forward rule is the plain forward with its scan run on the expanded stream as M = 1
(`return_residuals`), so that it checkpoints the state entering every expanded chunk, and it
hands back that and more intermediates (the per-chunk inverse Ai, the expanded-stream
cumulative decays Gx, the key row factors, V', and with the L2 norm the normalised q and k
rows): a plain forward call never goes through it, so it pays nothing for training. The
backward (docs/algorithm.md §13.1) runs on the expanded stream as Gated DeltaNet, with the
query and the output cotangent placed on each token's last copy (the kernels read both from
the token stream):

    per chunk  dV's part inside the chunk, P^T do~                                 chunk_dv_bwd
    reverse    dS from the final-state cotangent back to dh0; per chunk dh and
               X = T^T dV' (the cotangent of diag(beta) V)                          chunk_h_bwd
    per chunk  dq~, dk (output, state update, Kb = diag(beta Gamma) K from
               dKb = -X S^T), dbeta's and the decay's per-row parts                 chunk_o_bwd
    per chunk  the rest of the WY backward, dA = -X V'^T: dk, dv, dbeta; the
               decay's reverse cumulative sum                                       chunk_wy_bwd
    per rows   dq, dk: sum over value heads, L2 norm backward, zero tail, cast     qk_bwd

The last is one pass over each of the [rows, HV, K] buffers (float32, or the input dtype under
BwdConfig.partials) of dq (token stream: dq exists on each token's last copy only, where q~
sits) and dk (expanded stream): it sums the value heads of each key head in float32, applies
the L2 norm's backward dx = (dy - y <y, dy>) / |x|_eps, writes rows past cu_seqlens[N] as zeros
and stores the gradient in its input's dtype. With HV == H there is nothing to sum for dk and
chunk_wy_bwd finishes it in place of qk_bwd (the norm backward from the forward's key norms, the
cast, the zero tail: no per-value-head dk in memory).
With cu_seqlens chunk_wy_bwd also writes the zero rows past cu_seqlens[N] of dv, dbeta and dg.
The normalised q and k rows the kernels take are stored by the training forward (stages 2 and
6); what stays in XLA is dg kept from each token's first copy. The chunk states are saved by the
forward rather than recomputed (FLA and jax-linear-attention recompute them with a second
scan): a checkpoint per expanded chunk costs the forward's scan little, while the second scan
is a sequential walk of every chunk (docs/performance.md).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from gdp_jax import _launch
from gdp_jax import _prefill_kernels as pk

BT = pk.BT
_BK = 64  # chunk_dv_bwd's and chunk_wy_bwd's K blocks (chunk_o_bwd's: BwdConfig.o_bk)
_BV = 64


class BwdConfig(NamedTuple):
  """Block widths and warps of the backward kernels; pinned (bitwise repeatable gradients).
  `gdp_jax.chunk_gated_delta_product(..., bwd_config=)` takes one (static: part of every jit
  cache key; checked by gdp_jax._checks.check_config).

  H200, fwd+bwd at B=4 T=2048 H=16 K=V=128 M=2 (row 0) and B=4 T=2048 H=6 K=256 V=512 (row 4),
  bf16, 2026-12-01 (benchmarks/train_profile.py --variants): chunk_h_bwd, which carries a
  [K, BV] float32 slice of dS and walks every chunk of its sequence in order, took 463 us at
  BV 64 against 527 at 32 and 982 at 16 (row 0); at K = 256, 1724 us at BV 32 against 2594 at
  16. chunk_o_bwd, once it read each state tile once (h and dS in bf16, <S, dS> as a product):
  399 us at 4 warps against 632 at 8 (row 0; before that change 8 warps won, 713 against 806).
  chunk_wy_bwd: 356 us at 4 warps, 597 at 8.

  With few programs (a long sequence, few heads) the walk's sequential chain sets the pace. At
  B=1 T=8192 H=16 (32 programs at BV 64), chunk_h_bwd took 1062 us unsplit at BV 64, 862 at
  32, 797 at 16; split into pieces (docs/algorithm.md §13.3) at BV 64 it took 502 us in 8
  pieces and 600 in 4 (the two launches), at BV 32 in 4 pieces 755, at BV 16 in 2 pieces 953;
  fwd+bwd 2.211 ms (8 pieces, BV 64) against 2.443 (unsplit, BV 16), the pieces' float32 chain
  in XLA included (2026-12-01). Those numbers are for the walk carrying dS; carrying dS^T
  (2026-12-02) it takes 274 us at row 0 (294 before) and 698 at row 4 (1110 before) at 4 warps;
  8 warps: 321 and 688.
  """
  h_bv: int = 64          # K <= 128
  h_bv_big_k: int = 32    # K > 128 (two [BV, 128] tiles of dS^T)
  h_warps: int = 4
  # chunk_h_bwd's pipeline stages for 16-bit inputs (float32 takes 1: see the launch). At 2 a
  # program takes 92.8 KB of shared memory (sm_90, K = V = 128, M = 2), so two fit on an SM; at
  # 3, 138 KB, one (figures before its operands' staging changed: 101 and 151 KB). H100,
  # 2026-12-06, same gradient bits, 2 against 3 stages: 285.0 against 481.8 us at B=4 T=2048
  # H=16, 441.1 / 768.2 at B=1 T=8192 (8 pieces), 721.6 / 1163.8 on 8 packed sequences of 16384
  # tokens, 664.2 / 1246.3 at K=256 V=512 H=6 (benchmarks/train_stages_h100.json;
  # docs/performance.md, Training).
  h_stages: int = 2
  # chunk_h_bwd's walk split into pieces per sequence (_h_pieces): h_split pieces when set (1:
  # the unsplit walk), otherwise 1 while the walk has at least h_split_min_programs programs
  # (half the H200's 132 SMs, the forward scan's rule), else enough pieces for
  # h_split_programs programs, at most h_split_max (8 pieces of 32 programs measured best).
  h_split: int = 0
  h_split_min_programs: int = 66
  h_split_programs: int = 256
  h_split_max: int = 8
  # chunk_o_bwd: o_bk columns of K per program, the V loop in steps of o_bv. At row 0 o_bk=128
  # with 8 warps tied (410.5 us against 413.8; H100, 2026-12-08, with <S, dS> out of the
  # products, 401.8 against 352.8) and o_bv=128 lost (439.2); one program per
  # (chunk, value head) walking every K block after forming dP once lost too (533.6 us at 4
  # warps, 577.6 at 8) and is gone (docs/performance.md, Training).
  o_bk: int = 64
  o_bv: int = 64
  o_warps: int = 4
  o_stages: int = 2
  # chunk_dv_local's and chunk_wy_bwd's. sm_90, K = V = 128 bf16: 72 and 150 registers, 36 and
  # 48 KB of shared memory at 3 stages (24 and 40 KB at 2), three programs per SM either way.
  # H100, 2026-12-07, same gradient bits: 3 stages took 69.0 / 282.1 us against 75.5 / 289.6 at
  # 2 (B=4 T=2048 H=16 M=2), the step 1.437 against 1.455 ms (benchmarks/train_compact_h100.json).
  wy_warps: int = 4
  wy_stages: int = 3
  # qk_bwd, a pass bound by memory: BR rows times BK (K rounded up to a power of two) =
  # qk_block elements per program, 32 float32 values per thread per tile at 4 warps, and
  # thousands of programs at training sizes (8192 for dk at B=4 T=2048 H=16 M=2).
  qk_block: int = 4096
  qk_warps: int = 4
  # With HV == H, chunk_wy_bwd finishes dk (norm backward, cast, zero tail) instead of writing
  # rows per value head for qk_bwd (0: the qk_bwd path, kept to time the two against each other).
  finish_dk: int = 1
  # The dtype of the partial gradients one kernel hands the next: chunk_o_bwd's dq~ and dk per
  # value head, and chunk_wy_bwd's dk where qk_bwd finishes it. "input" (the default) stores
  # them in the input dtype, "float32" in float32; the kernels add in float32 either way. At
  # bf16 B=4 T=2048 H=16 K=V=128 M=2 "input" moves 201 MB less; H100, 2026-12-07, fwd+bwd per
  # step against "float32": 1.392 / 1.440 ms, 2.086 / 2.251 at M=3, 1.756 / 1.816 at B=1
  # T=8192 (benchmarks/train_partials_h100.json). The cost, one more bf16 rounding of each
  # partial sum: dq and dk move by 2.8e-3 relative, inside the bf16 tolerances (interpreter,
  # against the float64 reference: 4.3e-3 -> 4.6e-3). Float32 inputs are unaffected.
  partials: str = "input"   # "input" | "float32"
  # The dots on float32 inputs, as FwdConfig.f32_precision ("tf32x3" or "ieee"); the forward
  # rule's kernels take _Static.fwd_config's.
  f32_precision: str = "tf32x3"


class _Static(NamedTuple):
  num_householder: int
  scale: float
  output_final_state: bool
  use_qk_l2norm_in_kernel: bool
  backend: str
  config: BwdConfig = BwdConfig()
  fwd_config: pk.FwdConfig = pk.FwdConfig()  # the forward rule's kernels


def chunk_gated_delta_product_train(
    q, k, v, g, beta, *, num_householder, scale, initial_state, output_final_state,
    use_qk_l2norm_in_kernel, cu_seqlens, state, state_indices, return_chunk_states,
    chunk_states_dtype, backend, config=pk.FwdConfig(), bwd_config=BwdConfig()):
  """`_prefill_kernels._chunk_gated_delta_product_fwd`, differentiable where it can be: under
  `config` (the forward's kernels, the forward rule's too) and `bwd_config` (the backward's)."""
  if state is not None or state_indices is not None or return_chunk_states:
    return pk._chunk_gated_delta_product_fwd(
        q, k, v, g, beta, num_householder=num_householder, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, state=state,
        state_indices=state_indices, return_chunk_states=return_chunk_states,
        chunk_states_dtype=chunk_states_dtype, backend=backend, config=config)
  static = _Static(int(num_householder), float(scale), bool(output_final_state),
                   bool(use_qk_l2norm_in_kernel), backend, bwd_config, config)
  return _prefill(q, k, v, g, beta, initial_state, cu_seqlens, static)


def _forward(q, k, v, g, beta, initial_state, cu_seqlens, static, return_residuals):
  return pk._chunk_gated_delta_product_fwd(
      q, k, v, g, beta, num_householder=static.num_householder, scale=static.scale,
      initial_state=initial_state, output_final_state=static.output_final_state,
      use_qk_l2norm_in_kernel=static.use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
      state=None, state_indices=None, return_chunk_states=False, chunk_states_dtype=None,
      backend=static.backend, return_residuals=return_residuals, config=static.fwd_config)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _prefill(q, k, v, g, beta, initial_state, cu_seqlens, static):
  return _forward(q, k, v, g, beta, initial_state, cu_seqlens, static, False)


def _prefill_fwd(q, k, v, g, beta, initial_state, cu_seqlens, static):
  o, final, res = _forward(q, k, v, g, beta, initial_state, cu_seqlens, static, True)
  return (o, final), (q, k, v, g, beta, initial_state, cu_seqlens, res)


def _prefill_bwd(static, saved, cotangents):
  q, k, v, g, beta, initial_state, cu_seqlens, res = saved
  do, dht = cotangents
  grads = _backward(q, k, v, g, beta, initial_state, cu_seqlens, res, do,
                    dht if static.output_final_state else None, static)
  return grads + (None,)


_prefill.defvjp(_prefill_fwd, _prefill_bwd)


def _qk_bwd(dy_v, x, cu, N, M, H, out_dtype, backend, cfg):
  """dq or dk [rows, H, K] in out_dtype from the per-value-head cotangent dy_v [rows, HV, K]
  (float32, or the input dtype under BwdConfig.partials="input"; kernels/qk_bwd.py): dy, the
  float32 sum over each key head's value heads; with x (the raw rows [rows, H, K]; None: no L2
  norm) the norm's backward r (dy - y <y, dy>), y = x r, r = 1 / sqrt(|x|^2 + 1e-6); rows at or
  past cu[N] * M zero (M rows per token)."""
  rows, HV, K = dy_v.shape
  bk = 1 << (K - 1).bit_length()
  br = max(1, cfg.qk_block // bk)
  (dx,) = _launch.call(
      "qk_bwd.qk_bwd_kernel", dy_v, x if x is not None else _launch.placeholder(), cu, N, rows,
      grid=(-(-rows // br), H), out_shape=[jax.ShapeDtypeStruct((rows, H, K), out_dtype)],
      backend=backend, num_warps=cfg.qk_warps, num_stages=1,
      H=H, HV=HV, K=K, M=M, BR=br, BK=bk, USE_L2NORM=x is not None)
  return dx


def _h_block_v(cfg: BwdConfig, K: int) -> int:
  return cfg.h_bv if K <= 128 else cfg.h_bv_big_k


def _h_pieces(cfg: BwdConfig, programs: int) -> int:
  """Pieces per sequence of chunk_h_bwd's walk, which has `programs` programs unsplit. The
  split adds a summary pass (columns of K + V per piece instead of V) to shorten each
  program's chain by the number of pieces: a gain only where most SMs would sit idle."""
  if cfg.h_split:
    return cfg.h_split
  if programs >= cfg.h_split_min_programs:
    return 1
  return min(cfg.h_split_max, -(-cfg.h_split_programs // programs))


def _piece_states(summary, dht, K):
  """The cotangent of the state leaving each piece, [N, P, HV, K, V] float32.

  summary: [N, P-1, HV, K, K+V] float32, [Pi_p | E_p] of pieces p = 1..P-1 (chunk_h_bwd with
  SUMMARY): dS_in(p) = Pi_p dS_out(p) + E_p. dht: [N, HV, K, V] float32, or None for zeros.
  dS_out(P-1) = dht and dS_out(p-1) = dS_in(p), a chain of P-1 small float32 products.
  """
  pi, e = summary[..., :K], summary[..., K:]
  s = dht if dht is not None else jnp.zeros(e.shape[:1] + e.shape[2:], jnp.float32)
  out = [s]
  for p in range(summary.shape[1], 0, -1):
    s = jnp.einsum("nhij,nhjv->nhiv", pi[:, p - 1], s,
                   precision=jax.lax.Precision.HIGHEST) + e[:, p - 1]
    out.append(s)
  return jnp.stack(out[::-1], axis=1)


def _backward(q, k, v, g, beta, initial_state, cu_seqlens, res, do, dht, static):
  """(dq, dk, dv, dg, dbeta, dh0), each in its input's dtype (None for an absent input)."""
  Ai, gx, rk, h_x, v_new, qn, kn = res
  M = static.num_householder
  backend = static.backend
  B, T, H, K = q.shape
  HV, V = v.shape[2], v.shape[3]
  dtype = k.dtype
  cfg = static.config
  prec = pk._dot_precision(dtype, cfg.f32_precision)
  part = dtype if cfg.partials == "input" else jnp.float32   # the hand-off buffers' dtype
  TT, R = B * T, B * T * M

  kp = k.reshape(R, H, K)
  vp = v.astype(dtype).reshape(R, HV, V)
  qp = q.astype(dtype).reshape(TT, H, K)
  beta_p = (jnp.ones((R, HV), jnp.float32) if beta is None
            else beta.reshape(R, HV).astype(jnp.float32))
  N, cu, _, desc_x, _ = pk._packing(B, T, M, cu_seqlens)
  n_rows_x = desc_x.shape[0]
  offsets_x = pk.chunk_offsets(cu * M)

  # The backward kernels take the normalised rows themselves (stored by the forward).
  if not static.use_qk_l2norm_in_kernel:
    qn, kn = qp, kp
  do_t = do.reshape(TT, HV, V).astype(dtype)

  ph = _launch.placeholder
  f32 = jnp.float32
  use_g = gx is not None
  bv = min(_h_block_v(cfg, K), max(16, 1 << (V - 1).bit_length()))
  nv = -(-V // bv)
  pieces = _h_pieces(cfg, N * HV * nv)
  (dv_local,) = _launch.call(
      "chunk_dv_bwd.chunk_dv_local_kernel", qn, kn, do_t, gx if use_g else ph(), cu, desc_x,
      float(static.scale),
      grid=(desc_x.shape[0], HV),
      out_shape=[jax.ShapeDtypeStruct((R, HV, V), dtype)],
      backend=backend, num_warps=cfg.wy_warps, num_stages=cfg.wy_stages,
      H=H, HV=HV, K=K, V=V, M=M, BT=BT, BK=_BK, BV=_BV, USE_G=use_g, DOT_PRECISION=prec)

  # The reverse state pass. Split into pieces (docs/algorithm.md §13.3), it takes three steps:
  # the summary launch maps the dS leaving each piece 1..P-1 to the dS entering it (columns
  # [Pi | E]), _piece_states chains the maps from the last piece back, and the walk runs every
  # piece from the dS leaving it. Unsplit, the walk starts from dht alone.
  h_args = (qn, kn, gx if use_g else ph(), beta_p, Ai, do_t, dv_local)
  # The sequences longest first, as the forward scan issues its pieces (kernels/chunk_h_bwd.py).
  order = pk._whole_sequences(
      N, n_x=None if cu_seqlens is None else pk._expanded_chunks(cu, M)).launch[:, 0]
  h_tail = (cu, offsets_x, order, float(static.scale))
  h_kw = dict(
      # float32 inputs stage ieee-dot operands in shared memory: 2 stages need 329 KB at K=256
      # (over the H200's 227 KB, sm_90 compile), 1 stage fits.
      backend=backend, num_warps=cfg.h_warps,
      num_stages=1 if dtype == jnp.float32 else cfg.h_stages,
      H=H, HV=HV, K=K, V=V, M=M, BT=BT, BV=bv, NP=pieces, USE_G=use_g,
      DOT_PRECISION=prec)
  ds_out = dht.astype(f32) if dht is not None else None
  if pieces > 1:
    summary = _launch.call(
        "chunk_h_bwd.chunk_h_bwd_kernel", *h_args, ph(), *h_tail,
        grid=(N * HV * (-(-K // bv) + nv) * (pieces - 1),),
        out_shape=[jax.ShapeDtypeStruct((1,), dtype), jax.ShapeDtypeStruct((1,), dtype),
                   jax.ShapeDtypeStruct((1,), f32),
                   jax.ShapeDtypeStruct((N, pieces - 1, HV, K, K + V), f32)],
        USE_DHT=False, USE_DH0=False, SUMMARY=True, **h_kw)[3]
    ds_out = _piece_states(summary, ds_out, K)
  dh, xp, dh0, _ = _launch.call(
      "chunk_h_bwd.chunk_h_bwd_kernel", *h_args, ds_out if ds_out is not None else ph(),
      *h_tail,
      grid=(N * HV * nv * pieces,),
      out_shape=[jax.ShapeDtypeStruct((n_rows_x, HV, K, V), dtype),
                 jax.ShapeDtypeStruct((R, HV, V), dtype),
                 jax.ShapeDtypeStruct((N, HV, K, V) if initial_state is not None else (1,), f32),
                 jax.ShapeDtypeStruct((1,), f32)],
      USE_DHT=ds_out is not None, USE_DH0=initial_state is not None, SUMMARY=False, **h_kw)

  nk = -(-K // cfg.o_bk)
  dq_v, dk_o, db_k, dg_k = _launch.call(
      "chunk_o_bwd.chunk_o_bwd_kernel", qn, kn, v_new, h_x, do_t, dh, xp,
      gx if use_g else ph(), beta_p, cu, desc_x, float(static.scale),
      grid=(desc_x.shape[0] * nk, HV),   # the K block fastest (shared tiles in L2)
      out_shape=[jax.ShapeDtypeStruct((TT, HV, K), part), jax.ShapeDtypeStruct((R, HV, K), part),
                 jax.ShapeDtypeStruct((R, HV, nk), f32),
                 jax.ShapeDtypeStruct((R, HV, nk) if use_g else (1,), f32)],
      backend=backend, num_warps=cfg.o_warps, num_stages=cfg.o_stages,
      H=H, HV=HV, K=K, V=V, M=M, BT=BT, BK=cfg.o_bk, BV=cfg.o_bv, NK=nk, USE_G=use_g,
      DOT_PRECISION=prec)

  # Without value heads to sum (HV == H), chunk_wy_bwd finishes dk in k's dtype; otherwise it
  # leaves rows per value head (in `part`) for qk_bwd. With cu_seqlens it writes the zero rows
  # past cu_seqlens[N] of its outputs too (block i_d by descriptor i_d: enough descriptors).
  l2 = static.use_qk_l2norm_in_kernel
  finish_dk = HV == H and bool(cfg.finish_dk)
  assert desc_x.shape[0] * BT >= R, (desc_x.shape, R)
  dk_x, dv_x, dbeta_x, dg_x, _ = _launch.call(
      "chunk_wy_bwd.chunk_wy_bwd_kernel", kn, vp, v_new, beta_p, gx if use_g else ph(), xp,
      dk_o, db_k, dg_k if use_g else ph(), kp if finish_dk and l2 else ph(dtype),
      rk if finish_dk and l2 else ph(), cu, desc_x, N, R,
      grid=(desc_x.shape[0], HV),
      out_shape=[jax.ShapeDtypeStruct((R, HV, K), k.dtype if finish_dk else part),
                 jax.ShapeDtypeStruct((R, HV, V), v.dtype),
                 jax.ShapeDtypeStruct((R, HV), f32),
                 jax.ShapeDtypeStruct((R, HV) if use_g else (1,), f32),
                 jax.ShapeDtypeStruct((R, HV, BT), dtype)],
      backend=backend, num_warps=cfg.wy_warps, num_stages=cfg.wy_stages,
      H=H, HV=HV, K=K, V=V, M=M, BT=BT, BK=_BK, BV=_BV, NK=nk, USE_G=use_g,
      FINISH_DK=finish_dk, USE_L2NORM=l2, ZERO_TAIL=cu_seqlens is not None,
      DOT_PRECISION=prec)

  # qk_bwd: the group sums over value heads, the L2 norm's backward, the zero rows past
  # cu_seqlens[N] and the cast, in one pass over each per-value-head buffer.
  dq = _qk_bwd(dq_v, qp if l2 else None, cu, N, 1, H, q.dtype, backend, cfg)
  dk = dk_x if finish_dk else _qk_bwd(dk_x, kp if l2 else None, cu, N, M, H, k.dtype, backend,
                                      cfg)
  dg = dg_x.reshape(TT, M, HV)[:, 0] if use_g else None

  return (dq.reshape(q.shape), dk.reshape(k.shape),
          dv_x.reshape(v.shape).astype(v.dtype),
          dg.reshape(g.shape).astype(g.dtype) if use_g else None,
          dbeta_x.reshape(beta.shape).astype(beta.dtype) if beta is not None else None,
          dh0.astype(initial_state.dtype) if initial_state is not None else None)
