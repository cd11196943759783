"""The gdp_jax ops on a device mesh: value heads and batch split across devices, no collectives.

`sharded(op, mesh, batch_axis=..., head_axis=...)` returns `op` with its own signature, running
under `jax.shard_map`: every device runs the op (Triton kernels, interpreter or reference) on its
own block of value heads and/or sequences, and nothing is communicated, because the recurrence
never mixes heads or sequences. The compiled program has no all-gather, all-to-all,
collective-permute or all-reduce.

Layout (P = shards of the mesh axis):

* head_axis splits value heads HV (P | HV), in contiguous blocks of HV / P, everywhere they occur:
  v, g, beta, o, initial_state, final state, the cache, intermediate_states, chunk_states, and
  the replay ring's v, g and beta. Value head hv reads key head hv // (HV // H), so q, k and the
  ring's keys are split over H too when P | H; otherwise (H < P, e.g. H = 1) they are replicated
  over head_axis and each device picks its own key heads locally.
* batch_axis splits sequences: B of the prefill and the decode step, N of Gated Delta Product
  decode, `accept_draft_tokens` and `commit_replay`. A state cache is then split over slots S
  along the same axis (P | S), and its snapshots and replay ring with it: device i owns slots
  [i S/P, (i+1) S/P). `state_indices` stay global, the same array as without sharding, but
  request n of batch shard i must use a slot that device i owns; a slot owned by another device
  is treated like -1 (no read, no write, output 0), since reaching it would need communication.
  A serving loop keeps this by allocating each data shard's requests slots from its own range.
  Packed sequences (cu_seqlens, B == 1) cannot be split over batch.
* K, V, the token axis T and the ring's rows R are never split: inputs sharded over them are
  rejected with a ValueError naming the dimension to replicate, rather than resharded behind
  the caller's back. The check sees concrete arrays, and traced ones on meshes with Explicit
  axes (the default of `jax.make_mesh` since jax 0.9); on Auto axes under jit the layout is not
  visible at trace time and XLA moves data to the wrapper's layout by itself (`in_shardings`
  gives that layout).

Training: `jax.grad` / `jax.vjp` through a sharded `chunk_gated_delta_product` differentiate
per shard. shard_map's transpose runs the op's `jax.custom_vjp` (the backward kernels, or jax.grad
of the reference) on each device's own block, and every gradient comes back split like its
input, with no collective: the recurrence's gradient does not mix heads or sequences either,
and dq, dk sum only over the value heads of a key head, which sit on one device when P | H. The
two exceptions are sums the math asks for: with fewer key heads than head shards (q and k
replicated), dq and dk add up the parts of the shards that share a key head (one all-reduce); and
an input replicated over a mesh axis the wrapper does not split (heads only on a 2-D mesh) is
processed whole on every device of that axis, so its gradient sums over it (an all-reduce of
equal halves; build the wrapper from the axes you split over). The model's own reduction of its
parameter gradients over the batch shards happens outside the op.

Why shard_map and not `jax.experimental.custom_partitioning`: shard_map is public, stable API
in jax 0.8 to 0.11 and under Shardy, its layout is fixed at trace time, so bad layouts become
ValueErrors before compilation, and the per-device body is the plain op, Triton custom calls and
interpreter callbacks included. custom_partitioning would run Python partition callbacks during
XLA compilation (errors surface as compile failures), needs Shardy sharding rules written as
strings for every argument combination, and its rules cannot express "replicate key heads when
H < P, then pick them locally".
"""
from __future__ import annotations

import functools
import inspect
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from gdp_jax import _checks
from gdp_jax.decode import _push_ring

__all__ = ["sharded"]

# Dimension roles: "b" batch (B or N), "t" tokens or rows, "r" replay ring rows, "hk" query/key
# heads H, "h" value heads HV, "k" K, "v" V, "s" cache slots S, "n" cu_seqlens entries.
_ROLE_NAMES = {"b": "B", "t": "T", "r": "R", "hk": "H", "h": "HV", "k": "K", "v": "V", "s": "S",
               "n": "N+1"}
