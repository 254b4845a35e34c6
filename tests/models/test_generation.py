"""Generation through the one decoding module: cached greedy equals recompute for both models,
beam search equals exhaustive search on a tiny LM, sampling is reproducible, stays inside its
top-k / top-p set and draws tokens at the softmax's frequencies, and continuous batching over a
paged cache gives what static batching gives."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

from flax_mha import cache as cache_lib
from flax_mha.models import decoding, lm_nnx, serving
from flax_mha.models.lm import DecoderLM, LMConfig

VOCAB = 13


def _lm(**kwargs):
  cfg = LMConfig(**dict(dict(vocab_size=VOCAB, d_model=32, num_heads=4, num_kv_heads=2,
                             num_layers=3, d_ff=48, local_window=3, logit_soft_cap=5.0),
                        **kwargs))
  model = DecoderLM(cfg)
  x = jnp.zeros((1, 8), jnp.int32)
  params = model.init(jax.random.key(0), x, x, x)
  if cfg.learned_sinks:  # non-zero sinks, so that they matter
    params = jax.tree_util.tree_map_with_path(
        lambda p, v: v + 0.7 if "sinks" in jax.tree_util.keystr(p) else v, params)
  return model, params


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


PROMPTS = np.array([[3, 4, 5, 6, 7, 8], [9, 10, 0, 0, 0, 0], [11, 3, 12, 4, 0, 0]])
LENGTHS = np.array([6, 2, 4])


@pytest.mark.parametrize("kwargs", [dict(), dict(learned_sinks=True, sink_tokens=1),
                                    dict(local_window=None, normalize_qk=True)],
                         ids=["rotary_gqa_window_soft_cap", "sinks", "global_normalize_qk"])
@pytest.mark.integration  # a whole model end to end: seconds of compiles
def test_lm_cached_greedy_equals_recompute_for_prompts_of_different_lengths(kwargs):
  model, params = _lm(**kwargs)
  got = decoding.generate(model, params, (PROMPTS,), PROMPTS, LENGTHS, max_new_tokens=7)
  assert np.asarray(got).tolist() == _recompute_greedy(model, params, PROMPTS, LENGTHS, 7)


@pytest.mark.integration  # a whole model end to end: seconds of compiles
def test_an_nnx_lm_decodes_as_recompute_and_as_its_linen_twin():
  """The NNX DecoderLM, given the linen one's parameters, through every entry point: greedy
  tokens equal recomputing its whole forward each step, and beam search the linen model's."""
  model, params = _lm(learned_sinks=True, sink_tokens=1)
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


@pytest.mark.integration  # a whole model end to end: seconds of compiles
def test_lm_beam_search_equals_exhaustive_search():
  model, params = _lm()
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


@pytest.mark.integration  # a whole model end to end: seconds of compiles
def test_sampling_is_reproducible_and_stays_in_its_set():
  model, params = _lm()
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


def test_sampled_frequencies_match_the_softmax():
  """20k draws from a fixed distribution (top-p restricted): total variation below 0.02 (the
  draw's own noise is ~0.01) and every token outside the nucleus drawn 0 times."""
  logits = jnp.log(jnp.array([[0.35, 0.25, 0.15, 0.1, 0.08, 0.04, 0.03]]))
  sampler = decoding.Sampling(top_p=0.7)
  keys = jax.random.split(jax.random.key(0), 20_000)
  draws = np.asarray(jax.vmap(lambda k: sampler(logits, k))(keys))[:, 0]
  freq = np.bincount(draws, minlength=7) / len(draws)
  want = np.array([0.35, 0.25, 0.15, 0, 0, 0, 0])  # the smallest set reaching 0.7
  want /= want.sum()
  assert 0.5 * np.abs(freq - want).sum() < 0.02, freq
  assert freq[3:].sum() == 0


