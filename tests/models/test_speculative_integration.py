"""Speculative decoding end to end beyond the unit part (tests/models/test_speculative.py): the
same greedy tokens as plain decoding with a draft model (partial acceptance) and with the model
drafting for itself (every draft kept), with an int8 cache, under the caller's jit, and for one
new token."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_mha.models import decoding, speculative

from test_speculative import lm, prompts, test_greedy_tokens_are_plain_decodings

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("drafter", ["draft", "self"])
def test_greedy_tokens_with_draft_models(drafter):
  test_greedy_tokens_are_plain_decodings(drafter)


def test_an_int8_cache_and_one_token_and_jit():
  model, params = lm()
  rows, lengths = prompts()
  kw = dict(max_new_tokens=12, cache_dtype=jnp.int8)
  want = decoding.generate(model, params, (rows,), rows, lengths, **kw)
  got = jax.jit(lambda p: speculative.generate(model, params, (p,), p, lengths,
                                               drafter=speculative.PromptLookup(2),
                                               num_speculative_tokens=2, **kw))(rows)
  np.testing.assert_array_equal(got, want)
  one = speculative.generate(model, params, (rows,), rows, lengths, max_new_tokens=1,
                             drafter=speculative.PromptLookup())
  np.testing.assert_array_equal(one, want[:, :1])


def test_a_row_whose_drafts_fail_drafts_fewer():
  """A draft model of other weights (its drafts almost never kept): the row's own k falls to
  1, so the run drafts about one token a round, not k = 4; the tokens stay plain decoding's."""
  model, params = lm()
  rows, lengths = prompts()
  want = decoding.generate(model, params, (rows,), rows, lengths, max_new_tokens=16)
  got, stats = speculative.generate_with_stats(
      model, params, (rows,), rows, lengths, max_new_tokens=16, num_speculative_tokens=4,
      drafter=speculative.DraftModel(*lm(local_window=None, seed=5)))
  np.testing.assert_array_equal(got, want)
  assert stats.acceptance < 0.2 and stats.drafted < 1.6 * 3 * stats.rounds, stats
  assert speculative.ks(4) == (1, 2, 4) and speculative.ks(6) == (1, 2, 4, 6)
