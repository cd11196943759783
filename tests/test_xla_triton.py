"""Launch backend "xla_triton": our kernels handed to XLA's own Triton custom call.

On a CPU (a subprocess: the TTIR needs triton in compiled mode, and the test process imported
it in interpreter mode, conftest.py) every workload below is lowered for CUDA and each custom
call is read back: its target, its backend_config (name, grid, warps, stages, as the "triton"
backend would launch the same kernel), its aliases, and a TTIR that pip's triton parses, whose
kernel takes pointers only (the scalars compiled in), and that the Triton dialect jaxlib ships
(the one its XLA compiles with) parses too. These need no GPU: on the H200 they run with its
versions by `pytest tests/test_xla_triton.py -m "not gpu"`. With `-m gpu` every workload runs
under both launch backends and must agree within rounding (XLA's Triton is another compiler:
not the same bits).

The whole GPU suite runs under this backend with `pytest -m gpu --launch=xla_triton`
(conftest.py).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

TARGET = "__gpu$xla.gpu.triton"


# -------------------------------------------------------------------------------------------------
# Workloads: one per launch path of the entry points (decode fold with snapshots, the fused step
# packed with an initial state, the prepare kernel with libdevice, the prefill packed into a
# cache with chunk states, the prefill at K=256 V=512, and its backward).

def workloads():
  """name -> (inputs, f) where f(backend, *inputs) returns the outputs of one call."""
  import jax
  import jax.numpy as jnp
  import gdp_jax
  bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  out = {}

  rng = np.random.default_rng(1)
  N, D, M, H, HV, K, V, S = 8, 3, 2, 4, 8, 128, 128, 12
  slots = rng.permutation(S)[:N].astype(np.int32)
  slots[2] = -1
  out["decode"] = (
      (bf16(rng.standard_normal((N, D, H, K))), bf16(rng.standard_normal((N, D * M, H, K))),
       bf16(rng.standard_normal((N, D * M, HV, V))), f32(-rng.exponential(0.3, (N, D, HV))),
       f32(rng.uniform(0, 1, (N, D * M, HV))), f32(rng.standard_normal((S, HV, K, V))),
       jnp.asarray(slots), f32(np.full((S, D, HV, K, V), np.nan))),
      lambda backend, q, k, v, g, beta, state, slots, inter: gdp_jax.gated_delta_product_decode(
          q, k, v, g, beta, num_householder=2, state=state, state_indices=slots,
          intermediate_states=inter, use_qk_l2norm_in_kernel=True, backend=backend))

  rng = np.random.default_rng(2)
  T, H, HV, K, V = 9, 2, 4, 64, 96
  out["fused_packed"] = (
      (bf16(rng.standard_normal((1, T, H, K))), bf16(rng.standard_normal((1, T, H, K))),
       bf16(rng.standard_normal((1, T, HV, V))), f32(-rng.exponential(0.3, (1, T, HV))),
       bf16(rng.uniform(0, 1, (1, T, HV))), f32(rng.standard_normal((3, HV, K, V))),
       jnp.asarray([0, 4, 4, 9], jnp.int32)),
      lambda backend, q, k, v, g, beta, h0, cu: gdp_jax.fused_recurrent_gated_delta_rule(
          q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
          use_qk_l2norm_in_kernel=True, backend=backend))

  rng = np.random.default_rng(3)
  N, D, M, H, HV, K = 4, 2, 3, 2, 4, 128
  out["prepare"] = (
      (bf16(rng.standard_normal((N, D, H, K))), bf16(rng.standard_normal((N, D * M, H, K))),
       bf16(rng.standard_normal((N, D * M, HV, K))), f32(rng.standard_normal((N, D, HV))),
       f32(rng.standard_normal((N, D * M, HV))), f32(rng.standard_normal(HV)),
       f32(rng.standard_normal(HV))),
      lambda backend, *x: gdp_jax.gated_delta_product_decode_prepare(
          *x, num_householder=3, allow_neg_eigval=True, backend=backend))

  rng = np.random.default_rng(4)
  lens, M, H, HV, K, V, S = (200, 75, 1), 2, 2, 4, 128, 128, 5
  T = sum(lens)
  out["prefill_cache"] = (
      (bf16(rng.standard_normal((1, T, H, K))), bf16(rng.standard_normal((1, T * M, H, K))),
       bf16(rng.standard_normal((1, T * M, HV, V))), f32(-rng.exponential(0.1, (1, T, HV))),
       f32(rng.uniform(0, 1, (1, T * M, HV))), f32(rng.standard_normal((S, HV, K, V))),
       jnp.asarray([3, -1, 0], jnp.int32),
       jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)),
      lambda backend, q, k, v, g, beta, state, slots, cu: gdp_jax.chunk_gated_delta_product(
          q, k, v, g, beta, num_householder=2, cu_seqlens=cu, state=state, state_indices=slots,
          return_chunk_states=True, use_qk_l2norm_in_kernel=True, backend=backend))

  rng = np.random.default_rng(5)
  B, T, M, H, HV, K, V = 1, 150, 2, 1, 2, 256, 512
  out["prefill_k256"] = (
      (bf16(rng.standard_normal((B, T, H, K))), bf16(rng.standard_normal((B, T * M, H, K))),
       bf16(rng.standard_normal((B, T * M, HV, V))), f32(-rng.exponential(0.1, (B, T, HV))),
       f32(rng.uniform(0, 1, (B, T * M, HV))), f32(rng.standard_normal((B, HV, K, V)))),
      lambda backend, q, k, v, g, beta, h0: gdp_jax.chunk_gated_delta_product(
          q, k, v, g, beta, num_householder=2, initial_state=h0, output_final_state=True,
          use_qk_l2norm_in_kernel=True, backend=backend))

  # float32 at K = 256: the output stage's tf32x3 operand tiles at 2 stages overflow the shared
  # memory of XLA's Triton build (gdp_jax/_prefill_kernels.py, _output_launch).
  rng = np.random.default_rng(7)
  B, T, M, H, HV, K, V = 1, 70, 2, 1, 1, 256, 512
  out["prefill_k256_f32"] = (
      (f32(rng.standard_normal((B, T, H, K))), f32(rng.standard_normal((B, T * M, H, K))),
       f32(rng.standard_normal((B, T * M, HV, V))), f32(-rng.exponential(0.1, (B, T, HV))),
       f32(rng.uniform(0, 1, (B, T * M, HV)))),
      lambda backend, q, k, v, g, beta: gdp_jax.chunk_gated_delta_product(
          q, k, v, g, beta, num_householder=2, use_qk_l2norm_in_kernel=True, backend=backend))

  rng = np.random.default_rng(6)
  B, T, M, H, HV, K, V = 2, 100, 2, 2, 4, 128, 128

  def grads(backend, q, k, v, g, beta, h0, w_o, w_h):
    def loss(q, k, v, g, beta, h0):
      o, ht = gdp_jax.chunk_gated_delta_product(
          q, k, v, g, beta, num_householder=2, initial_state=h0, output_final_state=True,
          use_qk_l2norm_in_kernel=True, backend=backend)
      return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(ht * w_h)
    # The loss value too: without it the forward's output would be dead code (the loss is
    # linear in it) and XLA would drop its kernel.
    return jax.value_and_grad(loss, argnums=tuple(range(6)))(q, k, v, g, beta, h0)

  out["prefill_grad"] = (
      (bf16(rng.standard_normal((B, T, H, K))), bf16(rng.standard_normal((B, T * M, H, K))),
       bf16(rng.standard_normal((B, T * M, HV, V))), f32(-rng.exponential(0.1, (B, T, HV))),
       bf16(rng.uniform(0, 1, (B, T * M, HV))), f32(rng.standard_normal((B, HV, K, V))),
       f32(rng.standard_normal((B, T, HV, V))), f32(rng.standard_normal((B, HV, K, V)))),
      grads)
  return out


# -------------------------------------------------------------------------------------------------
# CPU: the lowering (run as a script in a subprocess)

def _custom_calls(lowered):
  """Every stablehlo.custom_call of a lowered module, as a dict of what XLA will read."""
  calls = []

  def walk(op):
    for region in op.regions:
      for block in region.blocks:
        for inner in block.operations:
          inner = inner.operation
          if inner.name == "stablehlo.custom_call":
            attrs = inner.attributes
            call = dict(target=attrs["call_target_name"].value,
                        operands=len(inner.operands), results=len(inner.results),
                        aliases=len(attrs["output_operand_aliases"])
                        if "output_operand_aliases" in attrs else 0)
            if call["target"] == TARGET:
              config = attrs["mhlo.backend_config"]
              call.update({k: config[k].value for k in (
                  "name", "ir", "num_warps", "num_stages", "grid_x", "grid_y", "grid_z")})
            calls.append(call)
          walk(inner)

  walk(lowered.compiler_ir("stablehlo").operation)
  return calls


def _ttir_signature(text, tmp):
  """(entry name, parameter types) of a TTIR text, as pip's triton parses it."""
  from triton.backends.compiler import GPUTarget
  from triton.compiler import make_backend
  from triton.compiler.compiler import IRSource
  from triton._C.libtriton import ir
  path = os.path.join(tmp, "kernel.ttir")
  with open(path, "w") as f:
    f.write(text)
  src = IRSource(path, ir.context(), make_backend(GPUTarget("cuda", 90, 32)))
  return src.name.lstrip("@"), [str(t) for t in src.signature.values()]


