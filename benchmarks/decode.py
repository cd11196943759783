"""Decode benchmark: `gdp_jax.gated_delta_product_decode` against fla-core's fused recurrent step.

What it measures, in order (each row in its own try/except; every number lands in
$OUT/decode.json as soon as it exists, tables go to stdout):

1. Device-to-device copy bandwidth in this process (4 GiB, read + write counted): the ceiling
   for a step that streams the state once in and once out.
2. First-call cost of one decode step: lowering (jax_triton compiles the Triton kernel there,
   into an empty cache), XLA compile, first run.
3. The main table: a jitted step with the cache [S, HV, K, V] float32 donated and
   state_indices a random permutation, K = V = 128, M = 2, H = 16, for N in {1, 8, 64, 256},
   HV in {16, 32}, D in {1, 4} (D = 4 with intermediate_states), S = N, plus S = 8N for
   N = 256, HV = 16, D = 1. Per row:
   * ours: one jitted call per step (what a serving loop pays, host dispatch included);
   * ours_loop: 16 steps on the same inputs unrolled inside one jit, per step: XLA folds the
     identical inputs once, so this is close to the kernel's device time, like fla's graph,
     which is handed the folded stream;
   * bandwidth from ours_loop counting state read + write (+ snapshot writes for D > 1);
   * fla-core `fused_recurrent_gated_delta_rule` on the same folded stream (query on the last
     Householder copy, decay on the first; dense initial_state, output_final_state=True),
     eagerly with do_bench and as 16 steps in one CUDA graph; fla writes no snapshots;
   * relative errors of ours against the jnp reference (float32) and against fla: a Triton
     miscompile on Hopper shows here before it shows in a timing.
4. A bfloat16 cache at N = 256, HV = 16.
5. Speculative steps (--parts spec) at N = 256, HV = 16, D in {2, 4, 8} (and D = 4 with
   bfloat16 snapshots, float32 cache): the verify step that
   writes the state and D snapshots followed by `accept_draft_tokens` (the rollback copy),
   against the step that starts from the previous step's snapshots through `num_accepted`
   (random counts in 1..D) and writes only the snapshots; the plain D = 1 step and fla-core's
   D-token step (no snapshots) beside them; both speculative paths checked bit for bit against
   each other.
   (--parts replay) The checkpoint + replay step (`replay_ring`: replay the accepted ring tokens
   into the cache slot, write the checkpoint, run the D new tokens with outputs only) at
   N = 256, HV = 16, D in {1, 2, 4, 8}, random counts in 1..D, beside the `num_accepted` step
   (snapshots), the plain D = 1 step and fla-core's D-token step; its checkpoints checked bit
   for bit against `commit_replay`, its outputs against `commit_replay` followed by the plain
   step (err_plain_o: 0 for the token loop, bf16 rounding for the block form that bf16 inputs
   at BV 16 take up to D*M = 8) and against the jnp reference. `--replay-configs 8x1x1,16x1x2`
   adds replay rows under other kernel configs (BV x warps x stages; BV 8 keeps the token loop).
6. A config sweep (BV x num_warps x num_stages through the decode entry point's `config`
   argument; --sweep-grid picks the grid, D too) at N = 256, 1, 8, HV = 16, D = 1, each config
   checked against
   the reference after 16 steps.
7. (--parts profile, not in the default) A kernel profile of our 16-step loop (jax.profiler)
   and of fla-core's 16 eager steps (torch.profiler), CUPTI's device times per kernel: per step,
   how long kernels ran and the span they took, so launch gaps show apart from kernel time.
7. (--parts launch, not in the default) Launch cost per launch backend ("triton", "xla_triton"):
   64 decode steps in a lax.fori_loop and unrolled in one jit, and one step per jitted call, at
   N = 1, 8, 32, 256 (HV = 16, D = 1), beside fla-core's 64 steps in one CUDA graph, the second
   backend's final state compared bit for bit with the first's; the same for a trivial kernel
   (us per launch); at N = 1 and 8 where a step's time goes (kernels, idle between them inside
   the call, outside it); `--launch-configs` adds unrolled rows under other kernel configs; and
   one prefill call, forward and forward+backward, kernel by kernel,
   to see whether XLA's Triton compiles a kernel slower than pip's.

`--cpu-smoke` runs the same code at tiny shapes through Triton's interpreter, without torch
or fla, to prove the plumbing on a machine without a GPU (its times mean nothing).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

LOOP_STEPS = 16   # steps per jit (ours) and per CUDA graph (fla) in the "loop" timings
CHECK_ROWS = 32   # cache slots compared per row: enough to catch a miscompile, cheap on the host
# A config counts as correct under this error against the float32 reference: o is stored in
# bf16 (about 1.5e-3 from rounding alone); a miscompile gives errors of order 1.
OK_ERR = 5e-3


def parse_args():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--cpu-smoke", action="store_true",
                 help="tiny shapes, Triton interpreter, no torch/fla (plumbing check)")
  p.add_argument("--budget-s", type=float, default=300.0,
                 help="stop starting rows after this many seconds")
  p.add_argument("--out", default=None, help="output folder (default $OUT or ./bench_out)")
  p.add_argument("--skip-fla", action="store_true")
  p.add_argument("--parts", default="copy,first,main,bf16,spec,replay,sweep",
                 help="comma-separated subset of copy,first,main,bf16,spec,replay,sweep,profile,"
                      "launch "
                      "(e.g. 'copy,sweep' for a second call that only sweeps; 'profile' and "
                      "'launch' are not in the default)")
  p.add_argument("--shapes", default=None,
                 help="main-table rows as NxHVxD[xS] items, comma-separated (default: all)")
  p.add_argument("--sweep-grid", default=None,
                 help="the sweep's grid as 'N=256,1,8;D=1;BV=8,16,32,64;warps=1,2,4,8;stages=1' "
                      "(any subset; the rest keep these defaults)")
  p.add_argument("--replay-ds", default="4,1,2,8",
                 help="draft lengths D of the replay rows (N = 256, HV = 16), in this order")
  p.add_argument("--launch-configs", default="",
                 help="extra kernel configs for the launch part's unrolled rows, as "
                      "BVxWARPSxSTAGES items, comma-separated (e.g. 16x2x1)")
  p.add_argument("--replay-configs", default="",
                 help="extra kernel configs for the replay rows, as BVxWARPSxSTAGES items, "
                      "comma-separated (e.g. 8x1x1,16x1x2); each adds a timed replay row per D")
  return p.parse_args()


def parse_sweep_grid(text, smoke=False):
  """--sweep-grid 'N=256,1;BV=16' over the defaults, as a dict of int tuples."""
  grid = ({"N": (2,), "D": (1,), "BV": (8, 16), "warps": (1, 2), "stages": (1,)} if smoke else
          {"N": (256, 1, 8), "D": (1,), "BV": (8, 16, 32, 64), "warps": (1, 2, 4, 8),
           "stages": (1,)})
  for item in filter(None, (text or "").split(";")):
    key, _, values = item.partition("=")
    if key not in grid:
      raise SystemExit(f"--sweep-grid: unknown key {key!r}; expected one of {sorted(grid)}")
    grid[key] = tuple(int(x) for x in values.split(","))
  return grid


class Bench:
  """Shapes, backend and the imported modules of one run."""

  def __init__(self, args):
    self.smoke = args.cpu_smoke
    import jax
    import jax.numpy as jnp
    import numpy as np
    import gdp_jax
    from gdp_jax import _configs
    common.fix_triton_cache()
    self.jax, self.jnp, self.np, self.gdp_jax, self.configs = jax, jnp, np, gdp_jax, _configs
    self.backend = "interpret" if self.smoke else "triton"
    self.loop_steps = 2 if self.smoke else LOOP_STEPS  # the interpreter is slow
    self.copy_Bps = None  # set by main() once measured
    self.fla = None
    if not (self.smoke or args.skip_fla):
      try:
        import torch
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
        torch.set_grad_enabled(False)  # no autograd bookkeeping in the timed calls
        self.torch, self.fla = torch, fused_recurrent_gated_delta_rule
      except Exception as e:
        print(f"[decode] fla-core unavailable, its columns stay empty: {type(e).__name__}: {e}")
      common.fix_triton_cache()
    if self.smoke:
      self.H, self.K, self.V, self.M = 1, 16, 16, 2
    else:
      self.H, self.K, self.V, self.M = 16, 128, 128, 2

  # ------------------------------------------------------------------------------ inputs

  def inputs(self, N, HV, D, S, state_dtype="float32", seed=0):
    """Random inputs of one decode step: bf16 activations, logsigmoid decays, beta in (0, 1),
    a random nonzero cache, slots a random permutation of S taken N at a time, and a
    NaN-poisoned snapshot buffer when D > 1 (an unwritten snapshot shows as NaN)."""
    jax, jnp, np = self.jax, self.jnp, self.np
    H, K, V, M = self.H, self.K, self.V, self.M
    ks = jax.random.split(jax.random.PRNGKey(seed), 7)
    bf16 = jnp.bfloat16
    x = dict(
        q=jax.random.normal(ks[0], (N, D, H, K), jnp.float32).astype(bf16),
        k=jax.random.normal(ks[1], (N, D * M, H, K), jnp.float32).astype(bf16),
        v=jax.random.normal(ks[2], (N, D * M, HV, V), jnp.float32).astype(bf16),
        g=jax.nn.log_sigmoid(jax.random.uniform(ks[3], (N, D, HV), jnp.float32, 1.0, 5.0)),
        beta=jax.nn.sigmoid(jax.random.normal(ks[4], (N, D * M, HV), jnp.float32)).astype(bf16),
    )
    state = (0.1 * jax.random.normal(ks[5], (S, HV, K, V), jnp.float32)).astype(state_dtype)
    slots = jnp.asarray(np.random.default_rng(seed).permutation(S)[:N].astype(np.int32))
    inter = None
    if D > 1:
      inter = jnp.full((S, D, HV, K, V), jnp.nan, state_dtype)
    return x, state, slots, inter

  # ------------------------------------------------------------------------------ functions

  def step_fn(self, use_inter, steps=1, config=None):
    """A jitted function running `steps` decode steps, cache (and snapshots) donated; `config`
    overrides the kernel's DecodeConfig (None: the library's)."""
    jax, gdp_jax, M, backend = self.jax, self.gdp_jax, self.M, self.backend

    def f(state, inter, q, k, v, g, beta, slots):
      o = None
      for _ in range(steps):
        out = gdp_jax.gated_delta_product_decode(
            q, k, v, g, beta, num_householder=M, state=state, state_indices=slots,
            intermediate_states=inter, use_qk_l2norm_in_kernel=True, config=config,
            backend=backend)
        o, state = out[0], out[1]
        if use_inter:
          inter = out[2]
      return o, state, inter

    return jax.jit(f, donate_argnums=(0, 1) if use_inter else (0,))

  def reference(self, x, state, slots, inter, steps=1):
    """The jnp reference on float32 upcasts of the same inputs, `steps` steps."""
    jax, jnp, gdp_jax, M = self.jax, self.jnp, self.gdp_jax, self.M
    f32 = lambda a: None if a is None else a.astype(jnp.float32)

    @jax.jit
    def f(state, inter, q, k, v, g, beta, slots):
      o = None
      for _ in range(steps):
        out = gdp_jax.gated_delta_product_decode(
            f32(q), f32(k), f32(v), g, f32(beta), num_householder=M, state=state,
            state_indices=slots, intermediate_states=inter, use_qk_l2norm_in_kernel=True,
            backend="reference")
        o, state = out[0], out[1]
        inter = out[2] if inter is not None else None
      return o, state

    return f(f32(state), f32(inter), x["q"], x["k"], x["v"], x["g"], x["beta"], slots)

  def run_chain(self, fn, state, inter, x, slots, *extra):
    """A zero-argument callable that runs `fn` once, threading the donated buffers."""
    box = {"state": state, "inter": inter}

    def call():
      o, s, i = fn(box["state"], box["inter"], x["q"], x["k"], x["v"], x["g"], x["beta"], slots,
                   *extra)
      box["state"], box["inter"] = s, i
      return o, s

    return call

  def copy(self, a):
    return None if a is None else self.jnp.copy(a)

  def state_bytes(self, N, HV, D, dtype, with_inter):
    """Bytes a step must move: the N addressed states read and written, plus one snapshot per
    draft token when snapshots are kept. The activations (q, k, v, g, beta, o) are under 1% of
    that at these shapes and are left out."""
    item = self.np.dtype(self.jnp.dtype(dtype)).itemsize
    per_state = HV * self.K * self.V * item
    return N * per_state * 2 + (N * D * per_state if with_inter else 0)

  # ------------------------------------------------------------------------------ measurements

  def first_call(self, results):
    """Lowering, XLA compile and first run of one step, with an empty Triton cache."""
    N, HV, D = (256, 16, 1) if not self.smoke else (2, 2, 1)
    x, state, slots, inter = self.inputs(N, HV, D, N)
    f = self.step_fn(use_inter=False)
    args = (state, inter, x["q"], x["k"], x["v"], x["g"], x["beta"], slots)
    t0 = time.perf_counter()
    lowered = f.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    self.jax.block_until_ready(compiled(*args))
    t3 = time.perf_counter()
    results.set_meta(compile_shape=dict(N=N, HV=HV, D=D, K=self.K, V=self.V, M=self.M),
                     compile_lower_s=t1 - t0, compile_xla_s=t2 - t1, compile_first_run_s=t3 - t2)
    print(f"[decode] first call N={N} HV={HV}: lower (Triton compile) {t1 - t0:.2f} s, "
          f"XLA compile {t2 - t1:.2f} s, first run {t3 - t2:.3f} s")

  def main_row(self, row):
    N, HV, D, S, sdt = row["N"], row["HV"], row["D"], row["S"], row["state_dtype"]
    use_inter = D > 1
    cfg = self.configs.decode_config(self.K, self.V)
    row["cfg"] = f"BV{cfg.BV}w{cfg.num_warps}"
    x, state, slots, inter = self.inputs(N, HV, D, S, sdt, seed=N * 1000 + HV * 10 + D)
    nchk = min(N, CHECK_ROWS)
    chk = slots[:nchk]

    # Correctness on copies (the timed chain donates the originals).
    step = self.step_fn(use_inter)
    o, new_state, new_inter = step(self.copy(state), self.copy(inter), x["q"], x["k"], x["v"],
                                   x["g"], x["beta"], slots)
    ref_o, ref_state = self.reference(x, state, slots, inter)
    row["err_ref_o"] = common.rel_err(o, ref_o)
    row["err_ref_state"] = common.rel_err(new_state[chk], ref_state[chk])
    row["err_ref"] = common.worst(row["err_ref_o"], row["err_ref_state"])
    if use_inter:
      # The last snapshot is the final state, stored from the same float32 registers.
      row["err_snapshot"] = common.rel_err(new_inter[chk, D - 1], new_state[chk])
    del ref_o, ref_state, new_inter

    if self.fla is not None and sdt == "float32":
      self.fla_columns(row, x, state, slots, o, new_state, nchk)
    del o, new_state

    # Timing: the chain donates `state` (and `inter`) from here on.
    row["bytes"] = self.state_bytes(N, HV, D, sdt, use_inter)
    t = common.time_jax(self.run_chain(step, state, inter, x, slots))
    row["ours_ms"], row["ours_spread"], row["ours_batch"] = t["ms"], t["spread"], t["batch"]
    state, inter = self.inputs(N, HV, D, S, sdt, seed=1)[1::2]  # fresh buffers: old ones donated
    loop = self.step_fn(use_inter, steps=self.loop_steps)
    t = common.time_jax(self.run_chain(loop, state, inter, x, slots))
    row["ours_loop_ms"], row["ours_loop_spread"] = t["ms"] / self.loop_steps, t["spread"]
    row["TBps_loop"] = row["bytes"] / (row["ours_loop_ms"] * 1e-3) / 1e12
    row["TBps_dispatch"] = row["bytes"] / (row["ours_ms"] * 1e-3) / 1e12
    if self.copy_Bps:
      row["frac_copy"] = row["TBps_loop"] * 1e12 / self.copy_Bps
      row["copy_floor_ms"] = row["bytes"] / self.copy_Bps * 1e3
    if row.get("fla_ms"):
      row["ours_over_fla"] = row["ours_ms"] / row["fla_ms"]
    if row.get("fla_graph_ms"):
      row["ours_over_fla_graph"] = row["ours_loop_ms"] / row["fla_graph_ms"]
    common.free_device_memory()

  def fla_step_fn(self, x, state, slots):
    """fla-core's step on the folded stream: T = D*M steps, query on copy M-1, decay on copy 0,
    the dense state of the N addressed slots as its initial state."""
    jnp = self.jnp
    N, D, H, K = x["q"].shape
    HV, M = x["v"].shape[2], self.M
    q_fold = jnp.zeros((N, D, M, H, K), x["q"].dtype).at[:, :, M - 1].set(x["q"])
    g_fold = jnp.zeros((N, D, M, HV), jnp.float32).at[:, :, 0].set(x["g"])
    tq = common.to_torch(q_fold.reshape(N, D * M, H, K))
    tg = common.to_torch(g_fold.reshape(N, D * M, HV))
    tk, tv, tb = (common.to_torch(x[n]) for n in ("k", "v", "beta"))
    th0 = common.to_torch(state[slots])  # fla takes the dense state of the N sequences
    scale = K ** -0.5

    def fla_step():
      # beta by keyword: fla's fifth positional parameter is gk.
      return self.fla(tq, tk, tv, tg, beta=tb, scale=scale, initial_state=th0,
                      output_final_state=True, use_qk_l2norm_in_kernel=True)

    return fla_step

  def fla_columns(self, row, x, state, slots, o, new_state, nchk):
    """fla-core's errors against ours and its times, eager and as a CUDA graph."""
    torch, M = self.torch, self.M
    N, D = x["q"].shape[:2]
    HV = x["v"].shape[2]
    fla_step = self.fla_step_fn(x, state, slots)
    fo, fht = fla_step()
    torch.cuda.synchronize()
    row["err_fla_o"] = common.rel_err(o, fo[:, M - 1::M])
    row["err_fla_state"] = common.rel_err(new_state[slots[:nchk]], fht[:nchk])
    row["err_fla"] = common.worst(row["err_fla_o"], row["err_fla_state"])
    del fo, fht
    row["fla_ms"] = common.time_torch(fla_step)
    row["fla_graph_ms"] = common.time_torch_graph(fla_step, steps=self.loop_steps)
    fla_bytes = self.state_bytes(N, HV, D, "float32", with_inter=False)
    row["fla_TBps_graph"] = fla_bytes / (row["fla_graph_ms"] * 1e-3) / 1e12
    del fla_step
    common.free_device_memory()

  def profile_row(self, row):
    """The device kernels of our 16-step loop (row["side"] "ours") or of fla-core's 16 eager
    steps ("fla"): per step, the time kernels ran and the span from the first kernel's start to
    the last one's end."""
    N, HV, D, S = row["N"], row["HV"], row["D"], row["S"]
    steps = self.loop_steps
    x, state, slots, inter = self.inputs(N, HV, D, S, seed=3)
    if row["side"] == "ours":
      prof = common.profile_jax(self.run_chain(self.step_fn(D > 1, steps=steps), state, inter,
                                               x, slots))
      what = f"{steps} steps in one jit"
    else:
      prof = common.profile_torch(self.fla_step_fn(x, state, slots), calls=steps)
      what = f"{steps} eager steps"
    row["kernel_us"], row["span_us"] = prof["busy_us"] / steps, prof["span_us"] / steps
    row["profile"] = prof
    common.print_profile(f"{row['side']} N={N} HV={HV} D={D}, {what}", prof, per=steps,
                         unit="step")
    common.free_device_memory()

  def spec_fn(self, mode, steps=1):
    """`steps` speculative steps in one jit, cache and snapshots donated. mode "accept": the
    verify step writes the state and the snapshots, then `accept_draft_tokens` copies each
    request's accepted snapshot into the cache; mode "num_accepted": the step starts from the
    previous step's snapshot selected by `num_accepted` and writes only the snapshots."""
    jax, gdp_jax, M, backend = self.jax, self.gdp_jax, self.M, self.backend

    def f(state, inter, q, k, v, g, beta, slots, num):
      o = None
      for _ in range(steps):
        kw = dict(num_householder=M, state=state, state_indices=slots, intermediate_states=inter,
                  use_qk_l2norm_in_kernel=True, backend=backend)
        if mode == "accept":
          o, state, inter = gdp_jax.gated_delta_product_decode(q, k, v, g, beta, **kw)
          state = gdp_jax.accept_draft_tokens(state, inter, slots, num)
        else:
          o, state, inter = gdp_jax.gated_delta_product_decode(q, k, v, g, beta, **kw,
                                                               num_accepted=num)
      return o, state, inter

    return jax.jit(f, donate_argnums=(0, 1))

  def spec_inputs(self, N, HV, D, S, seed, snap_dtype="float32"):
    """Inputs of a speculative step: the snapshots hold states (the new path reads them), and
    the accepted counts are random in 1..D."""
    jnp, np = self.jnp, self.np
    x, state, slots, _ = self.inputs(N, HV, D, S, seed=seed)
    inter = (jnp.broadcast_to(state[:, None], (S, D) + state.shape[1:]) * jnp.linspace(
        0.5, 1.5, D, dtype=jnp.float32)[None, :, None, None, None]).astype(snap_dtype)
    num = jnp.asarray(np.random.default_rng(seed).integers(1, D + 1, N), jnp.int32)
    return x, state, slots, inter, num

  def spec_row(self, row):
    """The old verify + rollback copy against the new step, at one (N, HV, D)."""
    N, HV, D, S, sdt = row["N"], row["HV"], row["D"], row["S"], row["snapshots"]
    x, state, slots, inter, num = self.spec_inputs(N, HV, D, S, seed=N + D, snap_dtype=sdt)
    # Bitwise: the new step equals the rollback copy followed by the old step.
    old, new = self.spec_fn("accept"), self.spec_fn("num_accepted")
    rolled = self.gdp_jax.accept_draft_tokens(state, inter, slots, num)
    o_old, _, i_old = self.step_fn(True)(rolled, self.copy(inter), x["q"], x["k"], x["v"],
                                         x["g"], x["beta"], slots)
    o_new, _, i_new = new(self.copy(state), self.copy(inter), x["q"], x["k"], x["v"], x["g"],
                          x["beta"], slots, num)
    live = slots[:CHECK_ROWS]
    same = lambda a, b: self.np.asarray(a).tobytes() == self.np.asarray(b).tobytes()
    row["same_bits"] = same(o_old, o_new) and same(i_old[live], i_new[live])
    del rolled, o_old, i_old, o_new, i_new
    per_state = HV * self.K * self.V * 4
    snap = per_state * self.np.dtype(self.jnp.dtype(sdt)).itemsize // 4
    # Bytes per step: old 1 read + 1 write + D snapshots + the copy (a snapshot read, a state
    # write); new 1 read (a snapshot's) + D snapshots.
    row["bytes_accept"] = N * (3 * per_state + (D + 1) * snap)
    row["bytes_new"] = N * (1 + D) * snap
    for mode, key in (("accept", "accept"), ("num_accepted", "new")):
      loop = self.spec_fn(mode, steps=self.loop_steps)
      x, state, slots, inter, num = self.spec_inputs(N, HV, D, S, seed=N + D, snap_dtype=sdt)
      t = common.time_jax(self.run_chain(loop, state, inter, x, slots, num))
      row[f"{key}_loop_ms"], row[f"{key}_spread"] = t["ms"] / self.loop_steps, t["spread"]
      row[f"{key}_TBps"] = row[f"bytes_{key}"] / (row[f"{key}_loop_ms"] * 1e-3) / 1e12
      del state, inter
      common.free_device_memory()
    # The plain D = 1 step at the same N, HV, the yardstick of the target ratio.
    self.yardsticks(row, N, HV, D, S, x, slots, "new", ("new", "accept"))

  def yardsticks(self, row, N, HV, D, S, x, slots, main, over_d1):
    """The plain D = 1 step at the same N, HV (the target ratio's yardstick) and fla-core's D-token
    step from a CUDA graph: row[f"{n}_over_d1"] for n in over_d1, row[f"{main}_over_fla_graph"]."""
    x1, state1, slots1, _ = self.inputs(N, HV, 1, S, seed=5)
    t = common.time_jax(self.run_chain(self.step_fn(False, steps=self.loop_steps), state1, None,
                                       x1, slots1))
    row["d1_loop_ms"] = t["ms"] / self.loop_steps
    for n in over_d1:
      row[f"{n}_over_d1"] = row[f"{n}_loop_ms"] / row["d1_loop_ms"]
    del state1
    if self.fla is not None:
      fla_step = self.fla_step_fn(x, self.inputs(N, HV, D, S, seed=6)[1], slots)
      row["fla_graph_ms"] = common.time_torch_graph(fla_step, steps=self.loop_steps)
      row[f"{main}_over_fla_graph"] = row[f"{main}_loop_ms"] / row["fla_graph_ms"]
      del fla_step
    common.free_device_memory()

  def replay_fn(self, steps=1, config=None):
    """`steps` checkpoint + replay steps in one jit, cache and ring donated; `config` overrides
    the kernel's DecodeConfig (None: the library's)."""
    jax, gdp_jax, M, backend = self.jax, self.gdp_jax, self.M, self.backend

    def f(state, ring, q, k, v, g, beta, slots, num):
      o = None
      for _ in range(steps):
        o, state, ring = gdp_jax.gated_delta_product_decode(
            q, k, v, g, beta, num_householder=M, state=state, state_indices=slots,
            num_accepted=num, replay_ring=ring, use_qk_l2norm_in_kernel=True, config=config,
            backend=backend)
      return o, state, ring

    return jax.jit(f, donate_argnums=(0, 1))

  def replay_inputs(self, N, HV, D, S, seed):
    """A step's inputs, a ring of S slots holding another step's inputs, counts in 1..D."""
    x, state, slots, _ = self.inputs(N, HV, D, S, seed=seed)
    other = self.inputs(S, HV, D, S, seed=seed + 1)[0]
    ring = tuple(other[n] for n in ("k", "v", "g", "beta"))
    num = self.jnp.asarray(self.np.random.default_rng(seed).integers(1, D + 1, N),
                           self.jnp.int32)
    return x, state, slots, ring, num

  def replay_row(self, row):
    """The checkpoint + replay step against the num_accepted step, at one (N, HV, D); a row
    with a `cfg` (BV, warps, stages) times the replay step alone under that kernel config."""
    jnp, np, gdp_jax, M = self.jnp, self.np, self.gdp_jax, self.M
    N, HV, D, S = row["N"], row["HV"], row["D"], row["S"]
    cfg = None
    if row.get("cfg"):
      BV, w, ns = (int(a) for a in row["cfg"].split("x"))
      cfg = self.configs.DecodeConfig(BV=BV, num_warps=w, num_stages=ns)
    x, state, slots, ring, num = self.replay_inputs(N, HV, D, S, seed=N + D)
    xs = (x["q"], x["k"], x["v"], x["g"], x["beta"], slots)
    o, new_state, _ = self.replay_fn(config=cfg)(self.copy(state), tuple(map(self.copy, ring)),
                                                 *xs, num)
    live = slots[:CHECK_ROWS]
    # The replay step is commit_replay (bitwise: the same checkpoints) followed by the plain
    # step (same config; its outputs to rounding, bf16 rounding in block form).
    committed = gdp_jax.commit_replay(state, ring, slots, num, steps_per_token=M,
                                      use_qk_l2norm_in_kernel=True, config=cfg,
                                      backend=self.backend)
    o_plain = self.step_fn(False, config=cfg)(self.copy(committed), None, *xs)[0]
    same = lambda a, b: np.asarray(a).tobytes() == np.asarray(b).tobytes()
    row["same_bits"] = same(new_state[live], committed[live])
    row["err_plain_o"] = common.rel_err(o, o_plain)
    f32 = lambda a: a.astype(jnp.float32)
    ref_o, ref_state, _ = gdp_jax.gated_delta_product_decode(
        f32(x["q"]), f32(x["k"]), f32(x["v"]), x["g"], f32(x["beta"]), num_householder=M,
        state=state, state_indices=slots, num_accepted=num, replay_ring=tuple(map(f32, ring)),
        use_qk_l2norm_in_kernel=True, backend="reference")
    row["err_ref_o"] = common.rel_err(o, ref_o)
    row["err_ref_state"] = common.rel_err(new_state[live], ref_state[live])
    row["err_ref"] = common.worst(row["err_ref_o"], row["err_ref_state"])
    del o, new_state, committed, o_plain, ref_o, ref_state
    # Bytes per step: the state read and the checkpoint written, plus the ring rows read (the
    # accepted ones) and written (all D*M): k, v, beta bf16, g float32 (counted once per row,
    # an upper bound).
    per_state = HV * self.K * self.V * 4
    per_row = (self.H * self.K + HV * self.V + HV) * 2 + HV * 4
    row["bytes_replay"] = N * 2 * per_state + (int(np.asarray(num).sum()) + N * D) * M * per_row
    t = common.time_jax(self.run_chain(self.replay_fn(steps=self.loop_steps, config=cfg), state,
                                       ring, x, slots, num))
    row["replay_loop_ms"], row["replay_spread"] = t["ms"] / self.loop_steps, t["spread"]
    row["replay_TBps"] = row["bytes_replay"] / (row["replay_loop_ms"] * 1e-3) / 1e12
    del state, ring
    common.free_device_memory()
    if cfg is not None:
      return
    # Today's num_accepted step (D snapshots written, one read) at the same shape.
    x2, state, slots2, inter, num2 = self.spec_inputs(N, HV, D, S, seed=N + D)
    t = common.time_jax(self.run_chain(self.spec_fn("num_accepted", steps=self.loop_steps),
                                       state, inter, x2, slots2, num2))
    row["snap_loop_ms"] = t["ms"] / self.loop_steps
    del state, inter
    common.free_device_memory()
    self.yardsticks(row, N, HV, D, S, x, slots, "replay", ("replay", "snap"))

  def sweep_shape(self, results, N, HV, D, bvs, warps, stages, budget):
    """Every (BV, num_warps, num_stages) at one shape: 16 steps from the same cache, against the
    reference. num_stages > 1 lets Triton pipeline the loads of the step loop (measured a loss
    at D = 1; the D*M-step loop of a speculative step is longer)."""
    S = N
    x, state0, slots, inter0 = self.inputs(N, HV, D, S, seed=7)
    ref_o, ref_state = self.reference(x, state0, slots, inter0, steps=self.loop_steps)
    default = self.configs.decode_config(self.K, self.V)
    rows = []
    for BV, w, ns in ((BV, w, ns) for BV in bvs for w in warps for ns in stages):
        row = dict(N=N, HV=HV, D=D, S=S, BV=BV, num_warps=w, num_stages=ns,
                   default_cfg=f"BV{default.BV}w{default.num_warps}s{default.num_stages}",
                   is_default=(BV, w, ns) == (default.BV, default.num_warps,
                                              default.num_stages))

        def body(row, BV=BV, w=w, ns=ns):
          cfg = self.configs.DecodeConfig(BV=BV, num_warps=w, num_stages=ns)
          loop = self.step_fn(D > 1, steps=self.loop_steps, config=cfg)
          o, st, _ = loop(self.copy(state0), self.copy(inter0), x["q"], x["k"], x["v"], x["g"],
                          x["beta"], slots)
          row["err_ref"] = common.worst(common.rel_err(o, ref_o),
                               common.rel_err(st[slots[:CHECK_ROWS]],
                                              ref_state[slots[:CHECK_ROWS]]))
          t = common.time_jax(self.run_chain(loop, st, None if D == 1 else self.copy(inter0),
                                             x, slots))
          row["loop_ms"], row["spread"] = t["ms"] / self.loop_steps, t["spread"]
          row["TBps"] = (self.state_bytes(N, HV, D, "float32", D > 1)
                         / (row["loop_ms"] * 1e-3) / 1e12)

        rows.append(common.run_row(results, "sweep", row, body, budget))
    ok = [r for r in rows if r.get("loop_ms") and r.get("err_ref", 1.0) < OK_ERR]
    if ok:
      best = dict(min(ok, key=lambda r: r["loop_ms"]))
      dflt = [r for r in rows if r["is_default"] and r.get("loop_ms")]
      best["default_loop_ms"] = dflt[0]["loop_ms"] if dflt else None
      results.add("sweep_best", best)
    common.print_table(f"sweep N={N} HV={HV} D={D} (loop ms per step)", rows, SWEEP_COLS)


