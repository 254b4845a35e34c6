"""A model trained here over HTTP: `python -m experiments.serve --workdir DIR` on a tiny
configs/lm.py run, speculating with the run drafting for itself (`--speculate draft`), answers
the openai client with the run's own greedy answers (its held-out decoding), counts the drafts
kept in its metrics, names a character outside its vocabulary, refuses chat (no template), and a workdir
of the encoder-decoder model is refused in one line."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest

from configs import dates as dates_config
from configs import lm as lm_config
from experiments import generate, run_config, train
from flax_mha.serving.http import launch
from tests.multidevice.run import ROOT

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.integration


def test_a_trained_lm_answers_its_own_greedy_answers(tmp_path):
  config = lm_config.get_config("tiny")
  config.train.steps = 10
  train.train_and_evaluate(config, str(tmp_path))
  runner, params = generate.restore_params(str(tmp_path))
  sources = [source for source, _ in runner.pairs[:4]]
  want = runner.decode(params)[:4]
  flags = ["--batch-size", "2", "--max-length", "64", "--speculate", "draft",
           "--num-speculative-tokens", "3", "--draft-checkpoint", str(tmp_path)]
  with launch.Launched(["--workdir", str(tmp_path), *flags], module="experiments.serve",
                       cwd=ROOT) as server:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    name = client.models.list().data[0].id
    for source, answer in zip(sources, want):
      got = client.completions.create(model=name, prompt=source, temperature=0,
                                      max_tokens=runner.decode_length).choices[0]
      assert got.text == answer
    with pytest.raises(openai.BadRequestError, match="'☃' of '3 ☃ 2098' is not in the vocab"):
      client.completions.create(model=name, prompt="3 ☃ 2098", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="no chat template"):
      client.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}])
    page = httpx.get(server.url + "/metrics").text
    drafted, kept = (float(re.search(rf"^flax_mha_spec_decode_{what}_tokens_total (\S+)$", page,
                                     re.M).group(1)) for what in ("draft", "accepted"))
    assert 0 < kept == drafted, page  # the run drafting for itself: every draft kept
    assert server.stop() == 0


def test_an_encoder_decoder_workdir_is_refused_in_one_line(tmp_path):
  (tmp_path / run_config.CONFIG_FILE).write_text(dates_config.get_config("tiny").to_json())
  result = subprocess.run([sys.executable, "-m", "experiments.serve", "--workdir",
                           str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=300)
  assert result.returncode == 1
  assert result.stderr.strip().splitlines() == [
      f"error: {tmp_path} holds a seq2seq run; the server takes a decoder-only LM "
      "(configs/lm.py)"]
