"""Gradients of the chunked prefill through the Triton backward kernels.

Every input's gradient (q, k, v, g, beta, initial_state, with a final-state cotangent) from the
kernels (the interpreter on a CPU, jax_triton on a GPU) is compared by relative error with
`jax.grad` of the float64 `lax.scan` reference on the same rounded inputs, through the public
entry point and with the reverse state pass split into a fixed number of pieces per sequence
(docs/algorithm.md §13.3). The interpreter
allocates every kernel output as NaN, so a gradient element no kernel wrote fails the
all-finite check; rows past cu_seqlens[N] must come back exactly zero. The backward's last
kernel, qk_bwd, is also checked alone against its float64 formula.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdp_jax
from conftest import KERNEL_BACKEND
from gdp_jax import _backends, _prefill_bwd, reference
from gdp_jax import _prefill_kernels as pk
from helpers import RTOL, PrefillCase, assert_close, bits_equal, err_ratio, float32_again
from helpers import spy_launches

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")

f64 = jnp.float64
NAMES = ("q", "k", "v", "g", "beta", "initial_state")
# Relative error of each gradient against the float64 reference, by input dtype. float32 inputs
# take exact float32 dots in every kernel; bfloat16 rounds the operands of every product, and
# the gradients chain three to four such products (FLA's fp16 gradient thresholds are 7e-3 to
# 2e-2, docs/algorithm.md §10.1); float16 keeps three more mantissa bits than bfloat16.
GRAD_RTOL = {"float32": 1e-5, "bfloat16": 3e-2, "float16": 1e-2}


# The prefill's case record, with an initial state and 70 tokens unless a case says otherwise.
Case = functools.partial(PrefillCase, T=70, init=True)


CASES = [
    Case(),
    Case(T=1, HV=1, M=1),
    Case(T=43, H=2, HV=4, K=100, V=80, M=3, l2norm=True),        # K, V masks; GVA; straddles
    Case(T=65, HV=1, M=1, use_g=False, use_beta=False, final=False),
    Case(T=40, HV=1, K=256, V=16, M=2, init=False),                # four state tiles
    Case(T=150, HV=2, M=2, varlen=(5, 0, 70, 1, 64), l2norm=True),  # empty sequence, slack
    Case(T=70, K=32, V=32, M=2, dtype="bfloat16", l2norm=True),
    # float16: the 16-bit paths, whose intermediates (dh, X, V', the partials) are then float16.
    Case(T=70, H=1, HV=2, K=32, V=32, M=2, dtype="float16", l2norm=True),
    # HV == H, where chunk_wy_bwd finishes dk without qk_bwd: FINISH_CASES.
]
GPU_CASES = [
    Case(B=2, T=600, H=4, HV=8, K=128, V=128, M=2, dtype="bfloat16", l2norm=True),
    # Enough programs for the backward scan unsplit (the B=2 K=128 cases above and below, and
    # the varlen float32 one, walk it in pieces; the varlen bf16 case unsplit).
    Case(B=4, T=400, H=4, HV=16, K=128, V=128, M=3, dtype="float32", l2norm=True),
    Case(B=2, T=500, H=2, HV=4, K=256, V=512, M=2, dtype="bfloat16", l2norm=True),
    Case(B=2, T=500, H=2, HV=4, K=256, V=512, M=2, dtype="float32", l2norm=True),
    Case(B=1, T=1200, H=4, HV=8, K=128, V=128, M=2, dtype="bfloat16", l2norm=True,
         varlen=(700, 0, 63, 1, 300, 130)),
    Case(B=1, T=1500, H=2, HV=4, K=100, V=80, M=3, dtype="float32", varlen=(200, 0, 65, 1000)),
    Case(B=2, T=300, H=2, HV=2, K=64, V=64, M=4, dtype="bfloat16", use_g=False),
    # HV == H with the L2 norm: chunk_wy_bwd finishes dk (the benchmark rows' layout).
    Case(B=2, T=600, H=4, HV=4, K=128, V=128, M=2, dtype="bfloat16", l2norm=True),
    Case(B=1, T=1200, H=4, HV=4, K=128, V=128, M=3, dtype="float32", l2norm=True,
         varlen=(700, 0, 63, 1, 300, 130)),
    Case(B=2, T=500, H=2, HV=2, K=256, V=512, M=2, dtype="bfloat16", l2norm=True),
    # float16 (dh, X, V' and the partials then float16): dq and dk finished in place (HV == H)
    # and by qk_bwd (HV > H).
    Case(B=2, T=600, H=4, HV=4, K=128, V=128, M=2, dtype="float16", l2norm=True),
    Case(B=1, T=1200, H=4, HV=8, K=128, V=128, M=3, dtype="float16",
         varlen=(700, 0, 63, 1, 300, 130)),
]


def n_seqs(c):
  return len(c.varlen) if c.varlen else c.B


def make_inputs(c: PrefillCase, seed):
  """(inputs by name in float64, cotangents (do, dht) in float64, keyword arguments)."""
  rng = np.random.default_rng(seed)
  N = n_seqs(c)
  q = rng.standard_normal((c.B, c.T, c.H, c.K))
  k = rng.standard_normal((c.B, c.T * c.M, c.H, c.K))
  if not c.l2norm:  # unnormalised keys with beta near 2 blow the state up and prove nothing
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
  x = dict(q=q, k=k, v=rng.standard_normal((c.B, c.T * c.M, c.HV, c.V)))
  if c.use_g:
    g = -rng.exponential(0.3, (c.B, c.T, c.HV))
    g[rng.random(g.shape) < 0.1] = 0.       # exact zeros
    x["g"] = g
  if c.use_beta:
    x["beta"] = rng.uniform(0.05, 1.95, (c.B, c.T * c.M, c.HV))   # negative eigenvalues too
  if c.init:
    x["initial_state"] = rng.standard_normal((N, c.HV, c.K, c.V))
  kw = dict(num_householder=c.M, use_qk_l2norm_in_kernel=c.l2norm, output_final_state=c.final)
  if c.varlen:
    cu = np.concatenate([[0], np.cumsum(c.varlen)])
    kw["cu_seqlens"] = jnp.asarray(cu, jnp.int32)
  cts = (rng.standard_normal((c.B, c.T, c.HV, c.V)), rng.standard_normal((N, c.HV, c.K, c.V)))
  return x, cts, kw


def _cast(c, x):
  """The inputs as the kernels take them: g and initial_state in float32, the rest in c.dtype."""
  return {n: jnp.asarray(a, jnp.float32 if n in ("g", "initial_state") else jnp.dtype(c.dtype))
          for n, a in x.items()}


def _loss(fn, cts, kw, with_outputs=False, **extra):
  """The loss <o, do> (+ <final, dht>); with_outputs: (loss, (o, final)), for has_aux."""
  do, dht = cts

  def loss(x):
    o, ht = fn(**x, **kw, **extra)
    val = jnp.sum(o.astype(f64) * do)
    if kw["output_final_state"]:
      val = val + jnp.sum(ht.astype(f64) * dht)
    return (val, (o, ht)) if with_outputs else val

  return loss


def grads(x, cts, kw, backend, config=None, with_outputs=False):
  """The kernels' gradients (with with_outputs: and (o, final)) through the public entry point
  under `config`: None (the defaults), a BwdConfig, or a (BwdConfig, FwdConfig) pair."""
  extra = {}
  if config is not None:
    bwd, fwd = (config, None) if isinstance(config, gdp_jax.BwdConfig) else config
    extra = dict(config=fwd, bwd_config=bwd)
  return jax.jit(jax.grad(_loss(gdp_jax.chunk_gated_delta_product, cts, kw,
                                with_outputs=with_outputs, backend=backend, **extra),
                          has_aux=with_outputs))(x)


def check_grads(c: PrefillCase, backend, seed=0, configs=(None,)):
  """Checks the kernels' gradients and outputs against the reference's, once per entry of
  `configs` (as `grads` takes them); returns the gradients in that order."""
  x, cts, kw = make_inputs(c, seed)
  xk = _cast(c, x)
  up = {n: a.astype(f64) for n, a in xk.items()}   # the same rounded inputs, in float64
  ref = jax.jit(jax.grad(_loss(reference.chunk_gated_delta_product, cts, kw, with_outputs=True),
                         has_aux=True))(up)
  return [_check_against(c, x, cts, kw, grads(xk, cts, kw, backend, cfg, with_outputs=True),
                         ref) for cfg in configs]


def _check_against(c, x, cts, kw, got, expected):
  """got, expected: (gradients, (o, final)) of the kernels and of the reference."""
  (out, (o, ht)), (ref, (o_ref, ht_ref)) = got, expected
  xk = _cast(c, x)
  # The outputs of the training forward (the custom_vjp's forward rule: the scan checkpointing
  # every expanded chunk, the gather for stage 6), which the gradients never read.
  assert_close("o", o_ref, o, RTOL[c.dtype])
  if c.final:
    assert_close("final_state", ht_ref, ht, 1e-5 if c.dtype == "float32" else 1e-2)
  tol = GRAD_RTOL[c.dtype]
  for n in x:
    d, r = out[n], ref[n]
    assert d.dtype == xk[n].dtype and d.shape == xk[n].shape, f"d{n}: {d.dtype}{d.shape}"
    d = np.asarray(d, np.float64)
    assert np.all(np.isfinite(d)), f"d{n}: {np.sum(~np.isfinite(d))} non-finite values"
    e = err_ratio(r, d)
    assert e < tol, f"d{n}: ratio {e:.3e} >= {tol:.1e} (max abs diff {np.max(np.abs(r - d)):.3e})"
  if c.varlen:
    cu = np.asarray(kw["cu_seqlens"])
    for n in ("q", "g"):
      if n in x:
        assert np.all(np.asarray(out[n])[0, cu[-1]:] == 0), f"d{n}: rows past cu_seqlens[N]"
    for n in ("k", "v", "beta"):
      if n in x:
        assert np.all(np.asarray(out[n])[0, cu[-1] * c.M:] == 0), f"d{n}: rows past cu[N]"
    for i in np.nonzero(np.diff(cu) == 0)[0]:
      # An empty sequence passes the final-state cotangent straight through to its initial state.
      want = cts[1][i] if c.final else 0
      np.testing.assert_array_equal(np.asarray(out["initial_state"][i]),
                                    np.asarray(want, np.float32))
  return out


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_prefill_grads(c):
  check_grads(c, KERNEL_BACKEND)


# The float32 cases again with exact float32 products ("ieee": FMA loops on the CUDA cores;
# the default is "tf32x3", docs/algorithm.md §4.5), within the same float32 tolerances.
IEEE = (_prefill_bwd.BwdConfig(f32_precision="ieee"), pk.FwdConfig(f32_precision="ieee"))
# The 16-bit cases again with the per-value-head dq and dk handed between the backward kernels
# in float32 (BwdConfig.partials; the default hands them in bf16; below,
# test_partials_in_input_dtype), within the same tolerances.
PARTIALS_F32 = _prefill_bwd.BwdConfig(partials="float32")
GPU_CONFIGS = float32_again(GPU_CASES, IEEE, "ieee") + [
    pytest.param(c, PARTIALS_F32, id=f"{c.id}-partials_float32") for c in GPU_CASES
    if c.dtype == "bfloat16"]


@pytest.mark.gpu
@pytest.mark.parametrize("c,config", GPU_CONFIGS)
def test_prefill_grads_gpu(c, config):
  check_grads(c, "triton", configs=(config,))


# The forward configs other than the default that change a 16-bit training step: stages 2 and
# 3 as two kernels, the solve's products as three TF32 products.
VARIANTS = {"two_kernels": pk.FwdConfig(kkt_solve=0),
            "solve_tf32x3": pk.FwdConfig(solve_precision="tf32x3")}


def test_prefill_grads_kkt_solve():
  """Stage 3 inside stage 2 (the 16-bit default) on float32 inputs, where it is not the
  default, so the interpreter's float32 cases run it too."""
  check_grads(CASES[2], KERNEL_BACKEND,
              configs=((_prefill_bwd.BwdConfig(), pk.FwdConfig(kkt_solve=1)),))


