"""Task generators and the data pipeline: vocabularies, determinism, splits, batch shapes."""

import datetime

import numpy as np
import pytest

from experiments import data, tasks
from experiments.tasks import BOS, EOS, PAD

BUCKETS = (7, 19, 41, 83)
ALL_TASKS = [("dates", {}), ("num2words_de", {"target": "digits"}),
             ("num2words_de", {"target": "words"}), ("copy", {}), ("reverse", {}), ("sort", {}),
             ("addition", {})]


def _task(name, kwargs):
  return tasks.get_task(name, **kwargs)


@pytest.mark.parametrize("name,kwargs", ALL_TASKS)
def test_vocab_round_trip(name, kwargs):
  task = _task(name, kwargs)
  rng = np.random.default_rng(3)
  for split in tasks.SPLITS:
    for _ in range(300):
      _, src, tgt = task.sample(rng, split)
      for text in (src, tgt):
        ids = task.vocab.encode(text)
        assert min(ids) >= tasks.NUM_SPECIAL and max(ids) < task.vocab.size
        assert task.vocab.decode([BOS, *ids, EOS, PAD, *ids]) == text


def test_vocab_rejects_unknown_characters_and_duplicates():
  with pytest.raises(ValueError, match="not in the vocabulary"):
    tasks.Vocab("abc").encode("abd")
  with pytest.raises(ValueError, match="unique"):
    tasks.Vocab("aba")


@pytest.mark.parametrize("name,kwargs", ALL_TASKS)
def test_generators_are_deterministic(name, kwargs):
  task = _task(name, kwargs)
  a = [task.sample(np.random.default_rng(7), "train") for _ in range(3)]
  b = [task.sample(np.random.default_rng(7), "train") for _ in range(3)]
  assert a == b
  first = data.train_batch(task, 5, 3, 8, 4, BUCKETS)
  data.train_batch(task, 5, 11, 8, 4, BUCKETS)  # another window in between: no hidden state
  again = data.train_batch(task, 5, 3, 8, 4, BUCKETS)
  for key in first:
    np.testing.assert_array_equal(first[key], again[key])
  assert not np.array_equal(first["src"], data.train_batch(task, 6, 3, 8, 4, BUCKETS)["src"])


@pytest.mark.parametrize("name,kwargs", ALL_TASKS)
def test_heldout_values_never_occur_in_training(name, kwargs):
  task = _task(name, kwargs)
  rng = np.random.default_rng(0)
  train = {task.sample(rng, "train")[0] for _ in range(2000)}
  heldout = {task.sample(rng, "heldout")[0] for _ in range(500)}
  assert train and heldout and not train & heldout
  assert {task.split_of(v) for v in train} == {"train"}
  assert {task.split_of(v) for v in heldout} == {"heldout"}


def test_held_out_dates_differ_in_every_rendering():
  """The split is by date, not by string: a held-out date's ISO target never occurs in training."""
  task = tasks.dates()
  rng = np.random.default_rng(1)
  train_targets = {task.sample(rng, "train")[2] for _ in range(3000)}
  heldout = [task.sample(rng, "heldout") for _ in range(300)]
  for day, src, tgt in heldout:
    assert tgt == (datetime.date(1900, 1, 1) + datetime.timedelta(days=day)).isoformat()
    assert tgt not in train_targets


def test_pad_batch_layout():
  task = tasks.copy()
  batch = data.pad_batch(task, [("abc", "abc"), ("abcdefg", "abcdefg")], buckets=(5, 10, 15))
  b, s = batch["src"].shape  # B=2, S=7 and T=8 (7 + eos) both padded to the bucket 10
  assert (b, s) == (2, 10) and batch["tgt_in"].shape == batch["tgt_out"].shape == (2, 10)
  ids = task.vocab.encode("abc")
  np.testing.assert_array_equal(batch["src"][0], ids + [PAD] * 7)
  np.testing.assert_array_equal(batch["tgt_in"][0], [BOS] + ids + [PAD] * 6)
  np.testing.assert_array_equal(batch["tgt_out"][0], ids + [EOS] + [PAD] * 6)
  assert all(v.dtype == np.int32 for v in batch.values())


@pytest.mark.parametrize("name,kwargs", ALL_TASKS)
def test_batch_shapes(name, kwargs):
  task = _task(name, kwargs)
  for step in range(4):
    batch = data.train_batch(task, 0, step, 13, 4, BUCKETS)
    assert batch["src"].shape[0] == 13 and batch["src"].shape[1] in BUCKETS
    assert batch["tgt_in"].shape == batch["tgt_out"].shape and batch["tgt_in"].shape[1] in BUCKETS
    np.testing.assert_array_equal(batch["tgt_in"][:, 0], BOS)
    assert np.all(np.sum(batch["tgt_out"] == EOS, axis=1) == 1)
    assert np.all(batch["src"][:, 0] != PAD)  # no empty sources
  pairs, batches = data.eval_batches(task, 0, num_examples=29, batch_size=11,
                                      buckets=BUCKETS)
  assert len(pairs) == 29 and len(batches) == 3
  assert len({tuple(v.shape) for b in batches for k, v in b.items() if k == "src"}) == 1
  assert np.all(batches[-1]["tgt_out"][29 - 22:] == PAD)  # filler rows


def test_bucketing_reduces_padding():
  """Within a window, batches are sorted by source length: less padding than random batches."""
  task = tasks.dates()
  bucketed = [data.train_batch(task, 0, s, 32, 8, range(100))["src"] for s in range(8)]
  random = [data.train_batch(task, 0, s, 32, 1, range(100))["src"] for s in range(8)]
  def pad_share(batches):
    return np.mean([np.mean(b == PAD) for b in batches])
  assert pad_share(bucketed) < 0.5 * pad_share(random)


def test_bucket_length():
  assert [data.bucket_length(n, (4, 8)) for n in (1, 4, 5, 8)] == [4, 4, 8, 8]
  with pytest.raises(ValueError, match="exceeds the largest bucket"):
    data.bucket_length(9, (4, 8))


def test_unknown_task_and_arguments_raise():
  with pytest.raises(ValueError, match="task must be one of"):
    tasks.get_task("nope")
  with pytest.raises(ValueError, match="target must be one of"):
    tasks.get_task("num2words_de", target="french")
  with pytest.raises(TypeError):
    tasks.get_task("dates", max_len=3)
  with pytest.raises(ValueError, match="no heldout value"):
    tasks.get_task("num2words_de", max_value=20).sample(np.random.default_rng(0), "heldout")
  with pytest.raises(ValueError, match="split must be one of"):
    tasks.copy().sample(np.random.default_rng(0), "test")
