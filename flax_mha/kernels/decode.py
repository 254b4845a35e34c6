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
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from flax_mha import checks
from flax_mha import mods as mods_lib
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
            page_indices=None, lengths=None):
  """out [B, T, H, V] and lse [B, H, T] in the softmax dtype, as chunked's forward.

  k, v: the cache [B, S, G, K] and [B, S, G, V]; or, with `page_indices` [B, n] (paged: row b's
  positions j·page .. (j+1)·page - 1 live in page page_indices[b, j]) and `lengths` [B], the
  page pools [pages, page, G, K] and [pages, page, G, V], cfg.block_k a multiple of the page
  size (`paged_block`).
  """
  if page_indices is None:
    b, s, g, _ = k.shape
  else:
    (b, n_pages), (page, g) = page_indices.shape, k.shape[1:3]
    s = n_pages * page
  shape_BSGK = jax.ShapeDtypeStruct((b, s, g, k.shape[-1]), k.dtype)
  ctx = chunked.tile_context(q, shape_BSGK, bias, mask, rng, mods, cfg, 0, 0)
  tl, acc = ctx.tl, common.softmax_dtype(q.dtype)
  q_0 = tiling.blocks(q, 1, tl.bq, g)[0]  # [B, G, R, Q, K]: all T queries are one tile
  if page_indices is None:
    # Blocks of the cache in its own layout, [B, n_k, P, G, K] (a free reshape): each trip's
    # product transposes only its block, in cache, never the whole cache.
    def blocked(x):  # a free reshape, unless S needs padding (a copy: avoided when it divides)
      if tl.n_k * tl.bk != s:
        x = jnp.pad(x, ((0, 0), (0, tl.n_k * tl.bk - s), (0, 0), (0, 0)))
      return x.reshape(b, tl.n_k, tl.bk, g, x.shape[-1])
    k_blocks, v_blocks = blocked(k), blocked(v)
    fetch = lambda j: (k_blocks[:, j], v_blocks[:, j])
  else:  # a block is cfg.block_k / page pages: each row's j-th run of pages, gathered from the
    # pools; values past a row's length zeroed (hidden already: whatever a reused page holds
    # cannot leak as 0 · NaN)
    per_block = tl.bk // page
    table = jnp.pad(page_indices, ((0, 0), (0, tl.n_k * per_block - n_pages)))

    def fetch(j):
      pages = lax.dynamic_slice_in_dim(table, j * per_block, per_block, axis=1)  # [B, m]
      gather = lambda pool: pool[pages].reshape(b, tl.bk, *pool.shape[2:])
      held = (j * tl.bk + jnp.arange(tl.bk) < lengths[:, None])[:, :, None, None]
      return gather(k), jnp.where(held, gather(v), 0)
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
          jnp.zeros((splits, *stats_shape, v.shape[-1]), acc))
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def paged(query, k_pages, v_pages, page_indices, lengths, mods, cfg, cfg_bwd, splits,
          paged_forward=None):
  """(out [B, T, H, V], lse [B, H, T]) over paged keys and values (see `forward`; cfg.block_k
  whole pages, `paged_block`); the lse carries no gradient. Gradients reach the query, the pages and the
  float leaves of `mods` (sinks, score tables). `paged_forward`: another forward with
  `forward`'s paged contract (a platform's kernel), None for this one."""
  del cfg_bwd
  return _paged_forward(query, k_pages, v_pages, page_indices, lengths, mods, cfg, splits,
                        paged_forward)


def _paged_forward(query, k_pages, v_pages, page_indices, lengths, mods, cfg, splits,
                   paged_forward):
  if paged_forward is None:
    paged_forward = lambda q, k, v, table, lengths, mods, cfg, splits: forward(
        q, k, v, None, None, None, mods, cfg, splits, table, lengths)
  out, lse = paged_forward(query, k_pages, v_pages, page_indices, lengths, mods, cfg, splits)
  return out.astype(query.dtype), lse


def _paged_fwd(query, k_pages, v_pages, page_indices, lengths, mods, cfg, cfg_bwd, splits,
               paged_forward):
  del cfg_bwd
  out, lse = _paged_forward(query, k_pages, v_pages, page_indices, lengths, mods, cfg, splits,
                            paged_forward)
  return (out, lse), (query, k_pages, v_pages, page_indices, lengths, mods, out, lse)


def _paged_bwd(cfg, cfg_bwd, splits, paged_forward, residuals, cotangents):
  """The chunked backward over the rows' pages gathered in order, scattered back to the pools."""
  del cfg, splits, paged_forward
  query, k_pages, v_pages, page_indices, lengths, mods, out, lse = residuals
  b, n = page_indices.shape
  held = (jnp.arange(n * k_pages.shape[1]) < lengths[:, None])[:, :, None, None]
  gather = lambda pages: jnp.where(held, pages[page_indices].reshape(
      b, n * pages.shape[1], *pages.shape[2:]), 0)
  dq, dk, dv, _, _, _, dmods = chunked.attention_bwd(
      cfg_bwd, (query, gather(k_pages), gather(v_pages), None, None, None, mods, out, lse),
      cotangents)
  scatter = lambda pages, d: jnp.zeros_like(pages).at[page_indices].add(
      d.reshape(b, n, *pages.shape[1:]).astype(pages.dtype))
  return dq, scatter(k_pages, dk), scatter(v_pages, dv), None, None, dmods


paged.defvjp(_paged_fwd, _paged_bwd)


def refuses(call: registry.Call) -> str | None:
  """Why the decode kernel cannot run `call`: over pages in place it takes no dropout."""
  if call.layout == "paged" and call.dropout_rate:
    return "the decode kernel over pages takes no dropout"
  return None


KERNEL = registry.register(registry.Kernel(
    "decode", attention, refuses, summary="a few queries over a long cache: keys split into "
    "partitions merged by log-sum-exp", layouts=("dense", "paged")))
