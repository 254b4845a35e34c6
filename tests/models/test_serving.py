"""Continuous batching as one compiled program (flax_mha.models.serving.serve): the loop on the
device with no host callback, chunked prefill, pages handed out and back on the device, and the
same tokens as `decoding.generate` and static batching."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_params
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


def _generated(model, params, prompt, limit, **kwargs):
  """`decoding.generate`'s tokens for one prompt alone, cut after a stop token."""
  tokens = np.asarray(decoding.generate(model, params, (prompt[None],), prompt[None],
                                        max_new_tokens=limit, **kwargs))[0]
  stop = kwargs.get("stop_tokens", ())
  hits = [i for i, t in enumerate(tokens) if t in stop]
  return tokens[:hits[0] + 1 if hits else limit].tolist()


@pytest.mark.integration  # a model compiled several times: ~20 s
def test_chunked_prefill_serves_what_generate_gives():
  """Prompts up to 50 tokens fed in pieces of at most 16 (and 4-token pages) between decode
  steps, 5 requests through 2 rows: each request's tokens equal generating it alone."""
  model, params = _lm()
  prompts, limits = _requests()
  served, stats = serving.serve(model, params, prompts, limits, batch_size=2, page_size=4,
                                num_pages=2 * 15, prefill_chunk=16)
  want = [_generated(model, params, p, n) for p, n in zip(prompts, limits)]
  assert served == want
  assert len({t for row in want for t in row}) > 3  # the tokens vary: the check means something
  assert stats.new_tokens == sum(limits) and 0 < stats.peak_pages <= 30
  assert stats.peak_tokens <= stats.peak_tokens_in_pages <= 4 * stats.peak_pages


@pytest.mark.integration
def test_stop_tokens_and_pages_given_back_for_the_next_requests():
  """A stop token ends a request early; 7 requests through 2 rows in a pool of exactly 2 rows'
  pages can only all finish right if every finished row puts its pages back."""
  model, params = _lm()
  prompts, limits = _requests(1, (5, 30, 12, 30, 7, 26, 3), (8, 8, 8, 8, 8, 8, 8))
  first = _generated(model, params, prompts[0], 8)
  stop = (first[2],)
  served, _ = serving.serve(model, params, prompts, limits, batch_size=2, page_size=4,
                            num_pages=2 * 10, prefill_chunk=16, stop_tokens=stop)
  want = [_generated(model, params, p, n, stop_tokens=stop) for p, n in zip(prompts, limits)]
  assert served == want and served[0][-1] == stop[0] and len(served[0]) <= 3
  static, _ = serving.serve_static(model, params, prompts, limits, batch_size=2,
                                   stop_tokens=stop)
  assert served == static


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
