"""Query-row blocks with an exact softmax: the fast CPU path (bias, mask and causality; no dropout).

One block of query rows at a time sees all the keys it may attend to at once: [rows, S] logits
per key head, one max, one exp, one sum, no running-max rescaling and one large matmul each way.
The loops also walk over heads, a few key heads per trip, so that each tile (heads · rows · S
logits) stays in cache: that, not the FLOP count, is what decides speed on XLA:CPU (a [B, H, T, S]
logits array that misses the cache costs more than the matmuls that make it). Memory is linear
in T and S for a fixed tile (the tile's rows shrink as S grows), and the backward (a
`jax.custom_vjp`) recomputes each tile from `out` and the log-sum-exp, like `flax_mha.kernels.chunked`.

Layout inside: units are (batch, key head) pairs; a tile is [U, R·Q, S] where the R query heads
that share a key head are rows of one matmul (GQA without repeating K/V). The backward works on
transposed tiles [U, S, R·Q] so that all five matmuls are products XLA:CPU runs without copying
an operand (sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ, dV += Pᵀ·dO, dK += dSᵀ·Q, dQᵀ = Kᵀ·dSᵀ).

Causal attention visits, per query block, only the keys up to the block's last row: query
blocks are grouped into at most MAX_SEGMENTS segments with a static key extent each (one block
per segment for up to MAX_SEGMENTS blocks), so causal costs about half of non-causal. A sliding
window (left, right) visits, per block of WINDOW_ROWS query rows, one band of
WINDOW_ROWS + left + right keys (right 0 when causal) that starts where the block's first row
looks: work proportional to the window, not to S.

Takes query, key, value, a bias and a mask (rank 4, broadcasting to [B, H, T, S], with their
1s kept: a trip reads its [batch, heads, rows, keys] part), `is_causal`, `scale`, sinks and a
`local_window_size` without sink tokens; a query row that sees no key gives 0, as everywhere.
Dropout and the other mask/score options are refused by name (use "chunked" or "xla", which
take everything).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from flax_mha import checks
from flax_mha import mods as mods_lib
from flax_mha.kernels import common
from flax_mha.kernels import registry

# Logits per tile (units · rows · keys), forward and backward: the fastest of a sweep on a 2-core
# CPU in float32 (`python -m experiments.bench.blocks --rows` re-runs the sweep).
TILE_FORWARD = 2**21
TILE_FORWARD_CAUSAL = 2**19
TILE_BACKWARD = 2**18
CAUSAL_BLOCKS = 4  # causal: at least this many query blocks, so that few hidden keys are visited
MAX_SEGMENTS = 16  # causal: distinct static key extents (each one more loop in the program)
MIN_ROWS = 128  # query rows per block at least (up to T): skinnier products waste the matmul
WINDOW_ROWS = 128  # query rows per block under a window narrower than S (the band's overhang)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static facts of one call: sizes, tiles, causal segments (hashable for custom_vjp)."""
  scale: float
  is_causal: bool
  t: int
  s: int
  units: int  # U·n_u = B·G: (batch, key head) pairs per trip, trips
  n_u: int
  bq: int  # query rows per block (per query head)
  n_q: int
  segments: tuple[tuple[int, int, int], ...]  # (first block, end block, key extent)
  window: tuple[int, int] | None = None  # (left, right; 0 when causal): what a row sees
  band: bool = False  # whether each block visits only its window's band of keys


def unsupported_reason(dropout_rate, mods) -> str | None:
  """Why "rows" can't run this call (None when it can)."""
  if dropout_rate > 0.0:
    return "it has no dropout"
  if mods is not None and (mods.scores or window_of(mods) is None and mods.masks):
    return ("it takes no lengths, segment ids, positions, sink tokens, soft-capping or "
            "mask/score functions (bias, mask, is_causal, a window and sinks only)")
  return None


def band_keys(window: tuple[int, int], is_causal: bool, window_rows: int = WINDOW_ROWS) -> int:
  """Keys one block of `window_rows` query rows visits under `window` (left, right): the rows'
  own span plus the window's reach (a causal window reaches no key to the right)."""
  return window_rows + window[0] + (0 if is_causal else window[1])


