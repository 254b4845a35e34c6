"""flax_mha.models.decoding end to end: cached greedy and beam search against cache-free and
exhaustive searches on a whole Transformer. The argument checks are the unit part,
tests/models/test_decoding.py."""

import functools
import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_mha.models.decoding import length_penalty
from flax_mha.models.transformer import beam_search, greedy_decode
from flax_mha.models.transformer import Transformer
from test_decoding import B, init, shared_make, make

import test_decoding as unit_cases

pytestmark = pytest.mark.integration  # a whole model end to end: seconds of compiles

# Cases of tests/models/test_decoding.py that compile for seconds: the unit part skips them
# (`check_` there), the integration part runs them here.
test_bad_arguments = (
    unit_cases.check_bad_arguments)


@functools.lru_cache
def _apply(cfg):
  """Transformer(cfg).apply under jit, one per config: the cache-free greedy decodes share it
  (one-off calls run eagerly: in a warm process that is cheaper than a compile)."""
  return jax.jit(Transformer(cfg).apply)


def naive_greedy(cfg, params, src, max_len):
  """Recomputes the whole decoder each step: no cache.

  The target buffer has a fixed length (one compilation); the decoder is causal, so the logits at
  position i ignore the padding after it.
  """
  apply = _apply(cfg)
  tgt = np.full((src.shape[0], max_len), cfg.pad_id, np.int32)
  tgt[:, 0] = cfg.bos_id
  done = np.zeros(src.shape[0], bool)
  out = []
  for i in range(max_len):
    nxt = np.asarray(jnp.argmax(apply({"params": params}, src, jnp.asarray(tgt))[:, i], -1))
    nxt = np.where(done, cfg.pad_id, nxt)
    done |= nxt == cfg.eos_id
    out.append(nxt)
    if i + 1 < max_len:
      tgt[:, i + 1] = nxt
  return np.stack(out, 1)


def sequence_scores(cfg, params, src_row, seqs, alpha):
  """Penalised log-probs [N] of seqs [N, L] (each up to and including eos), one full recompute."""
  seqs = np.asarray(seqs)
  is_eos = seqs == cfg.eos_id
  lengths = np.where(is_eos.any(1), is_eos.argmax(1) + 1, seqs.shape[1])
  valid = np.arange(seqs.shape[1])[None, :] < lengths[:, None]
  tgt_in = np.concatenate([np.full((len(seqs), 1), cfg.bos_id), seqs[:, :-1]], 1)
  src = jnp.repeat(src_row[None], len(seqs), axis=0)
  logits = Transformer(cfg).apply({"params": params}, src, jnp.asarray(tgt_in, jnp.int32))
  lp = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), seqs[..., None], -1)[..., 0]
  return (lp * valid).sum(1) / length_penalty(lengths, alpha)


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_equals_cache_free_greedy(seed):
  cfg, params, src = make(seed=seed)
  tokens = greedy_decode(cfg, params, src, max_len=8)
  chex.assert_shape(tokens, (B, 8))
  assert tokens.dtype == jnp.int32
  np.testing.assert_array_equal(tokens, naive_greedy(cfg, params, src, 8))


def make_eos_prone(step=3, seed=1):
  """A model that emits eos at decoder step `step` (or earlier) for some rows, and never pad.

  Pre-LN with an untied output layer: the decoder's learned position `step` is pushed along the
  eos column of the output kernel, so after the final norm eos wins there; pad's output bias is
  -1e3, so only the decoders' pad-after-eos rule can emit pad.
  """
  cfg, _, src = make(seed=seed)
  cfg = cfg.replace(share_embeddings=False, pre_layer_norm=True, learned_positions=True)
  params = jax.tree.map(lambda p: p * 1.5, init(cfg, seed, src))
  w_eos = params["logits"]["kernel"][:, cfg.eos_id]
  positions = params["decoder"]["positions"]["pos_embedding"]
  positions = positions.at[step].add(10.0 * w_eos / jnp.linalg.norm(w_eos))
  bias = params["logits"]["bias"].at[cfg.pad_id].set(-1e3)
  params = {**params, "decoder": {**params["decoder"], "positions": {"pos_embedding": positions}},
            "logits": {**params["logits"], "bias": bias}}
  return cfg, params, src


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_pad_after_eos(search):
  """Regression: the old test checked greedy only, and only rows that happened to emit eos
  (vacuous when none did); here eos is forced mid-sequence for both searches."""
  cfg, params, src = make_eos_prone()
  max_len = 10
  if search == "greedy":
    tokens = np.asarray(greedy_decode(cfg, params, src, max_len=max_len))
  else:
    tokens = np.asarray(beam_search(cfg, params, src, max_len=max_len, beam_size=4))
  first_eos = [list(row).index(cfg.eos_id) if cfg.eos_id in row else None for row in tokens]
  # Not vacuous: some row ends mid-sequence, with tokens after its eos to check.
  assert any(i is not None and 0 < i < max_len - 1 for i in first_eos), tokens
  for row, i in zip(tokens, first_eos):
    end = max_len if i is None else i
    assert cfg.pad_id not in row[:end], row  # pad only ever follows eos
    if i is not None:
      np.testing.assert_array_equal(row[i + 1:], cfg.pad_id, err_msg=str(row))


def test_beam_of_one_is_greedy():
  cfg, params, src = make()
  np.testing.assert_array_equal(beam_search(cfg, params, src, max_len=8, beam_size=1),
                                greedy_decode(Transformer(cfg), params, src, max_len=8))


def test_wide_beam_finds_the_exhaustive_best():
  """With a beam as wide as the search space, beam search is exact."""
  vocab, max_len, alpha = 5, 3, 0.6  # 5**3 sequences: few enough to enumerate
  cfg, params, src = make(vocab=vocab)
  tokens = beam_search(cfg, params, src, max_len=max_len, beam_size=vocab**max_len, alpha=alpha)
  candidates = np.array(list(itertools.product(range(vocab), repeat=max_len)))
  for b in range(B):  # one call (one shape) scores every candidate and the beam's pick
    scores = sequence_scores(cfg, params, src[b], np.concatenate([candidates, tokens[b][None]]),
                             alpha)
    best, got = scores[:-1].max(), scores[-1]
    np.testing.assert_allclose(got, best, rtol=1e-5)


def test_beam_beats_or_ties_greedy_on_score():
  cfg, params, src = make(seed=2)
  alpha = 0.6
  greedy = np.asarray(greedy_decode(cfg, params, src, max_len=6))
  beams = np.asarray(beam_search(cfg, params, src, max_len=6, beam_size=8, alpha=alpha))
  for b in range(B):
    beam_score, greedy_score = sequence_scores(cfg, params, src[b], [beams[b], greedy[b]], alpha)
    assert beam_score >= greedy_score - 1e-5


def test_decoding_under_x64():
  """Regression: with jax_enable_x64 the KV-cache update mixed int64 and int32 start indices."""
  with jax.enable_x64(True):
    cfg, params, src = shared_make()  # made under x64, not the cached one
    tokens = greedy_decode(cfg, params, src, max_len=6)
    np.testing.assert_array_equal(tokens, naive_greedy(cfg, params, src, 6))
    np.testing.assert_array_equal(beam_search(cfg, params, src, max_len=6, beam_size=1), tokens)
  assert not jax.config.jax_enable_x64


# Moved from the unit part for its time (6.7 s on the slower type).
test_generate_refuses_source_ids_outside_the_vocabulary = (
    unit_cases.check_generate_refuses_source_ids_outside_the_vocabulary)