_ARG_ROLES = {
    "q": ("b", "t", "hk", "k"),
    "k": ("b", "t", "hk", "k"),
    "v": ("b", "t", "h", "v"),
    "g": ("b", "t", "h"),
    "beta": ("b", "t", "h"),
    "initial_state": ("b", "h", "k", "v"),
    "cu_seqlens": ("n",),
    "state": ("s", "h", "k", "v"),
    "state_indices": ("b",),
    "intermediate_states": ("s", "t", "h", "k", "v"),
    "num_accepted": ("b",),
}
# The replay ring's four arrays (k, v, g, beta) travel as arguments of their own, named as the
# ops' messages name them; the ring is a per-slot companion of the cache and splits like it.
_RING_PARTS = _checks.RING_NAMES
_ARG_ROLES.update(zip(_RING_PARTS, (("s", "r", "hk", "k"), ("s", "r", "h", "v"), ("s", "r", "h"),
                                    ("s", "r", "h"))))
_CACHE = ("s", "h", "k", "v")
# The ops on a cache alone: their batch is num_accepted's N, their value heads the state's HV.
_CACHE_OPS = ("accept", "commit")


def _kinds():
  """Maps each supported op (public entry points and their reference twins) to its kind."""
  import gdp_jax
  from gdp_jax import reference
  return {
      gdp_jax.fused_recurrent_gated_delta_rule: "recurrent",
      gdp_jax.chunk_gated_delta_product: "prefill",
      gdp_jax.gated_delta_product_decode: "gdp_decode",
      gdp_jax.accept_draft_tokens: "accept",
      gdp_jax.commit_replay: "commit",
      reference.fused_recurrent_gated_delta_rule: "recurrent",
      reference.chunk_gated_delta_product: "prefill",
      reference.chunk_gated_delta_product_chunked: "prefill",
      reference.gated_delta_product_decode: "gdp_decode",
      reference.accept_draft_tokens: "accept",
      reference.commit_replay: "commit",
  }


def _out_roles(kind, a):
  """Roles of the op's outputs, in the op's output structure (None where it returns None)."""
  if kind in _CACHE_OPS:
    return _CACHE
  o = ("b", "t", "h", "v")
  if a.get("state") is not None:
    final = _CACHE
  elif a.get("output_final_state"):
    final = ("b", "h", "k", "v")
  else:
    final = None
  roles = [o, final]
  if kind in ("recurrent", "gdp_decode") and a.get("intermediate_states") is not None:
    roles.append(("s", "t", "h", "k", "v"))
  if kind in ("recurrent", "gdp_decode") and _RING_PARTS[0] in a:
    roles.append(tuple(None if a.get(n) is None else _roles_of(n, a[n]) for n in _RING_PARTS))
  if kind == "prefill" and a.get("return_chunk_states"):
    roles.append(("t", "h", "k", "v") if a.get("cu_seqlens") is not None
                 else ("b", "t", "h", "k", "v"))
  return tuple(roles)


def _roles_of(name, x):
  roles = _ARG_ROLES[name]
  # Element-wise beta has V last.
  return roles + ("v",) if name in ("beta", _RING_PARTS[3]) and x.ndim == 4 else roles


def _is_roles(x):
  return isinstance(x, tuple) and bool(x) and isinstance(x[0], str)


def _axes(axis):
  if axis is None:
    return ()
  return (axis,) if isinstance(axis, str) else tuple(axis)


def _entry(axes):
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else axes


def _is_array(x):
  # Arrays, tracers, and ShapeDtypeStructs (for in_shardings).
  return hasattr(x, "shape") and hasattr(x, "dtype")


def _visible_spec(x, mesh):
  """The PartitionSpec x is known to have on `mesh`'s axes, or None when it is not visible."""
  if isinstance(x, jax.core.Tracer):
    sharding = jax.typeof(x).sharding
  else:
    sharding = getattr(x, "sharding", None)
  if not isinstance(sharding, NamedSharding):
    return None
  if tuple(sharding.mesh.axis_names) != tuple(mesh.axis_names):
    return None
  spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
  return [_axes(e) for e in spec]


