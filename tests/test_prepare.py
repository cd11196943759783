"""The decode prepare kernel (gating + Householder fold) against its jnp twin, and end to end.

The kernel runs through the Triton interpreter on a CPU and through jax_triton on a GPU
(`-m gpu` adds a realistic shape). The folded query must be the same bits as the input and the
inserted zeros exact zeros; the float32 gates must match the jnp twin to a few ulp (relative
1e-6, docs/algorithm.md §8), over the softplus threshold and very negative pre-activations too. End
to end, prepare + the fused recurrent step with steps_per_token=M must equal
`gated_delta_product_decode` fed the twin's gates.
"""
import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdp_jax
from conftest import KERNEL_BACKEND
from gdp_jax.prepare import gated_delta_product_decode_prepare
from gdp_jax.reference import prepare as ref_prepare
from helpers import RTOL, assert_close, bits_equal

GATE_RTOL = 1e-6  # a few float32 ulp (one ulp is 6e-8 to 1.2e-7 relative)
# Below the smallest normal float32, XLA on a CPU may flush to zero where numpy and a GPU do not.
GATE_ATOL = 1e-36


def assert_gates_close(name, ref, out):
  ref = np.asarray(ref, np.float64)
  out = np.asarray(out, np.float64)
  assert ref.shape == out.shape, f"{name}: shape {out.shape} != reference {ref.shape}"
  assert np.all(np.isfinite(out)), f"{name}: {np.sum(~np.isfinite(out))} non-finite values"
  err = np.abs(out - ref)
  bad = err > GATE_RTOL * np.abs(ref) + GATE_ATOL
  rel = err / np.maximum(np.abs(ref), GATE_ATOL)
  assert not np.any(bad), (f"{name}: {bad.sum()} elements off by more than {GATE_RTOL:.0e} relative"
                           f" (max relative {rel.max():.3e}, max abs diff {err.max():.3e})")


@dataclasses.dataclass(frozen=True)
class Case:
  N: int = 3
  D: int = 2
  M: int = 2
  H: int = 1
  HV: int = 2
  K: int = 16
  q_dtype: str = "float32"
  ab_dtype: str = "float32"
  allow_neg_eigval: bool = False

  @property
  def id(self):
    return (f"N{self.N}-D{self.D}-M{self.M}-H{self.H}-HV{self.HV}-K{self.K}-q_{self.q_dtype}"
            f"-ab_{self.ab_dtype}" + ("-negeig" if self.allow_neg_eigval else ""))


CASES = [
    Case(),
    Case(N=2, D=3, M=3, H=2, HV=6, K=20, q_dtype="bfloat16", ab_dtype="bfloat16",
         allow_neg_eigval=True),
    Case(N=2, D=1, M=1, H=2, HV=4, K=8, ab_dtype="bfloat16"),
    Case(N=1, D=2, M=2, H=4, HV=4, K=32, q_dtype="bfloat16", allow_neg_eigval=True),
]
GPU_CASES = [Case(N=64, D=2, M=2, H=4, HV=8, K=128),
             Case(N=64, D=2, M=2, H=4, HV=8, K=128, q_dtype="bfloat16", ab_dtype="bfloat16",
                  allow_neg_eigval=True)]

# Pre-activations that reach both sides of the softplus threshold and the ends of the sigmoid.
A_SPECIAL = [-200., -100., -80., -30., 0., 19.5, 20., 20.5, 25., 60., 1e4]
B_SPECIAL = [-200., -100., -80., -20., 0., 17., 80., 200.]


def make_inputs(c: Case, seed, V=8):
  rng = np.random.default_rng(seed)
  N, D, M, H, HV, K = c.N, c.D, c.M, c.H, c.HV, c.K
  a = rng.standard_normal((N, D, HV)) * 4
  b = rng.standard_normal((N, D * M, HV)) * 4
  # Sprinkle the extremes in; dt_bias shifts them by at most a few units.
  a.flat[rng.choice(a.size, min(a.size, len(A_SPECIAL)), replace=False)] = A_SPECIAL[:a.size]
  b.flat[rng.choice(b.size, min(b.size, len(B_SPECIAL)), replace=False)] = B_SPECIAL[:b.size]
  k = rng.standard_normal((N, D * M, H, K))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), HV))
  return dict(
      q=jnp.asarray(rng.standard_normal((N, D, H, K)), c.q_dtype),
      k=jnp.asarray(k, c.q_dtype),
      v=jnp.asarray(rng.standard_normal((N, D * M, HV, V)), c.q_dtype),
      a=jnp.asarray(a, c.ab_dtype),
      b=jnp.asarray(b, c.ab_dtype),
      # The layer's initialisation: A ~ U(0, 16), dt_bias = softplus^-1(dt), dt log-uniform.
      A_log=jnp.asarray(np.log(rng.uniform(1e-2, 16, HV)), jnp.float32),
      dt_bias=jnp.asarray(dt + np.log(-np.expm1(-dt)), jnp.float32),
  )