def _jaxlib_parse_error(text):
  """None if the Triton dialect jaxlib ships (the one its XLA compiles with) parses the TTIR,
  else the parser's message."""
  from jax._src.interpreters import mlir
  from jax._src.lib import triton as jaxlib_triton
  from jax._src.lib.mlir import ir
  ctx = mlir.make_ir_context()
  jaxlib_triton.dialect.register_dialect(ctx)
  try:
    with ctx:
      ir.Module.parse(text)
  except Exception as e:  # noqa: BLE001 - the message is the finding
    return str(e)[:600]
  return None


def main(out_path):
  import tempfile
  import jax
  import jax.numpy as jnp
  from gdp_jax import _backends, _launch_jax_triton, _launch_spec
  _backends.resolve = lambda backend: backend  # no GPU here; the lowering targets CUDA anyway
  tmp = tempfile.mkdtemp()
  report = {}

  # The launch module's own kernel (tests/test_launch.py): an aliased cache and two scalars.
  import test_launch as tl_
  x, idx, cache = tl_._case(jnp.float32)
  step = jax.jit(lambda x, i, c: tl_._run(x, i, c, 0.5, "xla_triton"), donate_argnums=2)
  lowered = step.trace(x, idx, cache).lower(lowering_platforms=("cuda",))
  [call] = _custom_calls(lowered)
  call["jaxlib_parse_error"] = _jaxlib_parse_error(call["ir"])
  call["signature"] = _ttir_signature(call["ir"], tmp)
  call["hlo"] = lowered.as_text(dialect="hlo")
  # The TTIR is a whole kernel: pip's triton compiles it on to a cubin for sm_90.
  import triton
  from triton.backends.compiler import GPUTarget
  path = os.path.join(tmp, "row_update.ttir")
  with open(path, "w") as f:
    f.write(call["ir"])
  kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=call["num_warps"]))
  call["cubin_bytes"] = len(kernel.asm["cubin"])
  report["row_update"] = call

  for name, (inputs, fn) in workloads().items():
    launches = []

    def recorder(spec, arrays):
      fn_ = _launch_spec.kernel_function(spec.kernel, interpret=False)
      launches.append(dict(name=fn_.__name__, grid=list(spec.grid3), num_warps=spec.num_warps,
                           num_stages=spec.num_stages, aliases=len(spec.aliases),
                           operands=len(arrays), results=len(spec.out_shape)))
      return tuple(jnp.zeros(s.shape, s.dtype) for s in spec.out_shape)

    _launch_jax_triton.run = recorder
    jax.eval_shape(lambda *x: fn("triton", *x), *inputs)
    lowered = jax.jit(lambda *x: fn("xla_triton", *x)).trace(*inputs).lower(
        lowering_platforms=("cuda",))
    calls = _custom_calls(lowered)
    for c in calls:
      if c["target"] == TARGET:
        c["jaxlib_parse_error"] = _jaxlib_parse_error(c["ir"])
        c["signature"] = _ttir_signature(c.pop("ir"), tmp)
    report[name] = dict(launches=launches, calls=calls)
  import triton
  report["triton"] = triton.__version__
  with open(out_path, "w") as f:
    json.dump(report, f)


