"""Data and tensor (head) parallelism on JAX's SPMD engine: the mechanism, not the layouts.

Parameters stay plain arrays (the tree equals flax.linen's); their layout comes from two tables:

  param_axes     parameter path pattern -> logical axes, one name per array dim. Each model
                 declares its own (`flax_mha.nn.PARAM_AXES` for the attention projections,
                 `flax_mha.models.transformer.PARAM_AXES`, `flax_mha.models.lm.PARAM_AXES`):
                 a model knows its parameter names, this module does not.
  LOGICAL_RULES  logical axis -> mesh axis ('data', 'model', 'seq') or None (replicated)

Megatron-style tensor parallelism, as the models declare it: the query/key/value kernels
[D, H, K] and the first FFN kernel [D, F] are split over their output (heads, mlp) on 'model'
(column-parallel), the `out` kernel [H, V, D] and the second FFN kernel [F, D] over their input
(row-parallel), so every head and every hidden unit lives on one device and XLA inserts one
all-reduce after each sublayer. The batch of activations is split over 'data'. `jit`
propagates these layouts through the step; no sharding constraint inside the modules is needed.

FSDP (ZeRO-3) on top: with an 'fsdp' mesh axis of size n > 1, each parameter (and, matched by
path suffix, each of its optimizer moments) is also split n ways along the dim with the largest
per-device size that n still divides (after the rules' split of that dim, if any), and the
batch is split over data x fsdp. Between steps a device holds 1/n of the state; `jit` gathers
each weight where the step uses it (GSPMD) and reduce-scatters its gradient. 'data' stays plain
replication (with fsdp: HSDP).

A parameter that matches no pattern is an error, never a silent replication: a model declares
what it replicates (norm scales) with None axes. A dim whose size the mesh axis does not divide
(e.g. G=1 key/value head on model=2, a vocab of 11) is replicated instead, so any config runs on
any mesh. Scalars (step counts) need no entry.
"""

from __future__ import annotations

import collections
import math
import re

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# Mesh axis names, defined here only: batch, fully sharded data parallelism (batch and state),
# tensor (heads / FFN width), sequence (sequence parallelism). flax_mha.parallel.seq_parallel
# imports them, so this module must not import flax. Outermost first: the slowest links carry
# 'data'.
DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
MODEL_AXIS = "model"
SEQ_AXIS = "seq"
MESH_AXES = (DATA_AXIS, FSDP_AXIS, MODEL_AXIS, SEQ_AXIS)

# A pattern table: (regex searched in 'a/b/c' parameter paths, logical axes); first match of the
# leaf's rank wins.
ParamAxes = tuple[tuple[str, tuple[str | None, ...]], ...]

# Logical axis -> mesh axis. Everything not listed is replicated.
LOGICAL_RULES: dict[str, str | None] = {
    "batch": DATA_AXIS,
    "heads": MODEL_AXIS,
    "mlp": MODEL_AXIS,
    "expert": MODEL_AXIS,  # a mixture's experts, X/n a device (expert parallelism)
}


def make_mesh(data: int = 1, model: int = 1, seq: int = 1, devices=None, *,
              fsdp: int = 1) -> Mesh:
  """A (data, fsdp, model, seq) mesh over the first data·fsdp·model·seq devices (default: all
  local ones)."""
  devices = jax.devices() if devices is None else devices
  n = data * fsdp * model * seq
  if min(data, fsdp, model, seq) < 1 or n > len(devices):
    raise ValueError(f"mesh data={data} x fsdp={fsdp} x model={model} x seq={seq} needs {n} "
                     f"devices, {len(devices)} available")
  return jax.make_mesh((data, fsdp, model, seq), MESH_AXES,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES),
                       devices=devices[:n])


def logical_axes(path: str, ndim: int, param_axes: ParamAxes) -> tuple[str | None, ...]:
  """The logical axes of the parameter at `path` ('encoder/layer_0/ffn/Dense_0/kernel').

  Works on any tree that holds parameters (a train state, optimizer moments): patterns match a
  path's suffix. Scalars (a step count) are replicated; any other leaf must match a pattern of
  its rank, or this raises a ValueError naming it.
  """
  if ndim == 0:
    return ()
  for pattern, axes in param_axes:
    if re.search(pattern, path) and len(axes) == ndim:
      return axes
  raise ValueError(
      f"parameter {path!r} (rank {ndim}) matches no pattern of the model's param_axes: declare "
      "its logical axes (None for a replicated dim) so that no parameter is replicated by "
      f"accident; patterns: {[pattern for pattern, _ in param_axes]}")