@pytest.mark.gpu
@pytest.mark.parametrize("c", [c for c in GPU_CASES if c.dtype == "bfloat16"], ids=lambda c: c.id)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prefill_grads_variants_gpu(c, variant):
  check_grads(c, "triton", configs=((_prefill_bwd.BwdConfig(), VARIANTS[variant]),))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_f32_precision_reaches_every_kernel(monkeypatch, dtype):
  """f32_precision (BwdConfig's, and FwdConfig's for the forward rule) sets the dot precision
  of every kernel of a training step on float32 inputs, and changes no launch on 16-bit ones.
  Traced only (eval_shape): the interpreter computes every dot in float32 whatever the
  precision, so the GPU test above is what checks each precision's accuracy."""
  def launches(config):
    seen = spy_launches(monkeypatch, lambda kernel, args, kwargs: (
        kernel, kwargs.get("DOT_PRECISION"), kwargs.get("BK"), kwargs.get("BV")))
    c = Case(T=70, HV=2, K=32, V=16, M=2, dtype=dtype, l2norm=True)
    x, cts, kw = make_inputs(c, 0)
    jax.eval_shape(lambda x: grads(x, cts, kw, KERNEL_BACKEND, config), _cast(c, x))
    return seen

  default, ieee = launches(_prefill_bwd.BwdConfig()), launches(IEEE)
  dots = {k for k, p, _, _ in default if p is not None}
  # 16-bit inputs take stage 3 inside chunk_kkt (FwdConfig.kkt_solve=-1).
  assert {k.split(".")[0] for k in dots} == {
      "chunk_kkt", "chunk_h", "chunk_o", "chunk_dv_bwd", "chunk_h_bwd", "chunk_o_bwd",
      "chunk_wy_bwd"} | ({"chunk_solve"} if dtype == "float32" else set()), dots
  if dtype == "float32":
    assert {p for _, p, _, _ in default if p is not None} == {"tf32x3"}
    assert {p for _, p, _, _ in ieee if p is not None} == {"ieee"}
    assert [x[:1] + x[2:] for x in default] == [x[:1] + x[2:] for x in ieee]
  else:
    assert default == ieee


