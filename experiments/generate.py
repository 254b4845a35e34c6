"""Generate from a trained run: the newest checkpoint of a workdir answers prompts, printed as
the tokens come.

  python -m experiments.generate --workdir runs/lm --prompt "3 août 2098"
  python -m experiments.generate --workdir runs/dates --prompt "AGOSTO 3, 2098" \\
      --prompt "03.08.98" --temperature 0.8 --top_k 5 --samples 3 --seed 1

The run's own config (<workdir>/config.json, written by experiments.train) rebuilds the model:
the Transformer answers a source, the LM continues `prompt BOS`. Greedy by default; with
--temperature, --top_k or --top_p it samples, reproducibly for a --seed. Decoding stops at EOS
or after --max_new_tokens (default: the length the run's held-out answers were decoded with).
A checkpoint saved with another model, task or seed than config.json says is refused by name.

A Hugging Face checkpoint directory generates text the same way (experiments/generate_hf.py):

  python -m experiments.generate --checkpoint path/to/llama --prompt "Once upon a time" \
      --max_new_tokens 64 [--serve --batch_size 4] [--dtype bfloat16] [--samples 3 --top_p 0.9] \
      [--speculate ngram | --speculate draft --draft_checkpoint DIR] [--num_speculative_tokens 4]

--dtype takes what `flax_mha.models.hf.load` takes: float32, bfloat16, float16, and float64 when
jax_enable_x64 is on (JAX_ENABLE_X64=1). An error in the workdir, the checkpoint or the prompts
prints one line, `error: <why>`, to stderr and exits with status 1.
"""

from __future__ import annotations

import os
import sys

import jax
from absl import app, flags, logging

from experiments import checkpoints, generate_hf, run_config, train
from experiments.tasks import EOS
from flax_mha.models import decoding, hf_config


def sampler_from(temperature: float, top_k: int | None, top_p: float | None):
  """Greedy for temperature 0 without top-k / top-p; otherwise sampling."""
  if temperature == 0.0 and top_k is None and top_p is None:
    return decoding.Greedy()
  return decoding.Sampling(temperature=temperature or 1.0, top_k=top_k, top_p=top_p)


def restore_params(workdir: str):
  """(runner, params) of the newest readable checkpoint in `workdir`."""
  workdir = os.path.abspath(workdir)  # orbax restores absolute paths only
  runner = train.make_runner(run_config.load(workdir))
  state = train.init_state(runner, train.make_optimizer(runner.config.train))
  with checkpoints.open_manager(workdir) as manager:
    if not manager.all_steps():
      raise FileNotFoundError(f"no checkpoint in {workdir}: train first (experiments.train)")
    state, _ = checkpoints.restore_newest_readable(
        manager, state, os.path.join(workdir, checkpoints.UNREADABLE_DIR), runner.config)
  return runner, state.params


class PromptError(ValueError):
  """A prompt the run's vocabulary cannot encode (a character it never saw)."""


def generate(workdir: str, prompts, *, samples: int = 1, max_new_tokens: int | None = None,
             temperature: float = 0.0, top_k=None, top_p=None, seed: int = 0, out=sys.stdout):
  """Print each prompt's continuation(s) to `out` as produced; return them as strings.
  max_new_tokens None: as many as the run's held-out answers were generated with."""
  runner, params = restore_params(workdir)
  max_new_tokens = runner.decode_length if max_new_tokens is None else max_new_tokens
  sampler = sampler_from(temperature, top_k, top_p)
  vocab, texts = runner.task.vocab, []
  for i, text in enumerate(prompts):
    try:
      context, prompt = runner.generation_inputs(text)
    except ValueError as e:
      raise PromptError(f"--prompt {text!r}: {e}") from None
    for n in range(samples):
      out.write(f"{text} -> ")
      tokens = []
      for token in decoding.stream(runner.model, {"params": params}, context, prompt,
                                   max_new_tokens=max_new_tokens, sampler=sampler,
                                   stop_tokens=(EOS,),
                                   rng=jax.random.fold_in(jax.random.key(seed), i * samples + n)):
        tokens.append(token)
        out.write(vocab.decode([token]))
        out.flush()
      out.write("\n")
      texts.append(vocab.decode(tokens))
  return texts


