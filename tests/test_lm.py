"""The decoder-only LM: packing, document isolation, position restarts, generation, a tiny run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import lm as lm_config
from experiments import lm, lm_data, metrics, train
from experiments.tasks import BOS, EOS, PAD, get_task
from flax_mha.models.lm import DecoderLM, LMConfig

TASK = get_task("reverse", heldout_percent=10, min_len=1, max_len=9)


def _model(implementation=None, **kwargs):
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


@pytest.mark.parametrize("implementation", ["xla", "chunked"])
def test_a_document_sees_only_itself_wherever_it_is_packed(implementation):
  """Logits of a document are the same alone at the start of a row and packed after another
  one (segment ids isolate it, positions restart, rotary is relative), and do not change when
  the other document does."""
  model = _model(implementation)
  doc, other = lm_data.document(TASK, "abcd", "dcba"), lm_data.document(TASK, "xyz", "zyx")
  alone = lm_data.pack([doc], 1, 24)
  packed = lm_data.pack([other, doc], 1, 24)
  changed = lm_data.pack([lm_data.document(TASK, "qrs", "srq"), doc], 1, 24)
  params = model.init(jax.random.key(0), *train.model_inputs(alone))["params"]
  logits = lambda batch: np.asarray(lm.apply(model, params, batch))[0]
  n, start = len(doc[0]), len(other[0])
  np.testing.assert_allclose(logits(packed)[start:start + n], logits(alone)[:n], atol=2e-5)
  np.testing.assert_allclose(logits(changed)[start:start + n], logits(packed)[start:start + n],
                             atol=2e-5)


def test_generate_equals_step_by_step_argmax():
  model = _model()
  pairs = [("abc", "cba"), ("hello", "olleh")]
  prompts, lengths = lm_data.prompts(TASK, pairs, 16)
  params = model.init(jax.random.key(1), prompts, np.ones_like(prompts), prompts * 0)["params"]
  got = np.asarray(lm.generate(model, params, prompts, lengths, 4))
  for row, n in enumerate(lengths):
    tokens = list(prompts[row, :n])
    for _ in range(4):
      ids = jnp.asarray([tokens])
      out = model.apply({"params": params}, ids, jnp.ones_like(ids),
                        jnp.arange(len(tokens))[None])
      tokens.append(int(jnp.argmax(out[0, -1])))
    assert got[row, :n + 4].tolist() == tokens


def test_tiny_config_trains(tmp_path):
  config = lm_config.get_config("tiny")
  config.train.steps = 30
  summary = train.train_and_evaluate(config, str(tmp_path))
  losses = [r["train/loss"] for r in metrics.read_rows(str(tmp_path)) if "train/loss" in r]
  assert losses[-1] < 0.9 * losses[0]
  assert summary["steps"] == 30 and 0.0 <= summary["eval_exact_match"] <= 1.0


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_kv_heads=3), "LMConfig.num_heads=4 must be a multiple of LMConfig.num_kv_heads=3"),
    (dict(local_window=-2), "LMConfig.local_window must be an int >= 0, got -2"),
    (dict(global_every=0), "LMConfig.global_every must be a positive int"),
])
def test_bad_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    _model(**kwargs)


def test_local_and_global_layers_alternate():
  cfg = _model().config
  assert [cfg.is_local(i) for i in range(4)] == [True, False, True, False]
  assert not LMConfig(vocab_size=9, local_window=None).is_local(0)
