"""Where prefill time goes: each stage of the chunked pipeline timed on its own, and a sweep of
the pinned block sizes and warps of the stages that dominate.

Without hardware counters, a stage's share is measured by running it alone on the inputs the
previous stages produced (time variants, take differences). A stage's time includes
the launch of its jitted call: for stages of tens of microseconds that launch dominates (at
K=256 V=512 kkt and solve read 55 and 50 us here, 24 and 30 us in prefill.py --profile), so
compare small stages with the profile, not with this table. Each config variant is
checked against the default config's output before its time counts: block sizes change the
summation order, so the check is a relative error (bf16 level), not bits. Stage 4 runs inside
our scan, so our scan column compares with fla-core's wy + scan.

    python3 benchmarks/prefill_stages.py [--rows 0,1] [--sweep] [--fla] [--like-prefill]
                                         [--budget-s 240]
    python3 benchmarks/prefill_stages.py --cpu-smoke      # the plumbing, in the interpreter

Writes $OUT/prefill_stages.json and prints a table per row (ms per stage, share of the total).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

# The rows of benchmarks/prefill.py: (B, T, H, HV, K, V, M).
ROWS = [(4, 2048, 16, 16, 128, 128, 2), (4, 2048, 16, 16, 128, 128, 3),
        (1, 8192, 16, 16, 128, 128, 2), (8, 4096, 32, 32, 128, 128, 2),
        (4, 2048, 6, 6, 256, 512, 2)]
SMOKE_ROWS = [(1, 130, 1, 2, 32, 32, 2)]

# Variants per stage: the fields of gdp_jax._prefill_kernels.FwdConfig each one overrides. Dict order is sweep
# order, the stages with the most to gain first, so a budget cut drops the least likely winners;
# combinations that lost everywhere in the first full sweep (1-stage scans, 2-warp scans; see
# docs/performance.md) are left out.
SWEEP = {
    "solve": [dict(solve_warps=w, solve_precision=p) for p in ("tf32x3", "tf32", "ieee")
              for w in (1, 2, 4)],
    # BV 16: twice the programs of BV 32 where few sequences x heads leave SMs idle (row 2).
    "scan": [dict(h_warps=w, h_stages=s, h_bv_wide=bv, h_bv_big_k=bv)
             for w in (4, 8) for s in (2, 3) for bv in (16, 32, 64)],
    "output": [dict(o_warps=w, o_bv=bv, o_bk=bk, o_stages=s) for w in (4, 8)
               for bv in (64, 128) for bk in (64, 128) for s in (2, 3)],
    "kkt": [dict(kkt_warps=w, kkt_bk=bk) for w in (2, 4, 8) for bk in (64, 128)],
}


def make_inputs(B, T, H, HV, K, V, M, seed=0, like_prefill=False):
  """bf16 q, k, v, keys of unit norm, float32 beta. With `like_prefill`, the inputs of
  benchmarks/prefill.py instead: raw keys (normalised in the kernels), beta in bf16 and its
  decays (logsigmoid of U(1, 5))."""
  import jax.numpy as jnp
  import numpy as np
  rng = np.random.default_rng(seed)
  k = rng.standard_normal((B * T * M, H, K)).astype(np.float32)
  if not like_prefill:
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
  bf = jnp.bfloat16
  if like_prefill:
    g = -np.log1p(np.exp(-rng.uniform(1.0, 5.0, (B * T, HV))))
    beta = jnp.asarray(1 / (1 + np.exp(-rng.standard_normal((B * T * M, HV)))), bf)
  else:
    g = -rng.exponential(0.05, (B * T, HV))
    beta = jnp.asarray(rng.uniform(0, 1, (B * T * M, HV)), jnp.float32)
  return dict(
      q=jnp.asarray(rng.standard_normal((B * T, H, K)) / np.sqrt(K), bf),
      k=jnp.asarray(k, bf),
      v=jnp.asarray(rng.standard_normal((B * T * M, HV, V)), bf),
      g=jnp.asarray(g, jnp.float32), beta=beta)


def _descriptors(pk, B, T, M):
  """cu_seqlens and the expanded stream's chunk descriptors of B dense sequences of T tokens."""
  import jax.numpy as jnp
  import numpy as np
  return (jnp.asarray(np.arange(B + 1, dtype=np.int32) * T),
          jnp.asarray(pk._dense_descriptors(B, T * M)))