class _Plan:
  """The layout of one call: specs of the array arguments and outputs, and the local fix-ups."""

  def __init__(self, kind, a, mesh, batch_axes, head_axes):
    self.kind = kind
    self.mesh = mesh
    self.batch_axes = batch_axes
    self.head_axes = head_axes
    self.pb = math.prod(mesh.shape[x] for x in batch_axes)
    self.ph = math.prod(mesh.shape[x] for x in head_axes)
    batch_name = "B" if kind in ("recurrent", "prefill") else "N"
    self.names = dict(_ROLE_NAMES, b=batch_name)
    self._check_divisible(kind, a)

  def _check_divisible(self, kind, a):
    batch, heads = _entry(self.batch_axes), _entry(self.head_axes)
    if self.batch_axes:
      if a.get("cu_seqlens") is not None:
        raise ValueError(
            f"cu_seqlens: packed sequences (B == 1) cannot be split over batch_axis={batch!r}; "
            "use head_axis only (batch_axis=None), or give each batch shard its own pack")
      lead = "num_accepted" if kind in _CACHE_OPS else "v"
      n = a[lead].shape[0]
      if n % self.pb:
        raise ValueError(
            f"{lead}: {self.names['b']} = {n} is not divisible by the {self.pb} shards of "
            f"batch_axis={batch!r}; pad the batch with -1 slots to a multiple of {self.pb}")
      for name in ("state", "intermediate_states"):
        x = a.get(name)
        if x is not None and x.shape[0] % self.pb:
          raise ValueError(
              f"{name}: S = {x.shape[0]} cache slots are not divisible by the {self.pb} shards "
              f"of batch_axis={batch!r} (the cache is split over slots along the batch axis)")
      if (a.get("state") is None and a.get("intermediate_states") is not None
          and a["intermediate_states"].shape[0] != n):
        raise ValueError(
            "intermediate_states: without state, sequence n uses slot n, which under "
            f"batch_axis={batch!r} needs S == B = {n}, got S = "
            f"{a['intermediate_states'].shape[0]}; pass state and state_indices instead")
    self.key_mode = "shard"
    if self.head_axes:
      by_state = kind in _CACHE_OPS
      hv_arg = "state" if by_state else "v"
      HV = a[hv_arg].shape[1 if by_state else 2]
      if HV % self.ph:
        raise ValueError(
            f"{hv_arg}: HV = {HV} value heads are not divisible by the {self.ph} shards of "
            f"head_axis={heads!r}")
      if kind != "accept":
        H = a[_RING_PARTS[0] if kind == "commit" else "q"].shape[2]
        self.H, self.HV = H, HV
        if H % self.ph:
          # A shard's HV / P value heads need key heads of their groups only; with fewer key
          # heads than shards they are replicated and each shard takes its own locally.
          self.key_mode = "slice" if self.ph % H == 0 else "take"

  def axes_of(self, role):
    if role in ("b", "s"):
      return self.batch_axes
    if role == "h" or (role == "hk" and self.key_mode == "shard"):
      return self.head_axes
    return ()

  def spec(self, roles):
    return PartitionSpec(*[_entry(self.axes_of(r)) for r in roles])

  def check_layout(self, name, x):
    """Rejects inputs already split over dimensions (or axes) that the wrapper keeps whole."""
    seen = _visible_spec(x, self.mesh)
    if seen is None:
      return
    for d, (role, have) in enumerate(zip(_roles_of(name, x), seen)):
      want = self.axes_of(role)
      # Going from fewer to more shards along the same axes is a local slice; anything else
      # would move data between devices.
      if not have or tuple(have) == tuple(want[:len(have)]):
        continue
      dim = self.names[role]
      axes = _entry(tuple(have))
      if role in ("t", "r", "k", "v", "n"):
        why, alt = f"the sharded ops never split {dim}", ""
      elif role == "hk" and self.key_mode != "shard":
        why = (f"H = {self.H} key heads are not split over the {self.ph} shards of "
               f"head_axis={_entry(self.head_axes)!r}: they stay replicated")
        alt = ""
      elif role in ("b", "s"):
        why = f"this wrapper has batch_axis={_entry(self.batch_axes)!r}"
        alt = f", or build the wrapper with batch_axis={axes!r}"
      else:
        why = f"this wrapper has head_axis={_entry(self.head_axes)!r}"
        alt = f", or build the wrapper with head_axis={axes!r}"
      raise ValueError(
          f"{name}: dimension {d} ({dim}) is sharded over mesh axis {axes!r}, but {why}; place "
          f"{name} as NamedSharding(mesh, {self.spec(_roles_of(name, x))}) (see "
          f"in_shardings){alt}")


