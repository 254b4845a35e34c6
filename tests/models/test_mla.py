"""Multi-head latent attention (`flax_mha.models.mla`) in the decoder: the absorbed step over
a latent cache of every kind equals the expanded forward, in values and gradients; the caches
hold R + P and R a token; what a layer cannot take is refused by name.
DeepSeek's checkpoints against transformers, the NNX twin among them (logits: expanded;
greedy tokens: absorbed): tests/models/test_hf_integration.py.

Dimension key: B batch, L length, C vocabulary, R latent, P rotary features.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_mha import cache as cache_lib
from flax_mha.models import mla
from flax_mha.models.lm import DecoderLM
from flax_mha.models.lm_config import MLA, LMConfig
from flax_mha.rotary import Rope, YarnScaling

C, L, R, P = 50, 9, 16, 4
CONFIG = LMConfig(vocab_size=C, d_model=32, num_heads=4, num_kv_heads=4, num_layers=2,
                  d_ff=48, local_window=None, logit_soft_cap=None, mlp="swiglu",
                  norm=mla.LATENT_NORM, tie_embeddings=False, scale_embeddings=False,
                  scale_logits=False, attention_scale=0.3,
                  rope=Rope(scaling=YarnScaling(4.0, 8), interleaved=True),
                  mla=MLA(kv_rank=R, rope_dim=P, nope_dim=8, v_dim=6, q_rank=12))
TOKENS = jax.random.randint(jax.random.key(0), (2, L), 3, C)
LENGTHS = jnp.asarray([6, 4])  # prompts' lengths: row 1 padded


@pytest.fixture(scope="module")
def params():
  return DecoderLM(CONFIG).init(jax.random.key(1), TOKENS)


def _cached_logits(model, variables, caches):
  """Logits [B, L - 4 + 1, C]: each row's prompt prefilled (padding at position -1), then
  the rest of TOKENS teacher-forced one token a step, from each row's length on."""
  apply = (lambda *a: model.apply(variables, *a, method=DecoderLM.logits)) if variables else (
      model.logits)
  positions = jnp.where(jnp.arange(6) < LENGTHS[:, None], jnp.arange(6), -1)
  logits, caches = apply(TOKENS[:, :6], caches, positions)
  out = [jnp.take_along_axis(logits, (LENGTHS - 1)[:, None, None], axis=1)]
  for step in range(3):
    token = jnp.take_along_axis(TOKENS, (LENGTHS + step)[:, None], axis=1)
    logits, caches = apply(token, caches, (LENGTHS + step)[:, None])
    out.append(logits)
  return jnp.concatenate(out, axis=1)


def _expanded_logits(params):
  """The same positions' logits of the forward without a cache (the expanded path)."""
  full = DecoderLM(CONFIG).apply(params, TOKENS)
  index = (LENGTHS - 1)[:, None] + jnp.arange(4)
  return jnp.take_along_axis(full, index[..., None], axis=1)


def test_the_absorbed_step_over_a_full_latent_cache_equals_the_expanded_forward(params):
  check_the_absorbed_step_over_each_latent_cache_equals_the_expanded_forward(params, "full")


def check_the_absorbed_step_over_each_latent_cache_equals_the_expanded_forward(params, kind):
  """A padded prefill and three steps over a full cache, a paged one (rows' pages out of
  order) and an int8 one: the expanded forward's logits (int8: within 0.05, same argmax)."""
  model = DecoderLM(CONFIG)
  if kind == "paged":
    caches = model.apply(params, 2, 6, 4, 3, method=DecoderLM.init_paged_cache)
    table = jnp.asarray([[4, 1, 3], [0, 5, 2]], jnp.int32)
    caches = tuple(c.with_table(table) for c in caches)
    assert isinstance(caches[0], cache_lib.PagedKVCache)
  else:
    caches = model.apply(params, TOKENS, 12, jnp.int8 if kind == "int8" else None,
                         method=DecoderLM.init_cache)
  got = jax.jit(lambda c: _cached_logits(model, params, c))(caches)
  want = _expanded_logits(params)
  if kind == "int8":
    assert float(jnp.max(jnp.abs(got - want))) < 0.05
    np.testing.assert_array_equal(jnp.argmax(got, -1), jnp.argmax(want, -1))
  else:
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_the_caches_hold_one_latent_and_one_rotary_key_a_token(params):
  """(G, K, V) = (1, R + P, R) in every layer's cache, whatever the heads; plain attention's
  would be (G, K, K)."""
  caches = DecoderLM(CONFIG).apply(params, TOKENS, 12, method=DecoderLM.init_cache)
  for c in caches:
    assert c.key.shape == (2, 1, 12, R + P) and c.value.shape == (2, 1, 12, R)
  plain = dataclasses.replace(CONFIG, mla=None)
  assert plain.cache_dims == (4, 8, 8) and CONFIG.cache_dims == (1, R + P, R)


