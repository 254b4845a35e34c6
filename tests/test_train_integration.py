"""End-to-end training of the tiny configs: metrics, plots, checkpoints, exact resume, decoding,
and the command line's refusals. The config checks that fail before anything runs are the unit
part, tests/test_train.py, whose clock these runs share: 1 s per training batch drawn, so
timings are exact (tokens/s is a window's real tokens over its steps, and a resumed run's rows
and summary equal an uninterrupted run's, timings included).

The two runs marked slow (a text target, the copy task learned) run with `make test-slow`.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import dates, num2words_de
from experiments import checkpoints, data, metrics, run_config, seq2seq, tasks, train
from experiments.tasks import BOS, PAD
from test_train import REPO, step_clock, tiny_config
# The unit part's autouse fixture, the same here: the StepClock.
from test_train import clock  # noqa: F401

pytestmark = pytest.mark.integration  # trainings and subprocesses


SUMMARY_KEYS = {"task", "steps", "train_seconds", "steps_per_second", "eval_loss",
                "eval_token_accuracy", "eval_exact_match", "params"}


def spy_on_evaluate(monkeypatch, runner_class) -> list:
  """A list that receives (params, metrics) of every evaluation of `runner_class`'s runs."""
  calls, evaluate = [], runner_class.evaluate

  def spied(self, params):
    metrics_ = evaluate(self, params)
    calls.append((params, metrics_))
    return metrics_

  monkeypatch.setattr(runner_class, "evaluate", spied)
  return calls


