"""The host's book of a serving pool (flax_mha.serving.page_pool), rule by rule, without a device:
prefix matching by digest chains, reference counts, copy-on-write of a whole-prompt match,
waiting for a prefix being written, eviction (least recently used, deepest first), and a
ledger check that fails when a page leaks."""

from __future__ import annotations

import numpy as np

from flax_mha.serving import page_pool
from flax_mha.serving.page_pool import BLOCKED, PagePool

PAGE = 4


def _ledger(pool: PagePool, held=()) -> None:
  """Every page is exactly one of: on the free stack, an entry's, or held by a live row (`held`,
  the rows' own pages): a page leaked or given twice fails here."""
  free = pool.free[:pool.n_free].tolist()
  owned = [e.page for e in pool.entries.values()] + list(held)
  assert sorted(free + owned) == list(range(pool.num_pages)), (free, owned)


def _written(pool, admission, prompt):
  pool.mark_written(admission, len(prompt))
  return admission


def test_digests_name_a_page_by_everything_before_it():
  a = page_pool.digests(np.arange(12), PAGE)
  b = page_pool.digests(np.r_[np.arange(4), 9, 9, 9, 9, np.arange(8, 12)], PAGE)
  assert len(a) == 3 and a[0] == b[0] and a[2] != b[2]  # same last page, other middle page
  assert page_pool.digests(np.arange(3), PAGE) == []


def test_a_shared_prefix_is_taken_by_reference_and_released():
  pool = PagePool(16, PAGE, sharing=True)
  first = np.arange(1, 11)  # two whole pages and two tokens
  a = pool.admit(first, 14, reserved=0)
  assert (a.keep, a.start, a.copy) == (2, 0, None) and pool.n_free == 14
  _ledger(pool)
  assert pool.admit(np.r_[first[:8], 5, 5], 12, 0) == BLOCKED  # its pages not written yet
  _written(pool, a, first)
  b = pool.admit(np.r_[first[:8], 5, 5], 12, 0)
  assert b.pages == a.pages and b.start == 8 and b.keep == 2
  assert [e.refs for e in pool.entries.values()] == [2, 2]
  pool.release(a)
  pool.release(b)
  assert [e.refs for e in pool.entries.values()] == [0, 0]
  _ledger(pool)


def test_a_whole_prompt_match_copies_its_last_page():
  pool = PagePool(16, PAGE, sharing=True)
  a = _written(pool, pool.admit(np.arange(12), 13, 0), np.arange(12))
  b = pool.admit(np.arange(12), 14, 0)
  assert b.keep == 2 and b.start == 11 and b.pages == a.pages[:2]
  assert b.copy[0] == a.pages[2] and b.copy[1] not in a.pages
  _ledger(pool, held=[b.copy[1]])


def test_a_cancelled_prefill_drops_its_unwritten_pages():
  pool = PagePool(16, PAGE, sharing=True)
  a = pool.admit(np.arange(12), 12, 0)
  pool.mark_written(a, 5)  # one page written
  pool.release(a)
  assert len(pool.entries) == 1 and pool.n_free == 15
  _ledger(pool)


def test_eviction_takes_the_least_recent_and_the_deepest_first():
  pool = PagePool(6, PAGE, sharing=True)
  old = _written(pool, pool.admit(np.arange(8), 8, 0), np.arange(8))  # 2 pages
  new = _written(pool, pool.admit(np.arange(20, 28), 8, 0), np.arange(20, 28))
  pool.release(old)
  pool.release(new)
  assert pool.n_free == 2
  c = pool.admit(np.arange(40, 43), 12, 0)  # 3 pages: one of `old` must go, its tail first
  assert c is not None and len(pool.entries) == 3
  assert pool.match(page_pool.digests(np.arange(8), PAGE)) == (1, False)
  assert pool.match(page_pool.digests(np.arange(20, 28), PAGE)) == (2, False)


def test_a_full_pool_makes_requests_wait_and_evicts_nothing_held():
  pool = PagePool(6, PAGE, sharing=True)
  a = _written(pool, pool.admit(np.arange(8), 16, 0), np.arange(8))  # 2 kept + 2 reserved
  assert pool.admit(np.arange(30, 34), 12, reserved=2) is None  # 3 > 4 - 2: wait
  assert len(pool.entries) == 2 and pool.n_free == 4  # nothing evicted for nothing
  pool.release(a)
  assert pool.admit(np.arange(30, 34), 16, reserved=0) is not None  # now evicts a's pages
  _ledger(pool)


def test_without_sharing_nothing_is_entered():
  pool = PagePool(8, PAGE, sharing=False)
  a = pool.admit(np.arange(12), 16, 0)
  assert (a.keep, a.start, a.pages, pool.n_free) == (0, 0, [], 8)


def test_leases_reserve_what_live_rows_may_still_pop_and_end_gives_it_back():
  """The pool is the one owner of the reservations: a row leased for 12 tokens (3 pages, none
  popped yet) reserves 3; once it holds 9 tokens (3 pages popped) it reserves none; a lease
  that would pass the stack beside the reservations waits (None); ending a cancelled row
  pushes its own pages and lets go of its entries, and the ledger balances."""
  pool = PagePool(5, PAGE, sharing=False)
  assert isinstance(pool.lease(0, np.arange(1, 4), 12, {}), page_pool.Admission)
  assert pool.reserved({0: 0}) == 3 and pool.reserved({0: 9}) == 0
  assert pool.lease(1, np.arange(1, 4), 12, {0: 0}) is None  # 3 reserved + 3 > 5 free
  popped = pool.free[pool.n_free - 3:pool.n_free].copy()
  free, n_free = pool.lend()
  pool.take_back(free, n_free - 3)  # the device popped row 0's three pages
  assert isinstance(pool.lease(1, np.arange(1, 4), 8, {0: 9}), page_pool.Admission)
  pool.end(0, popped)
  assert set(pool.leases) == {1} and pool.n_free == 5
  _ledger(pool)
