"""Every check of docs/api.md's "Bad input" raises ValueError at trace time, naming the argument."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdp_jax

B, T, H, HV, K, V, M = 1, 8, 2, 4, 16, 8, 2
f32 = jnp.float32


def _sd(*shape, dtype=f32):
  return jax.ShapeDtypeStruct(shape, dtype)


def prefill_args(**over):
  a = dict(q=_sd(B, T, H, K), k=_sd(B, T * M, H, K), v=_sd(B, T * M, HV, V), g=_sd(B, T, HV),
           beta=_sd(B, T * M, HV))
  a.update(over)
  return a


def recurrent_args(**over):
  a = dict(q=_sd(B, T, H, K), k=_sd(B, T, H, K), v=_sd(B, T, HV, V), g=_sd(B, T, HV),
           beta=_sd(B, T, HV))
  a.update(over)
  return a


def decode_args(**over):
  N, D, S = 3, 2, 5
  a = dict(q=_sd(N, D, H, K), k=_sd(N, D * M, H, K), v=_sd(N, D * M, HV, V), g=_sd(N, D, HV),
           beta=_sd(N, D * M, HV), state=_sd(S, HV, K, V), state_indices=_sd(N, dtype=jnp.int32))
  a.update(over)
  return a


def _split(over):
  arrays = {k: v for k, v in over.items() if v is None or isinstance(v, jax.ShapeDtypeStruct)}
  static = {k: v for k, v in over.items() if k not in arrays}
  return arrays, static


def _run_prefill(cu=None, **over):
  arrays, static = _split(prefill_args(**over))
  static.setdefault("num_householder", M)
  if cu is not None:
    arrays["cu_seqlens"] = cu
  jax.eval_shape(lambda a: gdp_jax.chunk_gated_delta_product(**a, **static, backend="reference"), arrays)


def _run_recurrent(**over):
  arrays, static = _split(recurrent_args(**over))
  jax.eval_shape(lambda a: gdp_jax.fused_recurrent_gated_delta_rule(**a, **static, backend="reference"), arrays)


def _run_decode(**over):
  args = decode_args(**over)
  jax.eval_shape(lambda a: gdp_jax.gated_delta_product_decode(**a, num_householder=M, backend="reference"), args)


PREFILL_BAD = [
    ("q", dict(q=_sd(B, T, H))),
    ("k", dict(k=_sd(B, T, H, K))),
    ("k", dict(k=_sd(B, T * M, H, K + 1))),
    ("v", dict(v=_sd(B, T, HV, V))),
    ("v", dict(v=_sd(B, T * M, 3, V))),  # HV % H != 0
    ("q", dict(q=_sd(B, T, H, 300), k=_sd(B, T * M, H, 300))),  # K > 256
    ("g", dict(g=_sd(B, T * M, HV))),
    ("beta", dict(beta=_sd(B, T, HV))),
    ("q", dict(q=_sd(B, T, H, K, dtype=jnp.int32))),
    ("initial_state", dict(initial_state=_sd(B, HV, V, K))),
    ("state", dict(state=_sd(4, HV, K, V), initial_state=_sd(B, HV, K, V))),
    ("state_indices", dict(state_indices=_sd(B, dtype=jnp.int32))),
    ("state_indices", dict(state=_sd(4, HV, K, V), state_indices=_sd(B + 1, dtype=jnp.int32))),
    ("state_indices", dict(state=_sd(4, HV, K, V), state_indices=_sd(B))),  # float indices
    ("state", dict(state=_sd(4, HV, K + 1, V))),
    ("chunk_states_dtype", dict(chunk_states_dtype=jnp.int32)),
    ("num_householder", dict(num_householder=0)),
]


@pytest.mark.parametrize("name,over", PREFILL_BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(PREFILL_BAD)])
def test_prefill_rejects(name, over):
  with pytest.raises(ValueError, match=name):
    _run_prefill(**over)


def test_prefill_cu_seqlens_needs_batch_one():
  q = _sd(2, T, H, K)
  with pytest.raises(ValueError, match="cu_seqlens"):
    _run_prefill(cu=_sd(3, dtype=jnp.int32), q=q, k=_sd(2, T * M, H, K), v=_sd(2, T * M, HV, V),
                 g=_sd(2, T, HV), beta=_sd(2, T * M, HV))


def test_prefill_cu_seqlens_dtype():
  with pytest.raises(ValueError, match="cu_seqlens"):
    _run_prefill(cu=_sd(3, dtype=f32))


def test_prefill_state_without_indices_needs_enough_slots():
  with pytest.raises(ValueError, match="state"):
    _run_prefill(cu=_sd(4, dtype=jnp.int32), state=_sd(2, HV, K, V))


def test_prefill_message_gives_expected_shape():
  with pytest.raises(ValueError, match=r"k: expected \[B, T\*M, H, K\] = \[1, 16, 2, 16\] \(M=2 rows per token\), got \[1, 8, 2, 16\]"):
    _run_prefill(k=_sd(B, T, H, K))


RECURRENT_BAD = [
    ("k", dict(k=_sd(B, T + 1, H, K))),
    ("v", dict(v=_sd(B, T, 3, V))),
    ("beta", dict(beta=_sd(B, T, HV, V + 1))),
    ("beta", dict(beta=_sd(B, T, H))),
    ("g", dict(g=_sd(B, T, H))),
    ("q", dict(q=_sd(B, T, H, 512), k=_sd(B, T, H, 512))),
    ("intermediate_states", dict(state=_sd(4, HV, K, V), state_indices=_sd(B, dtype=jnp.int32),
                                 intermediate_states=_sd(4, T + 1, HV, K, V))),
    ("intermediate_states", dict(state=_sd(4, HV, K, V), intermediate_states=_sd(3, T, HV, K, V))),
    ("steps_per_token", dict(steps_per_token=0)),
    ("state_indices", dict(state_indices=_sd(B, dtype=jnp.int32))),
    ("state", dict(state=_sd(4, HV, K, V), initial_state=_sd(B, HV, K, V))),
    ("scale", dict(scale="x")),
]


@pytest.mark.parametrize("name,over", RECURRENT_BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(RECURRENT_BAD)])
def test_recurrent_rejects(name, over):
  with pytest.raises(ValueError, match=name):
    _run_recurrent(**over)


DECODE_BAD = [
    ("k", dict(k=_sd(3, 2, H, K))),
    ("v", dict(v=_sd(3, 2, HV, V))),
    ("g", dict(g=_sd(3, 4, HV))),
    ("beta", dict(beta=_sd(3, 2, HV))),
    ("state", dict(state=None)),
    ("state_indices", dict(state_indices=None)),
    ("state_indices", dict(state_indices=_sd(4, dtype=jnp.int32))),
    ("intermediate_states", dict(intermediate_states=_sd(5, 3, HV, K, V))),
]


@pytest.mark.parametrize("name,over", DECODE_BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(DECODE_BAD)])
def test_decode_rejects(name, over):
  with pytest.raises(ValueError, match=name):
    _run_decode(**over)


ACCEPT_BAD = [
    ("intermediate_states", dict(intermediate_states=_sd(4, 2, HV, K, V))),
    ("state_indices", dict(state_indices=_sd(3))),
    ("num_accepted", dict(num_accepted=_sd(2, dtype=jnp.int32))),
    ("state", dict(state=_sd(5, HV, K))),
]


@pytest.mark.parametrize("name,over", ACCEPT_BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(ACCEPT_BAD)])
def test_accept_rejects(name, over):
  a = dict(state=_sd(5, HV, K, V), intermediate_states=_sd(5, 2, HV, K, V),
           state_indices=_sd(3, dtype=jnp.int32), num_accepted=_sd(3, dtype=jnp.int32))
  a.update(over)
  with pytest.raises(ValueError, match=name):
    jax.eval_shape(lambda a: gdp_jax.accept_draft_tokens(**a), a)


def test_unknown_backend():
  with pytest.raises(ValueError, match="backend"):
    jax.eval_shape(lambda a: gdp_jax.fused_recurrent_gated_delta_rule(**a, backend="cuda"), recurrent_args())


def test_prefill_kernels_refuse_float64():
  args = prefill_args(**{n: _sd(*s.shape, dtype=jnp.float64) for n, s in prefill_args().items()})
  with pytest.raises(NotImplementedError, match="float64"):
    jax.eval_shape(lambda a: gdp_jax.chunk_gated_delta_product(**a, num_householder=M,
                                                               backend="interpret"), args)


def test_valid_arguments_pass():
  # The baseline of every rejection above is accepted, so each test isolates its one defect.
  _run_prefill()
  _run_recurrent()
  _run_decode()
  a = dict(state=_sd(5, HV, K, V), intermediate_states=_sd(5, 2, HV, K, V),
           state_indices=_sd(3, dtype=jnp.int32), num_accepted=_sd(3, dtype=jnp.int32))
  jax.eval_shape(lambda a: gdp_jax.accept_draft_tokens(**a), a)


def test_version_is_the_installed_distributions():
  import tomllib
  from pathlib import Path
  project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
  assert gdp_jax.__version__ == project["project"]["version"]


# -------------------------------------------------------------------------------------------------
# Kernel configs: the type, then every field against what the kernels can take. The prefill
# checks its configs on every backend (backend="reference" then ignores them).

Fwd, Bwd = gdp_jax.FwdConfig, gdp_jax.BwdConfig
CONFIG_BAD = [
    (dict(config=dict(h_piece=0)), r"config: expected a gdp_jax.FwdConfig or None, got dict"),
    (dict(config=tuple(Fwd())), r"config: expected a gdp_jax.FwdConfig or None, got tuple"),
    (dict(config=Bwd()), r"config: expected a gdp_jax.FwdConfig or None, got BwdConfig"),
    (dict(bwd_config=Fwd()), r"bwd_config: expected a gdp_jax.BwdConfig or None, got FwdConfig"),
    (dict(config=Fwd(h_piece=-2)), r"config: FwdConfig.h_piece: expected an int >= -1 \(-1: from "
     r"the request's shape, 0: never split, n > 0: pieces of n expanded chunks\), got -2"),
    (dict(config=Fwd(h_piece=2.0)), r"config: FwdConfig.h_piece: expected an int >= -1 .*, got 2.0"),
    (dict(config=Fwd(kkt_bk=96)), r"config: FwdConfig.kkt_bk: expected a power of two >= 16, got 96"),
    (dict(config=Fwd(o_bv=8)), r"config: FwdConfig.o_bv: expected a power of two >= 16, got 8"),
    (dict(config=Fwd(h_bv_big_k=48)), r"config: FwdConfig.h_bv_big_k: expected a power of two"),
    (dict(config=Fwd(h_warps=3)), r"config: FwdConfig.h_warps: expected 1, 2, 4, 8, 16 or 32, got 3"),
    (dict(config=Fwd(solve_warps=True)), r"config: FwdConfig.solve_warps: expected .*, got True"),
    (dict(config=Fwd(o_warps=64)), r"config: FwdConfig.o_warps: expected 1, 2, 4, 8, 16 or 32"),
    (dict(config=Fwd(h_stages=0)), r"config: FwdConfig.h_stages: expected an int >= 1, got 0"),
    (dict(config=Fwd(f32_precision="tf32")),
     r"config: FwdConfig.f32_precision: expected one of 'ieee', 'tf32x3', got 'tf32'"),
    (dict(config=Fwd(solve_precision="bf16")),
     r"config: FwdConfig.solve_precision: expected one of 'tf32x3', 'ieee', 'tf32', got 'bf16'"),
    (dict(config=Fwd(h_split_programs=-1)), r"config: FwdConfig.h_split_programs: expected an int >= 0"),
    (dict(bwd_config=Bwd(h_split=-1)), r"bwd_config: BwdConfig.h_split: expected an int >= 0 \(0: "
     r"from the number of programs, 1: never split, n > 1: n pieces per sequence\), got -1"),
    (dict(bwd_config=Bwd(h_split_programs=0)), r"bwd_config: BwdConfig.h_split_programs: expected an int >= 1"),
    (dict(bwd_config=Bwd(qk_block=3000)), r"bwd_config: BwdConfig.qk_block: expected a power of two >= 16"),
    (dict(bwd_config=Bwd(o_bk=32.0)), r"bwd_config: BwdConfig.o_bk: expected a power of two >= 16, got 32.0"),
    (dict(bwd_config=Bwd(finish_dk=2)), r"bwd_config: BwdConfig.finish_dk: expected 0 or 1, got 2"),
    (dict(bwd_config=Bwd(f32_precision="tf32")), r"bwd_config: BwdConfig.f32_precision: expected one of"),
    (dict(bwd_config=Bwd(partials="bfloat16")),
     r"bwd_config: BwdConfig.partials: expected one of 'float32', 'input', got 'bfloat16'"),
]


@pytest.mark.parametrize("backend", ["reference", "interpret"])
@pytest.mark.parametrize("over,message", CONFIG_BAD, ids=[f"{next(iter(o))}-{i}" for i, (o, _) in enumerate(CONFIG_BAD)])
def test_prefill_refuses_bad_config(over, message, backend):
  arrays, _ = _split(prefill_args())
  with pytest.raises(ValueError, match=message):
    jax.eval_shape(lambda a: gdp_jax.chunk_gated_delta_product(
        **a, num_householder=M, **over, backend=backend), arrays)


def test_config_rules_cover_every_field():
  """A field added to a config class needs a rule of what the kernels take (none is skipped)."""
  from gdp_jax import _checks
  for cls in (gdp_jax.DecodeConfig, Fwd, Bwd):
    assert set(_checks._CONFIG_FIELDS[cls]) == set(_checks.config_fields(cls)), cls.__name__


def test_valid_configs_pass():
  """The defaults, both opt-outs of the shape-keyed split, and every decode tile picked."""
  from gdp_jax import _checks, _configs
  arrays, _ = _split(prefill_args())
  for config in (Fwd(), Fwd(h_piece=0), Fwd(h_piece=3), Fwd(f32_precision="tf32x3")):
    for backend in ("reference", "interpret"):
      jax.eval_shape(lambda a: gdp_jax.chunk_gated_delta_product(
          **a, num_householder=M, config=config, bwd_config=Bwd(h_split=1), backend=backend),
          arrays)
  for K_, V_ in ((16, 8), (100, 512), (256, 256)):
    _checks.check_config("config", _configs.decode_config(K_, V_), gdp_jax.DecodeConfig)


@pytest.mark.parametrize("config,message", [
    (gdp_jax.FwdConfig(), r"config: expected a gdp_jax.DecodeConfig or None, got FwdConfig"),
    (gdp_jax.DecodeConfig(BV=12, num_warps=1), r"config: DecodeConfig.BV: expected a power of two >= 1, got 12"),
    (gdp_jax.DecodeConfig(BV=16, num_warps=0), r"config: DecodeConfig.num_warps: expected 1, 2, 4, 8, 16 or 32, got 0"),
], ids=["type", "BV", "num_warps"])
@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_decode_refuses_bad_config(config, message, backend):
  """Checked on every backend, as the prefill's, though "reference" runs no kernel."""
  with pytest.raises(ValueError, match=message):
    jax.eval_shape(lambda a: gdp_jax.gated_delta_product_decode(
        **a, num_householder=M, config=config, backend=backend), decode_args())


