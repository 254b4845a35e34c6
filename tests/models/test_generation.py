"""Generation through the one decoding module: the sampler draws tokens at the softmax's
frequencies, every entry point refuses ids outside the vocabulary and bad arguments by name,
no decoding loop traces a cache overflow check. The decodings compared with recompute,
exhaustive search and static batching are in tests/models/test_generation_integration.py."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

from flax_mha import cache as cache_lib
from flax_mha.cache import entry
from experiments.bench import static_batching
from flax_mha import serving
from flax_mha.models import decoding, lm_nnx
from flax_mha.models.lm import DecoderLM, LMConfig

VOCAB = 13


def lm(**kwargs):
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


PROMPTS = np.array([[3, 4, 5, 6, 7, 8], [9, 10, 0, 0, 0, 0], [11, 3, 12, 4, 0, 0]])
LENGTHS = np.array([6, 2, 4])


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


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(prompt_lengths=np.array([7, 1, 1])), ValueError, r"prompt_lengths must be in \[1, L=6\]"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens must be a positive int"),
    (dict(sampler=decoding.Sampling()), ValueError, "sampling needs rng"),
])
def test_bad_generation_arguments_are_named(kwargs, error, match):
  model, params = lm()
  args = dict(prompt_lengths=LENGTHS, max_new_tokens=3)
  args.update(kwargs)
  with pytest.raises(error, match=match):
    decoding.generate(model, params, (PROMPTS,), PROMPTS, **args)


def test_decoding_loops_trace_no_overflow_check(monkeypatch):
  """generate and beam search size their caches for every token they write, so their loops
  trace every cache write inside room_made_by_caller() (no overflow select, no host callback);
  the same cache write of a user's own under jit keeps its check."""
  model, params = lm()
  checked = []
  judge = entry.nan_past_capacity
  monkeypatch.setattr(entry, "nan_past_capacity", lambda out, cache: (
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
      "serve_static": lambda: static_batching.serve_static(model, params, rows, 3, batch_size=1),
  }


@pytest.mark.parametrize("bad", [VOCAB, -1])
@pytest.mark.parametrize("entry", ["generate", "stream", "generate_beam", "serve",
                                   "serve_static"])
def test_ids_outside_the_vocabulary_are_refused_by_every_entry_point(entry, bad):
  model, params = lm()
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
  model, params = lm()
  padded = PROMPTS.copy()
  padded[1, LENGTHS[1]:] = pad
  np.testing.assert_array_equal(
      decoding.generate(model, params, (PROMPTS,), padded, LENGTHS, max_new_tokens=3),
      decoding.generate(model, params, (PROMPTS,), PROMPTS, LENGTHS, max_new_tokens=3))


@pytest.mark.parametrize("entry", ["serve", "serve_static"])
def test_serving_refuses_an_empty_prompt_by_name(entry):
  model, params = lm()
  call = dict(serve=lambda: serving.serve(model, params, [[3, 4], []], 3, batch_size=1,
                                          page_size=4, num_pages=4),
              serve_static=lambda: static_batching.serve_static(model, params, [[3, 4], []], 3,
                                                        batch_size=1))[entry]
  with pytest.raises(ValueError, match=r"prompts\[1\] must be a non-empty sequence of integer "
                                       r"token ids, got shape \(0,\)"):
    call()


@pytest.mark.parametrize("front", ["linen", "nnx"])
def test_serving_no_prompts_gives_no_outputs(front):
  """No requests: an empty list of outputs and stats of nothing, as a run of requests gives a
  list and stats (it was `max() arg is an empty sequence`); the arguments are still checked."""
  model, params = lm()
  if front == "nnx":
    model = lm_nnx.load_linen_params(lm_nnx.DecoderLM(model.config, rngs=nnx.Rngs(1)), params)
    params = None
  for limits in (3, []):
    served, stats = serving.serve(model, params, [], limits, batch_size=2, page_size=4,
                                  num_pages=8)
    assert served == [] and isinstance(stats, serving.ServeStats)
    assert (stats.new_tokens, stats.peak_pages, stats.page_size, stats.peak_tokens) == (0, 0, 4, 0)
    assert stats.tokens_per_second == 0.0
    static, static_stats = static_batching.serve_static(model, params, [], limits, batch_size=2)
    assert static == [] and static_stats.new_tokens == 0
  with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
    serving.serve(model, params, [], 3, batch_size=0, page_size=4, num_pages=8)
  with pytest.raises(ValueError, match=r"max_new_tokens must be an int or one per prompt \(0\)"):
    serving.serve(model, params, [], [3], batch_size=2, page_size=4, num_pages=8)


def test_serving_says_an_empty_prompt_is_empty_not_its_dtype():
  """NumPy reads `[]` as float64: the message says empty, not "dtype float64"."""
  model, params = lm()
  for call in (lambda: serving.serve(model, params, [[]], 3, batch_size=1, page_size=4,
                                     num_pages=4),
               lambda: decoding.generate(model, params, ([[]],), [[]], max_new_tokens=3)):
    with pytest.raises(ValueError, match=r"prompts\[0\] .* got shape \(0,\): it is empty$"):
      call()


def test_serve_takes_numpy_integers_as_generate_does():
  """`serve(..., np.int64(3))` (it was `'numpy.int64' object is not iterable`)."""
  model, params = lm()
  for limit in (np.int64(3), np.int32(3), np.array(3)):
    assert serving.serve(model, params, [], limit, batch_size=1, page_size=4,
                         num_pages=4)[0] == []
  assert serving.check_limits(np.int64(2), 3) == [2, 2, 2]


def test_generate_takes_python_lists_as_serve_does():
  """A list of prompts, ragged or not, in the prompts and the context: the tokens of the
  right-padded array with each row's length."""
  model, params = lm()
  rows = [list(PROMPTS[i, :n]) for i, n in enumerate(LENGTHS)]
  want = decoding.generate(model, params, (PROMPTS,), PROMPTS, LENGTHS, max_new_tokens=3)
  got = decoding.generate(model, params, (rows,), rows, max_new_tokens=3)
  np.testing.assert_array_equal(got, want)
  square = [list(r) for r in PROMPTS]
  np.testing.assert_array_equal(
      decoding.generate(model, params, (square,), square, max_new_tokens=3),
      decoding.generate(model, params, (PROMPTS,), PROMPTS, max_new_tokens=3))


def _learned(front="linen", max_positions=16):
  """A GPT-2-like LM: learned positions, a table of `max_positions`."""
  model, params = lm(positions="learned", max_positions=max_positions, local_window=None)
  if front == "nnx":
    model = lm_nnx.load_linen_params(lm_nnx.DecoderLM(model.config, rngs=nnx.Rngs(1)), params)
    params = None
  return model, params


@pytest.mark.parametrize("front", ["linen", "nnx"])
def test_learned_positions_past_their_table_are_refused_by_every_entry_point(front):
  """A prompt of 6 and max_new_tokens=20 with a table of 16 (it gave NaN logits from position
  16, read by greedy as token 0); 6 + 11 reach position 15 and run, finite."""
  model, params = _learned(front)
  prompt = np.arange(1, 7)[None]
  message = (r"a prompt of 6 tokens and max_new_tokens=20 reach position 24, past the "
             r"model's learned positions \[0, 16\)")
  calls = {
      "generate": lambda n: decoding.generate(model, params, (prompt,), prompt,
                                              max_new_tokens=n),
      "stream": lambda n: list(decoding.stream(model, params, (prompt,), prompt,
                                               max_new_tokens=n)),
      "generate_beam": lambda n: decoding.generate_beam(model, params, (prompt,), prompt,
                                                        max_new_tokens=n, beam_size=2),
      "serve": lambda n: serving.serve(model, params, list(prompt), n, batch_size=1,
                                       page_size=4, num_pages=8),
      "submit": lambda n: serving.Server(model, params, batch_size=1, page_size=4,
                                         num_pages=8, max_length=32).submit(prompt[0], n),
  }
  for name, call in calls.items():
    with pytest.raises(ValueError, match=message):
      call(20)
  tokens = decoding.generate(model, params, (prompt,), prompt, max_new_tokens=11)
  assert tokens.shape == (1, 11)
  jitted = jax.jit(lambda p: decoding.generate(model, params, (p,), p, max_new_tokens=20))
  with pytest.raises(ValueError, match=message):  # the lengths are static under jit
    jitted(prompt)


@pytest.mark.parametrize("front", ["linen", "nnx"])
def check_a_model_call_past_learned_positions_is_refused_eagerly_and_nan_inside_jit(front):
  """`apply` on 20 tokens with a table of 16: a ValueError naming the first position past it;
  inside `jit` (traced positions) NaN logits there, as an id outside the vocabulary; 16 run."""
  model, params = _learned(front)
  call = (lambda t: model(t)) if front == "nnx" else (lambda t: model.apply(params, t))
  with pytest.raises(ValueError, match=r"positions holds 16 at \(0, 16\), past the learned "
                                       r"positions' table \[0, 16\) \(LMConfig.max_positions\)"):
    call(jnp.ones((1, 20), jnp.int32))
  logits = jax.jit(call)(jnp.ones((1, 20), jnp.int32))
  assert bool(jnp.isnan(logits[0, 16:]).all())
  assert bool(jnp.isfinite(call(jnp.ones((1, 16), jnp.int32))).all())


def test_a_rotary_model_has_no_position_limit():
  model, params = lm(local_window=None)
  assert decoding.position_limit(model) is None
  assert decoding.generate(model, params, (PROMPTS,), PROMPTS,
                           max_new_tokens=40).shape == (3, 40)


def test_generate_says_what_its_context_is_and_why_an_lm_gets_its_prompts_twice():
  """The context argument is explained where a user meets it: generate's docstring and the
  inference tour."""
  assert "the prompts go twice" in decoding.generate.__doc__
  assert "(src,)" in decoding.generate.__doc__
  tour = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "tour_inference.md").read_text()
  assert "an LM gets its prompts twice" in " ".join(tour.split())