def _prepare(x, c, backend):
  with warnings.catch_warnings():
    # The interpreter's numpy exp overflows to inf for b < -88 (sigmoid's limit 0 is right).
    warnings.filterwarnings("ignore", "overflow encountered in exp", RuntimeWarning)
    return gated_delta_product_decode_prepare(
        **x, num_householder=c.M, allow_neg_eigval=c.allow_neg_eigval, backend=backend)


def check_prepare(c: Case, backend, seed=0):
  x = make_inputs(c, seed)
  q_fold, g_fold, beta = _prepare(x, c, backend)
  q_ref, g_ref, beta_ref = ref_prepare.gated_delta_product_decode_prepare(
      **x, num_householder=c.M, allow_neg_eigval=c.allow_neg_eigval)
  N, D, M, H, HV, K = c.N, c.D, c.M, c.H, c.HV, c.K
  assert q_fold.shape == (N, D * M, H, K) and q_fold.dtype == x["q"].dtype
  assert g_fold.shape == (N, D * M, HV) and g_fold.dtype == jnp.float32
  assert beta.shape == (N, D * M, HV) and beta.dtype == jnp.float32

  # The query on copy M-1, bit for bit; +0.0 on every other copy.
  qf = np.asarray(q_fold).reshape(N, D, M, H, K)
  assert bits_equal(qf[:, :, M - 1], np.asarray(x["q"]))
  assert not np.any(qf[:, :, :M - 1].view(np.uint16 if qf.itemsize == 2 else np.uint32))
  assert bits_equal(q_fold, q_ref)

  # The decay on copy 0 only, the other copies exactly +0.0.
  gf = np.asarray(g_fold).reshape(N, D, M, HV)
  assert not np.any(gf[:, :, 1:].view(np.uint32))
  assert np.all(gf[:, :, 0] <= 0)
  assert_gates_close("g", np.asarray(g_ref).reshape(N, D, M, HV)[:, :, 0], gf[:, :, 0])

  assert_gates_close("beta", beta_ref, beta)
  top = 2.0 if c.allow_neg_eigval else 1.0
  assert np.all((np.asarray(beta) >= 0) & (np.asarray(beta) <= top))


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_prepare_matches_reference(c):
  check_prepare(c, KERNEL_BACKEND)


@pytest.mark.gpu
@pytest.mark.parametrize("c", GPU_CASES, ids=lambda c: c.id)
def test_prepare_matches_reference_gpu(c):
  check_prepare(c, "triton", seed=1)
  check_end_to_end(c, "triton", V=128, seed=1)


def test_gates_at_the_extremes():
  """softplus's threshold, exp underflow and sigmoid saturation, with A = 1 and no bias."""
  a = np.array([-200., -100., -80., -30., -1., 0., 19.5, 20., 20.5, 25., 60., 1e4], np.float32)
  b = np.array([-200., -100., -80., -1., 0., 1., 17., 80., 200., 0., 0., 0.], np.float32)
  HV = a.size
  x = dict(q=jnp.ones((1, 1, 1, 4), jnp.float32), k=jnp.ones((1, 2, 1, 4), jnp.float32),
           v=jnp.ones((1, 2, HV, 4), jnp.float32), a=jnp.asarray(a[None, None]),
           b=jnp.asarray(np.stack([b, -b])[None]), A_log=jnp.zeros((HV,), jnp.float32),
           dt_bias=jnp.zeros((HV,), jnp.float32))
  for neg in (False, True):
    c = Case(N=1, D=1, M=2, H=1, HV=HV, K=4, allow_neg_eigval=neg)
    _, g_fold, beta = map(np.asarray, _prepare(x, c, KERNEL_BACKEND))
    g = g_fold[0, 0]
    above = a > 20
    # Above the threshold softplus is the identity: g = -a exactly.
    assert bits_equal(g[above], -a[above])
    # At and below it, log1p(exp(x)) in float64.
    want = -np.log1p(np.exp(a[~above].astype(np.float64)))
    assert_gates_close("g below threshold", want, g[~above])
    assert np.all(g <= 0) and np.all(np.isfinite(g))
    scale = 2.0 if neg else 1.0
    bb = np.stack([b, -b]).astype(np.float64)
    assert_gates_close("beta", scale / (1 + np.exp(-bb)), beta[0])
    assert np.all(beta[0][bb == 0] == 0.5 * scale)        # sigmoid(0) = 1/2 exactly
    assert np.all(beta[0][bb >= 17] == scale)             # saturated
    assert np.all(beta[0][bb <= -200] == 0)               # exp(200) = inf in float32


