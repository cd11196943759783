"""Kernel profile of one training step of the prefill (fwd+bwd through the Triton kernels).

Prints, per kernel (Triton kernels under their names, XLA fusions under theirs), its device
time per call, for the rows of benchmarks/train.py (bf16, logsigmoid decays, beta in (0, 1),
L2-normalised q and k inside the op).

With --variants, each row also runs the backward under other block configs
(gdp_jax._prefill_bwd.BwdConfig fields, e.g. "h_bv=64;h_bv=16,wy_warps=8"), profiled the same way.

Usage (GPU, repository root on PYTHONPATH):
  python3 benchmarks/train_profile.py [--rows 0,4] [--variants "h_bv=64;wy_warps=8"]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

ROWS = [dict(B=4, T=2048, H=16, K=128, V=128, M=2), dict(B=4, T=2048, H=16, K=128, V=128, M=3),
        dict(B=1, T=8192, H=16, K=128, V=128, M=2), dict(B=1, T=16384, H=16, K=128, V=128, M=2,
                                                          N=8),
        dict(B=4, T=2048, H=6, K=256, V=512, M=2)]


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--rows", default="0")
  p.add_argument("--variants", default="", help="';'-separated BwdConfig overrides")
  args = p.parse_args()
  common.setup_env(cpu_smoke=False)
  import jax
  import jax.numpy as jnp
  import numpy as np
  common.fix_triton_cache()
  import gdp_jax
  from gdp_jax import _prefill_bwd
  variants = [dict((kv.split("=")[0], int(kv.split("=")[1])) for kv in v.split(","))
              for v in args.variants.split(";") if v]
  for i in map(int, args.rows.split(",")):
    r = ROWS[i]
    B, T, H, K, V, M = (r[n] for n in "BTHKVM")
    rng = np.random.default_rng(i)
    bf = jnp.bfloat16
    x = dict(q=jnp.asarray(rng.standard_normal((B, T, H, K)), bf),
             k=jnp.asarray(rng.standard_normal((B, T * M, H, K)), bf),
             v=jnp.asarray(rng.standard_normal((B, T * M, H, V)), bf),
             g=jnp.asarray(jax.nn.log_sigmoid(rng.standard_normal((B, T, H)) + 3), jnp.float32),
             beta=jnp.asarray(jax.nn.sigmoid(rng.standard_normal((B, T * M, H))), bf))
    do = jnp.asarray(rng.standard_normal((B, T, H, V)), bf)
    kw = dict(num_householder=M, use_qk_l2norm_in_kernel=True, backend="triton")
    if "N" in r:
      cuts = np.sort(rng.choice(np.arange(1, T), r["N"] - 1, replace=False))
      kw["cu_seqlens"] = jnp.asarray(np.concatenate([[0], cuts, [T]]), jnp.int32)

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
      common.print_profile(f"{name} row {i} {r}: {ms:.3f} ms", prof, per=3, top=16)


if __name__ == "__main__":
  main()
