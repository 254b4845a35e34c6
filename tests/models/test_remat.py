"""flax_mha.remat and the models' `remat`: each policy recomputes (a `checkpoint` in the
program) and gives the values and gradients of remat="none" on the same parameters."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_mha
from flax_mha import remat
from flax_mha.models.lm import DecoderLM, LMConfig
from flax_mha.models.transformer import Transformer, TransformerConfig
from conftest import qkv

VOCAB, B, L = 13, 3, 10


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


@pytest.mark.integration  # a whole model end to end: seconds of compiles
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


@pytest.mark.parametrize("implementation", [None, "xla", "chunked"])
def test_remat_implementation_equals_the_plain_call(rng, implementation):
  """The pure API: values and gradients of q, k, v and the sinks, causal with segment ids."""
  q, k, v = qkv(rng, s=5)  # T == S: one segment id array serves both sides
  segments = jnp.asarray(np.sort(rng.integers(0, 3, q.shape[:2]), axis=-1))
  sinks = jnp.asarray(rng.standard_normal(q.shape[-2]), jnp.float32)

  def run(impl):
    def loss(q, k, v, sinks):
      out = flax_mha.dot_product_attention(q, k, v, is_causal=True, q_segment_ids=segments,
                                           kv_segment_ids=segments, sinks=sinks,
                                           implementation=impl)
      return jnp.sum(jnp.sin(out))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, sinks)

  (got, got_grads), (want, want_grads) = run(remat.remat_implementation(implementation)), run(
      implementation)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got_grads, want_grads):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("make, value, error, message", [
    (lambda r: TransformerConfig(vocab_size=VOCAB, remat=r), "all", ValueError,
     "TransformerConfig.remat must be one of ['none', 'layer', 'attention'], got 'all'"),
    (lambda r: LMConfig(vocab_size=VOCAB, remat=r), True, TypeError,
     "LMConfig.remat must be a string, one of ['none', 'layer', 'attention'], got bool"),
    (remat.remat_implementation, "flash", ValueError, "implementation must be None, a callable"),
])
def test_bad_remat_values_raise_naming_the_argument(make, value, error, message):
  with pytest.raises(error, match=message.replace("[", r"\[").replace("]", r"\]")):
    make(value)


def test_policy_helpers_apply_only_their_own_policy():
  """The one reading of `remat` both models use (values: the test above)."""
  assert remat.attention_implementation("none", "xla") == "xla"
  assert remat.attention_implementation("layer", "xla") == "xla"
  assert remat.attention_implementation("attention", "xla").__name__ == "remat_xla"
  assert remat.layer_class("none", DecoderLM, (1,)) is DecoderLM
  assert remat.layer_class("attention", DecoderLM, (1,)) is DecoderLM
  assert remat.layer_class("layer", DecoderLM, (1,)) is not DecoderLM
