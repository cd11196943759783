"""Gated Delta Product as a Flax NNX layer, with FLA's parameters and a slot-addressed cache.

`GatedDeltaProduct` has the structure, the parameter names (see `from_fla_state_dict`) and the
math of FLA's `fla.layers.GatedDeltaProduct`; per token t of a sequence, M = num_householder:

    q, k, v = silu(causal_conv(x W_q)), silu(causal_conv(x W_k)), silu(causal_conv(x W_v))
                 # depthwise, kernel W = conv_size, no bias; k, v (and b) carry M copies each,
                 # copy-major: feature block m of token t is expanded row t*M + m
    beta = sigmoid(x W_b)                  (x 2 with allow_neg_eigval: eigenvalues in (-1, 1))
    g    = -exp(A_log) * softplus(x W_a + dt_bias)        (float32, one per token and value head)
    o    = GatedDeltaProduct(l2norm(q), l2norm(k), v, g, beta)   (gdp_jax's kernels)
    y    = (RMSNorm(o) * w * silu(x W_gate)) W_o          (per value head)

Two paths share the weights: `__call__` runs a prefill (dense or packed with cu_seqlens) through
`gdp_jax.chunk_gated_delta_product`, and `decode` runs D draft tokens per request through
`gdp_jax.gated_delta_product_decode`. Both read and write a `GDPCache`, addressed by slot: the
recurrent state and the short convolution's last W-1 inputs. For speculative decoding, `decode`
takes the previous step's accepted counts and either starts both from the snapshots after the
last accepted token, with no rollback copy (`accept_draft_tokens` copies those snapshots back
into the cache when it must be the state of record again), or, with a replay cache
(`init_cache(..., replay=True)`), replays the accepted tokens from a ring of the previous step's
inputs into a checkpoint (`GatedDeltaProduct.commit_replay` folds them in to end speculation).
docs/api.md describes both.

This module is `gdp_jax.flax` (it needs the optional dependency flax >= 0.12); its absolute
`import flax.nnx` reaches the Flax package, not this file.
"""
from __future__ import annotations

import math
from typing import NamedTuple

try:
  import flax.nnx as nnx
except ModuleNotFoundError as e:
  if e.name is None or e.name.split(".")[0] != "flax":
    raise
  raise ModuleNotFoundError(
      "gdp_jax.flax needs Flax >= 0.12, which is not installed: pip install \"gdp-jax[flax]\" "
      '(from a checkout: pip install -e ".[flax]")', name=e.name) from e
import jax
import jax.numpy as jnp
import numpy as np

from gdp_jax._common import owners
from gdp_jax.decode import accept_draft_tokens as _accept_state
from gdp_jax.decode import commit_replay as _commit_state
from gdp_jax.decode import gated_delta_product_decode
from gdp_jax.prefill import chunk_gated_delta_product
# torch's softplus (threshold 20), as FLA's gate uses it; the one the jnp gates of gdp_jax use.
from gdp_jax.reference.prepare import _softplus

__all__ = [
    "GDPCache",
    "GatedDeltaProduct",
    "accept_draft_tokens",
    "fla_state_dict_shapes",
    "from_fla_state_dict",
    "reset_slots",
    "to_fla_state_dict",
]


class GDPCache(NamedTuple):
  """The serving cache of one `GatedDeltaProduct` layer, S slots (a pytree: donate it to jit).

  C = H*K + M*H*K + M*HV*V is the width of the short convolution's input, the q, k and v
  projections side by side in that order. W is the convolution kernel size.

  Attributes:
    state: recurrent state [S, HV, K, V] (float32 unless asked otherwise).
    conv: the last W-1 convolution inputs of each slot, oldest first, [S, W-1, C]; None without
      the short convolution.
    state_snapshots: [S, D, HV, K, V], the state after each of D draft tokens of the last
      `decode`, read by the next `decode` through its num_accepted (or copied back by
      `accept_draft_tokens`); None when the cache was made without draft tokens.
    conv_snapshots: [S, D, W-1, C], the convolution inputs after each draft token; None like
      state_snapshots (or without the short convolution).
    ring: the replay ring of a replay cache (`init_cache(..., replay=True)`), else None: the
      kernel's `replay_ring` (k [S, D*M, H, K], v [S, D*M, HV, V], g [S, D, HV] or None without
      the forget gate, beta [S, D*M, HV]), the last `decode`'s inputs per slot. In a replay
      cache `state` and `conv` are the checkpoint, the state and convolution inputs before that
      step; the next `decode` replays its first num_accepted tokens into them.
    conv_ring: [S, D, C], the last `decode`'s D convolution inputs per slot, in a replay cache
      with the short convolution; else None.
  """
  state: jax.Array
  conv: jax.Array | None = None
  state_snapshots: jax.Array | None = None
  conv_snapshots: jax.Array | None = None
  ring: tuple | None = None
  conv_ring: jax.Array | None = None


def _acc(dtype):
  # FLA computes convolutions, norms and gates in float32; float64 inputs keep float64.
  return jnp.promote_types(dtype, jnp.float32)


def _live_slots(slots, S):
  """(valid mask, clipped index for gathers, index for scatters with out-of-range = dropped)."""
  slots = slots.astype(jnp.int32)
  valid = (slots >= 0) & (slots < S)
  # jnp reads -1 as the last slot: gather from a clipped index and discard, scatter invalid rows to
  # S, which mode="drop" ignores.
  return valid, jnp.where(valid, slots, 0), jnp.where(valid, slots, S)