# -------------------------------------------------------------------------------------------------
# Dtypes: every argument has a listed set (gdp_jax._checks), anything else is refused with it.

CACHE_LIST = r"one of float32, bfloat16, float64; got float16"
INPUT_LIST = r"one of float32, bfloat16, float16, float64; got float8_e4m3fn"
INDEX_LIST = r"one of int32, int64; got uint32"
f16, f8 = jnp.float16, jnp.float8_e4m3fn

DTYPE_BAD = [
    (_run_prefill, dict(state=_sd(4, HV, K, V, dtype=f16)), r"state: expected a cache dtype, " + CACHE_LIST),
    (_run_recurrent, dict(state=_sd(4, HV, K, V, dtype=f16)), r"state: expected a cache dtype, " + CACHE_LIST),
    (_run_recurrent, dict(state=_sd(4, HV, K, V), intermediate_states=_sd(4, T, HV, K, V, dtype=f16)),
     r"intermediate_states: expected a cache dtype, " + CACHE_LIST),
    (_run_decode, dict(state=_sd(5, HV, K, V, dtype=f16)), r"state: expected a cache dtype, " + CACHE_LIST),
    (_run_decode, dict(intermediate_states=_sd(5, 2, HV, K, V, dtype=f16)),
     r"intermediate_states: expected a cache dtype, " + CACHE_LIST),
    (_run_prefill, dict(q=_sd(B, T, H, K, dtype=f8)), r"q: expected an input dtype, " + INPUT_LIST),
    (_run_prefill, dict(k=_sd(B, T * M, H, K, dtype=f8)), r"k: expected an input dtype, " + INPUT_LIST),
    (_run_recurrent, dict(v=_sd(B, T, HV, V, dtype=f8)), r"v: expected an input dtype, " + INPUT_LIST),
    (_run_recurrent, dict(g=_sd(B, T, HV, dtype=f8)), r"g: expected an input dtype, " + INPUT_LIST),
    (_run_decode, dict(beta=_sd(3, 2 * M, HV, dtype=f8)), r"beta: expected an input dtype, " + INPUT_LIST),
    (_run_recurrent, dict(initial_state=_sd(B, HV, K, V, dtype=f8)),
     r"initial_state: expected an input dtype, " + INPUT_LIST),
    (_run_decode, dict(state_indices=_sd(3, dtype=jnp.uint32)), r"state_indices: expected an index dtype, " + INDEX_LIST),
    (_run_prefill, dict(chunk_states_dtype=f8),
     r"chunk_states_dtype: expected None or one of float32, bfloat16, float16, float64; got float8_e4m3fn"),
]