# ------------------------------------------------------------------------------------------------
# 7. (--parts launch, not in the default) Launch cost at small batch, per launch backend: steps in
# a lax.fori_loop and unrolled in one jit, beside fla-core's CUDA graph; where a jitted step's
# time goes; a trivial kernel's launch; the prefill's kernels as each backend compiles them.

LAUNCH_STEPS = 64           # steps per jitted call (fori_loop or unrolled) and per CUDA graph
LAUNCH_BACKENDS = ("triton", "xla_triton")


def launch_steps_fn(b, backend, steps, loop, config=None):
  """A jitted function running `steps` decode steps (HV, K, V, M of the bench, D = 1) with the
  cache donated: in a lax.fori_loop (loop "fori") or unrolled (loop "unrolled"); `config`
  overrides the kernel's DecodeConfig (None: the library's)."""
  jax, jnp, gdp_jax, M = b.jax, b.jnp, b.gdp_jax, b.M

  def step(state, x, slots):
    return gdp_jax.gated_delta_product_decode(
        x["q"], x["k"], x["v"], x["g"], x["beta"], num_householder=M, state=state,
        state_indices=slots, use_qk_l2norm_in_kernel=True, backend=backend, config=config)

  def f(state, x, slots):
    if loop == "fori":
      N, D = x["q"].shape[:2]
      o = jnp.zeros((N, D) + x["v"].shape[2:], x["v"].dtype)
      return jax.lax.fori_loop(0, steps, lambda i, c: step(c[1], x, slots), (o, state))
    o = None
    for _ in range(steps):
      o, state = step(state, x, slots)
    return o, state

  return jax.jit(f, donate_argnums=0)


