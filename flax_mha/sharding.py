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

A parameter that matches no pattern is an error, never a silent replication: a model declares
what it replicates (norm scales) with None axes. A dim whose size the mesh axis does not divide
(e.g. G=1 key/value head on model=2, a vocab of 11) is replicated instead, so any config runs on
any mesh. Scalars (step counts) need no entry.
"""

from __future__ import annotations

import re

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# Mesh axis names, defined here only: batch, tensor (heads / FFN width), sequence (sequence
# parallelism). flax_mha.kernels.seq_parallel imports them, so this module must not import flax.
DATA_AXIS = "data"
MODEL_AXIS = "model"
SEQ_AXIS = "seq"
MESH_AXES = (DATA_AXIS, MODEL_AXIS, SEQ_AXIS)

# A pattern table: (regex searched in 'a/b/c' parameter paths, logical axes); first match of the
# leaf's rank wins.
ParamAxes = tuple[tuple[str, tuple[str | None, ...]], ...]

# Logical axis -> mesh axis. Everything not listed is replicated.
LOGICAL_RULES: dict[str, str | None] = {
    "batch": DATA_AXIS,
    "heads": MODEL_AXIS,
    "mlp": MODEL_AXIS,
}


def make_mesh(data: int = 1, model: int = 1, seq: int = 1, devices=None) -> Mesh:
  """A (data, model, seq) mesh over the first data·model·seq devices (default: all local ones)."""
  devices = jax.devices() if devices is None else devices
  n = data * model * seq
  if min(data, model, seq) < 1 or n > len(devices):
    raise ValueError(f"mesh data={data} x model={model} x seq={seq} needs {n} devices, "
                     f"{len(devices)} available")
  return jax.make_mesh((data, model, seq), MESH_AXES,
                       axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=devices[:n])


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
  """PartitionSpec of logical `axes` under `rules`, replicating dims the mesh axis can't divide."""
  rules = LOGICAL_RULES if rules is None else rules
  spec = []
  for name, size in zip(axes, shape):
    mesh_axis = rules.get(name) if name is not None else None
    if mesh_axis is not None and size % mesh.shape[mesh_axis]:
      mesh_axis = None
    spec.append(mesh_axis)
  return P(*spec)


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


def batch_sharding(mesh: Mesh, ndim: int = 1) -> NamedSharding:
  """Sharding of an array [B, ...] of rank `ndim`: the batch over 'data', the rest replicated."""
  return NamedSharding(mesh, P(LOGICAL_RULES["batch"], *(None,) * (ndim - 1)))


def shard_batch(batch, mesh: Mesh):
  """Every array [B, ...] in `batch` split over 'data' (B must be a multiple of its size)."""
  data = mesh.shape[LOGICAL_RULES["batch"]]
  def one(x):
    if x.shape[0] % data:
      raise ValueError(f"batch size {x.shape[0]} must be a multiple of mesh data={data}")
    return jax.device_put(x, batch_sharding(mesh, x.ndim))
  return jax.tree_util.tree_map(one, batch)


def path_str(path) -> str:
  """'a/b/0/c' from a jax key path (dict keys, attributes, sequence indices)."""
  parts = []
  for entry in path:
    for attr in ("key", "name", "idx"):
      if hasattr(entry, attr):
        parts.append(str(getattr(entry, attr)))
        break
  return "/".join(parts)