# dk finished by chunk_wy_bwd (HV == H) or by qk_bwd: without the L2 norm the same float32 sum
# rounded once (bitwise equal), with it the norm's backward from the forward's row factors
# against qk_bwd's own.
FINISH_CASES = [
    Case(T=90, H=2, HV=2, K=80, V=32, M=2, varlen=(30, 0, 50), l2norm=True),
    Case(T=100, H=1, HV=1, K=32, V=32, M=1, varlen=(30, 0, 50)),
    Case(T=70, H=2, HV=2, K=32, V=32, M=3, dtype="bfloat16", l2norm=True),
]


@pytest.mark.parametrize("c", FINISH_CASES, ids=lambda c: c.id)
def test_dk_finished_in_wy_bwd(c):
  check_finish_paths(c, KERNEL_BACKEND)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_dk_finished_in_wy_bwd_gpu(dtype):
  check_finish_paths(Case(B=1, T=1000, H=4, HV=4, K=128, V=128, M=2, dtype=dtype, l2norm=True,
                          varlen=(500, 0, 470)), "triton")


def check_finish_paths(c, backend):
  """Both paths against the reference, and against each other: in the interpreter every other
  gradient bit for bit (the same code; compiled, the two chunk_wy_bwd variants may lay out
  their reductions differently)."""
  qk, wy = check_grads(c, backend, configs=[_prefill_bwd.BwdConfig(finish_dk=0),
                                            _prefill_bwd.BwdConfig()])
  tol = 1e-6 if c.dtype == "float32" else 1e-2
  for n in qk:
    if backend == "interpret" and (n != "k" or not c.l2norm):
      assert bits_equal(qk[n], wy[n]), f"d{n} differs between the two paths"
    e = err_ratio(np.asarray(qk[n], f64), np.asarray(wy[n], f64))
    assert e < tol, f"d{n}: ratio {e:.3e} between the paths"