def launch_chain(fn, state, *args):
  """A zero-argument callable running `fn(state, *args)` once, threading the donated state."""
  box = [state]

  def call():
    o, box[0] = fn(box[0], *args)
    return o, box[0]

  return call


_BUMP = {}


def bump_kernel():
  """A trivial Triton kernel (one 16-float row read, incremented, written back in place): its
  time per launch is the launch path's cost. Defined on first use, after common.setup_env has
  chosen Triton's mode."""
  if "kernel" not in _BUMP:
    import triton
    import triton.language as tl

    @triton.jit
    def bump_row_kernel(x_in, x_out, BLOCK: tl.constexpr):
      o = tl.arange(0, BLOCK)
      tl.store(x_out + o, tl.load(x_in + o) + 1.0)

    _BUMP["kernel"] = bump_row_kernel
  return _BUMP["kernel"]


def bump_fn(b, backend, steps, loop):
  """`steps` launches of the trivial kernel in one jit, each on the previous one's output."""
  jax = b.jax
  from gdp_jax import _launch

  def bump(x):
    (x,) = _launch.call(bump_kernel(), x, grid=(1,), out_shape=[x], backend=backend,
                        input_output_aliases={0: 0}, num_warps=1, num_stages=1, BLOCK=16)
    return x

  def f(x):
    if loop == "fori":
      x = jax.lax.fori_loop(0, steps, lambda i, x: bump(x), x)
    else:
      for _ in range(steps):
        x = bump(x)
    return x, x

  return jax.jit(f, donate_argnums=0)