@pytest.mark.parametrize("run,over,message", DTYPE_BAD, ids=[f"{r.__name__[5:]}-{m.split(':')[0]}-{i}" for i, (r, _, m) in enumerate(DTYPE_BAD)])
def test_refused_dtype_lists_the_allowed_ones(run, over, message):
  with pytest.raises(ValueError, match=message):
    run(**over)


def test_accept_refuses_dtypes_with_the_list():
  a = dict(state=_sd(5, HV, K, V), intermediate_states=_sd(5, 2, HV, K, V),
           state_indices=_sd(3, dtype=jnp.int32), num_accepted=_sd(3, dtype=jnp.int32))
  for over, message in [(dict(state=_sd(5, HV, K, V, dtype=f16)), r"state: expected a cache dtype, " + CACHE_LIST),
                        (dict(intermediate_states=_sd(5, 2, HV, K, V, dtype=f16)),
                         r"intermediate_states: expected a cache dtype, " + CACHE_LIST),
                        (dict(num_accepted=_sd(3, dtype=jnp.uint32)), r"num_accepted: expected an index dtype, " + INDEX_LIST)]:
    with pytest.raises(ValueError, match=message):
      jax.eval_shape(lambda a: gdp_jax.accept_draft_tokens(**a), dict(a, **over))


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("inputs", ["float32", "bfloat16", "float16", "float64"])
def test_every_listed_dtype_passes_the_checks(cache, inputs):
  cast = lambda a: {n: (_sd(*x.shape, dtype=inputs) if isinstance(x, jax.ShapeDtypeStruct)
                        and x.dtype == f32 else x) for n, x in a.items()}
  _run_prefill(**cast(prefill_args()), state=_sd(4, HV, K, V, dtype=cache),
               state_indices=_sd(B, dtype=jnp.int64), chunk_states_dtype=jnp.dtype(inputs))
  _run_recurrent(**cast(recurrent_args()), initial_state=_sd(B, HV, K, V, dtype=inputs))
  _run_decode(**dict(cast(decode_args()), state=_sd(5, HV, K, V, dtype=cache),
                     intermediate_states=_sd(5, 2, HV, K, V, dtype=cache)))


