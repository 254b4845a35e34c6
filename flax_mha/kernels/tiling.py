"""Tiles of the [T, S] logits for `flax_mha.kernels.chunked`: block layouts, tile slices of masks and
biases, and which tiles to visit.

Block letters (beside the dimension key): Q the rows of a query tile (block_q = bq), P the
columns of a key tile (block_k = bk); n_q, n_k count the tiles.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax


class Tiling(NamedTuple):
  """Static sizes: real lengths, block sizes and block counts (padded length = n · block)."""
  t: int
  s: int
  bq: int
  bk: int
  n_q: int
  n_k: int


def tiling(t: int, s: int, block_q: int, block_k: int) -> Tiling:
  bq, bk = min(block_q, t), min(block_k, s)
  return Tiling(t, s, bq, bk, -(-t // bq), -(-s // bk))


def blocks(x_BLHK, n: int, size: int, groups: int, transpose: bool = False):
  """[B, L, H, K] -> [n, B, G, R, size, K] (or [n, B, G, K, R, size]), zero-padding L to n·size.

  H = G·R is split so that the R query heads sharing a key head sit next to the rows they add to
  a matmul; with `transpose` the feature dim comes first, for matmuls that contract over rows.
  """
  b, length, h, k = x_BLHK.shape
  x_BLHK = jnp.pad(x_BLHK, ((0, 0), (0, n * size - length), (0, 0), (0, 0)))
  x = x_BLHK.reshape(b, n, size, groups, h // groups, k)
  return x.transpose((1, 0, 3, 5, 4, 2) if transpose else (1, 0, 3, 4, 2, 5))


def unblock(x_nBGRQV, length: int, transposed: bool = False):
  """Inverse of `blocks`: [n, B, G, R, size, V] (or [n, B, G, V, R, size]) -> [B, length, H, V]."""
  x = x_nBGRQV.transpose((1, 0, 5, 2, 4, 3) if transposed else (1, 0, 4, 2, 3, 5))
  b, n, size, g, r, v = x.shape
  return x.reshape(b, n * size, g * r, v)[:, :length]


def pad_tiles(x, tl: Tiling, fill_t, fill_s):
  """Pad a rank-4 mask/bias's full T and S dims (not the broadcast 1s) to block multiples."""
  if x is None:
    return None
  if x.shape[2] > 1:
    x = jnp.pad(x, ((0, 0), (0, 0), (0, tl.n_q * tl.bq - tl.t), (0, 0)), constant_values=fill_t)
  if x.shape[3] > 1:
    x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, tl.n_k * tl.bk - tl.s)), constant_values=fill_s)
  return x


def tile_index(x, i, j, tl: Tiling):
  """Start indices and sizes of tile (i, j) of a padded rank-4 mask/bias (broadcast dims stay 1)."""
  full_t, full_s = x.shape[2] > 1, x.shape[3] > 1
  i32 = lambda n: jnp.asarray(n, jnp.int32)  # one index dtype, also under jax_enable_x64
  starts = (i32(0), i32(0), i32(i * tl.bq if full_t else 0), i32(j * tl.bk if full_s else 0))
  sizes = (*x.shape[:2], tl.bq if full_t else 1, tl.bk if full_s else 1)
  return starts, sizes


def as_layout(x_BHQP, groups: int, transposed: bool):
  """A [b, h, q, p] tile (h = H or 1) as [b, G, R, q, p], or [b, G, p, R, q] when transposed."""
  b, h, q, p = x_BHQP.shape
  x = x_BHQP.reshape(b, groups, h // groups, q, p) if h > 1 else x_BHQP[:, :, None]
  return x.transpose(0, 1, 4, 2, 3) if transposed else x


def tile(x, i, j, tl: Tiling, groups: int, transposed: bool):
  """Tile (i, j) of a padded rank-4 mask/bias in the kernel's layout (None stays None)."""
  if x is None:
    return None
  return as_layout(lax.dynamic_slice(x, *tile_index(x, i, j, tl)), groups, transposed)


def dense_mask_map(mask, tl: Tiling):
  """(maybe, full) [n_q, n_k] of a padded boolean rank-4 mask: any / all of each tile."""
  def split(x, axis, n, size):
    if x.shape[axis] == 1:
      return jnp.expand_dims(x, axis)  # broadcast dim: one "tile" of size 1
    return x.reshape(*x.shape[:axis], n, size, *x.shape[axis + 1:])
  x = split(split(mask, 3, tl.n_k, tl.bk), 2, tl.n_q, tl.bq)  # [b, h, n_q|1, bq|1, n_k|1, bk|1]
  grid = (tl.n_q, tl.n_k)
  maybe = jnp.broadcast_to(jnp.any(x, axis=(0, 1, 3, 5)), grid)
  full = jnp.broadcast_to(jnp.all(x, axis=(0, 1, 3, 5)), grid)
  return maybe, full


class Visits(NamedTuple):
  """Per row of the tile grid: the columns to visit without a mask (`full`) and with one
  (`partial`), first `count` entries of each index row. NumPy when known at trace time."""
  full_idx: object
  full_count: object
  partial_idx: object
  partial_count: object


def visits(maybe, full) -> Visits:
  """From (maybe, full) [rows, cols]: each row's full columns, then its partial ones."""
  xp = np if isinstance(maybe, np.ndarray) and isinstance(full, np.ndarray) else jnp
  partial = maybe & ~full
  order = lambda m: xp.argsort(~m, axis=1, stable=True).astype(np.int32)
  count = lambda m: m.sum(axis=1).astype(np.int32)
  return Visits(order(full), count(full), order(partial), count(partial))


def loop(idx, count, row, body, carry):
  """carry = body(col, carry) for the first count[row] columns col of idx[row]."""
  if isinstance(count, np.ndarray):
    if not count.any():
      return carry
    if (count == count[0]).all() and (idx == np.arange(idx.shape[1])).all():
      return lax.fori_loop(0, int(count[0]), body, carry)  # every column, in order: static
  idx_row = jnp.asarray(idx)[row]
  return lax.fori_loop(0, jnp.asarray(count)[row], lambda n, c: body(idx_row[n], c), carry)
