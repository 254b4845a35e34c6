"""Serving (flax_mha.serving.server): a run of the loop is one compiled program with no host
callback, compiled once per shapes; shared prefixes give the tokens of serving without sharing
and leave no page behind; the prefill pieces; bad arguments named. The tokens served against
`decoding.generate`'s and static batching's, online admission, streaming, cancellation and a
full pool are in tests/serving/test_serving_integration.py; the host's book of pages alone in
tests/serving/test_page_pool.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import random_params
from flax_mha import serving
from flax_mha.serving import loop as serving_loop
from flax_mha.models import decoding
from flax_mha.models.lm import DecoderLM, LMConfig

VOCAB = 17


def lm():
  """A small LM with random weights whose greedy tokens vary (a global layer over pages, a local
  one with a rolling cache)."""
  model = DecoderLM(LMConfig(vocab_size=VOCAB, d_model=32, num_heads=4, num_kv_heads=2,
                             num_layers=2, d_ff=48, local_window=5, logit_soft_cap=5.0))
  x = jnp.zeros((1, 8), jnp.int32)
  return model, random_params(model, x, x, x, seed=3)


def shared_requests(seed=0, lengths=(3, 37, 20, 50, 9), limits=(6, 4, 9, 3, 7)):
  rng = np.random.default_rng(seed)
  return [rng.integers(1, VOCAB, n) for n in lengths], list(limits)


def global_lm():
  """The same without local layers: every layer's cache in pages, so prefixes can be shared."""
  model = DecoderLM(LMConfig(vocab_size=VOCAB, d_model=32, num_heads=4, num_kv_heads=2,
                             num_layers=2, d_ff=48, local_window=None, logit_soft_cap=5.0))
  x = jnp.zeros((1, 8), jnp.int32)
  return model, random_params(model, x, x, x, seed=3)


def shared_prefix_requests(seed=0, tails=(5, 0, 9, 3, 0, 7), limits=(6, 5, 7, 4, 6, 5)):
  """Prompts of a 12-token prefix (3 pages of 4) and tails of `tails` tokens; two are the prefix
  alone (a whole-prompt match: copy-on-write of its last page)."""
  rng = np.random.default_rng(seed)
  prefix = rng.integers(1, VOCAB, 12)
  return [np.concatenate([prefix, rng.integers(1, VOCAB, n)]) for n in tails], list(limits)


def check_the_loop_is_one_program_without_host_callbacks():
  """A run of the loop is a lax.while_loop in one jitted program (no per-token callback),
  compiled once for servers of the same shapes; shared prefixes give the tokens of serving
  without sharing, and every page is back (free or a prefix entry nobody holds)."""
  model, params = global_lm()
  prompts, limits = shared_prefix_requests()
  run = lambda sharing: serving.serve(model, params, prompts, limits, batch_size=2, page_size=4,
                                      num_pages=24, prefill_chunk=16, prefix_caching=sharing)
  (shared, stats), (alone, _) = run(True), run(False)
  compiled = serving_loop.segment._cache_size()  # pylint: disable=protected-access
  assert shared == alone and stats.shared_tokens == 3 * 12 + 2 * 11  # two copied on write
  assert run(True)[0] == shared and serving_loop.segment._cache_size() == compiled
  server = serving.Server(model, params, batch_size=2, page_size=4, num_pages=24, max_length=28,
                          prefill_chunk=16)
  for prompt, limit in zip(prompts, limits):
    server.submit(prompt, limit)
  server.run()
  pool = server.pool
  assert all(e.refs == 0 and e.written for e in pool.entries.values())
  assert pool.n_free + pool.cached_pages == 24
  rows = serving_loop.rows_state(server.plan)
  none = np.zeros((2,), bool), np.zeros((2,), np.int32), np.full((2,), 24, np.int32)
  jaxpr = str(jax.make_jaxpr(serving_loop.segment.__wrapped__, static_argnums=0)(
      server.plan, (params, None), server.runner.cache, rows, jax.random.key(0), *none, 4,
      False))
  assert "while" in jaxpr and "callback" not in jaxpr


