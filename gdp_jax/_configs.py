"""Block sizes and warps per kernel, picked from shapes; the reasons sit beside each choice.

Configs are pinned, never autotuned: jax-triton compiles every autotune candidate at lowering,
and a different block size changes the summation order, so repeat runs would not be bitwise
equal (docs/algorithm.md §10.4). Tuned numbers come from benchmarks/ (see docs/performance.md).
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

# Which kernel runs `gated_delta_product_decode`: "fold" builds the folded stream (query on the
# last copy, decay on the first) and runs the fused recurrent kernel with steps_per_token = M,
# the path measured on the H200; "native" runs kernels/gdp_decode.py on the unfolded inputs
# (no fold ops, no discarded read-outs; same bits in the interpreter), not yet timed on a GPU.
GDP_DECODE_KERNEL = "fold"


def decode_config(N: int, HV: int, K: int, V: int) -> DecodeConfig:
  """The fused recurrent step: one program per (V-block, sequence, value head).

  The whole key dimension sits in one [BK, BV] float32 tile. Measured on the H200 (docs/performance.md,
  sweep of BV in {8, 16, 32, 64} x warps in {1, 2, 4, 8} at K = V = 128): one warp per program
  wins at every batch, because the step is two reductions over K per token and a single warp
  does them with shuffles, no shared-memory round trip; BV = 16 (64 state registers per thread)
  was fastest at N = 256, HV = 16 (0.172 ms against 0.217 ms for BV = 32 with 4 warps), and at
  small batches every config sits within launch noise (8 to 10 us), where narrower blocks at
  least put more programs on the 132 SMs.
  """
  if DECODE_OVERRIDE is not None:
    return DECODE_OVERRIDE
  BK = _next_pow2(K)
  BV = 16 if N * HV * -(-V // 16) >= 4 * 132 else 8
  BV = min(BV, _next_pow2(V))
  # Keep the state tile at 64 float32 registers per thread or fewer (K = 256 takes two warps).
  num_warps = max(1, min(8, BK * BV // (64 * 32)))
  return DecodeConfig(BV=BV, num_warps=num_warps)
