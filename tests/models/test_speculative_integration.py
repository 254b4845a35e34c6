"""Speculative decoding end to end beyond the unit part (tests/models/test_speculative.py): the
same greedy tokens as plain decoding with a draft model (partial acceptance) and with the model
drafting for itself (every draft kept), with an int8 cache, under the caller's jit and inside
its lax.scan, with the NNX twin, at batch 1 and for one new token; a drafter of one's own
(a `Drafter` subclass)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
import numpy as np
import pytest

from flax_mha.models import decoding, lm_nnx, speculative

from test_speculative import lm, prompts

import test_speculative as unit_cases

pytestmark = pytest.mark.integration

# Cases of tests/models/test_speculative.py that compile for seconds: the unit part skips them
# (`check_` there), the integration part runs them here.
test_the_final_cache_is_what_the_kept_tokens_alone_make = (
    unit_cases.check_the_final_cache_is_what_the_kept_tokens_alone_make)
test_greedy_tokens_are_plain_decodings = (
    unit_cases.check_greedy_tokens_are_plain_decodings)
test_the_loop_of_rounds_copies_no_cache = (
    unit_cases.check_the_loop_of_rounds_copies_no_cache)
test_the_rejection_rule_keeps_the_targets_distribution = (
    unit_cases.check_the_rejection_rule_keeps_the_targets_distribution)
test_sampled_tokens_are_reproducible_and_bad_arguments_named = (
    unit_cases.check_sampled_tokens_are_reproducible_and_bad_arguments_named)
test_greedy_rows_of_a_per_row_sampler_keep_exactly_the_argmax_prefix = (
    unit_cases.check_greedy_rows_of_a_per_row_sampler_keep_exactly_the_argmax_prefix)


@pytest.mark.parametrize("case", ["int8", "rolling", "paged", "paged-int8"])
def test_every_cache_kinds_rollback_leaves_what_one_that_never_saw_them_holds(case):
  unit_cases.check_a_rollback_leaves_what_a_cache_that_never_saw_them_holds(case)


@pytest.mark.parametrize("drafter", [
    "draft", pytest.param("self", marks=pytest.mark.slow)])  # self: the NNX twin, tests/serving
def test_greedy_tokens_with_draft_models(drafter):
  test_greedy_tokens_are_plain_decodings(drafter)


def test_an_int8_cache_and_one_token_and_jit_and_batch_one():
  """An int8 cache under the caller's jit; alone (batch 1, the repetitive row) with drafts
  kept; one new token."""
  model, params = lm()
  rows, lengths = prompts()
  kw = dict(max_new_tokens=12, cache_dtype=jnp.int8)
  want = decoding.generate(model, params, (rows,), rows, lengths, **kw)
  got = jax.jit(lambda p: speculative.generate(model, params, (p,), p, lengths,
                                               drafter=speculative.PromptLookup(2),
                                               num_speculative_tokens=2, **kw))(rows)
  np.testing.assert_array_equal(got, want)
  alone, stats = speculative.generate_with_stats(
      model, params, (rows[:1],), rows[:1], lengths[:1], drafter=speculative.PromptLookup(2),
      num_speculative_tokens=2, **kw)
  np.testing.assert_array_equal(alone, want[:1])
  assert 0 < stats.accepted and stats.rounds < 11, stats
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


def test_inside_the_callers_scan_and_with_the_nnx_twin():
  """speculative.generate traced inside the caller's lax.scan (two batches, one program) gives
  each batch's plain greedy tokens; the NNX twin of the model speculates to the same tokens."""
  model, params = lm()
  rows, lengths = prompts()
  batches = np.stack([rows, np.roll(rows, 1, axis=0)])
  lengths2 = np.stack([lengths, np.roll(lengths, 1)])
  kw = dict(max_new_tokens=10)
  want = [decoding.generate(model, params, (r,), r, n, **kw) for r, n in zip(batches, lengths2)]

  def step(carry, batch):
    r, n = batch
    return carry, speculative.generate(model, params, (r,), r, n, num_speculative_tokens=3,
                                       drafter=speculative.PromptLookup(), **kw)

  _, got = jax.jit(lambda b, n: jax.lax.scan(step, 0, (b, n)))(batches, lengths2)
  np.testing.assert_array_equal(got, np.stack(want))
  twin = lm_nnx.load_linen_params(lm_nnx.DecoderLM(model.config, rngs=nnx.Rngs(1)), params)
  nnx_tokens = speculative.generate(twin, None, (rows,), rows, lengths, num_speculative_tokens=3,
                                    drafter=speculative.DraftModel(twin), **kw)
  np.testing.assert_array_equal(nnx_tokens, want[0])


@dataclasses.dataclass(frozen=True)
class RepeatLast(speculative.Drafter):
  """A third drafter, written outside the library: each row's last token, k times."""

  def split(self):
    return self, None

  def init(self, arrays, model_context, prompts, lengths, capacity, rollback_slots):
    return ()

  def read(self, arrays, state, tokens, positions):
    return state

  def offered(self, arrays, state, history_BM, length_B, k):
    return None

  def propose(self, arrays, state, history_BM, length_B, live_B, k, keys_B, sampler):
    last = jnp.take_along_axis(history_BM, length_B[:, None] - 1, axis=1)
    return state, jnp.repeat(last, k, axis=1), None

  def commit(self, state, history_BM, kept_B):
    return state


def test_a_drafter_of_ones_own_takes_the_same_interface():
  """A `Drafter` subclass from outside the library speculates to plain greedy tokens (the
  serving loop takes drafters through the same methods: prompt lookup's default
  `serving_state` in tests/serving/test_speculative_serving_integration.py)."""
  model, params = lm(local_window=None)
  rows, lengths = prompts()
  want = decoding.generate(model, params, (rows,), rows, lengths, max_new_tokens=8)
  got, stats = speculative.generate_with_stats(model, params, (rows,), rows, lengths,
                                               max_new_tokens=8, drafter=RepeatLast(),
                                               num_speculative_tokens=2)
  np.testing.assert_array_equal(got, want)
  assert stats.drafted > 0, stats


# Moved from the unit part for its time (6.3 s on the slower type).
test_a_second_call_traces_nothing = unit_cases.check_a_second_call_traces_nothing
