"""The decoder-only LM: packing, batches, a row without segment ids, config checks. Document
isolation, generation and a tiny run are in tests/test_lm_integration.py.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from experiments import lm_data
from experiments.tasks import BOS, EOS, PAD, get_task
from flax_mha.models.lm import DecoderLM, LMConfig

TASK = get_task("reverse", heldout_percent=10, min_len=1, max_len=9)


def shared_model(implementation=None, **kwargs):
  kwargs = dict(dict(d_model=32, num_heads=4, num_kv_heads=2, num_layers=3, d_ff=48,
                     local_window=3), **kwargs)
  return DecoderLM(LMConfig(vocab_size=TASK.vocab.size, attention_implementation=implementation,
                            **kwargs))


def test_pack_layout():
  docs = [lm_data.document(TASK, "abc", "cba"), lm_data.document(TASK, "de", "ed"),
          lm_data.document(TASK, "fghij", "jihgf")]
  out = lm_data.pack(docs, batch_size=2, length=12)
  a, b, _ = (d[0] for d in docs)  # 8, 6 and 12 tokens: 8 + 6 > 12, so one a row
  assert out["tokens"][0].tolist() == a + [PAD] * 4
  assert out["tokens"][1].tolist() == b + [PAD] * 6  # c (12 tokens) no longer fits: dropped
  assert out["segment_ids"][0].tolist() == [1] * 8 + [0] * 4
  assert out["positions"][1].tolist() == list(range(6)) + [0] * 6
  assert a[3] == BOS and a[-1] == EOS
  # The answer is scored: from BOS on, each position predicts the next answer token or EOS.
  assert out["weights"][0].tolist() == [0, 0, 0, 1, 1, 1, 1, 0] + [0] * 4
  assert out["targets"][0][:7].tolist() == a[1:]
  assert lm_data.rows_needed(docs, 12) == 3


def test_batches_are_a_pure_function_of_seed_and_step():
  first = lm_data.train_batch(TASK, 5, 3, 4, 32)
  lm_data.train_batch(TASK, 5, 9, 4, 32)
  again = lm_data.train_batch(TASK, 5, 3, 4, 32)
  for key in first:
    np.testing.assert_array_equal(first[key], again[key])
  assert (first["segment_ids"] > 1).any()  # rows hold several documents


def check_one_document_needs_no_segment_ids_or_positions():
  """Without segment_ids and positions a row is one document at positions 0..L-1: the logits
  (and the parameters init makes) equal those of passing them explicitly."""
  model = shared_model()
  tokens = np.asarray(jax.random.randint(jax.random.key(2), (2, 7), 0, TASK.vocab.size))
  segments, positions = np.ones_like(tokens), np.broadcast_to(np.arange(7), tokens.shape)
  params = model.init(jax.random.key(1), tokens)
  explicit = model.init(jax.random.key(1), tokens, segments, positions)
  jax.tree.map(np.testing.assert_array_equal, params, explicit)
  np.testing.assert_array_equal(model.apply(params, tokens),
                                model.apply(params, tokens, segments, positions))


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_kv_heads=3), "LMConfig.num_heads=4 must be a multiple of LMConfig.num_kv_heads=3"),
    (dict(local_window=-2), "LMConfig.local_window must be an int >= 0, got -2"),
    (dict(global_every=0), "LMConfig.global_every must be a positive int"),
])
def test_bad_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    shared_model(**kwargs)


def test_local_and_global_layers_alternate():
  cfg = shared_model().config
  assert [cfg.is_local(i) for i in range(4)] == [True, False, True, False]
  assert not LMConfig(vocab_size=9, local_window=None).is_local(0)
