"""What the training loop asks of a model kind, and the part both kinds' runners share.

`experiments.train` is the loop: steps, logging, checkpoints, the mesh. Everything that depends on
the model kind is a runner's: the sequence-to-sequence Transformer (`experiments.seq2seq`) or the
decoder-only LM (`experiments.lm`); `experiments.train.make_runner` picks one from config.kind.
"""

from __future__ import annotations

import jax
import ml_collections
import numpy as np
import sacrebleu

from experiments.tasks import Task, get_task
from flax_mha.checks import check_token_ids


class Runner:
  """Batches, loss, token count, evaluation, generation and artefacts of one model kind.

  A subclass sets `model` (a flax module taking `*inputs(batch)`), `pairs` (the held-out
  (source, target) strings) and `eval_batches` in its __init__, the class attributes below, and
  defines the methods that raise NotImplementedError here.

  Attributes:
    param_axes: the model's logical axes per parameter (flax_mha.parallel.sharding).
    token_names: the batch entries that hold token ids.
    token_order_free: whether the model reads token order only through attention (positions
      come with the batch) and the loss sums over tokens, so that a batch whose [B, L] arrays
      are all permuted alike trains alike: a sequence mesh then permutes each batch once into
      its layout (experiments.train).
    decode_length: new tokens the held-out answers are generated with (set by __init__).
  """
  param_axes: tuple
  token_names: tuple[str, ...]
  token_order_free: bool = False

  def __init__(self, config: ml_collections.ConfigDict):
    self.config = config
    self.task: Task = get_task(config.task.name, **config.task.kwargs)
    self._eval_loss = jax.jit(lambda params, batch: self.loss_terms(
        self.model.apply({"params": params}, *self.inputs(batch)), batch, 0.0))

  def train_batch(self, step: int) -> dict[str, np.ndarray]:
    """Training batch `step` (0-based): a pure function of (seed, step), its token ids checked
    against the vocabulary (inside jit a bad id would be a silent NaN)."""
    batch = self._train_batch(step)
    for name in self.token_names:
      check_token_ids(f"batch {step} {name}", batch[name], self.task.vocab.size)
    return batch

  def _train_batch(self, step: int) -> dict[str, np.ndarray]:
    raise NotImplementedError

  def init_batch(self) -> dict[str, np.ndarray]:
    """A small batch whose shapes initialise the parameters."""
    raise NotImplementedError

  @staticmethod
  def inputs(batch) -> tuple:
    """The model's positional inputs taken from a batch."""
    raise NotImplementedError

  @staticmethod
  def loss_terms(logits, batch, label_smoothing: float):
    """(sum of losses, sum of correct argmaxes, number of scored tokens): see losses.py."""
    raise NotImplementedError

  @staticmethod
  def num_tokens(batch) -> int:
    """Real (non-pad) tokens the model reads in a batch, each counted once: what tokens/s counts."""
    raise NotImplementedError

  def decode(self, params) -> list[str]:
    """Greedy answers to the held-out sources, in the order of `pairs`."""
    raise NotImplementedError

  def evaluate(self, params) -> dict[str, float]:
    """Held-out metrics: teacher-forced loss and token accuracy, exact match of the greedy
    answers, and BLEU / chrF where the target is text."""
    sums = [jax.device_get(self._eval_loss(params, batch)) for batch in self.eval_batches]
    loss, correct, count = np.sum(sums, axis=0)
    hyps = self.decode(params)
    refs = [target for _, target in self.pairs]
    out = {"eval/loss": float(loss / count), "eval/token_accuracy": float(correct / count),
           "eval/exact_match": float(np.mean([h == r for h, r in zip(hyps, refs)]))}
    if self.task.text_target:
      out["eval/bleu"] = sacrebleu.corpus_bleu(hyps, [refs]).score
      out["eval/chrf"] = sacrebleu.corpus_chrf(hyps, [refs]).score
    return out

  def generation_inputs(self, text: str):
    """(init_cache's context, the prompt [1, L] int32) that make the model answer `text`."""
    raise NotImplementedError

  def finish(self, params, workdir: str) -> None:
    """Write what the kind shows after training into `workdir` (nothing by default)."""
    del params, workdir
