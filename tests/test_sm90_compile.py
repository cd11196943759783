"""Every kernel configuration the launchers pick compiles for the H200 (sm_90) within its
shared memory, checked on a machine without a GPU.

A configuration that asks for more shared memory than the GPU has compiles fine and fails only
at launch ("Shared memory requested (287240 b) exceeds device resources (232448 b)": the prefill
scan with 3 pipeline stages on float32 inputs at K=256, found on the H200). Triton compiles for
a CUDA target without a device, so this test traces the public entry points with the launch
replaced by a recorder (the kernel, its argument types, constexprs, warps and stages, exactly as
they would reach jax-triton), compiles each distinct launch for sm_90 and reads the shared
memory the compiler reserved.

It runs in a subprocess: Triton fixes interpreted or compiled mode when it is first imported,
and the test process has imported it in interpreter mode (conftest.py).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

# cudaDevAttrMaxSharedMemoryPerBlockOptin of an H100 / H200: 227 KB.
SM90_MAX_SHARED = 232448

# (what, dtype, K, V, N): the largest head sizes the kernels support and the common one; N
# sequences, few and many; one sequence of 2200 tokens too (T below), so that the forward scan
# splits into pieces (its summary launch, the chain, the walk per piece) and, for training,
# the backward's reverse pass does; and packed training with as many value heads as key heads
# (chunk_wy_bwd finishes dk and zeroes the rows past cu_seqlens[N]).
CASES = [("prefill", "bfloat16", 256, 512, 2), ("prefill", "float32", 256, 512, 2),
         ("prefill", "bfloat16", 128, 128, 2), ("prefill", "bfloat16", 128, 128, 16),
         ("prefill", "bfloat16", 256, 512, 1), ("prefill", "float32", 256, 512, 1),
         ("prefill", "bfloat16", 128, 128, 1),
         ("decode", "bfloat16", 256, 512, 4), ("decode", "float32", 256, 512, 4),
         ("speculative", "bfloat16", 256, 512, 4),
         ("replay", "bfloat16", 256, 512, 4), ("replay", "float32", 128, 128, 4),
         ("replay", "bfloat16", 128, 128, 4),  # the new tokens in block form (tensor cores)
         ("commit", "bfloat16", 256, 512, 4),
         ("train", "bfloat16", 256, 512, 2), ("train", "float32", 256, 512, 2),
         ("train", "bfloat16", 128, 128, 16), ("train", "bfloat16", 128, 128, 1),
         ("train_packed", "bfloat16", 128, 128, 3)]
# float32 takes the largest shared-memory tiles at K=256 V=512 (kept above): its default dots are
# three TF32 tensor-core products each (f32_precision "tf32x3"), whose operand tiles sit in shared
# memory (chunk_o: 229376 B of 232448). The float32 variants at K=V=128 and the float32 packed
# and one-sequence training cases, whose tiles are no larger, are left to the GPU tests.
# Training under the chunk_o_bwd variant of BwdConfig that tied the default (only chunk_o_bwd's
# launch differs), at the benchmark's K=V=128.
CASES += [("train", "bfloat16", 128, 128, 16, dict(o_bk=128, o_warps=8))]
# float32 with exact products ("ieee", f32_precision's other value, the forward rule's too): FMA
# loops, which compile for up to a minute per kernel (docs/performance.md, "Compile time").
CASES += [("train", "float32", 256, 512, 2, dict(f32_precision="ieee"))]


def _record_launches(what, dtype, K, V, N, bwd=None):
  """The launches one call makes, as jax-triton would compile them (not run); for "train", bwd:
  BwdConfig overrides (None: the public entry point, which takes the default)."""
  import jax
  import jax.numpy as jnp
  import gdp_jax
  from gdp_jax import _backends, _launch_jax_triton, _launch_spec, _prefill_bwd
  from gdp_jax import _prefill_kernels as pk

  launches = []

  def recorder(spec, arrays):
    fn = _launch_spec.kernel_function(spec.kernel, interpret=False)
    launches.append((fn, spec.with_arrays(arrays), spec.out_shape, spec.num_warps,
                     spec.num_stages, dict(spec.constexprs)))
    return tuple(jnp.zeros(s.shape, s.dtype) for s in spec.out_shape)

  _launch_jax_triton.run = recorder
  _backends.resolve = lambda backend: "triton"
  dt = jnp.dtype(dtype)
  H, HV, M, S = 2, 4, 2, 16
  f32 = jnp.float32
  sds = jax.ShapeDtypeStruct
  T = 2200 if N == 1 else 300   # 69 expanded chunks at M = 2: two pieces of 64
  if what == "prefill":
    snap = jnp.float16 if N < 8 else jnp.float32  # both snapshot widths
    args = (sds((1, T, H, K), dt), sds((1, T * M, H, K), dt), sds((1, T * M, HV, V), dt),
            sds((1, T, HV), f32), sds((1, T * M, HV), f32), sds((S, HV, K, V), f32),
            sds((N + 1,), jnp.int32), sds((N,), jnp.int32))

    def run(q, k, v, g, beta, state, cu, idx):
      return gdp_jax.chunk_gated_delta_product(
          q, k, v, g, beta, num_householder=M, cu_seqlens=cu, state=state, state_indices=idx,
          return_chunk_states=True, chunk_states_dtype=snap,
          use_qk_l2norm_in_kernel=True, backend="triton")
  elif what == "train":
    args = (sds((N, T, H, K), dt), sds((N, T * M, H, K), dt), sds((N, T * M, HV, V), dt),
            sds((N, T, HV), f32), sds((N, T * M, HV), dt), sds((N, HV, K, V), f32))

    def loss(q, k, v, g, beta, h0):
      if bwd is None:
        o, ht = gdp_jax.chunk_gated_delta_product(
            q, k, v, g, beta, num_householder=M, initial_state=h0, output_final_state=True,
            use_qk_l2norm_in_kernel=True, backend="triton")
      else:
        cfg = _prefill_bwd.BwdConfig(**bwd)
        static = _prefill_bwd._Static(M, K ** -0.5, True, True, "triton", cfg,
                                      pk.FwdConfig(f32_precision=cfg.f32_precision))
        o, ht = _prefill_bwd._prefill(q, k, v, g, beta, h0, None, static)
      return jnp.sum(o.astype(f32)) + jnp.sum(ht)

    run = jax.grad(loss, argnums=tuple(range(6)))
  elif what == "train_packed":
    H = HV
    args = (sds((1, T, H, K), dt), sds((1, T * M, H, K), dt), sds((1, T * M, HV, V), dt),
            sds((1, T, HV), f32), sds((1, T * M, HV), dt), sds((N + 1,), jnp.int32))

    def loss(q, k, v, g, beta, cu):
      o, _ = gdp_jax.chunk_gated_delta_product(
          q, k, v, g, beta, num_householder=M, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
          backend="triton")
      return jnp.sum(o.astype(f32))

    run = jax.grad(loss, argnums=tuple(range(5)))
  elif what in ("replay", "commit"):
    D = 3
    ring = (sds((S, D * M, H, K), dt), sds((S, D * M, HV, V), dt), sds((S, D, HV), f32),
            sds((S, D * M, HV), dt))
    args = (sds((N, D, H, K), dt), sds((N, D * M, H, K), dt), sds((N, D * M, HV, V), dt),
            sds((N, D, HV), f32), sds((N, D * M, HV), dt), sds((S, HV, K, V), f32),
            sds((N,), jnp.int32), ring, sds((N,), jnp.int32))

    def run(q, k, v, g, beta, state, idx, ring, accepted):
      # "replay": the checkpoint + replay step; "commit": the replay alone.
      if what == "commit":
        return gdp_jax.commit_replay(state, ring, idx, accepted, steps_per_token=M,
                                     use_qk_l2norm_in_kernel=True, backend="triton")
      return gdp_jax.gated_delta_product_decode(
          q, k, v, g, beta, num_householder=M, state=state, state_indices=idx,
          num_accepted=accepted, replay_ring=ring, use_qk_l2norm_in_kernel=True,
          backend="triton")
  else:
    D = 3
    args = (sds((N, D, H, K), dt), sds((N, D * M, H, K), dt), sds((N, D * M, HV, V), dt),
            sds((N, D, HV), f32), sds((N, D * M, HV), f32), sds((S, HV, K, V), f32),
            sds((N,), jnp.int32), sds((S, D, HV, K, V), f32), sds((N,), jnp.int32))

    def run(q, k, v, g, beta, state, idx, inter, accepted):
      # "speculative": the step that starts from the previous step's snapshots.
      return gdp_jax.gated_delta_product_decode(
          q, k, v, g, beta, num_householder=M, state=state, state_indices=idx,
          intermediate_states=inter, use_qk_l2norm_in_kernel=True, backend="triton",
          num_accepted=accepted if what == "speculative" else None)
  jax.eval_shape(run, *args)
  return launches


def _signature(fn, args, out_shape, constexprs):
  """Triton signature and attributes of a launch, typed the way jax-triton 0.3.1 types it: every
  array pointer is taken as 16-byte aligned (XLA's buffers are), which lets Triton pipeline
  loads through shared memory with cp.async; without that attribute a kernel compiles with far
  less shared memory than it asks for on the GPU (found on the H200: 235528 B for the fused scan
  at BV 64, where this test without it measured 18440 B)."""
  import numpy as np

  def ptr(dtype):
    return "*" + {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16",
                  "int32": "i32", "int64": "i64"}[np.dtype(dtype).name]

  sig, consts, attrs = {}, dict(constexprs), {}
  for i, (a, name) in enumerate(zip(list(args) + list(out_shape), fn.arg_names)):
    if hasattr(a, "dtype") and hasattr(a, "shape") and not isinstance(a, np.generic):
      sig[name] = ptr(a.dtype)
      attrs[(i,)] = [["tt.divisibility", 16]]
    elif isinstance(a, bool):
      sig[name] = "i1"
    elif isinstance(a, int):
      if a == 1:  # jax-triton turns a scalar 1 into a constexpr
        consts[name] = 1
      else:
        sig[name] = "i32" if -2**31 <= a < 2**31 else "i64"
    else:
      sig[name] = "fp32"
  for name in consts:
    sig[name] = "constexpr"
  return sig, consts, attrs


def _resource_usage(triton, cubin):
  """(registers, stack bytes) per thread of a cubin, from the cuobjdump that ships with
  Triton; a nonzero stack is ptxas spilling registers to local memory."""
  import tempfile
  tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
  with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(cubin)
    f.flush()
    out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                         text=True, check=True).stdout
  m = re.search(r"REG:(\d+) STACK:(\d+)", out)
  return int(m.group(1)), int(m.group(2))


def _cpu_seconds():
  """This process's CPU time and its finished children's (ptxas runs as one)."""
  import resource
  import time
  kids = resource.getrusage(resource.RUSAGE_CHILDREN)
  return time.process_time() + kids.ru_utime + kids.ru_stime


def main(cases=CASES):
  import triton
  from triton.backends.compiler import GPUTarget
  from triton.compiler import ASTSource
  seen, report = set(), []
  verbose = os.environ.get("GDP_SM90_REPORT") == "1"  # print registers and spills too
  for case in cases:
    for fn, args, out_shape, warps, stages, constexprs in _record_launches(*case):
      sig, consts, attrs = _signature(fn, args, out_shape, constexprs)
      key = (fn.__name__, tuple(sig.items()), tuple(sorted(consts.items())), warps, stages)
      if key in seen:
        continue
      seen.add(key)
      t0 = _cpu_seconds()  # compile time: CPU, not wall (the development host is shared)
      kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=stages))
      cpu_s = round(_cpu_seconds() - t0, 2)
      regs, stack = _resource_usage(triton, kernel.asm["cubin"])
      report.append(dict(case=list(case), kernel=fn.__name__, num_warps=warps,
                         num_stages=stages, shared=kernel.metadata.shared, regs=regs,
                         stack=stack, compile_cpu_s=cpu_s))
      if verbose:
        print(case, fn.__name__, warps, stages, "shared", kernel.metadata.shared, "regs", regs,
              "stack", stack, "compile CPU s", cpu_s, file=sys.stderr)
  print(json.dumps(report))


@pytest.mark.slow  # compiles every launch for sm_90: minutes on one core
def test_every_launch_fits_sm90_shared_memory():
  env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
  env["JAX_PLATFORMS"] = "cpu"
  # The checkout this file is in, not whichever gdp_jax is installed (the script's own folder,
  # tests/, is what Python puts first on its path).
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
  proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                        timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  report = json.loads(proc.stdout.strip().splitlines()[-1])
  kernels = {r["kernel"] for r in report}
  # Every kernel of both paths was traced and compiled.
  assert {"chunk_kkt_fwd_kernel", "chunk_solve_fwd_kernel", "chunk_h_fwd_kernel",
          "chunk_h_chain_kernel", "chunk_o_fwd_kernel", "chunk_dv_local_kernel", "chunk_h_bwd_kernel",
          "chunk_o_bwd_kernel", "chunk_wy_bwd_kernel", "qk_bwd_kernel"} <= kernels, kernels
  assert any("decode" in k or "recurrent" in k for k in kernels), kernels
  over = [r for r in report if r["shared"] > SM90_MAX_SHARED]
  assert not over, f"over the {SM90_MAX_SHARED} bytes of an sm_90 block: {over}"
  # The decode kernel keeps its state in registers, the replay step's included.
  spills = [r for r in report if r["kernel"] == "fused_recurrent_fwd_kernel" and r["stack"]]
  assert not spills, f"the decode kernel spills: {spills}"


def _parse_case(text):
  """"train,float32,128,128,16[,f32_precision=ieee,...]" as a CASES entry."""
  what, dtype, *sizes = text.split(",")
  nums = [int(x) for x in sizes if "=" not in x]
  over = {k: int(v) if v.lstrip("-").isdigit() else v
          for k, v in (x.split("=", 1) for x in sizes if "=" in x)}
  return (what, dtype, *nums) + ((over,) if over else ())


if __name__ == "__main__":
  # Without arguments every case of CASES; with arguments the cases they name, e.g.
  # train,float32,128,128,16,f32_precision=ieee (time compiles with an empty TRITON_CACHE_DIR).
  main([_parse_case(a) for a in sys.argv[1:]] or CASES)