def assert_tokens_per_second(workdir, real_tokens, log_every):
  """Each logged tokens/s is the real tokens of the steps since the last row over those steps
  (the StepClock's seconds). `real_tokens(step)`: a count made independently of the runner."""
  rows = [r for r in metrics.read_rows(workdir) if "train/tokens_per_second" in r]
  assert [r["step"] for r in rows] == list(range(log_every, rows[-1]["step"] + 1, log_every))
  for row in rows:
    window = range(row["step"] - log_every, row["step"])  # 0-based batch numbers
    want = sum(real_tokens(step) for step in window) / log_every
    assert row["train/tokens_per_second"] == pytest.approx(want, rel=1e-12), row["step"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """(workdir, summary, [(params, metrics) of each evaluation]) of the tiny copy run."""
  with pytest.MonkeyPatch.context() as monkeypatch:
    step_clock(monkeypatch, data)
    evaluations = spy_on_evaluate(monkeypatch, seq2seq.Seq2SeqRunner)
    workdir = str(tmp_path_factory.mktemp("copy"))
    return workdir, train.train_and_evaluate(tiny_config(), workdir), evaluations


def _truncate_files(folder):
  """Cut every file under `folder` to 0 bytes: a checkpoint whose save never completed."""
  for root, _, files in os.walk(folder):
    for name in files:
      os.truncate(os.path.join(root, name), 0)


def test_loss_goes_down(trained):
  workdir, _, _ = trained
  losses = [r["train/loss"] for r in metrics.read_rows(workdir) if "train/loss" in r]
  uniform = np.log(train.make_runner(tiny_config()).task.vocab.size)  # a uniform guess's loss
  assert len(losses) == 4 and losses[-1] < 0.95 * losses[0] and losses[-1] < 0.8 * uniform


def test_summary_metrics_and_plots_written(trained):
  """The summary holds the last evaluation and the clock's 20 s (1 s a step), nothing else."""
  workdir, summary, evaluations = trained
  with open(os.path.join(workdir, "summary.json")) as f:
    assert json.load(f) == summary
  assert set(summary) == SUMMARY_KEYS and summary["steps"] == 20 and summary["task"] == "copy"
  assert (summary["train_seconds"], summary["steps_per_second"]) == (20.0, 1.0)
  assert summary["params"] == sum(x.size for x in jax.tree.leaves(evaluations[-1][0]))
  assert {f"eval_{k[5:]}": v for k, v in evaluations[-1][1].items()} == {
      k: v for k, v in summary.items() if k.startswith("eval_")}
  rows = metrics.read_rows(workdir)
  assert [r["step"] for r in rows if "eval/exact_match" in r] == [10, 20]
  for name in ("learning_curves.png", "cross_attention.png", "encoder_self_attention.png"):
    with open(os.path.join(workdir, name), "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert os.listdir(os.path.join(workdir, "tensorboard"))


def test_checkpoint_round_trip(trained):
  """A finished workdir restores its final state: re-evaluating it reproduces the summary."""
  workdir, summary, _ = trained
  again = train.train_and_evaluate(tiny_config(), workdir)
  assert again == summary  # train_seconds too: it is saved with the state


def test_tokens_per_second_counts_each_real_token_once(trained):
  """Real tokens: each source character, BOS and each target character (read back as text)."""
  workdir, _, _ = trained
  config = tiny_config()
  task = tasks.get_task(config.task.name, **config.task.kwargs)

  def real_tokens(step):
    batch = data.train_batch(task, config.seed, step, config.train.batch_size,
                             config.train.bucket_window, config.train.length_buckets)
    return sum(len(task.vocab.decode(src)) + 1 + len(task.vocab.decode(tgt))
               for src, tgt in zip(batch["src"], batch["tgt_out"]))

  assert_tokens_per_second(workdir, real_tokens, config.train.log_every)


def greedy_by_recomputation(model, params, src_BS, length):
  """Greedy answers computed without the KV cache: the whole target prefix re-read each step
  (causal, so the PAD after it is never seen). src_BS [B, S] -> tokens [B, length]."""
  apply = jax.jit(model.apply)
  tgt_BT = np.full((src_BS.shape[0], length + 1), PAD, np.int32)
  tgt_BT[:, 0] = BOS
  for t in range(length):
    logits = apply({"params": params}, src_BS, tgt_BT[:, :-1])
    tgt_BT[:, t + 1] = np.argmax(logits[:, t], axis=-1)
  return tgt_BT[:, 1:]


def test_exact_match_is_that_of_independent_greedy_decoding(trained):
  """The last evaluation's greedy answers and exact match, redone from its parameters."""
  _, summary, evaluations = trained
  params, reported = evaluations[-1]
  runner = train.make_runner(tiny_config())
  sources = [runner.task.vocab.encode(s) for s, _ in runner.pairs]
  src_BS = np.full((len(sources), runner.eval_batches[0]["src"].shape[1]), PAD, np.int32)
  for row, ids in zip(src_BS, sources):
    row[:len(ids)] = ids
  length = runner.eval_batches[0]["tgt_out"].shape[1]  # the runner's answer budget
  tokens = greedy_by_recomputation(runner.model, params, src_BS, length)
  answers = [runner.task.vocab.decode(row) for row in tokens]  # up to EOS
  assert runner.decode(params) == answers
  refs = [t for _, t in runner.pairs]
  exact = np.mean([a == r for a, r in zip(answers, refs)])
  assert reported["eval/exact_match"] == summary["eval_exact_match"] == exact


def test_exact_match_counts_answers_equal_to_the_target(trained, monkeypatch):
  """A quarter of the answers right (the model's own answers are wrong): exact match 0.25."""
  _, _, evaluations = trained
  runner = train.make_runner(tiny_config())
  refs = [t for _, t in runner.pairs]
  answers = [r if i % 4 == 0 else r + "x" for i, r in enumerate(refs)]
  monkeypatch.setattr(runner, "decode", lambda params: answers)
  assert runner.evaluate(evaluations[-1][0])["eval/exact_match"] == 0.25


class Killed(Exception):
  pass


def test_killed_and_resumed_run_equals_uninterrupted(trained, tmp_path, monkeypatch):
  """Killed at step 13 (checkpoint at 10), restarted: same metrics as one uninterrupted run."""
  uninterrupted_dir, uninterrupted, _ = trained
  batch_fn = data.train_batch

  def dies_at_13(task, seed, step, *args):
    if step == 13:
      raise Killed()
    return batch_fn(task, seed, step, *args)

  monkeypatch.setattr(data, "train_batch", dies_at_13)
  with pytest.raises(Killed):
    train.train_and_evaluate(tiny_config(), str(tmp_path))
  assert max(r["step"] for r in metrics.read_rows(str(tmp_path))) == 10
  monkeypatch.setattr(data, "train_batch", batch_fn)
  resumed = train.train_and_evaluate(tiny_config(), str(tmp_path))
  assert resumed == uninterrupted
  assert metrics.read_rows(str(tmp_path)) == metrics.read_rows(uninterrupted_dir)


def test_resume_skips_unreadable_checkpoints(trained, tmp_path, capsys):
  """Newest checkpoint truncated and an empty later one: resume from 10, same final metrics."""
  uninterrupted_dir, uninterrupted, _ = trained
  workdir = str(tmp_path / "run")
  shutil.copytree(uninterrupted_dir, workdir)
  saved = os.path.join(workdir, "checkpoints")
  _truncate_files(os.path.join(saved, "20"))
  os.makedirs(os.path.join(saved, "30"))
  capsys.readouterr()
  resumed = train.train_and_evaluate(tiny_config(), workdir)
  skipped = [line for line in capsys.readouterr().err.splitlines()
             if line.startswith("skipped unreadable checkpoint")]
  assert [line.split()[3] for line in skipped] == [os.path.join(saved, "30"),
                                                    os.path.join(saved, "20")]
  assert sorted(os.listdir(os.path.join(workdir, checkpoints.UNREADABLE_DIR))) == ["20", "30"]
  assert resumed == uninterrupted
  assert metrics.read_rows(workdir) == metrics.read_rows(uninterrupted_dir)
  again = train.train_and_evaluate(tiny_config(), workdir)  # step 20 was saved afresh
  assert "skipped unreadable" not in capsys.readouterr().err
  assert again == resumed


def test_no_readable_checkpoint_raises(trained, tmp_path):
  workdir = str(tmp_path / "run")
  shutil.copytree(trained[0], workdir)
  saved = os.path.join(workdir, "checkpoints")
  for step in ("10", "20"):
    _truncate_files(os.path.join(saved, step))
  with pytest.raises(RuntimeError, match=f"no readable checkpoint in {re.escape(saved)}"):
    train.train_and_evaluate(tiny_config(), workdir)
  assert sorted(os.listdir(saved)) == ["10", "20"]  # left for the user to inspect


def file_bytes(folder) -> dict[str, bytes]:
  """Every file under `folder`, by path relative to it: its bytes."""
  out = {}
  for root, _, files in os.walk(folder):
    for name in files:
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, folder)] = f.read()
  return out