# BwdConfig.partials="input", the default: chunk_o_bwd's dq~ and dk, and chunk_wy_bwd's dk where
# qk_bwd sums it, go between the kernels in bf16. HV > H (qk_bwd sums dk) and HV == H
# (chunk_wy_bwd finishes dk), packed with an empty sequence.
PARTIALS_CASES = [
    Case(T=90, H=1, HV=2, K=32, V=32, M=2, dtype="bfloat16", varlen=(30, 0, 50), l2norm=True),
    Case(T=90, H=2, HV=2, K=32, V=32, M=3, dtype="bfloat16", varlen=(30, 0, 50), l2norm=True),
]


@pytest.mark.parametrize("c", PARTIALS_CASES, ids=lambda c: c.id)
def test_partials_in_input_dtype(c):
  """Against the reference, and against float32 partials: dq and dk within a few bf16
  roundings (measured 2.5e-3 to 3.4e-3), every other gradient (none reads the partials) bit for
  bit in the interpreter (compiled, a store's dtype may change how a kernel lays out its
  reductions)."""
  ref32, out = check_grads(c, KERNEL_BACKEND,
                           configs=[PARTIALS_F32, _prefill_bwd.BwdConfig(partials="input")])
  for n in out:
    if n not in ("q", "k") and KERNEL_BACKEND == "interpret":
      assert bits_equal(ref32[n], out[n]), f"d{n} with bf16 partials differs"
    e = err_ratio(np.asarray(ref32[n], f64), np.asarray(out[n], f64))
    assert e < (1e-2 if n in ("q", "k") else 1e-3), f"d{n} with bf16 partials: ratio {e:.3e}"


def test_partials_reach_the_launches(monkeypatch):
  """The hand-off buffers' dtypes as launched: chunk_o_bwd's dq~ and dk, chunk_wy_bwd's dk
  (HV > H) and the two qk_bwd inputs. Traced only (eval_shape), at a shape no other test
  traces, so that no cached program hides the launches."""
  c = Case(T=37, H=1, HV=2, K=40, V=24, M=2, dtype="bfloat16", l2norm=True)
  x, cts, kw = make_inputs(c, 0)

  def dtypes(config):
    handoff = {"chunk_o_bwd.chunk_o_bwd_kernel": lambda args, out: out[:2],
               "chunk_wy_bwd.chunk_wy_bwd_kernel": lambda args, out: out[:1],
               "qk_bwd.qk_bwd_kernel": lambda args, out: args[:1]}
    seen = spy_launches(monkeypatch, lambda kernel, args, kwargs: (
        (kernel.split(".")[0], *(a.dtype.name for a in handoff[kernel](args, kwargs["out_shape"])))
        if kernel in handoff else None))
    jax.eval_shape(lambda x: grads(x, cts, kw, KERNEL_BACKEND, config), _cast(c, x))
    return seen

  for config, dt in ((None, "bfloat16"), (PARTIALS_F32, "float32")):
    assert dtypes(config) == [("chunk_o_bwd", dt, dt), ("chunk_wy_bwd", dt), ("qk_bwd", dt),
                              ("qk_bwd", dt)], config


def test_training_forward_stores_normalised_rows():
  """With the L2 norm the training forward hands the backward q and k normalised in the input
  dtype, stored by stages 2 and 6 (every row of every sequence; one writer per key head): the
  keys bit for bit k rk rounded once, with the forward's own row factors rk; the queries
  within a rounding of q / |q|."""
  from gdp_jax import _prefill_kernels as pk
  H, HV, K, M, dt = 2, 4, 160, 2, jnp.bfloat16   # two K blocks in each kernel
  lens = (40, 0, 70)
  T = sum(lens) + 9
  rng = np.random.default_rng(4)
  q = jnp.asarray(rng.standard_normal((1, T, H, K)) * 3, dt)
  k = jnp.asarray(rng.standard_normal((1, T * M, H, K)) * 3, dt)
  v = jnp.asarray(rng.standard_normal((1, T * M, HV, 16)), dt)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  *_, res = pk._chunk_gated_delta_product_fwd(
      q, k, v, None, None, num_householder=M, scale=1.0, initial_state=None,
      output_final_state=False, use_qk_l2norm_in_kernel=True, cu_seqlens=cu, state=None,
      state_indices=None, return_chunk_states=False, chunk_states_dtype=None,
      backend=KERNEL_BACKEND, return_residuals=True)
  rk, qn, kn = res[2], res[5], res[6]
  n = int(cu[-1])
  assert qn.dtype == dt and qn.shape == (T, H, K) and kn.dtype == dt and kn.shape == (T * M, H, K)
  want_k = (k.reshape(T * M, H, K).astype(jnp.float32) * rk[..., None]).astype(dt)
  assert bits_equal(kn[:n * M], want_k[:n * M])
  qf = np.asarray(q[0, :n], f64)
  want_q = qf / np.sqrt(np.sum(qf * qf, -1, keepdims=True) + 1e-6)
  assert_close("qn", want_q, np.asarray(qn[:n], f64), 4e-3)