@pytest.fixture(scope="module")
def lowering_report(tmp_path_factory):
  out = tmp_path_factory.mktemp("xla_triton") / "report.json"
  env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
  env["JAX_PLATFORMS"] = "cpu"
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
  proc = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  with open(out) as f:
    return json.load(f)


def test_custom_call_of_one_launch(lowering_report):
  call = lowering_report["row_update"]
  assert call["target"] == TARGET
  assert (call["name"], call["grid_x"], call["grid_y"], call["grid_z"]) == (
      "_scaled_row_update_kernel", 3, 1, 1)
  assert (call["num_warps"], call["num_stages"]) == (4, 2)
  # Operands are the three arrays; the cache (operand 2) is result 1.
  assert (call["operands"], call["results"]) == (3, 2)
  hlo = call["hlo"]
  assert "api_version=API_VERSION_TYPED_FFI" in hlo
  assert "output_to_operand_aliasing={{1}: (2, {})}" in hlo
  assert "input_output_alias={ {1}: (2, {}, may-alias) }" in hlo  # the donation reaches XLA
  # The kernel takes the three inputs and two outputs as pointers and nothing else: scale = 0.5
  # and S = 7 are constants in its body.
  name, params = call["signature"]
  assert name == "_scaled_row_update_kernel"
  assert len(params) == 5 and all(p.startswith("*") for p in params), params
  body = hlo[hlo.index("ir = "):]
  assert "5.000000e-01" in body and re.search(r"constant 7 : i(32|64)", body), body[:2000]
  assert call["cubin_bytes"] > 0


