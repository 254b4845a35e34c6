"""End-to-end training of the tiny configs: metrics, plots, checkpoints, exact resume, decoding."""

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags

from configs import algorithmic, dates, dates_long, num2words_de
from experiments import data, metrics, train
from tests.multidevice.run import run_check

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUMMARY_KEYS = {"task", "steps", "train_seconds", "eval_token_accuracy", "eval_exact_match",
                "params"}
TIMING_KEYS = {"train_seconds", "steps_per_second", "train/tokens_per_second"}


def tiny_config(steps=20):
  """Copy of strings of length <= 8: every batch has the same shape, so one compilation."""
  config = algorithmic.get_config("copy,tiny")
  config.task.kwargs.max_len = 8
  config.train.steps = steps
  return config


def _untimed(row):
  return {k: v for k, v in row.items() if k not in TIMING_KEYS}


def _truncate_files(folder):
  """Cut every file under `folder` to 0 bytes: a checkpoint whose save never completed."""
  for root, _, files in os.walk(folder):
    for name in files:
      os.truncate(os.path.join(root, name), 0)


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
  """Every run here compiles the same few programs: share them through jax's persistent cache."""
  names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
  before = [getattr(jax.config, name) for name in names]
  jax.config.update(names[0], str(tmp_path_factory.mktemp("jax_cache")))
  jax.config.update(names[1], 0.0)
  yield
  for name, value in zip(names, before):
    jax.config.update(name, value)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("copy"))
  return workdir, train.train_and_evaluate(tiny_config(), workdir)


def test_loss_goes_down(trained):
  workdir, _ = trained
  losses = [r["train/loss"] for r in metrics.read_rows(workdir) if "train/loss" in r]
  uniform = np.log(train.get_task("copy").vocab.size)  # the loss of a uniform guess, roughly
  assert len(losses) == 4 and losses[-1] < 0.95 * losses[0] and losses[-1] < 0.8 * uniform


