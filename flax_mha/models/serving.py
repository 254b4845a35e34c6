"""Serving many prompts of different lengths: continuous batching over a paged KV cache.

`serve` keeps `batch_size` rows busy, as one compiled program: a `lax.while_loop` whose every
trip admits waiting prompts into free rows, feeds one row's prompt a piece (chunked prefill:
at most `prefill_chunk` tokens, the last piece in the smallest of a few sizes that holds it),
and runs one decode step for every row past its prompt. So a long prompt enters between decode
steps and no running row waits for a whole prefill, and the host hands over the prompts and
takes the tokens once, with no round trip per token. The global layers' keys and values live
in a shared pool of pages (`flax_mha.cache.PagedKVCache`): a row takes pages off a free stack
(on the device) as its length crosses page boundaries and puts them back when it finishes, so
the pool holds what the live rows hold, rounded up to pages; the local layers keep rolling
caches of their window.

`serve_static`, the baseline: groups of `batch_size` prompts padded to the group's longest,
each group running until its longest request is done (`flax_mha.models.decoding.generate`).

The model must provide `init_paged_cache` and `logits` (as `flax_mha.models.DecoderLM` and its
NNX twin `flax_mha.models.lm_nnx.DecoderLM` do): a linen module with its variables as `params`,
or an NNX module with `params` None (see `flax_mha.models.decoding.decodable`). Both functions
refuse an empty prompt and ids outside the vocabulary [0, C), C the size of the logits.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flax_mha import cache as cache_lib
from flax_mha import checks
from flax_mha.models import decoding


@dataclasses.dataclass
class ServeStats:
  """What a serving run did: new tokens, wall seconds (compilation excluded when warmed up),
  the most pages in use at once and the tokens the rows held then."""
  new_tokens: int
  seconds: float
  peak_pages: int
  page_size: int
  peak_tokens: int = 0
  peak_tokens_in_pages: int = 0  # the same, each row's rounded up to whole pages

  @property
  def tokens_per_second(self) -> float:
    return self.new_tokens / self.seconds


def _with_table(cache, table):
  return tuple(c.with_table(table) for c in cache)


def _take_row(cache, row):
  """The batch-1 view of row `row` (the paged layers keep the whole pool)."""
  return tuple(c.take_row(row) for c in cache)


def _put_row(cache, row, row_cache):
  """`cache` with row `row` replaced by the batch-1 `row_cache` (and the pools it updated)."""
  return tuple(c.put_row(row, r) for c, r in zip(cache, row_cache))


def _reset_rows(cache, rows_B):
  """The rows `rows_B` (bool [B]) emptied: no position held, length 0 (their old pages are
  back on the free stack)."""
  return tuple(c.reset_rows(rows_B) for c in cache)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """The static facts of a serving program."""
  model: Any
  sampler: Any
  stop_tokens: tuple
  chunk: int  # prompt tokens a prefill step feeds
  page_size: int
  batch_size: int
  num_pages: int
  pages_per_row: int  # the table's width
  max_new_tokens: int  # the output buffer's width


def _pop_pages(s, want_BP):
  """Each True of want_BP [B, pages per row] takes a page off the free stack into the table."""
  flat = want_BP.reshape(-1)
  rank = (jnp.cumsum(flat) - 1).reshape(want_BP.shape)
  pages = s["free"][jnp.clip(s["n_free"] - 1 - rank, 0, s["free"].shape[0] - 1)]
  return dict(s, table=jnp.where(want_BP, pages, s["table"]), n_free=s["n_free"] - flat.sum())


def _push_pages(s, give_BP):
  """Each True of give_BP [B, pages per row] puts that table entry back on the free stack."""
  flat = give_BP.reshape(-1)
  slot = jnp.where(flat, s["n_free"] + jnp.cumsum(flat) - 1, s["free"].shape[0])
  free = s["free"].at[slot].set(s["table"].reshape(-1), mode="drop")
  return dict(s, free=free, n_free=s["n_free"] + flat.sum())


def _owning(s, page: int, held_B):
  """[B, pages per row]: the table entries that rows holding held_B tokens own."""
  return jnp.arange(s["table"].shape[1]) < -(-held_B[:, None] // page)


def _note_peak(s, page: int):
  """The peak of pages in use, and the tokens held then."""
  in_use = s["free"].shape[0] - s["n_free"]
  held = jnp.where(s["req"] >= 0, s["length"], 0)
  higher = in_use > s["peak"][0]
  now = jnp.stack([in_use, held.sum(), (-(-held // page) * page).sum()])
  return dict(s, peak=jnp.where(higher, now, s["peak"]))


def _emit(s, rows_B, tokens_B, limits, stop, page: int):
  """Rows rows_B emit tokens_B: written out, counted; a row at its limit or a stop token ends
  and gives its pages back."""
  req = jnp.where(rows_B, s["req"], s["out"].shape[0])
  out = s["out"].at[req, s["gen"]].set(tokens_B, mode="drop")
  gen = s["gen"] + rows_B
  done = rows_B & ((gen >= limits[jnp.maximum(s["req"], 0)]) | jnp.isin(tokens_B, stop))
  s = dict(s, out=out, gen=gen, token=jnp.where(rows_B, tokens_B, s["token"]))
  s = _push_pages(s, _owning(s, page, s["length"]) & done[:, None])
  return dict(s, req=jnp.where(done, -1, s["req"]))


def _reading(s, lengths):
  """[B]: the rows still reading their prompts."""
  return (s["req"] >= 0) & (s["fed"] < lengths[jnp.maximum(s["req"], 0)])


def _admit(s, n_requests):
  """Every free row takes the next waiting request (in order)."""
  idle = s["req"] < 0
  new = s["next"] + jnp.cumsum(idle) - 1
  take = idle & (new < n_requests)
  zero = lambda x: jnp.where(take, 0, x)
  return dict(s, req=jnp.where(take, new, s["req"]), next=s["next"] + take.sum(),
              fed=zero(s["fed"]), length=zero(s["length"]), gen=zero(s["gen"]),
              cache=_reset_rows(s["cache"], take))


def _chunks(chunk: int) -> tuple:
  """The prefill step's sizes: `chunk` and the powers of 4 from 16 below it (a prompt's last
  piece takes the smallest that holds it, so short prompts are not padded to `chunk`)."""
  sizes, size = [], 16
  while size < chunk:
    sizes.append(size)
    size *= 4
  return (*sizes, chunk)


def _prefill(plan, params, s, prompts, lengths, limits, stop, rng):
  """The oldest row still reading its prompt feeds its next piece (at most `chunk` tokens); a
  row that reads its last one samples its first new token."""
  reading = _reading(s, lengths)
  row = jnp.argmin(jnp.where(reading, s["req"], jnp.iinfo(jnp.int32).max))
  req, start = s["req"][row], s["fed"][row]
  count = jnp.minimum(plan.chunk, lengths[req] - start)
  is_row = jnp.arange(s["req"].shape[0]) == row
  s = _pop_pages(s, is_row[:, None] & _owning(s, plan.page_size, start + count * is_row)
                 & ~_owning(s, plan.page_size, s["length"]))

  def feed(size):
    def run(cache):
      tokens = jax.lax.dynamic_slice_in_dim(prompts[req], start, size)[None]
      ar = jnp.arange(size, dtype=jnp.int32)
      positions = jnp.where(ar < count, start + ar, -1)[None]
      logits, row_cache = plan.model.apply(params, tokens, _take_row(cache, row), positions,
                                           method="logits")
      return logits[:, count - 1], _put_row(cache, row, row_cache)
    return run

  sizes = _chunks(plan.chunk)
  index = jnp.searchsorted(jnp.asarray(sizes), count)  # the smallest size >= count
  last, cache = jax.lax.switch(index, [feed(size) for size in sizes],
                               _with_table(s["cache"], s["table"]))
  s = dict(s, cache=cache, fed=s["fed"] + count * is_row, length=s["length"] + count * is_row)
  s = _note_peak(s, plan.page_size)
  first = plan.sampler(last, jax.random.fold_in(rng, 2 * req))[0]
  read = is_row & (s["fed"] >= lengths[req])
  return _emit(s, read, jnp.full_like(s["token"], first), limits, stop, plan.page_size)


def _decode(plan, params, s, lengths, limits, stop, rng):
  """One token for every row past its prompt (the others: position -1, nothing written)."""
  writing = ~_reading(s, lengths) & (s["req"] >= 0)
  s = _pop_pages(s, writing[:, None] & _owning(s, plan.page_size, s["length"] + 1)
                 & ~_owning(s, plan.page_size, s["length"]))
  cache = _with_table(s["cache"], s["table"])
  positions = jnp.where(writing, s["length"], -1)[:, None]
  logits, cache = plan.model.apply(params, s["token"][:, None], cache, positions,
                                   method="logits")
  s = dict(s, cache=cache, length=s["length"] + writing, step=s["step"] + 1)
  s = _note_peak(s, plan.page_size)
  new = plan.sampler(logits[:, 0], jax.random.fold_in(rng, 2 * s["step"] + 1))
  return _emit(s, writing, new, limits, stop, plan.page_size)


def _start(plan, params, n_requests_padded: int):
  """The loop's state before the first request: an empty pool, every page free, rows idle."""
  rows = lambda value: jnp.full((plan.batch_size,), value, jnp.int32)
  return dict(
      cache=plan.model.apply(params, plan.batch_size, plan.num_pages, plan.page_size,
                             plan.pages_per_row, method="init_paged_cache"),
      table=jnp.zeros((plan.batch_size, plan.pages_per_row), jnp.int32),
      free=jnp.arange(plan.num_pages, dtype=jnp.int32)[::-1], n_free=jnp.int32(plan.num_pages),
      req=rows(-1), fed=rows(0), length=rows(0), gen=rows(0), token=rows(0),
      next=jnp.int32(0), step=jnp.int32(0),
      out=jnp.zeros((n_requests_padded, plan.max_new_tokens), jnp.int32),
      peak=jnp.zeros((3,), jnp.int32))


