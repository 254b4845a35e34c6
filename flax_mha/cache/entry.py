"""Attention over a KV cache: `attend` writes a chunk of new tokens into a cache and reads what
they see, where it lies; `explain` says which kernel a step runs and why.

  out, cache = attend(query, key, value, cache)            # a prompt, a chunk, or one token

A contiguous cache (`KVCache`, `flax_mha.cache.kv`): a full one is written first (it then holds
every key the chunk may see); a rolling one is read with the chunk after its slots, then
written (it keeps what the window needs). The read is a step of a few tokens with the kernel
`flax_mha.dispatch` chooses (`flax_mha.cache.steps`), or, past a step's size, a prefill through
`dot_product_attention`. A paged cache (`PagedKVCache`) is written into its rows' pages and read
in place (`flax_mha.cache.paged`).

Shapes: B batch, T new tokens, H query heads, G key/value heads, K, V head dims, S slots.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from flax_mha import dispatch
from flax_mha import quant
from flax_mha.attention import dot_product_attention
from flax_mha.cache import kv
from flax_mha.cache import paged
from flax_mha.cache import steps
from flax_mha.kernels import triton_decode


def attend(query_BTHK, key_BTGK, value_BTGV, cache, positions_BT=None, **options):
  """(out [B, T, H, V], updated cache): the T new tokens attend causally to everything the
  cache holds and to themselves (by position), then are written.

  `positions_BT` default to the rows' next positions; a negative one marks padding (a shorter
  prompt in the batch): not written, seeing and seen by nothing. `options` are
  `dot_product_attention`'s (scale, logit_soft_cap, sinks, local_window_size for a full cache,
  implementation, ...); a rolling cache brings its own window (cache.window, 0) and sink tokens.
  With `implementation=None` a step of a few tokens runs the kernel `flax_mha.dispatch`
  chooses for it (`flax_mha.cache.steps`; `explain` says which); `implementation` may also
  name the Triton decode kernel for the step: "triton_decode" (compiled: 'cuda' only) or
  `flax_mha.kernels.triton_decode.make_attention(interpret=True)` (Pallas interpret mode, any
  platform); a step it cannot take is refused by name. "decode" runs the decode kernel over
  the slots in place whatever T (where it takes the call: no dense mask, no dropout); any
  other name, `dot_product_attention`'s kernel of that name over the keys (an int8 cache's
  dequantized). A `PagedKVCache` writes into its rows' pages and reads them in place
  (`flax_mha.cache.paged`).
  """
  if positions_BT is None:
    positions_BT = kv.next_positions(cache, query_BTHK.shape[1])
  kernel = triton_decode.named(options.get("implementation"))
  chunk = _paged if isinstance(cache, kv.PagedKVCache) else _contiguous
  out, cache = chunk(cache, query_BTHK, key_BTGK, value_BTGV, positions_BT, kernel, options)
  return nan_past_capacity(out, cache), cache


def write_then_read(cache, key_BTGK, value_BTGV, positions_BT, dtype):
  """(updated cache, (keys [B, S, G, K], values [B, S, G, V], positions [B, S])): the chunk
  written into a full `KVCache` or a `PagedKVCache`, then everything it holds read back in
  `dtype` (an int8 cache's dequantized), a slot that holds nothing at position -1. For a caller
  that attends over a cache's contents its own way (latent attention's prefill,
  `flax_mha.models.mla`); `nan_past_capacity` then marks the rows the write overflowed."""
  if isinstance(cache, kv.PagedKVCache):
    cache = kv.update_pages(cache, key_BTGK, value_BTGV, positions_BT)
    (b, n), page = cache.page_indices.shape, cache.k_pages.shape[1]
    rows = lambda x: x[cache.page_indices].reshape(b, n * page, *x.shape[2:])  # in slot order
    keys, values = rows(cache.k_pages), rows(cache.v_pages)
    scales = None if cache.scales is None else tuple(rows(x) for x in cache.scales)
    slots = jnp.arange(n * page, dtype=jnp.int32)
    held = jnp.minimum(cache.length, cache.capacity)[:, None]
    kv_pos_BS = jnp.where(slots < held, slots, -1)
  else:
    if cache.window is not None:
      raise ValueError(f"write_then_read takes a full KVCache or a PagedKVCache, got a rolling "
                       f"cache (window {cache.window}), whose slots move")
    cache = kv.update(cache, key_BTGK, value_BTGV, positions_BT)
    keys, values = (_api_layout(x) for x in (cache.key, cache.value))
    scales = None if cache.scales is None else tuple(x.transpose(0, 2, 1) for x in cache.scales)
    kv_pos_BS = cache.positions
  if scales is not None:
    keys, values = (quant.dequantize(x, s, dtype) for x, s in zip((keys, values), scales))
  return cache, (keys.astype(dtype), values.astype(dtype), kv_pos_BS)


def explain(query, cache, positions=None, *, platform: str | None = None,
            **options) -> dispatch.Explanation:
  """What a step of `query` [B, T, H, K] (arrays or `jax.ShapeDtypeStruct`s) over `cache` (a
  `KVCache` or `PagedKVCache`) runs with `implementation=None` on `platform` (None: the default
  backend's), why, and what every kernel of the step's layout says of it: the dispatch of
  `attend(query, key, value, cache, positions, **options)`. Nothing is
  computed. A call that is not a step (more than FEW_QUERIES queries, `return_residual`)
  reads "dense": `flax_mha.explain` on the cache's keys says what then runs."""
  platform = dispatch.check_platform(platform)
  b, t = query.shape[:2]
  heads = cache.k_pages.shape[2] if hasattr(cache, "k_pages") else cache.key.shape[1]
  chunk = lambda dims: jax.ShapeDtypeStruct((b, t, heads, dims), query.dtype)
  key_dim = cache.k_pages.shape[-1] if hasattr(cache, "k_pages") else cache.key.shape[-1]
  value_dim = cache.v_pages.shape[-1] if hasattr(cache, "v_pages") else cache.value.shape[-1]
  with steps.recording() as recorded:
    jax.eval_shape(lambda q, k, v, c, p: attend(q, k, v, c, p, **options), query,
                   chunk(key_dim), chunk(value_dim), cache, positions)
  if not recorded:
    reason = (dispatch.not_a_step(t).reason if not dispatch.is_step(t) else
              "not a step (an implementation named, or return_residual): the keys go to "
              "dot_product_attention")
    return dispatch.Explanation("dense", reason, platform, {})
  return dispatch.explanation(dataclasses.replace(recorded[0], platform=platform))


def _contiguous(cache, query_BTHK, key_BTGK, value_BTGV, positions_BT, kernel, options):
  """`attend` over a `KVCache`: a full one written first, a rolling one read with the chunk
  after its slots, then written."""
  if cache.window is None:
    cache = kv.update(cache, key_BTGK, value_BTGV, positions_BT)
    out = _read(query_BTHK, cache.key, cache.value, cache.positions, positions_BT,
                prefixes=True, kernel=kernel, options=options, kv_scales=cache.scales)
    return out, cache
  options = dict(options, local_window_size=(cache.window, 0), sink_tokens=cache.sink_tokens)
  chunk_pos = jnp.where(positions_BT >= 0, positions_BT, -1)
  # The chunk as it will be stored (an int8 cache's: quantized), after the slots.
  (key, k_scale), (value, v_scale) = (kv.stored(cache.key, x) for x in (key_BTGK, value_BTGV))
  join = lambda slots, chunk, axis: None if slots is None else jnp.concatenate(
      [slots, chunk], axis=axis)
  scales = None if cache.key_scale is None else (
      join(cache.key_scale, k_scale.transpose(0, 2, 1), 2),
      join(cache.value_scale, v_scale.transpose(0, 2, 1), 2))
  out = _read(query_BTHK, join(cache.key, kv.head_major(key), 2),
              join(cache.value, kv.head_major(value), 2),
              jnp.concatenate([cache.positions, chunk_pos], axis=1), positions_BT,
              prefixes=False, kernel=kernel, options=options, kv_scales=scales)
  return out, kv.update(cache, key_BTGK, value_BTGV, positions_BT)


def _paged(cache, query_BTHK, key_BTGK, value_BTGV, positions_BT, kernel, options):
  """`attend` over a `PagedKVCache`: written first, then each row's pages read in place."""
  if kernel is not None:
    options = dict(options, implementation=kernel)
  cache = kv.update_pages(cache, key_BTGK, value_BTGV, positions_BT)
  k_pages, v_pages = cache.k_pages, cache.v_pages
  if cache.scales is None:
    k_pages, v_pages = (x.astype(query_BTHK.dtype) for x in (k_pages, v_pages))
  out = paged.positioned_paged_attention(query_BTHK, k_pages, v_pages, cache.page_indices,
                                         positions_BT, jnp.minimum(cache.length, cache.capacity),
                                         kv_scales=cache.scales, **options)
  return out, cache


def _read(query_BTHK, keys_BGSK, values_BGSV, kv_pos_BS, positions_BT, *, prefixes, kernel,
          options, kv_scales=None):
  """The T queries over head-major keys: a step with the kernel `dispatch` chooses
  (`flax_mha.cache.steps`), or, past a step's size, `dot_product_attention` over them. With
  `kv_scales` (an int8 cache's) a step's kernel dequantizes the blocks it reads, and the keys
  handed to `dot_product_attention` are dequantized first."""
  dtype = query_BTHK.dtype
  keys, values = keys_BGSK, values_BGSV
  if kv_scales is None:
    keys, values = keys.astype(dtype), values.astype(dtype)
  implementation = options.get("implementation")
  stepping = kernel is not None or implementation == "decode" or (
      implementation is None and dispatch.is_step(query_BTHK.shape[1])
      and not options.get("return_residual", False))
  if stepping:
    step_options = {k: v for k, v in options.items() if k != "implementation"}
    out = steps.cache_step(query_BTHK, keys, values, kv_pos_BS, positions_BT,
                           prefixes=prefixes, kernel=kernel, kv_scales=kv_scales,
                           forced="decode" if implementation == "decode" else None,
                           **step_options)
    if out is not None:
      return out
  if kv_scales is not None:
    keys, values = (quant.dequantize(x, s, dtype) for x, s in zip((keys, values), kv_scales))
  return dot_product_attention(query_BTHK, _api_layout(keys), _api_layout(values),
                               is_causal=True, q_positions=positions_BT, kv_positions=kv_pos_BS,
                               **options)


def nan_past_capacity(out_BTHV, cache):
  """`out` with NaN in every row whose length has passed the capacity (a traced write beyond
  it was dropped), unless traced inside `room_made_by_caller()`: the check survives export."""
  if getattr(cache, "window", None) is not None or kv.ROOM_MADE_BY_CALLER.value:
    return out_BTHV
  if isinstance(out_BTHV, tuple):  # with return_residual: (out, lse)
    return (nan_past_capacity(out_BTHV[0], cache), *out_BTHV[1:])
  over_B = cache.length > cache.capacity
  return jnp.where(over_B[:, None, None, None], jnp.nan, out_BTHV)


def _api_layout(x_BGCK):
  return x_BGCK.transpose(0, 2, 1, 3)
