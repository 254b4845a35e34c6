"""Continuous batching as one compiled program (flax_mha.models.serving.serve): the loop on the
device with no host callback, compiled once per shapes; the prefill pieces; bad arguments named.
The tokens served, equal to `decoding.generate`'s and static batching's, are in
tests/models/test_serving_integration.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import random_params
from flax_mha.models import decoding, serving
from flax_mha.models.lm import DecoderLM, LMConfig

VOCAB = 17


def _lm():
  """A small LM with random weights whose greedy tokens vary (a global layer over pages, a local
  one with a rolling cache)."""
  model = DecoderLM(LMConfig(vocab_size=VOCAB, d_model=32, num_heads=4, num_kv_heads=2,
                             num_layers=2, d_ff=48, local_window=5, logit_soft_cap=5.0))
  x = jnp.zeros((1, 8), jnp.int32)
  return model, random_params(model, x, x, x, seed=3)


def _requests(seed=0, lengths=(3, 37, 20, 50, 9), limits=(6, 4, 9, 3, 7)):
  rng = np.random.default_rng(seed)
  return [rng.integers(1, VOCAB, n) for n in lengths], list(limits)


def test_the_loop_is_one_program_without_host_callbacks():
  """serve's loop is a lax.while_loop in one jitted program (no per-token callback), compiled
  once for calls of the same shapes."""
  model, params = _lm()
  prompts, limits = _requests(2, (4, 9), (3, 2))
  run = lambda: serving.serve(model, params, prompts, limits, batch_size=2, page_size=4,
                              num_pages=8, prefill_chunk=16)
  first, _ = run()
  compiled = serving._serve._cache_size()  # pylint: disable=protected-access
  assert run()[0] == first and serving._serve._cache_size() == compiled
  padded, lengths, limit_arr = serving._requests(prompts, limits, 16)
  plan = serving._Plan(model, decoding.Greedy(), (), 16, 4, 2, 8, 4, 4)
  jaxpr = str(jax.make_jaxpr(serving._serve.__wrapped__, static_argnums=0)(
      plan, params, padded, lengths, limit_arr, 2, jax.random.key(0)))
  assert "while" in jaxpr and "callback" not in jaxpr


def test_prefill_pieces_are_the_chunk_and_smaller_powers_of_4():
  assert serving._chunks(512) == (16, 64, 256, 512)
  assert serving._chunks(16) == (16,) and serving._chunks(8) == (8,)
  assert serving._chunks(100) == (16, 64, 100)


def test_bad_prefill_chunk_is_named():
  model, params = _lm()
  with pytest.raises(ValueError, match="prefill_chunk must be a positive int, got 0"):
    serving.serve(model, params, [[1, 2]], 2, batch_size=1, page_size=4, num_pages=4,
                  prefill_chunk=0)
