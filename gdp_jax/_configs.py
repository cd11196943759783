"""Block sizes and warps per kernel, picked from shapes; the reasons sit beside each choice.

Configs are pinned, never autotuned: jax-triton compiles every autotune candidate at lowering,
and a different block size changes the summation order, so repeat runs would not be bitwise
equal (ALGORITHM.md §10.4). Tuned numbers come from benchmarks/ (see RESULTS.md).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  BV: int
  num_warps: int
  num_stages: int = 1


def _next_pow2(x: int) -> int:
  return 1 << max(0, (int(x) - 1).bit_length())


# Benchmarks may force a config to sweep it; None means "pick from shapes".
DECODE_OVERRIDE: DecodeConfig | None = None


def decode_config(N: int, HV: int, K: int, V: int) -> DecodeConfig:
  """The fused recurrent step: one program per (V-block, sequence, value head).

  The whole key dimension sits in one [BK, BV] float32 tile, so BV trades registers and load
  width against the number of programs. Few sequences leave the GPU idle unless V is split
  finely (132 SMs want thousands of warps in flight); many sequences can afford wider blocks,
  whose rows are longer contiguous segments of the state.
  """
  if DECODE_OVERRIDE is not None:
    return DECODE_OVERRIDE
  BK = _next_pow2(K)
  programs_per_block = N * HV
  if programs_per_block * -(-V // 32) >= 8 * 132:
    BV = 32
  elif programs_per_block * -(-V // 16) >= 4 * 132:
    BV = 16
  else:
    BV = 8
  BV = min(BV, _next_pow2(V))
  # Keep the tile at or under 32 float32 registers per thread.
  num_warps = max(1, min(8, BK * BV // (32 * 32)))
  return DecodeConfig(BV=BV, num_warps=num_warps)