# -------------------------------------------------------------------------------------------------
# Values, checked when concrete: unique slots in [0, S), num_accepted in 1..D.

S_SLOTS, D_DRAFT = 5, 2


def _concrete_decode(slots):
  a = {n: jnp.zeros(s.shape, s.dtype) for n, s in decode_args().items()}
  a["state_indices"] = jnp.asarray(slots, jnp.int32)
  return a


def _concrete_accept(slots, counts):
  return dict(state=jnp.zeros((S_SLOTS, HV, K, V), f32),
              intermediate_states=jnp.ones((S_SLOTS, D_DRAFT, HV, K, V), f32),
              state_indices=jnp.asarray(slots, jnp.int32), num_accepted=jnp.asarray(counts, jnp.int32))


DUPLICATE = r"state_indices: slot 2 is used by requests \[0, 2\]; slots in \[0, S\) = \[0, 5\) must be unique"


def test_decode_refuses_repeated_slot():
  with pytest.raises(ValueError, match=DUPLICATE):
    gdp_jax.gated_delta_product_decode(**_concrete_decode([2, 0, 2]), num_householder=M,
                                       backend="reference")


def test_decode_refuses_repeated_slot_given_as_numpy():
  a = _concrete_decode([2, 0, 2])
  a["state_indices"] = np.asarray([2, 0, 2], np.int64)
  with pytest.raises(ValueError, match=DUPLICATE):
    gdp_jax.gated_delta_product_decode(**a, num_householder=M, backend="reference")


