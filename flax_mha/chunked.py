"""Chunked online-softmax attention (FlashAttention-2; Rabe & Staats 2021) in pure JAX.

Memory is linear in T and S: the forward walks over [bq, bk] tiles of the logits keeping a running
max `m`, normaliser `l` and output accumulator per query row, and saves only `out` and the
log-sum-exp `lse` for the backward (a `jax.custom_vjp`), which recomputes each tile. No [T, S]
matrix is ever stored (except the gradient of a full [B, H, T, S] bias, which is that big).

Block letters (beside the dimension key): Q the rows of a query tile (block_q = bq), P the
columns of a key tile (block_k = bk); n_q, n_k count the tiles.

Layout inside: query blocks [n_q, B, G, R, Q, K] (R = H // G; one transpose in), key/value
blocks [n_k, B, G, P, K], keys also pre-transposed [n_k, B, G, K, P]: the R query heads that
share a key head are rows of one matmul (K/V are never repeated), and every matmul is a plain
row-major product (no transposed operand for XLA:CPU to copy). The backward works on
transposed tiles [B, G, P, R, Q] for the same reason. Loops: `lax.scan`
over query blocks (forward) or key blocks (backward), `lax.fori_loop` over the other axis whose
bounds skip the tiles that causality hides (traced bounds work, so ring attention's traced
offsets keep the skip). T and S are padded to block multiples; padded keys are masked.

`chunked_forward` / `chunked_backward` are the building blocks for ring attention
(`flax_mha.ring_attention`): one (query shard, key shard) pair with absolute offsets, the backward
taking the GLOBAL `out`/`lse` so per-shard gradient contributions add up.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from flax_mha import _common
from flax_mha import _dropout

# Block sizes of chunked_forward/backward (ring attention's per-device shards): large shards.
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static facts of one call (hashable: the custom_vjp's non-differentiable argument)."""
  scale: float
  is_causal: bool
  dropout_rate: float
  block_q: int
  block_k: int


class _Tiling(NamedTuple):
  """Static sizes: real lengths, block sizes and block counts (padded length = n · block)."""
  t: int
  s: int
  bq: int
  bk: int
  n_q: int
  n_k: int


