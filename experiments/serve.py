"""Serve a model trained here over the OpenAI protocol: the newest checkpoint of a workdir of
configs/lm.py (the decoder-only LM), with the flags of `flax_mha.serving.http`.

  python -m experiments.serve --workdir runs/lm --port 8000
  python -m experiments.serve --workdir runs/lm --speculate ngram     # prompt lookup
  curl -s localhost:8000/v1/completions -H 'content-type: application/json' \\
      -d '{"model": "lm", "prompt": "3 août 2098", "max_tokens": 12, "temperature": 0}'

The LM answers `source BOS`: a prompt text is encoded character by character (a character
outside the run's vocabulary is a 400 naming it) and BOS appended, as experiments.generate
does; the answer stops at EOS. It has no chat template, so /v1/chat/completions answers 400.
The model's name is the workdir's base name unless --served-model-name says otherwise. A
workdir of another kind (the encoder-decoder Transformer) is refused by name.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from experiments import generate, run_config
from experiments.tasks import BOS, EOS, Vocab
from flax_mha.serving.http import cli
from flax_mha.serving.http.engine import Served


@dataclasses.dataclass(frozen=True)
class LMTokenizer:
  """The run's character vocabulary as the server's tokenizer: a prompt is `text BOS`."""
  vocab: Vocab

  @property
  def vocab_size(self) -> int:
    return self.vocab.size

  def encode(self, text: str) -> list[int]:
    return [*self.vocab.encode(text), BOS]

  def encode_chat(self, text: str) -> list[int]:
    return self.encode(text)

  def decode(self, ids) -> str:
    return self.vocab.decode(ids)


def lm_served(workdir: str, name: str | None = None) -> Served:
  """The newest checkpoint of an LM run, as the server serves it."""
  config = run_config.load(os.path.abspath(workdir))
  if config.get("kind", "seq2seq") != "lm":
    raise ValueError(f"{workdir} holds a {config.get('kind', 'seq2seq')} run; the server takes "
                     "a decoder-only LM (configs/lm.py)")
  runner, params = generate.restore_params(workdir)
  return Served(name or os.path.basename(os.path.abspath(workdir)), runner.model,
                {"params": params}, LMTokenizer(runner.task.vocab), None, (EOS,))


def _draft_model(workdir: str):
  """(model, variables) of --draft-checkpoint: here the workdir of an LM run on the same
  characters (a smaller one drafts for a larger)."""
  served = lm_served(workdir)
  return served.model, served.params


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m experiments.serve",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", required=True, help="a training run of configs/lm.py")
  cli.add_flags(parser)
  args = parser.parse_args(argv)
  try:
    served = lm_served(args.workdir, args.served_model_name)
    draft = cli.drafter(args, _draft_model)
  except (run_config.ConfigMismatch, ValueError, FileNotFoundError) as e:
    sys.exit(f"error: {e}")
  cli.serve(served, args, draft)


if __name__ == "__main__":
  main()
