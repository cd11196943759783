"""Launches the chunked prefill kernels (docs/algorithm.md §4, §5, §7) and packages their results.

`_chunk_gated_delta_product_fwd` is called by `gdp_jax.prefill.chunk_gated_delta_product` for
the "triton" and "interpret" backends, after the inputs were checked and the defaults filled.
It runs, per call:

    stage 0  L2 norms of q and k rows as factors (optional)        inside stages 2 and 6
    stage 1  Gx (expanded stream), Gu (token stream)               inside stages 2 and 6
    stage 2  A = strict_lower(beta K K^T decay), Gx, key factors   chunk_kkt
    stage 3  Ai = (I + A)^-1                                       chunk_solve
    stage 4  w, u                                                  inside stage 5
    stage 5  h (chunk states), v_new, final state / cache          chunk_h (in pieces, §13.3)
    stage 6  o                                                     chunk_o

Stage 0 (§4.2) never writes normalised rows: every use of a normalised q or k row is linear in
that row, so the kernels take the raw rows and scale their dot products by float32 row factors
1 / sqrt(|x|^2 + 1e-6) (keys: computed and stored by stage 2; queries: computed by stage 6).
Normalised rows are neither rounded to the input dtype nor written back (1.6 GB at B=8 T=4096
H=32), except by the training forward (`return_residuals`), whose backward kernels take them:
there stages 2 and 6 store them in the input dtype beside their outputs.

Each kernel's launch is spelled once, by a `_<stage>_launch` builder that returns a
`KernelCall` (kernel, inputs in the kernel's order, output shapes, grid, constexprs, warps and
stages) from the packed arrays and a `FwdConfig`; `KernelCall.run` hands it to `_launch.call`,
and a torch launcher can read the same fields. The config travels as a static argument (hashable, part of
every jit cache key), never as module state.

Dense inputs [B, T, ...] are folded into one packed stream of B*T tokens with
cu_seqlens = [0, T, 2T, ..] known at trace time, so one set of kernels serves both cases.
With `cu_seqlens`, the chunk descriptors are built on the device with static upper bounds
(§5.3): no host sync, and one compilation for every `cu_seqlens` value of a shape.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gdp_jax import _launch
from gdp_jax._common import BT, chunk_descriptors, chunk_offsets, descriptors_from_offsets
from gdp_jax._configs import _next_pow2


class FwdConfig(NamedTuple):
  """Block sizes and warps of the forward kernels. Pinned, not autotuned: BK and BV set the
  summation order, and repeat runs must be bitwise equal (docs/algorithm.md §10.4).
  `gdp_jax.chunk_gated_delta_product(..., config=)` takes one (static: part of every jit cache
  key; checked by gdp_jax._checks.check_config), for the plain and the training forward.

  The values are the winners of `benchmarks/prefill_stages.py --sweep` on the H200
  (2026-11-30, docs/performance.md) at B=4 T=2048 H=16 K=V=128 M=2, B=8 T=4096 H=32 and
  B=4 T=2048 H=6 K=256 V=512. One set won or came within 5% of the best at all three, so there
  is one table row, with the scan's BV keyed by K (_h_block_v). No field is chosen from the
  batch (N, B, the other sequences): docs/algorithm.md §13.2. Every config was checked there
  against the previous one's output.
  """
  # Stage 2: 2 warps (0.341 against 0.369 ms at 4 warps, B=8 H=32, two kernels) and a 64-wide
  # K slice: with stage 3 inside (below) the Gram's 128-wide slice held the whole [64, 128] key
  # tile live beside the solve, 219 registers at sm_90 (255 and a spill in training) against
  # 128 (168). H100, 2026-12-05, bf16, kernel time per call against 128: 62.0 against 75.0 us at
  # B=4 T=2048 H=16 M=2, 89.0 against 109.9 at M=3, 610.5 against 688.8 at B=8 T=4096 H=32,
  # 39.4 against 37.2 at K=256 V=512 H=6; training step 92.3 against 97.0. Same output bits.
  # kkt_bk, o_bk and o_bv are the widest tiles: a K or V below them takes its next power of
  # two (_block).
  kkt_bk: int = 64
  kkt_warps: int = 2
  # Stage 3: one warp. Its diagonal blocks take one multiply-add per row and column (no
  # reduction in the chain, kernels/chunk_solve.py): 55.8 us against 65.0 (2 warps) and 114.2
  # (4 warps) at B=4 T=2048 H=16 M=2 on the H200, 2026-12-04; the row-reduction substitution it
  # replaced took about 81 us at one warp.
  solve_warps: int = 1
  # Its off-diagonal 16x16 products on 16-bit inputs: "tf32" (one TF32 tensor-core product per
  # product, about 1e-3 relative each), "tf32x3" (three: float32-level accuracy) or "ieee"
  # (float32 on the CUDA cores). Float32 inputs take f32_precision. The inverse is stored in the
  # input dtype and feeds bf16 products downstream, so on 16-bit inputs TF32 costs no more than
  # the rounding that follows (docs/algorithm.md §4.5): Ai moves by 2.7e-4 relative, gradients
  # by 2.6e-3 against a bf16 tolerance of 3e-2, and every 16-bit GPU test passes under it. H200,
  # 2026-12-04, B=4 T=2048 H=16 M=2: 38.2 against 56.1 us (tf32x3) and 71.0 (ieee), columns form.
  solve_precision: str = "tf32"
  # Stage 3 inside stage 2's program (kernels/chunk_kkt.py): A never leaves the program, which
  # saves its float32 write and read (268 MB at B=4 T=2048 H=16 M=2). 1: always; 0: two
  # kernels (stage 3 at solve_warps); -1, the default: 1 for 16-bit inputs, 0 for float32, where
  # the fused program spills (255 registers and 3 KB of stack at sm_90, tf32x3 products). H200,
  # 2026-12-05, training step at B=4 T=2048 H=16 M=2 (kernel time): kkt 104.5 us against
  # 73.5 + 59.4 for kkt and solve; at 4 warps 151.8. A plain bf16 forward with this and tf32
  # above against both off (H100, 2026-12-05, kernel time per call): 0.320 against 0.355 ms at
  # that shape, 0.491 against 0.527 at B=1 T=8192, 0.436 against 0.493 at M=3, 2.926 against
  # 3.345 at B=8 T=4096 H=32; 0.704 against 0.708 at K=256 V=512 H=6.
  kkt_solve: int = -1
  # Every dot of every kernel (the solve's and the chain's included) on float32 inputs:
  # "tf32x3" (three TF32 tensor-core products, float32-level accuracy, docs/algorithm.md §4.5;
  # every float32 GPU test passes under it on the H200) or "ieee" (exact float32 products on
  # the CUDA cores, which Triton unrolls into FMA loops: 5.4x the compile time, up to minutes
  # per kernel, docs/performance.md "Compile time"). BwdConfig has the same field.
  f32_precision: str = "tf32x3"
  # Stage 5 (with stage 4 inside): 4 warps, 3 stages (the next chunk's tiles load while this
  # one computes): 0.115 against 0.199 ms (8 warps, 2 stages) at B=4 H=16, 0.94 against 1.44 ms
  # at B=8 H=32, 0.41 against 0.63 ms at K=256. BV 64 when the state fits (K up to 128: two
  # 64x64 float32 tiles), 32 for K > 128 (four tiles): keyed on K only, never on the batch
  # (docs/algorithm.md §13.2).
  h_bv_wide: int = 64
  h_bv_big_k: int = 32
  # The walk of a sequence longer than a piece is split into pieces that run in parallel
  # (docs/algorithm.md §13.3). h_piece: the piece in expanded chunks (0: never split); -1, the
  # default, picks it from the per-request shape only (_piece_length), so a sequence's pieces
  # follow from its own length and the split is the same alone and in any batch. H200,
  # 2026-12-01, bf16 (benchmarks/prefill_split.json), pieces of 64 chunks against none:
  # B=1 T=8192 H=16 0.539 against 0.743 ms, 8 packed sequences of 16384 tokens 1.026 / 1.004,
  # but B=4 T=2048 H=16 M=3 0.666 / 0.503 and B=8 T=4096 H=32 3.432 / 2.736: where the batch
  # already fills the SMs the summary pass is pure extra work. Hence pieces of 2048 tokens
  # (32 M chunks, so T = 2048 stays whole at any M), and only where one sequence has at most
  # h_split_programs walk programs (HV x ceil(V / BV): 32 at H=16 K=V=128, 64 at H=32).
  h_piece: int = -1
  h_split_programs: int = 32
  # The chain's float32 products M_p S + E_p on 16-bit inputs ("tf32x3": three TF32 products on
  # the tensor cores, float32-level accuracy; float32 inputs take f32_precision).
  h_chain_precision: str = "tf32x3"
  # The chain's V block (0: the walk's). Each program loads every piece's whole [K, K+V] map
  # and applies it to its [K, BV] columns, one piece after another: narrow blocks give more
  # programs for few sequences and fit the map tiles without spill (16: 180 registers at sm_90,
  # against 255 and 312 B of spill at 64). 8 packed sequences, H200: 18.2 against 24.1 us,
  # output bitwise the walk's block's (benchmarks/prefill_packed_longest_first_h200.json).
  h_chain_bv: int = 16
  h_warps: int = 4
  h_stages: int = 3
  # float32 inputs (the reference-precision path) take "ieee" dots, whose operands Triton stages
  # in shared memory: 3 stages need 287 KB at K=256 (over the H200's 227 KB; compiled with
  # triton 3.6 on the device and 3.9 here), 2 stages 148 KB.
  h_stages_f32: int = 2
  # Stage 6: 64 x 128 output tiles, K in 128-wide slices, 4 warps: 0.091 against 0.17 ms
  # (8 warps, 64 x 64, BK 64) at B=4 H=16, 0.68 against 1.48 ms at B=8 H=32. Fusing it into
  # the scan (no h, v_new round trip) was built and measured, then removed: 1.9x to 3.8x
  # slower at every K=128 row, as it lengthens each scan program's sequential chain (docs/performance.md).
  o_bk: int = 128
  o_bv: int = 128
  o_warps: int = 4
  o_stages: int = 2


class KernelCall(NamedTuple):
  """The arguments of one `_launch.call`, spelled once per kernel by its `_<stage>_launch`
  builder: `run` hands them to `_launch.call` (which describes them as a LaunchSpec for the
  backend), and a torch launcher takes the same fields,
  `kernel[grid](*args, *outputs, **constexprs, num_warps=.., num_stages=..)`."""
  kernel: str                # "module.function" inside gdp_kernels
  args: tuple                # the kernel's inputs in order: arrays (placeholders for absent
                             # ones, whose constexpr flag is off) and scalars
  out_shape: tuple           # one ShapeDtypeStruct per output pointer, in order
  grid: tuple
  constexprs: dict[str, Any]
  num_warps: int
  num_stages: int = 2
  aliases: dict[int, int] | None = None   # {position in args: output index}

  def run(self, backend: str) -> tuple[jax.Array, ...]:
    return _launch.call(self.kernel, *self.args, grid=self.grid, out_shape=self.out_shape,
                        backend=backend, input_output_aliases=self.aliases,
                        num_warps=self.num_warps, num_stages=self.num_stages, **self.constexprs)


def _h_block_v(cfg: FwdConfig, K: int) -> int:
  return cfg.h_bv_big_k if K > 128 else cfg.h_bv_wide


def _piece_length(cfg: FwdConfig, HV: int, K: int, V: int, M: int) -> int:
  """The scan's piece in expanded chunks (0: unsplit), from the per-request shape alone."""
  if cfg.h_piece >= 0:
    return cfg.h_piece
  programs = HV * -(-V // _h_block_v(cfg, K))
  return 2048 * M // BT if programs <= cfg.h_split_programs else 0


def _dense_descriptors(B: int, L: int, chunk_size: int = BT) -> np.ndarray:
  """The descriptors of B sequences of L rows each, as a trace-time constant."""
  nc = -(-L // chunk_size)
  seq = np.repeat(np.arange(B, dtype=np.int32), nc)
  local = np.tile(np.arange(nc, dtype=np.int32), B)
  return np.stack([seq, local], -1)


class _Packing(NamedTuple):
  N: int               # sequences
  cu: jax.Array        # [N+1] int32 token-stream sequence starts
  desc_t: jax.Array    # [NCD, 2] token-chunk descriptors; NCD rows of the chunk states
  desc_x: jax.Array    # [NXD, 2] expanded-chunk descriptors
  offsets: jax.Array   # [N+1] int32 first row of each sequence in the token-chunk states


def _packing(B: int, T: int, M: int, cu_seqlens) -> _Packing:
  """The packed stream's sequence starts and chunk descriptors (§5.3). Dense inputs [B, T]
  are B sequences of T tokens, with descriptors known at trace time; with `cu_seqlens`
  (B == 1) they are built on the device with static upper bounds: no host sync, one compilation
  for every cu_seqlens value of this shape; entries past the true count are (-1, 0)."""
  if cu_seqlens is None:
    n_c = -(-T // BT)
    return _Packing(B, jnp.asarray(np.arange(B + 1, dtype=np.int32) * T),
                    jnp.asarray(_dense_descriptors(B, T)),
                    jnp.asarray(_dense_descriptors(B, T * M)),
                    jnp.asarray(np.arange(B + 1, dtype=np.int32) * n_c))
  N = cu_seqlens.shape[0] - 1
  cu = cu_seqlens.astype(jnp.int32)
  return _Packing(N, cu, chunk_descriptors(cu, min(T, T // BT + N)),
                  chunk_descriptors(cu * M, min(T * M, (T * M) // BT + N)), chunk_offsets(cu))


# A piece length that no sequence reaches: every walk in one piece.
_WHOLE = 2 ** 30


class _Pieces(NamedTuple):
  """The forward scan's pieces (docs/algorithm.md §13.3): each sequence's expanded chunks cut
  into runs of `length` from its own start; a sequence of at most `length` chunks (an empty
  one too) is one piece, walked from its initial state as if unsplit."""
  length: int          # expanded chunks per piece
  desc: jax.Array      # [NP, 2] int32 (sequence, piece) per row, (-1, 0) past the count
  offsets: jax.Array   # [N+1] int32 first row of each sequence in desc
  split: bool          # static: some sequence may have two pieces or more, so the summary
                       # and chain launches run before the walk
  launch: jax.Array    # [NP, 3] int32 (sequence, piece, row of desc): desc's rows longest
                       # piece first, the order the scan's programs are issued in


def _launch_order(desc, n_x, length, xp):
  """desc's rows with their row numbers, longest piece first (a stable sort: ties and padding
  keep their order). With mixed lengths in more programs than the SMs hold at once, this is the
  longest-processing-time-first schedule: the last wave holds short pieces instead of long ones
  that started late. n_x: [N] expanded chunks of each sequence."""
  seq, piece = desc[:, 0], desc[:, 1]
  size = xp.where(seq >= 0, xp.clip(n_x[xp.maximum(seq, 0)] - piece * length, 0, length), -1)
  order = xp.argsort(-size, stable=True)
  rows = xp.arange(desc.shape[0], dtype=np.int32)
  return xp.concatenate([desc, rows[:, None]], -1)[order].astype(np.int32)


def _expanded_chunks(cu, M: int):
  """[N] int32 expanded chunks of each sequence of int32 cu_seqlens `cu` (may be traced)."""
  return -(-(cu[1:] - cu[:-1]) * M // BT)


def _whole_sequences(N: int, length: int = _WHOLE, n_x=None) -> _Pieces:
  """One piece per sequence; with n_x ([N] expanded chunks, traced) issued longest first."""
  seq = np.arange(N, dtype=np.int32)
  desc = np.stack([seq, np.zeros_like(seq)], -1)
  launch = (np.concatenate([desc, seq[:, None]], -1) if n_x is None else
            _launch_order(jnp.asarray(desc), n_x, _WHOLE, jnp))
  return _Pieces(length, jnp.asarray(desc), jnp.asarray(np.arange(N + 1, dtype=np.int32)),
                 False, jnp.asarray(launch))


def _pieces(B: int, T: int, M: int, cu_seqlens, length: int) -> _Pieces:
  """The pieces of `length` expanded chunks (0: never split) of the packed stream of
  `_packing(B, T, M, cu_seqlens)`: known at trace time for dense inputs, built on the device
  with a static bound under cu_seqlens (§5.3)."""
  if cu_seqlens is None:
    n_x = -(-T * M // BT)
    per = -(-n_x // length) if length else 1
    if per <= 1:
      return _whole_sequences(B, length or _WHOLE)
    desc = _dense_descriptors(B, T * M, BT * length)
    return _Pieces(length, jnp.asarray(desc), jnp.asarray(np.arange(B + 1, dtype=np.int32) * per),
                   True, jnp.asarray(_launch_order(desc, np.full(B, n_x), length, np)))
  N = cu_seqlens.shape[0] - 1
  cu = cu_seqlens.astype(jnp.int32)
  seq_x = _expanded_chunks(cu, M)
  n_x = min(T * M, (T * M) // BT + N)  # expanded chunks of all sequences together, at most
  if not length or n_x <= length:
    return _whole_sequences(N, length or _WHOLE, seq_x)
  counts = jnp.maximum(-(-seq_x // length), 1)
  offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts).astype(jnp.int32)])
  # sum_n max(1, ceil(x_n / L)) <= sum_n (floor(x_n / L) + 1) <= n_x // L + N.
  desc = descriptors_from_offsets(offsets, n_x // length + N)
  return _Pieces(length, desc, offsets, True, _launch_order(desc, seq_x, length, jnp))


def _block(size: int, width: int) -> int:
  """A tile's extent along a K or V axis of `size`: the config's `width`, or the next power of
  two of `size` (at least 16, tl.dot's smallest) when that is narrower. Masked columns past the
  size still cost their products, and on float32 inputs ("ieee": FMA loops unrolled in full)
  their compilation time (docs/performance.md "Compile time")."""
  return min(width, max(16, _next_pow2(size)))


# The precisions a config may give float32 inputs: float32-level products only, so not "tf32"
# (one TF32 product rounds the operands to 10 bits). Checked by gdp_jax._checks.check_config.
F32_PRECISIONS = ("ieee", "tf32x3")


def _dot_precision(dtype, f32_precision: str, precision16: str = "tf32") -> str:
  """A kernel's DOT_PRECISION: float32 inputs take `f32_precision` (a config's field), 16-bit
  inputs `precision16`; for them "tf32" names the tensor-core default."""
  return f32_precision if jnp.dtype(dtype) == jnp.float32 else precision16


def _opt(x, dtype=jnp.float32):
  """x, or a placeholder for an absent optional pointer (its constexpr flag is off)."""
  return x if x is not None else _launch.placeholder(dtype)


_f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)


# --- one launch builder and one runner per stage; all arrays are packed (B folded into the
# token axis) ------------------------------------------------------------------------------


def _kkt_launch(k, beta, g, cu, desc, *, HV, M, l2norm, config: FwdConfig,
                store_kn=False, solve=False) -> KernelCall:
  """Stage 2; with `solve`, stages 2 and 3: the first output is then Ai in k's dtype."""
  TM, H, K = k.shape
  store_kn = store_kn and l2norm
  return KernelCall(
      "chunk_kkt.chunk_kkt_fwd_kernel", (k, beta, _opt(g), cu, desc),
      (jax.ShapeDtypeStruct((TM, HV, BT), k.dtype) if solve else _f32(TM, HV, BT),
       _f32(TM, HV) if g is not None else _f32(1),
       _f32(TM, H) if l2norm else _f32(1),
       jax.ShapeDtypeStruct((TM, H, K), k.dtype) if store_kn else _f32(1)),
      grid=(desc.shape[0], HV), num_warps=config.kkt_warps,
      constexprs=dict(H=H, HV=HV, K=K, M=M, BT=BT, BK=_block(K, config.kkt_bk),
                      USE_G=g is not None, USE_RNORM=l2norm, STORE_KN=store_kn,
                      DOT_PRECISION=_dot_precision(k.dtype, config.f32_precision),
                      SOLVE=solve, SOLVE_PRECISION=_dot_precision(
                          k.dtype, config.f32_precision, config.solve_precision)))


def _kkt(k, beta, g, cu, desc, *, HV, M, backend, l2norm=False, config=FwdConfig()):
  """Stage 2, with stage 1 on the expanded stream and the key half of stage 0 folded in.

  g: [T, HV] float32 natural-log decays, or None. Returns A [T*M, HV, 64] float32; Gx
  [T*M, HV] (the chunk-local log2 cumsums of the expanded stream) or None without g; and with
  `l2norm` the key row factors rk [T*M, H], else None. Rows past cu_seqlens[N] are never
  written.
  """
  A, gx, rk, _ = _kkt_launch(k, beta, g, cu, desc, HV=HV, M=M, l2norm=l2norm,
                             config=config).run(backend)
  return A, (gx if g is not None else None), (rk if l2norm else None)


def _solve_launch(A, cu, desc, *, M, dtype, config: FwdConfig) -> KernelCall:
  TM, HV, _ = A.shape
  return KernelCall(
      "chunk_solve.chunk_solve_fwd_kernel", (A, cu, desc),
      (jax.ShapeDtypeStruct((TM, HV, BT), dtype),),
      grid=(desc.shape[0], HV), num_warps=config.solve_warps,
      constexprs=dict(HV=HV, M=M, BT=BT, DOT_PRECISION=_dot_precision(
          dtype, config.f32_precision, config.solve_precision)))


def _solve(A, cu, desc, *, M, dtype, backend, config=FwdConfig()):
  """Stage 3: Ai [T*M, HV, 64] = (I + A)^-1 per chunk, in `dtype`."""
  (Ai,) = _solve_launch(A, cu, desc, M=M, dtype=dtype, config=config).run(backend)
  return Ai


def _scan_launch(k, v, beta, Ai, gx, cu, offsets, n_rows, *, M, h0, state_indices, final_kind,
                 h_dtype, snap_dtype, rk, config: FwdConfig, pieces: _Pieces, h_start=None,
                 summary=False) -> KernelCall:
  """The walk over `pieces` (each from h_start's row when its sequence is split, else from h0),
  or with `summary` the pass that writes each piece's map [M_p | E_p] and nothing else."""
  TM, H, K = k.shape
  _, HV, V = v.shape
  N = cu.shape[0] - 1
  NP = pieces.desc.shape[0]
  bv = _h_block_v(config, K)
  nv = -(-V // bv)
  aliases = None
  S = h0.shape[0] if h0 is not None else N
  if summary:
    # It reads no state: only the slots, to skip padding.
    h0, final_kind, snap_dtype = None, "none", None
    outs = (_f32(1), _f32(1), _f32(1), _f32(1), _f32(NP, HV, K, K + V))
    grid = (NP * HV * (-(-K // bv) + nv),)
  else:
    if final_kind == "cache":
      # Argument 2 (h0, the cache) is output 3: updated in place when donated.
      final, aliases = jax.ShapeDtypeStruct(h0.shape, h0.dtype), {2: 3}
    else:
      final = _f32(N, HV, K, V) if final_kind == "dense" else _f32(1)
    outs = (jax.ShapeDtypeStruct((n_rows, HV, K, V), h_dtype),
            jax.ShapeDtypeStruct((n_rows, HV, K, V), snap_dtype) if snap_dtype is not None
            else _f32(1),
            jax.ShapeDtypeStruct((TM, HV, V), k.dtype), final, _f32(1))
    grid = (NP * HV * nv,)
  # float32 beta: each chunk's per-row beta load sits in the scan's sequential chain, and Triton
  # pipelines it (cp.async, 4 bytes or more per row) only in float32; a bf16 beta is loaded
  # where it is used, a global-memory latency per chunk (B=1 T=8192, 256 chunks: scan 0.453
  # against 0.319 ms with float32 beta, H200, 2026-11-30).
  return KernelCall(
      "chunk_h.chunk_h_fwd_kernel",
      (k, _opt(gx), _opt(h0), _opt(state_indices, jnp.int32), cu, offsets, pieces.launch,
       pieces.length, _opt(h_start), HV * K * V, K * V, S, _opt(rk), v,
       beta.astype(jnp.float32), Ai),
      outs, grid=grid, aliases=aliases, num_warps=config.h_warps,
      num_stages=config.h_stages_f32 if k.dtype == jnp.float32 else config.h_stages,
      constexprs=dict(
          H=H, HV=HV, K=K, V=V, M=M, BT=BT, BV=bv, USE_G=gx is not None,
          USE_INITIAL_STATE=h0 is not None, STORE_FINAL_STATE=final_kind != "none",
          HAS_STATE_INDICES=state_indices is not None, STORE_SNAPSHOT=snap_dtype is not None,
          USE_RNORM=rk is not None, SUMMARY=summary,
          DOT_PRECISION=_dot_precision(k.dtype, config.f32_precision)))


def _chain_launch(h0, state_indices, cu, summary, *, M, V, dtype, config: FwdConfig,
                  pieces: _Pieces) -> KernelCall:
  """Each piece's entering state from the maps of the pieces before it, in piece order."""
  NP, HV, K, _ = summary.shape
  N = cu.shape[0] - 1
  bv = config.h_chain_bv or _h_block_v(config, K)
  # One stage: the loop body's loads are a whole [K, K+V] map (256 KB at K=256 V=512), which
  # a second stage would double in shared memory.
  return KernelCall(
      "chunk_h.chunk_h_chain_kernel",
      (_opt(h0), _opt(state_indices, jnp.int32), cu, pieces.offsets, pieces.length, HV * K * V,
       K * V, h0.shape[0] if h0 is not None else N, summary),
      (_f32(NP, HV, K, V),), grid=(N * HV, -(-V // bv)), num_warps=config.h_warps,
      num_stages=1,
      constexprs=dict(HV=HV, K=K, V=V, M=M, BT=BT, BV=bv, USE_INITIAL_STATE=h0 is not None,
                      HAS_STATE_INDICES=state_indices is not None,
                      DOT_PRECISION=_dot_precision(dtype, config.f32_precision,
                                                   config.h_chain_precision)))


def _scan(k, v, beta, Ai, gx, cu, offsets, n_rows, *, M, h0, state_indices, final_kind,
          h_dtype, snap_dtype, backend, rk=None, config=FwdConfig(), pieces=None):
  """Stage 5, with stage 4 inside: the inter-chunk scan forms each chunk's w S and u from k, v,
  beta and Ai itself (docs/algorithm.md §4.6), so w and u never exist in memory.

  Stage 4 as a kernel of its own (chunk_wy, writing w and u for the scan to read back) was
  measured against it on the H200, whole prefill with fla-core's CUDA-graph time beside it
  (2026-11-30, docs/performance.md), and removed: inside the scan 0.437 -> 0.413 ms at
  B=4 T=2048 H=16, 0.625 -> 0.574 at M=3, 3.548 -> 2.752 at B=8 T=4096 H=32, K=256 V=512 0.821
  -> 0.776; B=1 T=8192 H=16 (128 programs of 256 chunks, where the chain sets the pace) 0.618
  -> 0.558, K=256 0.776 -> 0.700 with the float32 beta below.

  Args:
    k, v, beta, Ai: [T*M, H, K], [T*M, HV, V], [T*M, HV], [T*M, HV, 64] (stage 3's inverse).
    gx: [T*M, HV] float32 or None.
    cu, offsets: [N+1] int32 sequence starts and first rows in the chunk states.
    n_rows: rows of the chunk-state outputs (static).
    h0: None, an initial state [N, HV, K, V], or the cache [S, HV, K, V] (then final_kind is
      "cache" and the updated cache is returned in its place).
    state_indices: [N] int32 or None.
    final_kind: "none", "dense" ([N, HV, K, V] float32) or "cache".
    h_dtype: dtype of the chunk states read by stage 6.
    snap_dtype: dtype of a second copy of the chunk states, or None for no copy.
    rk: None, or the key row factors [T*M, H].

    pieces: the pieces of the walk (`_pieces`); None: every sequence in one piece.

  Returns:
    (h, h_snap or None, v_new, final or None).
  """
  if pieces is None:
    pieces = _whole_sequences(cu.shape[0] - 1)
  kw = dict(M=M, h0=h0, state_indices=state_indices, final_kind=final_kind, h_dtype=h_dtype,
            snap_dtype=snap_dtype, rk=rk, config=config, pieces=pieces)
  args = (k, v, beta, Ai, gx, cu, offsets, n_rows)
  h_start = None
  if pieces.split:
    # docs/algorithm.md §13.3: the maps of the pieces, then their entering states in order.
    summary = _scan_launch(*args, **kw, summary=True).run(backend)[4]
    (h_start,) = _chain_launch(h0, state_indices, cu, summary, M=M, V=v.shape[2],
                               dtype=k.dtype, config=config, pieces=pieces).run(backend)
  h, h_snap, v_new, ht, _ = _scan_launch(*args, **kw, h_start=h_start).run(backend)
  return (h, h_snap if snap_dtype is not None else None, v_new,
          ht if final_kind != "none" else None)


def _output_launch(q, k, v_new, h, g, state_indices, S, cu, desc, *, M, scale, out_dtype, rk,
                   config: FwdConfig, h_offsets=None, store_qn=False, zero_tail=False,
                   backend=None) -> KernelCall:
  T, H, K = q.shape
  # Zeroing the rows past cu[N] takes a descriptor per block of BT rows: enough of them (§5.3).
  assert not zero_tail or desc.shape[0] * BT >= T, (desc.shape, T)
  _, HV, V = v_new.shape
  store_qn = store_qn and rk is not None
  bk, bv = _block(K, config.o_bk), _block(V, config.o_bv)
  stages = config.o_stages
  precision = _dot_precision(q.dtype, config.f32_precision)
  if backend == "xla_triton" and K > 128 and precision == "tf32x3":
    # XLA's Triton asks 262144 B of shared memory for this kernel at 2 stages (float32 K = 256,
    # H200, 2026-12-03), over the 232448 an sm_90 block may have; pip's triton 3.6 fits it in
    # 229376. One stage holds one K block's operand tiles instead of two.
    stages = 1
  return KernelCall(
      "chunk_o.chunk_o_fwd_kernel",
      (q, k, v_new, h, _opt(h_offsets, jnp.int32), _opt(g), _opt(rk),
       _opt(state_indices, jnp.int32), cu, desc, S, cu.shape[0] - 1, T, float(scale)),
      (jax.ShapeDtypeStruct((T, HV, V), out_dtype),
       jax.ShapeDtypeStruct((T, H, K), q.dtype) if store_qn else _f32(1)),
      grid=(desc.shape[0], -(-V // bv), HV), num_warps=config.o_warps, num_stages=stages,
      constexprs=dict(H=H, HV=HV, K=K, V=V, M=M, BT=BT, BK=bk, BV=bv,
                      H_PER_CHUNK=M if h_offsets is not None else 1, USE_G=g is not None,
                      HAS_STATE_INDICES=state_indices is not None, USE_RNORM=rk is not None,
                      STORE_QN=store_qn, ZERO_TAIL=zero_tail,
                      DOT_PRECISION=precision))


def _output(q, k, v_new, h, g, state_indices, S, cu, desc, *, M, scale, out_dtype, backend,
            rk=None, config=FwdConfig(), h_offsets=None):
  """Stage 6: o [T, HV, V] in out_dtype; rows of tokens outside every sequence are unwritten.
  g: [T, HV] float32 natural-log decays or None (the kernel takes their token-stream cumsum
  Gu itself). rk: None, or the key row factors [T*M, H] of stage 2; then q is L2-normalised
  too, by factors the kernel computes from the q rows it loads. h: the state entering every
  token chunk (row: descriptor index), or with h_offsets ([N+1] int32,
  chunk_offsets(M * cu_seqlens)) the state entering every expanded chunk, of which token chunk
  c of sequence n reads row h_offsets[n] + M c."""
  o, _ = _output_launch(q, k, v_new, h, g, state_indices, S, cu, desc, M=M, scale=scale,
                        out_dtype=out_dtype, rk=rk, config=config,
                        h_offsets=h_offsets, backend=backend).run(backend)
  return o


def _chunk_gated_delta_product_fwd(
    q, k, v, g, beta, *, num_householder, scale, initial_state, output_final_state,
    use_qk_l2norm_in_kernel, cu_seqlens, state, state_indices, return_chunk_states,
    chunk_states_dtype, backend, return_residuals=False, config=FwdConfig()):
  """Chunked prefill on the Triton kernels; matches `gdp_jax.reference.chunk_gated_delta_product`.

  Inputs were checked by the caller (`gdp_jax.prefill`); `scale` is a float.

  Args:
    q: [B, T, H, K] queries.
    k: [B, T*M, H, K] keys of the Householder-expanded stream; token t owns rows t*M .. t*M+M-1.
    v: [B, T*M, HV, V] values of the expanded stream.
    g: [B, T, HV] natural-log decays, or None (no decay).
    beta: [B, T*M, HV], or None (beta = 1).
    num_householder: M.
    scale: query scale.
    initial_state: [N, HV, K, V] or None (zeros).
    output_final_state: return the final state densely (ignored with `state`).
    use_qk_l2norm_in_kernel: L2-normalise q and k rows (as float32 row factors, see above).
    cu_seqlens: [N+1] int32 token-stream sequence starts (B == 1), or None (N = B).
    state: [S, HV, K, V] cache read and written at `state_indices`, or None.
    state_indices: [N] int32 slot per sequence (outside [0, S): padding), or None (slot n).
    return_chunk_states: also return the state entering every 64-token chunk.
    chunk_states_dtype: dtype of those; None: the cache's, else initial_state's, else k's.
    backend: "triton" or "interpret".
    return_residuals: also return what the backward reuses (`_prefill_bwd`; only without
      `state` and `return_chunk_states`): the per-chunk inverse Ai [B*T*M, HV, 64] in k.dtype,
      the expanded-stream log2 cumulative decays Gx [B*T*M, HV] float32 (None without g), the
      key row factors [B*T*M, H] float32 (None without the L2 norm), the state entering every
      expanded chunk h_x [NXD, HV, K, V] in k.dtype (expanded chunk j of sequence n at row
      chunk_offsets(M * cu_seqlens)[n] + j), v_new [B*T*M, HV, V], and with the L2 norm the
      normalised queries [B*T, H, K] and keys [B*T*M, H, K] in k.dtype (else None; rows of no
      sequence unwritten). The first three are intermediates of every forward; h_x costs the
      scan a checkpoint per expanded chunk instead of per token chunk (stage 6 reads every
      M-th of them in place); the normalised rows cost stages 2 and 6 a store each.
    config: the kernels' block sizes and warps (static; benchmarks sweep it).

  Returns:
    (o, final_state), plus chunk_states when `return_chunk_states`, plus the residuals last
    when `return_residuals`:
      o: [B, T, HV, V] in v.dtype; zero for padding sequences and tokens past cu_seqlens[N].
      final_state: the updated cache [S, HV, K, V] (cache dtype) with `state`; else
        [N, HV, K, V] float32 when `output_final_state`; else None.
      chunk_states: [B, ceil(T/64), HV, K, V] (dense) or [NC_max, HV, K, V] with
        NC_max = min(T, T//64 + N) (packed; sequence n's chunk c at row chunk_offsets[n] + c,
        rows past chunk_offsets[N] zero), in chunk_states_dtype.
  """
  M = int(num_householder)
  B, T, H, K = q.shape
  HV, V = v.shape[2], v.shape[3]
  dtype = k.dtype
  out_dtype = v.dtype
  # Every dot takes two operands of one dtype: the input dtype is k's (docs/algorithm.md §4.9).
  q = q.astype(dtype)
  v = v.astype(dtype)

  # Fold the batch into one packed stream: every kernel indexes rows through cu_seqlens.
  q = q.reshape(B * T, H, K)
  k = k.reshape(B * T * M, H, K)
  v = v.reshape(B * T * M, HV, V)
  if state_indices is not None:
    state_indices = state_indices.astype(jnp.int32)
  if beta is None:
    beta = jnp.ones((B * T * M, HV), jnp.float32)
  else:
    beta = beta.reshape(B * T * M, HV)

  N, cu, desc_t, desc_x, offsets = _packing(B, T, M, cu_seqlens)
  n_rows = desc_t.shape[0]
  pieces = _pieces(B, T, M, cu_seqlens, _piece_length(config, HV, K, V, M))

  if g is not None:
    g = g.reshape(B * T, HV).astype(jnp.float32)

  fused = config.kkt_solve == 1 or (config.kkt_solve == -1 and dtype != jnp.float32)
  A, gx, rk, kn = _kkt_launch(k, beta, g, cu, desc_x, HV=HV, M=M,
                              l2norm=use_qk_l2norm_in_kernel, config=config,
                              store_kn=return_residuals, solve=fused).run(backend)
  gx = gx if g is not None else None
  rk = rk if use_qk_l2norm_in_kernel else None
  Ai = A if fused else _solve(A, cu, desc_x, M=M, dtype=dtype, backend=backend, config=config)

  if state is not None:
    h0, final_kind = state, "cache"
    states_default = state.dtype
  else:
    h0 = initial_state
    final_kind = "dense" if output_final_state else "none"
    states_default = initial_state.dtype if initial_state is not None else dtype
  # Stage 6 reads h and casts it to the input dtype. float32 or the input dtype itself round to
  # the same bits there; any other snapshot dtype gets its own copy so o never depends on it.
  snap_dtype = None
  h_dtype = dtype
  if return_chunk_states:
    want = jnp.dtype(chunk_states_dtype if chunk_states_dtype is not None else states_default)
    if want in (jnp.dtype(dtype), jnp.dtype(jnp.float32)):
      h_dtype = want
    else:
      snap_dtype = want
  h_offsets = None
  if return_residuals:
    # The backward wants the state entering every expanded chunk: the scan on the expanded
    # stream seen as one row per token (M = 1 over M * cu_seqlens) checkpoints each (cheaper
    # than a second scan in the backward), and stage 6 reads every M-th in place, the first
    # expanded chunk of each token chunk.
    h_offsets = chunk_offsets(cu * M)
    h_x, _, v_new, final = _scan(
        k, v, beta, Ai, gx, cu * M, h_offsets, desc_x.shape[0], M=1, h0=h0, state_indices=None,
        final_kind=final_kind, h_dtype=dtype, snap_dtype=None, backend=backend, rk=rk,
        config=config, pieces=pieces)
    h, h_snap = h_x, None
  else:
    h, h_snap, v_new, final = _scan(
        k, v, beta, Ai, gx, cu, offsets, n_rows, M=M, h0=h0, state_indices=state_indices,
        final_kind=final_kind, h_dtype=h_dtype, snap_dtype=snap_dtype, backend=backend, rk=rk,
        config=config, pieces=pieces)
  S = state.shape[0] if state is not None else N
  o, qn = _output_launch(q, k, v_new, h, g, state_indices, S, cu, desc_t, M=M, scale=scale,
                         out_dtype=out_dtype, rk=rk, config=config, h_offsets=h_offsets,
                         store_qn=return_residuals, zero_tail=cu_seqlens is not None,
                         backend=backend).run(backend)
  # Tokens past cu_seqlens[N] belong to no sequence: stage 6 wrote zeros there (§5.4).
  o = o.reshape(B, T, HV, V)

  outputs = (o, final)
  if return_chunk_states:
    states = h_snap if h_snap is not None else h
    if cu_seqlens is not None:
      live = jnp.arange(n_rows) < offsets[N]
      states = jnp.where(live[:, None, None, None], states, jnp.zeros((), states.dtype))
    else:
      states = states.reshape(B, -(-T // BT), HV, K, V)
    outputs = outputs + (states,)
  if return_residuals:
    normed = use_qk_l2norm_in_kernel
    outputs = outputs + ((Ai, gx, rk, h_x, v_new, qn if normed else None,
                          kn if normed else None),)
  return outputs
