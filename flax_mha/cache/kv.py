"""A key/value cache that is data: a pytree passed into an attention layer and returned updated.

  cache = KVCache.create(batch, capacity, num_kv_heads, head_dim)
  out, cache = attend(query, key, value, cache)            # a prompt, a chunk, or one token

The cache holds each row's keys [B, G, C, K] and values [B, G, C, V], head-major (each head's
keys contiguous: a decoding step reads them at the memory's speed; G key/value heads: GQA
caches hold G heads, not H), the absolute position of the token in each slot [B, C] (-1: empty)
and each row's next position [B]: rows advance independently, so a batch of prompts of
different lengths needs no left padding. Attention over the cache is attention with
`q_positions`/`kv_positions`: causality and windows compare positions and empty slots are
hidden. This module holds the caches and their writers; reading is `flax_mha.cache.steps`'s: a step
of a few tokens runs the kernel `flax_mha.dispatch` chooses for it ("xla" over the smallest
power-of-two prefix of slots that holds every filled one, so it costs what is filled, not the
capacity; on 'cuda' the Triton decode kernel, which reads each row's filled blocks in place;
`flax_mha.cache.explain` says which and why), and a long prefill goes through
`dot_product_attention`'s dispatch (chunked skips empty tiles).

Two layouts, by what a layer attends to:
- full (window None): slot = position; writing at or past the capacity never overwrites. A
  chunk at the rows' next positions (the default) longer than the capacity is a ValueError
  while tracing (static sizes), inside `jit` too, as is any overflow eagerly. Inside `jit` a
  position past the capacity that only the data shows (the cache's length is traced) is not
  written, and the row's length passes the capacity: from then on every output of that row
  is NaN (loud, as an out-of-range token id is). That check is data, not a host callback, so a
  step exported with `jax.export` keeps it; a decoding loop that sizes its cache for every
  token it writes (as `flax_mha.models.decoding` and `serving` do) traces inside
  `room_made_by_caller()`, which drops it.
- rolling (a local layer, window w): the first `sink_tokens` positions keep their slots
  (StreamingLLM's attention sinks) and the rest share w slots round-robin, so memory stays
  sink_tokens + w whatever the generated length. A chunk attends over the cache and itself
  before it is written, so chunks of any length (a whole prompt) work.

An int8 cache (`dtype=jnp.int8`) stores each token's key and value per head as int8 and a
float32 scale (`flax_mha.quant`: symmetric, max|x| / 127 per row), quantized when written:
a quarter of a float32 cache's bytes, plus 4 bytes per token and head for each scale. A step
reads it where it lies: "decode" and, on 'cuda', "triton_decode" dequantize each block they
load, never a float copy of the cache; the "xla" step (a CPU's choice for a contiguous cache
of up to `dispatch.XLA_INT8_MAX_SLOTS` slots) dequantizes the filled prefix its branch reads,
inside the product's fusion; a prefill (more than FEW_QUERIES queries) or an `implementation`
named other than the step kernels ("decode", "triton_decode") dequantizes the keys it hands to
`dot_product_attention`. It is for inference: a gradient through the keys written into it
raises (`flax_mha.quant`), one with respect to the query of a step is taken.

Keys arrive already rotated (rotary is applied when a key is written, by the front ends).
Shapes: B batch, C capacity, T new tokens, G key/value heads, K, V head dims, H query heads.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import jax
import jax.numpy as jnp
# jax's own config states are the one way to make a setting part of jit's trace cache key.
from jax._src import config as jax_config

from flax_mha import checks
from flax_mha import precision
from flax_mha import quant


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """One attention layer's cache (see the module docstring); `window`, `sink_tokens` static."""
  key: Any  # [B, G, C, K]
  value: Any  # [B, G, C, V]
  positions: Any  # [B, C] int32: the position held in each slot, -1 when empty
  length: Any  # [B] int32: tokens seen per row, the position of the next one
  window: int | None = dataclasses.field(default=None, metadata=dict(static=True))
  sink_tokens: int = dataclasses.field(default=0, metadata=dict(static=True))
  key_scale: Any = None  # [B, G, C] float32 of an int8 cache (flax_mha.quant), else None
  value_scale: Any = None  # [B, G, C] likewise

  @classmethod
  def create(cls, batch_size: int, capacity: int, num_kv_heads: int, head_dim: int,
             v_head_dim: int | None = None, dtype=jnp.float32, *, window: int | None = None,
             sink_tokens: int = 0, rollback: int = 0) -> "KVCache":
    """An empty cache. With `window` (a local layer's keys back), a rolling cache of
    sink_tokens + window + rollback slots whatever `capacity` says, when that is smaller: the
    `rollback` extra slots keep the tokens a `rollback` of that many tokens needs (speculative
    decoding), which a window alone would have overwritten. `dtype`: a floating dtype, or
    jnp.int8 (quantized on write, with float32 scales [B, G, C])."""
    for name, value in (("batch_size", batch_size), ("capacity", capacity),
                        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
      checks.check_int(name, value)
    dtype = quant.check_cache_dtype(dtype)
    v_head_dim = head_dim if v_head_dim is None else checks.check_int("v_head_dim", v_head_dim)
    checks.check_int("sink_tokens", sink_tokens, lowest=0)
    checks.check_int("rollback", rollback, lowest=0)
    if window is not None:
      checks.check_int("window", window, lowest=0)
      if sink_tokens + window + rollback >= capacity:
        window = None  # the whole sequence fits: a full cache is the same and simpler
      else:
        capacity = sink_tokens + window + rollback
    elif sink_tokens:
      raise ValueError(f"sink_tokens={sink_tokens} keeps tokens beyond a window: it needs "
                       "window")
    scales = ((jnp.zeros((batch_size, num_kv_heads, capacity), jnp.float32),) * 2
              if quant.is_quantized(dtype) else (None, None))
    return cls(jnp.zeros((batch_size, num_kv_heads, capacity, head_dim), dtype),
               jnp.zeros((batch_size, num_kv_heads, capacity, v_head_dim), dtype),
               jnp.full((batch_size, capacity), -1, jnp.int32),
               jnp.zeros((batch_size,), jnp.int32), window, sink_tokens, *scales)

  @property
  def capacity(self) -> int:
    return self.key.shape[2]

  @property
  def scales(self):
    """(key_scale, value_scale) of an int8 cache, None for a floating one."""
    return None if self.key_scale is None else (self.key_scale, self.value_scale)

  # The rows and the page table, as a serving loop handles them (one protocol for both kinds).

  @property
  def takes_mask(self) -> bool:
    """Whether a dense mask over the slots means anything: a full cache's slots are positions;
    a rolling cache's move."""
    return self.window is None

  def with_table(self, table) -> "KVCache":
    """The cache for a page table (a contiguous cache has none: itself)."""
    del table
    return self

  def take_row(self, row) -> "KVCache":
    """The batch-1 view of row `row` (traced `row` fine)."""
    one = lambda x: None if x is None else jax.lax.dynamic_slice_in_dim(x, row, 1)
    return dataclasses.replace(self, key=one(self.key), value=one(self.value),
                               positions=one(self.positions), length=one(self.length),
                               key_scale=one(self.key_scale), value_scale=one(self.value_scale))

  def put_row(self, row, row_cache: "KVCache") -> "KVCache":
    """The cache with row `row` replaced by the batch-1 `row_cache`."""
    put = lambda x, y: None if x is None else jax.lax.dynamic_update_slice_in_dim(x, y, row, 0)
    return dataclasses.replace(self, key=put(self.key, row_cache.key),
                               value=put(self.value, row_cache.value),
                               positions=put(self.positions, row_cache.positions),
                               length=put(self.length, row_cache.length),
                               key_scale=put(self.key_scale, row_cache.key_scale),
                               value_scale=put(self.value_scale, row_cache.value_scale))

  def copy_pages(self, src_N, dst_N) -> "KVCache":
    """A contiguous cache has no pages to copy: itself."""
    del src_N, dst_N
    return self

  def reset_rows(self, rows_B) -> "KVCache":
    """The rows `rows_B` (bool [B]) emptied: no position held, length 0."""
    return dataclasses.replace(self, positions=jnp.where(rows_B[:, None], -1, self.positions),
                               length=jnp.where(rows_B, 0, self.length))

  def rollback(self, length_B) -> "KVCache":
    """Each row cut back to its first length_B [B] tokens: the slots of later positions
    emptied (what attention reads is then what a cache that never saw them holds). A rolling
    cache keeps what the window needs only for rollbacks within its `rollback` extra slots."""
    length_B = jnp.minimum(jnp.asarray(length_B, jnp.int32), self.length)
    return dataclasses.replace(
        self, positions=jnp.where(self.positions >= length_B[:, None], -1, self.positions),
        length=length_B)


def next_positions(cache, num_tokens: int):
  """[B, T] positions of the next `num_tokens` tokens of each row. More than a full or paged
  cache's capacity cannot fit: a ValueError, while tracing too (the sizes are static)."""
  if getattr(cache, "window", None) is None and num_tokens > cache.capacity:
    raise ValueError(f"KV cache overflow: writing {num_tokens} tokens into a cache of capacity "
                     f"{cache.capacity}; make the cache larger (capacity >= prompt + new tokens)")
  return cache.length[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)


def _slots(cache: KVCache, positions_BT):
  """Where each new token goes ([B, T]; out of range = not written): its position in a full
  cache; in a rolling one, sink positions keep theirs and the rest share the window's slots,
  only the last `window` tokens of a chunk being written (earlier ones would be overwritten)."""
  c = cache.capacity
  valid = positions_BT >= 0
  if cache.window is None:
    return jnp.where(valid, positions_BT, c)
  n = cache.sink_tokens
  m = c - n  # the slots the window shares: the window and a rollback's extra slots
  last = jnp.max(positions_BT, axis=1, keepdims=True)
  kept = valid & ((positions_BT < n) | (positions_BT > last - m))
  slot = jnp.where(positions_BT < n, positions_BT, n + (positions_BT - n) % max(m, 1))
  return jnp.where(kept, slot, c)


# Whether traced writes skip the overflow check (see `room_made_by_caller`); part of jit's
# trace cache key, so a function traced on one side of it is traced again on the other.
ROOM_MADE_BY_CALLER = jax_config.bool_state(
    name="flax_mha_room_made_by_caller", default=False,
    help="flax_mha: KV-cache writes traced with this on skip the in-graph capacity check",
    include_in_jit_key=True, include_in_trace_context=True)


def room_made_by_caller(made: bool = True):
  """A context manager: writes traced inside skip the in-graph capacity check (eager writes
  are still checked), for decoding loops that size their caches, or hand out pages, for every
  token they will write. The check is a compare and a select per step, cheap but not free in
  a small model's step. The setting is part of jit's trace cache key: a function traced
  outside it is traced anew inside it, and the other way round."""
  if not isinstance(made, bool):
    raise TypeError(f"made must be a bool, got {type(made).__name__}")
  return ROOM_MADE_BY_CALLER(made)


def caller_makes_room(fn):
  """`fn` traced inside `room_made_by_caller()` (a decorator, to put under `jax.jit`)."""
  @functools.wraps(fn)
  def traced(*args, **kwargs):
    with room_made_by_caller():
      return fn(*args, **kwargs)
  return traced


def _check_room(cache, positions_BT) -> None:
  """A full or paged cache refuses concrete positions at or beyond its capacity (an eager
  write) with a ValueError; traced ones are judged by `flax_mha.cache.attend` after the write."""
  if getattr(cache, "window", None) is not None or isinstance(positions_BT, jax.core.Tracer):
    return
  last, c = int(jnp.max(positions_BT)), cache.capacity
  if last >= c:
    raise ValueError(f"KV cache overflow: writing position {last} into a cache of capacity "
                     f"{c}; make the cache larger (capacity >= prompt + new tokens)")


def update(cache: KVCache, key_BTGK, value_BTGV, positions_BT) -> KVCache:
  """`cache` with the new keys and values written at their positions (negative: padding, not
  written; an int8 cache's quantized); each row's length becomes one past its last position."""
  _check_room(cache, positions_BT)
  slots = _slots(cache, positions_BT)
  rows = jnp.arange(slots.shape[0])[:, None]
  # [B, G, C, K] indexed [rows, :, slots]: the selection is [B, T, G, K], the new keys' layout
  # (and [B, G, C] scales': [B, T, G]).
  write = lambda buf, new: None if buf is None else precision.set_at(
      jnp.asarray(buf), (rows, slice(None), slots), new)
  (key, k_scale), (value, v_scale) = (stored(cache.key, x) for x in (key_BTGK, value_BTGV))
  positions = jnp.asarray(cache.positions).at[rows, slots].set(
      jnp.where(positions_BT >= 0, positions_BT, -1), mode="drop")
  length = jnp.maximum(cache.length, jnp.max(positions_BT, axis=1) + 1)
  return dataclasses.replace(cache, key=write(cache.key, key), value=write(cache.value, value),
                             positions=positions, length=length,
                             key_scale=write(cache.key_scale, k_scale),
                             value_scale=write(cache.value_scale, v_scale))


def stored(buffer, x_BTGK):
  """(x as `buffer` stores it, its scales [B, T, G] or None): an int8 buffer's quantized
  (`flax_mha.quant`), a floating one's cast to its dtype."""
  if quant.is_quantized(buffer.dtype):
    return quant.quantize(x_BTGK)
  return x_BTGK.astype(buffer.dtype), None


def head_major(x_BTGK):
  return x_BTGK.transpose(0, 2, 1, 3)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
  """One layer's cache in pages of a shared pool (`flax_mha.cache.paged`): row b's position p lives in
  page page_indices[b, p // page], slot p % page. The host decides which pages a row owns (a
  continuous-batching loop hands a finished row's pages to the next prompt)."""
  k_pages: Any  # [P, page, G, K]
  v_pages: Any  # [P, page, G, V]
  page_indices: Any  # [B, n] int32
  length: Any  # [B] int32
  k_scales: Any = None  # [P, page, G] float32 of int8 pools (flax_mha.quant), else None
  v_scales: Any = None  # [P, page, G] likewise

  @classmethod
  def create(cls, num_pages: int, page_size: int, page_indices, num_kv_heads: int,
             head_dim: int, v_head_dim: int | None = None, dtype=jnp.float32) -> "PagedKVCache":
    """An empty pool of `num_pages` pages of `page_size` tokens, rows owning `page_indices`.
    `dtype`: a floating dtype, or jnp.int8 (quantized on write, float32 scales [P, page, G])."""
    for name, value in (("num_pages", num_pages), ("page_size", page_size),
                        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
      checks.check_int(name, value)
    v_head_dim = head_dim if v_head_dim is None else checks.check_int("v_head_dim", v_head_dim)
    dtype = quant.check_cache_dtype(dtype)
    page_indices = jnp.asarray(page_indices, jnp.int32)
    scales = ((jnp.zeros((num_pages, page_size, num_kv_heads), jnp.float32),) * 2
              if quant.is_quantized(dtype) else (None, None))
    return cls(jnp.zeros((num_pages, page_size, num_kv_heads, head_dim), dtype),
               jnp.zeros((num_pages, page_size, num_kv_heads, v_head_dim), dtype),
               page_indices, jnp.zeros((page_indices.shape[0],), jnp.int32), *scales)

  @property
  def scales(self):
    """(k_scales, v_scales) of int8 pools, None for floating ones."""
    return None if self.k_scales is None else (self.k_scales, self.v_scales)

  @property
  def capacity(self) -> int:
    """Tokens a row can hold: its pages times the page size."""
    return self.page_indices.shape[1] * self.k_pages.shape[1]

  # The rows and the page table, as a serving loop handles them (one protocol for both kinds).

  takes_mask = False  # a row's slots are wherever its pages are

  def with_table(self, table) -> "PagedKVCache":
    """The cache with the rows owning `table`'s pages [B, n]."""
    return dataclasses.replace(self, page_indices=table)

  def take_row(self, row) -> "PagedKVCache":
    """The batch-1 view of row `row` (the pool stays whole)."""
    one = lambda x: jax.lax.dynamic_slice_in_dim(x, row, 1)
    return dataclasses.replace(self, page_indices=one(self.page_indices),
                               length=one(self.length))

  def put_row(self, row, row_cache: "PagedKVCache") -> "PagedKVCache":
    """The cache with row `row`'s length from the batch-1 `row_cache`, and the pool it wrote."""
    put = lambda x, y: jax.lax.dynamic_update_slice_in_dim(x, y, row, 0)
    return dataclasses.replace(self, k_pages=row_cache.k_pages, v_pages=row_cache.v_pages,
                               k_scales=row_cache.k_scales, v_scales=row_cache.v_scales,
                               length=put(self.length, row_cache.length))

  def reset_rows(self, rows_B) -> "PagedKVCache":
    """The rows `rows_B` (bool [B]) emptied: length 0 (their pages are the host's to reuse)."""
    return dataclasses.replace(self, length=jnp.where(rows_B, 0, self.length))

  def rollback(self, length_B) -> "PagedKVCache":
    """Each row cut back to its first length_B [B] tokens: slots past a row's length are hidden
    whatever its pages hold (`flax_mha.cache.paged`), so the pages themselves are untouched;
    those no longer reached are the host's to take back."""
    return dataclasses.replace(
        self, length=jnp.minimum(jnp.asarray(length_B, jnp.int32), self.length))

  def copy_pages(self, src_N, dst_N) -> "PagedKVCache":
    """The pool with pages dst_N [N] holding copies of pages src_N [N] (copy-on-write of a
    shared page); an index out of [0, P) in dst_N is dropped."""
    copy = lambda pool: None if pool is None else pool.at[dst_N].set(pool[src_N], mode="drop")
    return dataclasses.replace(self, k_pages=copy(self.k_pages), v_pages=copy(self.v_pages),
                               k_scales=copy(self.k_scales), v_scales=copy(self.v_scales))


def is_cache(x) -> bool:
  """Whether `x` is one layer's cache (`KVCache` or `PagedKVCache`): the leaves a function over
  a model's caches maps (`jax.tree.map(..., is_leaf=is_cache)`)."""
  return isinstance(x, (KVCache, PagedKVCache))


def update_pages(cache: PagedKVCache, key_BTGK, value_BTGV, positions_BT) -> PagedKVCache:
  """`cache` with the new keys and values written into their rows' pages (negative positions:
  padding, not written; int8 pools' quantized); a position past a row's pages raises eagerly,
  and under `jit` is dropped, the row's length passing the capacity (its outputs then NaN, see
  `attend`)."""
  _check_room(cache, positions_BT)
  page = cache.k_pages.shape[1]
  valid = (positions_BT >= 0) & (positions_BT < cache.capacity)  # beyond: dropped
  safe = jnp.where(valid, positions_BT, 0)
  rows = jnp.arange(positions_BT.shape[0])[:, None]
  pages = jnp.where(valid, cache.page_indices[rows, safe // page], cache.k_pages.shape[0])
  # [P, page, G, K] (and [P, page, G] scales) indexed [pages, slots]: [B, T, G, K] ([B, T, G]).
  write = lambda pool, new: None if pool is None else precision.set_at(
      pool, (pages, safe % page), new)
  (key, k_scale), (value, v_scale) = (stored(cache.k_pages, x) for x in (key_BTGK, value_BTGV))
  length = jnp.maximum(cache.length, jnp.max(positions_BT, axis=1) + 1)
  return dataclasses.replace(cache, k_pages=write(cache.k_pages, key),
                             v_pages=write(cache.v_pages, value), length=length,
                             k_scales=write(cache.k_scales, k_scale),
                             v_scales=write(cache.v_scales, v_scale))


def _register_for_export(cls) -> None:
  """Let `jax.export` serialize functions that take or return `cls` (its static fields, the
  pytree's auxiliary data, as JSON)."""
  jax.export.register_pytree_node_serialization(
      cls, serialized_name=f"flax_mha.cache.{cls.__name__}",
      serialize_auxdata=lambda aux: json.dumps(list(aux)).encode(),
      deserialize_auxdata=lambda data: tuple(json.loads(data)))


_register_for_export(KVCache)
_register_for_export(PagedKVCache)
