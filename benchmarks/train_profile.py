"""Kernel profile of one training step of the prefill (fwd+bwd through the Triton kernels).

Prints, per kernel (Triton kernels under their names, XLA fusions under theirs), its device
time per call, for the rows of benchmarks/train.py on the same inputs (train.shapes,
train.host_inputs: bf16, logsigmoid decays, beta in (0, 1), L2-normalised q and k inside the op).

With --variant (repeatable) or --variants (';'-separated), each row also runs the backward under
other block configs (gdp_jax._prefill_bwd.BwdConfig fields, e.g. "o_bk=128,o_warps=8" or
"h_split=4": the reverse state pass in 4 pieces per sequence; FwdConfig fields for the training
forward; "fwd.h_stages=2" for a field both have), profiled the same way, and checks
each variant's gradients against the default config's in the same process: the relative error
||variant - default|| / ||default|| per input (bf16 inputs: different tilings round differently,
so expect about 1e-3, not 0). A closing table puts each run's step time and its time in the
kernels the variants touch beside the default's.

Usage (GPU, repository root on PYTHONPATH):
  python3 benchmarks/train_profile.py [--rows 0,4] [--variant o_bk=128,o_warps=8] [--top 16]
  python3 benchmarks/train_profile.py --smoke --variant o_bk=128   # CPU: interpreter, tiny rows
  python3 benchmarks/train_profile.py --dtype float32 --variant f32_precision=ieee

--dtype float32 casts the bf16 inputs to float32; there f32_precision (the dots' precision,
docs/performance.md "Compile time") is set for the forward rule's kernels too.

--grads FILE saves the default config's gradients of each row (float32, .npz); --grads-ref FILE
compares them with such a file written by another tree (a kernel change timed in its own process
on the same inputs): the relative error per input, beside the timing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import train  # noqa: E402

# The Triton kernels whose time the closing table lists per run: the training forward's and the
# backward's.
KERNELS = ("chunk_kkt", "chunk_solve", "chunk_h_fwd", "chunk_h_chain", "chunk_o_fwd",
           "chunk_dv_local", "chunk_h_bwd", "chunk_o_bwd", "chunk_wy_bwd", "qk_bwd")


def _targets(name: str) -> list[tuple[str, str]]:
  """The (config, field) pairs a variant name sets: "bwd" (BwdConfig) and/or "fwd" (FwdConfig);
  an unprefixed field that both configs have sets both."""
  from gdp_jax import _prefill_bwd
  from gdp_jax import _prefill_kernels as pk
  which, _, field = name.rpartition(".")
  return [(w, field) for w, cls in (("bwd", _prefill_bwd.BwdConfig), ("fwd", pk.FwdConfig))
          if which in ("", w) and field in cls._fields]


def parse_variant(text: str) -> dict:
  """"o_bk=128,o_warps=8" -> {"o_bk": 128, "o_warps": 8}; names checked against BwdConfig and
  FwdConfig (a FwdConfig field sets the forward rule's kernels, e.g. solve_precision=tf32). A
  field both configs have (h_stages, f32_precision) sets both, unless prefixed "fwd." or "bwd."
  (fwd.h_stages=2: the training forward's scan only). Values are ints, or strings where they are
  not digits."""
  from gdp_jax import _prefill_bwd
  from gdp_jax import _prefill_kernels as pk
  out = {}
  for kv in filter(None, text.split(",")):
    name, _, value = kv.partition("=")
    if not _targets(name):
      bwd, fwd = (", ".join(sorted(c._fields)) for c in (_prefill_bwd.BwdConfig, pk.FwdConfig))
      raise SystemExit(f"--variant: {name!r} is not a field of BwdConfig ({bwd}) or FwdConfig "
                       f"({fwd}), optionally prefixed bwd. or fwd.")
    out[name] = int(value) if value.lstrip("-").isdigit() else value  # f32_precision=ieee
  return out


def split_variant(var: dict):
  """(BwdConfig, FwdConfig) of a variant: each field to the config(s) `_targets` names;
  f32_precision to both unless prefixed (as the public entry point's configs would be set)."""
  from gdp_jax import _prefill_bwd
  from gdp_jax import _prefill_kernels as pk
  picked = {"bwd": {}, "fwd": {}}
  for name, value in var.items():
    for w, field in _targets(name):
      picked[w][field] = value
  cfg = _prefill_bwd.BwdConfig()._replace(**picked["bwd"])
  fwd = pk.FwdConfig(f32_precision=cfg.f32_precision)._replace(**picked["fwd"])
  return cfg, fwd


def rel_err(a, b) -> float:
  """||a - b|| / ||b|| in float64."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def grad_errs(grads: dict, ref: dict) -> str:
  """Each input of ref against it, by relative error: "dq 1.2e-03 dk ..."."""
  return " ".join(f"d{n} {rel_err(grads[n], r):.1e}" for n, r in ref.items())


def kernel_us(prof: dict, per: int) -> dict:
  """Device time per step of each listed kernel (summed over its launches)."""
  return {k: sum(e["us"] for e in prof["kernels"] if k in e["name"]) / per for k in KERNELS}


def jla_runs(r: dict, h: dict, dt, do, smoke: bool):
  """("jla fwd", f) and ("jla fwd+bwd", f), f(x) on the inputs x of our runs: jla's forward and
  the jitted value_and_grad of <o, do> through it (packed rows by segment ids)."""
  import jax
  import jax.numpy as jnp
  op, _ = train.jax_op("jla", r, "reference" if smoke else "triton")
  kw = {"segment_ids": jnp.asarray(h["segment_ids"])} if "segment_ids" in h else {}

  def fwd(x):
    return op(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)

  def loss(x):
    return jnp.sum(fwd(x).astype(jnp.float32) * do.astype(jnp.float32))

  return [("jla fwd", jax.jit(fwd)), ("jla fwd+bwd", jax.jit(jax.value_and_grad(loss)))]


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--rows", default="0")
  p.add_argument("--variant", action="append", default=[],
                 help="BwdConfig overrides, e.g. o_bk=128,o_warps=8 (repeatable)")
  p.add_argument("--variants", default="", help="';'-separated BwdConfig overrides")
  p.add_argument("--top", type=int, default=16, help="how many kernels to list per run")
  p.add_argument("--smoke", action="store_true",
                 help="CPU: the interpreter on train.py's smoke rows (checks the script, times "
                      "nothing of interest)")
  p.add_argument("--json", default=None,
                 help="also write each run's step ms and backward kernel us to this file")
  p.add_argument("--jla", action="store_true",
                 help="also profile jax-linear-attention's forward and fwd+bwd on the same inputs "
                      "(its Mosaic GPU kernels; with --smoke its jnp reference)")
  p.add_argument("--grads", default=None, help="save the default config's gradients (.npz)")
  p.add_argument("--grads-ref", default=None,
                 help="compare the default config's gradients with this --grads file")
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                 help="of q, k, v, beta and the output cotangent (g stays float32)")
  args = p.parse_args()
  common.setup_env(cpu_smoke=args.smoke)
  import jax
  import jax.numpy as jnp
  common.fix_triton_cache()
  from gdp_jax import _prefill_bwd
  variants = [parse_variant(v) for v in args.variant + args.variants.split(";") if v]
  backend = "interpret" if args.smoke else "triton"
  calls = 1 if args.smoke else 3
  rows = train.shapes(smoke=args.smoke)
  table = []
  saved = {}
  ref_file = dict(np.load(args.grads_ref)) if args.grads_ref else {}

  meta = {}

  def save(**entry):
    """Adds one run to the --json file, rewritten after every run."""
    if args.json:
      table.append(entry)
      if not meta:   # date, commit, command, versions and device, once
        meta.update(common.run_meta(), dtype=args.dtype)
      with open(args.json, "w") as fh:
        json.dump(dict(meta=meta, runs=table), fh, indent=1)

  def measure(title, f, x):
    """(f(x), ms per call, kernel profile) with the profile printed, or None where f fails (a
    variant that does not compile or fit, a shape jla refuses): reported, and the rows go on."""
    try:
      out = jax.block_until_ready(f(x))
      ms = common.time_jax(lambda: f(x))["ms"]
      prof = common.profile_jax(lambda: f(x), calls=calls)
    except Exception as e:
      print(f"\n-- {title}: {type(e).__name__}: {str(e)[:300]}")
      return None
    common.print_profile(f"{title} {args.dtype}: {ms:.3f} ms", prof, per=calls, top=args.top)
    return out, ms, prof

  for i in map(int, args.rows.split(",")):
    r = rows[i]
    K, M = r["K"], r["M"]
    h = train.host_inputs(r, common.row_seed(r))
    dt = jnp.dtype(args.dtype)
    x = {n: jnp.asarray(h[n]) if n == "g" else jnp.asarray(h[n]).astype(dt)
         for n in ("q", "k", "v", "g", "beta")}
    do = jnp.asarray(h["do"]).astype(dt)
    cu = jnp.asarray(h["cu_seqlens"]) if "cu_seqlens" in h else None

    def step_under(var):
      """The jitted value_and_grad of <o, do> with the kernels under the variant's configs (the
      training path that the public entry point takes, with explicit configs)."""
      cfg, fcfg = split_variant(var)
      static = _prefill_bwd._Static(M, K ** -0.5, False, True, backend, cfg, fcfg)

      def loss(x):
        o, _ = _prefill_bwd._prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], None, cu,
                                     static)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

      return jax.jit(jax.value_and_grad(loss)), jax.jit(loss)

    default_step, fwd = step_under({})
    runs = [("fwd", fwd, None), ("fwd+bwd", default_step, {})]
    runs += [(f"fwd+bwd {var}", step_under(var)[0], var) for var in variants]
    ref_grads, summary = None, []
    for name, f, var in runs:
      got = measure(f"{name} row {i} {r}", f, x)
      if got is None:
        continue
      out, ms, prof = got
      errs = ref_errs = ""
      if var is not None:
        grads = out[1]
        if not var:
          ref_grads = grads
          if args.grads:
            saved.update({f"row{i}_d{n}": np.asarray(a, np.float32) for n, a in grads.items()})
            np.savez(args.grads, **saved)
          other = {n: ref_file[f"row{i}_d{n}"] for n in grads if f"row{i}_d{n}" in ref_file}
          if other:
            ref_errs = grad_errs(grads, other)
            print(f"   gradients against {args.grads_ref}: {ref_errs}")
        elif ref_grads is not None:
          errs = grad_errs(grads, ref_grads)
          print(f"   gradients against the default config's: {errs}")
      summary.append((name, ms, kernel_us(prof, calls), errs))
      save(row=i, run=name, variant=var, ms=ms, kernel_us=kernel_us(prof, calls),
           grad_err_vs_default=errs, **({"grad_err_vs_ref": ref_errs} if ref_errs else {}))
    try:
      extra = jla_runs(r, h, dt, do, smoke=args.smoke) if args.jla else []
    except ImportError as e:
      print(f"\n-- jla: not installed ({e})")
      extra = []
    for name, f in extra:
      got = measure(f"{name} row {i} {r}", f, x)
      if got is not None:
        _, ms, prof = got
        top = ", ".join(f"{k['name']} {k['us'] / calls:.1f}" for k in prof["kernels"][:args.top])
        save(row=i, run=name, variant=None, ms=ms, kernel_us={}, grad_err_vs_default="",
             kernels=top)
    print(f"\n-- row {i} {r}: step ms, backward kernels us per step, gradient error vs default")
    print("   " + f"{'run':<44} {'ms':>7} " + " ".join(f"{k:>14}" for k in KERNELS))
    for name, ms, us, errs in summary:
      print(f"   {name[:44]:<44} {ms:7.3f} " + " ".join(f"{us[k]:14.1f}" for k in KERNELS)
            + (f"   {errs}" if errs else ""))


if __name__ == "__main__":
  main()
