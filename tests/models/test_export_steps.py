"""A decoding step shipped with `jax.export`: `DecoderLM.logits` over a contiguous and a paged
KV cache, exported for cpu, cuda and tpu at once, serialized, deserialized and run here equals
the eager step, and keeps the cache's capacity check (an overflowing row comes back NaN)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_mha import cache as cache_lib
from flax_mha.models.lm import DecoderLM, LMConfig

CONFIG = LMConfig(vocab_size=13, d_model=16, num_heads=4, num_kv_heads=2, num_layers=2, d_ff=32,
                  local_window=None)
B, CAPACITY, PAGE = 2, 8, 4
pytestmark = pytest.mark.integration  # lowering for three platforms: ~10 s a case


def _model_and_caches(paged: bool):
  lm = DecoderLM(CONFIG)
  tokens = jnp.ones((B, 3), jnp.int32)
  params = lm.init(jax.random.key(0), tokens)
  if paged:
    caches = lm.apply(params, B, 2 * B, PAGE, CAPACITY // PAGE,
                      method=DecoderLM.init_paged_cache)
    table = jnp.arange(2 * B, dtype=jnp.int32).reshape(B, CAPACITY // PAGE)
    caches = tuple(dataclasses.replace(c, page_indices=table)
                   if isinstance(c, cache_lib.PagedKVCache) else c for c in caches)
  else:
    caches = lm.apply(params, tokens, CAPACITY, method=DecoderLM.init_cache)
  return lm, params, caches


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_a_decode_step_exports_serializes_and_runs(paged):
  lm, params, caches = _model_and_caches(paged)
  step = jax.jit(lambda p, t, c: lm.apply(p, t, c, method=DecoderLM.logits))
  prompt = jax.random.randint(jax.random.key(1), (B, 3), 0, CONFIG.vocab_size)
  _, caches = step(params, prompt, caches)  # a prefill, then the step that is shipped
  token = jnp.array([[4], [7]], jnp.int32)
  exported = jax.export.export(step, platforms=("cpu", "cuda", "tpu"))(params, token, caches)
  shipped = jax.export.deserialize(exported.serialize())
  got_logits, got_caches = shipped.call(params, token, caches)
  want_logits, want_caches = lm.apply(params, token, caches, method=DecoderLM.logits)
  np.testing.assert_allclose(got_logits, want_logits, atol=1e-6, rtol=1e-6)
  assert jax.tree.structure(got_caches) == jax.tree.structure(want_caches)
  for got, want in zip(jax.tree.leaves(got_caches), jax.tree.leaves(want_caches)):
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)
  # The capacity check travels with it: row 1 written past its capacity comes back NaN.
  full = got_caches
  for _ in range(CAPACITY - 4):
    _, full = shipped.call(params, token, full)
  logits, _ = shipped.call(params, token, full)
  assert np.isnan(logits).all()


def test_exported_steps_without_the_check_inside_room_made_by_caller():
  """A decoding loop that sizes its caches exports inside room_made_by_caller(): no overflow
  check in the program (a position past the end is simply not written, the outputs finite)."""
  lm, params, caches = _model_and_caches(False)
  step = jax.jit(lambda p, t, c: lm.apply(p, t, c, method=DecoderLM.logits))
  prompt = jnp.ones((B, CAPACITY), jnp.int32)
  _, full = step(params, prompt, caches)
  token = jnp.ones((B, 1), jnp.int32)
  ship = lambda: jax.export.deserialize(
      jax.export.export(step, platforms=("cpu",))(params, token, full).serialize())
  with cache_lib.room_made_by_caller():
    unchecked = ship()
  assert np.isfinite(unchecked.call(params, token, full)[0]).all()
  assert np.isnan(ship().call(params, token, full)[0]).all()