def test_gradients_through_the_absorbed_path_equal_the_expanded_ones(params):
  """A loss over a whole sequence prefilled into a cache (absorbed) and over the forward
  (expanded): the same gradients for every parameter, under jit."""
  model = DecoderLM(CONFIG)

  def absorbed(p):
    caches = model.apply(p, TOKENS, L, method=DecoderLM.init_cache)
    return jnp.sum(jnp.tanh(model.apply(p, TOKENS, caches, method=DecoderLM.logits)[0]))

  expanded = lambda p: jnp.sum(jnp.tanh(model.apply(p, TOKENS)))
  got, want = jax.jit(jax.grad(absorbed))(params), jax.jit(jax.grad(expanded))(params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-4, rtol=2e-4), got, want)
  grads = jax.tree.leaves(got["params"]["block_0"]["attention"])
  assert all(float(jnp.abs(g).max()) > 0 for g in grads)


def test_a_long_prefill_expands_a_full_latent_cache_as_the_forward(params):
  check_a_long_prefill_expands_each_latent_cache_as_the_forward(params, "full")


def check_a_long_prefill_expands_each_latent_cache_as_the_forward(params, kind):
  """40 prompt tokens (more than a step: the expanded path over the cache's slots), one row
  padded, then a step: the forward's logits at the prompt's last position and the next one
  (int8: within 0.05)."""
  model = DecoderLM(CONFIG)
  tokens = jax.random.randint(jax.random.key(5), (2, 41), 3, C)
  lengths = jnp.asarray([40, 33])
  if kind == "paged":
    caches = model.apply(params, 2, 12, 8, 6, method=DecoderLM.init_paged_cache)
    table = jnp.asarray([[7, 2, 9, 0, 4, 11], [5, 1, 10, 3, 8, 6]], jnp.int32)
    caches = tuple(c.with_table(table) for c in caches)
  else:
    caches = model.apply(params, tokens, 48, jnp.int8 if kind == "int8" else None,
                         method=DecoderLM.init_cache)

  @jax.jit
  def run(caches):
    positions = jnp.where(jnp.arange(40) < lengths[:, None], jnp.arange(40), -1)
    logits, caches = model.apply(params, tokens[:, :40], caches, positions,
                                 method=DecoderLM.logits)
    first = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)
    token = jnp.take_along_axis(tokens, lengths[:, None], axis=1)
    step, _ = model.apply(params, token, caches, lengths[:, None], method=DecoderLM.logits)
    return jnp.concatenate([first, step], axis=1)

  full = model.apply(params, tokens)
  want = jnp.take_along_axis(full, ((lengths - 1)[:, None] + jnp.arange(2))[..., None], axis=1)
  got = run(caches)
  if kind == "int8":
    assert float(jnp.max(jnp.abs(got - want))) < 0.05
  else:
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_explain_names_the_path_and_the_steps_kernel(params):
  caches = DecoderLM(CONFIG).apply(params, TOKENS, 12, method=DecoderLM.init_cache)
  told = mla.explain(CONFIG, caches[0], 1, platform="cpu")
  assert told.startswith("latent attention, absorbed: 4 query heads over one latent head "
                         f"(keys {R + P} = R + P, values {R} = R); "), told
  assert mla.explain(CONFIG, caches[0], 40).startswith(
      "latent attention, expanded: T = 40 tokens > FEW_QUERIES = 32, a prefill")


def test_what_a_latent_layer_cannot_take_is_refused_by_name(params):
  with pytest.raises(ValueError, match=r"LMConfig.mla \(latent attention\) takes global rotary "
                                       r"layers only, without \['local layers \(set "
                                       r"local_window=None\)'\]"):
    dataclasses.replace(CONFIG, local_window=4)
  with pytest.raises(ValueError, match=r"MLA.rope_dim must be even"):
    MLA(16, 3, 8, 6)
  plain = dataclasses.replace(CONFIG, mla=None)
  caches = DecoderLM(plain).init_cache(TOKENS, 12)
  with pytest.raises(ValueError, match=r"a latent attention layer's cache must hold \(heads, "
                                       r"key dim, value dim\) = \(1, 20, 16\) \(1, R \+ P, R\), "
                                       r"got \(4, 8, 8\)"):
    DecoderLM(CONFIG).apply(params, TOKENS[:, :1], caches, method=DecoderLM.logits)
