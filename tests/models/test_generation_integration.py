"""Generation through the one decoding module, end to end on a tiny LM: cached greedy equals
recompute for both front ends, beam search equals exhaustive search, sampling is reproducible and
stays inside its top-k / top-p set, stop tokens end a row, and continuous batching over a paged
cache gives what static batching gives. The argument checks and the sampler's frequencies are
the unit part, tests/models/test_generation.py."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

from experiments.bench import static_batching
from flax_mha import serving
from flax_mha.models import decoding, lm_nnx
from test_generation import LENGTHS, PROMPTS, VOCAB, lm

import test_generation as test_generation_cases

pytestmark = pytest.mark.integration  # a whole model end to end: seconds of compiles

# Cases of tests/models/test_generation.py that compile for seconds: the unit part skips them
# (`check_` there), the integration part runs them here.
test_a_model_call_past_learned_positions_is_refused_eagerly_and_nan_inside_jit = (
    test_generation_cases.check_a_model_call_past_learned_positions_is_refused_eagerly_and_nan_inside_jit)


def _recompute_greedy(model, params, prompts, lengths, n):
  """Greedy continuations by a full forward pass over each whole prefix every step (one jitted
  shape: the rows padded to L + n, padding its own segment 0)."""
  width = prompts.shape[1] + n
  seqs = np.zeros((len(prompts), width), np.int32)
  seqs[:, :prompts.shape[1]] = prompts
  forward = jax.jit(lambda t, seg: model.apply(params, t, seg, jnp.broadcast_to(
      jnp.arange(width), t.shape)))
  for step in range(n):
    ends = lengths + step  # each row's prefix length
    segments = (np.arange(width)[None] < ends[:, None]).astype(np.int32)
    logits = np.asarray(forward(seqs, segments))
    seqs[np.arange(len(seqs)), ends] = logits[np.arange(len(seqs)), ends - 1].argmax(-1)
  return [seqs[row, end:end + n].tolist() for row, end in enumerate(lengths)]


@pytest.mark.parametrize("kwargs", [dict(), dict(learned_sinks=True, sink_tokens=1),
                                    dict(local_window=None, normalize_qk=True)],
                         ids=["rotary_gqa_window_soft_cap", "sinks", "global_normalize_qk"])
def test_lm_cached_greedy_equals_recompute_for_prompts_of_different_lengths(kwargs):
  model, params = lm(**kwargs)
  got = decoding.generate(model, params, (PROMPTS,), PROMPTS, LENGTHS, max_new_tokens=7)
  assert np.asarray(got).tolist() == _recompute_greedy(model, params, PROMPTS, LENGTHS, 7)


def test_an_nnx_lm_decodes_as_recompute_and_as_its_linen_twin():
  """The NNX DecoderLM, given the linen one's parameters, through every entry point: greedy
  tokens equal recomputing its whole forward each step, and beam search the linen model's."""
  model, params = lm(learned_sinks=True, sink_tokens=1)
  nnx_lm = lm_nnx.load_linen_params(lm_nnx.DecoderLM(model.config, rngs=nnx.Rngs(1)), params)
  want = _recompute_greedy(*decoding.decodable(nnx_lm), PROMPTS, LENGTHS, 5)
  got = decoding.generate(nnx_lm, None, (PROMPTS,), PROMPTS, LENGTHS, max_new_tokens=5)
  assert np.asarray(got).tolist() == want
  np.testing.assert_array_equal(
      got, decoding.generate(model, params, (PROMPTS,), PROMPTS, LENGTHS, max_new_tokens=5))
  first = PROMPTS[:1, :LENGTHS[0]]
  assert list(decoding.stream(nnx_lm, None, (first,), first, max_new_tokens=5)) == want[0]
  rows = [PROMPTS[i, :n] for i, n in enumerate(LENGTHS)]
  served, _ = serving.serve(nnx_lm, None, rows, 5, batch_size=2, page_size=4, num_pages=8)
  assert served == want
  beam = lambda m, p: np.asarray(decoding.generate_beam(m, p, (PROMPTS,), PROMPTS, LENGTHS,
                                                        max_new_tokens=4, beam_size=3))
  np.testing.assert_array_equal(beam(nnx_lm, None), beam(model, params))
  with pytest.raises(ValueError, match="an NNX model holds its parameters: params must be None"):
    decoding.generate(nnx_lm, params, (PROMPTS,), PROMPTS, max_new_tokens=2)


