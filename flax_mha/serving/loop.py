"""The device side of serving (`flax_mha.serving.server`): a compiled loop over `batch_size` rows
that runs until the host has something to do.

Each trip of the loop feeds prompt pieces (chunked prefill: a row's piece is at most `chunk`
tokens, padded to the smallest power of two from 16 that holds it; the oldest request first, one
row after another while the trip's padded tokens stay within `chunk`), then runs one decode
step for every row past its prompt: a long prompt enters between decode steps, no running row
waits for a whole prefill, and prompts arriving together are read in few trips (one decode step
a trip for all of them). The global layers' keys and values live in a pool of pages
(`flax_mha.cache.PagedKVCache`): a row pops pages off a free stack as its length crosses page
boundaries and pushes them back when it ends, except its first `keep` table entries, which are
the host's (shared prefix pages, `flax_mha.serving.page_pool`); the local layers keep rolling
caches of their window.

A run (`segment`) ends after `max_trips` trips, when a row's output buffer is nearly full, when
no row is live, or, while requests wait, as soon as a row ends (a row to give out) or, while a
row is free, finishes its prompt (a prefix to share with a request waiting for it; with every
row busy no request could be admitted), and, with `first_tokens`, as soon as a row reads its
prompt's last piece (its first token goes out without waiting for the run's other trips: an
online server's time to first token). Between runs the host reads the small state back (the
rows, the table, the free stack, the tokens of the run) and writes the next requests in; the
pool stays on the device (donated from run to run).

Speculative decoding (a `Plan` with a drafter, `flax_mha.models.speculative`): a trip's decode
step is a round instead, each row past its prompt drafting up to its own k tokens (k adapts to
the row's acceptance, as in `speculative.generate`), the model scoring the row's pending token
and the drafts in one step of k + 1 queries, and the row keeping the drafts the rule accepts
plus one token of the model's own: rows advance unevenly. Pages are popped for the most a round
writes and those past the kept tokens pushed back at once (the cache rolled back as data); the
host reserves k tokens more a request for that. A draft model's caches sit beside the model's
on the same page table (its keys in a pool of its own), fed the same prompt pieces, so a
shared prefix page holds both. A row's history for prompt lookup is its prompt room, where
each token it makes is written after its prompt.

Each row samples by its request's own parameters (temperature 0: greedy). Token t of request
r is drawn with the key fold_in(fold_in(rng, r), t), or fold_in(key(seed), t) for a request
with its own seed: what a request gets does not depend on which row it ran in or when. Shapes: B rows, n table entries per row, P
pages, W prompt room per row, O output buffer per row, C vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flax_mha import cache as cache_lib
from flax_mha.models import sampling
from flax_mha.models import speculative

# The rows' sampling parameters (`flax_mha.models.sampling.draw_rows`; temperature 0: greedy).
SAMPLING = ("temperature", "top_k", "top_p")


@dataclasses.dataclass(frozen=True)
class Plan:
  """The static facts of a serving program."""
  model: Any
  stop_tokens: tuple
  chunk: int  # prompt tokens a prefill step feeds
  page_size: int
  batch_size: int
  num_pages: int
  pages_per_row: int  # the table's width n
  out_width: int  # O: tokens a row may emit in one run, plus slack
  cache_dtype: Any = None
  drafter: Any = None  # a speculative drafter's static part (`split()`), None: no speculation
  speculative_tokens: int = 0  # k: the most drafts a row proposes a round

  @property
  def most_per_trip(self) -> int:
    """The most tokens a row emits in one trip: its first, then a decode step's (or a round's
    k + 1)."""
    return self.speculative_tokens + 2

  @property
  def prompt_width(self) -> int:
    """W: a row's prompt room, plus one chunk (its last piece may read past the prompt)."""
    return self.pages_per_row * self.page_size + self.chunk


def chunks(chunk: int) -> tuple:
  """The prefill step's sizes: `chunk` and the powers of 2 from 16 below it (a prompt's last
  piece takes the smallest that holds it: padded to less than twice its tokens, or to 16)."""
  sizes, size = [], 16
  while size < chunk:
    sizes.append(size)
    size *= 2
  return (*sizes, chunk)


