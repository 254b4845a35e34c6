"""Query-row blocks with an exact softmax: the fast CPU path for plain and causal attention.

One block of query rows at a time sees all the keys it may attend to at once: [rows, S] logits
per key head, one max, one exp, one sum, no running-max rescaling and one large matmul each way.
The loops also walk over heads, a few key heads per trip, so that each tile (heads · rows · S
logits) stays in cache: that, not the FLOP count, is what decides speed on XLA:CPU (a [B, H, T, S]
logits array that misses the cache costs more than the matmuls that make it). Memory is linear
in T and S for a fixed tile (the tile's rows shrink as S grows), and the backward (a
`jax.custom_vjp`) recomputes each tile from `out` and the log-sum-exp, like `flax_mha.chunked`.

Layout inside: units are (batch, key head) pairs; a tile is [U, R·Q, S] where the R query heads
that share a key head are rows of one matmul (GQA without repeating K/V). The backward works on
transposed tiles [U, S, R·Q] so that all five matmuls are products XLA:CPU runs without copying
an operand (sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ, dV += Pᵀ·dO, dK += dSᵀ·Q, dQᵀ = Kᵀ·dSᵀ).

Causal attention visits, per query block, only the keys up to the block's last row: query
blocks are grouped into at most MAX_SEGMENTS segments with a static key extent each (one block
per segment for up to MAX_SEGMENTS blocks), so causal costs about half of non-causal.

Takes query, key, value, `is_causal` and `scale`; a bias, a mask, dropout or the mask/score
options are refused by name (use "chunked" or "xla", which take everything).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from flax_mha import _common

# Logits per tile (units · rows · keys), forward and backward: the fastest of a sweep on a 2-core
# CPU in float32 (`python -m experiments.benchmark_blocks --rows` re-runs the sweep).
TILE_FORWARD = 2**21
TILE_FORWARD_CAUSAL = 2**19
TILE_BACKWARD = 2**18
CAUSAL_BLOCKS = 4  # causal: at least this many query blocks, so that few hidden keys are visited
MAX_SEGMENTS = 16  # causal: distinct static key extents (each one more loop in the program)
MIN_ROWS = 128  # query rows per block at least (up to T): skinnier products waste the matmul


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


def unsupported_reason(bias, mask, dropout_rate, mods) -> str | None:
  """Why "rows" can't run this call (None when it can)."""
  if bias is not None or mask is not None:
    return "it takes no bias or mask (is_causal only)"
  if dropout_rate > 0.0:
    return "it has no dropout"
  if mods is not None and (mods.masks or mods.scores):
    return ("it takes no windows, lengths, segment ids, soft-capping or mask/score functions "
            "(is_causal only)")
  return None


def _largest_divisor(n: int, at_most: int) -> int:
  return max(d for d in range(1, max(1, min(n, at_most)) + 1) if n % d == 0)


