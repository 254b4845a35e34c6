"""flax_mha.models.transformer: shapes, masks, causality, cache equivalence, variants, bad configs."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import flax_mha
from flax_mha.models.transformer import Transformer, TransformerConfig, sinusoidal_positions

VOCAB, B, S, T = 13, 3, 7, 5


def make(**overrides):
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


def test_logits_shape_and_finite():
  cfg, variables = make()
  src, tgt = batch()
  logits = jax.jit(Transformer(cfg).apply)(variables, src, tgt)
  chex.assert_shape(logits, (B, T, VOCAB))
  chex.assert_tree_all_finite(logits)


def test_sinusoids_match_the_paper():
  table = sinusoidal_positions(10, 8)
  pos, i = 7, 3
  np.testing.assert_allclose(table[pos, 2 * i], np.sin(pos / 10000 ** (2 * i / 8)), rtol=1e-6)
  np.testing.assert_allclose(table[pos, 2 * i + 1], np.cos(pos / 10000 ** (2 * i / 8)), rtol=1e-6)


def test_padding_content_is_ignored():
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


@pytest.mark.parametrize("overrides", [{}, {"pre_layer_norm": True, "learned_positions": True},
                                       {"num_kv_heads": 1}])
def test_cached_decoding_equals_full_recompute(overrides):
  cfg, variables = make(**overrides)
  src, tgt = batch()
  tgt = tgt.at[2, 3:].set(4)  # no padding in the teacher-forced prefix
  model = Transformer(cfg)
  full = model.apply(variables, src, tgt)
  memory, src_valid = model.apply(variables, src, method=Transformer.encode)
  dec = Transformer(cfg.replace(decode=True))
  cache = dec.init(jax.random.key(0), tgt, memory, src_valid, method=Transformer.decode)["cache"]
  steps = []
  for t in range(T):
    logits, mutated = dec.apply({"params": variables["params"], "cache": cache}, tgt[:, t:t + 1],
                                memory, src_valid, method=Transformer.decode, mutable=["cache"])
    cache = mutated["cache"]
    steps.append(logits)
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=1e-5)


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


def test_overfits_copy_task():
  cfg = TransformerConfig(vocab_size=VOCAB, d_model=32, num_heads=2, d_ff=64, dropout_rate=0.0,
                          num_encoder_layers=1, num_decoder_layers=1, max_len=16)
  rng = np.random.default_rng(1)
  ys = rng.integers(3, VOCAB, (32, 6))
  src = jnp.asarray(ys, jnp.int32)
  tgt_in = jnp.asarray(np.concatenate([np.ones((32, 1)), ys], 1), jnp.int32)
  tgt_out = jnp.asarray(np.concatenate([ys, np.full((32, 1), 2)], 1), jnp.int32)
  model = Transformer(cfg)
  params = model.init(jax.random.key(0), src, tgt_in)["params"]
  opt = optax.adam(3e-3)
  state = opt.init(params)

  @jax.jit
  def step(params, state):
    def loss_fn(p):
      logits = model.apply({"params": p}, src, tgt_in)
      return optax.softmax_cross_entropy_with_integer_labels(logits, tgt_out).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, state = opt.update(grads, state)
    return optax.apply_updates(params, updates), state, loss

  first = None
  for _ in range(150):
    params, state, loss = step(params, state)
    first = loss if first is None else first
  assert float(loss) < 0.1 * float(first)


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


def test_callable_attention_implementation():
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


def test_bad_tokens_and_lengths():
  cfg, variables = make()
  src, tgt = batch()
  model = Transformer(cfg)
  with pytest.raises(ValueError, match="src must be integer tokens"):
    model.apply(variables, src.astype(jnp.float32), tgt)
  with pytest.raises(TypeError, match="tgt_in must be an integer array .*got list"):
    model.apply(variables, src, tgt.tolist())
  with pytest.raises(ValueError, match="exceeds TransformerConfig.max_len=16"):
    model.apply(variables, jnp.ones((B, 17), jnp.int32), tgt)
