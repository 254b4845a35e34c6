"""The decoder-only language model's side of the runner: batches, loss, generation, evaluation.

`experiments.train` trains either model with the same loop, checkpoints and metrics; this module
holds what differs for `flax_mha.models.lm.DecoderLM` (packed documents with segment ids, an answer
generated after the prompt `source BOS`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from experiments import lm_data
from experiments.losses import cross_entropy
from experiments.tasks import Task
from flax_mha.checks import check_token_ids
from flax_mha.models.lm import DecoderLM, LMConfig


def model_config(config, task: Task) -> LMConfig:
  return LMConfig(vocab_size=task.vocab.size, **config.model)


def init_batch(config, task: Task) -> dict[str, np.ndarray]:
  return lm_data.train_batch(task, config.seed, 0, 2, config.train.length)


def train_batch(config, task: Task, step: int) -> dict[str, np.ndarray]:
  """Training batch `step` (0-based): packed documents, a pure function of (seed, step)."""
  return lm_data.train_batch(task, config.seed, step, config.train.batch_size,
                             config.train.length)


def apply(model: DecoderLM, params, batch, **kwargs):
  return model.apply({"params": params}, batch["tokens"], batch["segment_ids"],
                     batch["positions"], **kwargs)


def loss_terms(logits_BLC, batch, label_smoothing: float):
  """(sum of losses, sum of correct argmaxes, number of answer tokens) over the weighted tokens."""
  weights_BL = batch["weights"]
  targets_BL = jnp.where(weights_BL > 0, batch["targets"], 0)  # pad (0) where not scored
  return cross_entropy(logits_BLC, targets_BL, label_smoothing)


@functools.partial(jax.jit, static_argnums=(0, 4))
def generate(model: DecoderLM, params, prompts_BL, prompt_lengths_B, max_new: int):
  """Greedy continuation of each prompt (recomputing the prefix each step): tokens [B, L] with
  the answer written after the prompt; positions past the prompt plus what was generated are
  their own padding segment (0), invisible to the rest."""
  length = prompts_BL.shape[1]
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), prompts_BL.shape)

  def step(t, tokens):
    last = prompt_lengths_B + t - 1  # the position whose next token we predict
    segments = (positions <= last[:, None]).astype(jnp.int32)
    logits = model.apply({"params": params}, tokens, segments, positions)
    nxt = jnp.argmax(jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0], axis=-1)
    write = jnp.minimum(last + 1, length - 1)
    return tokens.at[jnp.arange(tokens.shape[0]), write].set(nxt.astype(tokens.dtype))

  return jax.lax.fori_loop(0, max_new, step, prompts_BL)


class Evaluator:
  """Held-out metrics: teacher-forced loss / token accuracy on packed held-out documents, and
  exact match of the greedy answer to each held-out prompt."""

  def __init__(self, config, task: Task, model: DecoderLM):
    self.task, self.model = task, model
    self.pairs = lm_data.eval_pairs(task, config.seed, config.eval.num_examples)
    docs = [lm_data.document(task, s, t) for s, t in self.pairs]
    self.packed = lm_data.pack(docs, lm_data.rows_needed(docs, config.train.length),
                               config.train.length)
    longest = max(len(t) for _, t in self.pairs) + 1  # the answer and its EOS
    self.max_new = longest
    self.length = max(len(task.vocab.encode(s)) for s, _ in self.pairs) + 1 + longest
    self.batch_size = config.eval.batch_size
    self._loss = jax.jit(lambda p, b: loss_terms(apply(model, p, b), b, 0.0))

  def decode(self, params) -> list[str]:
    """Greedy answers to the held-out prompts, in order."""
    out = []
    for i in range(0, len(self.pairs), self.batch_size):
      chunk = self.pairs[i:i + self.batch_size]
      chunk = chunk + [chunk[-1]] * (self.batch_size - len(chunk))  # one shape: one compilation
      prompts, lengths = lm_data.prompts(self.task, chunk, self.length)
      check_token_ids("prompts", prompts, self.task.vocab.size)
      tokens = np.asarray(generate(self.model, params, prompts, lengths, self.max_new))
      out += [self.task.vocab.decode(row[n:]) for row, n in zip(tokens, lengths)]
    return out[:len(self.pairs)]

  def __call__(self, params) -> dict[str, float]:
    loss, correct, count = jax.device_get(self._loss(params, self.packed))
    hyps = self.decode(params)
    exact = np.mean([h == t for h, (_, t) in zip(hyps, self.pairs)])
    return {"eval/loss": float(loss / count), "eval/token_accuracy": float(correct / count),
            "eval/exact_match": float(exact)}