def plan(b, t, s, h, g, scale, is_causal, tile) -> _Plan:
  """Tile sizes for [B, T, H, ·] queries over [B, S, G, ·] keys within `tile` logits."""
  r = h // g
  bq = max(MIN_ROWS, min(t, tile // (r * s)))
  if is_causal:
    bq = max(MIN_ROWS, min(bq, -(-t // CAUSAL_BLOCKS)))
  bq = -(-t // -(-t // bq))  # even blocks: n_q blocks of at most bq rows, the padding < n_q
  n_q = -(-t // bq)
  units = _largest_divisor(b * g, max(1, tile // (r * bq * s)))
  if is_causal:
    n_seg = min(n_q, MAX_SEGMENTS)
    ends = [round((i + 1) * n_q / n_seg) for i in range(n_seg)]
    starts = [0] + ends[:-1]
    segments = tuple((a, e, min(s, e * bq)) for a, e in zip(starts, ends))
  else:
    segments = ((0, n_q, s),)
  return _Plan(float(scale), is_causal, t, s, units, b * g // units, bq, n_q, segments)


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


def _hidden(p: _Plan, block, extent: int, transposed: bool):
  """Causal: True where key > query, [1, Q, extent] (or [extent, 1, Q] when transposed) to
  broadcast over R; None when nothing is hidden."""
  if not p.is_causal or (isinstance(block, int) and block * p.bq >= extent - 1):
    return None
  rows = block * p.bq + jnp.arange(p.bq, dtype=jnp.int32)
  keys = jnp.arange(extent, dtype=jnp.int32)
  hidden = keys[None, :] > rows[:, None]  # [Q, extent]
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


def _mask_rows(x, hidden, r: int, fill, transposed: bool):
  """x [U, R·Q, E] (or [U, E, R·Q]) with hidden entries set to fill."""
  if hidden is None:
    return x
  u, a, c = x.shape
  if transposed:
    return jnp.where(hidden[None], fill, x.reshape(u, a, r, c // r)).reshape(x.shape)
  return jnp.where(hidden[None], fill, x.reshape(u, r, a // r, c)).reshape(x.shape)


def _forward(q, k, v, p: _Plan):
  """out [B, T, H, V] and lse [n_u, n_q, U, R·Q], in the softmax dtype."""
  b, _, h, _ = q.shape
  g = k.shape[2]
  r, acc = h // g, _common.softmax_dtype(q.dtype)
  q_units = _to_units(q * jnp.asarray(p.scale, q.dtype), g, p.n_u, p.n_q, p.bq)
  k_units, v_units = _kv_units(k, p.n_u), _kv_units(v, p.n_u)

  def unit_step(_, xs):
    q_u, k_u, v_u = xs

    def block(i, extent, carry, q_i):
      s = jnp.einsum("UQK,USK->UQS", q_i, k_u[:, :extent], preferred_element_type=acc)
      s = _mask_rows(s, _hidden(p, i, extent, False), r, -jnp.inf, False)
      m = jnp.max(s, axis=-1, keepdims=True)  # finite: every causal row sees key 0
      e = jnp.exp(s - m)
      l = jnp.sum(e, axis=-1, keepdims=True)
      o = jnp.einsum("UQS,USV->UQV", e.astype(v.dtype), v_u[:, :extent],
                     preferred_element_type=acc)
      return carry, (o / l, (m + jnp.log(l))[..., 0])

    return None, _over_blocks(p, block, None, q_u)[1]

  _, (out, lse) = lax.scan(unit_step, None, (q_units, k_units, v_units))
  return _from_units(out, b, g, p.t, p.bq), lse


def _backward(q, k, v, out, lse, dout, p: _Plan):
  """(dq, dk, dv) in the softmax dtype, given the output `out` [B, T, H, V] and the log-sum-exp
  `lse` (layout of `_forward` for plan p) of every key that the queries see, here or elsewhere:
  the gradient contribution of these keys."""
  b, _, h, _ = q.shape
  g = k.shape[2]
  r, acc = h // g, _common.softmax_dtype(q.dtype)
  delta = jnp.sum(dout.astype(acc) * out.astype(acc), axis=-1)  # [B, T, H]
  q_units = _to_units(q * jnp.asarray(p.scale, q.dtype), g, p.n_u, p.n_q, p.bq)
  do_units = _to_units(dout, g, p.n_u, p.n_q, p.bq)
  delta_units = _to_units(delta[..., None], g, p.n_u, p.n_q, p.bq)[..., 0]
  k_units, v_units = _kv_units(k, p.n_u), _kv_units(v, p.n_u)
  mm = functools.partial(jnp.einsum, preferred_element_type=acc)

  def unit_step(_, xs):
    q_u, do_u, lse_u, delta_u, k_u, v_u = xs
    kt_u = k_u.swapaxes(-1, -2)

    def block(i, extent, carry, x):
      dk, dv = carry
      q_i, do_i, lse_i, delta_i = x
      st = mm("USK,UQK->USQ", k_u[:, :extent], q_i)
      pt = jnp.exp(st - lse_i[:, None])
      pt = _mask_rows(pt, _hidden(p, i, extent, True), r, 0.0, True)
      dpt = mm("USV,UQV->USQ", v_u[:, :extent], do_i)
      dst = pt * (dpt - delta_i[:, None])
      dv_i = mm("USQ,UQV->USV", pt.astype(v.dtype), do_i)
      dk_i = mm("USQ,UQK->USK", dst.astype(q.dtype), q_i)
      dqt = mm("UKS,USQ->UKQ", kt_u[..., :extent], dst.astype(k.dtype)) * p.scale
      if extent == p.s:
        return (dk + dk_i, dv + dv_i), dqt
      return (dk.at[:, :extent].add(dk_i), dv.at[:, :extent].add(dv_i)), dqt

    zeros = (jnp.zeros(k_u.shape, acc), jnp.zeros(v_u.shape, acc))
    (dk, dv), dqt = _over_blocks(p, block, zeros, (q_u, do_u, lse_u, delta_u))
    return None, (dqt, dk, dv)

  _, (dqt, dk, dv) = lax.scan(unit_step, None, (q_units, do_units, lse, delta_units, k_units,
                                                v_units))
  dq = _from_units(dqt.swapaxes(-1, -2), b, g, p.t, p.bq)
  from_kv = lambda x: x.reshape(b, g, p.s, -1).transpose(0, 2, 1, 3)
  return dq, from_kv(dk), from_kv(dv)


def _lse_bth(lse, p: _Plan, b: int, g: int):
  """lse [n_u, n_q, U, R·Q] of plan p -> [B, T, H]."""
  return _from_units(lse[..., None], b, g, p.t, p.bq)[..., 0]


def _lse_units(lse_BTH, p: _Plan, g: int):
  """lse [B, T, H] -> [n_u, n_q, U, R·Q] of plan p."""
  return _to_units(lse_BTH[..., None], g, p.n_u, p.n_q, p.bq)[..., 0]


def _cast_grads(grads, q, k, v):
  return tuple(d.astype(x.dtype) for d, x in zip(grads, (q, k, v)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attention(q, k, v, p_fwd: _Plan, p_bwd: _Plan):
  return _forward(q, k, v, p_fwd)[0].astype(q.dtype)


def _attention_fwd(q, k, v, p_fwd, p_bwd):
  out, lse = _forward(q, k, v, p_fwd)
  out = out.astype(q.dtype)
  return out, (q, k, v, out, lse)


def _attention_bwd(p_fwd, p_bwd, residuals, dout):
  q, k, v, out, lse = residuals
  if (p_fwd.units, p_fwd.bq) != (p_bwd.units, p_bwd.bq):
    lse = _lse_units(_lse_bth(lse, p_fwd, q.shape[0], k.shape[2]), p_bwd, k.shape[2])
  return _cast_grads(_backward(q, k, v, out, lse, dout, p_bwd), q, k, v)


_attention.defvjp(_attention_fwd, _attention_bwd)


def make_attention(tile_forward: int | None = None, tile_backward: int = TILE_BACKWARD):
  """"rows" attention with the given tile budgets (logits per tile; tile_forward None:
  TILE_FORWARD, or TILE_FORWARD_CAUSAL when causal), with `reference.attention`'s signature."""
  for name, tile in (("tile_forward", tile_forward), ("tile_backward", tile_backward)):
    if not (isinstance(tile, int) and tile > 0) and (name, tile) != ("tile_forward", None):
      raise ValueError(f"{name} must be a positive int{' or None' * (name == 'tile_forward')}, "
                       f"got {tile!r}")

  def attention(query, key, value, bias, mask, *, is_causal, scale, dropout_rate, dropout_rng,
                mods=None):
    """softmax(Q·Kᵀ·scale, causal)·V in query-row blocks: [B, T, H, V], as
    `reference.attention`; a bias, mask, dropout or mods raise a ValueError."""
    del dropout_rng
    reason = unsupported_reason(bias, mask, dropout_rate, mods)
    if reason is not None:
      raise ValueError(f"implementation='rows' cannot run this call: {reason}. Use "
                       "implementation='chunked' or 'xla', which take every option")
    b, t, h, _ = query.shape
    s, g = key.shape[1:3]
    forward = tile_forward or (TILE_FORWARD_CAUSAL if is_causal else TILE_FORWARD)
    plans = [plan(b, t, s, h, g, scale, is_causal, tile) for tile in (forward, tile_backward)]
    return _common.without_forward_mode("rows", _attention, query, key, value, *plans)

  return attention


attention = make_attention()