def _tiling(t: int, s: int, block_q: int, block_k: int) -> _Tiling:
  bq, bk = min(block_q, t), min(block_k, s)
  return _Tiling(t, s, bq, bk, -(-t // bq), -(-s // bk))


def _blocks(x_BLHK, n: int, size: int, groups: int, transpose: bool = False):
  """[B, L, H, K] -> [n, B, G, R, size, K] (or [n, B, G, K, R, size]), zero-padding L to n·size.

  H = G·R is split so that the R query heads sharing a key head sit next to the rows they add to
  a matmul; with `transpose` the feature dim comes first, for matmuls that contract over rows.
  """
  b, length, h, k = x_BLHK.shape
  x_BLHK = jnp.pad(x_BLHK, ((0, 0), (0, n * size - length), (0, 0), (0, 0)))
  x = x_BLHK.reshape(b, n, size, groups, h // groups, k)
  return x.transpose((1, 0, 3, 5, 4, 2) if transpose else (1, 0, 3, 4, 2, 5))


def _unblock(x_nBGRQV, length: int, transposed: bool = False):
  """Inverse of `_blocks`: [n, B, G, R, size, V] (or [n, B, G, V, R, size]) -> [B, length, H, V]."""
  x = x_nBGRQV.transpose((1, 0, 5, 2, 4, 3) if transposed else (1, 0, 4, 2, 3, 5))
  b, n, size, g, r, v = x.shape
  return x.reshape(b, n * size, g * r, v)[:, :length]


def _pad_tiles(x, tl: _Tiling, fill):
  """Pad a rank-4 mask/bias's full T and S dims (not the broadcast 1s) to block multiples."""
  if x is None:
    return None
  pad_t = tl.n_q * tl.bq - tl.t if x.shape[2] > 1 else 0
  pad_s = tl.n_k * tl.bk - tl.s if x.shape[3] > 1 else 0
  return jnp.pad(x, ((0, 0), (0, 0), (0, pad_t), (0, pad_s)), constant_values=fill)


def _tile_index(x, i, j, tl: _Tiling):
  """Start indices and sizes of tile (i, j) of a padded rank-4 mask/bias (broadcast dims stay 1)."""
  full_t, full_s = x.shape[2] > 1, x.shape[3] > 1
  starts = (0, 0, i * tl.bq if full_t else 0, j * tl.bk if full_s else 0)
  sizes = (*x.shape[:2], tl.bq if full_t else 1, tl.bk if full_s else 1)
  return starts, sizes


def _as_layout(x_BHQP, groups: int, transposed: bool):
  """A [b, h, q, p] tile (h = H or 1) as [b, G, R, q, p], or [b, G, p, R, q] when transposed."""
  b, h, q, p = x_BHQP.shape
  x = x_BHQP.reshape(b, groups, h // groups, q, p) if h > 1 else x_BHQP[:, :, None]
  return x.transpose(0, 1, 4, 2, 3) if transposed else x


def _tile(x, i, j, tl: _Tiling, groups: int, transposed: bool):
  if x is None:
    return None
  return _as_layout(lax.dynamic_slice(x, *_tile_index(x, i, j, tl)), groups, transposed)


def _causal_hi(i, tl: _Tiling, q_offset, kv_offset):
  """One past the last key block that query block i sees (causal: q_offset+t >= kv_offset+s)."""
  last_visible = q_offset + (i + 1) * tl.bq - 1 - kv_offset
  return jnp.clip(jnp.floor_divide(last_visible, tl.bk) + 1, 0, tl.n_k)


def _causal_lo(j, tl: _Tiling, q_offset, kv_offset):
  """The first query block that sees key block j."""
  return jnp.clip(jnp.floor_divide(kv_offset + j * tl.bk - q_offset, tl.bq), 0, tl.n_q)


class _TileCtx(NamedTuple):
  """What every tile needs besides q/k: static config and sizes, mask, bias, rng, offsets."""
  cfg: _Config
  tl: _Tiling
  groups: int  # G
  heads: int  # H
  mask: jax.Array | None
  bias: jax.Array | None
  rng: jax.Array | None
  q_offset: int | jax.Array
  kv_offset: int | jax.Array


def _bias_and_visible(i, j, ctx: _TileCtx, transposed: bool):
  """The bias tile and the boolean visibility of tile (i, j) in the tile's layout (or None)."""
  cfg, tl = ctx.cfg, ctx.tl
  bias = _tile(ctx.bias, i, j, tl, ctx.groups, transposed)
  visible = _tile(ctx.mask, i, j, tl, ctx.groups, transposed)
  t_pos, s_pos = _row_col(i, j, tl, transposed)
  if cfg.is_causal:
    causal = ctx.q_offset + t_pos >= ctx.kv_offset + s_pos
    visible = causal if visible is None else visible & causal
  if tl.n_k * tl.bk > tl.s:  # padded keys
    real = s_pos < tl.s
    visible = real if visible is None else visible & real
  return bias, visible


def _row_col(i, j, tl: _Tiling, transposed: bool):
  """Row (t) and column (s) indices of tile (i, j), broadcastable to its layout."""
  t_pos, s_pos = i * tl.bq + jnp.arange(tl.bq), j * tl.bk + jnp.arange(tl.bk)
  if transposed:  # [B, G, P, R, Q]
    return t_pos, s_pos[:, None, None]
  return t_pos[:, None], s_pos  # [B, G, R, Q, P]


def _masked_logits(raw, i, j, ctx: _TileCtx, transposed: bool):
  """scale·raw + bias, hidden entries -inf (in raw's dtype and the tile's layout)."""
  bias, visible = _bias_and_visible(i, j, ctx, transposed)
  s = raw * ctx.cfg.scale
  if bias is not None:
    s = s + bias.astype(raw.dtype)
  return s if visible is None else jnp.where(visible, s, -jnp.inf)


def _apply_dropout(p, i, j, ctx: _TileCtx, transposed: bool):
  """p · keep / (1 - rate) with the reference's hash mask over (b·H + h, t, s), or p unchanged."""
  rate = ctx.cfg.dropout_rate
  if rate == 0.0:
    return p
  b, g = p.shape[:2]
  r = ctx.heads // g
  bh = jnp.arange(b * ctx.heads).reshape((b, g, 1, r, 1) if transposed else (b, g, r, 1, 1))
  t_pos, s_pos = _row_col(i, j, ctx.tl, transposed)
  keep = _dropout.keep_mask(ctx.rng, rate, bh, t_pos, s_pos, ctx.tl.s)
  return _dropout.apply(p, rate, keep)


def _context(q, k, bias, mask, rng, cfg: _Config, q_offset, kv_offset) -> _TileCtx:
  tl = _tiling(q.shape[1], k.shape[1], cfg.block_q, cfg.block_k)
  return _TileCtx(cfg, tl, k.shape[2], q.shape[2], _pad_tiles(mask, tl, False),
                  _pad_tiles(bias, tl, 0.0), rng, q_offset, kv_offset)


def _forward(q, k, v, bias, mask, rng, cfg: _Config, q_offset=0, kv_offset=0):
  """out [B, T, H, V] and lse [B, H, T] in the softmax dtype (lse -inf: no key visible)."""
  ctx = _context(q, k, bias, mask, rng, cfg, q_offset, kv_offset)
  tl, g, acc = ctx.tl, ctx.groups, _common.softmax_dtype(q.dtype)
  q_blocks = _blocks(q, tl.n_q, tl.bq, g)  # [n_q, B, G, R, Q, K]
  kt_blocks = _blocks(k, tl.n_k, tl.bk, g, transpose=True)[:, :, :, :, 0]  # [n_k, B, G, K, P]
  v_blocks = _blocks(v, tl.n_k, tl.bk, g)[:, :, :, 0]  # [n_k, B, G, P, V]

  def q_step(_, xs):
    i, q_i = xs

    def k_step(j, carry):
      m, l, o = carry
      raw = jnp.einsum("BGRQK,BGKP->BGRQP", q_i, kt_blocks[j], preferred_element_type=acc)
      s = _masked_logits(raw, i, j, ctx, transposed=False)
      m_new = jnp.maximum(m, s.max(axis=-1))
      # A row that has seen only -inf so far keeps m = -inf; subtracting 0 instead keeps
      # exp(-inf - m) at 0 rather than NaN.
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      p = jnp.exp(s - m_safe[..., None])
      alpha = jnp.exp(m - m_safe)
      p_dropped = _apply_dropout(p, i, j, ctx, False).astype(v.dtype)
      pv = jnp.einsum("BGRQP,BGPV->BGRQV", p_dropped, v_blocks[j], preferred_element_type=acc)
      return m_new, alpha * l + p.sum(axis=-1), alpha[..., None] * o + pv

    stats_shape = q_i.shape[:-1]  # [B, G, R, bq]
    init = (jnp.full(stats_shape, -jnp.inf, acc), jnp.zeros(stats_shape, acc),
            jnp.zeros((*stats_shape, v.shape[-1]), acc))
    hi = _causal_hi(i, tl, q_offset, kv_offset) if cfg.is_causal else tl.n_k
    m, l, o = lax.fori_loop(0, hi, k_step, init)
    out = jnp.where(l[..., None] > 0, o / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return None, (out, m + jnp.log(l))

  _, (out, lse) = lax.scan(q_step, None, (jnp.arange(tl.n_q), q_blocks))
  lse_BHT = _unblock(lse[..., None], tl.t)[..., 0].transpose(0, 2, 1)
  return _unblock(out, tl.t), lse_BHT


def _backward(q, k, v, out, lse, dout, bias, mask, rng, cfg: _Config, q_offset=0, kv_offset=0):
  """(dq, dk, dv, dbias) of one (query, key) pair in the softmax dtype, given the global out/lse
  (dbias: None without a bias).

  Works on transposed tiles [B, G, P, R, Q] so that all five matmuls per tile are plain
  row-major products (no transposed operand): sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ, dV += Pᵀ·dO,
  dK += dSᵀ·Q and dQᵀ += Kᵀ·dSᵀ.
  """
  ctx = _context(q, k, bias, mask, rng, cfg, q_offset, kv_offset)
  tl, g, acc = ctx.tl, ctx.groups, _common.softmax_dtype(q.dtype)
  delta = jnp.sum(dout.astype(acc) * out.astype(acc), axis=-1)  # [B, T, H]
  lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # rows with no visible key: every p is 0 anyway
  rows = lambda x_BTH: _blocks(x_BTH[..., None], tl.n_q, tl.bq, g)[..., 0]  # [n_q, B, G, R, Q]
  q_blocks, do_blocks = _blocks(q, tl.n_q, tl.bq, g), _blocks(dout, tl.n_q, tl.bq, g)
  qt_blocks = _blocks(q, tl.n_q, tl.bq, g, transpose=True)  # [n_q, B, G, K, R, Q]
  dot_blocks = _blocks(dout, tl.n_q, tl.bq, g, transpose=True)
  lse_blocks, delta_blocks = rows(lse.transpose(0, 2, 1)), rows(delta)
  mm = functools.partial(jnp.einsum, preferred_element_type=acc)

  def k_step(carry, xs):
    j, k_j, kt_j, v_j = xs

    def q_step(i, carry):
      dqt, dbias, dk_j, dv_j = carry
      st = _masked_logits(mm("BGPK,BGKRQ->BGPRQ", k_j, qt_blocks[i]), i, j, ctx, True)
      pt = jnp.exp(st - lse_blocks[i][:, :, None])
      dpt = _apply_dropout(mm("BGPV,BGVRQ->BGPRQ", v_j, dot_blocks[i]), i, j, ctx, True)
      dst = pt * (dpt - delta_blocks[i][:, :, None])
      pdt = _apply_dropout(pt, i, j, ctx, True).astype(v_j.dtype)
      dv_j = dv_j + mm("BGPRQ,BGRQV->BGPV", pdt, do_blocks[i])
      dk_j = dk_j + mm("BGPRQ,BGRQK->BGPK", dst.astype(k_j.dtype), q_blocks[i]) * cfg.scale
      dqt = dqt.at[i].add(mm("BGKP,BGPRQ->BGKRQ", kt_j, dst.astype(k_j.dtype)) * cfg.scale)
      if dbias is not None:
        dbias = _add_tile(dbias, dst, i, j, ctx)
      return dqt, dbias, dk_j, dv_j

    dqt, dbias = carry
    init = (dqt, dbias, jnp.zeros(k_j.shape, acc), jnp.zeros(v_j.shape, acc))
    lo = _causal_lo(j, tl, q_offset, kv_offset) if cfg.is_causal else 0
    dqt, dbias, dk_j, dv_j = lax.fori_loop(lo, tl.n_q, q_step, init)
    return (dqt, dbias), (dk_j, dv_j)

  k_blocks = _blocks(k, tl.n_k, tl.bk, g)[:, :, :, 0]  # [n_k, B, G, P, K]
  kt_blocks = _blocks(k, tl.n_k, tl.bk, g, transpose=True)[:, :, :, :, 0]  # [n_k, B, G, K, P]
  v_blocks = _blocks(v, tl.n_k, tl.bk, g)[:, :, :, 0]
  dqt0 = jnp.zeros(qt_blocks.shape, acc)
  dbias0 = None if ctx.bias is None else jnp.zeros(ctx.bias.shape, acc)
  (dqt, dbias), (dk, dv) = lax.scan(
      k_step, (dqt0, dbias0), (jnp.arange(tl.n_k), k_blocks, kt_blocks, v_blocks))
  if dbias is not None:
    dbias = dbias[:, :, :min(bias.shape[2], tl.t), :min(bias.shape[3], tl.s)]
  unblock_kv = lambda x: _unblock(x[:, :, :, None], tl.s)
  return _unblock(dqt, tl.t, transposed=True), unblock_kv(dk), unblock_kv(dv), dbias


def _add_tile(dbias, dst, i, j, ctx: _TileCtx):
  """dbias[tile (i, j)] += dS (transposed tile [B, G, P, R, Q]), summed where bias broadcasts."""
  b, g, bk, r, bq = dst.shape
  ds_BHQP = dst.transpose(0, 1, 3, 4, 2).reshape(b, g * r, bq, bk)
  starts, sizes = _tile_index(dbias, i, j, ctx.tl)
  axes = tuple(a for a in range(4) if sizes[a] == 1 and ds_BHQP.shape[a] > 1)
  update = ds_BHQP.sum(axis=axes, keepdims=True) + lax.dynamic_slice(dbias, starts, sizes)
  return lax.dynamic_update_slice(dbias, update, starts)


def chunked_forward(query, key, value, *, scale, is_causal, q_offset=0, kv_offset=0, mask=None,
                    bias=None, dropout_rate=0.0, dropout_rng=None,
                    block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K):
  """Attention of one query shard over one key shard, with the statistics to merge shards.

  Args:
    query: [B, T, H, K]; key: [B, S, G, K]; value: [B, S, G, V] (H a multiple of G).
    scale, is_causal, dropout_rate, block_q, block_k: static.
    q_offset, kv_offset: absolute positions of query row 0 and key row 0 (ints, may be traced);
      causal visibility is `q_offset + t >= kv_offset + s`.
    mask, bias: None or rank 4 broadcasting to [B, H, T, S], in this shard's local coordinates.
    dropout_rng: required when dropout_rate > 0; the keep-mask hashes local (t, s) and num_kv=S.

  Returns:
    out [B, T, H, V] (normalised within this shard) and lse [B, H, T] in the softmax dtype
    (float32 for 16- and 32-bit inputs, float64 for float64), lse being the
    log-sum-exp of the visible logits: -inf for a row with no visible key (its out is 0).
  """
  cfg = _Config(float(scale), is_causal, float(dropout_rate), block_q, block_k)
  return _forward(query, key, value, bias, mask, dropout_rng, cfg, q_offset, kv_offset)


def chunked_backward(query, key, value, out, lse, dout, *, scale, is_causal, q_offset=0,
                     kv_offset=0, mask=None, bias=None, dropout_rate=0.0, dropout_rng=None,
                     block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K):
  """Gradient contribution of this key shard, given the GLOBAL out [B,T,H,V] and lse [B,H,T].

  Same arguments as `chunked_forward`, plus the attention output over all shards, its lse and
  the output cotangent dout [B, T, H, V]. Returns, in the softmax dtype, (dquery [B,T,H,K],
  this shard's contribution: summing over key shards gives the full gradient; dkey [B,S,G,K];
  dvalue [B,S,G,V]). Bias gradients are available through `attention` (the custom_vjp), not here.
  """
  cfg = _Config(float(scale), is_causal, float(dropout_rate), block_q, block_k)
  dq, dk, dv, _ = _backward(query, key, value, out, lse, dout, None, mask, dropout_rng, cfg,
                            q_offset, kv_offset)
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(query, key, value, bias, mask, dropout_rng, cfg: _Config):
  return _forward(query, key, value, bias, mask, dropout_rng, cfg)[0].astype(query.dtype)


def _attention_fwd(query, key, value, bias, mask, dropout_rng, cfg):
  out, lse = _forward(query, key, value, bias, mask, dropout_rng, cfg)
  out = out.astype(query.dtype)
  return out, (query, key, value, bias, mask, dropout_rng, out, lse)


def _attention_bwd(cfg, residuals, dout):
  query, key, value, bias, mask, dropout_rng, out, lse = residuals
  dq, dk, dv, dbias = _backward(query, key, value, out, lse, dout, bias, mask, dropout_rng, cfg)
  if dbias is not None:
    dbias = dbias.astype(bias.dtype)
  return (dq.astype(query.dtype), dk.astype(key.dtype), dv.astype(value.dtype), dbias, None,
          None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def default_blocks(t: int, s: int, k: int, is_causal: bool) -> tuple[int, int]:
  """(block_q, block_k) for a shape: the fastest of a sweep on a 2-core CPU in float32
  (`python -m experiments.benchmark_blocks` re-runs it).

  Large tiles mean few loop trips; causal tiles above the diagonal are skipped, so smaller tiles
  skip more of the causal work at short lengths.
  """
  if is_causal and max(t, s) <= 1024:
    block = 128 if k <= 64 else 256
  else:
    block = 512
  return block, block


FORWARD_MODE_ERROR = (
    "implementation='chunked' has no forward-mode autodiff (jax.jvp, jax.jacfwd, jax.linearize "
    "of a custom_vjp function): its memory-lean backward is a custom VJP. Use "
    "implementation='xla' or 'reference' for forward mode, or reverse mode (jax.grad, jax.vjp, "
    "jax.jacrev) with 'chunked'.")


def make_attention(block_q: int | None = None, block_k: int | None = None):
  """Chunked attention with static block sizes (None: `default_blocks` of the shape), with
  `reference.attention`'s signature.

  Gradients (reverse mode only) flow to query, key, value and bias; memory is
  O((T + S)·(H·K + bq·bk)) plus the size of the bias gradient when a bias is given.
  """
  for name, block in (("block_q", block_q), ("block_k", block_k)):
    if block is not None and not (isinstance(block, int) and block > 0):
      raise ValueError(f"{name} must be a positive int or None, got {block!r}")

  def attention(query, key, value, bias, mask, *, is_causal, scale, dropout_rate, dropout_rng):
    """Chunked `softmax(QKᵀ·scale + bias, masked)·V`: [B, T, H, V], as `reference.attention`."""
    auto_q, auto_k = default_blocks(query.shape[1], key.shape[1], query.shape[-1], is_causal)
    cfg = _Config(float(scale), is_causal, float(dropout_rate), block_q or auto_q,
                  block_k or auto_k)
    try:
      return _attention(query, key, value, bias, mask, dropout_rng, cfg)
    except TypeError as e:  # raised here when jax.jvp traces this call outside of jit
      if "forward-mode" in str(e):
        raise TypeError(FORWARD_MODE_ERROR) from e
      raise

  return attention


attention = make_attention()