def assert_resume_refused(workdir, config, differences):
  """Resuming `workdir`'s run with `config` raises a ValueError that names each of
  `differences` and suggests a new workdir; no file of the workdir changes."""
  before = file_bytes(workdir)
  with pytest.raises(ValueError, match="trained with other settings") as refusal:
    train.train_and_evaluate(config, workdir)
  message = str(refusal.value)
  assert all(difference in message for difference in differences), message
  assert "new --workdir" in message
  assert file_bytes(workdir) == before


def test_resume_with_another_model_is_refused_and_changes_nothing(trained, tmp_path):
  workdir = str(tmp_path / "run")
  shutil.copytree(trained[0], workdir)
  config = tiny_config()
  config.model.d_ff, config.seed = 128, 3
  assert_resume_refused(workdir, config, ["model.d_ff: 64 (saved) != 128 (given)",
                                          "seed: 0 (saved) != 3 (given)"])


def test_checkpoints_refuse_another_model_without_config_json(trained, tmp_path):
  """Each checkpoint records its run's config: the check holds with config.json gone."""
  workdir = str(tmp_path / "run")
  shutil.copytree(trained[0], workdir)
  os.remove(os.path.join(workdir, run_config.CONFIG_FILE))
  config = tiny_config()
  config.task.kwargs.max_len = 9
  assert_resume_refused(workdir, config, ["task.kwargs.max_len: 8 (saved) != 9 (given)"])