def launch_row(b, row, bits):
  """One (N, backend, loop) cell: microseconds per step (or per launch, kernel "bump").
  `bits` collects each backend's final state per (N, loop), so the second backend's row says
  whether it gave the same bits."""
  jnp, np = b.jnp, b.np
  N, backend, loop, steps = row["N"], row["backend"], row["loop"], row["steps"]
  if row["kernel"] == "bump":
    fn, per = bump_fn(b, backend, steps, loop), steps
    x0 = jnp.zeros((16,), jnp.float32)
    out = np.asarray(fn(jnp.copy(x0))[0])
    row["err"] = float(np.max(np.abs(out - steps)))  # every launch adds 1
    t = common.time_jax(launch_chain(lambda x: fn(x), x0))
    row["us"] = t["ms"] * 1e3 / per
    return
  HV = 2 if b.smoke else 16
  x, state, slots, _ = b.inputs(N, HV, 1, N, seed=11 + N)
  if backend == "fla":
    fla_step = b.fla_step_fn(x, state, slots)
    row["us"] = common.time_torch_graph(fla_step, steps=steps) * 1e3
    return
  fn = launch_steps_fn(b, backend, steps, loop, launch_config(b, row))
  _, new_state = fn(jnp.copy(state), x, slots)
  if loop == "call":
    ref_o, ref_state = b.reference(x, state, slots, None)
    row["err_ref"] = common.rel_err(new_state[slots], ref_state[slots])
  as_bits = lambda a: b.jax.lax.bitcast_convert_type(a, jnp.uint32)
  other = bits.setdefault((N, loop, row.get("cfg")), {})
  for name, s in other.items():
    row[f"same_bits_as_{name}"] = bool(jnp.all(as_bits(new_state) == as_bits(s)))
  other[backend] = new_state
  t = common.time_jax(launch_chain(fn, state, x, slots))
  row["us"] = t["ms"] * 1e3 / steps
  row["spread"] = t["spread"]


