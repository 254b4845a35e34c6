"""Serving many prompts of different lengths: continuous batching over a paged KV cache.

`serve` keeps `batch_size` rows busy: a prompt is admitted into a free row as soon as one frees
up, prefilled alone (its own length, no padding to the longest), and then generates with the
other rows one token a step. The global layers' keys and values live in a shared pool of pages
(`flax_mha.cache.PagedKVCache`): a row takes a page when its length crosses a page boundary and
gives its pages back when it finishes, so the pool holds what the live rows hold, rounded up to
pages; the local layers keep rolling caches of their window. The host does the bookkeeping
(which row owns which pages) between jitted steps.

`serve_static`, the baseline: groups of `batch_size` prompts padded to the group's longest,
each group running until its longest request is done (`flax_mha.models.decoding.generate`).

The model must provide `init_paged_cache` and `logits` (as `flax_mha.models.DecoderLM` and its
NNX twin `flax_mha.models.lm_nnx.DecoderLM` do): a linen module with its variables as `params`,
or an NNX module with `params` None (see `flax_mha.models.decoding.decodable`). Both functions
refuse an empty prompt and ids outside the vocabulary [0, C), C the size of the logits.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time

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


def _map_layers(fn_kv, fn_paged, cache):
  """Apply fn_kv to the rolling (KVCache) layers and fn_paged to the paged ones."""
  return tuple(fn_paged(c) if isinstance(c, cache_lib.PagedKVCache) else fn_kv(c) for c in cache)


def _with_table(cache, table):
  return _map_layers(lambda c: c, lambda c: dataclasses.replace(c, page_indices=table), cache)


def _reset_row(cache, row):
  """Row `row` emptied: no position held, length 0 (its old pages are the host's to reuse)."""
  def kv(c):
    return dataclasses.replace(c, positions=c.positions.at[row].set(-1),
                               length=c.length.at[row].set(0))
  return _map_layers(kv, lambda c: dataclasses.replace(c, length=c.length.at[row].set(0)), cache)


def _take_row(cache, row):
  """The batch-1 view of row `row` (the paged layers keep the whole pool)."""
  one = lambda x: jax.lax.dynamic_slice_in_dim(x, row, 1)
  def kv(c):
    return dataclasses.replace(c, key=one(c.key), value=one(c.value),
                               positions=one(c.positions), length=one(c.length))
  return _map_layers(
      kv, lambda c: dataclasses.replace(c, page_indices=one(c.page_indices), length=one(c.length)),
      cache)


def _put_row(cache, row, row_cache):
  """`cache` with row `row` replaced by the batch-1 `row_cache` (and the pools it updated)."""
  put = lambda x, y: jax.lax.dynamic_update_slice_in_dim(x, y, row, 0)
  def one(c, r):
    if isinstance(c, cache_lib.PagedKVCache):
      return dataclasses.replace(c, k_pages=r.k_pages, v_pages=r.v_pages,
                                 length=put(c.length, r.length))
    return dataclasses.replace(c, key=put(c.key, r.key), value=put(c.value, r.value),
                               positions=put(c.positions, r.positions),
                               length=put(c.length, r.length))
  return tuple(one(c, r) for c, r in zip(cache, row_cache))


@functools.partial(jax.jit, static_argnums=(0, 7), donate_argnums=(2,))
@cache_lib.caller_makes_room  # serve checks the pool and hands out the pages
def _prefill(model, params, cache, table, tokens_1L, length, row, sampler, rng, request):
  """Row `row` takes a prompt (tokens [1, L] padded past `length`): its first new token."""
  cache = _reset_row(_with_table(cache, table), row)
  ar = jnp.arange(tokens_1L.shape[1], dtype=jnp.int32)
  positions = jnp.where(ar < length, ar, -1)[None]
  logits, row_cache = model.apply(params, tokens_1L, _take_row(cache, row), positions,
                                  method="logits")
  token = sampler(logits[:, length - 1], jax.random.fold_in(rng, 2 * request))[0]
  return token, _put_row(cache, row, row_cache)


@functools.partial(jax.jit, static_argnums=(0, 6), donate_argnums=(2,))
@cache_lib.caller_makes_room
def _step(model, params, cache, table, tokens_B, active_B, sampler, rng, step):
  """One token for every active row (inactive rows: position -1, nothing written)."""
  cache = _with_table(cache, table)
  positions = jnp.where(active_B, cache_lib.next_positions(cache[0], 1)[:, 0], -1)[:, None]
  logits, cache = model.apply(params, tokens_B[:, None], cache, positions,
                              method="logits")
  return sampler(logits[:, 0], jax.random.fold_in(rng, 2 * step + 1)), cache


def _bucket(length: int) -> int:
  """The padded prompt length a prefill compiles for: the next power of two (few shapes)."""
  return 1 << max(4, (length - 1).bit_length())


def serve(model, params, prompts, max_new_tokens, *, batch_size: int, page_size: int,
          num_pages: int, stop_tokens=(), sampler=decoding.Greedy(), rng=None):
  """Continuous batching (see the module docstring): (new tokens per prompt, ServeStats).

  prompts: sequences of token ids; max_new_tokens: an int or one per prompt. The pool must
  hold the live rows: num_pages >= batch_size · pages of the longest request.
  """
  model, params = decoding.decodable(model, params)
  checks.check_int("batch_size", batch_size)
  checks.check_int("page_size", page_size)
  prompts = _prompts(prompts, decoding.vocabulary(model, params, "init_paged_cache",
                                                  static=(1, 1, 1, 1)))
  limits = _limits(max_new_tokens, len(prompts))
  pages_per_row = max(math.ceil((len(p) + n) / page_size) for p, n in zip(prompts, limits))
  if num_pages < batch_size * pages_per_row:
    raise ValueError(f"num_pages={num_pages} cannot hold {batch_size} rows of up to "
                     f"{pages_per_row} pages: pass at least {batch_size * pages_per_row}")
  rng = jax.random.key(0) if rng is None else rng
  cache = model.apply(params, batch_size, num_pages, page_size, pages_per_row,
                      method="init_paged_cache")
  table = np.zeros((batch_size, pages_per_row), np.int32)
  free = collections.deque(range(num_pages))
  queue = collections.deque(range(len(prompts)))
  rows = [None] * batch_size  # the request each row serves
  outputs = [[] for _ in prompts]
  tokens, active = np.zeros(batch_size, np.int32), np.zeros(batch_size, bool)
  lengths = np.zeros(batch_size, np.int64)  # tokens each row holds
  peak, peak_held, steps, start = 0, (0, 0), 0, time.perf_counter()

  def finish(row, token):
    request = rows[row]
    outputs[request].append(int(token))
    done = len(outputs[request]) >= limits[request] or int(token) in stop_tokens
    if done:
      owned = math.ceil(lengths[row] / page_size)
      free.extend(int(p) for p in table[row, :owned])
      rows[row], active[row] = None, False
    return done

  while queue or active.any():
    for row in range(batch_size):  # admit into every free row
      if rows[row] is not None or not queue:
        continue
      request = queue.popleft()
      prompt = prompts[request]
      owned = math.ceil(len(prompt) / page_size)
      table[row, :owned] = [free.popleft() for _ in range(owned)]
      padded = np.zeros((1, _bucket(len(prompt))), np.int32)
      padded[0, :len(prompt)] = prompt
      token, cache = _prefill(model, params, cache, table, padded, len(prompt), row, sampler,
                              rng, request)
      rows[row], lengths[row] = request, len(prompt)
      if not finish(row, token):
        tokens[row], active[row] = int(token), True
    if not active.any():
      continue
    for row in np.flatnonzero(active):  # a row about to start a new page takes one
      if lengths[row] % page_size == 0:
        table[row, lengths[row] // page_size] = free.popleft()
    if num_pages - len(free) > peak:  # the step writes one token per active row
      held = lengths[active] + 1
      peak = num_pages - len(free)
      peak_held = int(held.sum()), int(np.sum(-(-held // page_size) * page_size))
    new, cache = _step(model, params, cache, table, tokens, active, sampler, rng, steps)
    new, steps = np.asarray(new), steps + 1
    for row in np.flatnonzero(active):
      lengths[row] += 1
      if not finish(row, new[row]):
        tokens[row] = new[row]
  seconds = time.perf_counter() - start
  return outputs, ServeStats(sum(map(len, outputs)), seconds, peak, page_size, *peak_held)


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
      done.setdefault(i, _until_stop(new[row, :limits[i]], stop_tokens))
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


def _until_stop(tokens, stop_tokens) -> list[int]:
  out = []
  for token in tokens:
    out.append(int(token))
    if int(token) in stop_tokens:
      break
  return out