def stage_calls(pk, x, B, T, M, backend, config, l2norm=False):
  """The stages as jitted functions (lazy: nothing compiles until a call) under the block
  config `config` (a pk.FwdConfig). With `l2norm`, stage 2 computes the key row factors rk and
  every later stage takes them, as the prefill does with use_qk_l2norm_in_kernel; else rk is
  None. The scan is stages 4 and 5 in one kernel, as in the prefill, split into pieces as the
  prefill splits it (its summary and chain launches included)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  HV = x["v"].shape[1]
  K = x["k"].shape[2]
  V = x["v"].shape[2]
  cu, desc_x = _descriptors(pk, B, T, M)
  nc = -(-T // pk.BT)
  desc_t = jnp.asarray(pk._dense_descriptors(B, T))
  offsets = jnp.asarray(np.arange(B + 1, dtype=np.int32) * nc)
  calls = {
      # Stage 1 is folded into stages 2 and 6.
      "kkt": jax.jit(lambda k, b, g: pk._kkt(k, b, g, cu, desc_x, HV=HV, M=M,
                                             backend=backend, l2norm=l2norm, config=config)),
      "solve": jax.jit(lambda A: pk._solve(A, cu, desc_x, M=M, dtype=x["k"].dtype,
                                           backend=backend, config=config)),
      "scan": jax.jit(lambda k, v, b, Ai, gx, rk: pk._scan(
          k, v, b, Ai, gx, cu, offsets, B * nc, M=M, h0=None, state_indices=None,
          final_kind="dense", h_dtype=x["k"].dtype, snap_dtype=None, backend=backend,
          rk=rk, config=config, pieces=pk._pieces(B, T, M, None, pk._piece_length(config, HV, K, V, M)))),
      "output": jax.jit(lambda q, k, vn, h, g, rk: pk._output(
          q, k, vn, h, g, None, B, cu, desc_t, M=M, scale=K ** -0.5, out_dtype=x["v"].dtype,
          backend=backend, rk=rk, config=config)),
  }
  return calls


def stage_args(calls, x):
  """Each stage's inputs, from running the stages before it once."""
  A, gx, rk = calls["kkt"](x["k"], x["beta"], x["g"])
  Ai = calls["solve"](A)
  scan_args = (x["k"], x["v"], x["beta"], Ai, gx, rk)
  h, _, v_new, _ = calls["scan"](*scan_args)
  args = {"kkt": (x["k"], x["beta"], x["g"]), "solve": (A,), "scan": scan_args,
          "output": (x["q"], x["k"], v_new, h, x["g"], rk)}
  return args