def test_recurrent_refuses_repeated_slot():
  a = {n: jnp.zeros(s.shape, s.dtype) for n, s in recurrent_args(
      q=_sd(3, T, H, K), k=_sd(3, T, H, K), v=_sd(3, T, HV, V), g=_sd(3, T, HV), beta=_sd(3, T, HV)).items()}
  with pytest.raises(ValueError, match=DUPLICATE):
    gdp_jax.fused_recurrent_gated_delta_rule(**a, state=jnp.zeros((5, HV, K, V), f32),
                                             state_indices=jnp.asarray([2, 4, 2], jnp.int32),
                                             backend="reference")


def test_prefill_refuses_repeated_slot():
  a = {n: jnp.zeros(s.shape, s.dtype) for n, s in prefill_args().items()}
  with pytest.raises(ValueError, match=DUPLICATE):
    gdp_jax.chunk_gated_delta_product(**a, num_householder=M, cu_seqlens=jnp.asarray([0, 3, 5, 8], jnp.int32),
                                      state=jnp.zeros((5, HV, K, V), f32),
                                      state_indices=jnp.asarray([2, 1, 2], jnp.int32), backend="reference")


def test_accept_refuses_repeated_slot():
  with pytest.raises(ValueError, match=DUPLICATE):
    gdp_jax.accept_draft_tokens(**_concrete_accept([2, 0, 2], [1, 1, 1]))