def rows_state(plan: Plan) -> dict:
  """The host's side of the state, as NumPy arrays: every row idle, every page free."""
  b, p = plan.batch_size, plan.num_pages
  rows = lambda: np.zeros((b,), np.int32)
  return dict(table=np.zeros((b, plan.pages_per_row), np.int32),
              free=np.arange(p, dtype=np.int32)[::-1].copy(), n_free=np.int32(p),
              req=np.full((b,), -1, np.int32), prompt=np.zeros((b, plan.prompt_width), np.int32),
              plen=rows(), limit=rows(), keep=rows(), fed=rows(), length=rows(), gen=rows(),
              token=rows(), out=np.zeros((b, plan.out_width), np.int32), count=rows(),
              temperature=np.zeros((b,), np.float32), top_k=rows(),
              top_p=np.ones((b,), np.float32), seed=np.full((b,), -1, np.int32),
              stops=np.ones((b,), bool), own_k=rows(), drafted=np.int32(0),
              accepted=np.int32(0), step=np.int32(0), peak=np.zeros((3,), np.int32), trips=np.int32(0),
              finished=np.bool_(False), prefilled=np.bool_(False))


@functools.partial(jax.jit, static_argnums=(0,))
def empty_cache(plan: Plan, params):
  """(the model's caches, a draft model's: () without one); params: (the model's, the
  drafter's arrays)."""
  def make(model, variables):
    return model.apply(variables, plan.batch_size, plan.num_pages, plan.page_size,
                       plan.pages_per_row, plan.cache_dtype, rollback=plan.speculative_tokens,
                       method="init_paged_cache")
  drafter = plan.drafter
  return make(plan.model, params[0]), () if drafter is None else drafter.serving_state(
      params[1], make)


def _each(fn, *caches):
  """fn over every layer's cache of the pytrees `caches` (the model's and a draft model's)."""
  return jax.tree.map(fn, *caches, is_leaf=cache_lib.is_cache)


def _with_table(cache, table):
  return _each(lambda c: c.with_table(table), cache)


def _take_row(cache, row):
  """The batch-1 view of row `row` (the paged layers keep the whole pool)."""
  return _each(lambda c: c.take_row(row), cache)


def _put_row(cache, row, row_cache):
  """`cache` with row `row` replaced by the batch-1 `row_cache` (and the pools it updated)."""
  return _each(lambda c, r: c.put_row(row, r), cache, row_cache)


def _pop_pages(s, want_BN):
  """Each True of want_BN [B, n] takes a page off the free stack into the table."""
  flat = want_BN.reshape(-1)
  rank = (jnp.cumsum(flat) - 1).reshape(want_BN.shape)
  pages = s["free"][jnp.clip(s["n_free"] - 1 - rank, 0, s["free"].shape[0] - 1)]
  return dict(s, table=jnp.where(want_BN, pages, s["table"]), n_free=s["n_free"] - flat.sum())


def _push_pages(s, give_BN):
  """Each True of give_BN [B, n] puts that table entry back on the free stack."""
  flat = give_BN.reshape(-1)
  slot = jnp.where(flat, s["n_free"] + jnp.cumsum(flat) - 1, s["free"].shape[0])
  free = s["free"].at[slot].set(s["table"].reshape(-1), mode="drop")
  return dict(s, free=free, n_free=s["n_free"] + flat.sum())


