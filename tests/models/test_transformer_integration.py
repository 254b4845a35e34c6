"""flax_mha.models.transformer end to end: cached decoding equals a full recompute, and the model
overfits a copy task. The forward pass against NumPy, masks, causality, variants and bad configs
are the unit part, tests/models/test_transformer.py."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flax_mha.models.transformer import Transformer, TransformerConfig
from test_transformer import VOCAB, T, batch, make

import test_transformer as unit_cases

pytestmark = pytest.mark.integration  # a whole model end to end: seconds of compiles

# Cases of tests/models/test_transformer.py that compile for seconds: the unit part skips them
# (`check_` there), the integration part runs them here.
test_bad_tokens_and_lengths = (
    unit_cases.check_bad_tokens_and_lengths)


@pytest.mark.parametrize("overrides", [{}, {"pre_layer_norm": True, "learned_positions": True},
                                       {"num_kv_heads": 1}])
def test_cached_decoding_equals_full_recompute(overrides):
  cfg, variables = make(**overrides)
  src, tgt = batch()
  tgt = tgt.at[2, 3:].set(4)  # no padding in the teacher-forced prefix
  model = Transformer(cfg)
  full = model.apply(variables, src, tgt)
  cache = model.apply(variables, src, T, method=Transformer.init_cache)
  steps = []
  for t in range(T):
    logits, cache = model.apply(variables, tgt[:, t:t + 1], cache, method=Transformer.logits)
    steps.append(logits)
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=1e-5)
  # A prefix in one call, then steps, equals it too.
  cache = model.apply(variables, src, T, method=Transformer.init_cache)
  head, cache = model.apply(variables, tgt[:, :3], cache, method=Transformer.logits)
  tail, _ = model.apply(variables, tgt[:, 3:], cache, method=Transformer.logits)
  np.testing.assert_allclose(jnp.concatenate([head, tail], axis=1), full, atol=1e-5)


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


# Moved from the unit part for its time (9 s on the slower type).
test_padding_content_is_ignored = unit_cases.check_padding_content_is_ignored

# Moved from the unit part for its time (7.8 s on the slower type).
test_callable_attention_implementation = unit_cases.check_callable_attention_implementation
