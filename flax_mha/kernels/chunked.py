"""Chunked online-softmax attention (FlashAttention-2; Rabe & Staats 2021) in pure JAX.

Memory is linear in T and S: the forward walks over [bq, bk] tiles of the logits keeping a running
max `m`, normaliser `l` and output accumulator per query row, and saves only `out` and the
log-sum-exp `lse` for the backward (a `jax.custom_vjp`), which recomputes each tile. No [T, S]
matrix is ever stored (except the gradient of a full [B, H, T, S] bias, which is that big).

Work is proportional to what the mask leaves visible: every mask (causal, windows, lengths,
segment ids, `mask_mod`, the dense `mask`) says which tiles may hold a visible entry and which
are entirely visible (`flax_mha.mods`). The loops visit only the former, and evaluate no mask on
the latter. Maps known from static shapes are built at trace time; data-dependent ones at run
time from per-tile summaries.

Layout inside (block letters Q, P: see `flax_mha.kernels.tiling`): query blocks [n_q, B, G, R, Q, K]
(R = H // G; one transpose in), key/value blocks [n_k, B, G, P, K], keys also pre-transposed
[n_k, B, G, K, P]: the R query heads that share a key head are rows of one matmul (K/V are never
repeated), and every matmul is a plain row-major product (no transposed operand for XLA:CPU to
copy). The backward works on transposed tiles [B, G, P, R, Q] for the same reason. Loops:
`lax.scan` over query blocks (forward) or key blocks (backward), `lax.fori_loop` over the
visited tiles of the other axis. T and S are padded to block multiples; padded keys are masked.

`chunked_forward` / `chunked_backward` are the building blocks for ring attention
(`flax_mha.parallel.ring`): one (query shard, key shard) pair with absolute offsets, the backward
taking the GLOBAL `out`/`lse` so per-shard gradient contributions add up.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flax_mha import checks
from flax_mha.kernels import common
from flax_mha.kernels import dropout
from flax_mha.kernels import tiling
from flax_mha import mods as mods_lib
from flax_mha.kernels import registry

# Block sizes of chunked_forward/backward (ring attention's per-device shards): large shards.
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512


@dataclasses.dataclass(frozen=True)
class Config:
  """Static facts of one call (hashable: the custom_vjp's non-differentiable argument)."""
  scale: float
  dropout_rate: float
  block_q: int
  block_k: int


class TileContext(NamedTuple):
  """What every tile needs besides q/k: config, sizes, mask, bias, rng, mods, offsets, visits."""
  cfg: Config
  tl: tiling.Tiling
  batch: int  # B
  groups: int  # G
  heads: int  # H
  mask: jax.Array | None
  bias: jax.Array | None
  rng: jax.Array | None
  mods: mods_lib.Mods
  q_offset: int | jax.Array
  kv_offset: int | jax.Array
  rows: tiling.Visits  # per query block: key blocks to visit (forward)
  cols: tiling.Visits  # per key block: query blocks to visit (backward)


def tile_context(q, k, bias, mask, rng, mods, cfg: Config, q_offset, kv_offset) -> TileContext:
  tl = tiling.tiling(q.shape[1], k.shape[1], cfg.block_q, cfg.block_k)
  mask = tiling.pad_tiles(mask, tl, True, False)  # padded query rows: don't care
  tiles = mods_lib.make_tiles(tl.t, tl.s, tl.bq, tl.bk, q_offset, kv_offset)
  maybe, full = mods.tile_map(tiles)
  full = full & (np.arange(1, tl.n_k + 1) * tl.bk <= tl.s)[None]  # a padded key tile is masked
  if mask is not None:
    mask_maybe, mask_full = tiling.dense_mask_map(mask, tl)
    maybe, full = maybe & mask_maybe, full & mask_full
  return TileContext(cfg, tl, q.shape[0], k.shape[2], q.shape[2], mask,
                  tiling.pad_tiles(bias, tl, 0.0, 0.0), rng, mods, q_offset, kv_offset,
                  tiling.visits(maybe, full), tiling.visits(maybe.T, full.T))


def _indices(i, j, ctx: TileContext, transposed: bool):
  """(b, h, q, kv) int32 indices of tile (i, j), broadcastable to its layout: [B, G, R, Q, P], or
  [B, G, P, R, Q] when transposed; q and kv absolute positions."""
  tl, g, r = ctx.tl, ctx.groups, ctx.heads // ctx.groups
  ar = lambda n: jnp.arange(n, dtype=jnp.int32)
  b = ar(ctx.batch).reshape(-1, 1, 1, 1, 1)
  q = (ctx.q_offset + i * tl.bq + ar(tl.bq)).astype(jnp.int32)
  kv = (ctx.kv_offset + j * tl.bk + ar(tl.bk)).astype(jnp.int32)
  if transposed:
    return b, ar(ctx.heads).reshape(1, g, 1, r, 1), q, kv[:, None, None]
  return b, ar(ctx.heads).reshape(1, g, r, 1, 1), q[:, None], kv


def _visible(i, j, ctx: TileContext, idx, transposed: bool):
  """Boolean visibility of a partially visible tile (i, j) in its layout."""
  visible = ctx.mods.visible(*idx)
  dense = tiling.tile(ctx.mask, i, j, ctx.tl, ctx.groups, transposed)
  if dense is not None:
    visible = dense if visible is None else visible & dense
  if ctx.tl.n_k * ctx.tl.bk > ctx.tl.s:  # padded keys
    real = idx[3] - ctx.kv_offset < ctx.tl.s
    visible = real if visible is None else visible & real
  return visible


def _pre_scores(raw, i, j, ctx: TileContext, transposed: bool):
  """scale·raw + bias (in raw's dtype and the tile's layout)."""
  s = raw * ctx.cfg.scale
  bias = tiling.tile(ctx.bias, i, j, ctx.tl, ctx.groups, transposed)
  return s if bias is None else s + bias.astype(raw.dtype)


def _mask(s, i, j, ctx, idx, transposed: bool, masked: bool):
  """Hidden entries of a partial tile at -inf; full tiles pass through unmasked."""
  if not masked:
    return s
  visible = _visible(i, j, ctx, idx, transposed)
  return s if visible is None else jnp.where(visible, s, -jnp.inf)


def _apply_dropout(p, ctx: TileContext, idx):
  """p · keep / (1 - rate) with the shared hash mask over (b·H + h, t, s), or p unchanged."""
  rate = ctx.cfg.dropout_rate
  if rate == 0.0:
    return p
  b, h, q, kv = idx
  keep = dropout.keep_mask(ctx.rng, rate, b * ctx.heads + h, q - ctx.q_offset,
                            kv - ctx.kv_offset, ctx.tl.s)
  return dropout.apply(p, rate, keep)


def forward_tile(carry, i, j, raw, v_j, ctx: TileContext, masked: bool):
  """One step of the online softmax: the running (max, sum, output) [B, G, R, Q(, V)] of query
  block i after key block j, from the tile's raw products Q·Kᵀ (raw [B, G, R, Q, P]) and its
  values (v_j [B, G, P, V]); `masked` for tiles not entirely visible."""
  m, l, o = carry
  idx = _indices(i, j, ctx, False)
  s = _mask(ctx.mods.score(_pre_scores(raw, i, j, ctx, False), *idx), i, j, ctx, idx, False,
            masked)
  m_new = jnp.maximum(m, s.max(axis=-1))
  # A row that has seen only -inf so far keeps m = -inf; subtracting 0 instead keeps
  # exp(-inf - m) at 0 rather than NaN.
  m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  p = jnp.exp(s - m_safe[..., None])
  alpha = jnp.exp(m - m_safe)
  p_dropped = _apply_dropout(p, ctx, idx).astype(v_j.dtype)
  pv = jnp.einsum("BGRQP,BGPV->BGRQV", p_dropped, v_j, preferred_element_type=m.dtype)
  return m_new, alpha * l + p.sum(axis=-1), alpha[..., None] * o + pv


def initial_stats(stats_shape, groups: int, sinks, dtype):
  """(max, sum) before any key: (-inf, 0), or with sinks [H] the sink itself (sink, 1)."""
  if sinks is None:
    return jnp.full(stats_shape, -jnp.inf, dtype), jnp.zeros(stats_shape, dtype)
  m0 = jnp.broadcast_to(sinks.astype(dtype).reshape(1, groups, -1, 1), stats_shape)
  return m0, jnp.ones(stats_shape, dtype)


def _forward(q, k, v, bias, mask, rng, mods, cfg: Config, q_offset=0, kv_offset=0):
  """out [B, T, H, V] and lse [B, H, T] in the softmax dtype (lse finfo.min: no key visible)."""
  ctx = tile_context(q, k, bias, mask, rng, mods, cfg, q_offset, kv_offset)
  tl, g, acc = ctx.tl, ctx.groups, common.softmax_dtype(q.dtype)
  q_blocks = tiling.blocks(q, tl.n_q, tl.bq, g)  # [n_q, B, G, R, Q, K]
  kt_blocks = tiling.blocks(k, tl.n_k, tl.bk, g, transpose=True)[:, :, :, :, 0]  # [n_k,B,G,K,P]
  v_blocks = tiling.blocks(v, tl.n_k, tl.bk, g)[:, :, :, 0]  # [n_k, B, G, P, V]

  def q_step(_, xs):
    i, q_i = xs

    def k_step(masked):
      def step(j, carry):
        raw = jnp.einsum("BGRQK,BGKP->BGRQP", q_i, kt_blocks[j], preferred_element_type=acc)
        return forward_tile(carry, i, j, raw, v_blocks[j], ctx, masked)
      return step

    stats_shape = q_i.shape[:-1]  # [B, G, R, Q]
    carry = (*initial_stats(stats_shape, g, mods.sinks, acc),
             jnp.zeros((*stats_shape, v.shape[-1]), acc))
    rows = ctx.rows
    carry = tiling.loop(rows.full_idx, rows.full_count, i, k_step(False), carry)
    m, l, o = tiling.loop(rows.partial_idx, rows.partial_count, i, k_step(True), carry)
    out = jnp.where(l[..., None] > 0, o / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return None, (out, common.row_lse(m, l))

  _, (out, lse) = lax.scan(q_step, None, (jnp.arange(tl.n_q), q_blocks))
  lse_BHT = tiling.unblock(lse[..., None], tl.t)[..., 0].transpose(0, 2, 1)
  return tiling.unblock(out, tl.t), lse_BHT


def _score_grad(mods: mods_lib.Mods):
  """(scores(s_raw, idx), d/ds_raw, d/dconsts) by one vjp, differentiating the float leaves of
  the score terms (a learned table, ...); (identity, None) without score terms."""
  leaves, treedef = jax.tree.flatten(mods.scores)
  is_float = [jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x in leaves]

  def apply(s_raw, floats, idx):
    it = iter(floats)
    full = [next(it) if f else x for x, f in zip(leaves, is_float)]
    return mods_lib.Mods(scores=jax.tree.unflatten(treedef, full)).score(s_raw, *idx)

  floats = [x for x, f in zip(leaves, is_float) if f]
  return apply, floats


def _backward(q, k, v, out, lse, dout, bias, mask, rng, mods, cfg: Config, q_offset=0,
              kv_offset=0):
  """(dq, dk, dv, dbias, dscore_consts) of one (query, key) pair in the softmax dtype, given the
  global out/lse (dbias: None without a bias; dscore_consts: the float leaves of the score terms).

  Works on transposed tiles [B, G, P, R, Q] so that all five matmuls per tile are plain
  row-major products (no transposed operand): sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ, dV += Pᵀ·dO,
  dK += dSᵀ·Q and dQᵀ += Kᵀ·dSᵀ.
  """
  ctx = tile_context(q, k, bias, mask, rng, mods, cfg, q_offset, kv_offset)
  tl, g, acc = ctx.tl, ctx.groups, common.softmax_dtype(q.dtype)
  delta = jnp.sum(dout.astype(acc) * out.astype(acc), axis=-1)  # [B, T, H]
  lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # rows with no visible key: every p is 0 anyway
  rows = lambda x_BTH: tiling.blocks(x_BTH[..., None], tl.n_q, tl.bq, g)[..., 0]
  q_blocks, do_blocks = tiling.blocks(q, tl.n_q, tl.bq, g), tiling.blocks(dout, tl.n_q, tl.bq, g)
  qt_blocks = tiling.blocks(q, tl.n_q, tl.bq, g, transpose=True)  # [n_q, B, G, K, R, Q]
  dot_blocks = tiling.blocks(dout, tl.n_q, tl.bq, g, transpose=True)
  lse_blocks, delta_blocks = rows(lse.transpose(0, 2, 1)), rows(delta)  # [n_q, B, G, R, Q]
  mm = functools.partial(jnp.einsum, preferred_element_type=acc)
  score_fn, score_floats = _score_grad(mods)

  def k_step(carry, xs):
    j, k_j, kt_j, v_j = xs

    def q_step(masked):
      def step(i, carry):
        dqt, dbias, dfloats, dk_j, dv_j = carry
        idx = _indices(i, j, ctx, True)
        st_raw = _pre_scores(mm("BGPK,BGKRQ->BGPRQ", k_j, qt_blocks[i]), i, j, ctx, True)
        st, score_vjp = jax.vjp(lambda s, f: score_fn(s, f, idx), st_raw, score_floats)
        st = _mask(st, i, j, ctx, idx, True, masked)
        pt = jnp.exp(st - lse_blocks[i][:, :, None])
        dpt = _apply_dropout(mm("BGPV,BGVRQ->BGPRQ", v_j, dot_blocks[i]), ctx, idx)
        dst, dfloats_tile = score_vjp(pt * (dpt - delta_blocks[i][:, :, None]))
        dfloats = [a + b for a, b in zip(dfloats, dfloats_tile)]
        pdt = _apply_dropout(pt, ctx, idx).astype(v_j.dtype)
        dv_j = dv_j + mm("BGPRQ,BGRQV->BGPV", pdt, do_blocks[i])
        dk_j = dk_j + mm("BGPRQ,BGRQK->BGPK", dst.astype(k_j.dtype), q_blocks[i]) * cfg.scale
        dqt = dqt.at[i].add(mm("BGKP,BGPRQ->BGKRQ", kt_j, dst.astype(k_j.dtype)) * cfg.scale)
        if dbias is not None:
          dbias = _add_tile(dbias, dst, i, j, ctx)
        return dqt, dbias, dfloats, dk_j, dv_j
      return step

    dqt, dbias, dfloats = carry
    carry = (dqt, dbias, dfloats, jnp.zeros(k_j.shape, acc), jnp.zeros(v_j.shape, acc))
    cols = ctx.cols
    carry = tiling.loop(cols.full_idx, cols.full_count, j, q_step(False), carry)
    dqt, dbias, dfloats, dk_j, dv_j = tiling.loop(cols.partial_idx, cols.partial_count, j,
                                                   q_step(True), carry)
    return (dqt, dbias, dfloats), (dk_j, dv_j)

  k_blocks = tiling.blocks(k, tl.n_k, tl.bk, g)[:, :, :, 0]  # [n_k, B, G, P, K]
  kt_blocks = tiling.blocks(k, tl.n_k, tl.bk, g, transpose=True)[:, :, :, :, 0]  # [n_k,B,G,K,P]
  v_blocks = tiling.blocks(v, tl.n_k, tl.bk, g)[:, :, :, 0]
  dqt0 = jnp.zeros(qt_blocks.shape, acc)
  dbias0 = None if ctx.bias is None else jnp.zeros(ctx.bias.shape, acc)
  dfloats0 = [jnp.zeros_like(x) for x in score_floats]
  (dqt, dbias, dfloats), (dk, dv) = lax.scan(
      k_step, (dqt0, dbias0, dfloats0), (jnp.arange(tl.n_k), k_blocks, kt_blocks, v_blocks))
  if dbias is not None:
    dbias = dbias[:, :, :min(bias.shape[2], tl.t), :min(bias.shape[3], tl.s)]
  unblock_kv = lambda x: tiling.unblock(x[:, :, :, None], tl.s)
  return (tiling.unblock(dqt, tl.t, transposed=True), unblock_kv(dk), unblock_kv(dv), dbias,
          dfloats)


def _add_tile(dbias, dst, i, j, ctx: TileContext):
  """dbias[tile (i, j)] += dS (transposed tile [B, G, P, R, Q]), summed where bias broadcasts."""
  b, g, bk, r, bq = dst.shape
  ds_BHQP = dst.transpose(0, 1, 3, 4, 2).reshape(b, g * r, bq, bk)
  starts, sizes = tiling.tile_index(dbias, i, j, ctx.tl)
  axes = tuple(a for a in range(4) if sizes[a] == 1 and ds_BHQP.shape[a] > 1)
  update = ds_BHQP.sum(axis=axes, keepdims=True) + lax.dynamic_slice(dbias, starts, sizes)
  return lax.dynamic_update_slice(dbias, update, starts)


def chunked_forward(query, key, value, *, scale, is_causal, q_offset=0, kv_offset=0, mask=None,
                    bias=None, mods=None, dropout_rate=0.0, dropout_rng=None,
                    block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K):
  """Attention of one query shard over one key shard, with the statistics to merge shards.

  Args:
    query: [B, T, H, K]; key: [B, S, G, K]; value: [B, S, G, V] (H a multiple of G).
    scale, is_causal, dropout_rate, block_q, block_k: static.
    q_offset, kv_offset: absolute positions of query row 0 and key row 0 (ints, may be traced);
      causal visibility is `q_offset + t >= kv_offset + s`, and `mods` see absolute positions.
    mask, bias: None or rank 4 broadcasting to [B, H, T, S], in this shard's local coordinates.
    mods: optional `flax_mha.mods.Mods` (mask and score terms).
    dropout_rng: required when dropout_rate > 0; the keep-mask hashes local (t, s) and num_kv=S.

  Returns:
    out [B, T, H, V] (normalised within this shard) and lse [B, H, T] in the softmax dtype
    (float32 for 16- and 32-bit inputs, float64 for float64), lse being the
    log-sum-exp of the visible logits: -inf for a row with no visible key (its out is 0).
  """
  cfg = Config(float(scale), float(dropout_rate), block_q, block_k)
  mods = mods_lib.with_causal(mods, is_causal)
  return _forward(query, key, value, bias, mask, dropout_rng, mods, cfg, q_offset, kv_offset)


def chunked_backward(query, key, value, out, lse, dout, *, scale, is_causal, q_offset=0,
                     kv_offset=0, mask=None, bias=None, mods=None, dropout_rate=0.0,
                     dropout_rng=None, block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K):
  """Gradient contribution of this key shard, given the GLOBAL out [B,T,H,V] and lse [B,H,T].

  Same arguments as `chunked_forward`, plus the attention output over all shards, its lse and
  the output cotangent dout [B, T, H, V]. Returns, in the softmax dtype, (dquery [B,T,H,K],
  this shard's contribution: summing over key shards gives the full gradient; dkey [B,S,G,K];
  dvalue [B,S,G,V]). Bias and score-term gradients are available through `attention` (the
  custom_vjp), not here.
  """
  cfg = Config(float(scale), float(dropout_rate), block_q, block_k)
  mods = mods_lib.with_causal(mods, is_causal)
  dq, dk, dv, _, _ = _backward(query, key, value, out, lse, dout, None, mask, dropout_rng, mods,
                               cfg, q_offset, kv_offset)
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attention(query, key, value, bias, mask, dropout_rng, mods, cfg: Config):
  """(out [B, T, H, V], lse [B, H, T]); the lse carries no gradient (its cotangent is ignored:
  callers stop it)."""
  out, lse = _forward(query, key, value, bias, mask, dropout_rng, mods, cfg)
  return out.astype(query.dtype), lse


def _attention_fwd(query, key, value, bias, mask, dropout_rng, mods, cfg):
  out, lse = _forward(query, key, value, bias, mask, dropout_rng, mods, cfg)
  out = out.astype(query.dtype)
  return (out, lse), (query, key, value, bias, mask, dropout_rng, mods, out, lse)


def attention_bwd(cfg, residuals, cotangents):
  query, key, value, bias, mask, dropout_rng, mods, out, lse = residuals
  dout = cotangents[0]
  dq, dk, dv, dbias, dfloats = _backward(query, key, value, out, lse, dout, bias, mask,
                                         dropout_rng, mods, cfg)
  if dbias is not None:
    dbias = dbias.astype(bias.dtype)
  dsinks = None
  if mods.sinks is not None:
    dsinks = common.sink_grad(mods.sinks, lse.transpose(0, 2, 1), out, dout)
  return (dq.astype(query.dtype), dk.astype(key.dtype), dv.astype(value.dtype), dbias, None,
          None, _mods_cotangent(mods, dfloats, dsinks))


def _mods_cotangent(mods: mods_lib.Mods, dfloats, dsinks):
  """The cotangent of `mods`: dfloats at the score terms' float leaves, dsinks at the sinks,
  None everywhere else."""
  leaves, treedef = jax.tree.flatten(mods.scores)
  it = iter(dfloats)
  d_scores = [next(it) if jnp.issubdtype(jnp.result_type(x), jnp.inexact) else None
              for x in leaves]
  mask_leaves, mask_def = jax.tree.flatten(mods.masks)
  return mods_lib.Mods(masks=jax.tree.unflatten(mask_def, [None] * len(mask_leaves)),
                       scores=jax.tree.unflatten(treedef, d_scores), sinks=dsinks)


_attention.defvjp(_attention_fwd, attention_bwd)


def default_blocks(t: int, s: int, k: int, is_causal: bool,
                   window: int | None = None) -> tuple[int, int]:
  """(block_q, block_k) for a shape: the fastest of a sweep on a 2-core CPU in float32
  (`python -m experiments.bench.blocks` re-runs it).

  Large tiles mean few loop trips; causal tiles above the diagonal are skipped, so smaller tiles
  skip more of the causal work at short lengths. A local window of `window` keys (left + right
  + 1) skips tiles outside its band, and tiles of at most a quarter of it keep the band's ragged
  edges a small part of the work (`python -m experiments.bench.sparsity`).
  """
  if window is not None and window < min(t, s):
    block = 128 if window <= 1024 else 256 if window <= 4096 else 512
  elif is_causal and max(t, s) <= 1024:
    block = 128 if k <= 64 else 256
  else:
    block = 512
  return block, block


def visited_fraction(t: int, s: int, k: int, is_causal: bool, mods) -> float:
  """The share of its [T, S] tiles that this kernel visits under the masks known from static
  shapes (causality, windows, index-only mask_mods); data-dependent terms count as visible."""
  static = tuple(term for term in (mods.masks if mods else ())
                 if isinstance(term, mods_lib.LocalWindow)
                 or (isinstance(term, mods_lib.MaskMod) and not term.consts))
  if not static and not is_causal:
    return 1.0
  static_mods = mods_lib.with_causal(mods_lib.Mods(static), is_causal)
  bq, bk = default_blocks(t, s, k, is_causal, mods_lib.narrowest_window(mods))
  maybe, _ = static_mods.tile_map(mods_lib.make_tiles(t, s, bq, bk))
  return float(np.mean(maybe))


def make_attention(block_q: int | None = None, block_k: int | None = None):
  """Chunked attention with static block sizes (None: `default_blocks` of the shape), with
  `reference.attention`'s signature.

  Gradients (reverse mode only) flow to query, key, value, bias and the float arrays of score
  terms; memory is O((T + S)·(H·K + bq·bk)) plus the size of the bias gradient when a bias is
  given.
  """
  for name, block in (("block_q", block_q), ("block_k", block_k)):
    if block is not None:
      checks.check_int(name, block)

  def attention(query, key, value, bias, mask, *, is_causal, scale, dropout_rate, dropout_rng,
                mods=None, return_residual=False):
    """Chunked `softmax(QKᵀ·scale + bias, masked)·V`: [B, T, H, V] (and with
    `return_residual` the lse [B, T, H]), as `reference.attention`."""
    auto_q, auto_k = default_blocks(query.shape[1], key.shape[1], query.shape[-1], is_causal,
                                    mods_lib.narrowest_window(mods))
    cfg = Config(float(scale), float(dropout_rate), block_q or auto_q, block_k or auto_k)
    mods = mods_lib.with_causal(mods, is_causal)
    out, lse_BHT = common.without_forward_mode("chunked", _attention, query, key, value, bias,
                                                mask, dropout_rng, mods, cfg)
    return (out, lax.stop_gradient(lse_BHT.transpose(0, 2, 1))) if return_residual else out

  return attention


attention = make_attention()


KERNEL = registry.register(registry.Kernel(
    "chunked", attention, summary="online softmax in tiles with its own backward: memory linear "
    "in S, every option, the tiles its masks hide skipped",
    layouts=("dense", "ring_block"), hints=dict(visited_fraction=visited_fraction),
    entries={"ring_block": registry.Block(chunked_forward, chunked_backward,
                                          skips_hidden_tiles=True)}))
