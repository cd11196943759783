"""The example model (`examples.tiny_lm.TinyLM`) trained and served on a device mesh.

Sequences are split over the mesh axis "data" and value heads over "model". Each layer's Gated
Delta Product op runs through `gdp_jax.sharding.sharded`: every device runs it (forward and
backward) on its own sequences and value heads, with no communication. Everything else is left
to XLA's partitioner under jax.jit, on Auto mesh axes: the parameters are replicated, and XLA
adds what the model needs around the op (the projections split or sliced into head blocks, the
heads of o brought together for o_proj, the parameter gradients summed over the devices).

    mesh = make_mesh(2, 1)                   # data-parallel on 2 devices; (1, 2): head-parallel
    step = train_step(graphdef, mesh, learning_rate=0.5)
    params = jax.device_put(params, replicated(mesh))
    params, loss = step(params, jax.device_put(tokens, batch_sharding(mesh)))

    engine = ShardedEngine(model, mesh, num_slots=4, num_draft=3)   # slots over "data"
    outputs, stats = engine.generate(requests)

`ShardedEngine` keeps every cache split: slots over "data" (device i of the axis owns slots
[i S/P, (i+1) S/P)), value heads over "model", replay rings (or snapshots) alike. The decode
step splits its rows (one per slot) and their accepted counts over "data", so each row meets
its slot and its ring on its own device. The packed prefill (B == 1 with cu_seqlens) cannot be
split over sequences: it runs with heads over "model" only, each "data" shard prefilling every
admitted sequence.
"""
from __future__ import annotations

import contextlib
import functools

import flax.nnx as nnx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import gdp_jax
from examples import tiny_lm as em
from gdp_jax import flax as gflax
from gdp_jax.sharding import sharded

__all__ = ["ShardedEngine", "batch_sharding", "cache_shardings", "layer_ops_on", "loss_fn",
           "make_mesh", "replicated", "train_step"]


def make_mesh(data: int, model: int, devices=None):
  """A ("data", "model") mesh of data * model devices with Auto axes.

  Auto, because the model's jnp code (embedding gathers, reshapes of head-split activations) is
  left to XLA's partitioner; on Explicit axes every such op would need its layout spelled out.
  """
  return jax.make_mesh((data, model), ("data", "model"), axis_types=(AxisType.Auto,) * 2,
                       devices=devices)


def replicated(mesh):
  return NamedSharding(mesh, P())


def batch_sharding(mesh):
  """[B, ...] arrays (token batches, per-slot vectors) split over "data"."""
  return NamedSharding(mesh, P("data"))


@contextlib.contextmanager
def layer_ops_on(mesh, *, bitwise: bool = False):
  """While a step traces, `GatedDeltaProduct` calls the gdp_jax ops sharded over `mesh`.

  The layer calls the entry points through their names in `gdp_jax.flax` and takes no argument
  to choose them, so this swaps those names for sharded wrappers and puts them back on exit.
  Only tracing needs it: a jitted step traced inside keeps the sharded ops in its program.

  Args:
    mesh: a `make_mesh` mesh.
    bitwise: False lets XLA split the layer's projections over heads as well (the op's inputs
      column by column, o_proj's contraction, then a sum over the head shards), which computes
      the same values in another rounding. True keeps every device's arithmetic outside the op
      that of one device: the op's inputs are computed whole on each device of a "model" row
      (the op takes its head block locally) and o is gathered before o_proj, at the price of
      projections repeated on every head shard. The model's outputs then equal the unsharded
      model's up to how XLA fuses the two programs, wherever the op's do on each shard: always
      on the reference backend, and on the kernels where no block size changes with the
      per-device HV or batch (the prefill's state scan picks its V block from N * HV * V:
      docs/api.md, "Batch invariance"). On 4 CPU devices that was bit for bit with jax 0.10.2
      and 0.11.2, and 7.9e-8 relative in the caches with jax 0.12, whose fusions round a few
      elements differently (with False: up to 2.8e-7 with jax 0.10.2, 2.0e-7 with 0.12).
  """
  kw = dict(batch_axis="data", head_axis="model")
  dense = sharded(gdp_jax.chunk_gated_delta_product, mesh, **kw)
  # Packed sequences (cu_seqlens, B == 1) cannot be split over "data".
  packed = sharded(gdp_jax.chunk_gated_delta_product, mesh, head_axis="model")
  decode = sharded(gdp_jax.gated_delta_product_decode, mesh, **kw)

  def constrain(xs, spec):
    if not bitwise:
      return xs
    return [jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec)) for x in xs]

  def run(op, args, kwargs, spec):
    # spec: the layout of the batch dimension, heads whole (replicated over "model").
    out = op(*constrain(args, spec), **kwargs)
    return tuple(constrain(out[:1], spec)) + tuple(out[1:])

  def prefill(*args, cu_seqlens=None, **kwargs):
    if cu_seqlens is None:
      return run(dense, args, kwargs, P("data"))
    return run(packed, args, dict(kwargs, cu_seqlens=cu_seqlens), P())

  ops = dict(chunk_gated_delta_product=prefill,
             gated_delta_product_decode=lambda *a, **k: run(decode, a, k, P("data")),
             _accept_state=sharded(gdp_jax.accept_draft_tokens, mesh, **kw),
             _commit_state=sharded(gdp_jax.commit_replay, mesh, **kw))
  saved = {name: getattr(gflax, name) for name in ops}
  for name, op in ops.items():
    setattr(gflax, name, op)
  try:
    yield
  finally:
    for name, op in saved.items():
      setattr(gflax, name, op)


