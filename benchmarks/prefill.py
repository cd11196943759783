"""Prefill benchmark: `gdp_jax.chunk_gated_delta_product` against jax-linear-attention and fla-core.

Rows (bf16 q/k/v/beta, float32 log decays, q and k L2-normalised in the kernel on every side,
output_final_state=True; fla-core has no GVA, so HV == H everywhere), numbered for --rows:

  0: B=4 T=2048 H=16 K=V=128 M=2 | 1: the same with M=3 | 2: B=1 T=8192 H=16 M=2 |
  3: B=8 T=4096 H=32 M=2 | 4: B=4 T=2048 H=6 K=256 V=512 M=2 (the FLA layer's defaults) |
  5: 8 packed sequences, 16384 tokens, H=16 K=V=128 M=2 (lengths as benchmarks/train.py draws
     them; cu_seqlens for ours and fla-core, segment_ids for jla)

Per row: our jitted time; jax-linear-attention's (jla 0.1.0, its Mosaic GPU forward, Hopper
only, K and V in {64, 128}: a row it rejects records its refusal), jitted in this process on the
same inputs; fla-core's (do_bench median, and replayed from a CUDA graph: its device time without
its Python launch cost; not for packed rows, where fla-core reads cu_seqlens on the host); the
two floors (matmul FLOPs of the chunked algorithm over 790 TFLOP/s, and the bytes that must
move over the copy bandwidth measured in this process); and the relative errors of jla's and
fla's o and final state against ours (about 1e-2 or less is bf16 agreement; a miscompiled
config or a layout mistake shows as O(1)).
For the first row also: the first-call cost (lowering, where jax_triton compiles the Triton
kernels, XLA compile, first run) and the jitted `lax.scan` reference, whose time over ours is
the speed-up the project targets (>= 50x), plus the chunked jnp reference.

With --profile, each row also prints the kernels of ours (jax.profiler, three calls back to back,
with the idle time before each kernel) and, after all rows, those of one call of fla-core's
(torch.profiler; last, because CUPTI refuses jax.profiler once torch.profiler has run): device
time per kernel, so stages compare side by side in one run.

Numbers go to $OUT/prefill.json after every row; tables to stdout. `--cpu-smoke` runs tiny
shapes through Triton's interpreter without torch or fla, and jla's jnp chunked reference in
place of its kernels (when jla imports), to prove the plumbing.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

MATMUL_FLOPS = 790e12  # dense bf16 matmul rate, as measured on an H200


def parse_args():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--cpu-smoke", action="store_true",
                 help="tiny shapes, Triton interpreter, no torch/fla (plumbing check)")
  p.add_argument("--budget-s", type=float, default=240.0,
                 help="stop starting rows after this many seconds")
  p.add_argument("--out", default=None, help="output folder (default $OUT or ./bench_out)")
  p.add_argument("--skip-fla", action="store_true")
  p.add_argument("--skip-jla", action="store_true", help="leave jax-linear-attention out")
  p.add_argument("--skip-ref", action="store_true", help="skip the reference timings")
  p.add_argument("--ref-rows", default="0",
                 help="table rows (numbers as in --rows) that also time the jnp references; "
                      "'all' for every row (each costs a GPU compile of the scan)")
  p.add_argument("--rows", default=None,
                 help="comma-separated row numbers of the table (default: all)")
  p.add_argument("--profile", action="store_true",
                 help="per row, also a kernel profile of ours (three calls, with the gaps between "
                      "kernels) and, after all rows, of one call of fla-core's")
  p.add_argument("--variant", default=None,
                 help="FwdConfig overrides, e.g. h_piece=32 or h_bv_wide=32,h_stages=2: each row "
                      "also times ours under them (checked against the default's output)")
  return p.parse_args()


def parse_variant(text):
  """'a=1,b=True,c=tf32' as a dict of FwdConfig overrides."""
  if not text:
    return {}
  lit = {"True": True, "False": False}
  return {k: lit.get(v, int(v) if v.lstrip("-").isdigit() else v)
          for k, v in (item.split("=", 1) for item in text.split(","))}


def flops(B, T, H, K, V, M):
  """Matmul FLOPs of the chunked forward (the solve's triangular work is left out).

  Per 64-row chunk of the expanded stream and head: K K^T (64*64*K*2), w and u
  (64*64*(K+V)*2), the state scan w@S and K^T@D (2 * 64*K*V*2). Per 64-token chunk and head:
  Q S (64*K*V*2), Q K^T and P@D over the chunk's M*64 expanded rows (M*64*64*(K+V)*2).
  """
  from gdp_jax._common import BT  # after common.setup_env, like every gdp_jax import here
  n_exp = math.ceil(T * M / BT)
  n_tok = math.ceil(T / BT)
  per_exp = BT * BT * K * 2 + BT * BT * (K + V) * 2 + BT * K * V * 2 * 2
  per_tok = BT * K * V * 2 + M * BT * BT * K * 2 + M * BT * BT * V * 2
  return B * H * (n_exp * per_exp + n_tok * per_tok)


def min_bytes(B, T, H, K, V, M, N=None):
  """q, k, v, g, beta read once (bf16, g float32), o written once (bf16), the final states
  float32 (one per sequence: B, or N packed ones)."""
  return (B * T * H * K * 2 + B * T * M * H * K * 2 + B * T * M * H * V * 2 + B * T * H * 4
          + B * T * M * H * 2 + B * T * H * V * 2 + (N or B) * H * K * V * 4)


class Bench:

  def __init__(self, args):
    self.smoke = args.cpu_smoke
    self.skip_ref = args.skip_ref
    self.profile = args.profile
    self.variant = parse_variant(args.variant)
    import jax
    import jax.numpy as jnp
    import gdp_jax
    common.fix_triton_cache()
    self.jax, self.jnp, self.gdp_jax = jax, jnp, gdp_jax
    self.backend = "interpret" if self.smoke else "triton"
    self.copy_Bps = None
    self.fla = None
    self.jla = None
    if not args.skip_jla:
      try:
        self.jla = common.jla_gated_delta_product(kernels=not self.smoke)
        if self.smoke:
          print("[prefill] smoke: jla's jnp chunked reference stands in for its Mosaic GPU "
                "kernels, which need a Hopper GPU")
      except ImportError as e:
        print(f"[prefill] jax-linear-attention unavailable, its columns stay empty: "
              f"{type(e).__name__}: {e}")
    if not (self.smoke or args.skip_fla):
      try:
        import torch
        from fla.ops.gated_delta_product import chunk_gated_delta_product
        torch.set_grad_enabled(False)  # fla saves tensors for backward only when grad is on
        self.torch, self.fla = torch, chunk_gated_delta_product
      except Exception as e:
        print(f"[prefill] fla-core unavailable, its columns stay empty: {type(e).__name__}: {e}")
      common.fix_triton_cache()

  def inputs(self, B, T, H, K, V, M, N=None, seed=None):
    """bf16 activations, logsigmoid decays in float32, beta = sigmoid(normal) in (0, 1); with N,
    the B == 1 row packs N sequences (cu_seqlens and segment_ids, lengths as train.py's). The
    seed defaults to one per row, so a later pass rebuilds a row's inputs exactly."""
    shape = dict(B=B, T=T, M=M, **({} if N is None else dict(N=N)))
    if seed is None:
      seed = common.row_seed(shape)
    jax, jnp = self.jax, self.jnp
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    bf16 = jnp.bfloat16
    pack = {} if N is None else {
        n: jnp.asarray(a) for n, a in common.packing(
            common.seq_lengths(T, N, common.row_seed(shape))).items()}
    return dict(**pack,
        q=jax.random.normal(ks[0], (B, T, H, K), jnp.float32).astype(bf16),
        k=jax.random.normal(ks[1], (B, T * M, H, K), jnp.float32).astype(bf16),
        v=jax.random.normal(ks[2], (B, T * M, H, V), jnp.float32).astype(bf16),
        g=jax.nn.log_sigmoid(jax.random.uniform(ks[3], (B, T, H), jnp.float32, 1.0, 5.0)),
        beta=jax.nn.sigmoid(jax.random.normal(ks[4], (B, T * M, H), jnp.float32)).astype(bf16),
    )

  def ours_fn(self, M, fn=None, backend=None, config=None):
    jax = self.jax
    fn = fn or self.gdp_jax.chunk_gated_delta_product
    kw = {} if backend is None else dict(backend=backend)
    if config is not None:
      kw["config"] = config

    def f(q, k, v, g, beta, cu_seqlens=None):
      return fn(q, k, v, g, beta, num_householder=M, output_final_state=True,
                use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, **kw)

    return jax.jit(f)

  @staticmethod
  def call_args(x):
    """Our call's arguments: q, k, v, g, beta and cu_seqlens (None unless packed)."""
    return (x["q"], x["k"], x["v"], x["g"], x["beta"], x.get("cu_seqlens"))

  def first_call(self, results, shape):
    """Lowering (jax_triton compiles every Triton kernel here, into an empty cache), XLA
    compile and the first run of the prefill at `shape`."""
    x = self.inputs(*shape["shape"], N=shape.get("N"), seed=0)
    f = self.ours_fn(shape["shape"][-1], backend=self.backend)
    args = self.call_args(x)
    t0 = time.perf_counter()
    lowered = f.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    self.jax.block_until_ready(compiled(*args))
    t3 = time.perf_counter()
    results.set_meta(compile_lower_s=t1 - t0, compile_xla_s=t2 - t1, compile_first_run_s=t3 - t2)
    packed = f" N={shape['N']}" if "N" in shape else ""
    print(f"[prefill] first call {shape['shape']}{packed}: lower (Triton compile) {t1 - t0:.2f} s, "
          f"XLA compile {t2 - t1:.2f} s, first run {t3 - t2:.3f} s")

  def row(self, row, with_ref, results):
    B, T, H, K, V, M = (row[n] for n in ("B", "T", "H", "K", "V", "M"))
    N = row.get("N")
    x = self.inputs(B, T, H, K, V, M, N=N)
    args = self.call_args(x)
    if N:
      row["seq_lengths"] = self.jnp.diff(x["cu_seqlens"]).tolist()
    row["flops"] = flops(B, T, H, K, V, M)
    row["bytes"] = min_bytes(B, T, H, K, V, M, N)
    row["flop_floor_ms"] = row["flops"] / MATMUL_FLOPS * 1e3
    if self.copy_Bps:
      row["byte_floor_ms"] = row["bytes"] / self.copy_Bps * 1e3

    f = self.ours_fn(M, backend=self.backend)
    o, ht = f(*args)
    self.jax.block_until_ready((o, ht))
    row["finite"] = bool(self.jnp.all(self.jnp.isfinite(o.astype(self.jnp.float32)))
                         and self.jnp.all(self.jnp.isfinite(ht)))
    t = common.time_jax(lambda: f(*args))
    row["ours_ms"], row["ours_spread"] = t["ms"], t["spread"]
    floor = max(row["flop_floor_ms"], row.get("byte_floor_ms") or 0.0)
    row["ours_over_floor"] = row["ours_ms"] / floor
    row["TFLOPs"] = row["flops"] / (row["ours_ms"] * 1e-3) / 1e12
    if self.variant:
      self.variant_columns(row, args, M, o)
    if self.profile:
      # Three calls back to back, as the timing loop runs them: the gaps between kernels are
      # the steady state's, not those of a lone call waiting on the host.
      prof = common.profile_jax(lambda: f(*args), calls=3)
      row["ours_kernel_ms"], row["ours_span_ms"] = prof["busy_us"] / 3e3, prof["span_us"] / 3e3
      row["profile_ours"] = prof
      common.print_profile(f"ours {row_name(row)}", prof, per=3, timeline=True)

    if self.jla is not None:
      self.jla_columns(row, x, M, o, ht)

    fo = None
    if self.fla is not None:
      fla_call = self.fla_fn(x, M)
      t0 = time.perf_counter()
      fo, fht = fla_call()  # autotunes on first call
      self.torch.cuda.synchronize()
      row["fla_first_call_s"] = time.perf_counter() - t0
      row["err_fla_o"] = common.rel_err(o, fo)
      row["err_fla_state"] = common.rel_err(ht, fht)
      row["fla_ms"] = common.time_torch(fla_call)
      row["ours_over_fla"] = row["ours_ms"] / row["fla_ms"]
      # do_bench's time includes fla-core's Python launches of its ~12 kernels when those
      # outlast the kernels, and that host cost moves from one process to the next (row 4:
      # 1.83 ms in one run, 0.81 in another). Replayed from a CUDA graph, its call costs its
      # device time only: the fastest fla-core can be, so the ratio that must hold. Not for
      # packed rows: fla-core's chunk indices read cu_seqlens on the host (a repeat_interleave
      # over device lengths), which a capture cannot hold.
      try:
        if N:
          raise RuntimeError("not captured: fla-core reads cu_seqlens on the host")
        row["fla_graph_ms"] = common.time_torch_graph(fla_call, steps=1, replays=10, repeats=5)
        row["ours_over_fla_graph"] = row["ours_ms"] / row["fla_graph_ms"]
        if "variant_ms" in row:
          row["variant_over_fla_graph"] = row["variant_ms"] / row["fla_graph_ms"]
      except Exception as e:
        row["fla_graph_error"] = f"{type(e).__name__}: {e}"[:300]
        print(f"[prefill] fla-core in a CUDA graph failed: {row['fla_graph_error']}")
      del fla_call, fht

    if with_ref and not self.skip_ref:
      self.reference_columns(row, results, args, M, o, fo)
    del o, ht, x, args, fo
    common.free_device_memory()

  def jla_columns(self, row, x, M, o, ht):
    """jla's forward, jitted, on the same inputs: its time, and its o and final state against
    ours (packed: its final state is that of the last sequence). A refusal is recorded as such."""
    jax = self.jax
    seg = x.get("segment_ids")
    f = jax.jit(lambda q, k, v, g, beta, seg: common.jla_call(
        self.jla, q, k, v, g, beta, M, segment_ids=seg, output_final_state=True))
    jargs = (x["q"], x["k"], x["v"], x["g"], x["beta"], seg)
    try:
      t0 = time.perf_counter()
      jo, jht = f(*jargs)  # traces (its shape checks), compiles and runs the Mosaic kernels
      jax.block_until_ready((jo, jht))
      row["jla_first_call_s"] = time.perf_counter() - t0
    except Exception as e:
      msg = f"{type(e).__name__}: {e}"[:800]
      row["jla_refused" if common.jla_refused(e) else "jla_error"] = msg
      print(f"[prefill] jla {'refused' if common.jla_refused(e) else 'failed'}: {msg}",
            flush=True)
      return
    row["jla_err"] = common.rel_err(jo, o)
    row["jla_err_state"] = common.rel_err(jht, ht[-1:] if seg is not None else ht)
    del jo, jht
    row["jla_ms"] = common.time_jax(lambda: f(*jargs))["ms"]
    row["ours_over_jla"] = row["ours_ms"] / row["jla_ms"]
    if "variant_ms" in row:
      row["variant_over_jla"] = row["variant_ms"] / row["jla_ms"]
    if self.profile:
      prof = common.profile_jax(lambda: f(*jargs), calls=3)
      row["jla_kernel_ms"] = prof["busy_us"] / 3e3
      row["profile_jla"] = prof
      common.print_profile(f"jla {row_name(row)}", prof, per=3)

  def variant_columns(self, row, args, M, o):
    """Ours under the --variant config overrides (the public `config=`); its output against
    the default config's."""
    config = self.gdp_jax.FwdConfig()._replace(**self.variant)
    f = self.ours_fn(M, backend=self.backend, config=config)
    ov, _ = f(*args)
    self.jax.block_until_ready(ov)
    row["variant_err_o"] = common.rel_err(ov, o)
    row["variant_ms"] = common.time_jax(lambda: f(*args))["ms"]
    row["variant_over_ours"] = row["variant_ms"] / row["ours_ms"]
    print(f"[prefill] variant {self.variant}: {row['variant_ms']:.3f} ms against "
          f"{row['ours_ms']:.3f} (o rel. difference {row['variant_err_o']:.1e})", flush=True)
    if self.profile:
      prof = common.profile_jax(lambda: f(*args), calls=3)
      row["variant_kernel_ms"] = prof["busy_us"] / 3e3
      row["profile_variant"] = prof
      common.print_profile(f"variant {row_name(row)}", prof, per=3)

  def fla_fn(self, x, M):
    """fla-core's call on the inputs `x` (moved to torch once), as a function of nothing."""
    tq, tk, tv, tg, tb = (common.to_torch(x[n]) for n in ("q", "k", "v", "g", "beta"))
    cu = common.to_torch(x["cu_seqlens"]).long() if "cu_seqlens" in x else None
    return lambda: self.fla(tq, tk, tv, tg, tb, num_householder=M, output_final_state=True,
                            use_qk_l2norm_in_kernel=True, cu_seqlens=cu)

  def fla_profile(self, row):
    """fla-core's kernels at a row already run (so autotuned), on the same inputs rebuilt from
    their seed. Called after every row of ours was profiled: once torch.profiler has run in a
    process, CUPTI refuses jax.profiler and our profiles come back empty."""
    B, T, H, K, V, M = (row[n] for n in ("B", "T", "H", "K", "V", "M"))
    x = self.inputs(B, T, H, K, V, M, N=row.get("N"))
    prof = common.profile_torch(self.fla_fn(x, M))
    row["fla_kernel_ms"], row["fla_span_ms"] = prof["busy_us"] / 1e3, prof["span_us"] / 1e3
    row["profile_fla"] = prof
    common.print_profile(f"fla-core {row_name(row)}", prof)

  def reference_columns(self, row, results, args, M, o, fla_o):
    """The jnp references on the same inputs: the token scan (the oracle and the >=50x
    baseline) and the chunked WY form. Errors of ours and of fla against the scan."""
    ref = self.gdp_jax.reference
    f = self.ours_fn(M, fn=ref.chunk_gated_delta_product)
    ro, rh = f(*args)
    row["err_ref_o"] = common.rel_err(o, ro)
    if fla_o is not None:
      row["err_fla_ref_o"] = common.rel_err(fla_o, ro)
    t = common.time_jax(lambda: f(*args), repeats=3, warmup=1)
    row["ref_scan_ms"] = t["ms"]
    row["ref_over_ours"] = t["ms"] / row["ours_ms"]
    results.set_meta(ref_scan_ms=t["ms"], ref_over_ours=row["ref_over_ours"])
    print(f"[prefill] reference scan {t['ms']:.2f} ms = {row['ref_over_ours']:.1f}x ours")
    del ro, rh
    try:
      fc = self.ours_fn(M, fn=ref.chunk_gated_delta_product_chunked)
      co, _ = fc(*args)
      row["err_ref_chunked_o"] = common.rel_err(co, o)
      t = common.time_jax(lambda: fc(*args), repeats=3, warmup=1)
      row["ref_chunked_ms"] = t["ms"]
      results.set_meta(ref_chunked_ms=t["ms"])
    except Exception as e:
      row["ref_chunked_error"] = f"{type(e).__name__}: {e}"[:300]


def row_name(row):
  name = " ".join(f"{k}={row[k]}" for k in ("B", "T", "H", "K", "V", "M"))
  return name + (f" N={row['N']} packed" if row.get("N") else "")


COLS = [
    ("B", "B", "d"), ("T", "T", "d"), ("H", "H", "d"), ("K", "K", "d"), ("V", "V", "d"),
    ("M", "M", "d"), ("N", "N", "d"), ("ours_ms", "ours_ms", ".3f"), ("ours_spread", "spr", ".2f"),
    ("jla_ms", "jla_ms", ".3f"), ("ours_over_jla", "ours/jla", ".2f"),
    ("jla_err", "jla_err", ".1e"), ("jla_err_state", "jla_err_h", ".1e"),
    ("variant_over_jla", "var/jla", ".2f"), ("jla_kernel_ms", "jla_kern", ".3f"),
    ("fla_ms", "fla_ms", ".3f"), ("ours_over_fla", "ours/fla", ".2f"),
    ("fla_graph_ms", "fla_graph", ".3f"), ("ours_over_fla_graph", "ours/graph", ".2f"),
    ("variant_ms", "variant", ".3f"), ("variant_kernel_ms", "var_kern", ".3f"),
    ("variant_over_fla_graph", "var/graph", ".2f"),
    ("ours_kernel_ms", "ours_kern", ".3f"), ("fla_kernel_ms", "fla_kern", ".3f"),
    ("flop_floor_ms", "flop_floor", ".3f"), ("byte_floor_ms", "byte_floor", ".3f"),
    ("ours_over_floor", "/floor", ".1f"), ("TFLOPs", "TFLOP/s", ".0f"),
    ("err_fla_o", "err_fla_o", ".1e"), ("err_fla_state", "err_fla_h", ".1e"),
    ("err_ref_o", "err_ref_o", ".1e"), ("err_fla_ref_o", "fla_vs_ref", ".1e"),
    ("ref_scan_ms", "ref_scan", ".1f"), ("ref_over_ours", "ref/ours", ".0f"),
    ("fla_first_call_s", "fla_1st_s", ".1f"), ("row_s", "row_s", ".1f"),
]


def main():
  args = parse_args()
  common.setup_env(args.cpu_smoke)
  out = common.out_dir(args.out)
  budget = common.Budget(args.budget_s)
  b = Bench(args)
  results = common.Results(os.path.join(out, "prefill.json"),
                           dict(common.versions(), smoke=b.smoke, backend=b.backend,
                                matmul_flops=MATMUL_FLOPS))
  print("[prefill] versions:", results.data["meta"])
  # (B, T, H, K, V, M), and N for B == 1 rows that pack N sequences of T tokens in all.
  if b.smoke:
    shapes = [dict(shape=(1, 128, 2, 32, 32, 2)), dict(shape=(1, 96, 2, 32, 16, 3)),
              dict(shape=(1, 128, 2, 32, 32, 2), N=3)]
  else:
    shapes = [dict(shape=s) for s in (
        (4, 2048, 16, 128, 128, 2), (4, 2048, 16, 128, 128, 3), (1, 8192, 16, 128, 128, 2),
        (8, 4096, 32, 128, 128, 2), (4, 2048, 6, 256, 512, 2))]
    shapes.append(dict(shape=(1, 16384, 16, 128, 128, 2), N=8))
  # Row numbers as in the full table, so --rows and --ref-rows name the same rows.
  numbers = [int(i) for i in args.rows.split(",")] if args.rows else list(range(len(shapes)))
  shapes = [shapes[i] for i in numbers]
  rows = []
  try:
    try:
      c = common.copy_bandwidth_jax((16 << 20) if b.smoke else (4 << 30))
      b.copy_Bps = c["Bps"]
      results.set_meta(copy_Bps=c["Bps"])
      print(f"[prefill] copy bandwidth (jax, read + write): {c['Bps'] / 1e12:.3f} TB/s")
    except Exception as e:
      print(f"[prefill] copy bandwidth failed: {type(e).__name__}: {e}")
    common.free_device_memory()
    try:
      b.first_call(results, shapes[0])
    except Exception as e:
      results.set_meta(compile_error=f"{type(e).__name__}: {e}"[:800])
      print(f"[prefill] first-call timing failed: {type(e).__name__}: {e}")
    common.free_device_memory()
    ref_rows = set(numbers) if args.ref_rows == "all" else {
        int(i) for i in args.ref_rows.split(",") if i}
    for i, s in zip(numbers, shapes):
      row = dict(zip(("B", "T", "H", "K", "V", "M"), s["shape"]), **(
          {"N": s["N"]} if "N" in s else {}))
      rows.append(common.run_row(results, "prefill", row,
                                 lambda r, i=i: b.row(r, with_ref=(i in ref_rows),
                                                      results=results),
                                 budget))
    # Second pass: fla-core's kernel profiles, after all of ours.
    if b.profile and b.fla is not None:
      for row in rows:
        if "fla_ms" in row:
          try:
            b.fla_profile(row)
          except Exception as e:
            row["fla_profile_error"] = f"{type(e).__name__}: {e}"[:300]
            print(f"[prefill] fla-core profile failed: {row['fla_profile_error']}")
          results.save()
          common.free_device_memory()
  except KeyboardInterrupt:
    results.set_meta(interrupted=True)
    print("[prefill] interrupted; partial results saved")
  # A row jla rejects shows "refuses" in its column; the reasons follow the table.
  shown = [dict(r, jla_ms="refuses") if "jla_refused" in r else r for r in rows]
  common.print_table("prefill (ms; floors: FLOPs / 790 TFLOP/s, bytes / copy bandwidth)", shown,
                     COLS)
  for i, r in enumerate(rows):
    for key in ("jla_refused", "jla_error"):
      if key in r:
        print(f"  row {i} jla {key[4:]}: {r[key][:300]}")
  results.set_meta(elapsed_s=budget.elapsed())
  print(f"[prefill] done in {budget.elapsed():.1f} s; results in {results.path}")


if __name__ == "__main__":
  main()