def launch_config(b, row):
  """The row's DecodeConfig override ("BVxWARPSxSTAGES" in row["cfg"]), or None."""
  if not row.get("cfg"):
    return None
  BV, w, ns = (int(a) for a in row["cfg"].split("x"))
  return b.configs.DecodeConfig(BV=BV, num_warps=w, num_stages=ns)


def launch_profile_row(b, row):
  """Where one jitted small-batch step spends its time (us per step, CUPTI through
  jax.profiler): kernels (device busy), idle between them inside the call (each launch's host
  latency, the loop's own work), and outside the call (dispatching the jitted program, shared
  by its steps), the wall time per step from back-to-back calls, and the host's own share:
  the time until a call returns with nothing queued before it (a step whose dispatch exceeds
  its kernel time is host-bound whatever the device does)."""
  jax, jnp, np = b.jax, b.jnp, b.np
  N, backend, loop, steps = row["N"], row["backend"], row["loop"], row["steps"]
  HV = 2 if b.smoke else 16
  x, state, slots, _ = b.inputs(N, HV, 1, N, seed=13)
  fn = launch_steps_fn(b, backend, steps, loop, launch_config(b, row))
  t = common.time_jax(launch_chain(fn, jnp.copy(state), x, slots))
  chain, dispatch = launch_chain(fn, jnp.copy(state), x, slots), []
  for _ in range(3 if b.smoke else 20):
    jax.block_until_ready(chain())
    t0 = time.perf_counter()
    out = chain()
    dispatch.append(time.perf_counter() - t0)
  jax.block_until_ready(out)
  row["dispatch_us"] = float(np.median(dispatch)) * 1e6 / steps
  prof = common.profile_jax(launch_chain(fn, state, x, slots))
  row["wall_us"] = t["ms"] * 1e3 / steps
  row["kernel_us"] = prof["busy_us"] / steps
  row["idle_us"] = (prof["span_us"] - prof["busy_us"]) / steps
  row["outside_us"] = row["wall_us"] - prof["span_us"] / steps
  row["kernels"] = {k["name"]: k["count"] / steps for k in prof["kernels"]}
  row["profile"] = prof
  common.print_profile(f"{backend} {loop} N={N}, {steps} steps in one jit", prof, per=steps,
                       unit="step", timeline=True)


