"""Packed documents for the decoder-only language model, from the same generated tasks.

Each (source, target) pair becomes one document `source BOS target EOS` (BOS marks where the
answer starts); documents are packed back to back into rows of a fixed length, each with its own
segment id (1, 2, ...; 0 is padding) and positions restarting at 0. The loss covers the answer:
the tokens after BOS, EOS included. Every batch is a pure function of (task, seed, step), so a
resumed run sees the batches an uninterrupted run would.
"""

from __future__ import annotations

import numpy as np

from experiments.data import sample_pairs
from experiments.tasks import BOS, EOS, PAD, Task

_TRAIN_STREAM, _EVAL_STREAM = 2, 3


def document(task: Task, source: str, target: str) -> tuple[list[int], list[float]]:
  """(tokens, loss weights) of one document: weight 1 where the next token is the answer's."""
  src, tgt = task.vocab.encode(source), task.vocab.encode(target)
  tokens = [*src, BOS, *tgt, EOS]
  weights = [0.0] * len(src) + [1.0] * (len(tgt) + 1) + [0.0]  # predict tgt..., EOS from BOS on
  return tokens, weights


def pack(docs, batch_size: int, length: int) -> dict[str, np.ndarray]:
  """Greedily pack (tokens, weights) documents into [batch_size, length] rows.

  Returns tokens, targets (next token; PAD at a document's end), weights, segment_ids, positions
  (all [B, L]); documents that don't fit are dropped.
  """
  out = {k: np.zeros((batch_size, length), np.int32)
         for k in ("tokens", "targets", "segment_ids", "positions")}
  out["tokens"][:], out["targets"][:] = PAD, PAD
  out["weights"] = np.zeros((batch_size, length), np.float32)
  row, col, seg = 0, 0, 1
  for tokens, weights in docs:
    n = len(tokens)
    if n > length:
      raise ValueError(f"a document of {n} tokens does not fit rows of length {length}")
    if col + n > length:
      row, col, seg = row + 1, 0, 1
      if row == batch_size:
        break
    sl = slice(col, col + n)
    out["tokens"][row, sl] = tokens
    out["targets"][row, col:col + n - 1] = tokens[1:]
    out["weights"][row, col:col + n - 1] = weights[:-1]
    out["segment_ids"][row, sl] = seg
    out["positions"][row, sl] = np.arange(n)
    col, seg = col + n, seg + 1
  return out


def rows_needed(docs, length: int) -> int:
  """Rows of `length` that `pack` fills with all of `docs`."""
  rows, col = 1, 0
  for tokens, _ in docs:
    if col + len(tokens) > length:
      rows, col = rows + 1, 0
    col += len(tokens)
  return rows


def train_batch(task: Task, seed: int, step: int, batch_size: int,
                length: int) -> dict[str, np.ndarray]:
  """Packed training batch number `step`: enough documents drawn to fill every row."""
  rng = np.random.default_rng([seed, _TRAIN_STREAM, step])
  docs = []
  room = batch_size * length
  while room > 0:
    doc = document(task, *sample_pairs(task, "train", rng, 1)[0])
    docs.append(doc)
    room -= len(doc[0])
  return pack(docs, batch_size, length)


def eval_pairs(task: Task, seed: int, num_examples: int) -> list[tuple[str, str]]:
  return sample_pairs(task, "heldout", np.random.default_rng([seed, _EVAL_STREAM]), num_examples)


def prompts(task: Task, pairs, length: int) -> tuple[np.ndarray, np.ndarray]:
  """Prompts `source BOS` left-aligned in [N, length] rows, and each prompt's length [N]."""
  out = np.full((len(pairs), length), PAD, np.int32)
  lengths = np.zeros(len(pairs), np.int32)
  for i, (source, _) in enumerate(pairs):
    ids = [*task.vocab.encode(source), BOS]
    out[i, :len(ids)] = ids
    lengths[i] = len(ids)
  return out, lengths