@pytest.mark.parametrize("name", ["decode", "fused_packed", "prepare", "prefill_cache",
                                  "prefill_k256", "prefill_grad"])
def test_every_launch_lowers_to_xla_triton(lowering_report, name):
  """Each kernel the "triton" backend would launch is one XLA Triton call with the same grid,
  warps and stages, its arrays as operands, its outputs as results, pointers only."""
  r = lowering_report[name]
  assert r["launches"], "the workload launched nothing"
  others = [c["target"] for c in r["calls"] if c["target"] != TARGET]
  assert not others, f"custom calls other than {TARGET}: {others}"
  key = lambda c: (c["name"], tuple(c["grid"]) if "grid" in c else
                   (c["grid_x"], c["grid_y"], c["grid_z"]), c["num_warps"], c["num_stages"],
                   c["operands"], c["results"])
  assert {key(c) for c in r["calls"]} == {key(l) for l in r["launches"]}
  for c in r["calls"]:
    name_, params = c["signature"]
    assert name_ == c["name"]
    assert len(params) == c["operands"] + c["results"], (c["name"], params)
    assert all(p.startswith("*") for p in params), (c["name"], params)
  # An aliased output is an output_operand_alias of its call (the cache updated in place).
  assert ({(l["name"], l["aliases"]) for l in r["launches"]}
          == {(c["name"], c["aliases"]) for c in r["calls"]})


