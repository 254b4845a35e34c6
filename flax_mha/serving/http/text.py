"""Token ids to text as they stream: an incremental detokenizer, and the matching of stop strings
across token boundaries. Pure Python: `decode` is any function of a list of ids to text (a
tokenizer's, special tokens skipped)."""

from __future__ import annotations

from typing import Callable, Sequence

REPLACEMENT = "\ufffd"  # what a decoder writes for the bytes of a character not yet complete


class Detokenizer:
  """The text of a growing list of ids, a piece at a time, whose pieces join to decode(ids).

  Each piece is decoded from a window that starts a few tokens back (at the start of the last
  piece handed out), so a decoder that treats a sequence's first token apart (a leading space,
  SentencePiece's "▁") treats both ends of the difference alike; text that ends in the
  replacement character waits for the token that completes it.
  """

  def __init__(self, decode: Callable[[list[int]], str]):
    self.decode = decode
    self.ids: list[int] = []
    self._prefix = 0  # where the window starts
    self._read = 0  # the ids whose text has been handed out

  def add(self, ids: Sequence[int]) -> str:
    """The new text that `ids` (appended) complete; "" while a character is incomplete."""
    self.ids.extend(int(i) for i in ids)
    before = self.decode(self.ids[self._prefix:self._read])
    now = self.decode(self.ids[self._prefix:])
    if len(now) <= len(before) or now.endswith(REPLACEMENT):
      return ""
    self._prefix, self._read = self._read, len(self.ids)
    return now[len(before):]

  def flush(self) -> str:
    """The rest at the end (an incomplete character as the replacement character)."""
    before = self.decode(self.ids[self._prefix:self._read])
    now = self.decode(self.ids[self._prefix:])
    self._prefix = self._read = len(self.ids)
    return now[len(before):]


class StopStrings:
  """Text pieces in, text pieces out, cut before the first of `stops` (OpenAI's `stop`: the stop
  string is not returned). A tail that could begin a stop string is held until the next piece
  settles it."""

  def __init__(self, stops: Sequence[str]):
    self.stops = tuple(s for s in stops if s)
    self._held = ""
    self.stopped = False

  def add(self, piece: str) -> str:
    """What of `piece` may go out now; after a stop string, "" (and `stopped` is True)."""
    if self.stopped:
      return ""
    text = self._held + piece
    found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
    if found:
      self.stopped, self._held = True, ""
      return text[:min(found)]
    keep = max((n for s in self.stops for n in range(min(len(s) - 1, len(text)), 0, -1)
                if text.endswith(s[:n])), default=0)
    self._held = text[len(text) - keep:] if keep else ""
    return text[:len(text) - keep]

  def flush(self) -> str:
    """The held tail, once no more text comes."""
    held, self._held = ("" if self.stopped else self._held), ""
    return held
