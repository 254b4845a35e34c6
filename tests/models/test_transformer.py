"""flax_mha.models.transformer: logits against a NumPy forward, masks, causality, dropout,
variants, bad configs. Cached decoding and training are in
tests/models/test_transformer_integration.py."""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_mha
from flax_mha.models.transformer import Transformer, TransformerConfig, sinusoidal_positions
from helpers import np_layer_norm, np_mha, randn

VOCAB, B, S, T = 13, 3, 7, 5


@functools.lru_cache
def make(**overrides):
  """(config, variables) of the small model with `overrides`, made once per overrides."""
  fields = dict(vocab_size=VOCAB, d_model=32, num_heads=2, d_ff=48, dropout_rate=0.0, max_len=16)
  cfg = TransformerConfig(**{**fields, **overrides})
  src, tgt = batch()
  variables = Transformer(cfg).init(jax.random.key(0), src, tgt)
  return cfg, variables


def batch():
  rng = np.random.default_rng(0)
  src = rng.integers(3, VOCAB, (B, S))
  src[1, 4:] = 0  # padding
  tgt = rng.integers(3, VOCAB, (B, T))
  tgt[:, 0] = 1  # bos
  tgt[2, 3:] = 0
  return jnp.asarray(src, jnp.int32), jnp.asarray(tgt, jnp.int32)


