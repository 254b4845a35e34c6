"""The models' `remat`, end to end: each policy recomputes (a `checkpoint` in the program) and
gives the values and gradients of remat="none" on the same parameters, for the Transformer and
the LM. flax_mha.remat's pure API and the config checks are the unit part,
tests/models/test_remat.py."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_mha.models.lm import DecoderLM, LMConfig
from flax_mha.models.transformer import Transformer, TransformerConfig
from test_remat import VOCAB, B, L

pytestmark = pytest.mark.integration  # whole models end to end: seconds of compiles


def transformer_case(policy):
  """Dropout on embeddings, sublayers and attention weights: recomputed with the same keys."""
  cfg = TransformerConfig(vocab_size=VOCAB, d_model=16, num_heads=2, num_kv_heads=1, d_ff=24,
                          num_encoder_layers=1, num_decoder_layers=1, dropout_rate=0.1,
                          attention_dropout_rate=0.1, max_len=16, remat=policy)
  rng = np.random.default_rng(0)
  src = rng.integers(3, VOCAB, (B, L - 3))
  src[1, 4:] = 0  # padding
  tgt = rng.integers(3, VOCAB, (B, L))
  return Transformer(cfg), tuple(jnp.asarray(x, jnp.int32) for x in (src, tgt))


def lm_case(policy):
  """Packed documents, a local and a global layer, soft cap (the sinks' gradient through the
  checkpoint's closure: test_remat_implementation_equals_the_plain_call)."""
  cfg = LMConfig(vocab_size=VOCAB, d_model=16, num_heads=2, num_kv_heads=1, num_layers=2,
                 d_ff=24, local_window=3, remat=policy)
  tokens = np.random.default_rng(1).integers(3, VOCAB, (B, L))
  segments = np.repeat([[1] * 6 + [2] * 3 + [0]], B, axis=0)
  positions = np.concatenate([np.arange(6), np.arange(3), [0]])[None].repeat(B, axis=0)
  return DecoderLM(cfg), tuple(jnp.asarray(x, jnp.int32) for x in (tokens, segments, positions))


CASES = {"transformer": transformer_case, "lm": lm_case}


@functools.lru_cache
def loss_and_grads(model_name, policy):
  """(the loss's jaxpr as text, loss, grads) in training mode, parameters from remat="none"'s
  init."""
  model, inputs = CASES[model_name](policy)
  params = CASES[model_name]("none")[0].init(jax.random.key(0), *inputs)["params"]

  def loss(params):
    logits = model.apply({"params": params}, *inputs, train=True,
                         rngs={"dropout": jax.random.key(1)})
    return jnp.mean(jnp.sin(logits) * jnp.arange(VOCAB))

  return str(jax.make_jaxpr(loss)(params)), *jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("model_name", sorted(CASES))
@pytest.mark.parametrize("policy", ["layer", "attention"])
def test_remat_gives_the_values_and_gradients_of_none(model_name, policy):
  jaxpr, loss, grads = loss_and_grads(model_name, policy)
  none_jaxpr, want_loss, want_grads = loss_and_grads(model_name, "none")
  recomputed = lambda text: len(re.findall(r"= (checkpoint|remat2?)\[", text))
  assert recomputed(jaxpr) > 0 and recomputed(none_jaxpr) == 0
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  assert jax.tree.structure(grads) == jax.tree.structure(want_grads)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
               grads, want_grads)
  assert any(np.abs(g).max() > 0 for g in jax.tree.leaves(grads))