def test_summary_metrics_and_plots_written(trained):
  workdir, summary = trained
  with open(os.path.join(workdir, "summary.json")) as f:
    assert json.load(f) == summary
  assert SUMMARY_KEYS <= set(summary) and summary["steps"] == 20 and summary["task"] == "copy"
  assert 0.0 <= summary["eval_exact_match"] <= summary["eval_token_accuracy"] <= 1.0
  rows = metrics.read_rows(workdir)
  assert [r["step"] for r in rows if "eval/exact_match" in r] == [10, 20]
  for name in ("learning_curves.png", "cross_attention.png", "encoder_self_attention.png"):
    with open(os.path.join(workdir, name), "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert os.listdir(os.path.join(workdir, "tensorboard"))


def test_checkpoint_round_trip(trained):
  """A finished workdir restores its final state: re-evaluating it reproduces the summary."""
  workdir, summary = trained
  again = train.train_and_evaluate(tiny_config(), workdir)
  assert _untimed(again) == _untimed(summary)


class Killed(Exception):
  pass


def test_killed_and_resumed_run_equals_uninterrupted(trained, tmp_path, monkeypatch):
  """Killed at step 13 (checkpoint at 10), restarted: same metrics as one uninterrupted run."""
  uninterrupted_dir, uninterrupted = trained
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
  assert _untimed(resumed) == _untimed(uninterrupted)
  assert ([_untimed(r) for r in metrics.read_rows(str(tmp_path))]
          == [_untimed(r) for r in metrics.read_rows(uninterrupted_dir)])


def test_resume_skips_unreadable_checkpoints(trained, tmp_path, capsys):
  """Newest checkpoint truncated and an empty later one: resume from 10, same final metrics."""
  uninterrupted_dir, uninterrupted = trained
  workdir = str(tmp_path / "run")
  shutil.copytree(uninterrupted_dir, workdir)
  checkpoints = os.path.join(workdir, "checkpoints")
  _truncate_files(os.path.join(checkpoints, "20"))
  os.makedirs(os.path.join(checkpoints, "30"))
  capsys.readouterr()
  resumed = train.train_and_evaluate(tiny_config(), workdir)
  skipped = [line for line in capsys.readouterr().err.splitlines()
             if line.startswith("skipped unreadable checkpoint")]
  assert [line.split()[3] for line in skipped] == [os.path.join(checkpoints, "30"),
                                                    os.path.join(checkpoints, "20")]
  assert sorted(os.listdir(os.path.join(workdir, train.UNREADABLE_DIR))) == ["20", "30"]
  assert _untimed(resumed) == _untimed(uninterrupted)
  assert ([_untimed(r) for r in metrics.read_rows(workdir)]
          == [_untimed(r) for r in metrics.read_rows(uninterrupted_dir)])
  again = train.train_and_evaluate(tiny_config(), workdir)  # step 20 was saved afresh
  assert "skipped unreadable" not in capsys.readouterr().err
  assert _untimed(again) == _untimed(resumed)


def test_no_readable_checkpoint_raises(trained, tmp_path):
  workdir = str(tmp_path / "run")
  shutil.copytree(trained[0], workdir)
  checkpoints = os.path.join(workdir, "checkpoints")
  for step in ("10", "20"):
    _truncate_files(os.path.join(checkpoints, step))
  with pytest.raises(RuntimeError, match=f"no readable checkpoint in {re.escape(checkpoints)}"):
    train.train_and_evaluate(tiny_config(), workdir)
  assert sorted(os.listdir(checkpoints)) == ["10", "20"]  # left for the user to inspect


def test_learning_rate_schedule():
  """Linear warm-up to the peak at step w, then peak * sqrt(w / step); w=0 means no warm-up."""
  def lr(warmup, counts):  # optax passes count = step - 1
    schedule = train.learning_rate_schedule(2.0, warmup)
    return [float(schedule(c)) for c in counts]

  np.testing.assert_allclose(lr(4, [0, 1, 3, 15]), [0.5, 1.0, 2.0, 1.0], rtol=1e-6)
  np.testing.assert_allclose(lr(0, [0, 3, 99]), [2.0, 1.0, 0.2], rtol=1e-6)
  np.testing.assert_allclose(lr(1, [0, 3, 99]), [2.0, 1.0, 0.2], rtol=1e-6)
  with pytest.raises(ValueError, match="warmup_steps must be >= 0, got -1"):
    train.learning_rate_schedule(2.0, -1)


@pytest.mark.parametrize("key,value,message", [
    ("train.steps", -5, "config.train.steps must be a positive int, got -5"),
    ("train.steps", 0, "config.train.steps must be a positive int, got 0"),
    ("train.batch_size", 0, "config.train.batch_size must be a positive int, got 0"),
    ("train.peak_lr", 0.0, "config.train.peak_lr must be a finite number > 0, got 0.0"),
    ("train.peak_lr", float("nan"), "config.train.peak_lr must be a finite number > 0, got nan"),
    ("train.warmup_steps", -1, "config.train.warmup_steps must be an int >= 0, got -1"),
    ("train.log_every", 0, "config.train.log_every must be a positive int, got 0"),
    ("train.checkpoint_every", 0, "config.train.checkpoint_every must be a positive int, got 0"),
    ("train.bucket_window", 0, "config.train.bucket_window must be a positive int, got 0"),
    ("train.label_smoothing", 1.0, "config.train.label_smoothing must be a finite number in "
                                   "[0, 1), got 1.0"),
    ("train.grad_clip_norm", 0.0, "config.train.grad_clip_norm must be a finite number > 0"),
    ("train.weight_decay", -0.1, "config.train.weight_decay must be a finite number >= 0"),
    ("train.length_buckets", (), "config.train.length_buckets must be a non-empty sequence"),
    ("eval.every", 0, "config.eval.every must be a positive int, got 0"),
    ("eval.num_examples", 0, "config.eval.num_examples must be a positive int, got 0"),
    ("eval.batch_size", -2, "config.eval.batch_size must be a positive int, got -2"),
    ("seed", -1, "config.seed must be an int >= 0, got -1"),
])
def test_bad_config_values_raise_before_anything_runs(tmp_path, key, value, message):
  config = tiny_config()
  *parents, last = key.split(".")
  node = config
  for name in parents:
    node = node[name]
  node[last] = value
  workdir = tmp_path / "run"
  with pytest.raises(ValueError, match=re.escape(message)):
    train.train_and_evaluate(config, str(workdir))
  assert not workdir.exists()


def test_bad_config_value_fails_from_the_command_line(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "experiments.train", "--config", "configs/dates.py:tiny",
       "--workdir", str(tmp_path / "run"), "--config.eval.every=0"],
      capture_output=True, text=True, cwd=REPO, timeout=120)
  assert result.returncode != 0
  assert "config.eval.every must be a positive int, got 0" in result.stderr
  assert not (tmp_path / "run").exists()


