"""Kernel profile of one training step of the prefill (fwd+bwd through the Triton kernels).

Prints, per kernel (Triton kernels under their names, XLA fusions under theirs), its device
time per call, for the rows of benchmarks/train.py on the same inputs (train.shapes,
train.host_inputs: bf16, logsigmoid decays, beta in (0, 1), L2-normalised q and k inside the op).

With --variants, each row also runs the backward under other block configs
(gdp_jax._prefill_bwd.BwdConfig fields, e.g. "h_bv=64;h_bv=16,wy_warps=8;h_split=4": the
reverse state pass in 4 pieces per sequence), profiled the same way.

Usage (GPU, repository root on PYTHONPATH):
  python3 benchmarks/train_profile.py [--rows 0,4] [--variants "h_bv=64;wy_warps=8"] [--top 16]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import train  # noqa: E402

def main():
  p = argparse.ArgumentParser()
  p.add_argument("--rows", default="0")
  p.add_argument("--variants", default="", help="';'-separated BwdConfig overrides")
  p.add_argument("--top", type=int, default=16, help="how many kernels to list per run")
  args = p.parse_args()
  common.setup_env(cpu_smoke=False)
  import jax
  import jax.numpy as jnp
  common.fix_triton_cache()
  import gdp_jax
  from gdp_jax import _prefill_bwd
  variants = [dict((kv.split("=")[0], int(kv.split("=")[1])) for kv in v.split(","))
              for v in args.variants.split(";") if v]
  rows = train.shapes(smoke=False)
  for i in map(int, args.rows.split(",")):
    r = rows[i]
    K, M = r["K"], r["M"]
    h = train.host_inputs(r, common.row_seed(r))
    x = {n: jnp.asarray(h[n]) for n in ("q", "k", "v", "g", "beta")}
    do = jnp.asarray(h["do"])
    kw = dict(num_householder=M, use_qk_l2norm_in_kernel=True, backend="triton")
    if "cu_seqlens" in h:
      kw["cu_seqlens"] = jnp.asarray(h["cu_seqlens"])

    def loss(x):
      o, _ = gdp_jax.chunk_gated_delta_product(**x, **kw)
      return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

    step = jax.jit(jax.value_and_grad(loss))
    fwd = jax.jit(loss)
    runs = [("fwd", fwd), ("fwd+bwd", step)]
    for var in variants:
      static = _prefill_bwd._Static(M, K ** -0.5, False, True, "triton",
                                    _prefill_bwd.BwdConfig()._replace(**var))

      def vloss(x, static=static):
        o, _ = _prefill_bwd._prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], None,
                                     kw.get("cu_seqlens"), static)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

      runs.append((f"fwd+bwd {var}", jax.jit(jax.value_and_grad(vloss))))
    for name, f in runs:
      try:
        ms = common.time_jax(lambda: f(x))["ms"]
        prof = common.profile_jax(lambda: f(x), calls=3)
      except Exception as e:  # a variant that does not compile or fit: report, go on
        print(f"\n-- {name} row {i}: {type(e).__name__}: {str(e)[:300]}")
        continue
      common.print_profile(f"{name} row {i} {r}: {ms:.3f} ms", prof, per=3, top=args.top)


if __name__ == "__main__":
  main()
