"""The sequence-to-sequence Transformer's runner: length-bucketed batches, loss on the target,
greedy decoding with the KV cache, and the attention maps drawn after training."""

from __future__ import annotations

import os

import flax
import jax
import ml_collections
import numpy as np

from experiments import data, plots
from experiments.losses import cross_entropy
from experiments.runner import Runner
from experiments.tasks import BOS, EOS, PAD, Task
from flax_mha.models import transformer
from flax_mha.models.transformer import greedy_decode
from flax_mha.models.transformer import Transformer, TransformerConfig


def model_config(config: ml_collections.ConfigDict, task: Task) -> TransformerConfig:
  return TransformerConfig(vocab_size=task.vocab.size, pad_id=PAD, bos_id=BOS, eos_id=EOS,
                           **config.model)


class Seq2SeqRunner(Runner):
  """Batches {'src': [B, S], 'tgt_in': [B, T] (BOS, y...), 'tgt_out': [B, T] (y..., EOS)}."""
  param_axes = transformer.PARAM_AXES
  token_names = ("src", "tgt_in", "tgt_out")

  def __init__(self, config: ml_collections.ConfigDict, model: Transformer | None = None):
    """`model`: the Transformer to train; by default built from config.model (the training
    benchmark passes one with another attention module)."""
    super().__init__(config)
    self.model = Transformer(model_config(config, self.task)) if model is None else model
    self.pairs, self.eval_batches = data.eval_batches(
        self.task, config.seed, config.eval.num_examples, config.eval.batch_size,
        config.train.length_buckets)
    self.decode_length = max_len = self.eval_batches[0]["tgt_out"].shape[1]
    cfg = self.model.config
    self._decode = jax.jit(lambda params, src: greedy_decode(cfg, params, src, max_len=max_len))

  def _train_batch(self, step: int) -> dict[str, np.ndarray]:
    train = self.config.train
    return data.train_batch(self.task, self.config.seed, step, train.batch_size,
                            train.bucket_window, train.length_buckets)

  def init_batch(self) -> dict[str, np.ndarray]:
    return data.train_batch(self.task, self.config.seed, 0, 2, 1, self.config.train.length_buckets)

  @staticmethod
  def inputs(batch) -> tuple:
    return batch["src"], batch["tgt_in"]

  @staticmethod
  def loss_terms(logits, batch, label_smoothing: float):
    return cross_entropy(logits, batch["tgt_out"], label_smoothing)

  @staticmethod
  def num_tokens(batch) -> int:
    """Source tokens and the decoder's inputs (BOS and the target), pad excluded."""
    return int(np.sum(batch["src"] != PAD) + np.sum(batch["tgt_in"] != PAD))

  def decode(self, params) -> list[str]:
    tokens = [np.asarray(self._decode(params, b["src"])) for b in self.eval_batches]
    return [self.task.vocab.decode(row) for row in np.concatenate(tokens)][:len(self.pairs)]

  def generation_inputs(self, text: str):
    """The source to encode, and the decoder's prompt: BOS."""
    src = np.array([self.task.vocab.encode(text)], np.int32)
    return (src,), np.array([[BOS]], np.int32)

  def finish(self, params, workdir: str) -> None:
    """Attention maps of the first held-out example and its greedy decoding."""
    plot_attention(self.model, params, self.task, self.pairs[0][0], self.decode(params)[0],
                   workdir)


def _labels(text: str) -> list[str]:
  return ["␣" if c == " " else c for c in text]


def plot_attention(model: Transformer, params, task: Task, src: str, hyp: str,
                   workdir: str) -> None:
  """Cross-attention (last decoder layer) and encoder self-attention (last layer) per head."""
  src_ids = np.array([task.vocab.encode(src)], np.int32)
  tgt_in = np.array([[BOS, *task.vocab.encode(hyp)]], np.int32)
  _, state = model.apply({"params": params}, src_ids, tgt_in, sow_weights=True,
                         mutable=["intermediates"])
  inter = flax.traverse_util.flatten_dict(state["intermediates"], sep="/")

  def last(kind: str) -> np.ndarray:
    name = max(k for k in inter if kind in k and "attention_weights" in k)
    return np.asarray(inter[name][0])[0]  # sown as a 1-tuple; batch element 0 -> [H, T, S]

  plots.attention_maps(last("cross_attention"), _labels(hyp) + ["</s>"], _labels(src),
                       f"cross-attention: {src!r} -> {hyp!r}",
                       os.path.join(workdir, "cross_attention.png"))
  plots.attention_maps(last("encoder"), _labels(src), _labels(src),
                       f"encoder self-attention: {src!r}",
                       os.path.join(workdir, "encoder_self_attention.png"))