def test_attention_dropout_rate_reaches_the_model(monkeypatch):
  """configs/common.py defines the key, so the locked config takes it from the command line."""
  argv = ["train", f"--config={REPO}/configs/dates.py:tiny",
          "--config.model.attention_dropout_rate=0.1"]
  monkeypatch.setattr(sys, "argv", argv)  # config_flags reads its overrides from sys.argv
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "experiment config", flag_values=flag_values,
                                  lock_config=True)
  flag_values(argv)
  config = flag_values.config
  task = train.get_task(config.task.name, **config.task.kwargs)
  cfg = train.model_config(config, task)
  assert (cfg.attention_dropout_rate, cfg.dropout_rate) == (0.1, 0.1)
  default = train.model_config(dates.get_config("tiny"), task)
  assert (default.attention_dropout_rate, default.dropout_rate) == (0.0, 0.1)  # as before


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
  task = train.get_task(config.task.name, **config.task.kwargs)
  cfg = train.model_config(config, task)
  model = train.Transformer(cfg)
  evaluator = train.Evaluator(config, task, model, cfg)
  state = train.init_state(config, task, model, train.make_optimizer(config.train))
  hyps = evaluator.decode(state.params)
  assert len(hyps) == len(evaluator.pairs) == config.eval.num_examples
  assert all(task.vocab.decode(task.vocab.encode(h)) == h for h in hyps)


@pytest.mark.parametrize("module,arg", [
    (dates, None), (dates, "tiny"), (dates_long, None), (num2words_de, None),
    (num2words_de, "words,tiny"), (algorithmic, "reverse"), (algorithmic, "sort,tiny"),
    (algorithmic, "addition")])
def test_configs_build_their_task(module, arg):
  config = module.get_config(arg)
  task = train.get_task(config.task.name, **config.task.kwargs)
  assert train.model_config(config, task).vocab_size == task.vocab.size
  with pytest.raises(ValueError):
    module.get_config("no_such_variant")


def test_unknown_config_key_raises(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "experiments.train", "--config", "configs/dates.py:tiny",
       "--workdir", str(tmp_path), "--config.train.no_such_key=1"],
      capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)), timeout=120)
  assert result.returncode != 0 and "no_such_key" in result.stderr
  assert not os.path.exists(os.path.join(tmp_path, "metrics.jsonl"))


@pytest.mark.slow
def test_copy_is_learned(tmp_path):
  config = tiny_config(steps=400)
  config.model.update(d_model=64, d_ff=128)
  config.train.update(batch_size=64, peak_lr=3e-3, warmup_steps=50, log_every=100,
                      checkpoint_every=400)
  config.eval.update(every=400, num_examples=64, batch_size=64)
  summary = train.train_and_evaluate(config, str(tmp_path))
  assert summary["eval_exact_match"] > 0.9
  np.testing.assert_array_less(0.95, summary["eval_token_accuracy"])


@pytest.mark.multidevice
def test_sharded_run_matches_single_device():
  """--config.mesh.{data,model,seq}=2 on 8 emulated devices logs the 1-device losses."""
  lines = run_check("check_train.py")
  assert any(line.startswith("OK runner layout") for line in lines), lines
  assert any(line.startswith("OK runner data_x_model_x_seq") for line in lines), lines


def test_mesh_must_divide_batch(tmp_path):
  config = tiny_config()
  config.mesh.data = 3
  with pytest.raises(ValueError, match="multiple of mesh.data=3"):
    train.train_and_evaluate(config, str(tmp_path))
  config.mesh.update(data=1, seq=3)
  with pytest.raises(ValueError, match="multiples of mesh.seq=3"):
    train.train_and_evaluate(config, str(tmp_path))