def test_output_stage_takes_one_stage_at_float32_k256(lowering_report):
  """At float32 K = 256 (tf32x3 dots) the output stage reaches XLA's Triton with 1 pipeline
  stage, where the "triton" backend launches it with 2: XLA's build asked 262144 B of shared
  memory for it at 2 (H200, sm_90 allows 232448). Every other launch is unchanged."""
  r = lowering_report["prefill_k256_f32"]
  launched = {(l["name"], l["num_stages"]) for l in r["launches"]}
  called = {(c["name"], c["num_stages"]) for c in r["calls"] if c["target"] == TARGET}
  assert ("chunk_o_fwd_kernel", 2) in launched and ("chunk_o_fwd_kernel", 1) in called
  assert launched - {("chunk_o_fwd_kernel", 2)} == called - {("chunk_o_fwd_kernel", 1)}


def test_jaxlibs_triton_parses_every_ttir(lowering_report):
  """XLA parses the TTIR with the Triton it bundles; jaxlib ships that dialect to Python (for
  Pallas), so what it refuses here XLA refuses at compile time. Asserted with the triton of the
  tested set (gdp_jax/_versions.py); another triton's TTIR may use ops this jaxlib does not
  know (triton 3.9 writes a barrier as ttg.barrier, jaxlib 0.10.2 knows gpu.barrier)."""
  from gdp_jax import _versions
  calls = [lowering_report["row_update"]] + [
      c for r in lowering_report.values() if isinstance(r, dict) and "calls" in r
      for c in r["calls"] if c["target"] == TARGET]
  refused = {c["name"]: c["jaxlib_parse_error"] for c in calls if c["jaxlib_parse_error"]}
  if lowering_report["triton"] != _versions.TESTED["triton"] and refused:
    pytest.skip(f"triton {lowering_report['triton']} (not the tested "
                f"{_versions.TESTED['triton']}): jaxlib's Triton refuses {refused}")
  assert not refused


def test_xla_triton_needs_a_gpu():
  import jax
  from gdp_jax import _backends
  if jax.default_backend() == "gpu":
    pytest.skip("a GPU is visible")
  with pytest.raises(NotImplementedError, match="backend='xla_triton' needs a CUDA GPU"):
    _backends.resolve("xla_triton")


# -------------------------------------------------------------------------------------------------
# GPU: the same results from both launch backends

# XLA compiles the TTIR with the Triton it bundles, whose instruction order differs from pip's:
# measured on the H200 the outputs differ by 2e-8 to 1e-5 (float32 outputs: the inputs are
# bf16, so a product rounded to bf16 inside a kernel can land on the other side of a rounding
# step, e.g. dg 1.0e-5) and 7e-6 to 9e-5 (bfloat16 outputs, a few elements one ulp apart) in
# relative rms error. A miscompile or a wrong launch shows as an error of order 1.
SAME_RTOL = 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["decode", "fused_packed", "prepare", "prefill_cache",
                                  "prefill_k256", "prefill_grad"])
def test_same_results_as_jax_triton(name, request):
  if request.config.getoption("--launch") == "xla_triton":
    pytest.skip("--launch=xla_triton routes both sides through XLA")
  import jax
  from helpers import err_ratio
  inputs, fn = workloads()[name]
  ours = jax.jit(lambda *x: fn("xla_triton", *x))(*inputs)
  theirs = jax.jit(lambda *x: fn("triton", *x))(*inputs)
  ours, theirs = jax.tree.leaves(ours), jax.tree.leaves(theirs)
  assert len(ours) == len(theirs)
  for i, (a, b) in enumerate(zip(ours, theirs)):
    assert a.dtype == b.dtype and a.shape == b.shape, f"output {i}"
    a, b = np.asarray(a.astype(np.float32)), np.asarray(b.astype(np.float32))
    # Only the decode snapshots keep NaN (slots no request addressed), in the same places.
    assert np.isfinite(b).all() or name == "decode", f"output {i}: non-finite values"
    np.testing.assert_array_equal(np.isfinite(a), np.isfinite(b))
    fin = np.isfinite(a)
    e = err_ratio(b[fin], a[fin])
    assert e < SAME_RTOL, f"output {i} {a.shape}: relative error {e:.2e} >= {SAME_RTOL:.0e}"


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  main(sys.argv[1])