def main(argv, flag_values=flags.FLAGS):
  """The command line (`define_flags`'s flags, parsed into `flag_values`)."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  f = flag_values
  if (f.workdir is None) == (f.checkpoint is None):
    raise app.UsageError("give one of --workdir (a training run) and --checkpoint (a Hugging "
                         "Face checkpoint directory)")
  try:
    if f.checkpoint is not None:
      generate_hf.generate(
          f.checkpoint, f.prompt, samples=f.samples, max_new_tokens=f.max_new_tokens or 32,
          sampler=sampler_from(f.temperature, f.top_k, f.top_p), seed=f.seed, serve=f.serve,
          batch_size=f.batch_size, page_size=f.page_size, dtype=f.dtype,
          speculate=f.speculate, num_speculative_tokens=f.num_speculative_tokens,
          draft_checkpoint=f.draft_checkpoint)
      return
    if f.speculate is not None:
      raise ValueError("--speculate takes a --checkpoint (a training run's workdir streams "
                       "its answers token by token)")
    generate(f.workdir, f.prompt, samples=f.samples, max_new_tokens=f.max_new_tokens,
             temperature=f.temperature, top_k=f.top_k, top_p=f.top_p, seed=f.seed)
  # ValueError: PromptError, hf.CheckpointError; UnsupportedDtype: --dtype float64 without x64.
  except (run_config.ConfigMismatch, ValueError, FileNotFoundError,
          hf_config.UnsupportedDtype) as e:
    sys.exit(f"error: {e}")  # the reason alone: no traceback to read it in


def define_flags(flag_values=flags.FLAGS) -> None:
  """The command line's flags, on `flag_values` (a test passes a fresh `flags.FlagValues()`):
  importing this module defines none."""
  d = dict(flag_values=flag_values)
  flags.DEFINE_string("workdir", None, "a training run's workdir (experiments.train)", **d)
  flags.DEFINE_string("checkpoint", None, "a Hugging Face checkpoint directory (config.json, "
                      "safetensors, tokenizer.json) instead of a workdir", **d)
  flags.DEFINE_boolean("serve", False, "with --checkpoint: continuous batching (serving.serve) "
                       "instead of one batch (decoding.generate)", **d)
  flags.DEFINE_integer("batch_size", 4, "with --serve: rows decoded at once", lower_bound=1, **d)
  flags.DEFINE_integer("page_size", 16, "with --serve: tokens per cache page", lower_bound=1, **d)
  flags.DEFINE_enum("dtype", None, list(hf_config.LOAD_DTYPES), "with --checkpoint: the "
                    "parameters' and computation's dtype (default: the checkpoint's; float64 "
                    "needs JAX_ENABLE_X64=1)", **d)
  flags.DEFINE_enum("speculate", None, ["ngram", "draft"], "with --checkpoint: speculative "
                    "decoding, drafts by prompt lookup or by --draft_checkpoint", **d)
  flags.DEFINE_integer("num_speculative_tokens", 4, "with --speculate: drafts per round",
                       lower_bound=1, **d)
  flags.DEFINE_string("draft_checkpoint", None, "with --speculate draft: a checkpoint with the "
                      "same tokenizer that drafts", **d)
  flags.DEFINE_multi_string("prompt", None, "text to answer; repeat for several", **d)
  flags.DEFINE_integer("samples", 1, "continuations per prompt", lower_bound=1, **d)
  flags.DEFINE_integer("max_new_tokens", None, "tokens at most per continuation (default: the "
                       "run's held-out answers' length; 32 with --checkpoint)", lower_bound=1, **d)
  flags.DEFINE_float("temperature", 0.0, "0: greedy (unless top_k / top_p); else sampling",
                     lower_bound=0.0, **d)
  flags.DEFINE_integer("top_k", None, "sample among the k most likely tokens", lower_bound=1, **d)
  flags.DEFINE_float("top_p", None, "sample from the nucleus of this probability", lower_bound=0.0,
                     upper_bound=1.0, **d)
  flags.DEFINE_integer("seed", 0, "the sampling seed (same seed, same samples)", **d)
  flags.mark_flags_as_required(["prompt"], flag_values=flag_values)


if __name__ == "__main__":
  define_flags()
  app.run(main)