def test_prefill_pieces_are_the_chunk_and_smaller_powers_of_2():
  assert serving_loop.chunks(512) == (16, 32, 64, 128, 256, 512)
  assert serving_loop.chunks(16) == (16,) and serving_loop.chunks(8) == (8,)
  assert serving_loop.chunks(100) == (16, 32, 64, 100)


def check_a_trip_reads_several_rows_prompts_beside_decoding_rows():
  """prefill_chunk=32 (pieces of 16 or 32): the first trip reads two rows' prompts (9 and 14
  tokens, 16 each padded) and decodes both; the next reads a third's (20 tokens, 32 padded:
  past the first trip's room) while the first two decode; every request gets the tokens of
  `decoding.generate`, over a local layer's rolling cache and a global layer's pages."""
  model, params = lm()
  prompts, limits = shared_requests(2, (9, 14, 20), (5, 3, 4))
  server = serving.Server(model, params, batch_size=3, page_size=4, num_pages=3 * 8,
                          max_length=28, prefill_chunk=32, segment_steps=1)
  requests = [server.submit(p, n) for p, n in zip(prompts, limits)]
  server.step()
  assert server.runner.state["fed"].tolist() == [9, 14, 0]
  assert [len(r.tokens) for r in requests] == [2, 2, 0]  # the prefill's token and a decode's
  server.step()
  assert server.runner.state["fed"].tolist() == [9, 14, 20]
  assert [len(r.tokens) for r in requests] == [3, 3, 2]
  server.run()
  padded = np.zeros((3, 20), np.int32)
  for row, prompt in enumerate(prompts):
    padded[row, :len(prompt)] = prompt
  want = np.asarray(decoding.generate(model, params, (padded,), padded,
                                      np.array([9, 14, 20], np.int32), max_new_tokens=5))
  assert [r.tokens for r in requests] == [row[:n].tolist() for row, n in zip(want, limits)]


def test_bad_prefill_chunk_is_named():
  model, params = lm()
  with pytest.raises(ValueError, match="prefill_chunk must be a positive int, got 0"):
    serving.serve(model, params, [[1, 2]], 2, batch_size=1, page_size=4, num_pages=4,
                  prefill_chunk=0)


def test_a_request_that_cannot_fit_is_refused_by_submit():
  model, params = global_lm()
  server = serving.Server(model, params, batch_size=2, page_size=4, num_pages=3, max_length=16)
  with pytest.raises(ValueError, match="need 17 tokens, more than max_length"):
    server.submit([1] * 9, 8)
  with pytest.raises(ValueError, match="needs 4 pages; the pool has num_pages=3"):
    server.submit([1] * 9, 7)
  with pytest.raises(ValueError, match=r"prompts\[0\] holds token id 17"):
    server.submit([1, 17], 2)
  with pytest.raises(TypeError, match="prefix_caching must be a bool, got int"):
    serving.Server(model, params, batch_size=2, page_size=4, num_pages=3, max_length=16,
                   prefix_caching=1)
  assert not server.busy


def test_max_length_rounds_up_to_whole_pages_and_stats_need_no_argument():
  """Server(max_length=10, page_size=4) takes requests of 12 tokens (3 pages) and says so;
  `stats()` reports the seconds spent in the loop (none yet)."""
  model, params = global_lm()
  server = serving.Server(model, params, batch_size=2, page_size=4, num_pages=8, max_length=10)
  assert server.max_length == 12
  server.submit([1] * 4, 8)
  with pytest.raises(ValueError, match=r"need 13 tokens, more than max_length \(12 in pages\)"):
    server.submit([1] * 5, 8)
  stats = server.stats()
  assert (stats.new_tokens, stats.seconds, stats.tokens_per_second) == (0, 0.0, 0.0)
