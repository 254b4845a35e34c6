"""Tokenize, pad, bucket and batch task examples; every batch is a pure function of its seed.

A training batch is a pure function of (task, seed, step): steps are grouped in windows of
`window` steps, each window samples `window * batch_size` training examples from its own seed,
sorts them by source length and deals them out as `window` length-bucketed batches in a shuffled
order. Resuming at any step therefore sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import functools

import numpy as np

from experiments.tasks import BOS, EOS, PAD, Task

_TRAIN_STREAM, _EVAL_STREAM = 0, 1


def bucket_length(n: int, buckets) -> int:
  """The smallest length in `buckets` that holds `n` tokens: few shapes, so few compilations."""
  fits = [b for b in buckets if b >= n]
  if not fits:
    raise ValueError(f"length {n} exceeds the largest bucket in {tuple(buckets)}")
  return min(fits)


def pad_batch(task: Task, pairs, buckets, src_len: int | None = None,
              tgt_len: int | None = None, batch_size: int | None = None) -> dict[str, np.ndarray]:
  """Encode (source, target) pairs into int32 arrays, pad-filled.

  Returns {'src': [B, S], 'tgt_in': [B, T] (bos, y...), 'tgt_out': [B, T] (y..., eos)} with S and
  T the longest lengths rounded up to a length in `buckets` unless given; `batch_size` adds
  all-pad rows.
  """
  src = [task.vocab.encode(s) for s, _ in pairs]
  tgt = [task.vocab.encode(t) for _, t in pairs]
  s_len = src_len or bucket_length(max(map(len, src)), buckets)
  t_len = tgt_len or bucket_length(max(map(len, tgt)) + 1, buckets)
  b = batch_size or len(pairs)
  if b < len(pairs) or s_len < max(map(len, src)) or t_len <= max(map(len, tgt)):
    raise ValueError(f"{len(pairs)} pairs do not fit batch [{b}, {s_len}] / [{b}, {t_len}]")
  out = {k: np.full((b, n), PAD, np.int32)
         for k, n in (("src", s_len), ("tgt_in", t_len), ("tgt_out", t_len))}
  for i, (s, t) in enumerate(zip(src, tgt)):
    out["src"][i, :len(s)] = s
    out["tgt_in"][i, :len(t) + 1] = [BOS, *t]
    out["tgt_out"][i, :len(t) + 1] = [*t, EOS]
  return out


def sample_pairs(task: Task, split: str, rng: np.random.Generator,
                 n: int) -> list[tuple[str, str]]:
  return [task.sample(rng, split)[1:] for _ in range(n)]


@functools.lru_cache(maxsize=1)
def _window(task: Task, seed: int, window_index: int, batch_size: int, window: int):
  """The `window` batches (lists of pairs) of one window, in training order."""
  rng = np.random.default_rng([seed, _TRAIN_STREAM, window_index])
  pairs = sample_pairs(task, "train", rng, window * batch_size)
  pairs.sort(key=lambda p: len(p[0]))
  batches = [pairs[i * batch_size:(i + 1) * batch_size] for i in range(window)]
  return [batches[i] for i in rng.permutation(window)]


def train_batch(task: Task, seed: int, step: int, batch_size: int, window: int,
                buckets) -> dict[str, np.ndarray]:
  """Training batch number `step` (see the module docstring), padded to lengths in `buckets`."""
  pairs = _window(task, seed, step // window, batch_size, window)[step % window]
  return pad_batch(task, pairs, buckets)


def eval_batches(task: Task, seed: int, num_examples: int, batch_size: int,
                 buckets) -> tuple[list[tuple[str, str]], list[dict[str, np.ndarray]]]:
  """A fixed held-out set: its pairs and same-shape batches (the last filled with all-pad rows)."""
  pairs = sample_pairs(task, "heldout", np.random.default_rng([seed, _EVAL_STREAM]), num_examples)
  src_len = bucket_length(max(len(s) for s, _ in pairs), buckets)
  tgt_len = bucket_length(max(len(t) for _, t in pairs) + 1, buckets)
  batches = [pad_batch(task, pairs[i:i + batch_size], buckets, src_len, tgt_len, batch_size)
             for i in range(0, num_examples, batch_size)]
  return pairs, batches
