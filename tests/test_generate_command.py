"""`python -m experiments.generate`: what it refuses before anything trains, and a Hugging Face
checkpoint written with NumPy through its main() in-process: each loader error one line (the
`error: ...` that Python prints to stderr, status 1), --samples and every --dtype the loader
takes. The trained workdirs answering prompts are in tests/test_generate_command_integration.py.
"""

from __future__ import annotations

import io
import json
import re

import jax
import numpy as np
import pytest
from absl import flags

import hf_checkpoints as hc
from experiments import generate, generate_hf
from flax_mha.models import decoding, hf


def test_a_directory_without_a_run_is_named(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json not found"):
    generate.restore_params(str(tmp_path))


def _main(*argv):
  """generate.main on `argv`, its flags defined on a FlagValues of its own."""
  flag_values = flags.FlagValues()
  generate.define_flags(flag_values)
  return generate.main(flag_values(["generate", *argv]), flag_values)


@pytest.fixture
def checkpoint(tmp_path, rng):
  """A tiny Llama checkpoint written with NumPy, with the tokenizer of tests/hf_checkpoints.py."""
  pytest.importorskip("safetensors")
  pytest.importorskip("tokenizers")
  tokenizer = hc.train_tokenizer(tmp_path)
  config = dict(model_type="llama", vocab_size=tokenizer.get_vocab_size(), hidden_size=16,
                num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
                intermediate_size=24, rms_norm_eps=1e-5, hidden_act="silu",
                tie_word_embeddings=False)
  return hc.write_checkpoint(tmp_path, config, hc.llama_tensors(config, rng))


def _cut(path):
  path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


@pytest.mark.parametrize("damage, dtype, file, match", [
    (lambda d: _cut(d / "model.safetensors"), "float32", "model.safetensors",
     "cannot be read as safetensors"),
    (lambda d: (d / "config.json").write_text("{"), "float32", "config.json",
     "is not valid JSON: Expecting property name enclosed in double quotes at line 1, column 2"),
    (lambda d: (d / "config.json").write_text(json.dumps({"model_type": "llama"})), "float32",
     "config.json", "the config lacks the key 'num_attention_heads', which a llama config needs"),
    (lambda d: None, "float64", None, "dtype 'float64' (float64) needs jax_enable_x64"),
], ids=["cut safetensors", "config not JSON", "config lacks a key", "float64 without x64"])
def test_each_loader_error_is_one_line_naming_the_file(checkpoint, damage, dtype, file, match):
  """SystemExit("error: ...") for a cut file, bad JSON, a missing key and float64 without x64:
  Python prints the message alone to stderr and exits with status 1, no traceback."""
  damage(checkpoint)
  with pytest.raises(SystemExit) as exit_:
    _main("--checkpoint", str(checkpoint), "--prompt", "the cat", "--dtype", dtype)
  message = exit_.value.code
  assert isinstance(message, str) and "\n" not in message, message
  named = f"error: {checkpoint / file}" if file else "error: "
  assert message.startswith(named) and match in message, message


def test_the_command_line_refuses_a_dtype_the_loader_does_not_take():
  with pytest.raises(flags.IllegalFlagValueError, match="int32"):
    _main("--checkpoint", "x", "--prompt", "p", "--dtype", "int32")


def test_dtype_takes_what_the_loader_takes(checkpoint, capsys, monkeypatch):
  """--dtype float16 (docs/hf.md: float16 checkpoints load): the parameters the decoder ran
  with are float16, and the prompt is answered."""
  loaded, load = [], hf.load

  def spy(*args, **kwargs):
    model, variables = load(*args, **kwargs)
    loaded.append({leaf.dtype for leaf in jax.tree.leaves(variables)})
    return model, variables

  monkeypatch.setattr(hf, "load", spy)
  _main("--checkpoint", str(checkpoint), "--prompt", "the cat", "--max_new_tokens", "2",
        "--dtype", "float16")
  assert loaded == [{np.dtype(np.float16)}]
  assert capsys.readouterr().out.startswith("the cat")


def test_samples_with_a_checkpoint_are_each_a_draw_of_their_own(checkpoint, capsys):
  """--samples 3 --temperature 1.0 prints three sampled continuations of the prompt, those of
  generate_hf.generate with the same seed, each row its own draws (three different texts)."""
  _main("--checkpoint", str(checkpoint), "--prompt", "the cat", "--samples", "3",
        "--temperature", "1.0", "--max_new_tokens", "6", "--seed", "1")
  printed = capsys.readouterr().out
  assert "\n18 new tokens in " in printed, printed  # 3 rows of 6
  texts = generate_hf.generate(str(checkpoint), ["the cat"], samples=3, max_new_tokens=6,
                               sampler=decoding.Sampling(temperature=1.0), seed=1,
                               out=io.StringIO())
  assert len(texts) == 3 and len(set(texts)) == 3, texts
  lines = "".join(f"the cat{text}\n" for text in texts)
  assert printed.startswith(lines) and printed[len(lines):].startswith("18 new tokens in "), printed


def check_speculate_prints_plain_greedy_text_and_its_acceptance(checkpoint, capsys):
  """--speculate ngram and --speculate draft (the checkpoint drafting for itself: every draft
  kept), in one batch and with --serve, print the text of plain greedy decoding, then the
  drafts kept; a combination the command does not take is one line."""
  _main("--checkpoint", str(checkpoint), "--prompt", "the cat the cat the", "--max_new_tokens",
        "8")
  plain = capsys.readouterr().out.splitlines()[0]
  for how in (["--speculate", "ngram"], ["--speculate", "ngram", "--serve"],
              ["--speculate", "draft", "--draft_checkpoint", str(checkpoint)]):
    _main("--checkpoint", str(checkpoint), "--prompt", "the cat the cat the",
          "--max_new_tokens", "8", "--num_speculative_tokens", "3", *how)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("speculation: ") and lines[1] == plain, lines
  kept, drafted = map(int, re.match(r"speculation: (\d+) of (\d+) drafts kept", lines[0]).groups())
  assert 0 < kept <= drafted, lines[0]  # the model drafting for itself: its drafts are kept
  with pytest.raises(SystemExit, match="--speculate draft needs --draft_checkpoint"):
    _main("--checkpoint", str(checkpoint), "--prompt", "x", "--speculate", "draft")