def test_padding_slots_may_repeat():
  # -1 and slots past S are padding: they may repeat, and they change nothing.
  slots = [-1, 3, -1, 5, 9, 5]
  N = len(slots)
  a = {n: jnp.zeros((N,) + s.shape[1:], s.dtype) for n, s in decode_args().items() if n != "state"}
  a["state_indices"] = jnp.asarray(slots, jnp.int32)
  o, cache = gdp_jax.gated_delta_product_decode(**a, state=jnp.zeros((S_SLOTS, HV, K, V), f32),
                                                num_householder=M, backend="reference")
  assert cache.shape == (S_SLOTS, HV, K, V)
  cache = gdp_jax.accept_draft_tokens(**_concrete_accept(slots, [1, 2, 0, 7, -1, 1]))
  assert np.all(np.asarray(cache)[np.arange(S_SLOTS) != 3] == 0)   # padding wrote nothing
  assert np.all(np.asarray(cache)[3] == 1)


@pytest.mark.parametrize("count", [0, -1, D_DRAFT + 3])
def test_accept_refuses_count_outside_one_to_D(count):
  with pytest.raises(ValueError, match=(
      rf"num_accepted: expected 1..D = 1..{D_DRAFT} for every request with a slot in \[0, S\), "
      rf"got {count} for request 1 \(slot 4\)")):
    gdp_jax.accept_draft_tokens(**_concrete_accept([0, 4, -1], [1, count, 1]))