def np_transformer(cfg, params, src, tgt_in):
  """The Transformer's logits [B, T, C] in float64 NumPy, from its params and the paper: embeddings
  scaled by sqrt(D) plus positions, post-LN (or pre-LN with a final norm) residual blocks of
  attention (tests/helpers.py's np_mha) and a ReLU FFN, logits by the shared embedding (or a
  dense layer)."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  d = cfg.d_model
  norm = lambda x, q: np_layer_norm(x, q["scale"], q["bias"])

  def positions(stack, length):
    if cfg.learned_positions:
      return stack["positions"]["pos_embedding"][:length]
    angle = np.arange(length)[:, None] / 10000 ** (np.arange(0, d, 2) / d)  # [L, D/2]
    return np.stack([np.sin(angle), np.cos(angle)], axis=-1).reshape(length, d)  # interleaved

  def residual(x, block, sublayer):
    if cfg.pre_layer_norm:
      return x + sublayer(norm(x, block["norm"]))
    return norm(x + sublayer(x), block["norm"])

  def ffn(x, q):
    hidden = np.maximum(x @ q["Dense_0"]["kernel"] + q["Dense_0"]["bias"], 0.0)
    return hidden @ q["Dense_1"]["kernel"] + q["Dense_1"]["bias"]

  def stack(name, tokens, embed, layer, num_layers):
    x = embed[tokens] * np.sqrt(d) + positions(p[name], tokens.shape[1])
    for i in range(num_layers):
      x = layer(x, p[name][f"layer_{i}"])
    return norm(x, p[name]["final_norm"]) if cfg.pre_layer_norm else x

  src, tgt_in = np.asarray(src), np.asarray(tgt_in)
  src_embed = p["embed" if cfg.share_embeddings else "src_embed"]["embedding"]
  tgt_embed = p["embed" if cfg.share_embeddings else "tgt_embed"]["embedding"]
  src_valid = src != cfg.pad_id
  self_mask = (src_valid[:, :, None] & src_valid[:, None, :])[:, None]  # [B, 1, S, S]
  cross_mask = src_valid[:, None, None, :]  # [B, 1, 1, S]
  tgt_mask = (tgt_in != cfg.pad_id)[:, None, None, :]  # [B, 1, 1, T], with causality

  def encoder_layer(x, q):
    x = residual(x, q["attention_block"], lambda y: np_mha(q["self_attention"], y, mask=self_mask))
    return residual(x, q["ffn_block"], lambda y: ffn(y, q["ffn"]))

  memory = stack("encoder", src, src_embed, encoder_layer, cfg.num_encoder_layers)

  def decoder_layer(x, q):
    x = residual(x, q["self_attention_block"], lambda y: np_mha(
        q["self_attention"], y, mask=tgt_mask, is_causal=True))
    x = residual(x, q["cross_attention_block"], lambda y: np_mha(
        q["cross_attention"], y, memory, mask=cross_mask))
    return residual(x, q["ffn_block"], lambda y: ffn(y, q["ffn"]))

  x = stack("decoder", tgt_in, tgt_embed, decoder_layer, cfg.num_decoder_layers)
  if cfg.share_embeddings:
    return x @ tgt_embed.T
  return x @ p["logits"]["kernel"] + p["logits"]["bias"]


@pytest.mark.parametrize("overrides", [
    {}, dict(pre_layer_norm=True, learned_positions=True, share_embeddings=False, num_kv_heads=1)])
def test_logits_equal_a_numpy_forward(overrides):
  """Post-LN with sinusoids and shared embeddings (the paper), and pre-LN with learned positions,
  an output layer and MQA: every parameter perturbed (norms and biases too) so each one counts."""
  cfg, variables = make(**overrides)
  rng = np.random.default_rng(2)
  params = jax.tree.map(lambda a: a + 0.1 * randn(rng, *a.shape), variables["params"])
  src, tgt = batch()
  logits = Transformer(cfg).apply({"params": params}, src, tgt)
  chex.assert_shape(logits, (B, T, VOCAB))
  chex.assert_tree_all_finite(logits)
  np.testing.assert_allclose(logits, np_transformer(cfg, params, src, tgt), atol=1e-4, rtol=1e-4)


def test_sinusoids_match_the_paper():
  table = sinusoidal_positions(10, 8)
  pos, i = 7, 3
  np.testing.assert_allclose(table[pos, 2 * i], np.sin(pos / 10000 ** (2 * i / 8)), rtol=1e-6)
  np.testing.assert_allclose(table[pos, 2 * i + 1], np.cos(pos / 10000 ** (2 * i / 8)), rtol=1e-6)


def check_padding_content_is_ignored():
  cfg, variables = make()
  src, tgt = batch()
  model = Transformer(cfg)
  base = model.apply(variables, src, tgt)
  longer = jnp.pad(src, ((0, 0), (0, 3)))  # more padding
  np.testing.assert_allclose(model.apply(variables, longer, tgt), base, atol=1e-5)
  # Target pad positions are never seen by real queries.
  tgt2 = tgt.at[2, 4].set(0)
  np.testing.assert_allclose(model.apply(variables, src, tgt2)[2, :3], base[2, :3], atol=1e-5)


def test_decoder_is_causal():
  cfg, variables = make()
  src, tgt = batch()
  model = Transformer(cfg)
  base = model.apply(variables, src, tgt)
  changed = model.apply(variables, src, tgt.at[:, 3].set(5))
  np.testing.assert_allclose(changed[:, :3], base[:, :3], atol=1e-6)
  assert not np.allclose(changed[:, 3:], base[:, 3:])


def test_dropout_only_in_training_and_deterministic():
  cfg, variables = make(dropout_rate=0.3)
  src, tgt = batch()
  model = Transformer(cfg)
  eval_a = model.apply(variables, src, tgt)
  np.testing.assert_array_equal(eval_a, model.apply(variables, src, tgt, train=False))
  train = lambda k: model.apply(variables, src, tgt, train=True,
                                rngs={"dropout": jax.random.key(k)})
  np.testing.assert_array_equal(train(1), train(1))
  assert not np.allclose(train(1), train(2))
  assert not np.allclose(train(1), eval_a)


def test_shared_embeddings_are_one_parameter():
  cfg, variables = make()
  params = variables["params"]
  assert "embed" in params and "logits" not in params
  assert params["embed"]["embedding"].shape == (VOCAB, 32)
  _, untied = make(share_embeddings=False)
  assert {"src_embed", "tgt_embed", "logits"} <= set(untied["params"])


def test_sown_attention_weights():
  cfg, variables = make()
  src, tgt = batch()
  _, state = Transformer(cfg).apply(variables, src, tgt, sow_weights=True,
                                    mutable=["intermediates"])
  inter = state["intermediates"]
  (cross,) = inter["decoder"]["layer_1"]["cross_attention"]["attention_weights"]
  chex.assert_shape(cross, (B, 2, T, S))
  np.testing.assert_allclose(cross.sum(-1), 1.0, atol=1e-5)
  assert float(cross[1, :, :, 4:].max()) == 0.0  # source padding gets no weight
  (enc,) = inter["encoder"]["layer_0"]["self_attention"]["attention_weights"]
  chex.assert_shape(enc, (B, 2, S, S))


def test_matches_a_flax_linen_attention_model():
  """Swapping in flax.linen's attention (same params) gives the same logits."""

  class LinenAttention(nn.MultiHeadDotProductAttention):
    def __init__(self, *, num_kv_heads, implementation, **kwargs):
      super().__init__(**kwargs)

    def __call__(self, x, kv=None, *, mask=None, is_causal=False, deterministic=True,
                 sow_weights=False):
      if is_causal:
        causal = jnp.tril(jnp.ones((x.shape[-2], x.shape[-2]), bool))
        mask = causal if mask is None else mask & causal
      return super().__call__(x, kv, mask=mask, deterministic=deterministic)

  cfg, variables = make()
  src, tgt = batch()
  ours = Transformer(cfg).apply(variables, src, tgt)
  theirs = Transformer(cfg.replace(attention_cls=LinenAttention)).apply(variables, src, tgt)
  np.testing.assert_allclose(ours, theirs, atol=1e-5)


