"""A tour of gdp_jax on whatever device JAX has: `python -m gdp_jax.demo`.

Prefills two packed sequences into cache slots, decodes a few tokens against the cache, then
verifies three draft tokens and rolls back to the accepted ones. Every step runs the Triton
kernels (compiled on a GPU, interpreted on a CPU) and is compared with the jnp reference.
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import gdp_jax
from gdp_jax import reference


def _rel(ref, out) -> float:
  ref = np.asarray(ref, np.float64)
  out = np.asarray(out, np.float64)
  return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def _inputs(rng, N, T, M, H, HV, K, V):
  k = rng.standard_normal((N, T * M, H, K))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return dict(q=f32(rng.standard_normal((N, T, H, K))), k=f32(k),
              v=f32(rng.standard_normal((N, T * M, HV, V))),
              g=f32(-rng.exponential(0.3, (N, T, HV))), beta=f32(rng.uniform(0, 2, (N, T * M, HV))))


def main() -> int:
  on_gpu = jax.default_backend() == "gpu"
  backend = "triton" if on_gpu else "interpret"
  # The interpreter is slow: keep the CPU tour tiny; a GPU takes realistic heads.
  H, HV, K, V, M = (4, 8, 128, 128, 2) if on_gpu else (1, 2, 16, 16, 2)
  lengths = (100, 37) if on_gpu else (20, 9)
  S = 4
  rng = np.random.default_rng(0)
  print(f"jax {jax.__version__} on {jax.default_backend()}; kernels via backend={backend!r}")
  print(f"H={H} HV={HV} K={K} V={V} M={M}, cache of S={S} slots")
  worst = 0.0

  def report(what, ref, out, tol=1e-4):
    nonlocal worst
    r = _rel(ref, out)
    worst = max(worst, r / tol)
    print(f"  {what:<34} relative error vs reference {r:.2e}  {'ok' if r < tol else 'FAIL'}")

  # 1. Prefill two packed sequences into slots 3 and 1 of an empty cache.
  T = sum(lengths)
  x = _inputs(rng, 1, T, M, H, HV, K, V)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
  slots = jnp.asarray([3, 1], jnp.int32)
  cache = jnp.zeros((S, HV, K, V), jnp.float32)
  prefill = jax.jit(lambda x, c: gdp_jax.chunk_gated_delta_product(
      **x, num_householder=M, cu_seqlens=cu, state=c, state_indices=slots, backend=backend))
  o, cache = prefill(x, cache)
  o_ref, cache_ref = reference.chunk_gated_delta_product(
      **x, num_householder=M, cu_seqlens=cu, state=jnp.zeros_like(cache), state_indices=slots)
  print(f"prefill of {len(lengths)} packed sequences, lengths {lengths}:")
  report("output o", o_ref, o)
  report("cache after prefill", cache_ref, cache)

  # 2. Three plain decode steps (D = 1) against the cache, cache donated to the jitted step.
  step = jax.jit(lambda x, c: gdp_jax.gated_delta_product_decode(
      **x, num_householder=M, state=c, state_indices=slots, backend=backend), donate_argnums=1)
  print("decode steps:")
  for i in range(3):
    x = _inputs(rng, 2, 1, M, H, HV, K, V)
    o_ref, cache_ref = reference.gated_delta_product_decode(
        **x, num_householder=M, state=cache, state_indices=slots)
    o, cache = step(x, cache)
    report(f"step {i}: output", o_ref, o)
    report(f"step {i}: cache", cache_ref, cache)

  # 3. Speculative decoding: verify D = 3 drafts, accept 2 for the first request and 1 for the
  #    second, roll back, and compare with decoding only the accepted tokens.
  D = 3
  x = _inputs(rng, 2, D, M, H, HV, K, V)
  snaps = jnp.zeros((S, D, HV, K, V), jnp.float32)
  _, drafted, snaps = gdp_jax.gated_delta_product_decode(
      **x, num_householder=M, state=cache, state_indices=slots, intermediate_states=snaps,
      backend=backend)
  accepted = jnp.asarray([2, 1], jnp.int32)
  rolled = gdp_jax.accept_draft_tokens(drafted, snaps, slots, accepted)
  print(f"speculative step, D={D} drafts, accepted {np.asarray(accepted).tolist()}:")
  for n, (slot, a) in enumerate(zip(np.asarray(slots), np.asarray(accepted))):
    one = {name: val[n:n + 1, : a * (1 if name in ("q", "g") else M)] for name, val in x.items()}
    _, expect = reference.gated_delta_product_decode(
        **one, num_householder=M, state=cache, state_indices=slots[n:n + 1])
    report(f"slot {slot} after rollback to {a}", expect[slot], rolled[slot])

  print("all steps agree with the reference" if worst < 1 else "MISMATCH against the reference")
  return 0 if worst < 1 else 1


if __name__ == "__main__":
  sys.exit(main())
