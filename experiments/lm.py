"""The decoder-only language model's runner: packed batches, loss on the answer, generation.

Each (source, target) pair is a document `source BOS target EOS`, packed with others into rows
with segment ids (experiments.lm_data); the answer is generated after the prompt `source BOS`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from experiments import lm_data
from experiments.losses import cross_entropy
from experiments.runner import Runner
from experiments.tasks import BOS, EOS, PAD, Task
from flax_mha.checks import check_token_ids
from flax_mha.models import decoding
from flax_mha.models import lm as lm_model
from flax_mha.models.lm import DecoderLM, LMConfig
from flax_mha.nn.options import Norm


def model_config(config: ml_collections.ConfigDict, task: Task) -> LMConfig:
  """The LM of `config.model`, whose `norm`, where given, names the kind of a `Norm` ("layer",
  "rms"): a config holds plain values, as its workdir's config.json does."""
  fields = dict(config.model)
  if "norm" in fields:
    fields["norm"] = Norm(fields["norm"])
  return LMConfig(vocab_size=task.vocab.size, **fields)


@functools.partial(jax.jit, static_argnums=(0, 4))
def generate_by_recompute(model: DecoderLM, params, prompts_BL, prompt_lengths_B, max_new: int):
  """Greedy continuation of each prompt recomputing the whole prefix every step (no cache: the
  baseline of `python -m experiments.bench.generation`): tokens [B, L] with the answer written
  after the prompt; positions past the prompt plus what was generated are their own padding
  segment (0), invisible to the rest."""
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


class LMRunner(Runner):
  """Batches of packed rows: tokens, targets (the next token), weights (1 on the answer's
  targets), segment_ids and positions, all [B, L] (experiments.lm_data.pack)."""
  param_axes = lm_model.PARAM_AXES
  token_names = ("tokens", "targets")
  token_order_free = True  # rotary and segments read the batch's arrays; attention the layout

  def __init__(self, config: ml_collections.ConfigDict):
    super().__init__(config)
    self.model = DecoderLM(model_config(config, self.task))
    # Teacher-forced evaluation on the held-out documents packed like training rows; exact
    # match of the greedy answer to each held-out prompt.
    self.pairs = lm_data.eval_pairs(self.task, config.seed, config.eval.num_examples)
    docs = [lm_data.document(self.task, s, t) for s, t in self.pairs]
    length = config.train.length
    self.eval_batches = [lm_data.pack(docs, lm_data.rows_needed(docs, length), length)]
    self.decode_length = max(len(t) for _, t in self.pairs) + 1  # the longest answer and EOS
    self.prompt_room = max(len(self.task.vocab.encode(s)) for s, _ in self.pairs) + 1
    self.decode_batch_size = config.eval.batch_size

  def _train_batch(self, step: int) -> dict[str, np.ndarray]:
    return lm_data.train_batch(self.task, self.config.seed, step, self.config.train.batch_size,
                               self.config.train.length)

  def init_batch(self) -> dict[str, np.ndarray]:
    return lm_data.train_batch(self.task, self.config.seed, 0, 2, self.config.train.length)

  @staticmethod
  def inputs(batch) -> tuple:
    return batch["tokens"], batch["segment_ids"], batch["positions"]

  @staticmethod
  def loss_terms(logits_BLC, batch, label_smoothing: float):
    """cross_entropy over the weighted tokens: the answer's."""
    weights_BL = batch["weights"]
    targets_BL = jnp.where(weights_BL > 0, batch["targets"], 0)  # pad (0) where not scored
    return cross_entropy(logits_BLC, targets_BL, label_smoothing)

  @staticmethod
  def num_tokens(batch) -> int:
    """Tokens of the packed documents, pad excluded (targets are the same tokens shifted)."""
    return int(np.sum(batch["tokens"] != PAD))

  def generation_inputs(self, text: str):
    """The document's first half, `source BOS`, as the prompt (and init_cache's context)."""
    prompt = np.array([[*self.task.vocab.encode(text), BOS]], np.int32)
    return (prompt,), prompt

  def decode(self, params, cache_dtype=None) -> list[str]:
    """Greedy answers to the held-out prompts, generated with the KV cache (prompts of
    different lengths in one batch, each row at its own positions), stopping at EOS;
    `cache_dtype` as `decoding.generate`'s (jnp.int8: an int8 cache)."""
    out, size = [], self.decode_batch_size
    for i in range(0, len(self.pairs), size):
      chunk = self.pairs[i:i + size]
      chunk = chunk + [chunk[-1]] * (size - len(chunk))  # one shape: one compilation
      prompts, lengths = lm_data.prompts(self.task, chunk, self.prompt_room)
      check_token_ids("prompts", prompts, self.task.vocab.size)
      tokens = np.asarray(decoding.generate(
          self.model, {"params": params}, (prompts,), prompts, lengths,
          max_new_tokens=self.decode_length, stop_tokens=(EOS,), pad_id=PAD,
          cache_dtype=cache_dtype))
      out += [self.task.vocab.decode(row) for row in tokens]
    return out[:len(self.pairs)]