@pytest.mark.parametrize("field, value, match", [
    ("d_model", 31, "d_model=31 must be divisible by num_heads=2"),
    ("num_kv_heads", 3,
     "TransformerConfig.num_heads=2 must be a multiple of TransformerConfig.num_kv_heads=3"),
    ("num_kv_heads", 0, "TransformerConfig.num_kv_heads must be a positive int, got 0"),
    ("num_heads", 0, "TransformerConfig.num_heads must be a positive int, got 0"),
    ("attention_dropout_rate", -0.1,
     r"TransformerConfig.attention_dropout_rate must be a finite number in \[0, 1\), got -0.1"),
    ("dropout_rate", 1.0, r"TransformerConfig.dropout_rate must be a finite number in \[0, 1\)"),
    ("eos_id", 99, "eos_id=99 must be in"),
    ("num_encoder_layers", 0, "num_encoder_layers must be a positive int"),
])
def test_bad_config(field, value, match):
  with pytest.raises(ValueError, match=match):
    TransformerConfig(**{**dict(vocab_size=VOCAB, d_model=32, num_heads=2), field: value})


def check_callable_attention_implementation():
  """A callable attention_implementation is passed through to every attention layer."""
  calls = []

  def spy(*args, **kwargs):
    calls.append(1)
    return flax_mha.IMPLEMENTATIONS["reference"](*args, **kwargs)

  cfg, variables = make()
  src, tgt = batch()
  want = Transformer(cfg).apply(variables, src, tgt)
  got = Transformer(cfg.replace(attention_implementation=spy)).apply(variables, src, tgt)
  assert len(calls) == 2 + 2 * 2  # encoder self; decoder self and cross, two layers each
  np.testing.assert_allclose(got, want, atol=1e-5)


def check_bad_tokens_and_lengths():
  cfg, variables = make()
  src, tgt = batch()
  model = Transformer(cfg)
  with pytest.raises(ValueError, match="src must be integer tokens"):
    model.apply(variables, src.astype(jnp.float32), tgt)
  with pytest.raises(TypeError, match="tgt_in must be an integer array .*got list"):
    model.apply(variables, src, tgt.tolist())
  with pytest.raises(ValueError, match="exceeds TransformerConfig.max_len=16"):
    model.apply(variables, jnp.ones((B, 17), jnp.int32), tgt)