def owning(table_width: int, page: int, held_B):
  """[B, n]: the table entries that rows holding held_B tokens occupy."""
  return jnp.arange(table_width) < -(-held_B[:, None] // page)


def _own(s, page: int, held_B):
  """[B, n]: the entries rows holding held_B tokens occupy that are theirs (past `keep`)."""
  n = s["table"].shape[1]
  return owning(n, page, held_B) & (jnp.arange(n) >= s["keep"][:, None])


def _note_peak(s, page: int):
  """The peak of pages in use (prefix entries nobody holds included), and the tokens held."""
  in_use = s["free"].shape[0] - s["n_free"]
  held = jnp.where(s["req"] >= 0, s["length"], 0)
  higher = in_use > s["peak"][0]
  now = jnp.stack([in_use, held.sum(), (-(-held // page) * page).sum()])
  return dict(s, peak=jnp.where(higher, now, s["peak"]))


def _emit(s, rows_B, tokens_BJ, count_B, stop, page: int):
  """Rows rows_B emit their first count_B of tokens_BJ [B, J] (up to a stop token) into their
  output buffers and after their prompts; a row at its limit or a stop token ends and pushes
  its own pages."""
  b, j = tokens_BJ.shape[0], jnp.arange(tokens_BJ.shape[1])
  stops = jnp.isin(tokens_BJ, stop) & (j < count_B[:, None]) & s["stops"][:, None]
  count = jnp.where(rows_B, jnp.where(stops.any(1), jnp.argmax(stops, 1) + 1, count_B), 0)
  at = lambda start: jnp.where(j < count[:, None], start[:, None] + j, jnp.iinfo(jnp.int32).max)
  rows = jnp.arange(b)[:, None]
  gen = s["gen"] + count
  done = rows_B & ((gen >= s["limit"]) | stops.any(1))
  last = jnp.take_along_axis(tokens_BJ, jnp.maximum(count - 1, 0)[:, None], 1)[:, 0]
  s = dict(s, out=s["out"].at[rows, at(s["count"])].set(tokens_BJ, mode="drop"),
           prompt=s["prompt"].at[rows, at(s["plen"] + s["gen"])].set(tokens_BJ, mode="drop"),
           gen=gen, count=s["count"] + count, token=jnp.where(count > 0, last, s["token"]))
  s = _push_pages(s, _own(s, page, s["length"]) & done[:, None])
  return dict(s, req=jnp.where(done, -1, s["req"]), finished=s["finished"] | done.any())


def _reading(s):
  """[B]: the rows still reading their prompts."""
  return (s["req"] >= 0) & (s["fed"] < s["plen"])


def _keys(s, rows_B, rng):
  """The rows' keys for their next token: for token t of request r, fold_in(fold_in(rng, r),
  t), or fold_in(key(seed), t) for a request with a seed."""
  def key(req, seed, gen):
    own = jax.random.key_data(jax.random.fold_in(jax.random.key(jnp.maximum(seed, 0)), gen))
    shared = jax.random.key_data(jax.random.fold_in(jax.random.fold_in(rng, req), gen))
    return jax.random.wrap_key_data(jnp.where(seed >= 0, own, shared))

  return jax.vmap(key)(s["req"][rows_B], s["seed"][rows_B], s["gen"][rows_B])


def _sampler(s, rows_B) -> sampling.Rows:
  """The rows' own sampling parameters."""
  return sampling.Rows(*(s[k][rows_B] for k in SAMPLING))


def _draw(s, rows_B, logits_BC, rng):
  """Each row's next token by its own sampling parameters and key (`_keys`)."""
  return _sampler(s, rows_B).draw(logits_BC, _keys(s, rows_B, rng))


def _next_piece(plan, s):
  """(row, start, count, index): the oldest row still reading its prompt, where its next piece
  starts, its tokens (at most `chunk`), and the index in `chunks(chunk)` of the smallest size
  that holds them (the piece's padded size)."""
  row = jnp.argmin(jnp.where(_reading(s), s["req"], jnp.iinfo(jnp.int32).max))
  start = s["fed"][row]
  count = jnp.minimum(plan.chunk, s["plen"][row] - start)
  return row, start, count, jnp.searchsorted(jnp.asarray(chunks(plan.chunk)), count)


def _prefill_trip(plan, params, s, stop, rng):
  """A trip's prefill: pieces of the oldest reading rows' prompts, one after another, while the
  trip's padded tokens stay within `chunk` (the first piece always fits)."""
  sizes = jnp.asarray(chunks(plan.chunk))

  def more(carry):
    s, fed = carry
    return _reading(s).any() & (fed + sizes[_next_piece(plan, s)[3]] <= plan.chunk)

  def feed(carry):
    s, fed = carry
    return _prefill(plan, params, s, stop, rng), fed + sizes[_next_piece(plan, s)[3]]

  return jax.lax.while_loop(more, feed, (s, jnp.int32(0)))[0]


def _prefill(plan, params, s, stop, rng):
  """The oldest row still reading its prompt feeds its next piece (`_next_piece`); a row that
  reads its last one samples its first new token."""
  row, start, count, index = _next_piece(plan, s)
  is_row = jnp.arange(s["req"].shape[0]) == row
  s = _pop_pages(s, is_row[:, None] & _own(s, plan.page_size, start + count * is_row)
                 & ~owning(plan.pages_per_row, plan.page_size, s["length"]))

  def feed(size):
    def run(cache):
      tokens = jax.lax.dynamic_slice_in_dim(s["prompt"][row], start, size)[None]
      ar = jnp.arange(size, dtype=jnp.int32)
      positions = jnp.where(ar < count, start + ar, -1)[None]
      (model_row, draft_row) = _take_row(cache, row)
      logits, model_row = plan.model.apply(params[0], tokens, model_row, positions,
                                           method="logits")
      if plan.drafter is not None:
        draft_row = plan.drafter.read(params[1], draft_row, tokens, positions)
      return logits[:, count - 1], _put_row(cache, row, (model_row, draft_row))
    return run

  last, cache = jax.lax.switch(index, [feed(size) for size in chunks(plan.chunk)],
                               _with_table(s["cache"], s["table"]))
  s = dict(s, cache=cache, fed=s["fed"] + count * is_row, length=s["length"] + count * is_row)
  s = _note_peak(s, plan.page_size)
  first = _draw(s, row[None], last, rng)[0]
  read = is_row & (s["fed"] >= s["plen"])
  s = dict(s, prefilled=s["prefilled"] | read.any())
  return _emit(s, read, jnp.full_like(s["token"], first)[:, None], read.astype(jnp.int32), stop,
               plan.page_size)


def _decode(plan, params, s, stop, rng):
  """One token for every row past its prompt (the others: position -1, nothing written)."""
  writing = ~_reading(s) & (s["req"] >= 0)
  s = _pop_pages(s, writing[:, None] & _own(s, plan.page_size, s["length"] + 1)
                 & ~owning(plan.pages_per_row, plan.page_size, s["length"]))
  cache, draft = _with_table(s["cache"], s["table"])
  positions = jnp.where(writing, s["length"], -1)[:, None]
  logits, cache = plan.model.apply(params[0], s["token"][:, None], cache, positions,
                                   method="logits")
  s = dict(s, cache=(cache, draft), length=s["length"] + writing, step=s["step"] + 1)
  s = _note_peak(s, plan.page_size)
  new = _draw(s, jnp.arange(s["req"].shape[0]), logits[:, 0], rng)
  return _emit(s, writing, new[:, None], writing.astype(jnp.int32), stop, plan.page_size)


def _round(plan, kk: int, params, s, stop, rng):
  """A round of speculation for every row past its prompt (see the module docstring): kk
  drafts each (a row's own k may be fewer: the rest are not kept), scored with its pending
  token in one step; the tokens kept emitted, the caches rolled back to them, the pages past
  them pushed."""
  page, n = plan.page_size, plan.pages_per_row
  b, j = s["req"].shape[0], jnp.arange(kk)
  writing = ~_reading(s) & (s["req"] >= 0)
  most = _own(s, page, s["length"] + kk + 1) & ~owning(n, page, s["length"])
  s = _note_peak(_pop_pages(s, writing[:, None] & most), page)
  cache, draft = _with_table(s["cache"], s["table"])
  rows, keys = _sampler(s, jnp.arange(b)), _keys(s, jnp.arange(b), rng)
  draft, drafts, q = plan.drafter.propose(params[1], draft, s["prompt"], s["plen"] + s["gen"],
                                          writing, kk, speculative.fold_rows(keys, 0), rows)
  none, drafts = drafts < 0, jnp.maximum(drafts, 0)  # -1: the row has no draft (fed as 0)
  positions = jnp.where(writing[:, None], s["length"][:, None] + jnp.arange(kk + 1), -1)
  logits, cache = plan.model.apply(params[0], jnp.concatenate([s["token"][:, None], drafts], 1),
                                   cache, positions, method="logits")
  # a draft past the row's own k, or past its limit, is never kept
  proposed = (j < s["own_k"][:, None]) & (j + 1 < (s["limit"] - s["gen"])[:, None]) & ~none
  count, new = speculative.accept(rows, logits, drafts, q, speculative.fold_rows(keys, 1),
                                  proposed)
  count = jnp.where(writing, count, 0)
  kept = s["length"] + count
  s = _push_pages(s, writing[:, None] & most & ~owning(n, page, kept))
  all_kept = count - 1 >= jnp.minimum(kk, s["own_k"])
  own_k = jnp.where(all_kept, jnp.minimum(s["own_k"] + 2, plan.speculative_tokens),
                    jnp.maximum(s["own_k"] - 1, 1))
  s = dict(s, cache=(speculative.rollback(cache, kept), plan.drafter.commit(draft, None, kept)),
           length=kept, step=s["step"] + 1, own_k=jnp.where(writing, own_k, s["own_k"]),
           drafted=s["drafted"] + jnp.where(writing, proposed.sum(1), 0).sum(),
           accepted=s["accepted"] + jnp.maximum(count - 1, 0).sum())
  return _emit(s, writing, new, count, stop, page)


def _decode_or_round(plan, params, s, stop, rng):
  """A decode step, or with a drafter a round of the smallest size in `speculative.ks(k)` that
  covers every writing row's own k."""
  if plan.drafter is None:
    return _decode(plan, params, s, stop, rng)
  ladder = speculative.ks(plan.speculative_tokens)
  writing = ~_reading(s) & (s["req"] >= 0)
  wanted = jnp.max(jnp.where(writing, s["own_k"], 1))
  rounds = [functools.partial(_round, plan, kk, params, stop=stop, rng=rng) for kk in ladder]
  return jax.lax.switch(jnp.searchsorted(jnp.asarray(ladder), wanted), rounds, s)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
@cache_lib.caller_makes_room  # the host admits a request only when its pages are covered
def segment(plan: Plan, params, cache, rows: dict, rng, reset_B, copy_src_B, copy_dst_B,
            max_trips, waiting, first_tokens=False):
  """One run of the loop (see the module docstring): (cache, rows). `reset_B` marks the rows
  the host just gave a request (their caches emptied); pages copy_src_B are copied into
  copy_dst_B first (copy-on-write; a destination P is none). `max_trips`, `waiting` and
  `first_tokens` are traced: one program serves every run."""
  stop = jnp.asarray(plan.stop_tokens, jnp.int32)
  cache = _each(lambda c: c.reset_rows(reset_B).copy_pages(copy_src_B, copy_dst_B), cache)
  s = dict(rows, cache=cache, count=jnp.zeros_like(rows["count"]), trips=jnp.int32(0),
           finished=jnp.bool_(False), prefilled=jnp.bool_(False))

  def more(s):
    host_wanted = ((waiting & (s["finished"] | (s["prefilled"] & (s["req"] < 0).any())))
                   | (first_tokens & s["prefilled"]))
    return ((s["req"] >= 0).any() & ~host_wanted & (s["trips"] < max_trips)
            & (s["count"].max() + plan.most_per_trip <= plan.out_width))

  def body(s):
    s = _prefill_trip(plan, params, s, stop, rng)
    writing = ~_reading(s) & (s["req"] >= 0)
    s = jax.lax.cond(writing.any(), lambda s: _decode_or_round(plan, params, s, stop, rng),
                     lambda s: s, s)
    return dict(s, trips=s["trips"] + 1)

  s = jax.lax.while_loop(more, body, s)
  cache = s.pop("cache")
  return cache, s
