"""Run under XLA_FLAGS=--xla_force_host_platform_device_count=8
(tests/parallel/test_sharding_integration.py does).

Every layout (data, model, data x model) must give the unsharded loss and gradients for
MultiHeadAttention (MHA and GQA), the FFN, a small Transformer and a decoder with experts
(split over 'model': expert parallelism), with parameters, optimizer moments and the batch
really split as flax_mha.parallel.sharding declares; the Transformer's parameter specs are
also compared with a hand-written table. Prints one 'OK ...' per check.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from flax_mha import MultiHeadAttention, Transformer, TransformerConfig, sharding
from flax_mha.models import lm, transformer
from flax_mha.models.lm import DecoderLM
from flax_mha.models.lm_config import LMConfig, MoE
from flax_mha.models.transformer import FeedForward
from flax_mha.nn import PARAM_AXES as ATTENTION_AXES

LAYOUTS = {"data": dict(data=4), "model": dict(model=2), "data_x_model": dict(data=2, model=2)}
B, T, D, H = 4, 6, 10, 6  # H and F=14 split over model=2; D=10 stays whole
CONFIG = TransformerConfig(vocab_size=11, d_model=D, num_heads=2, d_ff=14, num_encoder_layers=1,
                           num_decoder_layers=1, dropout_rate=0.0, max_len=16)
TRANSFORMER_GQA = CONFIG.replace(num_heads=4, num_kv_heads=2, d_model=12)

# Every parameter of `Transformer(TRANSFORMER_GQA)` and its spec on data=2 x model=2, written out
# by hand from the Megatron layout (docs/scale_out.md), not computed from transformer.PARAM_AXES: a renamed
# module that silently fell back to replicated, or a new parameter, fails check_pinned_specs.
TRANSFORMER_SPECS = {
    "embed/embedding": P(None, None),  # vocab 11 is not a logical axis with a rule
    "encoder/layer_0/attention_block/norm/bias": P(None),
    "encoder/layer_0/attention_block/norm/scale": P(None),
    "encoder/layer_0/self_attention/query/kernel": P(None, "model", None),  # [D, H, K]
    "encoder/layer_0/self_attention/query/bias": P("model", None),
    "encoder/layer_0/self_attention/key/kernel": P(None, "model", None),  # G=2 splits over model=2
    "encoder/layer_0/self_attention/key/bias": P("model", None),
    "encoder/layer_0/self_attention/value/kernel": P(None, "model", None),
    "encoder/layer_0/self_attention/value/bias": P("model", None),
    "encoder/layer_0/self_attention/out/kernel": P("model", None, None),  # [H, V, D]
    "encoder/layer_0/self_attention/out/bias": P(None),
    "encoder/layer_0/ffn_block/norm/bias": P(None),
    "encoder/layer_0/ffn_block/norm/scale": P(None),
    "encoder/layer_0/ffn/Dense_0/kernel": P(None, "model"),
    "encoder/layer_0/ffn/Dense_0/bias": P("model"),
    "encoder/layer_0/ffn/Dense_1/kernel": P("model", None),
    "encoder/layer_0/ffn/Dense_1/bias": P(None),
    "decoder/layer_0/self_attention_block/norm/bias": P(None),
    "decoder/layer_0/self_attention_block/norm/scale": P(None),
    "decoder/layer_0/self_attention/query/kernel": P(None, "model", None),
    "decoder/layer_0/self_attention/query/bias": P("model", None),
    "decoder/layer_0/self_attention/key/kernel": P(None, "model", None),
    "decoder/layer_0/self_attention/key/bias": P("model", None),
    "decoder/layer_0/self_attention/value/kernel": P(None, "model", None),
    "decoder/layer_0/self_attention/value/bias": P("model", None),
    "decoder/layer_0/self_attention/out/kernel": P("model", None, None),
    "decoder/layer_0/self_attention/out/bias": P(None),
    "decoder/layer_0/cross_attention_block/norm/bias": P(None),
    "decoder/layer_0/cross_attention_block/norm/scale": P(None),
    "decoder/layer_0/cross_attention/query/kernel": P(None, "model", None),
    "decoder/layer_0/cross_attention/query/bias": P("model", None),
    "decoder/layer_0/cross_attention/key/kernel": P(None, "model", None),
    "decoder/layer_0/cross_attention/key/bias": P("model", None),
    "decoder/layer_0/cross_attention/value/kernel": P(None, "model", None),
    "decoder/layer_0/cross_attention/value/bias": P("model", None),
    "decoder/layer_0/cross_attention/out/kernel": P("model", None, None),
    "decoder/layer_0/cross_attention/out/bias": P(None),
    "decoder/layer_0/ffn_block/norm/bias": P(None),
    "decoder/layer_0/ffn_block/norm/scale": P(None),
    "decoder/layer_0/ffn/Dense_0/kernel": P(None, "model"),
    "decoder/layer_0/ffn/Dense_0/bias": P("model"),
    "decoder/layer_0/ffn/Dense_1/kernel": P("model", None),
    "decoder/layer_0/ffn/Dense_1/bias": P(None),
}


def loss_and_grads(model, params, *inputs):
  def loss(p):
    out = model.apply({"params": p}, *inputs)
    return jnp.mean(jnp.sin(out.astype(jnp.float32)) * jnp.arange(out.shape[-1]))
  return jax.jit(jax.value_and_grad(loss))(params)


def check_model(name, model, param_axes, *inputs, layouts=tuple(LAYOUTS), pinned=None):
  """Loss and grads on each layout equal the unsharded ones, parameters placed by the model's
  `param_axes`; `pinned`: {path: spec} on data_x_model."""
  params = jax.jit(model.init)(jax.random.key(0), *inputs)["params"]
  want_loss, want_grads = loss_and_grads(model, params, *inputs)
  for layout in layouts:
    mesh = sharding.make_mesh(**LAYOUTS[layout])
    sharded = sharding.shard_params(params, mesh, param_axes)
    batch = sharding.shard_batch(inputs, mesh)
    got_loss, got_grads = loss_and_grads(model, sharded, *batch)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 got_grads, want_grads)
    check_layout(sharded, mesh, param_axes)
    if pinned is not None and layout == "data_x_model":
      check_pinned_specs(name, sharded, mesh, pinned)
    assert batch[0].sharding.spec[0] == "data", batch[0].sharding.spec
    assert batch[0].addressable_shards[0].data.shape[0] == B // mesh.shape["data"]
    print(f"OK {name} {layout} loss={float(got_loss):.6f}")


def check_layout(tree, mesh, param_axes):
  """Each leaf's spec follows param_axes / LOGICAL_RULES and its per-device shard matches it.

  The expected spec comes from the same tables that placed the leaf, so this checks consistency
  only; check_pinned_specs and check_declared_specs hold the literal expectations."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    path = sharding.path_str(path)
    want = sharding.spec_for(sharding.logical_axes(path, leaf.ndim, param_axes), leaf.shape,
                             mesh)
    assert leaf.sharding.spec == want, (path, leaf.sharding.spec, want)
    check_shard_shape(path, leaf, want, mesh)