def _reshard_explicit(x, spec, mesh):
  """Puts x into `spec` on the Explicit axes of `mesh`; shard_map checks those against in_specs.

  Only ever slices (replicated -> split): `check_layout` rejected every other move.
  """
  explicit = {n for n, t in zip(mesh.axis_names, mesh.axis_types)
              if t == jax.sharding.AxisType.Explicit}
  if not explicit:
    return x
  entries = []
  for e in spec:
    kept = tuple(a for a in _axes(e) if a in explicit)
    entries.append(_entry(kept))
  return jax.sharding.reshard(x, NamedSharding(mesh, PartitionSpec(*entries)))


def _shard_map(f, mesh, in_specs, out_specs):
  # Varying-axis typing stays off: the references' lax.scan carries start from constants and
  # fail it (carry type float32[...] vs float32[...]{V:(data,model)}), jax_triton's custom call
  # has no rule for it, and nothing is lost: every output varies over exactly the axes its
  # out_spec names.
  if hasattr(jax, "shard_map"):
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
  from jax.experimental.shard_map import shard_map
  return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def sharded(op, mesh, *, batch_axis=None, head_axis=None):
  """Returns `op` running on `mesh` with value heads and/or batch split, without communication.

  Call the result exactly like `op` (same signature, same outputs), inside or outside jax.jit,
  and differentiate it like `op` (jax.grad of the prefill runs its backward on each device).
  Each device runs `op` on its own block of value heads and sequences; see the module docstring
  for the layout and for when a gradient needs a collective. Outputs come back split the same
  way (o over batch and heads, the cache, its snapshots and its replay ring over slots and
  heads), so a jitted decode loop keeps everything in place; donate the cache (`donate_argnums`)
  and it stays in the same buffers.

  Args:
    op: one of `gdp_jax.fused_recurrent_gated_delta_rule`, `gdp_jax.chunk_gated_delta_product`,
      `gdp_jax.gated_delta_product_decode`, `gdp_jax.accept_draft_tokens`,
      `gdp_jax.commit_replay`, or their twins in `gdp_jax.reference`.
    mesh: a `jax.sharding.Mesh` (Auto or Explicit axes).
    batch_axis: mesh axis name (or tuple of names) to split sequences over: B ([B, T, ...]
      inputs), N (decode with draft tokens, accept, commit), and the cache's slots S; None keeps
      the batch whole on every device. Not with cu_seqlens.
    head_axis: mesh axis name (or tuple of names) to split value heads HV over (and key heads H
      when they divide evenly, else replicated); None keeps heads whole.

  Returns:
    A function with `op`'s signature. Its attribute `in_shardings(*args, **kwargs)` (same
    signature) gives the NamedSharding of each array argument of such a call, for
    `jax.device_put` or `jax.jit(in_shardings=...)`; for `replay_ring` a tuple like the ring
    (None where the ring has None).

  Raises:
    ValueError: (when the result is called) for sizes that the shards do not divide (HV, B or N,
      S), cu_seqlens with batch_axis, or an input sharded over a dimension the ops keep whole
      (T, K, V) or over other axes than the wrapper's; and every ValueError of `op`, with the
      global shapes.
  """
  kinds = _kinds()
  if op not in kinds:
    raise ValueError(f"op: expected one of the gdp_jax entry points or their reference twins, "
                     f"got {getattr(op, '__name__', op)!r}")
  kind = kinds[op]
  batch_axes, head_axes = _axes(batch_axis), _axes(head_axis)
  for arg, axes in (("batch_axis", batch_axes), ("head_axis", head_axes)):
    for x in axes:
      if x not in mesh.axis_names:
        raise ValueError(f"{arg}: {x!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
  if set(batch_axes) & set(head_axes):
    raise ValueError(f"batch_axis={batch_axis!r} and head_axis={head_axis!r} share mesh axes")
  sig = inspect.signature(op)

  def prepare(args, kwargs):
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    a = dict(bound.arguments)
    # A ring of another form stays whole, for the op's own check to reject.
    ring = a.get("replay_ring")
    if isinstance(ring, (tuple, list)) and len(ring) == 4:
      del a["replay_ring"]
      a.update(zip(_RING_PARTS, ring))
    arrays = [n for n, x in a.items() if n in _ARG_ROLES and _is_array(x)]
    static = {n: x for n, x in a.items() if n not in arrays}

    def invoke(named):
      kw = {**static, **named}
      if _RING_PARTS[0] in kw:
        kw["replay_ring"] = tuple(kw.pop(n) for n in _RING_PARTS)
      return op(**kw)

    # The op's own checks first, on global shapes, so its messages name the sizes the caller
    # passed; the output structure tells which outputs are None.
    out_struct = jax.eval_shape(
        lambda *xs: invoke(dict(zip(arrays, xs))),
        *[jax.ShapeDtypeStruct(a[n].shape, a[n].dtype) for n in arrays])
    plan = _Plan(kind, a, mesh, batch_axes, head_axes)
    return a, arrays, invoke, plan, out_struct

  @functools.wraps(op)
  def wrapper(*args, **kwargs):
    a, arrays, invoke, plan, out_struct = prepare(args, kwargs)
    roles = _out_roles(kind, a)
    skeleton = lambda tree, is_leaf=None: jax.tree.structure(
        jax.tree.map(lambda _: 0, tree, is_leaf=is_leaf))
    if skeleton(roles, _is_roles) != skeleton(out_struct):
      raise RuntimeError(f"gdp_jax.sharding: unexpected outputs of {op.__name__}: {out_struct}")

    for n in arrays:
      plan.check_layout(n, a[n])
    in_specs = tuple(plan.spec(_roles_of(n, a[n])) for n in arrays)
    xs = [_reshard_explicit(a[n], s, mesh) for n, s in zip(arrays, in_specs)]
    out_specs = tuple(plan.spec(r) for r in jax.tree.leaves(roles, is_leaf=_is_roles))

    def local(*xs):
      la = dict(zip(arrays, xs))
      whole = dict(la)
      if plan.key_mode != "shard":
        la.update(_local_key_heads(la, plan))
      if plan.batch_axes and la.get("state") is not None:
        la["state_indices"] = _local_slots(la, plan)
      res = invoke(la)
      if plan.key_mode != "shard" and kind != "commit" and _RING_PARTS[0] in la:
        # The new ring's keys stay whole on every head shard, like the ring's: each shard
        # pushes the step's whole k, where the op pushed only its own key heads.
        k_ring = _push_ring((whole[_RING_PARTS[0]],), la.get("state_indices"), (whole["k"],))
        res = res[:-1] + (k_ring + tuple(res[-1][1:]),)
      return tuple(jax.tree.leaves(res))

    res = _shard_map(local, mesh, in_specs, out_specs)(*xs)
    return jax.tree.unflatten(jax.tree.structure(out_struct), res)

  def in_shardings(*args, **kwargs):
    a, arrays, _, plan, _ = prepare(args, kwargs)
    out = {n: NamedSharding(mesh, plan.spec(_roles_of(n, a[n]))) for n in arrays}
    if _RING_PARTS[0] in a:
      out["replay_ring"] = tuple(out.pop(n, None) for n in _RING_PARTS)
    return out

  wrapper.__signature__ = sig
  in_shardings.__signature__ = sig
  in_shardings.__doc__ = "NamedSharding of each array argument of this call, by argument name."
  wrapper.in_shardings = in_shardings
  return wrapper


def _local_key_heads(la, plan):
  """q, k and the ring's keys of this shard's key heads, when H is not split (fewer key heads
  than shards)."""
  j = jax.lax.axis_index(plan.head_axes)
  HV_l = plan.HV // plan.ph
  G = plan.HV // plan.H
  out = {}
  for name in ("q", "k", _RING_PARTS[0]):
    if name not in la:
      continue
    x = la[name]
    if plan.key_mode == "slice":
      # HV / P divides the group size G: all of this shard's value heads read one key head.
      out[name] = jax.lax.dynamic_slice_in_dim(x, (j * HV_l) // G, 1, axis=2)
    else:
      # Value heads of this shard straddle groups: give each its own key head (local H = HV / P).
      out[name] = jnp.take(x, (j * HV_l + jnp.arange(HV_l)) // G, axis=2)
  return out


def _local_slots(la, plan):
  """Global slots of this batch shard's requests, as indices into its own block of the cache."""
  i = jax.lax.axis_index(plan.batch_axes)
  S_l = la["state"].shape[0]
  glob = la.get("state_indices")
  if glob is None:
    n_l = (la["num_accepted"] if plan.kind in _CACHE_OPS else la["v"]).shape[0]
    glob = i * n_l + jnp.arange(n_l, dtype=jnp.int32)
  loc = glob.astype(jnp.int32) - i * S_l
  # A slot owned by another shard would need communication: it becomes padding here.
  return jnp.where((glob >= 0) & (loc >= 0) & (loc < S_l), loc, -1).astype(jnp.int32)