@functools.partial(jax.jit, static_argnums=(0,))
@cache_lib.caller_makes_room  # the pool holds every live row's pages (checked by serve)
def _serve(plan, params, prompts, lengths, limits, n_requests, rng):
  """The whole continuous-batching loop as one program: admit, one prefill chunk, one decode
  step, until every request is done; (tokens [R, N], peak [3])."""
  stop = jnp.asarray(plan.stop_tokens, jnp.int32)
  s = _start(plan, params, prompts.shape[0])

  def body(s):
    s = _admit(s, n_requests)
    reading = _reading(s, lengths)
    s = jax.lax.cond(reading.any(), lambda s: _prefill(plan, params, s, prompts, lengths,
                                                       limits, stop, rng), lambda s: s, s)
    writing = ~_reading(s, lengths) & (s["req"] >= 0)
    return jax.lax.cond(writing.any(), lambda s: _decode(plan, params, s, lengths, limits, stop,
                                                         rng), lambda s: s, s)

  s = jax.lax.while_loop(lambda s: (s["next"] < n_requests) | (s["req"] >= 0).any(), body, s)
  return s["out"], s["peak"]


# The most prompt tokens one trip of the loop feeds: the faster of 256, 512 and 1024 on
# `python -m experiments.bench.generation --part serving` (512 and 1024 level; 256 slower).
PREFILL_CHUNK = 512