def spec_for(axes, shape, mesh: Mesh, rules=None) -> P:
  """PartitionSpec of logical `axes` under `rules`, replicating dims the mesh axis can't divide
  or already splits (a mixture's experts [X, D, F]: X over 'model' when it divides X, else F);
  then, on a mesh with fsdp > 1, the dim with the largest per-device size that fsdp still
  divides split over it as well (after the rules' axis, if any)."""
  rules = LOGICAL_RULES if rules is None else rules
  spec = []
  for name, size in zip(axes, shape):
    mesh_axis = rules.get(name) if name is not None else None
    if mesh_axis is not None and (size % mesh.shape[mesh_axis] or mesh_axis in spec):
      mesh_axis = None  # a mesh axis splits one dim: the first that it divides
    spec.append(mesh_axis)
  return P(*_with_fsdp(spec, shape, mesh))


def _with_fsdp(spec: list, shape, mesh: Mesh) -> list:
  """`spec` with FSDP_AXIS added to the dim of the largest per-device size that it divides
  (ties: the last); unchanged without an fsdp axis > 1 or such a dim."""
  fsdp = dict(mesh.shape).get(FSDP_AXIS, 1)
  split = [1 if axis is None else mesh.shape[axis] for axis in spec]
  local = [(size // n, i) for i, (size, n) in enumerate(zip(shape, split))
           if size % (n * fsdp) == 0]
  if fsdp > 1 and local:
    i = max(local)[1]
    spec[i] = FSDP_AXIS if spec[i] is None else (spec[i], FSDP_AXIS)
  return spec


def shardings_for(tree, mesh: Mesh, param_axes: ParamAxes, rules=None):
  """Pytree of `NamedSharding`s for the parameters in `tree` (params, a train state, ...) as
  `param_axes` (the model's table) and `rules` declare."""
  def one(path, leaf):
    shape = getattr(leaf, "shape", ())
    axes = logical_axes(path_str(path), len(shape), param_axes)
    return NamedSharding(mesh, spec_for(axes, shape, mesh, rules))
  return jax.tree_util.tree_map_with_path(one, tree)


def shard_params(params, mesh: Mesh, param_axes: ParamAxes, rules=None):
  """`params` (or any tree of parameter-shaped leaves: a train state) placed on `mesh`."""
  return jax.device_put(params, shardings_for(params, mesh, param_axes, rules))


def batch_axes(mesh: Mesh) -> str | tuple[str, ...]:
  """The mesh axes a batch is split over: 'data', and 'fsdp' too where its size is > 1."""
  if dict(mesh.shape).get(FSDP_AXIS, 1) > 1:
    return (LOGICAL_RULES["batch"], FSDP_AXIS)
  return LOGICAL_RULES["batch"]


def batch_sharding(mesh: Mesh, ndim: int = 1) -> NamedSharding:
  """Sharding of an array [B, ...] of rank `ndim`: the batch over `batch_axes(mesh)`, the rest
  replicated."""
  return NamedSharding(mesh, P(batch_axes(mesh), *(None,) * (ndim - 1)))


def shard_batch(batch, mesh: Mesh):
  """Every array [B, ...] in `batch` split over `batch_axes(mesh)` (B must be a multiple of
  their size)."""
  axes = batch_axes(mesh)
  size = math.prod(mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,)))
  def one(x):
    if x.shape[0] % size:
      raise ValueError(f"batch size {x.shape[0]} must be a multiple of mesh {axes}={size}")
    return jax.device_put(x, batch_sharding(mesh, x.ndim))
  return jax.tree_util.tree_map(one, batch)


def bytes_per_device(tree) -> dict:
  """{device: bytes of the shards of `tree`'s arrays that it holds} (addressable devices)."""
  held = collections.Counter()
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      held[shard.device] += shard.data.nbytes
  return dict(held)


def path_str(path) -> str:
  """'a/b/0/c' from a jax key path (dict keys, attributes, sequence indices)."""
  parts = []
  for entry in path:
    for attr in ("key", "name", "idx"):
      if hasattr(entry, attr):
        parts.append(str(getattr(entry, attr)))
        break
  return "/".join(parts)