def _read_rows(buf, slots):
  valid, gather, _ = _live_slots(slots, buf.shape[0])
  rows = buf[gather]
  return jnp.where(valid.reshape((-1,) + (1,) * (rows.ndim - 1)), rows, jnp.zeros((), buf.dtype))


def _write_rows(buf, slots, rows):
  _, _, scatter = _live_slots(slots, buf.shape[0])
  return buf.at[scatter].set(rows.astype(buf.dtype), mode="drop")


def _read_accepted(buf, snaps, slots, num_accepted):
  """Per request, the rows after its last accepted draft token: snaps[slot, n-1], or buf[slot]
  where n = 0; zeros for padding slots. Counts are clamped to 0..D, as the kernels do."""
  valid, gather, _ = _live_slots(slots, buf.shape[0])
  n = jnp.clip(num_accepted.astype(jnp.int32), 0, snaps.shape[1])
  rows = jnp.where((n > 0).reshape((-1,) + (1,) * (buf.ndim - 1)),
                   snaps[gather, jnp.maximum(n - 1, 0)], buf[gather])
  return jnp.where(valid.reshape((-1,) + (1,) * (rows.ndim - 1)), rows,
                   jnp.zeros((), buf.dtype))


def _read_replayed(conv, conv_ring, slots, num_accepted):
  """Per request, the W-1 convolution inputs after its last accepted token of the last step:
  the last W-1 rows of concat(conv[slot], conv_ring[slot, :n]); zeros for padding slots. Counts
  are clamped to 0..D, as the kernels do."""
  valid, gather, _ = _live_slots(slots, conv.shape[0])
  W1, D = conv.shape[1], conv_ring.shape[1]
  n = jnp.clip(num_accepted.astype(jnp.int32), 0, D)
  ext = jnp.concatenate([conv[gather], conv_ring[gather].astype(conv.dtype)], axis=1)
  rows = jnp.take_along_axis(ext, (n[:, None] + jnp.arange(W1))[:, :, None], axis=1)
  return jnp.where(valid[:, None, None], rows, jnp.zeros((), conv.dtype))


def reset_slots(cache: GDPCache, slots) -> GDPCache:
  """Zeroes the state and convolution inputs of `slots` (new requests start from zero).

  Args:
    cache: a `GDPCache` with S slots.
    slots: [N] int32; slots outside [0, S) are skipped.

  Returns:
    The cache with those rows zeroed (snapshots and replay rings untouched: `decode` rewrites
    them, and the next `decode` of a replay cache passes num_accepted = 0 for these slots).
  """
  state = _write_rows(cache.state, slots, jnp.zeros((slots.shape[0],) + cache.state.shape[1:]))
  conv = cache.conv
  if conv is not None:
    conv = _write_rows(conv, slots, jnp.zeros((slots.shape[0],) + conv.shape[1:]))
  return cache._replace(state=state, conv=conv)


def accept_draft_tokens(cache: GDPCache, slots, num_accepted) -> GDPCache:
  """Rolls each slot back to the state and convolution inputs after its last accepted token.

  After `GatedDeltaProduct.decode` with D draft tokens, request i (slot s = slots[i]) keeps its
  first n = num_accepted[i] tokens: `state[s] = state_snapshots[s, n-1]` and
  `conv[s] = conv_snapshots[s, n-1]`. n = D is a no-op after a decode without num_accepted.
  Slots outside [0, S) and counts outside [1, D] leave the cache untouched. A serving loop that
  passes num_accepted to the next `decode` needs no such copy; this one is for when the cache
  must be the state of record again (a prefill continuing the request, plain decoding).

  Args:
    cache: a `GDPCache` made with `num_draft=D` and written by `decode`.
    slots: [N] int32 slots, as passed to `decode`.
    num_accepted: [N] int32 in 1..D.

  Returns:
    The rolled-back cache.

  Raises:
    ValueError: if the cache holds no snapshots.
  """
  if cache.ring is not None:
    raise ValueError("cache: a replay cache keeps no snapshots to copy back; fold the accepted "
                     "tokens into its checkpoint with GatedDeltaProduct.commit_replay(cache, "
                     "slots, num_accepted)")
  if cache.state_snapshots is None:
    raise ValueError("cache: holds no draft-token snapshots; make it with "
                     "GatedDeltaProduct.init_cache(num_slots, num_draft=D)")
  state = _accept_state(cache.state, cache.state_snapshots, slots, num_accepted)
  conv = cache.conv
  if conv is not None:
    S, D = cache.conv_snapshots.shape[:2]
    n = num_accepted.astype(jnp.int32)
    valid, gather, _ = _live_slots(slots, S)
    valid = valid & (n >= 1) & (n <= D)
    rows = cache.conv_snapshots[gather, jnp.where(valid, n - 1, 0)]
    conv = conv.at[jnp.where(valid, gather, S)].set(rows, mode="drop")
  return cache._replace(state=state, conv=conv)


