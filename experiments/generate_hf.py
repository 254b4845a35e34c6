"""Generate text from a Hugging Face checkpoint directory: `python -m experiments.generate
--checkpoint DIR --prompt TEXT` runs this (see experiments/generate.py for the flags).

The directory holds config.json, the safetensors weights and tokenizer.json
(`flax_mha.models.hf` loads them, without torch). The prompts are encoded by the tokenizer as
it is configured (its post-processor adds a BOS token where the family's does), decoded
greedily or by sampling through `flax_mha.models.decoding.generate` (all prompts in one batch),
or with `serve=True` by continuous batching (`flax_mha.serving.serve`); a row stops at
the checkpoint's end-of-sequence ids (generation_config.json, else config.json). With
`samples=n` each prompt takes n rows of the batch (n requests when serving), each sampled with
its own draws.
"""

from __future__ import annotations

import sys
import time

import jax
import numpy as np

from flax_mha import checks
from flax_mha import serving
from flax_mha.models import decoding, hf, speculative


def generate(directory: str, prompts, *, samples: int = 1, max_new_tokens: int = 32,
             sampler=decoding.Greedy(), seed: int = 0, serve: bool = False, batch_size: int = 4,
             page_size: int = 16, dtype=None, speculate: str | None = None,
             num_speculative_tokens: int = 4, draft_checkpoint: str | None = None,
             out=None) -> list[str]:
  """Print each prompt with each of its `samples` continuations (a line each), then the new
  tokens per second (compilation included: one run of the command); return the continuations'
  texts, a prompt's samples side by side. out: a text stream (default: sys.stdout when called).
  speculate: None, "ngram" (prompt lookup) or "draft" (`draft_checkpoint`, a checkpoint with
  the same tokenizer): speculative decoding (`flax_mha.models.speculative`) of the one batch,
  its acceptance printed too.

  Raises what `hf.load` raises for the checkpoint; ValueError for a prompt that encodes to no
  tokens; TypeError or ValueError naming `samples` when it is not a positive int.
  """
  checks.check_int("samples", samples)
  drafter = _drafter(speculate, draft_checkpoint, dtype)
  out = sys.stdout if out is None else out
  model, variables = hf.load(directory, dtype=dtype)
  tokenizer = hf.load_tokenizer(directory)
  stops = hf.stop_tokens(directory)
  ids = [tokenizer.encode(text).ids for text in prompts]
  for text, row in zip(prompts, ids):
    if not row:
      raise ValueError(f"--prompt {text!r} encodes to no tokens")
  ids = [row for row in ids for _ in range(samples)]  # a row (a request) per sample
  rng = jax.random.key(seed)
  start = time.perf_counter()
  if serve:
    extra = 0 if drafter is None else num_speculative_tokens  # a round's writes past the end
    longest = max(map(len, ids)) + max_new_tokens + extra
    num_pages = batch_size * -(-longest // page_size)
    new, stats = serving.serve(model, variables, ids, max_new_tokens, batch_size=batch_size,
                               page_size=page_size, num_pages=num_pages, stop_tokens=stops,
                               sampler=sampler, rng=rng, drafter=drafter,
                               num_speculative_tokens=num_speculative_tokens)
    if drafter is not None:
      _acceptance(out, stats.accepted, stats.drafted)
  else:
    new = _batch(model, variables, ids, max_new_tokens, sampler, stops, rng, drafter,
                 num_speculative_tokens, out)
  seconds = time.perf_counter() - start
  texts = [tokenizer.decode(row, skip_special_tokens=True) for row in new]
  for row, continuation in enumerate(texts):
    out.write(f"{prompts[row // samples]}{continuation}\n")
  count = sum(map(len, new))
  out.write(f"{count} new tokens in {seconds:.2f} s ({count / seconds:.1f} tokens/s, "
            f"compilation included)\n")
  return texts


def _drafter(speculate, draft_checkpoint, dtype):
  """The drafter --speculate names (None without it). Raises ValueError for a combination the
  command does not take."""
  if speculate is None:
    if draft_checkpoint is not None:
      raise ValueError("--draft_checkpoint is the draft model of --speculate draft")
    return None
  if speculate == "ngram":
    return speculative.PromptLookup()
  if speculate == "draft":
    if draft_checkpoint is None:
      raise ValueError("--speculate draft needs --draft_checkpoint DIR (a checkpoint with the "
                       "same tokenizer)")
    return speculative.DraftModel(*hf.load(draft_checkpoint, dtype=dtype))
  raise ValueError(f"--speculate must be 'ngram' or 'draft', got {speculate!r}")


def _batch(model, variables, ids, max_new_tokens, sampler, stops, rng, drafter=None,
           num_speculative_tokens=4, out=None) -> list[list[int]]:
  """`decoding.generate` (with a drafter: `speculative.generate`, its acceptance written to
  `out`) of every prompt in one right-padded batch, each row cut after its first stop token."""
  prompts = np.zeros((len(ids), max(map(len, ids))), np.int32)
  for row, prompt in enumerate(ids):
    prompts[row, :len(prompt)] = prompt
  args = (model, variables, (prompts,), prompts, np.array([len(p) for p in ids], np.int32))
  kw = dict(max_new_tokens=max_new_tokens, sampler=sampler, stop_tokens=stops, rng=rng)
  if drafter is None:
    tokens = np.asarray(decoding.generate(*args, **kw))
  else:
    tokens, stats = speculative.generate_with_stats(
        *args, drafter=drafter, num_speculative_tokens=num_speculative_tokens, **kw)
    tokens = np.asarray(tokens)
    _acceptance(out, stats.accepted, stats.drafted, f", {stats.rounds} rounds of the model")
  return [serving.until_stop(row, stops) for row in tokens]


def _acceptance(out, accepted: int, drafted: int, more: str = "") -> None:
  share = f"{accepted / drafted:.0%}" if drafted else "none drafted"
  out.write(f"speculation: {accepted} of {drafted} drafts kept ({share}){more}\n")
