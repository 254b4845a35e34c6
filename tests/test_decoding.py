"""flax_mha.decoding: cached greedy and beam search against cache-free and exhaustive searches."""

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_mha.decoding import beam_search, greedy_decode, length_penalty
from flax_mha.transformer import Transformer, TransformerConfig

B, S = 3, 6


def make(vocab=11, max_len=12, seed=0):
  cfg = TransformerConfig(vocab_size=vocab, d_model=32, num_heads=2, d_ff=48, dropout_rate=0.0,
                          max_len=max_len)
  rng = np.random.default_rng(seed)
  src = rng.integers(3, vocab, (B, S))
  src[1, 3:] = 0
  src = jnp.asarray(src, jnp.int32)
  params = Transformer(cfg).init(jax.random.key(seed), src, src[:, :2])["params"]
  # Larger logits make eos likely at some point, so finished/unfinished beams both occur.
  params = jax.tree.map(lambda p: p * 1.5, params)
  return cfg, params, src


def naive_greedy(cfg, params, src, max_len):
  """Recomputes the whole decoder each step: no cache.

  The target buffer has a fixed length (one compilation); the decoder is causal, so the logits at
  position i ignore the padding after it.
  """
  apply = jax.jit(Transformer(cfg).apply)
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
  """Penalised log-probs [N] of seqs [N, L] (each up to and including eos), by one full recompute."""
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


def test_pad_after_eos():
  cfg, params, src = make(seed=1)
  tokens = np.asarray(greedy_decode(cfg, params, src, max_len=10))
  for row in tokens:
    if cfg.eos_id in row:
      after = row[list(row).index(cfg.eos_id) + 1:]
      assert (after == cfg.pad_id).all()


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
  for b in range(B):
    best = sequence_scores(cfg, params, src[b], candidates, alpha).max()
    got = sequence_scores(cfg, params, src[b], np.asarray(tokens[b])[None], alpha)[0]
    np.testing.assert_allclose(got, best, rtol=1e-5)


def test_beam_beats_or_ties_greedy_on_score():
  cfg, params, src = make(seed=2)
  alpha = 0.6
  greedy = np.asarray(greedy_decode(cfg, params, src, max_len=6))
  beams = np.asarray(beam_search(cfg, params, src, max_len=6, beam_size=8, alpha=alpha))
  for b in range(B):
    beam_score, greedy_score = sequence_scores(cfg, params, src[b], [beams[b], greedy[b]], alpha)
    assert beam_score >= greedy_score - 1e-5


def test_bad_arguments():
  cfg, params, src = make()
  with pytest.raises(ValueError, match="max_len must be an int in"):
    greedy_decode(cfg, params, src, max_len=99)
  with pytest.raises(ValueError, match="beam_size must be a positive int"):
    beam_search(cfg, params, src, max_len=4, beam_size=0)
  with pytest.raises(ValueError, match="src must be integer tokens"):
    greedy_decode(cfg, params, src.astype(jnp.float32), max_len=4)
  with pytest.raises(TypeError, match="config must be a TransformerConfig or Transformer"):
    greedy_decode({"vocab_size": 3}, params, src, max_len=4)
