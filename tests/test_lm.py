"""The decoder-only LM: packing, document isolation, position restarts, generation, a tiny run.

The tiny run trains under tests/test_train.py's StepClock (1 s per batch drawn), so its tokens/s
are exact numbers to check.
"""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest

from configs import lm as lm_config
from experiments import lm, lm_data, metrics, train
from experiments.lm import LMRunner
from experiments.tasks import BOS, EOS, PAD, get_task
from flax_mha.models import decoding
from flax_mha.models.lm import DecoderLM, LMConfig
from tests.test_train import (assert_resume_refused, assert_tokens_per_second, spy_on_evaluate,
                              step_clock)

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


@pytest.mark.integration  # a whole model end to end: seconds of compiles
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
  params = model.init(jax.random.key(0), *LMRunner.inputs(alone))["params"]
  apply = jax.jit(model.apply)  # one compile: every batch is [1, 24]
  logits = lambda batch: np.asarray(apply({"params": params}, *LMRunner.inputs(batch)))[0]
  n, start = len(doc[0]), len(other[0])
  np.testing.assert_allclose(logits(packed)[start:start + n], logits(alone)[:n], atol=2e-5)
  np.testing.assert_allclose(logits(changed)[start:start + n], logits(packed)[start:start + n],
                             atol=2e-5)


@pytest.mark.integration  # a whole model end to end: seconds of compiles
def test_recompute_generation_equals_the_cached_one():
  """The benchmark's baseline (the whole prefix recomputed each step) and the KV-cache
  decoding give the same greedy tokens."""
  model = _model()
  pairs = [("abc", "cba"), ("hello", "olleh")]
  prompts, lengths = lm_data.prompts(TASK, pairs, 16)
  params = model.init(jax.random.key(1), prompts, np.ones_like(prompts), prompts * 0)["params"]
  got = np.asarray(lm.generate_by_recompute(model, params, prompts, lengths, 4))
  cached = np.asarray(decoding.generate(model, {"params": params}, (prompts,), prompts[:, :6],
                                        lengths, max_new_tokens=4))
  for row, n in enumerate(lengths):
    assert got[row, n:n + 4].tolist() == cached[row].tolist()


def test_one_document_needs_no_segment_ids_or_positions():
  """Without segment_ids and positions a row is one document at positions 0..L-1: the logits
  (and the parameters init makes) equal those of passing them explicitly."""
  model = _model()
  tokens = np.asarray(jax.random.randint(jax.random.key(2), (2, 7), 0, TASK.vocab.size))
  segments, positions = np.ones_like(tokens), np.broadcast_to(np.arange(7), tokens.shape)
  params = model.init(jax.random.key(1), tokens)
  explicit = model.init(jax.random.key(1), tokens, segments, positions)
  jax.tree.map(np.testing.assert_array_equal, params, explicit)
  np.testing.assert_array_equal(model.apply(params, tokens),
                                model.apply(params, tokens, segments, positions))


def tiny_config():
  config = lm_config.get_config("tiny")
  config.train.steps = 60  # enough to beat a uniform guess on held-out answers
  config.eval.every = 30
  return config


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """(workdir, summary, [(params, metrics) of each evaluation]) of the tiny LM's run."""
  with pytest.MonkeyPatch.context() as monkeypatch:
    step_clock(monkeypatch, lm_data)
    evaluations = spy_on_evaluate(monkeypatch, LMRunner)
    workdir = str(tmp_path_factory.mktemp("lm"))
    return workdir, train.train_and_evaluate(tiny_config(), workdir), evaluations


@pytest.mark.integration
def test_tiny_config_learns_the_answers_tokens(trained):
  """Held-out loss on the answers under a uniform guess over the vocabulary (it starts above)."""
  workdir, summary, _ = trained
  uniform = np.log(get_task("dates").vocab.size)
  losses = [r["train/loss"] for r in metrics.read_rows(workdir) if "train/loss" in r]
  assert summary["steps"] == 60 and len(losses) == 12
  assert losses[0] > uniform and losses[-1] < uniform and summary["eval_loss"] < uniform


@pytest.mark.integration
def test_tokens_per_second_counts_each_real_token_once(trained):
  """Real tokens: the packed documents' tokens, counted by their segment ids (0 is padding)."""
  workdir, _, _ = trained
  config = tiny_config()
  task = get_task(config.task.name, **config.task.kwargs)

  def real_tokens(step):
    batch = lm_data.train_batch(task, config.seed, step, config.train.batch_size,
                                config.train.length)
    return int(np.count_nonzero(batch["segment_ids"]))

  assert_tokens_per_second(workdir, real_tokens, config.train.log_every)


@pytest.mark.integration
def test_resume_with_another_model_is_refused_and_changes_nothing(trained, tmp_path):
  workdir = str(tmp_path / "run")
  shutil.copytree(trained[0], workdir)
  config = tiny_config()
  config.model.num_kv_heads = 2
  assert_resume_refused(workdir, config, ["model.num_kv_heads: 1 (saved) != 2 (given)"])


@pytest.mark.integration
def test_exact_match_is_that_of_independent_greedy_answers(trained):
  """The last evaluation's answers, redone by appending one argmax at a time to `source BOS`
  (no segments: causality alone hides the PAD after the prefix)."""
  _, summary, evaluations = trained
  params, reported = evaluations[-1]
  runner = LMRunner(tiny_config())
  vocab = runner.task.vocab
  prompts = [[*vocab.encode(s), BOS] for s, _ in runner.pairs]
  new = max(len(t) for _, t in runner.pairs) + 1
  tokens_BL = np.full((len(prompts), max(map(len, prompts)) + new), PAD, np.int32)
  for row, prompt in zip(tokens_BL, prompts):
    row[:len(prompt)] = prompt
  positions_BL = np.broadcast_to(np.arange(tokens_BL.shape[1]), tokens_BL.shape)
  apply = jax.jit(runner.model.apply)
  for t in range(new):
    logits = apply({"params": params}, tokens_BL, np.ones_like(tokens_BL), positions_BL)
    for row, prompt in enumerate(prompts):
      tokens_BL[row, len(prompt) + t] = np.argmax(logits[row, len(prompt) + t - 1])
  answers = [vocab.decode(row[len(p):]) for row, p in zip(tokens_BL, prompts)]
  assert runner.decode(params) == answers
  exact = np.mean([a == t for a, (_, t) in zip(answers, runner.pairs)])
  assert reported["eval/exact_match"] == summary["eval_exact_match"] == exact


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