def check_shard_shape(path, leaf, spec, mesh):
  local = tuple(d // mesh.shape[a] if a else d for d, a in zip(leaf.shape, spec))
  assert leaf.addressable_shards[0].data.shape == local, (path, local)


def check_pinned_specs(name, params, mesh, want_specs):
  """The placed params have exactly the paths of `want_specs`, each with its literal spec."""
  leaves = {"/".join(entry.key for entry in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  assert leaves.keys() == want_specs.keys(), sorted(leaves.keys() ^ want_specs.keys())
  for path, want in want_specs.items():
    assert leaves[path].sharding.spec == want, (path, leaves[path].sharding.spec, want)
    check_shard_shape(path, leaves[path], want, mesh)
  print(f"OK {name} pinned specs ({len(want_specs)} parameters)")


def check_declared_specs():
  """The table itself: column-parallel in, row-parallel out, GQA's G=1 replicated."""
  mesh = sharding.make_mesh(data=2, model=2)
  model = MultiHeadAttention(num_heads=4, num_kv_heads=1, qkv_features=8)
  params = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((2, 3, 8)))["params"]
  specs = jax.tree.map(lambda s: s.spec, sharding.shardings_for(params, mesh, ATTENTION_AXES))
  assert specs["query"]["kernel"] == P(None, "model", None), specs["query"]
  assert specs["key"]["kernel"] == P(None, None, None), specs["key"]  # G=1: can't split
  assert specs["out"]["kernel"] == P("model", None, None), specs["out"]
  assert specs["out"]["bias"] == P(None), specs["out"]
  print("OK declared specs")


def check_train_state():
  """Adam moments follow their parameters; the step count is replicated."""
  mesh = sharding.make_mesh(data=2, model=2)
  model = MultiHeadAttention(num_heads=H, qkv_features=12)
  params = jax.jit(model.init)(jax.random.key(0), jnp.ones((B, T, D)))["params"]
  state = {"params": params, "opt_state": optax.adam(1e-3).init(params)}
  sharded = sharding.shard_params(state, mesh, ATTENTION_AXES)
  check_layout(sharded, mesh, ATTENTION_AXES)
  mu = sharded["opt_state"][0].mu
  assert mu["query"]["kernel"].sharding.spec == P(None, "model", None)
  assert sharded["opt_state"][0].count.sharding.spec == P()
  print("OK train state")


def check_experts():
  """A decoder with experts (expert parallelism): X=4 experts split 2 ways over 'model' (each
  device holds 2 whole experts), the unsharded loss and gradients; X=3, which 'model' cannot
  split, falls back to splitting each expert's width F."""
  moe_config = LMConfig(vocab_size=11, d_model=8, num_heads=2, num_kv_heads=2, num_layers=1,
                        d_ff=12, local_window=None, mlp="swiglu", moe=MoE(4, 2, 6))
  tokens = jax.random.randint(jax.random.key(4), (B, T), 0, 11)
  check_model("experts", DecoderLM(moe_config), lm.PARAM_AXES, tokens,
              layouts=("data_x_model",))
  mesh = sharding.make_mesh(data=2, model=2)
  for experts, want in ((4, P("model", None, None)), (3, P(None, None, "model"))):
    config = dataclasses.replace(moe_config, moe=MoE(experts, 2, 6))
    params = jax.eval_shape(DecoderLM(config).init, jax.random.key(0), tokens)["params"]
    specs = sharding.shardings_for(params, mesh, lm.PARAM_AXES)["block_0"]["moe"]
    assert specs["gate"].spec == want and specs["up"].spec == want, (experts, specs["gate"])
    assert specs["down"].spec == P(want[0], want[2], None), (experts, specs["down"])
  print("OK experts specs")


def main():
  assert jax.device_count() == 8, jax.device_count()
  x = jax.random.normal(jax.random.key(1), (B, T, D))
  check_declared_specs()
  check_train_state()
  check_model("mha", MultiHeadAttention(num_heads=H, qkv_features=12), ATTENTION_AXES, x)
  check_model("gqa", MultiHeadAttention(num_heads=H, num_kv_heads=2, qkv_features=12),
              ATTENTION_AXES, x, layouts=("data_x_model",))
  check_model("ffn", FeedForward(CONFIG), transformer.PARAM_AXES, x)
  src = jax.random.randint(jax.random.key(2), (B, 7), 0, 11)
  tgt = jax.random.randint(jax.random.key(3), (B, T), 0, 11)
  # One layout for the whole model (each compile is seconds): data x model covers both splits.
  check_model("transformer_gqa", Transformer(TRANSFORMER_GQA), transformer.PARAM_AXES, src, tgt,
              layouts=("data_x_model",), pinned=TRANSFORMER_SPECS)
  check_experts()


if __name__ == "__main__":
  main()
