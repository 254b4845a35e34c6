"""Training's checks that run before anything trains: config values and keys, the resume rules,
the learning-rate schedule, every config building its task. The tiny trainings themselves are
in tests/test_train_integration.py.

train.py's clock is replaced here by one that moves 1 s per training batch drawn and stands still
otherwise (the StepClock, which the integration part's trainings share), so timings are exact.
"""

import os
import re
import sys

import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags

from configs import algorithmic, dates, dates_long, lm_copy, num2words_de
from experiments import data, lm, run_config, seq2seq, tasks, train
from flax_mha.nn.options import Norm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(steps=20):
  """Copy of strings of length <= 8: every batch has the same shape, so one compilation."""
  config = algorithmic.get_config("copy,tiny")
  config.task.kwargs.max_len = 8
  config.train.steps = steps
  return config


class StepClock:
  """Stands in for train.py's `time`: 1 s passes per training batch drawn, none otherwise."""

  def __init__(self):
    self.now = 0.0

  def perf_counter(self):
    return self.now


def step_clock(monkeypatch, batch_module):
  """Install a StepClock in train.py that `batch_module.train_batch` advances."""
  clock, draw = StepClock(), batch_module.train_batch

  def ticking(*args, **kwargs):
    clock.now += 1.0
    return draw(*args, **kwargs)

  monkeypatch.setattr(train, "time", clock)
  monkeypatch.setattr(batch_module, "train_batch", ticking)
  return clock


@pytest.fixture(autouse=True)
def clock(monkeypatch):
  return step_clock(monkeypatch, data)


def test_settings_that_leave_the_checkpoints_alone_may_change():
  """Extending a run, its optimizer, logging, evaluation and mesh may change on resume; the
  model, task, seed and kind may not."""
  saved, given = tiny_config(), tiny_config()
  given.train.update(steps=40, peak_lr=1e-4, log_every=2, remat="layer")
  given.eval.update(every=3, num_examples=7)
  given.mesh.data = 2
  assert run_config.differences(run_config.as_dict(saved), given) == []
  given.model.num_heads, given.kind = 4, "lm"
  assert run_config.differences(run_config.as_dict(saved), given) == [
      "kind: (absent) (saved) != 'lm' (given)", "model.num_heads: 2 (saved) != 4 (given)"]


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


def test_cosine_schedule():
  """Linear warm-up to the peak at step w, then a cosine to 0 at the run's last step."""
  schedule = train.cosine_schedule(2.0, 4, 12)
  lr = [float(schedule(c)) for c in (0, 3, 7, 11, 20)]  # steps 1, 4, 8, 12 and past the end
  np.testing.assert_allclose(lr, [0.5, 2.0, 1.0, 0.0, 0.0], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(float(train.cosine_schedule(2.0, 0, 10)(0)), 2.0, rtol=1e-6)
  with pytest.raises(ValueError, match="warmup_steps must be >= 0, got -1"):
    train.cosine_schedule(2.0, -1, 10)


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
    ("mesh.fsdp", 0, "config.mesh.fsdp must be a positive int, got 0"),
    ("train.remat", "blocks", "config.train.remat must be one of ['none', 'layer', 'attention'], "
                              "got 'blocks'"),
    ("train.schedule", "linear", "config.train.schedule must be one of ('rsqrt', 'cosine'), "
                                 "got 'linear'"),
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


def test_unknown_model_kind_raises_before_anything_runs(tmp_path):
  config = tiny_config()
  config.kind = "gpt"
  with pytest.raises(ValueError, match=re.escape(
      "config.kind must be one of ['lm', 'seq2seq'], got 'gpt'")):
    train.train_and_evaluate(config, str(tmp_path / "run"))
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
  cfg = train.make_runner(flag_values.config).model.config
  assert (cfg.attention_dropout_rate, cfg.dropout_rate) == (0.1, 0.1)
  default = train.make_runner(dates.get_config("tiny")).model.config
  assert (default.attention_dropout_rate, default.dropout_rate) == (0.0, 0.1)  # as before


@pytest.mark.parametrize("module,arg", [
    (dates, None), (dates, "tiny"), (dates_long, None), (num2words_de, None),
    (num2words_de, "words,tiny"), (algorithmic, "reverse"), (algorithmic, "sort,tiny"),
    (algorithmic, "addition")])
def test_configs_build_their_task(module, arg):
  config = module.get_config(arg)
  task = tasks.get_task(config.task.name, **config.task.kwargs)
  assert seq2seq.model_config(config, task).vocab_size == task.vocab.size
  with pytest.raises(ValueError):
    module.get_config("no_such_variant")


@pytest.mark.parametrize("arg", [None, "draft", "tiny", "draft,tiny"])
def test_lm_copy_configs_name_their_norm_in_plain_values(arg):
  """configs/lm_copy.py says norm="rms" (a config.json holds plain values); the LM gets
  Llama's RMSNorm, no bias."""
  config = lm_copy.get_config(arg)
  task = tasks.get_task(config.task.name, **config.task.kwargs)
  cfg = lm.model_config(config, task)
  assert (cfg.norm, cfg.vocab_size) == (Norm("rms", 1e-6, use_bias=False), task.vocab.size)
  assert run_config.as_dict(config)["model"]["norm"] == "rms"
  with pytest.raises(ValueError):
    lm_copy.get_config("no_such_variant")