def test_reference_gates_against_float64():
  """The jnp twin's formulas, checked against numpy in float64 (the oracle needs checking too)."""
  rng = np.random.default_rng(7)
  a = rng.uniform(-90, 40, (64, 4)).astype(np.float32)
  A_log = np.log(rng.uniform(1e-2, 16, 4)).astype(np.float32)
  dt_bias = rng.standard_normal(4).astype(np.float32)
  x32 = (a + dt_bias).astype(np.float64)  # the twin adds in float32, as the kernel does
  want = -np.exp(A_log.astype(np.float64)) * np.where(x32 > 20, x32, np.log1p(np.exp(x32)))
  g = ref_prepare.decay_gate(jnp.asarray(a), jnp.asarray(A_log), jnp.asarray(dt_bias))
  assert g.dtype == jnp.float32
  assert_gates_close("decay_gate", want, g)
  b = rng.uniform(-80, 80, (64, 4)).astype(np.float32)
  beta = ref_prepare.beta_gate(jnp.asarray(b), allow_neg_eigval=True)
  assert beta.dtype == jnp.float32
  assert_gates_close("beta_gate", 2 / (1 + np.exp(-b.astype(np.float64))), beta)
  # Above 20 the threshold and jax.nn.softplus (no threshold) agree to half an ulp.
  y = jnp.asarray(np.linspace(20.001, 80, 50), jnp.float32)
  sp = ref_prepare._softplus(y)
  assert bits_equal(sp, y)
  assert np.all(np.abs(np.asarray(jax.nn.softplus(y)) - np.asarray(y)) <= 0.5 * np.spacing(np.asarray(y)))


