"""flax_mha.models.decoding: the arguments greedy decoding, beam search and generate refuse.
Cached greedy and beam search against cache-free and exhaustive searches are in
tests/models/test_decoding_integration.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_mha.models.decoding import generate
from flax_mha.models.transformer import beam_search, greedy_decode
from flax_mha.models.transformer import Transformer, TransformerConfig

B, S = 3, 6


def init(cfg, seed, src):
  return Transformer(cfg).init(jax.random.key(seed), src, src[:, :2])["params"]


def shared_make(vocab=11, max_len=12, seed=0):
  cfg = TransformerConfig(vocab_size=vocab, d_model=32, num_heads=2, d_ff=48, dropout_rate=0.0,
                          max_len=max_len)
  rng = np.random.default_rng(seed)
  src = rng.integers(3, vocab, (B, S))
  src[1, 3:] = 0
  src = jnp.asarray(src, jnp.int32)
  # Larger logits make eos likely at some point, so finished/unfinished beams both occur.
  params = jax.tree.map(lambda p: p * 1.5, init(cfg, seed, src))
  return cfg, params, src


make = functools.lru_cache(shared_make)  # (cfg, params, src) of a seed, made once


def check_bad_arguments():
  cfg, params, src = make()
  with pytest.raises(ValueError, match="max_len must be an int in"):
    greedy_decode(cfg, params, src, max_len=99)
  with pytest.raises(ValueError, match="beam_size must be a positive int"):
    beam_search(cfg, params, src, max_len=4, beam_size=0)
  with pytest.raises(ValueError, match="src must be integer tokens"):
    greedy_decode(cfg, params, src.astype(jnp.float32), max_len=4)
  with pytest.raises(TypeError, match="config must be a TransformerConfig or Transformer"):
    greedy_decode({"vocab_size": 3}, params, src, max_len=4)


def check_generate_refuses_source_ids_outside_the_vocabulary():
  """The source enters generation as the Transformer's context: its ids are checked as well."""
  cfg, params, src = make()
  bad = src.at[2, 1].set(cfg.vocab_size)
  bos = jnp.full((B, 1), cfg.bos_id, jnp.int32)
  with pytest.raises(ValueError, match=rf"^context\[0\] holds token id {cfg.vocab_size} at "
                                       rf"position \(2, 1\), outside the vocabulary"):
    generate(Transformer(cfg), {"params": params}, (bad,), bos, max_new_tokens=3)
