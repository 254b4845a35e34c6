"""`python -m experiments.generate` on the tiny configs: a trained workdir answers prompts,
greedily (as the runner's own greedy decoding does) or by sampling (reproducible by seed);
a cut Hugging Face checkpoint is one line of stderr. Integration: each case but the last trains
a model first. The unit part is tests/test_generate_command.py."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import pytest

import hf_checkpoints as hc
from configs import dates as dates_config
from configs import lm as lm_config
from experiments import generate, train
from tests.multidevice.run import ROOT

import test_generate_command as unit_cases
from test_generate_command import checkpoint  # noqa: F401  (the moved case's fixture)

pytestmark = pytest.mark.integration

# Cases of tests/test_generate_command.py that compile for seconds: the unit part skips them
# (`check_` there), the integration part runs them here.
test_speculate_prints_plain_greedy_text_and_its_acceptance = (
    unit_cases.check_speculate_prints_plain_greedy_text_and_its_acceptance)


def _trained(kind, tmp_path):
  config = (dates_config if kind == "dates" else lm_config).get_config("tiny")
  config.train.steps = 10
  train.train_and_evaluate(config, str(tmp_path))
  return tmp_path


@pytest.mark.parametrize("kind", [
    pytest.param("dates", marks=pytest.mark.slow),  # 80 s of training; the lm's run in CI
    "lm"])
def test_a_trained_workdir_answers_prompts(kind, tmp_path):
  """One training per model (each test a process of its own under xdist would train again):
  greedy answers are the runner's own greedy decoding, printed one per prompt; samples are
  reproducible by seed; the command line (run for the LM) answers with a relative --workdir;
  a config.json edited to another model is refused by name."""
  workdir = _trained(kind, tmp_path)
  runner, params = generate.restore_params(str(workdir))
  sources = [source for source, _ in runner.pairs[:3]]
  out = io.StringIO()
  texts = generate.generate(str(workdir), sources, out=out)
  assert texts == runner.decode(params)[:3]
  assert out.getvalue().splitlines() == [f"{s} -> {t}" for s, t in zip(sources, texts)]

  sample = lambda seed: generate.generate(str(workdir), ["3 août 2098"], samples=3,
                                          temperature=1.5, seed=seed, out=io.StringIO())
  assert sample(4) == sample(4)
  assert len(sample(4)) == 3
  with pytest.raises(generate.PromptError, match=r"--prompt '3 ☃ 2098': character '☃'"):
    generate.generate(str(workdir), ["3 ☃ 2098"], out=io.StringIO())
  if kind == "lm":  # the command line is the same code for both models: one process
    _assert_the_command_line_answers(workdir)
  _assert_another_model_is_refused(workdir)


def _assert_the_command_line_answers(workdir):
  result = subprocess.run(
      [sys.executable, "-m", "experiments.generate", "--workdir",
       os.path.relpath(workdir, ROOT), "--prompt",  # a relative workdir, as a user types it
       "3 août 2098", "--top_k", "3", "--samples", "2", "--max_new_tokens", "8"],
      capture_output=True, text=True, cwd=ROOT, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  lines = result.stdout.splitlines()
  assert len(lines) == 2 and all(line.startswith("3 août 2098 -> ") for line in lines)
  result = subprocess.run(  # a prompt the vocabulary cannot encode: one line, no traceback
      [sys.executable, "-m", "experiments.generate", "--workdir", str(workdir), "--prompt",
       "3 ☃ 2098"], capture_output=True, text=True, cwd=ROOT, timeout=300)
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
  assert result.stderr.strip().splitlines()[-1].startswith("error: --prompt '3 ☃ 2098'")


def _assert_another_model_is_refused(workdir):
  """The workdir's config.json says d_ff=128 beside checkpoints of d_ff=64: a ValueError naming
  the setting, not orbax's shape errors."""
  path = os.path.join(workdir, "config.json")
  with open(path) as f:
    config = json.load(f)
  config["model"]["d_ff"] = 128
  with open(path, "w") as f:
    json.dump(config, f)
  with pytest.raises(ValueError, match=re.escape("model.d_ff: 64 (saved) != 128 (given)")):
    generate.restore_params(str(workdir))


def test_a_cut_checkpoint_is_one_line_of_stderr(tmp_path, rng):
  """--checkpoint with its model.safetensors cut in half: status 1 and the file named in one
  line, no traceback (the unit tests call main() in-process for each loader error)."""
  pytest.importorskip("safetensors")
  config = dict(model_type="llama", vocab_size=11, hidden_size=8, num_attention_heads=2,
                num_key_value_heads=1, num_hidden_layers=1, intermediate_size=12)
  directory = hc.write_checkpoint(tmp_path, config, hc.llama_tensors(config, rng))
  weights = directory / "model.safetensors"
  weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
  result = subprocess.run(
      [sys.executable, "-m", "experiments.generate", "--checkpoint", str(directory), "--prompt",
       "the cat"], capture_output=True, text=True, cwd=ROOT, timeout=300,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
  assert result.stderr.strip().splitlines()[-1].startswith(
      f"error: {weights} cannot be read as safetensors"), result.stderr[-2000:]


def test_a_prompt_past_gpt2_s_positions_is_one_line_of_stderr(tmp_path):
  """--checkpoint of GPT-2 (learned positions, a table of 128) and max_new_tokens past it: status
  1 and one line naming the limit (it printed a cut-off answer and exited 0, NaN logits read as
  token 0, the end-of-sequence id)."""
  pytest.importorskip("transformers")
  directory = hc.save_tiny("gpt2", tmp_path)
  result = subprocess.run(
      [sys.executable, "-m", "experiments.generate", "--checkpoint", str(directory), "--prompt",
       "the cat", "--max_new_tokens", "200"], capture_output=True, text=True, cwd=ROOT,
      timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("error: a prompt of ") and "max_new_tokens=200" in last, last
  assert "past the model's learned positions [0, 128)" in last, last
