"""Decode-time attention ("flash decoding"): a few queries against a long key/value cache.

Generating a token attends T (1 to a few) queries over a cache of S keys: there is too little
query work to split the rows, so this splits the keys. The key blocks that the masks leave
visible (the same tile maps as `flax_mha.kernels.chunked`: a cache's empty slots, a window's
far past and the blocks beyond every row's length are never read) are dealt round-robin to
`splits` partitions; one loop walks them, each trip running one block of every partition at
once (a batched product: the partitions run in parallel), each keeping its own online-softmax
statistics; the partitions are merged by log-sum-exp at the end. Work is proportional to the
visible part of the cache, not to its capacity.

Same signature, options and semantics as every implementation (`flax_mha.kernels.reference`);
the backward (a custom VJP) is the chunked kernel's, which recomputes the tiles from the output
and its log-sum-exp whatever blocking produced them.

The keys lie in one of three layouts, each read block by block by its own fetch: the API's
[B, S, G, K] (`attention`), a contiguous KV cache's head-major [B, G, S, K] (`cache`: each
block sliced, then transposed alone) and page pools [P, page, G, K] (`paged`). A cache's or a
pool's keys may be int8 with their scales (`flax_mha.quant`): each fetched block is
dequantized, never the whole cache. Their backward dequantizes the keys it recomputes from
(a rare path: an int8 cache is for inference); the int8 arrays get no gradient, their scales
theirs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from flax_mha import checks
from flax_mha import mods as mods_lib
from flax_mha import quant
from flax_mha.kernels import common
from flax_mha.kernels import tiling
from flax_mha.kernels import chunked
from flax_mha.kernels import registry

# Keys per block and partitions of the cache walked in parallel: the fastest of a sweep on a
# 2-core CPU in float32 (`python -m experiments.bench.decode --part sweep` re-runs it).
BLOCK_K = 512
SPLITS = 2
# Keys per block over pages (whole pages): a loop trip per page of 16 tokens made serving's
# decode steps 1.24x slower on `python -m experiments.bench.generation --part serving` than
# blocks of 64-256 keys (level with each other there).
PAGED_BLOCK_K = 64
# Partitions over pages: one. Each trip gathers its block's pages, and two partitions gathered
# together (a batched gather) made paged attention of 16 rows holding 152 tokens 2.4x slower
# on the slower machine type (`python -m experiments.bench.serving_speed --part trips`).
PAGED_SPLITS = 1


def _visit_order(ctx):
  """(block indices [n_k], how many to visit): the visible key blocks of the one query tile,
  entirely visible ones and partly visible ones alike (the mask is applied to all)."""
  rows = ctx.rows
  full_idx, partial_idx = (jnp.asarray(x)[0] for x in (rows.full_idx, rows.partial_idx))
  n_full, n_partial = (jnp.asarray(x)[0] for x in (rows.full_count, rows.partial_count))
  n_k = full_idx.shape[0]
  # The full blocks first, then the partial ones: one list of n_full + n_partial blocks.
  slot = jnp.arange(n_k)
  order = jnp.where(slot < n_full, full_idx[jnp.minimum(slot, n_k - 1)],
                    partial_idx[jnp.clip(slot - n_full, 0, n_k - 1)])
  return order.astype(jnp.int32), (n_full + n_partial).astype(jnp.int32)


def forward(q, k, v, bias, mask, rng, mods, cfg: chunked.Config, splits: int,
            page_indices=None, lengths=None, kv_scales=None):
  """out [B, T, H, V] and lse [B, H, T] in the softmax dtype, as chunked's forward.

  k, v: the cache [B, S, G, K] and [B, S, G, V]; or, with `page_indices` [B, n] (paged: row b's
  positions j·page .. (j+1)·page - 1 live in page page_indices[b, j]) and `lengths` [B], the
  page pools [pages, page, G, K] and [pages, page, G, V], cfg.block_k a multiple of the page
  size (`paged_block`), int8 with `kv_scales` (k_scales, v_scales) [pages, page, G].
  """
  if page_indices is None:
    b, s, g, _ = k.shape
    reader = functools.partial(_api_blocks, k, v)
  else:
    (b, n_pages), (page, g) = page_indices.shape, k.shape[1:3]
    s = n_pages * page
    reader = functools.partial(_paged_blocks, k, v, kv_scales, page_indices, lengths, q.dtype)
  return _walk(q, (b, s, g, k.shape[-1], v.shape[-1]), reader, bias, mask, rng, mods, cfg,
               splits)


def cache_forward(q, key_BGSK, value_BGSV, mods, cfg: chunked.Config, splits: int,
                  kv_scales=None):
  """`forward` over a contiguous KV cache's head-major keys [B, G, S, K] and values
  [B, G, S, V] (int8 with `kv_scales` (key scales, value scales) [B, G, S]): (out, lse)."""
  b, g, s, k_dim = key_BGSK.shape
  reader = functools.partial(_cache_blocks, key_BGSK, value_BGSV, kv_scales, q.dtype)
  return _walk(q, (b, s, g, k_dim, value_BGSV.shape[-1]), reader, None, None, None, mods, cfg,
               splits)


def _api_blocks(k, v, tl):
  """fetch(j) of keys [B, S, G, K]: blocks of the cache in its own layout, [B, n_k, P, G, K] (a
  free reshape, unless S needs padding: a copy, avoided when it divides); each trip's product
  transposes only its block, in cache, never the whole cache."""
  b, s, g = k.shape[:3]

  def blocked(x):
    if tl.n_k * tl.bk != s:
      x = jnp.pad(x, ((0, 0), (0, tl.n_k * tl.bk - s), (0, 0), (0, 0)))
    return x.reshape(b, tl.n_k, tl.bk, g, x.shape[-1])
  k_blocks, v_blocks = blocked(k), blocked(v)
  return lambda j: (k_blocks[:, j], v_blocks[:, j])


def _cache_blocks(key_BGSK, value_BGSV, kv_scales, dtype, tl):
  """fetch(j) of head-major keys [B, G, S, K]: slots j·bk .. (j+1)·bk - 1 of every head, sliced
  (gathered, clamped, when S is no multiple of the block: the slots past S are hidden, their
  values zeroed), dequantized when int8, then transposed to [B, P, G, K] alone."""
  s = key_BGSK.shape[2]
  scales = (None, None) if kv_scales is None else kv_scales

  def block(x, j, scale):
    if s % tl.bk == 0:
      x = lax.dynamic_slice_in_dim(x, j * tl.bk, tl.bk, axis=2)
      scale = None if scale is None else lax.dynamic_slice_in_dim(scale, j * tl.bk, tl.bk, 2)
    else:
      slots = jnp.minimum(j * tl.bk + jnp.arange(tl.bk), s - 1)
      x, scale = x[:, :, slots], None if scale is None else scale[:, :, slots]
    x = x if scale is None else quant.dequantize(x, scale, dtype)
    return x.transpose(0, 2, 1, 3)  # [B, P, G, K]

  def fetch(j):
    k_j, v_j = block(key_BGSK, j, scales[0]), block(value_BGSV, j, scales[1])
    if s % tl.bk:
      v_j = jnp.where((j * tl.bk + jnp.arange(tl.bk) < s)[:, None, None], v_j, 0)
    return k_j, v_j
  return fetch


def _paged_blocks(k, v, kv_scales, page_indices, lengths, dtype, tl):
  """fetch(j) of page pools: a block is cfg.block_k / page pages, each row's j-th run of
  pages, gathered from the pools (and dequantized when int8); values past a row's length
  zeroed (hidden already: whatever a reused page holds cannot leak as 0 · NaN)."""
  b, n_pages = page_indices.shape
  page = k.shape[1]
  per_block = tl.bk // page
  table = jnp.pad(page_indices, ((0, 0), (0, tl.n_k * per_block - n_pages)))
  scales = (None, None) if kv_scales is None else kv_scales

  def fetch(j):
    pages = lax.dynamic_slice_in_dim(table, j * per_block, per_block, axis=1)  # [B, m]
    gather = lambda pool: pool[pages].reshape(b, tl.bk, *pool.shape[2:])
    read = lambda pool, scale: (gather(pool) if scale is None
                                else quant.dequantize(gather(pool), gather(scale), dtype))
    held = (j * tl.bk + jnp.arange(tl.bk) < lengths[:, None])[:, :, None, None]
    return read(k, scales[0]), jnp.where(held, read(v, scales[1]), 0)
  return fetch


def _walk(q, dims, reader, bias, mask, rng, mods, cfg: chunked.Config, splits: int):
  """The split-key loop over keys of dims (B, S, G, K, V), each block fetched by
  `reader(tiling)(j)` -> (keys [B, P, G, K], values [B, P, G, V]): (out, lse)."""
  b, s, g, k_dim, v_dim = dims
  shape_BSGK = jax.ShapeDtypeStruct((b, s, g, k_dim), q.dtype)
  ctx = chunked.tile_context(q, shape_BSGK, bias, mask, rng, mods, cfg, 0, 0)
  tl, acc = ctx.tl, common.softmax_dtype(q.dtype)
  q_0 = tiling.blocks(q, 1, tl.bq, g)[0]  # [B, G, R, Q, K]: all T queries are one tile
  fetch = reader(tl)
  order, count = _visit_order(ctx)

  def one(carry, j, live):
    """One partition's step on key block j (a no-op unless `live`)."""
    k_j, v_j = fetch(j)  # [B, P, G, K], [B, P, G, V]
    raw = jnp.einsum("BGRQK,BPGK->BGRQP", q_0, k_j, preferred_element_type=acc)
    v_j = v_j.transpose(0, 2, 1, 3)  # [B, G, P, V]
    new = chunked.forward_tile(carry, 0, j, raw, v_j, ctx, True)
    return jax.tree.map(lambda a, b: jnp.where(live, a, b), new, carry)

  part = jnp.arange(splits)

  def trip(n, carry):
    slot = n * splits + part  # round-robin: partition p takes every splits-th visible block
    return jax.vmap(one)(carry, order[jnp.minimum(slot, tl.n_k - 1)], slot < count)

  stats_shape = q_0.shape[:-1]  # [B, G, R, Q]
  m0, l0 = chunked.initial_stats(stats_shape, g, None, acc)
  init = (jnp.broadcast_to(m0, (splits, *stats_shape)),
          jnp.broadcast_to(l0, (splits, *stats_shape)),
          jnp.zeros((splits, *stats_shape, v_dim), acc))
  m, l, o = lax.fori_loop(0, (count + splits - 1) // splits, trip, init)
  # Merge the partitions (and the sink, a partition of its own that saw one entry).
  lse_p = common.row_lse(m, l)  # [splits, B, G, R, Q]
  if mods.sinks is not None:
    sink, _ = chunked.initial_stats(stats_shape, g, mods.sinks, acc)
    lse_p = jnp.concatenate([lse_p, sink[None]])
    o = jnp.concatenate([o, jnp.zeros_like(o[:1])])
    l = jnp.concatenate([l, jnp.ones_like(l[:1])])
  lse = common.row_lse(*_max_and_sum(lse_p))
  out_p = jnp.where(l[..., None] > 0, o / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
  out = jnp.sum(jnp.exp(lse_p - lse)[..., None] * out_p, axis=0)  # [B, G, R, Q, V]
  out = tiling.unblock(out[None], tl.t)
  return out, tiling.unblock(lse[None, ..., None], tl.t)[..., 0].transpose(0, 2, 1)


def _max_and_sum(lse_p):
  """(max, Σ exp(lse - max)) over the partitions (axis 0) of their log-sum-exps."""
  top = jnp.max(lse_p, axis=0)
  return top, jnp.sum(jnp.exp(lse_p - top), axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _attention(query, key, value, bias, mask, dropout_rng, mods, cfg, cfg_bwd, splits):
  """(out [B, T, H, V], lse [B, H, T]); the lse carries no gradient (callers stop it)."""
  del cfg_bwd
  out, lse = forward(query, key, value, bias, mask, dropout_rng, mods, cfg, splits)
  return out.astype(query.dtype), lse


def _attention_fwd(query, key, value, bias, mask, dropout_rng, mods, cfg, cfg_bwd, splits):
  del cfg_bwd
  out, lse = forward(query, key, value, bias, mask, dropout_rng, mods, cfg, splits)
  out = out.astype(query.dtype)
  return (out, lse), (query, key, value, bias, mask, dropout_rng, mods, out, lse)


def _attention_bwd(cfg, cfg_bwd, splits, residuals, cotangents):
  del cfg, splits
  return chunked.attention_bwd(cfg_bwd, residuals, cotangents)


_attention.defvjp(_attention_fwd, _attention_bwd)


def paged_block(page: int, n_pages: int) -> int:
  """The key block of a paged call: whole pages, as many as fit PAGED_BLOCK_K (at least one; a
  block of one small page costs a loop trip for a few keys)."""
  return page * max(1, min(n_pages, PAGED_BLOCK_K // page))


def configs(scale, dropout_rate, t: int, s: int, k: int, block_k: int, is_causal: bool = False,
            window: int | None = None) -> tuple[chunked.Config, chunked.Config]:
  """(forward, backward) tile configs of a decode call: the forward visits key blocks of
  `block_k` (at most S) with every query in one block; the backward is chunked's."""
  forward = chunked.Config(float(scale), float(dropout_rate), t, min(block_k, s))
  backward = chunked.Config(float(scale), float(dropout_rate),
                            *chunked.default_blocks(t, s, k, is_causal, window))
  return forward, backward


def make_attention(block_k: int | None = None, splits: int | None = None):
  """Decode attention with static key blocks and partitions (None: BLOCK_K, SPLITS), with
  `reference.attention`'s signature. Meant for T up to a few dozen queries; any T works."""
  block_k = BLOCK_K if block_k is None else checks.check_int("block_k", block_k)
  splits = SPLITS if splits is None else checks.check_int("splits", splits)

  def attention(query, key, value, bias, mask, *, is_causal, scale, dropout_rate, dropout_rng,
                mods=None, return_residual=False):
    """Split-key attention: [B, T, H, V] (and with `return_residual` the lse [B, T, H]), as
    `reference.attention`."""
    cfg, cfg_bwd = configs(scale, dropout_rate, query.shape[1], key.shape[1], query.shape[-1],
                           block_k, is_causal, mods_lib.narrowest_window(mods))
    mods = mods_lib.with_causal(mods, is_causal)
    out, lse_BHT = common.without_forward_mode(
        "decode", _attention, query, key, value, bias, mask, dropout_rng, mods, cfg, cfg_bwd,
        splits)
    return (out, lax.stop_gradient(lse_BHT.transpose(0, 2, 1))) if return_residual else out

  return attention


attention = make_attention()


def keys_bwd(cfg_bwd, query, keys_BSGK, values_BSGV, kv_scales_BSG, mods, out, lse,
             cotangents):
  """The chunked backward over keys and values in the API layout, dequantized first when int8
  (`kv_scales_BSG`: their scales [B, S, G]): (dq, dk, dv, dscales, dmods); int8 keys and values
  get None, their scales the gradient Σ d(dequantized) · int8 over the head dim (by
  `quant.dequantize`'s own derivative: a non-finite entry adds nothing)."""
  keys, values = keys_BSGK, values_BSGV
  if kv_scales_BSG is not None:
    keys, values = (quant.dequantize(x, scale, query.dtype)
                    for x, scale in zip((keys, values), kv_scales_BSG))
  dq, dk, dv, _, _, _, dmods = chunked.attention_bwd(
      cfg_bwd, (query, keys, values, None, None, None, mods, out, lse), cotangents)
  if kv_scales_BSG is None:
    return dq, dk, dv, None, dmods
  dscale = lambda d, x, scale: jax.vjp(lambda s: quant.dequantize(x, s, d.dtype), scale)[1](d)[0]
  dscales = tuple(dscale(d, x, scale) for d, x, scale in zip(
      (dk, dv), (keys_BSGK, values_BSGV), kv_scales_BSG))
  return dq, None, None, dscales, dmods


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def cache(query, key_BGSK, value_BGSV, mods, cfg, cfg_bwd, splits, forward_fn=None,
          kv_scales=None):
  """(out [B, T, H, V], lse [B, H, T]) over a contiguous cache's head-major keys [B, G, S, K]
  and values [B, G, S, V] (int8 with `kv_scales`, their scales [B, G, S] each), whose
  positions are `mods`' (see `cache_forward`); the lse carries no gradient. Gradients reach
  the query, floating keys and values or int8 ones' scales, and the float leaves of `mods`.
  `forward_fn`: another forward with `cache_forward`'s contract (a platform's kernel), None
  for this module's."""
  del cfg_bwd
  return _cache_forward(query, key_BGSK, value_BGSV, mods, cfg, splits, forward_fn, kv_scales)


def _cache_forward(query, key_BGSK, value_BGSV, mods, cfg, splits, forward_fn, kv_scales):
  out, lse = (forward_fn or cache_forward)(query, key_BGSK, value_BGSV, mods, cfg, splits,
                                           kv_scales)
  return out.astype(query.dtype), lse


def _cache_fwd(query, key_BGSK, value_BGSV, mods, cfg, cfg_bwd, splits, forward_fn,
               kv_scales):
  del cfg_bwd
  out, lse = _cache_forward(query, key_BGSK, value_BGSV, mods, cfg, splits, forward_fn,
                            kv_scales)
  return (out, lse), (query, key_BGSK, value_BGSV, kv_scales, mods, out, lse)


def _cache_bwd(cfg, cfg_bwd, splits, forward_fn, residuals, cotangents):
  """`keys_bwd` over the cache in the API layout, given back head-major."""
  del cfg, splits, forward_fn
  query, key_BGSK, value_BGSV, kv_scales, mods, out, lse = residuals
  api = lambda x: None if x is None else jnp.swapaxes(x, 1, 2)  # [B, G, S, ...] <-> [B, S, G, ...]
  scales = None if kv_scales is None else tuple(map(api, kv_scales))
  dq, dk, dv, dscales, dmods = keys_bwd(cfg_bwd, query, api(key_BGSK), api(value_BGSV), scales,
                                        mods, out, lse, cotangents)
  return (dq, api(dk), api(dv), dmods,
          None if dscales is None else tuple(map(api, dscales)))


cache.defvjp(_cache_fwd, _cache_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def paged(query, k_pages, v_pages, page_indices, lengths, mods, cfg, cfg_bwd, splits,
          paged_forward=None, kv_scales=None):
  """(out [B, T, H, V], lse [B, H, T]) over paged keys and values (see `forward`; cfg.block_k
  whole pages, `paged_block`; int8 pools with `kv_scales`, their scales [P, page, G] each);
  the lse carries no gradient. Gradients reach the query, floating pages or int8 ones' scales,
  and the float leaves of `mods` (sinks, score tables). `paged_forward`: another forward with
  `forward`'s paged contract (a platform's kernel), None for this one."""
  del cfg_bwd
  return _paged_forward(query, k_pages, v_pages, page_indices, lengths, mods, cfg, splits,
                        paged_forward, kv_scales)


def _paged_forward(query, k_pages, v_pages, page_indices, lengths, mods, cfg, splits,
                   paged_forward, kv_scales):
  if paged_forward is None:
    paged_forward = lambda q, k, v, table, lengths, mods, cfg, splits, kv_scales: forward(
        q, k, v, None, None, None, mods, cfg, splits, table, lengths, kv_scales)
  out, lse = paged_forward(query, k_pages, v_pages, page_indices, lengths, mods, cfg, splits,
                           kv_scales)
  return out.astype(query.dtype), lse


def _paged_fwd(query, k_pages, v_pages, page_indices, lengths, mods, cfg, cfg_bwd, splits,
               paged_forward, kv_scales):
  del cfg_bwd
  out, lse = _paged_forward(query, k_pages, v_pages, page_indices, lengths, mods, cfg, splits,
                            paged_forward, kv_scales)
  return (out, lse), (query, k_pages, v_pages, page_indices, lengths, kv_scales, mods, out, lse)


def _paged_bwd(cfg, cfg_bwd, splits, paged_forward, residuals, cotangents):
  """`keys_bwd` over the rows' pages gathered in order, scattered back to the pools."""
  del cfg, splits, paged_forward
  query, k_pages, v_pages, page_indices, lengths, kv_scales, mods, out, lse = residuals
  b, n = page_indices.shape
  rows = lambda pool: pool[page_indices].reshape(b, n * pool.shape[1], *pool.shape[2:])
  held = jnp.arange(n * k_pages.shape[1]) < lengths[:, None]  # [B, S]
  hide = lambda x: jnp.where(held.reshape(*held.shape, *(1,) * (x.ndim - 2)), x, 0)
  scales = None if kv_scales is None else tuple(hide(rows(x)) for x in kv_scales)
  dq, dk, dv, dscales, dmods = keys_bwd(cfg_bwd, query, hide(rows(k_pages)),
                                        hide(rows(v_pages)), scales, mods, out, lse, cotangents)
  scatter = lambda pool, d: None if d is None else jnp.zeros_like(pool).at[page_indices].add(
      d.reshape(b, n, *pool.shape[1:]).astype(pool.dtype))
  return (dq, scatter(k_pages, dk), scatter(v_pages, dv), None, None, dmods,
          None if dscales is None else tuple(map(scatter, kv_scales, dscales)))


paged.defvjp(_paged_fwd, _paged_bwd)


def refuses(call: registry.Call) -> str | None:
  """Why the decode kernel cannot run `call`: over pages in place it takes no dropout; over a
  contiguous cache's slots no dropout and no dense mask."""
  if call.layout == "paged" and call.dropout_rate:
    return "the decode kernel over pages takes no dropout"
  if call.layout == "cache" and (call.dropout_rate or call.mask is not None):
    return "the decode kernel over a cache's slots takes no dropout and no dense mask"
  return None


def cache_entry(query_BTHK, keys, values, kv_pos, *, mods, scale, kv_scales, **unused):
  """A KV cache's step (layout "cache"): the keys walked in place, block by block."""
  del kv_pos, unused  # the positions are the mods' Positions term
  t, s, k_dim = query_BTHK.shape[1], keys.shape[2], query_BTHK.shape[-1]
  cfg, cfg_bwd = configs(scale, 0.0, t, s, k_dim, BLOCK_K)
  out, _ = cache(query_BTHK, keys, values, mods, cfg, cfg_bwd, SPLITS,
                        kv_scales=kv_scales)
  return out


def paged_entry(query, k_pages, v_pages, page_indices, lengths, *, mods, cfg, cfg_bwd,
                  kv_scales, **unused):
  """A step over each row's pages read in place (layout "paged")."""
  del unused
  return paged(query, k_pages, v_pages, page_indices, lengths, mods, cfg, cfg_bwd,
               PAGED_SPLITS, kv_scales=kv_scales)


KERNEL = registry.register(registry.Kernel(
    "decode", attention, refuses, summary="a few queries over a long cache: keys split into "
    "partitions merged by log-sum-exp", layouts=("dense", "cache", "paged"),
    entries={"cache": cache_entry, "paged": paged_entry}))
