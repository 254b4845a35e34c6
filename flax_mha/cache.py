"""A key/value cache that is data: a pytree passed into an attention layer and returned updated.

  cache = KVCache.create(batch, capacity, num_kv_heads, head_dim)
  out, cache = attend(query, key, value, cache)            # a prompt, a chunk, or one token

The cache holds each row's keys [B, G, C, K] and values [B, G, C, V], head-major (each head's
keys contiguous: a decoding step reads them at the memory's speed; G key/value heads: GQA
caches hold G heads, not H), the absolute position of the token in each slot [B, C] (-1: empty)
and each row's next position [B]: rows advance independently, so a batch of prompts of
different lengths needs no left padding. Attention over the cache is attention with
`q_positions`/`kv_positions`: causality and windows compare positions and empty slots are
hidden. A step of a few tokens over a full cache attends over the smallest power-of-two prefix
of slots that holds every filled one (a `lax.switch` over static prefixes: no loop, so the
cache updates in place inside a decoding loop), so it costs what is filled, not the capacity;
on 'cuda' the step is the Triton decode kernel (`flax_mha.kernels.triton_decode`, staged as
`implementation=None` stages the Triton kernel), which reads each row's filled blocks in place.
A long prefill goes through `dot_product_attention`'s dispatch (chunked skips empty tiles).

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

from flax_mha import _options
from flax_mha import checks
from flax_mha import paged
from flax_mha import platforms
from flax_mha.kernels import triton_decode
from flax_mha.attention import attention_head_major, dot_product_attention


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

  @classmethod
  def create(cls, batch_size: int, capacity: int, num_kv_heads: int, head_dim: int,
             v_head_dim: int | None = None, dtype=jnp.float32, *, window: int | None = None,
             sink_tokens: int = 0) -> "KVCache":
    """An empty cache. With `window` (a local layer's keys back), a rolling cache of
    sink_tokens + window slots whatever `capacity` says, when that is smaller."""
    for name, value in (("batch_size", batch_size), ("capacity", capacity),
                        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
      checks.check_int(name, value)
    v_head_dim = head_dim if v_head_dim is None else checks.check_int("v_head_dim", v_head_dim)
    checks.check_int("sink_tokens", sink_tokens, lowest=0)
    if window is not None:
      checks.check_int("window", window, lowest=0)
      if sink_tokens + window >= capacity:
        window = None  # the whole sequence fits: a full cache is the same and simpler
      else:
        capacity = sink_tokens + window
    elif sink_tokens:
      raise ValueError(f"sink_tokens={sink_tokens} keeps tokens beyond a window: it needs "
                       "window")
    return cls(jnp.zeros((batch_size, num_kv_heads, capacity, head_dim), dtype),
               jnp.zeros((batch_size, num_kv_heads, capacity, v_head_dim), dtype),
               jnp.full((batch_size, capacity), -1, jnp.int32),
               jnp.zeros((batch_size,), jnp.int32), window, sink_tokens)

  @property
  def capacity(self) -> int:
    return self.key.shape[2]


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
  n, w = cache.sink_tokens, cache.window
  last = jnp.max(positions_BT, axis=1, keepdims=True)
  kept = valid & ((positions_BT < n) | (positions_BT > last - w))
  slot = jnp.where(positions_BT < n, positions_BT, n + (positions_BT - n) % max(w, 1))
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
  write) with a ValueError; traced ones are judged by `_overflow_is_nan` after the write."""
  if getattr(cache, "window", None) is not None or isinstance(positions_BT, jax.core.Tracer):
    return
  last, c = int(jnp.max(positions_BT)), cache.capacity
  if last >= c:
    raise ValueError(f"KV cache overflow: writing position {last} into a cache of capacity "
                     f"{c}; make the cache larger (capacity >= prompt + new tokens)")


def _overflow_is_nan(out_BTHV, cache):
  """`out` with NaN in every row whose length has passed the capacity (a traced write beyond
  it was dropped), unless traced inside `room_made_by_caller()`: the check survives export."""
  if getattr(cache, "window", None) is not None or ROOM_MADE_BY_CALLER.value:
    return out_BTHV
  over_B = cache.length > cache.capacity
  return jnp.where(over_B[:, None, None, None], jnp.nan, out_BTHV)


def update(cache: KVCache, key_BTGK, value_BTGV, positions_BT) -> KVCache:
  """`cache` with the new keys and values written at their positions (negative: padding, not
  written); each row's length becomes one past its last position."""
  _check_room(cache, positions_BT)
  slots = _slots(cache, positions_BT)
  rows = jnp.arange(slots.shape[0])[:, None]
  # [B, G, C, K] indexed [rows, :, slots]: the selection is [B, T, G, K], the new keys' layout.
  write = lambda buf, new: jnp.asarray(buf).at[rows, :, slots].set(new.astype(buf.dtype),
                                                                   mode="drop")
  positions = jnp.asarray(cache.positions).at[rows, slots].set(
      jnp.where(positions_BT >= 0, positions_BT, -1), mode="drop")
  length = jnp.maximum(cache.length, jnp.max(positions_BT, axis=1) + 1)
  return dataclasses.replace(cache, key=write(cache.key, key_BTGK),
                             value=write(cache.value, value_BTGV), positions=positions,
                             length=length)


# A step of up to STEP_MAX_TOKENS tokens (with the default implementation) attends over a
# prefix of the cache: the smallest of MIN_PREFIX·2^i slots holding every filled one.
STEP_MAX_TOKENS = 32
MIN_PREFIX = 256


def _prefixes(capacity: int) -> list[int]:
  sizes, size = [], MIN_PREFIX
  while size < capacity:
    sizes.append(size)
    size *= 2
  return sizes + [capacity]


def _attend_step(query_BTHK, cache: KVCache, positions_BT, extra_kv=None, *, kernel=None,
                 **options):
  """A few tokens over the cache, head-major: the Triton decode kernel where `kernel` names it,
  or with None on 'cuda' where it takes the step (it reads the filled blocks in place);
  elsewhere dense over the filled prefix (see above); `extra_kv` = (keys [B, G, T, K], values,
  positions [B, T]) of a rolling cache's chunk."""
  mask = options.pop("mask", None)
  dtype = query_BTHK.dtype
  operands = (query_BTHK, cache.key.astype(dtype), cache.value.astype(dtype), cache.positions)
  dense = functools.partial(_dense_step, positions_BT=positions_BT, extra_kv=extra_kv, mask=mask,
                            options=options)
  if kernel is None and not platforms.stages_for("cuda"):
    return dense(*operands)
  keys, values, kv_pos = _with_chunk(operands[1:], extra_kv)
  opts = {k: v for k, v in options.items() if k not in ("scale", "dropout_rate", "dropout_rng")}
  b, t, h, k_dim = query_BTHK.shape
  mods, _ = _options.build((b,), t, kv_pos.shape[1], h, dtype, True, q_positions=positions_BT,
                           kv_positions=kv_pos, **opts)
  scale = checks.checked_scale(options.get("scale"), k_dim)
  refused = triton_decode.reason(query_BTHK, keys.shape[1], k_dim, values.shape[-1], mods,
                                 mask=mask, dropout_rate=options.get("dropout_rate", 0.0))
  if kernel is not None:
    triton_decode.require(kernel, refused)
    return kernel.cache_attention(query_BTHK, keys, values, mods, scale)
  run = lambda q, *_: triton_decode.KERNEL.cache_attention(q, keys, values, mods, scale)
  return triton_decode.on_cuda(refused, run, dense, *operands)


def _with_chunk(cache_kv, extra_kv):
  """(keys, values, positions) of the cache, with a rolling cache's chunk after its slots."""
  if extra_kv is None:
    return cache_kv
  return tuple(jnp.concatenate([a, b], axis=axis) for a, b, axis in zip(cache_kv, extra_kv,
                                                                       (2, 2, 1)))


def _dense_step(query_BTHK, keys, values, kv_pos, *, positions_BT, extra_kv, mask, options):
  """The step dense over the smallest prefix of slots holding every filled one (a lax.switch
  over static prefixes; a rolling cache with its chunk: all of it)."""
  capacity = keys.shape[2]

  def over(size):
    def attend(q, k, v, kv_pos):
      k, v, kv_pos = _with_chunk((k[:, :, :size], v[:, :, :size], kv_pos[:, :size]), extra_kv)
      return attention_head_major(q, k, v, None if mask is None else mask[..., :size],
                                  is_causal=True, q_positions=positions_BT, kv_positions=kv_pos,
                                  **options)
    return attend

  sizes = _prefixes(capacity) if extra_kv is None else [capacity]
  operands = (query_BTHK, keys, values, kv_pos)
  if len(sizes) == 1:
    return over(sizes[0])(*operands)
  filled = jnp.max(jnp.where(kv_pos >= 0, jnp.arange(capacity) + 1, 0))
  index = jnp.minimum(jnp.searchsorted(jnp.asarray(sizes), filled), len(sizes) - 1)
  return jax.lax.switch(index, [over(size) for size in sizes], *operands)


def _api_layout(x_BGCK):
  return x_BGCK.transpose(0, 2, 1, 3)


def attend(query_BTHK, key_BTGK, value_BTGV, cache, positions_BT=None, **options):
  """(out [B, T, H, V], updated cache): the T new tokens attend causally to everything the
  cache holds and to themselves (by position), then are written.

  `positions_BT` default to the rows' next positions; a negative one marks padding (a shorter
  prompt in the batch): not written, seeing and seen by nothing. `options` are
  `dot_product_attention`'s (scale, logit_soft_cap, sinks, local_window_size for a full cache,
  implementation, ...); a rolling cache brings its own window (cache.window, 0) and sink tokens.
  `implementation` may also name the Triton decode kernel for the step: "triton_decode"
  (compiled: 'cuda' only) or `flax_mha.kernels.triton_decode.make_attention(interpret=True)`
  (Pallas interpret mode, any platform); a step it cannot take is refused by name.
  A `PagedKVCache` writes into its rows' pages and reads them in place (`flax_mha.paged`).
  """
  if positions_BT is None:
    positions_BT = next_positions(cache, query_BTHK.shape[1])
  if isinstance(cache, PagedKVCache):  # write first, then read each row's pages in place
    cache = update_pages(cache, key_BTGK, value_BTGV, positions_BT)
    out = paged.attend_pages(query_BTHK, cache.k_pages.astype(query_BTHK.dtype),
                             cache.v_pages.astype(query_BTHK.dtype), cache.page_indices,
                             positions_BT, jnp.minimum(cache.length, cache.capacity), **options)
    return _overflow_is_nan(out, cache), cache
  kernel = triton_decode.named(options.get("implementation"))
  step = kernel is not None or (query_BTHK.shape[1] <= STEP_MAX_TOKENS
                                and options.get("implementation") is None
                                and not options.get("return_residual", False))
  options.pop("implementation", None) if step else None
  options = dict(options, kernel=kernel) if step else options
  dtype = query_BTHK.dtype
  if cache.window is None:  # write first: the cache then holds every key the chunk may see
    cache = update(cache, key_BTGK, value_BTGV, positions_BT)
    if step:
      out = _attend_step(query_BTHK, cache, positions_BT, **options)
    else:
      out = dot_product_attention(
          query_BTHK, _api_layout(cache.key).astype(dtype),
          _api_layout(cache.value).astype(dtype), is_causal=True, q_positions=positions_BT,
          kv_positions=cache.positions, **options)
    return _overflow_is_nan(out, cache), cache
  # A rolling cache: see the cache and the chunk, then keep what the window needs.
  options = dict(options, local_window_size=(cache.window, 0), sink_tokens=cache.sink_tokens)
  chunk_pos = jnp.where(positions_BT >= 0, positions_BT, -1)
  if step:
    extra = (_api_layout(key_BTGK).astype(dtype), _api_layout(value_BTGV).astype(dtype),
             chunk_pos)
    out = _attend_step(query_BTHK, cache, positions_BT, extra, **options)
  else:
    keys = jnp.concatenate([_api_layout(cache.key), key_BTGK.astype(cache.key.dtype)], axis=1)
    values = jnp.concatenate([_api_layout(cache.value), value_BTGV.astype(cache.value.dtype)],
                             axis=1)
    kv_pos = jnp.concatenate([cache.positions, chunk_pos], axis=1)
    out = dot_product_attention(query_BTHK, keys.astype(dtype), values.astype(dtype),
                                is_causal=True, q_positions=positions_BT, kv_positions=kv_pos,
                                **options)
  return out, update(cache, key_BTGK, value_BTGV, positions_BT)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
  """One layer's cache in pages of a shared pool (`flax_mha.paged`): row b's position p lives in
  page page_indices[b, p // page], slot p % page. The host decides which pages a row owns (a
  continuous-batching loop hands a finished row's pages to the next prompt)."""
  k_pages: Any  # [P, page, G, K]
  v_pages: Any  # [P, page, G, V]
  page_indices: Any  # [B, n] int32
  length: Any  # [B] int32

  @classmethod
  def create(cls, num_pages: int, page_size: int, page_indices, num_kv_heads: int,
             head_dim: int, v_head_dim: int | None = None, dtype=jnp.float32) -> "PagedKVCache":
    """An empty pool of `num_pages` pages of `page_size` tokens, rows owning `page_indices`."""
    for name, value in (("num_pages", num_pages), ("page_size", page_size),
                        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
      checks.check_int(name, value)
    v_head_dim = head_dim if v_head_dim is None else checks.check_int("v_head_dim", v_head_dim)
    page_indices = jnp.asarray(page_indices, jnp.int32)
    return cls(jnp.zeros((num_pages, page_size, num_kv_heads, head_dim), dtype),
               jnp.zeros((num_pages, page_size, num_kv_heads, v_head_dim), dtype),
               page_indices, jnp.zeros((page_indices.shape[0],), jnp.int32))

  @property
  def capacity(self) -> int:
    """Tokens a row can hold: its pages times the page size."""
    return self.page_indices.shape[1] * self.k_pages.shape[1]


def update_pages(cache: PagedKVCache, key_BTGK, value_BTGV, positions_BT) -> PagedKVCache:
  """`cache` with the new keys and values written into their rows' pages (negative positions:
  padding, not written); a position past a row's pages raises eagerly, and under `jit` is
  dropped, the row's length passing the capacity (its outputs then NaN, see `attend`)."""
  _check_room(cache, positions_BT)
  page = cache.k_pages.shape[1]
  valid = (positions_BT >= 0) & (positions_BT < cache.capacity)  # beyond: dropped
  safe = jnp.where(valid, positions_BT, 0)
  rows = jnp.arange(positions_BT.shape[0])[:, None]
  pages = jnp.where(valid, cache.page_indices[rows, safe // page], cache.k_pages.shape[0])
  write = lambda pool, new: pool.at[pages, safe % page].set(new.astype(pool.dtype), mode="drop")
  length = jnp.maximum(cache.length, jnp.max(positions_BT, axis=1) + 1)
  return dataclasses.replace(cache, k_pages=write(cache.k_pages, key_BTGK),
                             v_pages=write(cache.v_pages, value_BTGV), length=length)


def _register_for_export(cls) -> None:
  """Let `jax.export` serialize functions that take or return `cls` (its static fields, the
  pytree's auxiliary data, as JSON)."""
  jax.export.register_pytree_node_serialization(
      cls, serialized_name=f"flax_mha.cache.{cls.__name__}",
      serialize_auxdata=lambda aux: json.dumps(list(aux)).encode(),
      deserialize_auxdata=lambda data: tuple(json.loads(data)))


_register_for_export(KVCache)
_register_for_export(PagedKVCache)