def fla_stage_times(x, B, T, M):
  """fla-core's forward stages (the calls inside its chunk_gated_delta_product_fwd) on the same
  inputs, ms each (do_bench medians); each stage's inputs come from running the ones before."""
  import torch
  from fla.ops.common.chunk_scaled_dot_kkt import chunk_scaled_dot_kkt_fwd
  from fla.ops.gated_delta_product.chunk_deltaproduct_h import chunk_gated_delta_product_fwd_h
  from fla.ops.gated_delta_product.chunk_deltaproduct_o import chunk_gated_delta_product_fwd_o
  from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd
  from fla.ops.utils import chunk_local_cumsum, solve_tril
  from fla.ops.utils.constant import RCP_LN2
  torch.set_grad_enabled(False)
  t = {n: common.to_torch(x[n]) for n in ("q", "k", "v", "g", "beta")}
  q = t["q"].reshape(B, T, *t["q"].shape[1:])
  k = t["k"].reshape(B, T * M, *t["k"].shape[1:])
  v = t["v"].reshape(B, T * M, *t["v"].shape[1:])
  g = t["g"].reshape(B, T, -1)
  beta = t["beta"].reshape(B, T * M, -1)
  K = k.shape[-1]

  def cumsum():
    gi = g.new_zeros(B, T, M, g.shape[-1])
    gi[:, :, 0] = g
    gi = gi.reshape(B, T * M, -1)
    return (chunk_local_cumsum(g, chunk_size=64, scale=RCP_LN2, output_dtype=torch.float32),
            chunk_local_cumsum(gi, chunk_size=64, scale=RCP_LN2, output_dtype=torch.float32))
  gu, gx = cumsum()
  kkt = lambda: chunk_scaled_dot_kkt_fwd(k=k, g=gx, beta=beta, output_dtype=torch.float32)
  A = kkt()
  solve = lambda: solve_tril(A=A, output_dtype=k.dtype)
  Ai = solve()
  wy = lambda: recompute_w_u_fwd(k=k, v=v, beta=beta, A=Ai, g=gx)
  w, u = wy()
  scan = lambda: chunk_gated_delta_product_fwd_h(
      k=k, w=w, u=u, g=gx, initial_state=None, output_final_state=True, num_householder=M)
  h, v_new, _ = scan()
  output = lambda: chunk_gated_delta_product_fwd_o(
      q=q, k=k, v=v_new, h=h, g=gu, scale=K ** -0.5, num_householder=M)
  output()
  return {s: common.time_torch(f) for s, f in (("cumsum", cumsum), ("kkt", kkt),
                                                ("solve", solve), ("wy", wy), ("scan", scan),
                                                ("output", output))}


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--cpu-smoke", action="store_true")
  p.add_argument("--rows", default=None, help="comma-separated row numbers (default: all)")
  p.add_argument("--sweep", action="store_true", help="also sweep the configs of big stages")
  p.add_argument("--budget-s", type=float, default=240.0)
  p.add_argument("--out", default=None)
  p.add_argument("--fla", action="store_true", help="also time fla-core's stages")
  p.add_argument("--like-prefill", action="store_true",
                 help="prefill.py's inputs: raw keys normalised in the kernels, bf16 beta, "
                      "its decays")
  a = p.parse_args()
  common.setup_env(a.cpu_smoke)
  import jax
  from gdp_jax import _prefill_kernels as pk
  common.fix_triton_cache()
  backend = "interpret" if a.cpu_smoke else "triton"
  rows = SMOKE_ROWS if a.cpu_smoke else ROWS
  if a.rows:
    rows = [rows[int(i)] for i in a.rows.split(",")]
  budget = common.Budget(a.budget_s)
  res = common.Results(os.path.join(common.out_dir(a.out), "prefill_stages.json"),
                       dict(common.versions(), backend=backend))
  default_cfg = pk.FwdConfig()
  for shape in rows:
    B, T, H, HV, K, V, M = shape
    row = dict(B=B, T=T, H=H, HV=HV, K=K, V=V, M=M)

    def body(row):
      x = make_inputs(*shape, like_prefill=a.like_prefill)
      calls = stage_calls(pk, x, B, T, M, backend, default_cfg, l2norm=a.like_prefill)
      args = stage_args(calls, x)
      times = {s: common.time_jax(lambda s=s: calls[s](*args[s]))["ms"] for s in calls}
      row.update({f"{s}_ms": t for s, t in times.items()})
      total = sum(times.values())
      row["sum_ms"] = total
      print(f"[stages] B={B} T={T} H={H} HV={HV} K={K} V={V} M={M}: "
            + ", ".join(f"{s} {t:.3f} ms ({t / total:.0%})" for s, t in times.items())
            + f"; sum {total:.3f} ms", flush=True)
      if a.fla and not a.cpu_smoke:
        try:
          ft = fla_stage_times(x, B, T, M)
          row.update({f"fla_{s}_ms": v for s, v in ft.items()})
          row["fla_sum_ms"] = sum(ft.values())
          # fla's cumsum has no counterpart of ours (folded into kkt and output).
          print("[stages] fla-core: " + ", ".join(
              f"{s} {v:.3f} ms" + (f" (ours/fla {times[s] / v:.2f})" if s in times else "")
              for s, v in ft.items())
                + f"; sum {row['fla_sum_ms']:.3f} ms", flush=True)
        except Exception as e:  # fla absent or its API moved: our columns still count
          print(f"[stages] fla-core stages failed: {type(e).__name__}: {e}"[:300], flush=True)
      if not a.sweep:
        return
      ref = {s: calls[s](*args[s]) for s in SWEEP}
      for stage, variants in SWEEP.items():
        best = (times[stage], "default")
        for over in variants:
          if budget.over(20):
            row[f"{stage}_sweep"] = "cut by the budget"
            break
          try:
            c2 = stage_calls(pk, x, B, T, M, backend, default_cfg._replace(**over),
                             l2norm=a.like_prefill)
            out = c2[stage](*args[stage])
            err = common.worst(*[common.rel_err(o, r) for o, r in
                                 zip(jax.tree.leaves(out), jax.tree.leaves(ref[stage]))])
            ms = common.time_jax(lambda: c2[stage](*args[stage]))["ms"]
            tag = ",".join(f"{k}={v}" for k, v in over.items())
            print(f"[sweep] {stage} {tag}: {ms:.4f} ms, err vs default {err:.1e}", flush=True)
            if err < 2e-2 and ms < best[0]:
              best = (ms, tag)
          except Exception as e:  # a config that does not compile is a result, not a crash
            print(f"[sweep] {stage} {over}: failed: {type(e).__name__}: {e}"[:300], flush=True)
        row[f"{stage}_best"] = f"{best[1]} ({best[0]:.4f} ms)"

    common.run_row(res, "stages", row, body, budget, margin=30)
  common.print_table("prefill stages (ms)", res.data["sections"].get("stages", []),
                     [(c, c, ".3f") for c in ("kkt_ms", "solve_ms", "scan_ms",
                                              "output_ms", "sum_ms")])
  common.print_table("fla-core stages (ms)", res.data["sections"].get("stages", []),
                     [(c, c, ".3f") for c in ("fla_cumsum_ms", "fla_kkt_ms", "fla_solve_ms",
                                              "fla_wy_ms", "fla_scan_ms", "fla_output_ms",
                                              "fla_sum_ms")])
  return 0


if __name__ == "__main__":
  sys.exit(main())