def window_of(mods) -> tuple[int, int] | None:
  """(left, right) of a call whose only mask term is a window without sink tokens, else None."""
  terms = () if mods is None else mods.masks
  if len(terms) == 1 and isinstance(terms[0], mods_lib.LocalWindow) and not terms[0].sink_tokens:
    return terms[0].left, terms[0].right
  return None


def _units(b: int, g: int, at_most: int) -> int:
  """The most (batch, key head) units per trip, at most `at_most`, that divide B·G and cover
  either whole batch elements (a multiple of G) or part of one (a divisor of G)."""
  return max(d for d in range(1, max(1, min(b * g, at_most)) + 1)
             if (b * g) % d == 0 and (d % g == 0 or g % d == 0))


def plan(b, t, s, h, g, scale, is_causal, tile, window=None, window_rows=WINDOW_ROWS) -> _Plan:
  """Tile sizes for [B, T, H, ·] queries over [B, S, G, ·] keys within `tile` logits, under a
  window (left, right) if given (blocks of `window_rows` query rows then)."""
  r = h // g
  if window is not None:
    window = (window[0], 0 if is_causal else window[1])
  if window is not None and band_keys(window, is_causal, window_rows) < s:
    bq = min(t, window_rows)
    n_q, extent = -(-t // bq), band_keys(window, is_causal, bq)
    units = _units(b, g, tile // (r * bq * extent))
    return _Plan(float(scale), is_causal, t, s, units, b * g // units, bq, n_q,
                 ((0, n_q, extent),), window, band=True)
  bq = max(MIN_ROWS, min(t, tile // (r * s)))
  if is_causal:
    bq = max(MIN_ROWS, min(bq, -(-t // CAUSAL_BLOCKS)))
  bq = -(-t // -(-t // bq))  # even blocks: n_q blocks of at most bq rows, the padding < n_q
  n_q = -(-t // bq)
  units = _units(b, g, tile // (r * bq * s))
  if is_causal:
    n_seg = min(n_q, MAX_SEGMENTS)
    ends = [round((i + 1) * n_q / n_seg) for i in range(n_seg)]
    starts = [0] + ends[:-1]
    segments = tuple((a, e, min(s, e * bq)) for a, e in zip(starts, ends))
  else:
    segments = ((0, n_q, s),)
  return _Plan(float(scale), is_causal, t, s, units, b * g // units, bq, n_q, segments, window)


def _to_units(x_BLHK, groups: int, n_u: int, n: int, size: int):
  """[B, L, H, K] -> [n_u, n, U, R·size, K] (zero-padding L to n·size)."""
  b, length, h, k = x_BLHK.shape
  x = jnp.pad(x_BLHK, ((0, 0), (0, n * size - length), (0, 0), (0, 0)))
  x = x.reshape(b, n, size, groups, h // groups, k).transpose(0, 3, 1, 4, 2, 5)
  return x.reshape(n_u, (b * groups) // n_u, n, h // groups * size, k).transpose(0, 2, 1, 3, 4)


def _from_units(x, b: int, groups: int, length: int, size: int):
  """Inverse of `_to_units`: [n_u, n, U, R·size, V] -> [B, length, H, V]."""
  n_u, n, u, rq, v = x.shape
  r = rq // size
  x = x.transpose(0, 2, 1, 3, 4).reshape(b, groups, n, r, size, v).transpose(0, 2, 4, 1, 3, 5)
  return x.reshape(b, n * size, groups * r, v)[:, :length]


def _kv_units(x_BSGK, n_u: int):
  """[B, S, G, K] -> [n_u, U, S, K]."""
  b, s, g, k = x_BSGK.shape
  return x_BSGK.transpose(0, 2, 1, 3).reshape(n_u, b * g // n_u, s, k)


def _key_start(p: _Plan, block):
  """The first key block `block` visits: 0, or under a window where its first row looks,
  clamped so that the band stays within S."""
  if not p.band:
    return 0
  return jnp.clip(block * p.bq - p.window[0], 0, p.s - p.segments[0][2])


def _keys(x, p: _Plan, start, extent: int, axis: int):
  """The `extent` keys from `start` along `axis` of x."""
  if not p.band:
    return lax.slice_in_dim(x, 0, extent, axis=axis)
  return lax.dynamic_slice_in_dim(x, start, extent, axis=axis)


def _hidden(p: _Plan, block, start, extent: int, transposed: bool):
  """Causal or a window: True where a key is out of a query's sight, [1, Q, extent] (or
  [extent, 1, Q] when transposed) to broadcast over R; None when nothing is hidden."""
  if p.window is None and (not p.is_causal or
                           (isinstance(block, int) and block * p.bq >= extent - 1)):
    return None
  rows = (block * p.bq + jnp.arange(p.bq, dtype=jnp.int32))[:, None]
  keys = (start + jnp.arange(extent, dtype=jnp.int32))[None, :]
  if p.window is None:
    hidden = keys > rows  # [Q, extent]: causal
  else:  # the plan's window already reaches no key to the right when causal
    hidden = (keys < rows - p.window[0]) | (keys > rows + p.window[1])
  return hidden.T[:, None, :] if transposed else hidden[None]


def _over_blocks(p: _Plan, body, carry, xs):
  """Run body(block, extent, carry, x) over query blocks, segment by segment; stack outputs."""
  outs = []
  for first, end, extent in p.segments:
    seg = jax.tree.map(lambda a, first=first, end=end: a[first:end], xs)
    if end - first == 1:
      carry, out = body(first, extent, carry, jax.tree.map(lambda a: a[0], seg))
      out = jax.tree.map(lambda a: a[None], out)
    else:
      step = lambda c, ix, extent=extent: body(ix[0], extent, c, ix[1])
      carry, out = lax.scan(step, carry, (jnp.arange(first, end), seg))
    outs.append(out)
  return carry, jax.tree.map(lambda *a: jnp.concatenate(a), *outs)


def _dense_index(shape, p: _Plan, g: int, r: int, trip, block, start, extent: int):
  """(starts, sizes) of what trip `trip` and query block `block` (keys from `start`) read of a
  rank-4 [B|1, H|1, T_pad|1, S|1] mask/bias (its broadcast dims stay 1)."""
  whole = p.units % g == 0  # the trip's units are units // g whole batch elements
  first = trip * p.units
  full = [n > 1 for n in shape]
  starts = (first // g, 0 if whole else (first % g) * r, block * p.bq, start)
  sizes = (p.units // g if whole else 1, (g if whole else p.units) * r, p.bq, extent)
  starts = tuple(jnp.asarray(x if f else 0, jnp.int32) for x, f in zip(starts, full))
  return starts, tuple(n if f else 1 for n, f in zip(sizes, full))


def _view(p: _Plan, g: int, r: int, shape, transposed: bool):
  """The 5-d view [b, G', R, Q, E] (or [b, G', E, R, Q]) of a tile [U, R·Q, E] ([U, E, R·Q])."""
  nb = p.units // g if p.units % g == 0 else 1
  u, a, c = shape
  return (nb, u // nb, a, r, c // r) if transposed else (nb, u // nb, r, a // r, c)


def _dense_tile(x, p: _Plan, g: int, r: int, trip, block, start, extent: int, transposed: bool):
  """A mask/bias's part for a tile, broadcastable against `_view` (None stays None)."""
  if x is None:
    return None
  starts, sizes = _dense_index(x.shape, p, g, r, trip, block, start, extent)
  t = lax.dynamic_slice(x, starts, sizes)
  heads = (sizes[1] // r, r) if sizes[1] > 1 else (1, 1)
  t = t.reshape(sizes[0], *heads, sizes[2], sizes[3])
  return t.transpose(0, 1, 4, 2, 3) if transposed else t


def _scores(s, dense, p: _Plan, g: int, r: int, trip, block, start, extent: int,
            transposed: bool):
  """s + bias, with -inf where the mask, causality or the window hides an entry (s's shape)."""
  hidden = _hidden(p, block, start, extent, transposed)
  bias, mask = (_dense_tile(x, p, g, r, trip, block, start, extent, transposed) for x in dense)
  if bias is None and mask is None and hidden is None:
    return s
  s5 = s.reshape(_view(p, g, r, s.shape, transposed))
  if bias is not None:
    s5 = s5 + bias.astype(s.dtype)
  if mask is not None:
    s5 = jnp.where(mask, s5, -jnp.inf)
  if hidden is not None:
    s5 = jnp.where(hidden, -jnp.inf, s5)
  return s5.reshape(s.shape)


def _add_dbias(dbias, dst, p: _Plan, g: int, r: int, trip, block, start, extent: int):
  """dbias [B|1, H|1, T_pad|1, S|1] += this tile's dS (transposed [U, E, R·Q]), summed over the
  bias's broadcast dims."""
  d = dst.reshape(_view(p, g, r, dst.shape, True)).transpose(0, 1, 3, 4, 2)  # [b, G', R, Q, E]
  for axes, n in (((0,), dbias.shape[0]), ((1, 2), dbias.shape[1]), ((3,), dbias.shape[2]),
                  ((4,), dbias.shape[3])):
    if n == 1:
      d = d.sum(axis=axes, keepdims=True)
  d = d.reshape(d.shape[0], d.shape[1] * d.shape[2], *d.shape[3:])
  starts, sizes = _dense_index(dbias.shape, p, g, r, trip, block, start, extent)
  return lax.dynamic_update_slice(dbias, lax.dynamic_slice(dbias, starts, sizes) + d, starts)


def _pad_rows(x, p: _Plan, fill):
  """A rank-4 mask/bias with a full T dim padded to n_q·bq rows (None stays None)."""
  if x is None or x.shape[2] == 1:
    return x
  return jnp.pad(x, ((0, 0), (0, 0), (0, p.n_q * p.bq - x.shape[2]), (0, 0)),
                 constant_values=fill)


def _forward(q, k, v, dense, sinks, p: _Plan):
  """out [B, T, H, V] and lse [n_u, n_q, U, R·Q], in the softmax dtype (lse finfo.min: a row
  that sees no key, its out 0); dense = (bias, mask), each None or rank 4; sinks None or [H]."""
  b, _, h, _ = q.shape
  g = k.shape[2]
  r, acc = h // g, common.softmax_dtype(q.dtype)
  dense = (_pad_rows(dense[0], p, 0.0), _pad_rows(dense[1], p, True))
  # Else every row sees a key (0 if causal); under a window, padding rows past T may not.
  empty_rows = any(x is not None for x in dense) or p.window is not None
  q_units = _to_units(q * jnp.asarray(p.scale, q.dtype), g, p.n_u, p.n_q, p.bq)
  k_units, v_units = _kv_units(k, p.n_u), _kv_units(v, p.n_u)

  # Each row's sink logit (of its query head), in the rows' layout: [n_u, n_q, U, R·Q, 1].
  sink_units = None if sinks is None else _to_units(
      jnp.broadcast_to(sinks.astype(acc)[None, None, :, None], (b, p.t, h, 1)), g, p.n_u,
      p.n_q, p.bq)
  empty_rows = empty_rows and sinks is None  # a sink is always seen

  def unit_step(_, xs):
    trip, q_u, k_u, v_u, sink_u = xs

    def block(i, extent, carry, x):
      q_i, sink_i = x
      start = _key_start(p, i)
      s = jnp.einsum("UQK,USK->UQS", q_i, _keys(k_u, p, start, extent, 1),
                     preferred_element_type=acc)
      s = _scores(s, dense, p, g, r, trip, i, start, extent, False)
      m = jnp.max(s, axis=-1, keepdims=True)
      if sink_i is not None:
        m = jnp.maximum(m, sink_i)
      if empty_rows:  # subtracting 0 keeps a row of -inf at exp = 0 rather than NaN
        m = jnp.where(m == -jnp.inf, 0.0, m)
      e = jnp.exp(s - m)
      l = jnp.sum(e, axis=-1, keepdims=True)
      if sink_i is not None:
        l = l + jnp.exp(sink_i - m)
      o = jnp.einsum("UQS,USV->UQV", e.astype(v.dtype), _keys(v_u, p, start, extent, 1),
                     preferred_element_type=acc)
      o = jnp.where(l > 0, o / jnp.where(l > 0, l, 1.0), 0.0) if empty_rows else o / l
      return carry, (o, common.row_lse(m, l)[..., 0])

    return None, _over_blocks(p, block, None, (q_u, sink_u))[1]

  _, (out, lse) = lax.scan(unit_step, None, (jnp.arange(p.n_u), q_units, k_units, v_units,
                                             sink_units))
  return _from_units(out, b, g, p.t, p.bq), lse


def _backward(q, k, v, out, lse, dout, dense, p: _Plan):
  """(dq, dk, dv, dbias) in the softmax dtype (dbias None without a bias), given the output
  `out` [B, T, H, V] and its log-sum-exp `lse` (layout of `_forward` for plan p)."""
  b, _, h, _ = q.shape
  g = k.shape[2]
  r, acc = h // g, common.softmax_dtype(q.dtype)
  delta = jnp.sum(dout.astype(acc) * out.astype(acc), axis=-1)  # [B, T, H]
  bias, mask = _pad_rows(dense[0], p, 0.0), _pad_rows(dense[1], p, True)
  lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # rows with no visible key: every p is 0
  q_units = _to_units(q * jnp.asarray(p.scale, q.dtype), g, p.n_u, p.n_q, p.bq)
  do_units = _to_units(dout, g, p.n_u, p.n_q, p.bq)
  delta_units = _to_units(delta[..., None], g, p.n_u, p.n_q, p.bq)[..., 0]
  k_units, v_units = _kv_units(k, p.n_u), _kv_units(v, p.n_u)
  mm = functools.partial(jnp.einsum, preferred_element_type=acc)

  def unit_step(dbias, xs):
    trip, q_u, do_u, lse_u, delta_u, k_u, v_u = xs
    kt_u = k_u.swapaxes(-1, -2)

    def block(i, extent, carry, x):
      dk, dv, dbias = carry
      q_i, do_i, lse_i, delta_i = x
      start = _key_start(p, i)
      k_i, v_i = _keys(k_u, p, start, extent, 1), _keys(v_u, p, start, extent, 1)
      st = _scores(mm("USK,UQK->USQ", k_i, q_i), (bias, mask), p, g, r, trip, i, start,
                   extent, True)
      pt = jnp.exp(st - lse_i[:, None])
      dpt = mm("USV,UQV->USQ", v_i, do_i)
      dst = pt * (dpt - delta_i[:, None])
      dv_i = mm("USQ,UQV->USV", pt.astype(v.dtype), do_i)
      dk_i = mm("USQ,UQK->USK", dst.astype(q.dtype), q_i)
      dqt = mm("UKS,USQ->UKQ", _keys(kt_u, p, start, extent, 2), dst.astype(k.dtype)) * p.scale
      if dbias is not None:
        dbias = _add_dbias(dbias, dst, p, g, r, trip, i, start, extent)
      if extent == p.s:
        return (dk + dk_i, dv + dv_i, dbias), dqt
      add = lambda x, d: lax.dynamic_update_slice_in_dim(
          x, _keys(x, p, start, extent, 1) + d, start, axis=1)
      return (add(dk, dk_i), add(dv, dv_i), dbias), dqt

    zeros = (jnp.zeros(k_u.shape, acc), jnp.zeros(v_u.shape, acc), dbias)
    (dk, dv, dbias), dqt = _over_blocks(p, block, zeros, (q_u, do_u, lse_u, delta_u))
    return dbias, (dqt, dk, dv)

  dbias0 = None if bias is None else jnp.zeros(bias.shape, acc)
  dbias, (dqt, dk, dv) = lax.scan(unit_step, dbias0, (jnp.arange(p.n_u), q_units, do_units, lse,
                                                      delta_units, k_units, v_units))
  dq = _from_units(dqt.swapaxes(-1, -2), b, g, p.t, p.bq)
  from_kv = lambda x: x.reshape(b, g, p.s, -1).transpose(0, 2, 1, 3)
  if dbias is not None:
    dbias = dbias[:, :, :dense[0].shape[2]]
  return dq, from_kv(dk), from_kv(dv), dbias


def _lse_bth(lse, p: _Plan, b: int, g: int):
  """lse [n_u, n_q, U, R·Q] of plan p -> [B, T, H]."""
  return _from_units(lse[..., None], b, g, p.t, p.bq)[..., 0]


def _lse_units(lse_BTH, p: _Plan, g: int):
  """lse [B, T, H] -> [n_u, n_q, U, R·Q] of plan p."""
  return _to_units(lse_BTH[..., None], g, p.n_u, p.n_q, p.bq)[..., 0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _attention(q, k, v, bias, mask, sinks, p_fwd: _Plan, p_bwd: _Plan):
  """(out [B, T, H, V], lse [B, T, H]); the lse carries no gradient (callers stop it)."""
  out, lse = _forward(q, k, v, (bias, mask), sinks, p_fwd)
  return out.astype(q.dtype), _lse_bth(lse, p_fwd, q.shape[0], k.shape[2])


def _attention_fwd(q, k, v, bias, mask, sinks, p_fwd, p_bwd):
  out, lse = _forward(q, k, v, (bias, mask), sinks, p_fwd)
  out, lse_BTH = out.astype(q.dtype), _lse_bth(lse, p_fwd, q.shape[0], k.shape[2])
  return (out, lse_BTH), (q, k, v, bias, mask, sinks, out, lse, lse_BTH)


def _attention_bwd(p_fwd, p_bwd, residuals, cotangents):
  q, k, v, bias, mask, sinks, out, lse, lse_BTH = residuals
  dout = cotangents[0]
  if (p_fwd.units, p_fwd.bq) != (p_bwd.units, p_bwd.bq):
    lse = _lse_units(lse_BTH, p_bwd, k.shape[2])
  dq, dk, dv, dbias = _backward(q, k, v, out, lse, dout, (bias, mask), p_bwd)
  dsinks = None if sinks is None else common.sink_grad(sinks, lse_BTH, out, dout)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
          None if bias is None else dbias.astype(bias.dtype), None, dsinks)


_attention.defvjp(_attention_fwd, _attention_bwd)


def make_attention(tile_forward: int | None = None, tile_backward: int = TILE_BACKWARD,
                   window_rows: int = WINDOW_ROWS):
  """"rows" attention with the given tile budgets (logits per tile; tile_forward None:
  TILE_FORWARD, or TILE_FORWARD_CAUSAL when causal) and query rows per block under a window,
  with `reference.attention`'s signature."""
  if tile_forward is not None:
    checks.check_int("tile_forward", tile_forward)
  checks.check_int("tile_backward", tile_backward)
  checks.check_int("window_rows", window_rows)

  def attention(query, key, value, bias, mask, *, is_causal, scale, dropout_rate, dropout_rng,
                mods=None, return_residual=False):
    """softmax(Q·Kᵀ·scale + bias, masked)·V in query-row blocks: [B, T, H, V] (and with
    `return_residual` the lse [B, T, H]), as `reference.attention`; dropout or mask/score
    terms raise a ValueError (sinks are fine)."""
    del dropout_rng
    reason = unsupported_reason(dropout_rate, mods)
    if reason is not None:
      raise ValueError(f"implementation='rows' cannot run this call: {reason}. Use "
                       "implementation='chunked' or 'xla', which take every option")
    b, t, h, _ = query.shape
    s, g = key.shape[1:3]
    forward = tile_forward or (TILE_FORWARD_CAUSAL if is_causal else TILE_FORWARD)
    window = window_of(mods)
    plans = [plan(b, t, s, h, g, scale, is_causal, tile, window, window_rows)
             for tile in (forward, tile_backward)]
    sinks = None if mods is None else mods.sinks
    out, lse = common.without_forward_mode("rows", _attention, query, key, value, bias, mask,
                                            sinks, *plans)
    return (out, lax.stop_gradient(lse)) if return_residual else out

  return attention


attention = make_attention()


def refuses(call: registry.Call) -> str | None:
  """The registry's question: why "rows" cannot run `call` (`unsupported_reason`)."""
  return unsupported_reason(call.dropout_rate, call.mods)


KERNEL = registry.register(registry.Kernel(
    "rows", attention, refuses, "query-row blocks with an exact softmax and their own backward: "
    "the fast CPU path for bias, mask, causality, a window and sinks",
    hints=dict(window_of=window_of, band_keys=band_keys)))