def _traced_on(mesh, fn, bitwise=False):
  """fn (a jitted function), traced and run with the layer's ops sharded over `mesh`."""
  @functools.wraps(fn)
  def call(*args):
    with layer_ops_on(mesh, bitwise=bitwise):
      return fn(*args)
  return call


def loss_fn(model: em.TinyLM, tokens):
  """Mean next-token cross-entropy of tokens [B, T+1] (positions 0..T-1 predict 1..T)."""
  logits = model(tokens[:, :-1]).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def train_step(graphdef, mesh=None, *, learning_rate: float):
  """One jitted plain-SGD step: `step(params, tokens) -> (new params, loss before the step)`.

  Args:
    graphdef: the `nnx.split(model)` graph definition of a `TinyLM`.
    mesh: a `make_mesh` mesh, or None for one device. With a mesh, tokens [B, T+1] split over
      "data" (B a multiple of its size), the layers' ops with heads over "model" (HV a multiple
      of its size); params come back replicated.
    learning_rate: the SGD step size.
  """
  def step(params, tokens):
    loss, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), tokens))(params)
    return jax.tree.map(lambda p, g: p - learning_rate * g, params, grads), loss

  if mesh is None:
    return jax.jit(step, donate_argnums=(0,))
  rep = replicated(mesh)
  return _traced_on(mesh, jax.jit(step, in_shardings=(rep, batch_sharding(mesh)),
                                  out_shardings=(rep, rep), donate_argnums=(0,)))


def cache_shardings(caches, mesh):
  """NamedShardings of a tuple of `GDPCache`: slots over "data", value heads over "model".

  The convolution inputs [S, W-1, C] and their ring [S, D, C] are split over slots only: their
  channels C are the q, k and v projections side by side, not blocks of heads. The replay ring's
  keys [S, R, H, K] are split over "model" where it divides H, as the sharded op splits them,
  else kept whole on every head shard.
  """
  slots = NamedSharding(mesh, P("data"))
  heads = NamedSharding(mesh, P("data", None, "model"))

  def ring(r):
    if r is None:
      return None
    keys = heads if r[0].shape[2] % mesh.shape["model"] == 0 else slots
    return (keys,) + tuple(None if x is None else heads for x in r[1:])

  def one(c):
    return gflax.GDPCache(
        NamedSharding(mesh, P("data", "model")), None if c.conv is None else slots,
        None if c.state_snapshots is None else heads,
        None if c.conv_snapshots is None else slots, ring(c.ring),
        None if c.conv_ring is None else slots)
  return tuple(one(c) for c in caches)


class ShardedEngine(em.Engine):
  """`examples.tiny_lm.Engine` with its caches and steps split over `mesh`.

  Same arguments as `Engine` after `mesh` (a `make_mesh` mesh), replay caches by default;
  num_slots must be a multiple of the size of "data" and the layers' HV of the size of
  "model". The steps trace with `layer_ops_on(mesh, bitwise=True)`: on the reference backend the
  generated tokens are the unsharded engine's and the caches equal its caches to a few float32
  ulp, bit for bit where XLA fuses both programs alike (tests/test_sharding.py); on the kernels
  the same tokens up to float32 rounding of the logits.
  """

  def __init__(self, model: em.TinyLM, mesh, *, drafter=em.bigram_drafter, **kwargs):
    super().__init__(model, drafter=drafter, **kwargs)
    self.mesh = mesh
    rep, rows = replicated(mesh), batch_sharding(mesh)
    caches = cache_shardings(self.caches, mesh)
    self.params = jax.device_put(self.params, rep)
    self.caches = jax.device_put(self.caches, caches)
    graphdef = self.graphdef
    self._prefill = _traced_on(mesh, jax.jit(
        lambda p, c, t, cu, s: em._prefill_step(graphdef, p, c, t, cu, s),
        in_shardings=(rep, caches, rep, rep, rep), out_shardings=(caches, rep),
        donate_argnums=(1,)), bitwise=True)
    # One decode row per slot: rows split over "data" like the slots they own (axis 1 of the
    # outputs stacked over the call's steps).
    steps = NamedSharding(mesh, P(None, "data"))
    self._decode = _traced_on(mesh, jax.jit(
        lambda p, c, cur, s, n: em._decode_steps(graphdef, drafter, self.steps_per_call, p, c,
                                                 cur, s, n),
        in_shardings=(rep, caches, rows, rows, rows), out_shardings=(caches, steps, steps, steps),
        donate_argnums=(1,)), bitwise=True)