def _pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def serve(model, params, prompts, max_new_tokens, *, batch_size: int, page_size: int,
          num_pages: int, prefill_chunk: int = PREFILL_CHUNK, stop_tokens=(),
          sampler=decoding.Greedy(), rng=None):
  """Continuous batching (see the module docstring): (new tokens per prompt, ServeStats).

  prompts: sequences of token ids; max_new_tokens: an int or one per prompt. The pool must
  hold the live rows: num_pages >= batch_size · pages of the longest request. prefill_chunk:
  the most prompt tokens one trip feeds between two decode steps (larger: faster prefill,
  longer waits for the running rows). Greedy tokens equal `decoding.generate`'s; a sampler
  draws with keys folded from `rng` by request (first token) and by step (the others).
  The stats' seconds include compilation on a first call with new shapes. No prompts: no
  outputs, ([], ServeStats) of 0 tokens and 0 pages, after the same checks and nothing run.
  """
  model, params = decoding.decodable(model, params)
  for name, value in (("batch_size", batch_size), ("page_size", page_size),
                      ("num_pages", num_pages), ("prefill_chunk", prefill_chunk)):
    checks.check_int(name, value)
  started = time.perf_counter()
  prompts = _prompts(prompts, decoding.vocabulary(model, params, "init_paged_cache",
                                                  static=(1, 1, 1, 1)))
  limits = _limits(max_new_tokens, len(prompts))
  if not prompts:
    return [], ServeStats(0, time.perf_counter() - started, 0, page_size)
  pages_per_row = max(math.ceil((len(p) + n) / page_size) for p, n in zip(prompts, limits))
  if num_pages < batch_size * pages_per_row:
    raise ValueError(f"num_pages={num_pages} cannot hold {batch_size} rows of up to "
                     f"{pages_per_row} pages: pass at least {batch_size * pages_per_row}")
  rng = jax.random.key(0) if rng is None else rng
  padded, lengths, limit_arr = _requests(prompts, limits, prefill_chunk)
  plan = _Plan(model, sampler, tuple(int(t) for t in stop_tokens), prefill_chunk, page_size,
               batch_size, num_pages, pages_per_row, _pow2(max(limits)))
  start = time.perf_counter()
  out, peak = (np.asarray(x) for x in _serve(plan, params, padded, lengths, limit_arr,
                                              len(prompts), rng))
  seconds = time.perf_counter() - start
  outputs = [until_stop(out[i, :limit], stop_tokens) for i, limit in enumerate(limits)]
  return outputs, ServeStats(sum(map(len, outputs)), seconds, int(peak[0]), page_size,
                             int(peak[1]), int(peak[2]))