def test_scan_block_widths_agree():
  """The backward scan's V blocks at 16 and at 64 (the default) give the same gradients:
  columns of dS are independent, only the tiling differs."""
  c = Case(T=100, HV=2, K=64, V=80, M=2, l2norm=True)
  x, cts, kw = make_inputs(c, 2)
  xk = _cast(c, x)
  # Unsplit (h_split=1), so that only the tiling differs.
  narrow = grads(xk, cts, kw, KERNEL_BACKEND, _prefill_bwd.BwdConfig(h_bv=16, h_split=1))
  wide = grads(xk, cts, kw, KERNEL_BACKEND, _prefill_bwd.BwdConfig(h_split=1))
  for n in x:
    assert err_ratio(np.asarray(narrow[n], f64), np.asarray(wide[n], f64)) < 1e-6, n


# chunk_o_bwd's tile widths (BwdConfig.o_bk, o_bv) against the reference and the default
# config: one masked K block of 128 at K = 100 (the default has two of 64), one masked V step of
# 128 at V = 80 (the default has two of 64).
O_CASE = Case(T=43, H=2, HV=4, K=100, V=80, M=3, l2norm=True)
O_VARIANTS = [dict(o_bk=128, o_bv=128)]   # both widths in one run of the whole backward


def test_chunk_o_bwd_variants():
  """Every tile width passes the reference check and gives the default's gradients to float32
  rounding: only the tiling differs."""
  default, *outs = check_grads(
      O_CASE, KERNEL_BACKEND,
      configs=[_prefill_bwd.BwdConfig(**v) for v in [{}] + O_VARIANTS])
  for v, out in zip(O_VARIANTS, outs):
    for n in out:
      e = err_ratio(default[n], out[n])
      assert e < 1e-5, f"d{n} under {v}: ratio {e:.3e} to the default config"


# The chunk_o_bwd variant that tests/test_sm90_compile.py compiles, on the GPU: K blocks of 128
# at 8 warps, a configuration BwdConfig takes (it tied the default at K = V = 128 until <S, dS>
# left the product; docs/performance.md, Training).
O_GPU_VARIANTS = [dict(o_bk=128, o_warps=8)]
O_GPU_CASES = [Case(B=2, T=600, H=4, HV=8, K=128, V=128, M=2, dtype="bfloat16", l2norm=True),
               Case(B=2, T=600, H=4, HV=8, K=128, V=128, M=2, dtype="float32", l2norm=True),
               Case(B=2, T=500, H=2, HV=4, K=256, V=512, M=2, dtype="bfloat16", l2norm=True)]
# float32 takes exact products there: under the default tf32x3 the variant's operand tiles need
# 245760 B of shared memory (sm_90 compile), over the 232448 a block may have.


def _o_gpu_param(c, variant):
  v = dict(variant, f32_precision="ieee") if c.dtype == "float32" else variant
  return pytest.param(c, v, id=c.id + "-" + ",".join(f"{k}={x}" for k, x in v.items()))


O_GPU_PARAMS = [_o_gpu_param(c, v) for c in O_GPU_CASES for v in O_GPU_VARIANTS]


@pytest.mark.gpu
@pytest.mark.parametrize("c,variant", O_GPU_PARAMS)
def test_chunk_o_bwd_variants_gpu(c, variant):
  """A chunk_o_bwd variant compiled: against the reference, and two runs bitwise equal (the
  patterns Triton miscompiles on Hopper showed as run-to-run differences)."""
  cfg = _prefill_bwd.BwdConfig(**variant)
  check_grads(c, "triton", configs=[cfg])
  x, cts, kw = make_inputs(c, 0)
  xk = _cast(c, x)
  f = jax.jit(lambda x: grads(x, cts, kw, "triton", cfg))
  a, b = f(xk), f(xk)
  for n in x:
    assert bits_equal(a[n], b[n]), f"d{n} differs between two identical runs ({variant})"


# K != V, so that a swap of Pi's and E's columns shows; K = 48 leaves Pi's second column block
# part empty. The packed case has an empty sequence (Pi = I, E = 0 in every piece: dht passes to
# dh0), one of a single chunk (fewer chunks than pieces) and empty last pieces.
SPLIT_CASES = [
    Case(B=2, HV=2, K=48, V=32, M=2, l2norm=True),
    Case(T=200, HV=1, K=32, V=48, M=2, varlen=(100, 0, 20, 70), l2norm=True),
]


@pytest.mark.parametrize("c", SPLIT_CASES, ids=lambda c: c.id)
def test_split_state_pass(c):
  """The reverse state pass in 3 pieces per sequence (two summary maps chained) gives the
  unsplit pass's gradients to float32 rounding (docs/algorithm.md §13.3), and each passes the
  reference check."""
  one, split = check_grads(c, KERNEL_BACKEND,
                           configs=[_prefill_bwd.BwdConfig(h_split=p) for p in (1, 3)])
  for n in split:
    e = err_ratio(one[n], split[n])
    assert e < 1e-5, f"d{n}, 3 pieces: ratio {e:.3e} to the unsplit pass"