def launch_prefill_row(b, row):
  """One prefill call (forward, or forward and backward) under one launch backend: its time and
  its kernels' device times, to see whether XLA's Triton compiles a kernel slower than pip's."""
  jax, jnp = b.jax, b.jnp
  B, T, H, K, M = row["B"], row["T"], row["H"], row["K"], row["M"]
  backend, grad = row["backend"], row["what"] == "fwd+bwd"
  ks = jax.random.split(jax.random.PRNGKey(5), 5)
  bf16 = jnp.bfloat16
  q = jax.random.normal(ks[0], (B, T, H, K), jnp.float32).astype(bf16)
  k = jax.random.normal(ks[1], (B, T * M, H, K), jnp.float32).astype(bf16)
  v = jax.random.normal(ks[2], (B, T * M, H, K), jnp.float32).astype(bf16)
  g = jax.nn.log_sigmoid(jax.random.uniform(ks[3], (B, T, H), jnp.float32, 2.0, 6.0))
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T * M, H), jnp.float32)).astype(bf16)

  def fwd(q, k, v, g, beta):
    return b.gdp_jax.chunk_gated_delta_product(q, k, v, g, beta, num_householder=M,
                                               use_qk_l2norm_in_kernel=True, backend=backend)[0]

  if grad:
    loss = lambda *a: jnp.sum(fwd(*a).astype(jnp.float32) ** 2)
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
  else:
    fn = jax.jit(fwd)
  call = lambda: fn(q, k, v, g, beta)
  row["ms"] = common.time_jax(call)["ms"]
  prof = common.profile_jax(call)
  row["kernel_us"] = {k_["name"]: k_["us"] for k_ in prof["kernels"]}
  common.print_profile(f"prefill {row['what']} {backend} B={B} T={T} H={H} K={K} M={M}", prof)