def test_accept_counts_one_to_D_pass():
  cache = gdp_jax.accept_draft_tokens(**_concrete_accept([0, 4, -1], [1, D_DRAFT, 0]))
  assert np.all(np.asarray(cache)[[0, 4]] == 1)


def test_traced_values_are_not_checked():
  # Under jax.jit the values are unknown at trace time: the same calls trace (and are
  # documented as undefined for repeated slots, and as a no-op for counts outside 1..D).
  dec = _concrete_decode([2, 0, 2])
  jax.jit(lambda a: gdp_jax.gated_delta_product_decode(**a, num_householder=M,
                                                       backend="reference")).lower(dec)
  acc = _concrete_accept([2, 0, 2], [0, -1, D_DRAFT + 3])
  jax.jit(lambda a: gdp_jax.accept_draft_tokens(**a)).lower(acc)
  out = jax.jit(lambda a: gdp_jax.accept_draft_tokens(**a))(_concrete_accept([1, 0], [0, D_DRAFT + 3]))
  assert np.all(np.asarray(out) == 0), "a count outside 1..D should leave the slot untouched"
  jax.eval_shape(lambda a: gdp_jax.accept_draft_tokens(**a), acc)


# -------------------------------------------------------------------------------------------------
# Versions: the GPU path warns once on a combination other than the one the GPU suite passed with.

def _fake_versions(monkeypatch, python, **dists):
  from gdp_jax import _versions
  monkeypatch.setattr(_versions, "_WARNED", False)
  monkeypatch.setattr(_versions, "_python_version", lambda: python)
  monkeypatch.setattr(_versions, "_dist_version", lambda name: dists.get(name.replace("-", "_")))
  return _versions


TESTED_KW = dict(jax="0.11.2", jaxlib="0.11.2", jax_cuda13_plugin="0.11.2", triton="3.6.0",
                 jax_triton="0.3.1")


def test_untested_versions_warn_once(monkeypatch):
  v = _fake_versions(monkeypatch, "3.11", **dict(TESTED_KW, jax="0.10.2", jaxlib="0.10.2",
                                                 jax_triton=None))
  with pytest.warns(gdp_jax.UntestedVersionsWarning) as record:
    assert v.warn_if_untested()
    assert not v.warn_if_untested()
  assert len(record) == 1
  msg = str(record[0].message)
  assert ("passed its test suite with Python 3.12, jax 0.11.2, jaxlib 0.11.2, "
          "jax-cuda13-plugin 0.11.2, triton 3.6.0, jax-triton 0.3.1;") in msg
  assert ("found Python 3.11, jax 0.10.2, jaxlib 0.10.2, jax-cuda13-plugin 0.11.2, "
          "triton 3.6.0, jax-triton (not installed)") in msg
  assert "differs: Python, jax, jaxlib, jax-triton" in msg
  assert 'pip install "gdp-jax[gpu]"' in msg


def test_tested_versions_do_not_warn(monkeypatch):
  import warnings
  v = _fake_versions(monkeypatch, "3.12", **TESTED_KW)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert not v.warn_if_untested()


def test_gpu_extra_pins_the_tested_versions():
  import tomllib
  from pathlib import Path
  from gdp_jax import _versions
  project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
  gpu = project["project"]["optional-dependencies"]["gpu"]
  t = _versions.TESTED
  assert f"jax[cuda13]=={t['jax']}; python_version >= '{t['Python']}'" in gpu
  assert f"triton=={t['triton']}" in gpu and f"jax-triton=={t['jax-triton']}" in gpu


# -------------------------------------------------------------------------------------------------
# A missing optional dependency names the extra that installs it.

def test_missing_flax_names_the_extra(monkeypatch):
  import sys
  monkeypatch.delitem(sys.modules, "gdp_jax.flax", raising=False)
  for name in ("flax", "flax.nnx"):   # "import flax.nnx" now fails as if flax were not installed
    monkeypatch.setitem(sys.modules, name, None)
  with pytest.raises(ModuleNotFoundError, match=r'gdp_jax.flax needs Flax >= 0.12, which is not installed: pip install "gdp-jax\[flax\]"'):
    import gdp_jax.flax  # noqa: F401
