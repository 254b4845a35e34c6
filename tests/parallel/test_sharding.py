"""flax_mha.parallel.sharding's tables and checks on the single CPU device: the logical axes of every
parameter, the rules, the refusals by name. The layouts on 8 devices equal to the unsharded
model are in tests/parallel/test_sharding_integration.py.
"""

import inspect

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from flax_mha.parallel import sharding
from flax_mha.parallel.seq_parallel import ring_attention
from flax_mha.models import lm, transformer
from flax_mha.models.lm import DecoderLM, LMConfig
from flax_mha.models.transformer import Transformer, TransformerConfig


@pytest.mark.parametrize("path, ndim, axes", [
    ("encoder/layer_0/self_attention/query/kernel", 3, ("embed", "heads", "head_dim")),
    ("decoder/layer_1/cross_attention/out/kernel", 3, ("heads", "head_dim", "embed")),
    ("encoder/layer_0/ffn/Dense_0/kernel", 2, ("embed", "mlp")),
    ("encoder/layer_0/ffn/Dense_1/kernel", 2, ("mlp", "embed")),
    ("embed/embedding", 2, ("vocab", "embed")),
    ("encoder/layer_0/ffn_block/norm/scale", 1, ("embed",)),
    ("opt_state/0/mu/encoder/layer_0/self_attention/value/bias", 2, ("heads", "head_dim")),
    ("opt_state/0/count", 0, ()),
])
def test_logical_axes_of_the_transformer(path, ndim, axes):
  assert sharding.logical_axes(path, ndim, transformer.PARAM_AXES) == axes


@pytest.mark.parametrize("model", ["transformer", "lm"])
def test_every_parameter_of_each_model_is_declared(model):
  """Each model's table covers every parameter it has (an undeclared one would raise)."""
  if model == "transformer":
    module, axes = Transformer(TransformerConfig(vocab_size=11, num_kv_heads=2, d_model=16,
                                                 learned_positions=True,
                                                 share_embeddings=False)), transformer.PARAM_AXES
    args = (jnp.zeros((1, 5), jnp.int32),) * 2
  else:
    module = DecoderLM(LMConfig(vocab_size=11, d_model=16, normalize_qk=True))
    axes, args = lm.PARAM_AXES, (jnp.zeros((1, 5), jnp.int32),) * 3
  params = jax.eval_shape(lambda: module.init(jax.random.key(0), *args))["params"]
  mesh = jax.sharding.AbstractMesh((1, 1, 2, 1), sharding.MESH_AXES)
  specs = sharding.shardings_for(params, mesh, axes)
  kernels = [s.spec for p, s in jax.tree_util.tree_flatten_with_path(specs)[0]
             if sharding.path_str(p).endswith("kernel") and "logits" not in sharding.path_str(p)]
  assert kernels and all("model" in spec for spec in kernels), kernels  # every block's dense split


def test_an_undeclared_parameter_is_an_error_not_a_replication():
  params = {"block": {"mlp_in": {"kernel": jnp.zeros((4, 8))}}}
  with pytest.raises(ValueError, match=r"'block/mlp_in/kernel' \(rank 2\) matches no pattern"):
    sharding.shardings_for(params, sharding.make_mesh(), transformer.PARAM_AXES)
  assert sharding.shardings_for(params, sharding.make_mesh(), lm.PARAM_AXES)  # the LM's own


def test_single_device_mesh():
  """Size-1 mesh axes divide everything: the same specs, each array whole on the one device."""
  mesh = sharding.make_mesh()
  assert sharding.spec_for(("embed", "heads", "head_dim"), (4, 2, 3), mesh) == P(None, "model",
                                                                               None)
  x = sharding.shard_batch({"src": jax.numpy.ones((3, 5))}, mesh)["src"]
  assert x.sharding.spec == P("data", None) and x.addressable_shards[0].data.shape == (3, 5)


def test_make_mesh_rejects_too_many_devices():
  with pytest.raises(ValueError, match="needs 1024 devices"):
    sharding.make_mesh(data=1024)


def test_ring_attention_and_the_rules_name_the_mesh_axes_make_mesh_builds():
  """The mesh that make_mesh builds is the one the rules and ring attention look for: a batch
  lands on its data axis, ring attention's default axis is one of its axes."""
  mesh = sharding.make_mesh()
  assert sharding.batch_sharding(mesh).spec[0] in mesh.axis_names
  assert set(sharding.LOGICAL_RULES.values()) <= set(mesh.axis_names)
  default = inspect.signature(ring_attention).parameters["axis_name"].default
  assert default in mesh.axis_names


@pytest.mark.parametrize("axes, shape, want", [
    (("embed", "heads", "head_dim"), (32, 2, 16), P("fsdp", "model", None)),  # D, the largest
    (("embed", "heads", "head_dim"), (30, 4, 16), P(None, "model", "fsdp")),  # 4 splits 16 only
    (("heads", "head_dim", "embed"), (2, 8, 8), P("model", None, "fsdp")),  # a tie: the last
    (("vocab", "embed"), (11, 32), P(None, "fsdp")),
    (("embed",), (6,), P(None)),  # nothing fsdp divides: replicated
    (("mlp",), (64,), P(("model", "fsdp"))),  # 32 per model shard, split 4 ways again
    (("embed", "mlp"), (8, 64), P(None, ("model", "fsdp"))),  # 8 < 32 per model shard
])
def test_fsdp_splits_the_largest_dim_per_device(axes, shape, want):
  mesh = jax.sharding.AbstractMesh((2, 4, 2, 1), sharding.MESH_AXES)
  assert sharding.spec_for(axes, shape, mesh) == want


def test_fsdp_splits_the_batch_over_data_and_fsdp():
  mesh = jax.sharding.AbstractMesh((2, 4, 1, 1), sharding.MESH_AXES)
  assert sharding.batch_sharding(mesh, ndim=2).spec == P(("data", "fsdp"), None)
  assert sharding.batch_sharding(sharding.make_mesh(), ndim=2).spec == P("data", None)
