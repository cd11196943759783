"""Accuracy of the solve's two forms of the diagonal blocks (FwdConfig.solve_diag) on adversarial
inputs, through Triton's interpreter on the CPU.

Stage 3 inverts I + A per 64x64 expanded chunk. Its diagonal 16x16 blocks are either a forward
substitution ("subst") or 8x8 halves by the product form (I + D)(I + D^2)(I + D^4) and the
off-half quadrant ("power8", docs/algorithm.md §4.5). Product forms multiply powers of the block,
which grow where the keys are nearly parallel and beta is near 2, so power8 has to be shown to
lose nothing there. Each case builds A = strictly_lower(beta_i k_i.k_j exp(g_i - g_j)) per chunk
in float64, rounds it to float32 (stage 2's output), runs the solve kernel under both forms and
compares Ai with the float64 inverse of I + A(float32): per chunk and head the rms ratio
||Ai - ref|| / ||ref|| (the tests' metric), the case's worst chunk reported.

Precisions: "ieee" is the interpreter's float32 matmul; "tf32x3" emulates the tensor cores'
three-pass product (operands split into TF32 high and low parts, round to nearest away, the
low-times-low product dropped, float32 accumulation) by patching the interpreter's dot, since
the interpreter itself computes every dot in float32; "bf16 out" stores Ai in bfloat16 (tf32x3
products), where the rounding of the store dominates both forms.

    python3 benchmarks/solve_accuracy.py [--out benchmarks/solve_accuracy.json]
"""
import argparse
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from gdp_jax import _prefill_kernels as pk  # noqa: E402
from gdp_jax._common import BT, chunk_descriptors  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def _tf32(x):
  """x rounded to TF32 (10 explicit mantissa bits), to nearest with ties away from zero, as
  cvt.rna.tf32.f32 does."""
  u = np.ascontiguousarray(x, np.float32).view(np.uint32)
  return ((u + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def _emulate_tf32x3():
  """The interpreter's dot, with input_precision tf32x3 computed as the GPU does."""
  from triton.runtime import interpreter as ti
  dot = ti.InterpreterBuilder.create_dot

  def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    if "TF32x3" not in str(input_precision) or a.data.dtype != np.float32:
      return dot(self, a, b, d, input_precision, max_num_imprecise_acc)
    a_hi, b_hi = _tf32(a.data), _tf32(b.data)
    a_lo, b_lo = _tf32(a.data - a_hi), _tf32(b.data - b_hi)
    f = lambda x, y: np.matmul(x, y, dtype=np.float32)
    out = d.data + (f(a_hi, b_lo) + f(a_lo, b_hi)) + f(a_hi, b_hi)
    return ti.TensorHandle(out.astype(np.float32), d.dtype.scalar)

  ti.InterpreterBuilder.create_dot = create_dot


# (name, keys, eps, beta, decay): keys "random" (standard normal over sqrt(K)), "unit" (the same
# L2-normalised) or "parallel" (k_i = k_0 + eps * noise, L2-normalised); beta "uniform" in (0, 2)
# or "near2" in (1.99, 2); decay: the scale of the exponential per-row log decays (0: none).
CASES = [
    ("random keys, beta (0,2), decays", "random", 0, "uniform", 0.05),
    ("unit keys, beta (0,2), decays", "unit", 0, "uniform", 0.05),
    ("unit keys, beta near 2, no decay", "unit", 0, "near2", 0.0),
    ("parallel 1e-1, beta (0,2), decays", "parallel", 1e-1, "uniform", 0.05),
    ("parallel 1e-2, beta (0,2), decays", "parallel", 1e-2, "uniform", 0.05),
    ("parallel 1e-3, beta (0,2), decays", "parallel", 1e-3, "uniform", 0.05),
    ("parallel 1e-1, beta near 2, decays", "parallel", 1e-1, "near2", 0.05),
    ("parallel 1e-2, beta near 2, decays", "parallel", 1e-2, "near2", 0.05),
    ("parallel 1e-3, beta near 2, decays", "parallel", 1e-3, "near2", 0.05),
    ("parallel 1e-3, beta near 2, no decay", "parallel", 1e-3, "near2", 0.0),
    ("parallel 1e-2, beta (0,2), strong decays", "parallel", 1e-2, "uniform", 0.5),
    ("parallel 1e-3, beta (0,2), no decay", "parallel", 1e-3, "uniform", 0.0),
]
# Two sequences: four full chunks and a partial one (rows past its end load as zeros).
LENGTHS = (256, 100)
PRECISIONS = (("ieee", jnp.float32, dict(f32_precision="ieee")),
              ("tf32x3", jnp.float32, dict(f32_precision="tf32x3")),
              ("bf16 out", jnp.bfloat16, dict(solve_precision="tf32x3")))


def build_A(rng, keys, eps, beta, decay, HV, K):
  """A [rows, HV, 64] in float64 per chunk, and the chunks' (first row, valid rows)."""
  cu = np.concatenate([[0], np.cumsum(LENGTHS)])
  A = np.zeros((cu[-1], HV, BT))
  chunks = []
  for s, e in zip(cu[:-1], cu[1:]):
    for c0 in range(s, e, BT):
      n = min(BT, e - c0)
      chunks.append((c0, n))
      if keys == "parallel":
        k = rng.standard_normal((1, HV, K)) + eps * rng.standard_normal((n, HV, K))
      else:
        k = rng.standard_normal((n, HV, K)) / np.sqrt(K)
      if keys != "random":
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
      b = rng.uniform(0, 2, (n, HV)) if beta == "uniform" else rng.uniform(1.99, 2, (n, HV))
      g = np.cumsum(-rng.exponential(decay, (n, HV)), 0) if decay else np.zeros((n, HV))
      for h in range(HV):
        kh = k[:, h]
        A[c0:c0 + n, h, :n] = np.tril(
            b[:, h, None] * (kh @ kh.T) * np.exp(g[:, h, None] - g[None, :, h]), -1)
  return A, cu, chunks


def errors(Ai, A32, chunks, HV):
  """The worst chunk's rms ratio against the float64 inverse, and the largest |entry| of the
  inverse (how far the entries grow)."""
  worst, big = 0.0, 0.0
  for c0, n in chunks:
    for h in range(HV):
      ref = np.linalg.inv(np.eye(n) + A32[c0:c0 + n, h, :n])
      blk = Ai[c0:c0 + n, h, :n]
      assert np.all(np.isfinite(blk)) and np.all(np.triu(Ai[c0:c0 + n, h], 1) == 0)
      worst = max(worst, float(np.linalg.norm(blk - ref) / np.linalg.norm(ref)))
      big = max(big, float(np.abs(ref).max()))
  return worst, big


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--HV", type=int, default=4)
  p.add_argument("--K", type=int, default=128)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=None)
  a = p.parse_args()
  _emulate_tf32x3()
  rows = []
  head = f"{'case':<42} {'|Ai| max':>9}" + "".join(
      f" {name + ' subst':>15} {'power8':>9} {'ratio':>6}" for name, _, _ in PRECISIONS)
  print(head)
  for i, (name, keys, eps, beta, decay) in enumerate(CASES):
    rng = np.random.default_rng(a.seed + i)
    A, cu, chunks = build_A(rng, keys, eps, beta, decay, a.HV, a.K)
    A32 = jnp.asarray(A, jnp.float32)
    A32_64 = np.asarray(A32, np.float64)
    cu_j = jnp.asarray(cu, jnp.int32)
    desc = chunk_descriptors(cu_j, len(chunks))
    row = dict(case=name, keys=keys, eps=eps, beta=beta, decay=decay)
    for prec, dtype, over in PRECISIONS:
      for diag in ("subst", "power8"):
        cfg = pk.FwdConfig(solve_diag=diag, **over)
        Ai = pk._solve(A32, cu_j, desc, M=1, dtype=dtype, backend="interpret", config=cfg)
        err, big = errors(np.asarray(jnp.asarray(Ai, jnp.float64)), A32_64, chunks, a.HV)
        row[f"{prec}/{diag}"] = err
        row["ref_max_abs"] = big
      row[f"{prec}/ratio"] = row[f"{prec}/power8"] / row[f"{prec}/subst"]
    rows.append(row)
    print(f"{name:<42} {row['ref_max_abs']:>9.3g}" + "".join(
        f" {row[f'{q}/subst']:>15.2e} {row[f'{q}/power8']:>9.2e} {row[f'{q}/ratio']:>6.2f}"
        for q, _, _ in PRECISIONS), flush=True)
  worst = {q: max(r[f"{q}/ratio"] for r in rows) for q, _, _ in PRECISIONS}
  print("worst power8 / subst ratio:", ", ".join(f"{q} {v:.2f}" for q, v in worst.items()))
  if a.out:
    meta = dict(common.run_meta(common.versions()),
                title="Ai = (I + A)^-1: solve_diag subst against power8, rms ratio against the "
                      "float64 inverse, worst chunk per case (Triton interpreter; tf32x3 "
                      "emulated)")
    with open(a.out, "w") as f:
      json.dump(dict(meta=meta, config=dict(vars(a), lengths=LENGTHS), rows=rows,
                     worst_ratio=worst), f, indent=1)


if __name__ == "__main__":
  main()