def launch_part(b, results, budget, cfgs=()):
  """Section 7: launch cost tables (see the block comment above); `cfgs` ("BVxWARPSxSTAGES")
  add unrolled rows under other kernel configs."""
  backends = ("interpret",) if b.smoke else LAUNCH_BACKENDS
  steps = 2 if b.smoke else LAUNCH_STEPS
  Ns = (1, 2) if b.smoke else (1, 8, 32, 256)
  results.set_meta(launch_steps=steps)
  bits, rows = {}, []
  plan = [dict(kernel="bump", N=0, backend=be, loop=lp, steps=steps)
          for be in backends for lp in ("unrolled", "fori")]
  for N in Ns:
    plan += [dict(kernel="decode", N=N, backend=be, loop=lp, steps=1 if lp == "call" else steps)
             for lp in ("fori", "unrolled", "call") for be in backends]
    plan += [dict(kernel="decode", N=N, backend=be, loop="unrolled", steps=steps, cfg=c)
             for c in cfgs for be in backends]
    if b.fla is not None:
      plan.append(dict(kernel="decode", N=N, backend="fla", loop="cuda_graph", steps=steps))
  for row in plan:
    rows.append(common.run_row(results, "launch", row, lambda r: launch_row(b, r, bits), budget))
  common.print_table(f"launch cost (us per step, or per launch for kernel 'bump'; {steps} "
                     "steps per jit / per CUDA graph)", rows, LAUNCH_COLS)

  prows = [common.run_row(results, "launch_profile",
                          dict(N=N, backend=be, loop=lp, steps=steps),
                          lambda r: launch_profile_row(b, r), budget)
           for N in Ns[:2] for be in backends for lp in ("fori", "unrolled")]
  prows += [common.run_row(results, "launch_profile",
                           dict(N=N, backend=be, loop="unrolled", steps=steps, cfg=c),
                           lambda r: launch_profile_row(b, r), budget)
            for N in Ns[:2] for be in backends for c in cfgs]
  common.print_table("where a jitted step's time goes (us per step)", prows,
                     LAUNCH_PROFILE_COLS)

  shape = (dict(B=1, T=40, H=1, K=16, M=2) if b.smoke else dict(B=1, T=8192, H=16, K=128, M=2))
  frows = [common.run_row(results, "launch_prefill", dict(shape, what=w, backend=be),
                          lambda r: launch_prefill_row(b, r), budget)
           for w in ("fwd", "fwd+bwd") for be in backends]
  common.print_table("prefill per launch backend (ms per call)", frows, LAUNCH_PREFILL_COLS)
  # Kernel by kernel, the second backend's device time over the first's.
  for w in ("fwd", "fwd+bwd"):
    pair = [r for r in frows if r["what"] == w and r.get("kernel_us")]
    if len(pair) == 2:
      a, c = pair
      print(f"\n-- prefill {w}: kernel device time, {c['backend']} / {a['backend']}")
      for name, us in sorted(a["kernel_us"].items(), key=lambda kv: -kv[1])[:12]:
        other = c["kernel_us"].get(name)
        ratio = f"{other / us:6.3f}" if other and us else "   -  "
        print(f"   {us:10.1f} us  {ratio}  {name[:80]}")


LAUNCH_COLS = [
    ("kernel", "kernel", ""), ("N", "N", "d"), ("backend", "backend", ""), ("loop", "loop", ""),
    ("cfg", "cfg", ""), ("us", "us", ".2f"), ("spread", "spr", ".2f"), ("err_ref", "err_ref", ".1e"),
    ("err", "err", ".1e"), ("same_bits_as_triton", "bits=triton", ""),
    ("row_s", "row_s", ".1f"),
]
LAUNCH_PROFILE_COLS = [
    ("N", "N", "d"), ("backend", "backend", ""), ("loop", "loop", ""), ("cfg", "cfg", ""),
    ("wall_us", "wall", ".2f"), ("kernel_us", "kernels", ".2f"), ("idle_us", "idle_in_call", ".2f"),
    ("outside_us", "outside_call", ".2f"), ("dispatch_us", "dispatch", ".2f"),
]
LAUNCH_PREFILL_COLS = [
    ("what", "what", ""), ("backend", "backend", ""), ("B", "B", "d"), ("T", "T", "d"),
    ("H", "H", "d"), ("K", "K", "d"), ("M", "M", "d"), ("ms", "ms", ".4f"),
]


SWEEP_COLS = [
    ("BV", "BV", "d"), ("num_warps", "warps", "d"), ("num_stages", "stages", "d"),
    ("is_default", "default", ""), ("loop_ms", "loop_ms", ".4f"), ("spread", "spread", ".2f"), ("TBps", "TB/s", ".2f"),
    ("err_ref", "err_ref", ".1e"),
]
MAIN_COLS = [
    ("N", "N", "d"), ("HV", "HV", "d"), ("D", "D", "d"), ("S", "S", "d"),
    ("state_dtype", "state", "s"), ("cfg", "cfg", "s"),
    ("ours_ms", "ours_ms", ".4f"), ("ours_spread", "spr", ".2f"),
    ("ours_loop_ms", "loop_ms", ".4f"), ("TBps_loop", "TB/s", ".2f"),
    ("frac_copy", "/copy", ".2f"), ("copy_floor_ms", "floor_ms", ".4f"),
    ("fla_ms", "fla_ms", ".4f"), ("fla_graph_ms", "fla_graph", ".4f"),
    ("fla_TBps_graph", "fla_TB/s", ".2f"), ("ours_over_fla", "ours/fla", ".2f"),
    ("ours_over_fla_graph", "loop/graph", ".2f"),
    ("err_ref_o", "err_ref_o", ".1e"), ("err_ref_state", "err_ref_h", ".1e"),
    ("err_fla_o", "err_fla_o", ".1e"), ("err_fla_state", "err_fla_h", ".1e"),
    ("err_snapshot", "err_snap", ".1e"), ("row_s", "row_s", ".1f"),
]


SPEC_COLS = [
    ("N", "N", "d"), ("HV", "HV", "d"), ("D", "D", "d"), ("S", "S", "d"),
    ("snapshots", "snapshots", "s"),
    ("accept_loop_ms", "verify+accept", ".4f"), ("accept_TBps", "TB/s", ".2f"),
    ("new_loop_ms", "num_accepted", ".4f"), ("new_TBps", "TB/s", ".2f"),
    ("d1_loop_ms", "D=1", ".4f"), ("new_over_d1", "new/D1", ".2f"),
    ("accept_over_d1", "old/D1", ".2f"), ("fla_graph_ms", "fla_graph", ".4f"),
    ("new_over_fla_graph", "new/fla", ".2f"), ("same_bits", "same_bits", ""),
    ("row_s", "row_s", ".1f"),
]


REPLAY_COLS = [
    ("N", "N", "d"), ("HV", "HV", "d"), ("D", "D", "d"), ("S", "S", "d"), ("cfg", "cfg", "s"),
    ("replay_loop_ms", "replay", ".4f"), ("replay_TBps", "TB/s", ".2f"),
    ("snap_loop_ms", "num_accepted", ".4f"), ("d1_loop_ms", "D=1", ".4f"),
    ("replay_over_d1", "replay/D1", ".2f"), ("snap_over_d1", "snap/D1", ".2f"),
    ("fla_graph_ms", "fla_graph", ".4f"), ("replay_over_fla_graph", "replay/fla", ".2f"),
    ("same_bits", "same_h_bits", ""), ("err_plain_o", "err_plain_o", ".1e"),
    ("err_ref_o", "err_ref_o", ".1e"), ("err_ref_state", "err_ref_h", ".1e"),
    ("row_s", "row_s", ".1f"),
]


PROFILE_COLS = [
    ("N", "N", "d"), ("HV", "HV", "d"), ("D", "D", "d"), ("side", "side", ""),
    ("kernel_us", "kernels", ".2f"), ("span_us", "span", ".2f"),
]


