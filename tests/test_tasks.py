"""Task generators and the data pipeline: vocabularies, determinism, splits, batch contents.

Every generated pair is checked against a computation of its own: the underlying value is read
back from the text (ISO dates parsed, English number words parsed by a small parser here, sums
redone), and the other side recomputed with babel, num2words, Python's sorted and reversed.
"""

import datetime
import string

import babel.dates
import numpy as np
import pytest
from num2words import num2words

from experiments import data, tasks
from experiments.tasks import BOS, EOS, PAD

BUCKETS = (7, 19, 41, 83)
ALL_TASKS = [("dates", {}), ("num2words_de", {"target": "digits"}),
             ("num2words_de", {"target": "words"}), ("copy", {}), ("reverse", {}), ("sort", {}),
             ("addition", {})]
# Value ranges small enough that a few thousand draws see most values: a split that leaks shows.
SMALL_TASKS = [("dates", {}), ("num2words_de", {"target": "digits", "max_value": 300}),
               ("num2words_de", {"target": "words", "max_value": 300}), ("copy", {"max_len": 2}),
               ("reverse", {"max_len": 2}), ("sort", {"max_len": 2}),
               ("addition", {"max_digits": 1})]
FIRST_DAY = datetime.date(1900, 1, 1)

_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
         "fifteen sixteen seventeen eighteen nineteen").split()
_TENS = "twenty thirty forty fifty sixty seventy eighty ninety".split()
_ENGLISH = {**{w: i for i, w in enumerate(_ONES)}, **{w: 10 * i for i, w in enumerate(_TENS, 2)}}


def _task(name, kwargs):
  return tasks.get_task(name, **kwargs)


def parse_english_number(words: str) -> int:
  """'one hundred and twenty-three thousand, four hundred and fifty-six' -> 123456 (n < 10**6)."""
  total = current = 0
  for word in words.replace(",", " ").replace("-", " ").split():
    if word == "hundred":
      current *= 100
    elif word == "thousand":
      total, current = total + current * 1000, 0
    elif word != "and":
      current += _ENGLISH[word]
  return total + current


def value_of(name: str, src: str, tgt: str):
  """The underlying value a pair names, read back from its text (in the task's own form)."""
  if name == "dates":
    return (datetime.date.fromisoformat(tgt) - FIRST_DAY).days
  if name == "num2words_de":
    return parse_english_number(src)
  if name == "addition":
    return tuple(int(x) for x in src.split("+"))
  return src  # copy, reverse, sort: the source string is the value


def date_renderings(date: datetime.date) -> set[str]:
  """Every source a date may have: each locale x format, as written, lower- or upper-case."""
  written = {babel.dates.format_date(date, fmt, locale=locale)
             for locale in tasks.DATE_LOCALES for fmt in tasks.DATE_FORMATS}
  return {f(w) for w in written for f in (str, str.lower, str.upper)}


def check_pair(name: str, kwargs: dict, src: str, tgt: str) -> None:
  """Assert that `tgt` is the right target for `src`, computed without experiments.tasks."""
  if name == "dates":
    date = datetime.date.fromisoformat(tgt)
    assert 1900 <= date.year <= 2099 and src in date_renderings(date), (src, tgt)
  elif name == "num2words_de":
    n = parse_english_number(src)
    assert 0 <= n < kwargs.get("max_value", 10**6) and src == num2words(n, lang="en")
    want = num2words(n, lang="de") if kwargs["target"] == "words" else f"{n:,}".replace(",", ".")
    assert tgt == want, (src, tgt)
  elif name == "addition":
    a, b = (int(x) for x in src.split("+"))
    assert src == f"{a}+{b}" and max(a, b) < 10 ** kwargs.get("max_digits", 4)  # no "007"
    assert tgt == str(a + b), (src, tgt)
  else:
    assert set(src) <= set(string.ascii_lowercase), src
    assert kwargs.get("min_len", 1) <= len(src) <= kwargs.get("max_len", 16), src
    want = {"copy": src, "reverse": "".join(reversed(src)), "sort": "".join(sorted(src))}[name]
    assert tgt == want, (src, tgt)