def test_refused_resume_from_the_command_line_says_why_first(tmp_path):
  """One line on stderr naming the setting, no traceback, no orbax teardown noise."""
  workdir = tmp_path / "run"
  workdir.mkdir()
  run_config.write(str(workdir), dates.get_config("tiny"))
  before = file_bytes(workdir)
  result = subprocess.run(
      [sys.executable, "-m", "experiments.train", "--config", "configs/dates.py:tiny",
       "--workdir", str(workdir), "--config.model.d_ff=128"],
      capture_output=True, text=True, cwd=REPO, timeout=120)
  assert result.returncode == 1
  assert result.stderr.startswith(f"error: {workdir} was trained with other settings: "
                                  "model.d_ff: 64 (saved) != 128 (given)"), result.stderr[-2000:]
  assert "Traceback" not in result.stderr and "Event loop is closed" not in result.stderr
  assert file_bytes(workdir) == before


def test_bad_config_value_fails_from_the_command_line(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "experiments.train", "--config", "configs/dates.py:tiny",
       "--workdir", str(tmp_path / "run"), "--config.eval.every=0"],
      capture_output=True, text=True, cwd=REPO, timeout=120)
  assert result.returncode != 0
  assert "config.eval.every must be a positive int, got 0" in result.stderr
  assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_text_target_reports_bleu_and_chrf(tmp_path):
  """German number words (a text target): BLEU/chrF from the greedy decodings."""
  config = num2words_de.get_config("words,tiny")
  config.task.kwargs.max_value = 100  # short words (<= 16 characters): one shape
  config.train.update(steps=4, log_every=2, checkpoint_every=4)
  config.eval.update(every=4, num_examples=8, batch_size=8)
  summary = train.train_and_evaluate(config, str(tmp_path))
  assert 0.0 <= summary["eval_bleu"] <= 100.0 and 0.0 <= summary["eval_chrf"] <= 100.0


def test_greedy_decodings_are_vocabulary_strings(trained):
  del trained  # run after it: the compilation cache then holds the decoder
  config = tiny_config()
  runner = train.make_runner(config)
  state = train.init_state(runner, train.make_optimizer(config.train))
  hyps = runner.decode(state.params)
  assert len(hyps) == len(runner.pairs) == config.eval.num_examples
  assert all(runner.task.vocab.decode(runner.task.vocab.encode(h)) == h for h in hyps)


def test_unknown_config_key_raises(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "experiments.train", "--config", "configs/dates.py:tiny",
       "--workdir", str(tmp_path), "--config.train.no_such_key=1"],
      capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)), timeout=120)
  assert result.returncode != 0 and "no_such_key" in result.stderr
  assert not os.path.exists(os.path.join(tmp_path, "metrics.jsonl"))


@pytest.mark.slow
def test_copy_is_learned(tmp_path):
  """The copy task is learned end to end. Its loss sits on a plateau (~0.54) before the model
  finds the copy: seed 0 leaves it between steps 300 and 800 (exact match 0.80 at 400, 0.98 at
  800; seeds 1 and 2: 0.98 and 0.91 at 400), so the run takes 800 steps."""
  config = tiny_config(steps=800)
  config.model.update(d_model=64, d_ff=128)
  config.train.update(batch_size=64, peak_lr=3e-3, warmup_steps=50, log_every=100,
                      checkpoint_every=800)
  config.eval.update(every=800, num_examples=64, batch_size=64)
  summary = train.train_and_evaluate(config, str(tmp_path))
  assert summary["eval_exact_match"] > 0.9
  np.testing.assert_array_less(0.95, summary["eval_token_accuracy"])