def test_split_rule():
  """Pieces only where the unsplit walk would leave most SMs idle; h_split overrides."""
  cfg = _prefill_bwd.BwdConfig()
  assert _prefill_bwd._h_pieces(cfg, 66) == 1
  assert _prefill_bwd._h_pieces(cfg, 32) == 8          # B=1 H=16 K=V=128: 256 programs
  assert _prefill_bwd._h_pieces(cfg, 48) == 6
  assert _prefill_bwd._h_pieces(cfg, 1) == cfg.h_split_max
  assert _prefill_bwd._h_pieces(cfg._replace(h_split=3), 512) == 3
  assert _prefill_bwd._h_pieces(cfg._replace(h_split=1), 1) == 1
  # The walk's sequences are issued longest first (ties and empty ones in order), by the forward
  # scan's list of whole sequences.
  cu = jnp.asarray([0, 5, 5, 70, 134, 199, 200])
  order = pk._whole_sequences(6, n_x=pk._expanded_chunks(cu, 2)).launch[:, 0]
  assert np.asarray(order).tolist() == [2, 4, 3, 0, 5, 1]
  assert np.asarray(pk._whole_sequences(3).launch[:, 0]).tolist() == [0, 1, 2]


def test_split_forward_scan():
  """The training forward's scan (M = 1 on the expanded stream, a checkpoint per expanded
  chunk) split into pieces of one chunk (docs/algorithm.md §13.3), an empty sequence
  and one of a single chunk among them: outputs and gradients against the reference (the
  backward reads the split walk's checkpoints, V' and final state), and within float32
  rounding of the unsplit forward's gradients. No decay, so that a piece's entering state
  counts in full."""
  c = Case(T=150, HV=2, K=32, V=16, M=2, varlen=(5, 0, 70, 1, 64), l2norm=True, use_g=False)
  bwd = _prefill_bwd.BwdConfig(h_split=1)
  one, *split = check_grads(c, KERNEL_BACKEND,
                            configs=[(bwd, pk.FwdConfig(h_piece=p)) for p in (0, 1)])
  for n in one:
    e = err_ratio(one[n], split[0][n])
    assert e < 1e-5, f"d{n}: ratio {e:.3e} to the unsplit forward"


def test_public_configs_reach_the_training_path(monkeypatch):
  """jax.grad through `chunk_gated_delta_product(..., config=, bwd_config=)`. At this size the
  defaults leave the forward scan whole and cut the reverse pass into pieces (2 programs, far
  below the SMs); FwdConfig(h_piece=1) and BwdConfig(h_split=1) turn both around, as their
  traced launches show (the forward's chain kernel, the backward's summary pass; shapes no
  other test traces), and give the defaults' gradients within float32 rounding, each against
  the reference. The defaults spelled out are config=None's program."""
  c = Case(T=40, HV=2, K=40, V=24, M=2, l2norm=True, use_g=False)
  x, cts, kw = make_inputs(c, 0)
  xk = _cast(c, x)
  def launches(config):
    seen = spy_launches(monkeypatch, lambda kernel, args, kwargs: (kernel, kwargs.get("SUMMARY")))
    jax.eval_shape(lambda x: grads(x, cts, kw, KERNEL_BACKEND, config), xk)
    return seen

  chain = ("chunk_h.chunk_h_chain_kernel", None)
  bwd_summary = ("chunk_h_bwd.chunk_h_bwd_kernel", True)
  turned = (gdp_jax.BwdConfig(h_split=1), gdp_jax.FwdConfig(h_piece=1))
  seen = launches(None)
  assert chain not in seen and bwd_summary in seen, seen
  seen = launches(turned)
  assert chain in seen and bwd_summary not in seen, seen
  misses = _backends._jitted.cache_info().misses
  launches((gdp_jax.BwdConfig(), gdp_jax.FwdConfig()))
  assert _backends._jitted.cache_info().misses == misses, "the default configs, a new program"
  default, other = check_grads(c, KERNEL_BACKEND, configs=[None, turned])
  for n in default:
    e = err_ratio(default[n], other[n])
    assert e < 1e-5, f"d{n}: ratio {e:.3e} to the default configs' gradient"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_split_state_pass_gpu(dtype):
  """One long sequence with few heads, the reverse state pass in 8 pieces at wide (64, the
  default) and narrow (16) V blocks, the forward scan in two pieces (128 expanded chunks, the
  default pieces of 2048 tokens at this head count): against the reference, and two runs bitwise equal."""
  c = Case(B=1, T=4096, H=4, HV=4, K=128, V=128, M=2, dtype=dtype, l2norm=True)
  configs = [_prefill_bwd.BwdConfig(h_split=8),
             _prefill_bwd.BwdConfig(h_split=8, h_bv=16)]
  check_grads(c, "triton", configs=configs)
  x, cts, kw = make_inputs(c, 0)
  xk = _cast(c, x)
  for cfg in configs:
    f = jax.jit(lambda x, cfg=cfg: grads(x, cts, kw, "triton", cfg))
    a, b = f(xk), f(xk)
    for n in x:
      assert bits_equal(a[n], b[n]), f"d{n} differs between two identical runs ({cfg})"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("HV", [8, 4])   # 4 = H: dk finished by chunk_wy_bwd