def check_end_to_end(c: Case, backend, V=8, seed=0):
  """prepare + fused recurrent (steps_per_token=M) == gated_delta_product_decode(twin's gates)."""
  x = make_inputs(c, seed, V=V)
  N, D, M, HV, K = c.N, c.D, c.M, c.HV, c.K
  rng = np.random.default_rng(seed + 100)
  S = N + 2
  slots = rng.permutation(S)[:N].astype(np.int32)
  slots[N // 2] = -1
  cache = jnp.asarray(rng.standard_normal((S, HV, K, V)), jnp.float32)
  inter = jnp.asarray(np.full((S, D, HV, K, V), np.nan), jnp.float32)
  kw = dict(state=cache, state_indices=jnp.asarray(slots), intermediate_states=inter)

  q_fold, g_fold, beta = _prepare(x, c, backend)
  o_fold, state, inter_out = gdp_jax.fused_recurrent_gated_delta_rule(
      q_fold, x["k"], x["v"], g_fold, beta, steps_per_token=M, backend=backend, **kw)
  o = o_fold[:, M - 1::M]

  g_ref = ref_prepare.decay_gate(x["a"], x["A_log"], x["dt_bias"])
  beta_ref = ref_prepare.beta_gate(x["b"], c.allow_neg_eigval)
  o_ref, state_ref, inter_ref = gdp_jax.gated_delta_product_decode(
      x["q"], x["k"], x["v"], g_ref, beta_ref, num_householder=M, backend=backend, **kw)

  assert o.shape == (N, D, HV, V)
  assert np.all(np.asarray(o, np.float32)[slots < 0] == 0)
  tol = RTOL[c.q_dtype]
  assert_close("o", o_ref, o, tol)
  live = np.zeros(S, bool)
  live[slots[slots >= 0]] = True
  assert bits_equal(np.asarray(state)[~live], np.asarray(cache)[~live])
  assert_close("state", np.asarray(state_ref)[live], np.asarray(state)[live], RTOL["float32"])
  assert_close("intermediate", np.asarray(inter_ref)[live], np.asarray(inter_out)[live],
               RTOL["float32"])


def test_end_to_end_decode():
  check_end_to_end(Case(N=3, D=2, M=2, H=1, HV=2, K=16), KERNEL_BACKEND)


def test_jit_repeat_and_reference_backend():
  """Under jit the same bits as eager (and on repeat); backend="reference" runs the twin.

  backend="reference" is the twin as one jitted program, so it has the bits of jax.jit(twin).
  The twin called eagerly, op by op, is other XLA programs: jax 0.11.2 on a CPU rounds a few of
  its gates 1 or 2 ulp away from the jitted twin (at most 1.5e-7 relative over 6 seeds), jax
  0.10.2 and 0.12 not at all. So the eager twin is held to the gates' tolerance, and q_fold,
  which only moves values, to its bits.
  """
  c = Case(N=2, D=2, M=3, H=1, HV=3, K=8, allow_neg_eigval=True)
  x = make_inputs(c, 3)
  eager = _prepare(x, c, KERNEL_BACKEND)
  f = jax.jit(functools.partial(gated_delta_product_decode_prepare, num_householder=c.M,
                                allow_neg_eigval=True, backend=KERNEL_BACKEND))
  for _ in range(2):
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", "overflow encountered in exp", RuntimeWarning)
      jitted = f(**x)
    for e, j in zip(eager, jitted):
      assert bits_equal(e, j)
  kw = dict(num_householder=c.M, allow_neg_eigval=c.allow_neg_eigval)
  public = _prepare(x, c, "reference")
  twin = jax.jit(functools.partial(ref_prepare.gated_delta_product_decode_prepare, **kw))(**x)
  for t, o in zip(twin, public):
    assert bits_equal(t, o)
  q_eager, g_eager, beta_eager = ref_prepare.gated_delta_product_decode_prepare(**x, **kw)
  assert bits_equal(q_eager, public[0])
  assert_gates_close("g_fold (eager twin)", g_eager, public[1])
  assert_gates_close("beta (eager twin)", beta_eager, public[2])


# Bad input: one case per check. Base sizes N=2, D=2, M=2, H=1, HV=2, K=8, V=4.
def _bad_inputs(**changes):
  f32 = jnp.float32
  x = dict(q=jnp.zeros((2, 2, 1, 8), f32), k=jnp.zeros((2, 4, 1, 8), f32),
           v=jnp.zeros((2, 4, 2, 4), f32), a=jnp.zeros((2, 2, 2), f32),
           b=jnp.zeros((2, 4, 2), f32), A_log=jnp.zeros((2,), f32), dt_bias=jnp.zeros((2,), f32))
  kw = dict(num_householder=2, allow_neg_eigval=False, backend="reference")
  for name, val in changes.items():
    (x if name in x else kw)[name] = val
  return x, kw


BAD = [
    ("num_householder", dict(num_householder=0)),
    ("q", dict(q=jnp.zeros((2, 2, 8)))),
    ("q", dict(q=jnp.zeros((2, 2, 1, 8), jnp.int32))),
    ("q", dict(q=jnp.zeros((2, 2, 1, 300)), k=jnp.zeros((2, 4, 1, 300)))),
    ("v", dict(v=jnp.zeros((2, 4, 8)))),
    ("v", dict(q=jnp.zeros((2, 2, 2, 8)), k=jnp.zeros((2, 4, 2, 8)), v=jnp.zeros((2, 4, 3, 4)),
               a=jnp.zeros((2, 2, 3)), b=jnp.zeros((2, 4, 3)), A_log=jnp.zeros(3),
               dt_bias=jnp.zeros(3))),
    ("k", dict(k=jnp.zeros((2, 2, 1, 8)))),
    ("k", dict(k=jnp.zeros((2, 4, 1, 8), jnp.int32))),
    ("v", dict(v=jnp.zeros((2, 5, 2, 4)))),
    ("a", dict(a=jnp.zeros((2, 4, 2)))),
    ("a", dict(a=jnp.zeros((2, 2, 2), jnp.int32))),
    ("b", dict(b=jnp.zeros((2, 2, 2)))),
    ("b", dict(b=jnp.zeros((2, 4, 2), jnp.int32))),
    ("A_log", dict(A_log=jnp.zeros((3,)))),
    ("A_log", dict(A_log=jnp.zeros((2,), jnp.int32))),
    ("dt_bias", dict(dt_bias=jnp.zeros((2, 1)))),
    ("dt_bias", dict(dt_bias=jnp.zeros((2,), jnp.int32))),
    ("allow_neg_eigval", dict(allow_neg_eigval=jnp.asarray(True))),
    ("backend", dict(backend="cuda")),
]


@pytest.mark.parametrize("name,changes", BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD)])
def test_bad_input(name, changes):
  x, kw = _bad_inputs(**changes)
  with pytest.raises(ValueError, match=f"^{name}:"):
    gated_delta_product_decode_prepare(**x, **kw)


def test_bad_input_message():
  x, kw = _bad_inputs(a=jnp.zeros((2, 4, 2)))
  with pytest.raises(ValueError) as e:
    gated_delta_product_decode_prepare(**x, **kw)
  assert str(e.value) == ("a: expected [N, D, HV] = [2, 2, 2] (one decay pre-activation per "
                          "draft token), got [2, 4, 2]")
  x, kw = _bad_inputs()
  assert len(gated_delta_product_decode_prepare(**x, **kw)) == 3  # the base inputs are valid