def _requests(prompts, limits, chunk: int):
  """(prompts [R', W], lengths [R'], limits [R']) as the loop reads them: R' the number of
  requests and W the prompt chunks rounded up to powers of two (few compiled shapes), plus one
  chunk of room (a row's last piece may run past its prompt); the padding requests are empty."""
  n, longest = len(prompts), max(map(len, prompts))
  padded = np.zeros((_pow2(n), (_pow2(-(-longest // chunk)) + 1) * chunk), np.int32)
  for i, prompt in enumerate(prompts):
    padded[i, :len(prompt)] = prompt
  pad = [0] * (len(padded) - n)
  return (padded, np.array([len(p) for p in prompts] + pad, np.int32),
          np.array(list(limits) + pad, np.int32))


def serve_static(model, params, prompts, max_new_tokens, *, batch_size: int, stop_tokens=(),
                 sampler=decoding.Greedy(), rng=None):
  """The baseline: groups of `batch_size` prompts, right-padded to the group's longest, each
  generating until the group's largest limit; (new tokens per prompt, ServeStats without
  pages)."""
  model, params = decoding.decodable(model, params)
  prompts = _prompts(prompts, decoding.vocabulary(model, params, "init_cache",
                                                  (np.zeros((1, 1), np.int32),), (1,)))
  limits = _limits(max_new_tokens, len(prompts))
  outputs, start = [], time.perf_counter()
  for first in range(0, len(prompts), batch_size):
    group = list(range(first, min(first + batch_size, len(prompts))))
    group += [group[-1]] * (batch_size - len(group))  # one shape for every group
    length = max(len(prompts[i]) for i in group)
    padded = np.zeros((batch_size, length), np.int32)
    for row, i in enumerate(group):
      padded[row, :len(prompts[i])] = prompts[i]
    lengths = np.array([len(prompts[i]) for i in group], np.int32)
    new = np.asarray(decoding.generate(
        model, params, (padded,), padded, lengths, max_new_tokens=max(limits[i] for i in group),
        sampler=sampler, stop_tokens=tuple(stop_tokens), rng=rng))
    done = {}
    for row, i in enumerate(group):
      done.setdefault(i, until_stop(new[row, :limits[i]], stop_tokens))
    outputs += [done[i] for i in sorted(done)]
  seconds = time.perf_counter() - start
  return outputs, ServeStats(sum(map(len, outputs)), seconds, 0, 0)


def _prompts(prompts, vocab_size: int) -> list[np.ndarray]:
  """Each prompt as int32 ids [L], refused when empty, not 1-D integers or outside
  [0, vocab_size)."""
  out = []
  for i, prompt in enumerate(prompts):
    prompt = np.asarray(prompt)
    if prompt.ndim != 1 or prompt.size == 0 or not np.issubdtype(prompt.dtype, np.integer):
      raise ValueError(f"prompts[{i}] must be a non-empty sequence of integer token ids, got "
                       f"shape {prompt.shape} and dtype {prompt.dtype}")
    checks.check_token_ids(f"prompts[{i}]", prompt, vocab_size)
    out.append(prompt.astype(np.int32))
  return out


def _limits(max_new_tokens, n: int) -> list[int]:
  limits = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
  if len(limits) != n:
    raise ValueError(f"max_new_tokens must be an int or one per prompt ({n}), got {len(limits)}")
  return [checks.check_int("max_new_tokens", m) for m in limits]


def until_stop(tokens, stop_tokens) -> list[int]:
  """The ids of `tokens` up to and including the first stop token (all of them without one)."""
  out = []
  for token in tokens:
    out.append(int(token))
    if int(token) in stop_tokens:
      break
  return out