def _conv_prefill(xa, weight, bias, cu, ctx):
  """Causal depthwise convolution + SiLU over a packed stream, sequences kept apart.

  Args:
    xa: [T, C] inputs of the packed stream (dense batches are flattened, one row per sequence).
    weight: [C, W]; weight[:, W-1] multiplies the current token (FLA's and torch's layout).
    bias: [C] or None.
    cu: [N+1] int32 sequence starts in the stream; tokens past cu[N] are slack.
    ctx: [N, W-1, C] inputs that precede each sequence (oldest first), or None for zeros.

  Returns:
    (y [T, C] in xa.dtype, new_ctx [N, W-1, C]: the last W-1 inputs of each sequence, which are
    taken from ctx where the sequence is shorter than W-1).
  """
  T, C = xa.shape
  W = weight.shape[1]
  N = cu.shape[0] - 1
  f32 = _acc(xa.dtype)
  xf = xa.astype(f32)
  w = weight.astype(f32)
  t = jnp.arange(T, dtype=jnp.int32)
  seq = owners(cu[1:], T)
  local = t - cu[jnp.minimum(seq, N)]
  y = xf * w[:, W - 1]
  for s in range(1, W):
    # Token t - s belongs to the same sequence only when t is at least s tokens in.
    prev = jnp.pad(xf, ((s, 0), (0, 0)))[:T]
    y = y + jnp.where((local >= s)[:, None], prev, 0.0) * w[:, W - 1 - s]
  bos = cu[:-1]
  length = cu[1:] - bos
  if ctx is not None:
    # The left context reaches only the first W-1 tokens of a sequence: token j (< W-1) sees
    # ctx[n, W-1 + j - s] for each shift s > j. A tiny [N, W-1, C] term, scattered into place.
    cf = ctx.astype(f32)
    j = np.arange(W - 1)
    corr = jnp.zeros((N, W - 1, C), f32)
    for s in range(1, W):
      idx = W - 1 + j - s                                       # ctx row for (token j, shift s)
      use = (j < s)[None, :, None]
      corr = corr + jnp.where(use, cf[:, np.clip(idx, 0, W - 2)], 0.0) * w[:, W - 1 - s]
    rows = bos[:, None] + j[None, :]
    rows = jnp.where(j[None, :] < length[:, None], rows, T)   # positions past the end: dropped
    y = y.at[rows].add(corr, mode="drop")
  if bias is not None:
    y = y + bias.astype(f32)
  y = y * jax.nn.sigmoid(y)
  # New context: inputs at eos-(W-1) .. eos-1, reaching back into ctx for short sequences.
  j = jnp.arange(W - 1)
  pos = cu[1:, None] - (W - 1) + j[None, :]                    # [N, W-1]
  from_x = pos >= bos[:, None]
  new_ctx = jnp.where(from_x[..., None], xa[jnp.clip(pos, 0, T - 1)], jnp.zeros((), xa.dtype))
  if ctx is not None:
    old = ctx[jnp.arange(N)[:, None], jnp.clip(length[:, None] + j[None, :], 0, W - 2)]
    new_ctx = jnp.where(from_x[..., None], new_ctx, old.astype(xa.dtype))
  return y.astype(xa.dtype), new_ctx


def _conv_decode(xa, weight, bias, ctx):
  """Causal depthwise convolution + SiLU over D new tokens per request, after ctx.

  Args:
    xa: [N, D, C] new inputs.
    weight: [C, W].
    bias: [C] or None.
    ctx: [N, W-1, C] the W-1 inputs before them.

  Returns:
    (y [N, D, C] in xa.dtype, windows [N, D, W-1, C]: the last W-1 inputs after each new token).
  """
  N, D, C = xa.shape
  W = weight.shape[1]
  ext = jnp.concatenate([ctx.astype(xa.dtype), xa], axis=1)          # [N, W-1+D, C]
  f32 = _acc(xa.dtype)
  ef = ext.astype(f32)
  w = weight.astype(f32)
  y = sum(ef[:, i:i + D] * w[:, i] for i in range(W))
  if bias is not None:
    y = y + bias.astype(f32)
  y = y * jax.nn.sigmoid(y)
  windows = jnp.stack([ext[:, d + 1:d + W] for d in range(D)], axis=1)
  return y.astype(xa.dtype), windows