def test_grads_deterministic_gpu(dtype, HV):
  c = Case(B=2, T=600, H=4, HV=HV, K=128, V=128, M=2, dtype=dtype, l2norm=True)
  x, cts, kw = make_inputs(c, 5)
  xk = _cast(c, x)
  f = jax.jit(lambda x: grads(x, cts, kw, "triton"))
  a, b = f(xk), f(xk)
  for n in x:
    assert bits_equal(a[n], b[n]), f"d{n} differs between two identical runs"


# The tail of the backward (kernels/qk_bwd.py): (G, K, L2 norm, dtype of x and of the result).
def _qk_case(G, K, l2norm, dtype):
  return pytest.param(G, K, l2norm, dtype, id=f"G{G}-K{K}-{'l2norm' if l2norm else 'raw'}-{dtype}")


QK_CASES = [_qk_case(G, K, l2, "float32" if K == 64 else "bfloat16")
            for G in (1, 2) for K in (64, 100) for l2 in (False, True)]


def check_qk_bwd(G, K, l2norm, dtype, backend):
  """Against the float64 formula on the same rounded inputs: every row below cu[N] * M close
  and finite, rows past it exactly zero though their float32 input is NaN (as unwritten rows of
  a kernel output may be on the GPU). 70 rows: a partial last block at either block height."""
  rng = np.random.default_rng(G * 1000 + K + l2norm)
  H, M, rows = 2, 2, 70
  cu = np.array([0, 12, 31], np.int32)                # the limit: row 62 of 70
  limit = cu[-1] * M
  dy_v = rng.standard_normal((rows, H * G, K)).astype(np.float32)
  dy_v[limit:] = np.nan
  x = jnp.asarray(rng.standard_normal((rows, H, K)) * rng.uniform(0.3, 3.0, (rows, H, 1)),
                  jnp.dtype(dtype))
  out = _prefill_bwd._qk_bwd(jnp.asarray(dy_v), x if l2norm else None, jnp.asarray(cu),
                             len(cu) - 1, M, H, jnp.dtype(dtype), backend,
                             _prefill_bwd.BwdConfig())
  assert out.dtype == jnp.dtype(dtype) and out.shape == (rows, H, K), f"{out.dtype}{out.shape}"
  dy = dy_v[:limit].astype(np.float64).reshape(limit, H, G, K).sum(2)
  want = dy
  if l2norm:
    xf = np.asarray(x[:limit], np.float64)
    r = 1 / np.sqrt(np.sum(xf * xf, -1, keepdims=True) + 1e-6)
    y = xf * r
    want = r * (dy - y * np.sum(y * dy, -1, keepdims=True))
  got = np.asarray(out, np.float64)
  assert np.all(np.isfinite(got)), f"{np.sum(~np.isfinite(got))} non-finite values"
  assert_close("dx", want, got[:limit], RTOL[dtype])
  # Row by row too: one wrong key head or row block would hide in the rms over all of them.
  row_err = (np.linalg.norm((got[:limit] - want).reshape(limit * H, K), axis=-1)
             / np.linalg.norm(want.reshape(limit * H, K), axis=-1))
  assert np.max(row_err) < RTOL[dtype], f"worst row: ratio {np.max(row_err):.3e}"
  assert np.all(got[limit:] == 0), "rows past cu_seqlens[N] * M"


@pytest.mark.parametrize("G,K,l2norm,dtype", QK_CASES)
def test_qk_bwd(G, K, l2norm, dtype):
  check_qk_bwd(G, K, l2norm, dtype, KERNEL_BACKEND)


@pytest.mark.gpu
@pytest.mark.parametrize("G,K,l2norm,dtype", QK_CASES + [_qk_case(4, 256, True, "bfloat16")])
def test_qk_bwd_gpu(G, K, l2norm, dtype):
  check_qk_bwd(G, K, l2norm, dtype, "triton")


def test_value_and_grad_and_vjp_under_jit_with_traced_cu_seqlens():
  """One compilation for every cu_seqlens of a shape, no device-to-host transfer, and vjp,
  value_and_grad and grad agree."""
  c = Case(T=90, HV=2, M=2, varlen=(30, 0, 50))
  x, cts, kw = make_inputs(c, 1)
  xk = _cast(c, x)
  cu0 = kw.pop("cu_seqlens")
  traces = []

  def loss(x, cu):
    traces.append(1)
    return _loss(gdp_jax.chunk_gated_delta_product, cts, dict(kw, cu_seqlens=cu),
                 backend=KERNEL_BACKEND)(x)

  vg = jax.jit(jax.value_and_grad(loss))
  with jax.transfer_guard_device_to_host("disallow"):
    val, g1 = vg(xk, cu0)
    vg(xk, jnp.asarray([0, 45, 45, 80], jnp.int32))
  assert len(traces) == 1
  _, pull = jax.vjp(lambda x: loss(x, cu0), xk)
  (g2,) = pull(jnp.ones((), f64))
  for n in x:
    assert bits_equal(g1[n], g2[n]), n
  assert np.isfinite(float(val))