def test_lm_beam_search_equals_exhaustive_search():
  model, params = lm()
  prompt, n, alpha = PROMPTS[:1, :3], 3, 0.6
  got = decoding.generate_beam(model, params, (prompt,), prompt, max_new_tokens=n,
                               beam_size=VOCAB ** 2, alpha=alpha)
  conts = np.array(list(itertools.product(range(VOCAB), repeat=n)))  # every continuation
  seqs = jnp.asarray(np.concatenate([np.repeat(prompt, len(conts), 0), conts], axis=1))
  logp = jax.nn.log_softmax(model.apply(params, seqs, jnp.ones_like(seqs),
                                        jnp.broadcast_to(jnp.arange(seqs.shape[1]), seqs.shape)))
  steps = np.asarray(logp[:, 2:2 + n])  # the log-prob of each continuation token
  scores = np.take_along_axis(steps, conts[..., None], axis=-1)[..., 0].sum(-1)
  best = conts[np.argmax(scores / decoding.length_penalty(n, alpha))]
  assert np.asarray(got[0]).tolist() == best.tolist()


def test_sampling_is_reproducible_and_stays_in_its_set():
  model, params = lm()
  sample = lambda key, **kw: np.asarray(decoding.generate(
      model, params, (PROMPTS,), PROMPTS, LENGTHS, max_new_tokens=9,
      sampler=decoding.Sampling(**kw), rng=jax.random.key(key)))
  np.testing.assert_array_equal(sample(1, temperature=2.0), sample(1, temperature=2.0))
  assert not np.array_equal(sample(1, temperature=5.0), sample(2, temperature=5.0))
  logits = jax.random.normal(jax.random.key(3), (4, VOCAB)) * 2
  for kwargs in (dict(top_k=3), dict(top_p=0.6), dict(top_k=5, top_p=0.8, temperature=0.7)):
    sampler = decoding.Sampling(**kwargs)
    allowed = np.isfinite(np.asarray(sampler.restrict(logits)))
    draws = np.stack([np.asarray(sampler(logits, jax.random.key(i))) for i in range(200)])
    assert allowed[np.arange(4), draws].all(), kwargs
    if "top_k" in kwargs:
      assert (allowed.sum(-1) <= kwargs["top_k"]).all()


def test_stop_tokens_end_a_row_and_pad_follows():
  model, params = lm()
  free = np.asarray(decoding.generate(model, params, (PROMPTS,), PROMPTS, LENGTHS,
                                      max_new_tokens=6))
  stop = int(free[0, 2])
  got = np.asarray(decoding.generate(model, params, (PROMPTS,), PROMPTS, LENGTHS,
                                     max_new_tokens=6, stop_tokens=(stop,), pad_id=0))
  first = int(np.flatnonzero(free[0] == stop)[0])
  np.testing.assert_array_equal(got[0, :first + 1], free[0, :first + 1])
  np.testing.assert_array_equal(got[0, first + 1:], 0)


@pytest.mark.slow  # 50 s; serving over pages against generate: tests/serving in CI
def test_continuous_batching_over_pages_equals_static_batching():
  model, params = lm(learned_sinks=True)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, VOCAB, n) for n in (5, 40, 9, 17, 3, 30)]  # 13x apart
  limits = [6, 3, 8, 5, 7, 4]
  paged, stats = serving.serve(model, params, prompts, limits, batch_size=2, page_size=4,
                               num_pages=40)
  static, _ = static_batching.serve_static(model, params, prompts, limits, batch_size=2)
  assert paged == static
  assert [len(o) for o in paged] == limits
  assert stats.peak_pages <= 2 * -(-(40 + 3) // 4)  # at most two rows' pages at once