def main():
  args = parse_args()
  common.setup_env(args.cpu_smoke)
  out = common.out_dir(args.out)
  budget = common.Budget(args.budget_s)
  b = Bench(args)
  results = common.Results(os.path.join(out, "decode.json"),
                           dict(common.versions(), smoke=b.smoke, backend=b.backend, H=b.H, K=b.K,
                                V=b.V, M=b.M, loop_steps=b.loop_steps))
  print("[decode] versions:", results.data["meta"])
  parts = set(args.parts.split(","))
  try:
    # 1. Copy bandwidth, the ceiling for a step that streams its state.
    if "copy" in parts:
      try:
        c = common.copy_bandwidth_jax((16 << 20) if b.smoke else (4 << 30))
        b.copy_Bps = c["Bps"]
        results.set_meta(copy_Bps=c["Bps"], copy_ms=c["ms"], copy_bytes=c["bytes"])
        print(f"[decode] copy bandwidth (jax, read + write): {c['Bps'] / 1e12:.3f} TB/s "
              f"({c['bytes'] / 2**30:.2f} GiB in {c['ms']:.3f} ms, spread {c['spread']:.2f})")
        if b.fla is not None:
          ct = common.copy_bandwidth_torch(4 << 30)
          results.set_meta(copy_Bps_torch=ct["Bps"])
          print(f"[decode] copy bandwidth (torch copy_): {ct['Bps'] / 1e12:.3f} TB/s")
      except Exception as e:
        print(f"[decode] copy bandwidth failed: {type(e).__name__}: {e}")
      common.free_device_memory()

    # 2. First call: compile cost (first, while the Triton cache is empty).
    if "first" in parts:
      try:
        b.first_call(results)
      except Exception as e:
        results.set_meta(compile_error=f"{type(e).__name__}: {e}"[:800])
        print(f"[decode] first-call timing failed: {type(e).__name__}: {e}")
      common.free_device_memory()

    # 3. + 4. The main table and the bf16 cache, most informative rows first so that a budget
    # cut drops the least: the bandwidth-bound D = 1 rows, then snapshots (D = 4).
    if b.smoke:
      shapes = [(1, 2, 1, 1), (2, 2, 2, 2), (2, 2, 1, 16)]
      bf16_shapes = [(2, 2, 1, 2)]
    else:
      shapes = [(256, 16, 1, 256), (256, 16, 1, 8 * 256)]
      shapes += [(N, 16, 1, N) for N in (1, 8, 64)]
      shapes += [(N, 32, 1, N) for N in (1, 8, 64, 256)]
      shapes += [(N, HV, 4, N) for HV in (16, 32) for N in (1, 8, 64, 256)]
      bf16_shapes = [(256, 16, 1, 256)]
    if args.shapes:
      shapes = [tuple(int(n) for n in item.split("x")) for item in args.shapes.split(",")]
      shapes = [s if len(s) == 4 else s + (s[0],) for s in shapes]
    rows = []
    plan = []
    if "main" in parts:
      plan += [dict(N=N, HV=HV, D=D, S=S, state_dtype="float32") for N, HV, D, S in shapes]
    if "bf16" in parts:
      plan += [dict(N=N, HV=HV, D=D, S=S, state_dtype="bfloat16") for N, HV, D, S in bf16_shapes]
    if "main" in parts and "bf16" in parts and not b.smoke:
      plan.insert(5, plan.pop())  # the bf16 cache right after the HV = 16, D = 1 rows
    for row in plan:
      rows.append(common.run_row(results, "decode", row, b.main_row, budget))
    if rows:
      common.print_table(f"decode step (ms; loop = per step of {b.loop_steps} in one jit / "
                         "one CUDA graph)", rows, MAIN_COLS)

    # Speculative steps: the rollback copy against num_accepted.
    if "spec" in parts:
      spec_shapes = [(2, 2, 2, 3, "float32"), (2, 2, 4, 3, "bfloat16")] if b.smoke else [
          (256, 16, D, 256, "float32") for D in (4, 2, 8)] + [(256, 16, 4, 256, "bfloat16")]
      srows = [common.run_row(results, "spec", dict(N=N, HV=HV, D=D, S=S, snapshots=sdt),
                              b.spec_row, budget)
               for N, HV, D, S, sdt in spec_shapes]
      common.print_table(f"speculative step (loop ms per step of {b.loop_steps} in one jit)",
                         srows, SPEC_COLS)

    # Checkpoint + replay against the num_accepted step and fla-core, D = 1, 2, 4, 8.
    if "replay" in parts:
      replay_shapes = [(2, 2, 1, 3), (2, 2, 3, 3)] if b.smoke else [
          (256, 16, int(D), 256) for D in args.replay_ds.split(",")]
      cfgs = [""] + list(filter(None, args.replay_configs.split(",")))
      rrows = [common.run_row(results, "replay", dict(N=N, HV=HV, D=D, S=S, cfg=c),
                              b.replay_row, budget)
               for c in cfgs for N, HV, D, S in replay_shapes]
      common.print_table(f"checkpoint + replay step (loop ms per step of {b.loop_steps} in one "
                         "jit)", rrows, REPLAY_COLS)

    # Kernel profiles (--parts profile): at the --shapes rows, or N = 1, 8, 256 at HV = 16.
    if "profile" in parts:
      prof_shapes = shapes if args.shapes else (
          [(1, 2, 1, 1)] if b.smoke else [(1, 16, 1, 1), (8, 16, 1, 8), (256, 16, 1, 256)])
      # Every profile of ours before any of fla-core's: after torch.profiler has run, CUPTI
      # refuses jax.profiler as a second subscriber and our profiles come back empty.
      prows = [common.run_row(results, "profile", dict(N=N, HV=HV, D=D, S=S, side=side),
                              b.profile_row, budget)
               for side in ("ours",) + (("fla",) if b.fla is not None else ())
               for N, HV, D, S in prof_shapes]
      common.print_table(f"decode kernel profile (us per step of {b.loop_steps})", prows,
                         PROFILE_COLS)

    # 5. Config sweep.
    if "sweep" in parts:
      grid = parse_sweep_grid(args.sweep_grid, smoke=b.smoke)
      for N, D in ((N, D) for D in grid["D"] for N in grid["N"]):
        if budget.over():
          print(f"[decode] sweep N={N} D={D} skipped: budget spent")
          continue
        try:
          b.sweep_shape(results, N, 2 if b.smoke else 16, D, grid["BV"], grid["warps"],
                        grid["stages"], budget)
        except Exception as e:
          print(f"[decode] sweep N={N} D={D} failed: {type(e).__name__}: {e}")
        common.free_device_memory()
      common.print_table("sweep: best config per shape", results.data["sections"].get(
          "sweep_best", []), common.SWEEP_BEST_COLS)

    # 7. Launch cost per launch backend (--parts launch).
    if "launch" in parts:
      launch_part(b, results, budget, list(filter(None, args.launch_configs.split(","))))
  except KeyboardInterrupt:
    results.set_meta(interrupted=True)
    print("[decode] interrupted; partial results saved")
  results.set_meta(elapsed_s=budget.elapsed())
  print(f"[decode] done in {budget.elapsed():.1f} s; results in {results.path}")


if __name__ == "__main__":
  main()