@pytest.mark.integration  # a whole model end to end: seconds of compiles
def test_stop_tokens_end_a_row_and_pad_follows():
  model, params = _lm()
  free = np.asarray(decoding.generate(model, params, (PROMPTS,), PROMPTS, LENGTHS,
                                      max_new_tokens=6))
  stop = int(free[0, 2])
  got = np.asarray(decoding.generate(model, params, (PROMPTS,), PROMPTS, LENGTHS,
                                     max_new_tokens=6, stop_tokens=(stop,), pad_id=0))
  first = int(np.flatnonzero(free[0] == stop)[0])
  np.testing.assert_array_equal(got[0, :first + 1], free[0, :first + 1])
  np.testing.assert_array_equal(got[0, first + 1:], 0)


@pytest.mark.integration  # a whole model end to end: seconds of compiles
def test_continuous_batching_over_pages_equals_static_batching():
  model, params = _lm(learned_sinks=True)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, VOCAB, n) for n in (5, 40, 9, 17, 3, 30)]  # 13x apart
  limits = [6, 3, 8, 5, 7, 4]
  paged, stats = serving.serve(model, params, prompts, limits, batch_size=2, page_size=4,
                               num_pages=40)
  static, _ = serving.serve_static(model, params, prompts, limits, batch_size=2)
  assert paged == static
  assert [len(o) for o in paged] == limits
  assert stats.peak_pages <= 2 * -(-(40 + 3) // 4)  # at most two rows' pages at once


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(prompt_lengths=np.array([7, 1, 1])), ValueError, r"prompt_lengths must be in \[1, L=6\]"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens must be a positive int"),
    (dict(sampler=decoding.Sampling()), ValueError, "sampling needs rng"),
])
def test_bad_generation_arguments_are_named(kwargs, error, match):
  model, params = _lm()
  args = dict(prompt_lengths=LENGTHS, max_new_tokens=3)
  args.update(kwargs)
  with pytest.raises(error, match=match):
    decoding.generate(model, params, (PROMPTS,), PROMPTS, **args)


def test_decoding_loops_trace_no_overflow_check(monkeypatch):
  """generate and beam search size their caches for every token they write, so their loops
  trace every cache write inside room_made_by_caller() (no overflow select, no host callback);
  the same cache write of a user's own under jit keeps its check."""
  model, params = _lm()
  checked = []
  judge = cache_lib._overflow_is_nan
  monkeypatch.setattr(cache_lib, "_overflow_is_nan", lambda out, cache: (
      checked.append(not cache_lib.ROOM_MADE_BY_CALLER.value), judge(out, cache))[1])
  for fn in (decoding.generate, decoding.generate_beam):
    jaxpr = jax.make_jaxpr(lambda p, fn=fn: fn(model, p, (PROMPTS,), PROMPTS, LENGTHS,
                                               max_new_tokens=3))(params)
    assert "callback" not in str(jaxpr)
  assert checked and not any(checked)
  cache = model.apply(params, PROMPTS, max_length=8, method=DecoderLM.init_cache)
  checked.clear()
  jax.make_jaxpr(lambda c: model.apply(params, PROMPTS[:, :1], c, method=DecoderLM.logits))(cache)
  assert checked and all(checked)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(top_p=1.5), ValueError, "top_p must be a finite number in (0, 1], got 1.5"),
    (dict(top_p=0.0), ValueError, "top_p must be a finite number in (0, 1], got 0.0"),
    (dict(temperature=0.0), ValueError, "temperature must be a finite number > 0, got 0.0"),
    (dict(top_k=0), ValueError, "top_k must be a positive int, got 0"),
    (dict(top_k=2.0), TypeError, "top_k must be a positive int, got float 2.0"),
])
def test_bad_sampling_fields_are_named_with_their_range(kwargs, error, message):
  with pytest.raises(error) as info:
    decoding.Sampling(**kwargs)
  assert str(info.value) == message
  decoding.Sampling(top_p=1.0)  # the bound is inclusive


