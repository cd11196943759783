"""Every check of API.md's "Bad input" raises ValueError at trace time, naming the argument."""
import jax
import jax.numpy as jnp
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
