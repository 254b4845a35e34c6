"""Token layouts of sequence parallelism: which tokens each of n devices holds.

A layout of a sequence of L tokens over n devices is a table `order` [n, L/n]: row d lists, in
local order, the (global) indices of the tokens device d holds. Flattened, it is the permutation
applied to the sequence before it is split into n equal shards, and undone at the output.

- "contiguous": device d holds tokens d·L/n .. (d+1)·L/n - 1. Causal work is unbalanced: the
  first device sees one shard of keys, the last n.
- "zigzag": the sequence is cut into 2n chunks and device d holds chunks d and 2n-1-d (an early
  and a late one: maxtext's dual-chunk swap, Brandon et al.'s zig-zag). Needs L divisible by 2n.
- "striped": token t lives on device t mod n (Brandon et al., 2023, "Striped Attention").

Every layout computes the same function: the kernels compare the tokens' true positions
(`flax_mha.parallel.seqmods`), so causality, windows and lengths hold whatever the order.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax

LAYOUTS = ("contiguous", "zigzag", "striped")


def check_layout(layout) -> str:
  if not isinstance(layout, str) or layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  return layout


def multiple(layout: str, n: int) -> int:
  """What a sequence length must be a multiple of under `layout` on n devices."""
  return 2 * n if layout == "zigzag" else n


@functools.lru_cache(maxsize=64)
def order(layout: str, length: int, n: int) -> np.ndarray:
  """[n, length // n] int32: row d the global indices of device d's tokens, in local order."""
  check_layout(layout)
  if length % multiple(layout, n):
    raise ValueError(f"layout={layout!r} on {n} devices needs a length that is a multiple of "
                     f"{multiple(layout, n)}, got {length}")
  tokens = np.arange(length, dtype=np.int32)
  if layout == "contiguous":
    table = tokens.reshape(n, length // n)
  elif layout == "striped":
    table = tokens.reshape(length // n, n).T
  else:  # zigzag: chunks d and 2n-1-d
    chunks = tokens.reshape(2 * n, length // (2 * n))
    table = np.concatenate([chunks[:n], chunks[::-1][:n]], axis=1)
  table = np.ascontiguousarray(table)
  table.flags.writeable = False  # cached: shared by every caller
  return table


def permutation(layout: str, length: int, n: int) -> np.ndarray | None:
  """The flat order [length] (None for contiguous: nothing to move)."""
  return None if layout == "contiguous" else order(layout, length, n).reshape(-1)


def inverse(perm: np.ndarray | None) -> np.ndarray | None:
  """The permutation that undoes `perm`."""
  return None if perm is None else np.argsort(perm).astype(np.int32)


def to_layout(x, layout: str, axis_name: str, n: int, axis: int):
  """Inside shard_map: this device's contiguous shard of x along `axis` -> its tokens under
  `layout`, by one collective each way (zigzag: two `ppermute`s of half shards; striped: one
  `all_to_all`, or an all-gather where the shard is not a multiple of n)."""
  if layout == "contiguous" or x.shape[axis] == 1:
    return x
  me = lax.axis_index(axis_name)
  if layout == "zigzag":
    first, second = jnp.split(x, 2, axis=axis)  # chunks 2d and 2d + 1
    a, b = (lax.ppermute(half, axis_name, _zigzag_perm(n, odd))
            for half, odd in ((first, 0), (second, 1)))
    # Device e's chunk e arrived with the chunks of e's parity.
    return jnp.where(me % 2 == 0, jnp.concatenate([a, b], axis), jnp.concatenate([b, a], axis))
  length = x.shape[axis]
  if length % n:
    full = lax.all_gather(x, axis_name, axis=axis, tiled=True)
    return jnp.take(full, jnp.asarray(order(layout, length * n, n))[me], axis=axis)
  split = x.reshape(*x.shape[:axis], length // n, n, *x.shape[axis + 1:])  # [.., row, residue]
  out = lax.all_to_all(split, axis_name, axis + 1, axis, tiled=True)  # [.., source·row, 1]
  return out.reshape(x.shape)


def from_layout(x, layout: str, axis_name: str, n: int, axis: int):
  """The inverse of `to_layout`: this device's tokens under `layout` -> its contiguous shard."""
  if layout == "contiguous" or x.shape[axis] == 1:
    return x
  me = lax.axis_index(axis_name)
  if layout == "zigzag":
    first, second = jnp.split(x, 2, axis=axis)
    even = me % 2 == 0
    a, b = jnp.where(even, first, second), jnp.where(even, second, first)
    back = lambda half, odd: lax.ppermute(half, axis_name,
                                          [(dst, src) for src, dst in _zigzag_perm(n, odd)])
    return jnp.concatenate([back(a, 0), back(b, 1)], axis)
  length = x.shape[axis]
  if length % n:
    full = lax.all_gather(x, axis_name, axis=axis, tiled=True)  # tokens in layout order
    where = inverse(order(layout, length * n, n).reshape(-1))
    return jnp.take(full, jnp.asarray(where.reshape(n, length))[me], axis=axis)
  split = x.reshape(*x.shape[:axis], length, 1, *x.shape[axis + 1:])  # [.., source·row, 1]
  out = lax.all_to_all(split, axis_name, axis, axis + 1, tiled=True)  # [.., row, residue]
  return out.reshape(x.shape)


def _zigzag_perm(n: int, odd: int) -> list[tuple[int, int]]:
  """Where chunk 2d + odd of device d lives under zigzag: (d, its device)."""
  home = lambda c: c if c < n else 2 * n - 1 - c
  return [(d, home(2 * d + odd)) for d in range(n)]
