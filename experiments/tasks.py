"""Sequence-transduction tasks, generated locally: each samples an underlying value and renders it.

A task draws an underlying value (a date, a number, a symbol string) and renders it as a
(source, target) pair of strings, with randomness of its own (locale, format, case). The held-out
split is a pure function of the underlying value, so no held-out date or number ever occurs in
training, in any rendering. Tokens are characters; each task declares its vocabulary, after the
special ids pad=0, bos=1, eos=2.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import string
from typing import Callable, Hashable

import babel.dates
import babel.numbers
import numpy as np
from num2words import num2words

PAD, BOS, EOS = 0, 1, 2
NUM_SPECIAL = 3
SPLITS = ("train", "heldout")
_MAX_DRAWS = 10_000  # draws before a split is declared empty (a tiny value range)


@dataclasses.dataclass(frozen=True)
class Vocab:
  """Character vocabulary: id 3 + i is `chars[i]`."""
  chars: str

  def __post_init__(self):
    if len(set(self.chars)) != len(self.chars):
      raise ValueError(f"vocabulary characters must be unique, got {self.chars!r}")

  @functools.cached_property
  def _ids(self) -> dict[str, int]:
    return {c: NUM_SPECIAL + i for i, c in enumerate(self.chars)}

  @property
  def size(self) -> int:
    return NUM_SPECIAL + len(self.chars)

  def encode(self, text: str) -> list[int]:
    """Character ids of `text` (no bos/eos); raises on characters outside the vocabulary."""
    try:
      return [self._ids[c] for c in text]
    except KeyError as e:
      raise ValueError(f"character {e.args[0]!r} of {text!r} is not in the vocabulary") from None

  def decode(self, ids) -> str:
    """Text of `ids` up to the first eos, skipping pad and bos."""
    out = []
    for i in map(int, ids):
      if i == EOS:
        break
      if i >= NUM_SPECIAL:
        out.append(self.chars[i - NUM_SPECIAL])
    return "".join(out)


@dataclasses.dataclass(frozen=True)
class Task:
  """Underlying values rendered as (source, target) strings.

  Attributes:
    name: registry name.
    vocab: characters of every source and target.
    sample_value: rng -> an underlying value (hashable; its repr decides the split).
    render: (value, rng) -> (source, target).
    text_target: whether BLEU/chrF mean something for the target.
    heldout_percent: share of underlying values reserved for evaluation.
  """
  name: str
  vocab: Vocab
  sample_value: Callable[[np.random.Generator], Hashable]
  render: Callable[[Hashable, np.random.Generator], tuple[str, str]]
  text_target: bool = False
  heldout_percent: int = 10

  def split_of(self, value) -> str:
    """'heldout' for a fixed `heldout_percent`% of underlying values, else 'train'."""
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return "heldout" if int.from_bytes(digest, "little") % 100 < self.heldout_percent else "train"

  def sample(self, rng: np.random.Generator, split: str) -> tuple[Hashable, str, str]:
    """(value, source, target) with the value drawn from `split`."""
    if split not in SPLITS:
      raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    for _ in range(_MAX_DRAWS):
      value = self.sample_value(rng)
      if self.split_of(value) == split:
        return (value, *self.render(value, rng))
    raise ValueError(f"{self.name}: no {split} value in {_MAX_DRAWS} draws; too few values?")


# ----------------------------------------------------------------------------- dates

DATE_LOCALES = ("en_US", "en_GB", "de_DE", "fr_FR", "es_ES", "it_IT", "nl_NL", "pt_BR")
# Four-digit years only, and numeric day/month order fixed by the separator (dots: day first,
# slashes: month first), so every source names exactly one date.
DATE_FORMATS = ("full", "long", "medium", "d MMMM y", "MMMM d, y", "d MMM y", "MMM d, y",
                "EEE, d MMM y", "EEEE d MMMM y", "y MMMM d", "dd.MM.y", "d.M.y", "MM/dd/y",
                "y-M-d")
_CASES = (str, str.lower, str.upper)
_FIRST_DAY = datetime.date(1900, 1, 1)
_NUM_DAYS = (datetime.date(2099, 12, 31) - _FIRST_DAY).days + 1


def _render_date(day: int, rng, case=None, locale=None, fmt=None) -> tuple[str, str]:
  date = _FIRST_DAY + datetime.timedelta(days=day)
  locale = DATE_LOCALES[rng.integers(len(DATE_LOCALES))] if locale is None else locale
  fmt = DATE_FORMATS[rng.integers(len(DATE_FORMATS))] if fmt is None else fmt
  case = _CASES[rng.integers(len(_CASES))] if case is None else case
  return case(babel.dates.format_date(date, fmt, locale=locale)), date.isoformat()


@functools.cache
def _date_chars() -> str:
  """Every character any rendering can produce: all months and weekdays in every locale/format."""
  probes = [datetime.date(2001, m, 1) for m in range(1, 13)]
  probes += [datetime.date(2001, 1, d) for d in range(1, 8)]
  chars = set(string.digits + "-")
  for date in probes:
    for locale in DATE_LOCALES:
      for fmt in DATE_FORMATS:
        for case in _CASES:
          chars.update(_render_date((date - _FIRST_DAY).days, None, case, locale, fmt)[0])
  return "".join(sorted(chars))


def dates(heldout_percent: int = 10) -> Task:
  """A date in 1900..2099, written in one of 8 locales x 14 formats, random case -> ISO 8601."""
  return Task("dates", Vocab(_date_chars()), lambda rng: int(rng.integers(_NUM_DAYS)),
              _render_date, heldout_percent=heldout_percent)


# ----------------------------------------------------------------------------- number words

_NUMBER_TARGETS = {
    # German digit grouping, e.g. 123.456
    "digits": lambda n: babel.numbers.format_decimal(n, locale="de_DE"),
    # German number words, e.g. einhundertdreiundzwanzigtausendvierhundertsechsundfünfzig
    "words": lambda n: num2words(n, lang="de"),
}


def num2words_de(target: str = "digits", max_value: int = 10**6,
                 heldout_percent: int = 10) -> Task:
  """English number words of n < max_value (<= 10**6) -> German digits or German number words."""
  if target not in _NUMBER_TARGETS:
    raise ValueError(f"target must be one of {sorted(_NUMBER_TARGETS)}, got {target!r}")
  if not 0 < max_value <= 10**6:
    raise ValueError(f"max_value must be in (0, 10**6], got {max_value}")
  to_target = _NUMBER_TARGETS[target]
  return Task(
      "num2words_de", Vocab(string.ascii_lowercase + string.digits + " ,-.äöüß"),
      lambda rng: int(rng.integers(max_value)),
      lambda n, rng: (num2words(n, lang="en"), to_target(n)),
      text_target=target == "words", heldout_percent=heldout_percent)


# ----------------------------------------------------------------------------- algorithmic


def _symbol_task(name: str, transform: Callable[[str], str], alphabet: str, min_len: int,
                 max_len: int, heldout_percent: int) -> Task:
  if not 1 <= min_len <= max_len:
    raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")

  def sample_value(rng):
    length = rng.integers(min_len, max_len + 1)
    return "".join(alphabet[i] for i in rng.integers(len(alphabet), size=length))

  return Task(name, Vocab(alphabet), sample_value, lambda s, rng: (s, transform(s)),
              heldout_percent=heldout_percent)


def copy(min_len: int = 1, max_len: int = 16, heldout_percent: int = 10) -> Task:
  """A random lowercase string -> itself."""
  return _symbol_task("copy", lambda s: s, string.ascii_lowercase, min_len, max_len,
                      heldout_percent)


def reverse(min_len: int = 1, max_len: int = 16, heldout_percent: int = 10) -> Task:
  """A random lowercase string -> reversed."""
  return _symbol_task("reverse", lambda s: s[::-1], string.ascii_lowercase, min_len, max_len,
                      heldout_percent)


def sort(min_len: int = 1, max_len: int = 16, heldout_percent: int = 10) -> Task:
  """A random lowercase string -> its characters sorted."""
  return _symbol_task("sort", lambda s: "".join(sorted(s)), string.ascii_lowercase, min_len,
                      max_len, heldout_percent)


def addition(max_digits: int = 4, heldout_percent: int = 10) -> Task:
  """'a+b' with a, b < 10**max_digits (digit counts uniform) -> decimal a + b."""
  def number(rng):
    return int(rng.integers(10 ** (rng.integers(max_digits) + 1)))

  return Task("addition", Vocab(string.digits + "+"), lambda rng: (number(rng), number(rng)),
              lambda ab, rng: (f"{ab[0]}+{ab[1]}", str(ab[0] + ab[1])),
              heldout_percent=heldout_percent)


TASKS: dict[str, Callable[..., Task]] = {
    f.__name__: f for f in (dates, num2words_de, copy, reverse, sort, addition)}


def get_task(name: str, **kwargs) -> Task:
  """The task `name` built with `kwargs` (see each factory's arguments)."""
  if name not in TASKS:
    raise ValueError(f"task must be one of {sorted(TASKS)}, got {name!r}")
  return TASKS[name](**kwargs)