@pytest.mark.parametrize("what", ["state", "return_chunk_states"])
def test_non_differentiable_arguments_say_what_is(what):
  c = Case(T=20, init=False)
  x, cts, kw = make_inputs(c, 3)
  xk = _cast(c, x)
  if what == "state":
    kw = dict(kw, output_final_state=False, state=jnp.zeros((1, c.HV, c.K, c.V), jnp.float32),
              state_indices=jnp.zeros((1,), jnp.int32))
  else:
    kw = dict(kw, return_chunk_states=True)

  def loss(q):
    out = gdp_jax.chunk_gated_delta_product(q, *(xk[n] for n in ("k", "v", "g", "beta")), **kw,
                                            backend=KERNEL_BACKEND)
    return jnp.sum(out[0].astype(jnp.float32))

  with pytest.raises(NotImplementedError, match="q, k, v, g, beta and initial_state"):
    jax.grad(loss)(xk["q"])


def test_remat_composes_and_higher_order_says_unsupported():
  """jax.checkpoint around the op (rematerialised training) gives the plain gradients bit for
  bit; forward mode over the backward (jacfwd of grad, as jax.hessian runs) names what is
  supported."""
  c = Case(T=20, init=False, final=False)
  x, cts, kw = make_inputs(c, 5)
  xk = _cast(c, x)
  loss = _loss(gdp_jax.chunk_gated_delta_product, cts, kw, backend=KERNEL_BACKEND)
  plain = grads(xk, cts, kw, KERNEL_BACKEND)
  remat = jax.jit(jax.grad(jax.checkpoint(loss)))(xk)
  for n in xk:
    assert bits_equal(plain[n], remat[n]), f"d{n} differs under jax.checkpoint"
    assert float(jnp.abs(plain[n].astype(f64)).max()) > 0, n
  with pytest.raises(NotImplementedError, match="derivatives of a gradient"):
    jax.jacfwd(jax.grad(lambda q: loss({**xk, "q": q})))(xk["q"])


@pytest.mark.slow
def test_reference_gradient_matches_finite_differences():
  """The oracle's own gradient: central differences of the float64 reference on a tiny case."""
  c = Case(T=5, HV=2, K=4, V=3, M=2, l2norm=True)
  x, cts, kw = make_inputs(c, 7)
  x = {n: jnp.asarray(a, f64) for n, a in x.items()}
  loss = jax.jit(_loss(reference.chunk_gated_delta_product, cts, kw))
  g = jax.jit(jax.grad(loss))(x)
  rng = np.random.default_rng(0)
  for n in x:
    d = jnp.asarray(rng.standard_normal(x[n].shape))   # a random direction per input
    eps = 1e-6
    plus = loss({**x, n: x[n] + eps * d})
    minus = loss({**x, n: x[n] - eps * d})
    fd = (plus - minus) / (2 * eps)
    an = jnp.sum(g[n] * d)
    assert abs(float(fd - an)) <= 1e-6 * max(1.0, abs(float(an))), (n, float(fd), float(an))


def check_vmap(backend, dtype):
  """jax.vmap over independent models' inputs (an ensemble, per-example gradients): outputs and
  gradients equal the per-element calls', each element launching the kernels once
  (gdp_jax/_launch.py). Packed sequences with a traced cu_seqlens per element."""
  E, c = 2, Case(B=1, T=60, H=1, HV=2, K=32, V=16, M=2, dtype=dtype, l2norm=True,
                 varlen=(25, 0, 35))
  per = [make_inputs(c, seed=7 + e) for e in range(E)]
  kw = per[0][2]
  xs = [_cast(c, p[0]) for p in per]
  cts = [tuple(jnp.asarray(t, jnp.float32) for t in p[1]) for p in per]

  def value_and_grad(x, do, dht, cu):
    def loss(x):
      o, ht = gdp_jax.chunk_gated_delta_product(**x, **dict(kw, cu_seqlens=cu), backend=backend)
      return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(ht * dht), o
    return jax.value_and_grad(loss, has_aux=True)(x)

  # Each element packs its sequences differently (the second one's first cut, and the empty
  # sequence at it, 10 tokens later).
  cus = [jnp.asarray(kw["cu_seqlens"]), jnp.asarray(kw["cu_seqlens"]).at[1:3].add(10)]
  stack = lambda trees: jax.tree.map(lambda *a: jnp.stack(a), *trees)
  got = jax.jit(jax.vmap(value_and_grad))(stack(xs), *stack(cts), jnp.stack(cus))
  for e in range(E):
    want = jax.jit(value_and_grad)(xs[e], *cts[e], cus[e])
    for path, w in jax.tree_util.tree_leaves_with_path(want):
      g = functools.reduce(lambda t, k: t[k.key if hasattr(k, "key") else k.idx], path, got)[e]
      assert_close(f"element {e} {jax.tree_util.keystr(path)}", w, g, 1e-5 if dtype == "float32" else 1e-3)


def test_vmap_over_inputs():
  check_vmap(KERNEL_BACKEND, "float32")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_vmap_over_inputs_gpu(dtype):
  check_vmap(KERNEL_BACKEND, dtype)
