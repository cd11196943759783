"""Block sizes and warps per kernel, picked from shapes; the reasons sit beside each choice.

Configs are pinned, never autotuned: jax-triton compiles every autotune candidate at lowering,
and a different block size changes the summation order, so repeat runs would not be bitwise
equal (docs/algorithm.md §10.4). For the same reason no choice depends on the batch (N, B, S,
the sequences in cu_seqlens): a request's results are then bitwise the same whatever it is
batched with (docs/algorithm.md §13.2). Tuned numbers come from benchmarks/ (see
docs/performance.md).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """The fused recurrent step's tile: BV value columns per program, all of K in one tile.

  Passed to the decode entry points as the static argument `config` (benchmarks sweep it that
  way); hashable, so it is part of the jit cache key.
  """
  BV: int
  num_warps: int
  num_stages: int = 1


def _next_pow2(x: int) -> int:
  return 1 << max(0, (int(x) - 1).bit_length())


def decode_config(K: int, V: int) -> DecodeConfig:
  """The fused recurrent step: one program per (V-block, sequence, value head).

  Picked from K and V only, never from the batch: BV and the warps set the order of the
  reductions over K, so a batch-dependent tile would make a request's bits depend on its
  neighbours (measured on the H200 before this rule: 1.1e-7 relative between N = 1 and N = 64
  at D = 1, 1.7e-5 at D = 4 with snapshots).

  The whole key dimension sits in one [BK, BV] float32 tile. Measured on the H200 (docs/performance.md,
  sweep of BV in {8, 16, 32, 64} x warps in {1, 2, 4, 8} at K = V = 128): one warp per program
  wins at every batch, because the step is two reductions over K per token and a single warp
  does them with shuffles, no shared-memory round trip; BV = 16 (64 state registers per thread)
  was fastest at N = 256, HV = 16 (0.172 ms against 0.217 ms for BV = 32 with 4 warps). At
  small batches every config sat within launch noise (8 to 10 us), so the BV = 8 that was taken
  there for more programs on the 132 SMs is not kept.
  """
  BK = _next_pow2(K)
  BV = min(16, _next_pow2(V))
  # Keep the state tile at 64 float32 registers per thread or fewer (K = 256 takes two warps).
  num_warps = max(1, min(8, BK * BV // (64 * 32)))
  return DecodeConfig(BV=BV, num_warps=num_warps)


def replay_block_rows(T: int, K: int, config: DecodeConfig, dtypes) -> int:
  """Steps BT per block of the replay step's block form for its T new steps (the kernel's W
  holds 2 BT rows: keys, then queries; two blocks past BT), or 0 for the token loop; dtypes:
  those of q, k and v.

  The block form runs its two products over K as bfloat16 tensor-core dots (docs/performance.md,
  decode step), so it needs bfloat16 queries, keys and values (the outputs' dtype: they leave
  the kernel no more precise than that) and a dot's 16 rows and columns: BV >= 16
  and next_pow2(K) >= 16. float32 inputs keep the token loop: a float32 dot spilled beside the
  state tile (measured). float16 inputs too: the checkpoint rounded to float16 would overflow
  past 65504, and float16 keys rounded to bfloat16 would lose 3 bits. Compiled for sm_90 at
  K = V = 128 one block takes 124 to 128 registers, as the token loop's 128; two (9 to 16
  steps: D = 8 at M = 2) 150 to 168, against 180 for one block of 16; K = 256 (two warps, each
  holding all of W) 167, so it keeps the token loop.
  """
  one_warp = config.num_warps == 1 and _next_pow2(K) * config.BV <= 2048
  bf16 = all(str(d) == "bfloat16" for d in dtypes)
  if not (bf16 and 0 < T <= 16 and config.BV >= 16 and _next_pow2(K) >= 16 and one_warp):
    return 0
  return 8


@dataclasses.dataclass(frozen=True)
class DecodePrepareConfig:
  """The decode prepare's launch: one program per (request, draft token), all heads in it."""
  num_warps: int
  num_stages: int = 1


def decode_prepare_config(H: int, K: int) -> DecodePrepareConfig:
  """The [H, K] query tile dominates a program's work: about 8 elements per thread, at most 4
  warps. An elementwise map: no choice here changes a bit of the result."""
  return DecodePrepareConfig(num_warps=max(1, min(4, _next_pow2(H) * _next_pow2(K) // 256)))