class ShortConvolution(nnx.Module):
  """Parameters of one causal depthwise convolution (FLA's `ShortConvolution`, an nn.Conv1d).

  `weight` is [C, W], FLA's [C, 1, W] without the unit axis; `bias` is [C] or None. The
  convolution itself runs in `GatedDeltaProduct`, over q, k and v side by side.
  """

  def __init__(self, hidden_size: int, kernel_size: int, *, bias: bool = False,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    # torch's Conv1d default init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = W for depthwise.
    bound = 1.0 / math.sqrt(kernel_size)
    self.weight = nnx.Param(jax.random.uniform(
        rngs.params(), (hidden_size, kernel_size), param_dtype, -bound, bound))
    self.bias = (nnx.Param(jax.random.uniform(rngs.params(), (hidden_size,), param_dtype,
                                              -bound, bound)) if bias else None)


class GatedRMSNorm(nnx.Module):
  """RMSNorm over the last axis times `weight`, optionally times silu(gate) (FLA's
  `FusedRMSNormGated` / `RMSNorm` with elementwise affine), computed in float32."""

  def __init__(self, hidden_size: int, *, eps: float, param_dtype=jnp.float32):
    self.eps = eps
    self.weight = nnx.Param(jnp.ones((hidden_size,), param_dtype))

  def __call__(self, x, gate=None):
    f32 = _acc(x.dtype)
    xf = x.astype(f32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    y = y * self.weight[...].astype(f32)
    if gate is not None:
      gf = gate.astype(f32)
      y = y * gf * jax.nn.sigmoid(gf)
    return y.astype(x.dtype)


class GatedDeltaProduct(nnx.Module):
  """Gated Delta Product layer (FLA's `GatedDeltaProduct`) on gdp_jax's kernels.

  Constructor arguments and defaults are FLA's: `head_dim` is K, `head_dim * expand_v` is V,
  `num_heads` is H, `num_v_heads` (default H) is HV, `num_householder` is M.

  Args:
    hidden_size: model width.
    expand_v: V / K.
    head_dim: K (<= 256).
    num_heads: H, query/key heads.
    num_v_heads: HV, value heads, a multiple of H (None: H).
    use_output_gate: gate the normalised output with silu(g_proj(x)); else plain RMSNorm.
    use_short_conv: causal depthwise convolutions (then SiLU) on q, k, v; else SiLU alone.
    conv_size: W, the convolution kernel size.
    conv_bias: convolutions with bias.
    norm_eps: epsilon of the output RMSNorm.
    use_forget_gate: the decay g (else g = 0, no decay).
    allow_neg_eigval: beta = 2 * sigmoid(b), in (0, 2).
    num_householder: M, rank-1 (Householder) updates per token.
    backend: passed to the gdp_jax entry points ("auto", "triton", "reference", "interpret").
    prefill_config, prefill_bwd_config: the prefill's `config=` (a `gdp_jax.FwdConfig`) and
      `bwd_config=` (a `gdp_jax.BwdConfig`), None for the defaults (docs/api.md, "Kernel
      configs").
    dtype: compute dtype of activations (None: that of the input); the gates are float32.
    param_dtype: dtype of the parameters.
    precision: matmul precision of the projections (jax.lax.Precision), None for the default.
    rngs: `nnx.Rngs` for initialisation (FLA's init: Xavier-uniform projections with gain
      2**-2.5, A = exp(A_log) ~ U(0, 16), dt = softplus(dt_bias) log-uniform in [1e-3, 1e-1]).
  """

  def __init__(self, hidden_size: int = 2048, expand_v: float = 2, head_dim: int = 256,
               num_heads: int = 6, num_v_heads: int | None = None, use_output_gate: bool = True,
               use_short_conv: bool = True, conv_size: int = 4, conv_bias: bool = False,
               norm_eps: float = 1e-5, use_forget_gate: bool = True,
               allow_neg_eigval: bool = True, num_householder: int = 2, backend: str = "auto",
               dtype=None, param_dtype=jnp.float32, precision=None, *, prefill_config=None,
               prefill_bwd_config=None, rngs: nnx.Rngs):
    num_v_heads = num_heads if num_v_heads is None else num_v_heads
    head_v_dim = head_dim * expand_v
    if not float(head_v_dim).is_integer():
      raise ValueError(f"expand_v: head_dim * expand_v = {head_dim} * {expand_v} = {head_v_dim} "
                       "is not an integer")
    if num_v_heads % num_heads != 0:
      raise ValueError(f"num_v_heads: {num_v_heads} must be a multiple of num_heads = {num_heads}")
    if conv_size < 2 and use_short_conv:
      raise ValueError(f"conv_size: expected >= 2 with use_short_conv, got {conv_size}")
    self.hidden_size = hidden_size
    self.head_k_dim = head_dim
    self.head_v_dim = int(head_v_dim)
    self.num_heads = num_heads
    self.num_v_heads = num_v_heads
    self.num_householder = num_householder
    self.key_dim = num_heads * head_dim
    self.value_dim = num_v_heads * self.head_v_dim
    self.use_output_gate = use_output_gate
    self.use_short_conv = use_short_conv
    self.conv_size = conv_size
    self.conv_bias = conv_bias
    self.norm_eps = norm_eps
    self.use_forget_gate = use_forget_gate
    self.allow_neg_eigval = allow_neg_eigval
    self.backend = backend
    self.prefill_config = prefill_config
    self.prefill_bwd_config = prefill_bwd_config
    self.dtype = dtype
    self.param_dtype = param_dtype
    M, HV = num_householder, num_v_heads
    init = nnx.initializers.variance_scaling(2 ** -5, "fan_avg", "uniform")  # xavier, gain 2**-2.5

    def linear(n_in, n_out):
      return nnx.Linear(n_in, n_out, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                        precision=precision, kernel_init=init, rngs=rngs)

    self.q_proj = linear(hidden_size, self.key_dim)
    self.k_proj = linear(hidden_size, self.key_dim * M)
    self.v_proj = linear(hidden_size, self.value_dim * M)
    self.b_proj = linear(hidden_size, HV * M)
    if use_forget_gate:
      self.a_proj = linear(hidden_size, HV)
      A = jax.random.uniform(rngs.params(), (HV,), jnp.float32, 0.0, 16.0)
      # At least float32 (FLA keeps it float32): in half precision exp(A_log) can overflow.
      self.A_log = nnx.Param(jnp.log(A).astype(_acc(param_dtype)))
      dt = jnp.exp(jax.random.uniform(rngs.params(), (HV,), jnp.float32)
                   * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
      dt = jnp.maximum(dt, 1e-4)
      self.dt_bias = nnx.Param((dt + jnp.log(-jnp.expm1(-dt))).astype(param_dtype))
    else:
      self.a_proj = self.A_log = self.dt_bias = None
    if use_short_conv:
      def conv(width):
        return ShortConvolution(width, conv_size, bias=conv_bias, param_dtype=param_dtype,
                                rngs=rngs)
      self.q_conv1d = conv(self.key_dim)
      self.k_conv1d = conv(self.key_dim * M)
      self.v_conv1d = conv(self.value_dim * M)
    else:
      self.q_conv1d = self.k_conv1d = self.v_conv1d = None
    self.g_proj = linear(hidden_size, self.value_dim) if use_output_gate else None
    self.o_norm = GatedRMSNorm(self.head_v_dim, eps=norm_eps, param_dtype=param_dtype)
    self.o_proj = linear(self.value_dim, hidden_size)

  # ---------------------------------------------------------------------------------------------
  # Cache

  @property
  def conv_width(self) -> int:
    """C, the width of the convolution input (q, k, v projections side by side)."""
    M = self.num_householder
    return self.key_dim * (1 + M) + self.value_dim * M

  def init_cache(self, num_slots: int, *, num_draft: int | None = None, replay: bool = False,
                 dtype=jnp.float32, conv_dtype=None) -> GDPCache:
    """A zeroed cache of `num_slots` slots.

    Args:
      num_slots: S.
      num_draft: D, the draft tokens per speculative `decode` step; None for plain decoding.
        Without replay the cache keeps their snapshots (`accept_draft_tokens` rolls back to
        them, or the next `decode` starts from them).
      replay: a checkpoint-and-replay cache (needs num_draft): the state and convolution
        inputs are checkpoints, and a ring keeps the last step's inputs per slot (`GDPCache`'s
        `ring` and `conv_ring`) for the next `decode` to replay; 1 state read and 1 write per
        step whatever D, against 1 read and D snapshot writes (docs/api.md).
      dtype: dtype of the state and its snapshots (float32 keeps rollback exact).
      conv_dtype: dtype of the convolution inputs and the replay ring's k, v and beta; None:
        the layer's dtype, else param_dtype (the dtype of the projections' outputs). The ring's
        g is float32 (float64 for float64 activations), as the layer computes it.

    Returns:
      `GDPCache` with state [S, HV, K, V], conv [S, W-1, C] and, with num_draft, the snapshots
      or (replay) the rings.

    Raises:
      ValueError: for replay without num_draft.
    """
    S, HV, K, V = num_slots, self.num_v_heads, self.head_k_dim, self.head_v_dim
    conv_dtype = conv_dtype or self.dtype or self.param_dtype
    state = jnp.zeros((S, HV, K, V), dtype)
    conv = (jnp.zeros((S, self.conv_size - 1, self.conv_width), conv_dtype)
            if self.use_short_conv else None)
    if replay and num_draft is None:
      raise ValueError("num_draft: replay=True needs D, the draft tokens per decode step "
                       "(the ring holds one step's)")
    if num_draft is None:
      return GDPCache(state, conv)
    if replay:
      R, H = num_draft * self.num_householder, self.num_heads
      # The ring replays what the step ran: k, v and beta in the activation dtype, g as _gates
      # computes it.
      ring = (jnp.zeros((S, R, H, K), conv_dtype), jnp.zeros((S, R, HV, V), conv_dtype),
              jnp.zeros((S, num_draft, HV), _acc(conv_dtype)) if self.use_forget_gate else None,
              jnp.zeros((S, R, HV), conv_dtype))
      conv_ring = (jnp.zeros((S, num_draft, self.conv_width), conv_dtype)
                   if conv is not None else None)
      return GDPCache(state, conv, ring=ring, conv_ring=conv_ring)
    state_snaps = jnp.zeros((S, num_draft, HV, K, V), dtype)
    conv_snaps = (jnp.zeros((S, num_draft) + conv.shape[1:], conv_dtype)
                  if conv is not None else None)
    return GDPCache(state, conv, state_snaps, conv_snaps)

  # ---------------------------------------------------------------------------------------------
  # Shared pieces of both paths

  def _conv_params(self):
    convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
    weight = jnp.concatenate([c.weight[...] for c in convs], axis=0)
    bias = (jnp.concatenate([c.bias[...] for c in convs], axis=0) if self.conv_bias else None)
    return weight, bias

  def _project(self, x):
    """q, k, v projections side by side, [..., C], in the compute dtype."""
    if self.dtype is not None:
      x = x.astype(self.dtype)
    return jnp.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)

  def _gates(self, x):
    """(beta [..., M*HV] copy-major, in the compute dtype; g [..., HV] float32 or None)."""
    xc = x if self.dtype is None else x.astype(self.dtype)
    b = self.b_proj(xc)
    f32 = _acc(b.dtype)
    # FLA rounds beta to the activation dtype (sigmoid in float32, then the cast).
    beta = jax.nn.sigmoid(b.astype(f32))
    if self.allow_neg_eigval:
      beta = beta * 2.0
    beta = beta.astype(b.dtype)
    g = None
    if self.use_forget_gate:
      a = self.a_proj(xc).astype(f32)
      g = -jnp.exp(self.A_log[...].astype(f32)) * _softplus(a + self.dt_bias[...].astype(f32))
    return beta, g

  def _split_heads(self, ya, lead):
    """Splits [..., C] into q [*lead, H, K], k [*lead, M, H, K], v [*lead, M, HV, V]."""
    H, HV, K, V, M = (self.num_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim,
                      self.num_householder)
    kd = self.key_dim
    q = ya[..., :kd].reshape(*lead, H, K)
    # FLA: rearrange '... t (n h d) -> ... (t n) h d': the copy index is the outer factor.
    k = ya[..., kd:kd * (1 + M)].reshape(*lead, M, H, K)
    v = ya[..., kd * (1 + M):].reshape(*lead, M, HV, V)
    return q, k, v

  def _output(self, o, x):
    """Gated RMSNorm per value head, then o_proj. o: [..., HV, V]."""
    gate = None
    if self.use_output_gate:
      xc = x if self.dtype is None else x.astype(self.dtype)
      gate = self.g_proj(xc).reshape(o.shape)
    y = self.o_norm(o, gate)
    return self.o_proj(y.reshape(*o.shape[:-2], self.value_dim))

  # ---------------------------------------------------------------------------------------------
  # Prefill

  def __call__(self, x, *, cu_seqlens=None, cache: GDPCache | None = None, slots=None):
    """Prefill: whole sequences through `gdp_jax.chunk_gated_delta_product`.

    Args:
      x: [B, T, hidden_size]; with cu_seqlens, B == 1 and the sequences are packed.
      cu_seqlens: [N+1] int32 sequence starts, or None (N = B sequences of T tokens). Tokens past
        cu_seqlens[N] are slack: their output is 0. The convolution never reaches across a
        sequence boundary.
      cache: a `GDPCache`, or None (sequences start from zero and nothing is kept). With a cache,
        sequence n continues from slot slots[n] (its state and last W-1 convolution inputs; a
        new request's slot must be zeroed first, `reset_slots`) and writes them back.
      slots: [N] int32 slots (None: slot n); a slot outside [0, S) is padding: it reads and
        writes nothing and its output is 0.

    Returns:
      y [B, T, hidden_size] without a cache; (y, updated cache) with one.
    """
    B, T, _ = x.shape
    M, HV = self.num_householder, self.num_v_heads
    if slots is not None and cache is None:
      raise ValueError("slots: given without cache; pass the GDPCache they address")
    if cu_seqlens is not None and B != 1:
      raise ValueError(f"cu_seqlens: packed sequences need B == 1, got x of shape {list(x.shape)}")
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if cache is not None and slots is None:
      slots = jnp.arange(N, dtype=jnp.int32)
    xa = self._project(x)
    new_conv = None
    if self.use_short_conv:
      cu = (jnp.arange(B + 1, dtype=jnp.int32) * T if cu_seqlens is None
            else cu_seqlens.astype(jnp.int32))
      ctx = None if cache is None else _read_rows(cache.conv, slots)
      weight, bias = self._conv_params()
      ya, new_ctx = _conv_prefill(xa.reshape(B * T, -1), weight, bias, cu, ctx)
      ya = ya.reshape(B, T, -1)
      if cache is not None:
        new_conv = _write_rows(cache.conv, slots, new_ctx)
    else:
      ya = jax.nn.silu(xa)
    q, k, v = self._split_heads(ya, (B, T))
    beta, g = self._gates(x)
    out = chunk_gated_delta_product(
        q, k.reshape(B, T * M, *k.shape[3:]), v.reshape(B, T * M, *v.shape[3:]), g,
        beta.reshape(B, T * M, HV), num_householder=M, use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_seqlens, state=None if cache is None else cache.state,
        state_indices=slots if cache is not None else None, config=self.prefill_config,
        bwd_config=self.prefill_bwd_config, backend=self.backend)
    y = self._output(out[0], x)
    if cache is None:
      return y
    return y, cache._replace(state=out[1], conv=new_conv)

  # ---------------------------------------------------------------------------------------------
  # Decode

  def decode(self, x, cache: GDPCache, slots, num_accepted=None):
    """D tokens per request against the cache, through `gdp_jax.gated_delta_product_decode`.

    With a cache made with `num_draft=D`, the state and convolution inputs after every token are
    kept in its snapshots. The next step then takes `num_accepted`, the tokens verification
    kept, and starts each request from the snapshots after its last kept token: speculative
    decoding with no rollback copy (docs/api.md). Without num_accepted the step starts from
    `cache.state` and `cache.conv` (roll them back first with `accept_draft_tokens`).

    With a replay cache (`init_cache(S, num_draft=D, replay=True)`) num_accepted is required:
    request n replays the first num_accepted[n] tokens of the last step (kept in the rings of
    its slot) into the checkpoint, stores the result as the new checkpoint (`cache.state`,
    `cache.conv`), runs its D tokens from there and leaves them in the rings. Count 0 (after a
    prefill or `reset_slots`) replays nothing. `commit_replay` ends speculation.

    Args:
      x: [N, D, hidden_size], D consecutive tokens per request (D = 1 for plain decoding).
      cache: a `GDPCache`.
      slots: [N] int32 slots; a slot outside [0, S) is padding: reads and writes nothing, y = 0.
        Non-negative slots must be unique.
      num_accepted: [N] int32 or None: per request, how many of its D tokens the previous step
        kept (0 for a request fresh from prefill: it starts from cache.state and cache.conv).
        Needs the snapshots or the replay rings; with snapshots the cache's state and conv are
        not written, the snapshots are the state of record. Concrete counts outside 0..D raise
        ValueError; traced ones are clamped to 0..D.

    Returns:
      (y [N, D, hidden_size], updated cache).

    Raises:
      ValueError: if the cache keeps snapshots or a ring for a different number of draft
        tokens, num_accepted comes without them, or a replay cache comes without num_accepted.
    """
    if cache.ring is not None:
      return self._decode_replay(x, cache, slots, num_accepted)
    D = x.shape[1]
    snaps = cache.state_snapshots
    if snaps is not None and snaps.shape[1] != D:
      raise ValueError(f"x: the cache keeps snapshots for D = {snaps.shape[1]} draft tokens, got "
                       f"D = {D} tokens per request; use a cache with init_cache(S, num_draft={D})"
                       " or drop its snapshots (cache._replace(state_snapshots=None, "
                       "conv_snapshots=None))")
    if num_accepted is not None and snaps is None:
      raise ValueError("num_accepted: the cache holds no draft-token snapshots to start from; "
                       "make it with GatedDeltaProduct.init_cache(num_slots, num_draft=D)")
    xa = self._project(x)
    conv, conv_snaps = cache.conv, cache.conv_snapshots
    if self.use_short_conv:
      weight, bias = self._conv_params()
      if num_accepted is None:
        ctx = _read_rows(conv, slots)
      else:
        ctx = _read_accepted(conv, conv_snaps, slots, num_accepted)
      ya, windows = _conv_decode(xa, weight, bias, ctx)
      if num_accepted is None:
        conv = _write_rows(conv, slots, windows[:, -1])
      if conv_snaps is not None:
        conv_snaps = _write_rows(conv_snaps, slots, windows)
    else:
      ya = jax.nn.silu(xa)
    out = self._recurrence(x, ya, cache.state, slots, intermediate_states=snaps,
                           num_accepted=num_accepted)
    y = self._output(out[0], x)
    new_cache = GDPCache(out[1], conv, out[2] if snaps is not None else None, conv_snaps)
    return y, new_cache

  def _decode_replay(self, x, cache, slots, num_accepted):
    N, D, _ = x.shape
    ring_d = cache.ring[0].shape[1] // self.num_householder
    if ring_d != D:
      raise ValueError(f"x: the cache's replay ring holds D = {ring_d} draft tokens per slot, got "
                       f"x of shape {list(x.shape)} (D = {D}); use a cache with "
                       f"init_cache(S, num_draft={D}, replay=True)")
    if num_accepted is None:
      raise ValueError(f"num_accepted: a replay cache needs the previous step's accepted counts "
                       f"[N] = [{N}] (0 for a request fresh from prefill or reset_slots)")
    if cache.state_snapshots is not None or cache.conv_snapshots is not None:
      raise ValueError("cache: holds both a replay ring and snapshots; make it with "
                       "init_cache(S, num_draft=D, replay=True), which keeps the ring only")
    xa = self._project(x)
    conv, conv_ring = cache.conv, cache.conv_ring
    if self.use_short_conv:
      weight, bias = self._conv_params()
      # The accepted inputs of the last step, appended to the checkpoint's window, are the new
      # checkpoint's window: the convolution's replay.
      ctx = _read_replayed(conv, conv_ring, slots, num_accepted)
      ya, _ = _conv_decode(xa, weight, bias, ctx)
      conv = _write_rows(conv, slots, ctx)
      conv_ring = _write_rows(conv_ring, slots, xa)
    else:
      ya = jax.nn.silu(xa)
    o, state, ring = self._recurrence(x, ya, cache.state, slots, num_accepted=num_accepted,
                                      replay_ring=cache.ring)
    return self._output(o, x), cache._replace(state=state, conv=conv, ring=ring,
                                              conv_ring=conv_ring)

  def _recurrence(self, x, ya, state, slots, **speculation):
    """The decode kernel on the convolution's output ya [N, D, C] of tokens x, each token's M
    keys, values and betas unfolded into D*M steps; `speculation`: its snapshot or replay
    arguments."""
    N, D = x.shape[:2]
    M, HV = self.num_householder, self.num_v_heads
    q, k, v = self._split_heads(ya, (N, D))
    beta, g = self._gates(x)
    return gated_delta_product_decode(
        q, k.reshape(N, D * M, *k.shape[3:]), v.reshape(N, D * M, *v.shape[3:]), g,
        beta.reshape(N, D * M, HV), num_householder=M, state=state,
        state_indices=slots.astype(jnp.int32), use_qk_l2norm_in_kernel=True,
        backend=self.backend, **speculation)

  def commit_replay(self, cache: GDPCache, slots, num_accepted) -> GDPCache:
    """Folds each slot's accepted tokens of the last `decode` into a replay cache's checkpoint.

    Request i (slot s = slots[i]) applies the first n = num_accepted[i] tokens of the rings of
    slot s to `state[s]` (`gdp_jax.commit_replay`, the same kernel as the replay in `decode`)
    and to `conv[s]`. Afterwards the cache is the state after all accepted tokens, for a
    prefill that continues the request or plain decoding, and the ring is spent: the next
    `decode` of these slots passes num_accepted = 0.

    Args:
      cache: a replay cache written by `decode`.
      slots: [N] int32 slots, as passed to `decode`; slots outside [0, S) are skipped.
      num_accepted: [N] int32 in 0..D (0: no change); concrete counts outside it raise
        ValueError, traced ones are clamped.

    Returns:
      The cache with the accepted tokens folded in (rings untouched).

    Raises:
      ValueError: if the cache holds no replay ring.
    """
    if cache.ring is None:
      raise ValueError("cache: holds no replay ring; make it with GatedDeltaProduct.init_cache("
                       "num_slots, num_draft=D, replay=True) (a snapshot cache rolls back with "
                       "accept_draft_tokens)")
    state = _commit_state(cache.state, cache.ring, slots.astype(jnp.int32), num_accepted,
                          steps_per_token=self.num_householder, use_qk_l2norm_in_kernel=True,
                          backend=self.backend)
    conv = cache.conv
    if conv is not None:
      conv = _write_rows(conv, slots, _read_replayed(conv, cache.conv_ring, slots, num_accepted))
    return cache._replace(state=state, conv=conv)


# -------------------------------------------------------------------------------------------------
# FLA weights


def _fla_entries(layer: GatedDeltaProduct):
  """(FLA name, FLA shape, nnx variable, to_fla, from_fla) for every parameter of the layer."""
  def linear(mod, name):
    n_in, n_out = mod.kernel.shape
    # torch's nn.Linear keeps [out, in]; Flax's kernel is [in, out].
    return (f"{name}.weight", (n_out, n_in), mod.kernel, lambda a: a.T, lambda a: a.T)

  def same(name, var):
    return (name, tuple(var.shape), var, lambda a: a, lambda a: a)

  entries = [linear(layer.q_proj, "q_proj"), linear(layer.k_proj, "k_proj"),
             linear(layer.v_proj, "v_proj"), linear(layer.b_proj, "b_proj")]
  if layer.use_forget_gate:
    entries += [linear(layer.a_proj, "a_proj"), same("A_log", layer.A_log),
                same("dt_bias", layer.dt_bias)]
  if layer.use_short_conv:
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
      mod = getattr(layer, name)
      C, W = mod.weight.shape
      # nn.Conv1d with groups = C keeps [C, 1, W].
      entries.append((f"{name}.weight", (C, 1, W), mod.weight, lambda a: a[:, None, :],
                      lambda a: a[:, 0, :]))
      if mod.bias is not None:
        entries.append(same(f"{name}.bias", mod.bias))
  if layer.use_output_gate:
    entries.append(linear(layer.g_proj, "g_proj"))
  entries += [same("o_norm.weight", layer.o_norm.weight), linear(layer.o_proj, "o_proj")]
  return entries


def fla_state_dict_shapes(layer: GatedDeltaProduct) -> dict[str, tuple[int, ...]]:
  """The names and shapes of the FLA layer's `state_dict()` that matches `layer`."""
  return {name: shape for name, shape, *_ in _fla_entries(layer)}


def from_fla_state_dict(layer: GatedDeltaProduct, state_dict, prefix: str = ""):
  """Loads the weights of an FLA `GatedDeltaProduct` (torch `state_dict()`) into `layer`.

  The layer must be built with the same configuration. Every FLA parameter is required and no
  other key under `prefix` is accepted; values are cast to the dtype of the layer's parameters.
  To skip the random initialisation, fill an abstract layer:
  `from_fla_state_dict(nnx.eval_shape(lambda: GatedDeltaProduct(..., rngs=nnx.Rngs(0))), sd)`.

  Args:
    layer: the `GatedDeltaProduct` to fill in (modified in place).
    state_dict: mapping from FLA's names (`q_proj.weight`, `k_conv1d.weight`, `A_log`, ...) to
      arrays in torch's layout, as numpy arrays (e.g.
      `{k: v.float().cpu().numpy() for k, v in m.state_dict().items()}`).
    prefix: prefix of this layer's keys in a whole model's state dict (e.g. "model.layers.0.attn.").

  Returns:
    The layer.

  Raises:
    ValueError: naming the key, for a missing or unexpected key or a shape that does not fit.
  """
  entries = _fla_entries(layer)
  keys = {k[len(prefix):] for k in state_dict if k.startswith(prefix)}
  expected = {name for name, *_ in entries}
  missing = sorted(expected - keys)
  unexpected = sorted(keys - expected)
  if missing:
    raise ValueError(f"state_dict: missing {[prefix + k for k in missing]} for this layer's "
                     "configuration")
  if unexpected:
    raise ValueError(f"state_dict: unexpected {[prefix + k for k in unexpected]}; the layer's "
                     "configuration (use_forget_gate, use_short_conv, conv_bias, "
                     "use_output_gate) does not have them")
  for name, shape, var, _, from_fla in entries:
    value = np.asarray(state_dict[prefix + name])
    if tuple(value.shape) != shape:
      raise ValueError(f"state_dict: {prefix + name}: expected shape {list(shape)} for this "
                       f"layer, got {list(value.shape)}")
    var.set_value(jnp.asarray(from_fla(value), var.dtype))
  return layer


def to_fla_state_dict(layer: GatedDeltaProduct, prefix: str = "") -> dict[str, np.ndarray]:
  """The layer's weights as FLA's `state_dict()`: numpy arrays in torch's layout, FLA's names.

  `torch_layer.load_state_dict({k: torch.from_numpy(v) for k, v in d.items()})` loads them.
  """
  return {prefix + name: np.asarray(to_fla(np.asarray(var.get_value())))
          for name, _, var, to_fla, _ in _fla_entries(layer)}
