"""The decoder-only LM end to end: document isolation wherever a document is packed, generation
recomputed equal to the cached one, and a tiny run. The unit part (packing, configs, the model's
defaults) is tests/test_lm.py.

The tiny run trains under tests/test_train.py's StepClock (1 s per batch drawn), so its tokens/s
are exact numbers to check.
"""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import lm as lm_config
from experiments import lm, lm_data, metrics, train
from experiments.lm import LMRunner
from experiments.tasks import BOS, PAD, get_task
from flax_mha.models import decoding
from test_lm import TASK, shared_model
from test_train import step_clock
from test_train_integration import (assert_resume_refused, assert_tokens_per_second,
                                    spy_on_evaluate)

import test_lm as unit_cases

pytestmark = pytest.mark.integration  # whole models compiled, a tiny run

# Cases of tests/test_lm.py that compile for seconds: the unit part skips them
# (`check_` there), the integration part runs them here.
test_one_document_needs_no_segment_ids_or_positions = (
    unit_cases.check_one_document_needs_no_segment_ids_or_positions)


@pytest.mark.parametrize("implementation", ["xla", "chunked"])
def test_a_document_sees_only_itself_wherever_it_is_packed(implementation):
  """Logits of a document are the same alone at the start of a row and packed after another
  one (segment ids isolate it, positions restart, rotary is relative), and do not change when
  the other document does."""
  model = shared_model(implementation)
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


def test_recompute_generation_equals_the_cached_one():
  """The benchmark's baseline (the whole prefix recomputed each step) and the KV-cache
  decoding give the same greedy tokens."""
  model = shared_model()
  pairs = [("abc", "cba"), ("hello", "olleh")]
  prompts, lengths = lm_data.prompts(TASK, pairs, 16)
  params = model.init(jax.random.key(1), prompts, np.ones_like(prompts), prompts * 0)["params"]
  got = np.asarray(lm.generate_by_recompute(model, params, prompts, lengths, 4))
  cached = np.asarray(decoding.generate(model, {"params": params}, (prompts,), prompts[:, :6],
                                        lengths, max_new_tokens=4))
  for row, n in enumerate(lengths):
    assert got[row, n:n + 4].tolist() == cached[row].tolist()


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


def test_tiny_config_learns_the_answers_tokens(trained):
  """Held-out loss on the answers under a uniform guess over the vocabulary (it starts above)."""
  workdir, summary, _ = trained
  uniform = np.log(get_task("dates").vocab.size)
  losses = [r["train/loss"] for r in metrics.read_rows(workdir) if "train/loss" in r]
  assert summary["steps"] == 60 and len(losses) == 12
  assert losses[0] > uniform and losses[-1] < uniform and summary["eval_loss"] < uniform


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


def test_resume_with_another_model_is_refused_and_changes_nothing(trained, tmp_path):
  workdir = str(tmp_path / "run")
  shutil.copytree(trained[0], workdir)
  config = tiny_config()
  config.model.num_kv_heads = 2
  assert_resume_refused(workdir, config, ["model.num_kv_heads: 1 (saved) != 2 (given)"])


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


def int8_agreement(runner, params) -> tuple[float, float, float]:
  """(exact match through a float32 cache, through an int8 one, the fraction of held-out
  answers the two caches give alike) of `runner.decode`."""
  refs = [t for _, t in runner.pairs]
  floats, ints = runner.decode(params), runner.decode(params, cache_dtype=jnp.int8)
  exact = lambda answers: float(np.mean([a == r for a, r in zip(answers, refs)]))
  return exact(floats), exact(ints), float(np.mean([f == i for f, i in zip(floats, ints)]))


def test_an_int8_cache_answers_as_the_float_one(trained):
  """The tiny run's held-out answers through an int8 cache: the float32 cache's, every one
  (measured: 32 of 32; its logits sit far from ties)."""
  _, _, evaluations = trained
  params, reported = evaluations[-1]
  float_exact, int8_exact, same = int8_agreement(LMRunner(tiny_config()), params)
  assert float_exact == reported["eval/exact_match"]
  assert same == 1.0 and int8_exact == float_exact


@pytest.mark.slow
def test_the_trained_lm_answers_alike_through_an_int8_cache(tmp_path):
  """configs/lm.py trained in full (docs/results.md: ~14 minutes): its 1000 held-out answers
  through an int8 cache are the float32 cache's but for at most 0.5%, and the exact match
  moves by at most 0.5 points (measured at 5dc2079: 1000 of 1000 answers identical, 99.7%
  exact match through either cache)."""
  summary = train.train_and_evaluate(lm_config.get_config(), str(tmp_path))
  from experiments import generate  # pylint: disable=import-outside-toplevel
  runner, params = generate.restore_params(str(tmp_path))
  float_exact, int8_exact, same = int8_agreement(runner, params)
  assert float_exact == summary["eval_exact_match"]
  assert same >= 0.995 and abs(int8_exact - float_exact) <= 0.005
