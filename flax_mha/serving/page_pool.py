"""The host's book of a serving loop's page pool: which pages are free, which hold a prompt's
prefix that later requests may share, and who holds them.

The device pops a row's pages off a free stack as it grows and pushes them back when it ends
(`flax_mha.serving.server`); between two runs of the loop the host reads that stack back, and
this book decides the rest:
- Prefix entries. A prompt's whole pages are named by a chain of digests (page i's digest
  covers the tokens of pages 0 .. i), so a page matches only under the same prefix. A request
  whose prompt begins with pages already here takes them by reference (a reference count per
  page) and prefills only the rest; its own whole prompt pages are entered as it is admitted,
  but shared only once written (`mark_written`): a request whose next page is still being
  written by another row waits for it (`BLOCKED`) rather than compute it twice.
- Eviction. An entry that nobody holds stays (its pages keep their keys and values) until the
  pool needs the page: then the least recently used go first, the deepest of a chain first
  among equals (a prefix's tail before its head).
- Reservations. A row may pop up to its request's pages as it decodes; the book admits a
  request only while the free stack covers every live row's remaining pages and the new one's,
  so the device never finds the stack empty: a request that does not fit waits. Each row's
  lease (`lease` / `end`) records what it holds and may still take.
- The free stack. The book owns it: a run of the loop borrows it (`lend`), pops and pushes on
  the device, and hands it back (`take_back`); nothing else writes it.

Pure Python over NumPy: no JAX here, so every rule is tested by itself
(tests/serving/test_page_pool.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools

import numpy as np

BLOCKED = "blocked"  # `admit`'s answer while a request's next prefix page is being written


@dataclasses.dataclass
class Entry:
  """One shared prompt page: its pool page, its depth in the chain, the rows holding it, whether
  its keys are written yet, and when it was last taken."""
  page: int
  depth: int
  refs: int = 1
  written: bool = False
  last_used: int = 0


@dataclasses.dataclass
class Admission:
  """What the host writes into a row for one request: its first `keep` table entries (shared and
  own whole prompt pages, never pushed by the device), the position its prefill starts at, and
  a copy-on-write (source page, destination page) when the whole prompt matched (its last token
  is recomputed into a copy of the last page, the row's own)."""
  pages: list[int]
  digests: list[bytes]
  keep: int
  start: int
  copy: tuple[int, int] | None


@dataclasses.dataclass
class Lease:
  """A live row's hold on the pool: its admission (the first `keep` table entries, the host's)
  and the pages the device may pop for it in all."""
  admission: Admission
  budget: int


def digests(prompt, page_size: int) -> list[bytes]:
  """The chain of digests of the prompt's whole pages."""
  tokens = np.asarray(prompt, np.int32)
  out, previous = [], b""
  for i in range(len(tokens) // page_size):
    previous = hashlib.blake2b(previous + tokens[i * page_size:(i + 1) * page_size].tobytes(),
                               digest_size=16).digest()
    out.append(previous)
  return out


class PagePool:
  """The host's book of `num_pages` pages of `page_size` tokens (see the module docstring).
  `free` and `n_free` mirror the device's free stack (top at n_free - 1); `sharing` False keeps
  no entries (every request prefills from its first token)."""

  def __init__(self, num_pages: int, page_size: int, sharing: bool):
    self.page_size, self.sharing = page_size, sharing
    self.free = np.arange(num_pages, dtype=np.int32)[::-1].copy()
    self.n_free = num_pages
    self.entries: dict[bytes, Entry] = {}
    self.leases: dict[int, Lease] = {}  # row -> what it holds and may still pop
    self._clock = itertools.count(1)

  @property
  def num_pages(self) -> int:
    return len(self.free)

  @property
  def cached_pages(self) -> int:
    """Pages held by entries (shared, or kept for later requests)."""
    return len(self.entries)

  def pages_for(self, tokens: int) -> int:
    return -(-tokens // self.page_size)

  def match(self, chain: list[bytes]) -> tuple[int, bool]:
    """(how many leading pages of `chain` are written entries, whether the next is an entry
    still being written)."""
    n = 0
    while n < len(chain) and chain[n] in self.entries and self.entries[chain[n]].written:
      n += 1
    return n, n < len(chain) and chain[n] in self.entries

  def admit(self, prompt, total_tokens: int, reserved: int) -> Admission | str | None:
    """Take pages for a request of `prompt` growing to `total_tokens`, while the live rows may
    still pop `reserved` pages: its Admission, BLOCKED (its next prefix page is being
    written), or None (the pool cannot cover it now, even after evicting what nobody holds)."""
    chain = digests(prompt, self.page_size) if self.sharing else []
    matched, pending = self.match(chain)
    if pending:
      return BLOCKED
    whole, length = len(chain), len(prompt)
    cow = matched > 0 and matched == whole and whole * self.page_size == length
    keep = whole - 1 if cow else whole  # the whole prompt pages the row holds by reference
    shared = min(matched, keep)
    own = keep - shared + (1 if cow else 0)  # pages taken off the stack now
    later = self.pages_for(total_tokens) - keep - (1 if cow else 0)  # popped by the device
    if not self._make_room(own + later + reserved, chain[:matched]):
      return None
    now = next(self._clock)
    for digest in chain[:shared]:
      entry = self.entries[digest]
      entry.refs, entry.last_used = entry.refs + 1, now
    fresh = self._pop(own)
    pages = [self.entries[d].page for d in chain[:shared]]
    for depth in range(shared, keep):
      page = fresh.pop(0)
      self.entries[chain[depth]] = Entry(page, depth, last_used=now)
      pages.append(page)
    copy = (self.entries[chain[-1]].page, fresh.pop(0)) if cow else None
    start = length - 1 if cow else shared * self.page_size
    return Admission(pages, chain[:keep], keep, start, copy)

  def reserved(self, held_tokens: dict[int, int]) -> int:
    """Pages the live rows may still pop, each row holding `held_tokens[row]` tokens now."""
    return sum(lease.budget - max(0, self.pages_for(held_tokens[row]) - lease.admission.keep)
               for row, lease in self.leases.items())

  def lease(self, row: int, prompt, total_tokens: int,
            held_tokens: dict[int, int]) -> Admission | str | None:
    """`admit` for row `row` beside the live rows (holding `held_tokens`); an Admission is
    recorded as the row's lease."""
    admission = self.admit(prompt, total_tokens, self.reserved(held_tokens))
    if isinstance(admission, Admission):
      budget = self.pages_for(total_tokens) - admission.keep
      self.leases[row] = Lease(admission, budget)
    return admission

  def end(self, row: int, own_pages=()) -> None:
    """Row `row` ended: its own pages past its admission's (`own_pages`, a cancelled row's,
    which the device did not push) back on the stack, its entries let go, its lease gone."""
    self.push(own_pages)
    self.release(self.leases.pop(row).admission)

  def lend(self) -> tuple[np.ndarray, np.int32]:
    """The free stack and its height, for a run of the loop (`take_back` ends the loan)."""
    return self.free, np.int32(self.n_free)

  def take_back(self, free, n_free) -> None:
    """The free stack as the run left it (the device popped and pushed rows' own pages)."""
    self.free, self.n_free = np.asarray(free), int(n_free)

  def mark_written(self, admission: Admission, fed: int) -> None:
    """The row of `admission` has fed `fed` prompt tokens: its pages below are shareable."""
    for digest in admission.digests[:fed // self.page_size]:
      self.entries[digest].written = True

  def release(self, admission: Admission) -> None:
    """The row of `admission` ended (or was cancelled): its entries lose a holder; one never
    written (a cancelled prefill) is dropped and its page freed."""
    now = next(self._clock)
    for digest in admission.digests:
      entry = self.entries[digest]
      entry.refs, entry.last_used = entry.refs - 1, now
      if not entry.written:
        del self.entries[digest]
        self.push([entry.page])

  def push(self, pages) -> None:
    """Pages back on the free stack."""
    pages = list(pages)
    self.free[self.n_free:self.n_free + len(pages)] = pages
    self.n_free += len(pages)

  def _pop(self, n: int) -> list[int]:
    taken = self.free[self.n_free - n:self.n_free][::-1].tolist()
    self.n_free -= n
    return taken

  def _make_room(self, needed: int, keep: list[bytes]) -> bool:
    """Evict entries nobody holds (least recently used, deepest first) until `needed` pages are
    free; False, evicting nothing, when even all of them would not do."""
    if self.n_free >= needed:
      return True
    keep = set(keep)
    spare = sorted(((e.last_used, -e.depth, d) for d, e in self.entries.items()
                    if e.refs == 0 and d not in keep))
    if self.n_free + len(spare) < needed:
      return False
    for _, _, digest in spare[:needed - self.n_free]:
      self.push([self.entries.pop(digest).page])
    return True