def decode_rows(task, batch) -> list[tuple[str, str]]:
  """The (source, target) of every non-filler row, asserting the exact pad/bos/eos layout."""
  pairs = []
  for src_row, in_row, out_row in zip(batch["src"], batch["tgt_in"], batch["tgt_out"]):
    if not src_row.any():
      assert not in_row.any() and not out_row.any()  # an all-pad filler row
      continue
    src, tgt = task.vocab.decode(src_row), task.vocab.decode(out_row)
    s_ids, t_ids = task.vocab.encode(src), task.vocab.encode(tgt)
    np.testing.assert_array_equal(src_row, s_ids + [PAD] * (len(src_row) - len(s_ids)))
    np.testing.assert_array_equal(in_row, [BOS, *t_ids] + [PAD] * (len(in_row) - len(t_ids) - 1))
    np.testing.assert_array_equal(out_row, [*t_ids, EOS] + [PAD] * (len(out_row) - len(t_ids) - 1))
    pairs.append((src, tgt))
  return pairs


def smallest_bucket(n: int) -> int:
  return min(b for b in BUCKETS if b >= n)


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
def test_targets_match_an_independent_computation(name, kwargs):
  task = _task(name, kwargs)
  rng = np.random.default_rng(2)
  for split in tasks.SPLITS:
    for _ in range(100):
      value, src, tgt = task.sample(rng, split)
      check_pair(name, kwargs, src, tgt)
      assert value_of(name, src, tgt) == value and task.split_of(value) == split


def test_known_renderings():
  """Hand-written pairs: the generators agree with what a person would write."""
  day = (datetime.date(2024, 2, 29) - FIRST_DAY).days
  assert tasks.dates().render(day, np.random.default_rng(0))[1] == "2024-02-29"
  assert {"February 29, 2024", "29.02.2024", "29 février 2024", "THURSDAY, FEBRUARY 29, 2024",
          "jueves 29 febrero 2024"} <= date_renderings(datetime.date(2024, 2, 29))
  src = "one hundred and twenty-three thousand, four hundred and fifty-six"
  assert parse_english_number(src) == 123456
  assert tasks.num2words_de("digits").render(123456, None) == (src, "123.456")
  assert tasks.num2words_de("words").render(123456, None) == (
      src, "einhundertdreiundzwanzigtausendvierhundertsechsundfünfzig")
  assert tasks.num2words_de("digits").render(999, None)[1] == "999"
  assert tasks.addition().render((999, 1), None) == ("999+1", "1000")
  assert tasks.reverse().render("abc", None) == ("abc", "cba")
  assert tasks.sort().render("cab", None) == ("cab", "abc")


@pytest.mark.parametrize("name,kwargs", SMALL_TASKS)
def test_heldout_values_never_occur_in_training(name, kwargs):
  """Disjoint by the value the text names, not by the string: a held-out date in no rendering."""
  task = _task(name, kwargs)
  rng = np.random.default_rng(0)
  train = {value_of(name, *task.sample(rng, "train")[1:]) for _ in range(2000)}
  heldout = {value_of(name, *task.sample(rng, "heldout")[1:]) for _ in range(300)}
  assert len(heldout) > 5 and not train & heldout


@pytest.mark.parametrize("percent", [10, 30])
def test_heldout_share_is_heldout_percent(percent):
  task = tasks.dates(heldout_percent=percent)
  days = range((datetime.date(2100, 1, 1) - FIRST_DAY).days)
  share = np.mean([task.split_of(day) == "heldout" for day in days])
  assert abs(share - percent / 100) < 0.01, share


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
def test_batches_hold_correct_pairs_in_the_smallest_buckets(name, kwargs):
  task = _task(name, kwargs)
  for step in range(4):
    batch = data.train_batch(task, 0, step, 13, 4, BUCKETS)
    pairs = decode_rows(task, batch)
    assert len(pairs) == 13 and all(src for src, _ in pairs)
    for src, tgt in pairs:
      check_pair(name, kwargs, src, tgt)
      assert task.split_of(value_of(name, src, tgt)) == "train"
    assert batch["src"].shape[1] == smallest_bucket(max(len(s) for s, _ in pairs))
    assert batch["tgt_out"].shape[1] == smallest_bucket(max(len(t) for _, t in pairs) + 1)
  pairs, batches = data.eval_batches(task, 0, num_examples=29, batch_size=11, buckets=BUCKETS)
  assert [p for b in batches for p in decode_rows(task, b)] == pairs and len(pairs) == 29
  assert {task.split_of(value_of(name, *p)) for p in pairs} == {"heldout"}
  assert {b["src"].shape[0] for b in batches} == {11} and len(batches) == 3
  assert {b["src"].shape[1] for b in batches} == {smallest_bucket(max(len(s) for s, _ in pairs))}


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