def _decoders(model, params, prompts):
  """Every decoding entry point, each called on `prompts` [B, L] (a list of rows for serving)."""
  rows = [list(row) for row in np.asarray(prompts)]
  return {
      "generate": lambda: decoding.generate(model, params, (prompts,), prompts, max_new_tokens=3),
      "stream": lambda: list(decoding.stream(model, params, (prompts,), prompts,
                                             max_new_tokens=3)),
      "generate_beam": lambda: decoding.generate_beam(model, params, (prompts,), prompts,
                                                      max_new_tokens=3, beam_size=2),
      "serve": lambda: serving.serve(model, params, rows, 3, batch_size=1, page_size=4,
                                     num_pages=4),
      "serve_static": lambda: serving.serve_static(model, params, rows, 3, batch_size=1),
  }


@pytest.mark.parametrize("bad", [VOCAB, -1])
@pytest.mark.parametrize("entry", ["generate", "stream", "generate_beam", "serve",
                                   "serve_static"])
def test_ids_outside_the_vocabulary_are_refused_by_every_entry_point(entry, bad):
  model, params = _lm()
  prompts = np.array([[3, bad]])
  name = r"prompts\[0\]" if entry.startswith("serve") else "prompts"
  where = r"\(1,\)" if entry.startswith("serve") else r"\(0, 1\)"
  with pytest.raises(ValueError, match=rf"^{name} holds token id {bad} at position {where}, "
                                       rf"outside the vocabulary \[0, {VOCAB}\)$"):
    _decoders(model, params, prompts)[entry]()


@pytest.mark.parametrize("pad", [-1, VOCAB])
def test_padding_past_a_prompts_length_is_not_checked(pad):
  """Nor read: any id there (one outside the vocabulary embeds as NaN in the models) gives
  the tokens of zero padding."""
  model, params = _lm()
  padded = PROMPTS.copy()
  padded[1, LENGTHS[1]:] = pad
  np.testing.assert_array_equal(
      decoding.generate(model, params, (PROMPTS,), padded, LENGTHS, max_new_tokens=3),
      decoding.generate(model, params, (PROMPTS,), PROMPTS, LENGTHS, max_new_tokens=3))


@pytest.mark.parametrize("entry", ["serve", "serve_static"])
def test_serving_refuses_an_empty_prompt_by_name(entry):
  model, params = _lm()
  call = dict(serve=lambda: serving.serve(model, params, [[3, 4], []], 3, batch_size=1,
                                          page_size=4, num_pages=4),
              serve_static=lambda: serving.serve_static(model, params, [[3, 4], []], 3,
                                                        batch_size=1))[entry]
  with pytest.raises(ValueError, match=r"prompts\[1\] must be a non-empty sequence of integer "
                                       r"token ids, got shape \(0,\)"):
    call()


@pytest.mark.parametrize("front", ["linen", "nnx"])
def test_serving_no_prompts_gives_no_outputs(front):
  """No requests: an empty list of outputs and stats of nothing, as a run of requests gives a
  list and stats (it was `max() arg is an empty sequence`); the arguments are still checked."""
  model, params = _lm()
  if front == "nnx":
    model = lm_nnx.load_linen_params(lm_nnx.DecoderLM(model.config, rngs=nnx.Rngs(1)), params)
    params = None
  for limits in (3, []):
    served, stats = serving.serve(model, params, [], limits, batch_size=2, page_size=4,
                                  num_pages=8)
    assert served == [] and isinstance(stats, serving.ServeStats)
    assert (stats.new_tokens, stats.peak_pages, stats.page_size, stats.peak_tokens) == (0, 0, 4, 0)
    assert stats.tokens_per_second == 0.0
    static, static_stats = serving.serve_static(model, params, [], limits, batch_size=2)
    assert static == [] and static_stats.new_tokens == 0
  with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
    serving.serve(model, params, [], 3, batch_size=0, page_size=4, num_pages=8)
  with pytest.raises(ValueError, match=r"max_new_tokens must be an int or one per prompt \(0\)"):
    serving.serve(model, params, [], [3], batch_size=2, page_size=4, num_pages=8)
