"""Mask and score terms under sequence parallelism: what each array is split along, and the
terms a device evaluates on its local tokens.

A device of a sequence-parallel strategy holds some query rows and some key rows in an order of
the layout's (`flax_mha.parallel.layouts`), not necessarily contiguous. Its local problem is an
ordinary call of the chunked kernel with offsets 0, made exact by `localize`: every term that
reads an index as a position (causality, windows, lengths, `mask_mod`, `score_mod`) is rewritten
to read the tokens' TRUE positions `q_pos`, `kv_pos` instead, and every term that indexes arrays
by token (segment ids, `Positions`) gets those arrays permuted and split like the tokens (`sides`
says which leaf goes where). Positions keep the tile maps cheap: a tile's range of positions
bounds what it sees, so a layout's fully hidden tiles are skipped like contiguous ones.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

from flax_mha import mods as mods_lib
from flax_mha.parallel import layouts

# What a leaf of `Mods` is split along: the query's tokens [B, T], the keys' [B, S], the batch
# [B], the query heads [H] (sinks), or nothing (a mod's closed-over arrays: replicated).
Q, KV, BATCH, HEADS, REPLICATED = "q", "kv", "batch", "heads", "replicated"


def sides(mods: mods_lib.Mods) -> list[str]:
  """One of Q, KV, BATCH, HEADS, REPLICATED per leaf of `mods`, in `jax.tree.leaves` order."""
  def term_sides(term):
    if isinstance(term, (mods_lib.Segments, mods_lib.Positions)):
      return [Q, KV]  # fields (q_ids, kv_ids) / (q_pos, kv_pos), both present
    if isinstance(term, mods_lib.SeqLengths):
      return [BATCH] * len(jax.tree.leaves(term))
    return [REPLICATED] * len(jax.tree.leaves(term))
  out = [side for term in (*mods.masks, *mods.scores) for side in term_sides(term)]
  return out + ([HEADS] if mods.sinks is not None else [])


@dataclasses.dataclass(frozen=True)
class _AtPositions:
  """A user's mask/score function called at true positions and global heads: the local
  indices q, kv look up `q_pos`, `kv_pos` and h is shifted by `h_offset` (its first consts)."""
  fn: Callable
  with_score: bool

  def __call__(self, *args):
    n = 5 if self.with_score else 4
    (*lead, h, q, kv), (q_pos, kv_pos, h_offset, *consts) = args[:n], args[n:]
    return self.fn(*lead, h + h_offset, q_pos[q], kv_pos[kv], *consts)


def localize(mods: mods_lib.Mods | None, is_causal: bool, q_pos, kv_pos, *, batch: int,
             heads: int, h_offset=0) -> mods_lib.Mods:
  """The terms of a local call over query rows at true positions q_pos [T'] and key rows at
  kv_pos [S'] (int32, possibly traced), offsets 0: `is_causal` and the index-reading terms
  rewritten over positions. `batch` and `heads` are the local B and H (a mask_mod's extents);
  h_offset the global index of local head 0."""
  mods = mods_lib.Mods() if mods is None else mods
  q_BT = jnp.broadcast_to(q_pos, (batch, q_pos.shape[0]))
  kv_BS = jnp.broadcast_to(kv_pos, (batch, kv_pos.shape[0]))
  at = lambda **kw: mods_lib.Positions(q_BT, kv_BS, **kw)
  masks = [at(causal=True)] if is_causal else []
  for term in mods.masks:
    if isinstance(term, mods_lib.Causal):
      masks.append(at(causal=True))
    elif isinstance(term, mods_lib.LocalWindow):
      masks.append(at(window=(term.left, term.right), sink_tokens=term.sink_tokens))
    elif isinstance(term, mods_lib.SeqLengths):
      hide = lambda pos, lengths: pos if lengths is None else jnp.where(
          pos < lengths[:, None], pos, -1)  # a negative position sees and is seen by nothing
      masks.append(mods_lib.Positions(hide(q_BT, term.q_lengths), hide(kv_BS, term.kv_lengths)))
    elif isinstance(term, mods_lib.MaskMod):
      sizes = (batch if term.sizes[0] > 1 else 1, heads if term.sizes[1] > 1 else 1)
      consts = (q_pos, kv_pos, jnp.asarray(h_offset, jnp.int32), *term.consts)
      masks.append(mods_lib.MaskMod(_AtPositions(term.fn, False), sizes, consts))
    else:  # Segments, Positions: their arrays are already the local tokens'
      masks.append(term)
  scores = []
  for term in mods.scores:
    if isinstance(term, mods_lib.ScoreMod):
      consts = (q_pos, kv_pos, jnp.asarray(h_offset, jnp.int32), *term.consts)
      term = mods_lib.ScoreMod(_AtPositions(term.fn, True), consts)
    scores.append(term)
  return mods_lib.Mods(tuple(masks), tuple(scores), mods.sinks)


def reads_batch_or_heads(mods: mods_lib.Mods | None) -> tuple[bool, bool]:
  """Whether a user's function of `mods` reads b, and whether one reads h (a score_mod is
  assumed to read both: its dependencies are not tracked)."""
  if mods is None:
    return False, False
  mask_mods = [t for t in mods.masks if isinstance(t, mods_lib.MaskMod)]
  score = any(isinstance(t, mods_lib.ScoreMod) for t in mods.scores)
  return (score or any(t.sizes[0] > 1 for t in mask_mods),
          score or any(t.sizes[1] > 1 for t in mask_mods))


def has_float_score_consts(mods: mods_lib.Mods | None) -> bool:
  """Whether a score term closes over floating arrays (that get gradients)."""
  return mods is not None and any(jnp.issubdtype(jnp.result_type(x), jnp.inexact)
                                  for x in jax.tree.leaves(mods.scores))


def block(layout: str, local_length: int) -> int:
  """The ring's tile size for a shard of `local_length` tokens: one that no layout chunk
  boundary cuts (zigzag holds two chunks), where one of at least 128 exists, so that tiles have
  tight position ranges."""
  chunk = local_length // 2 if layout == "zigzag" else local_length
  size = math.gcd(512, chunk)
  return size if size >= 128 else min(512, chunk)


@dataclasses.dataclass(frozen=True)
class Plan:
  """The static facts of one sequence-parallel call that every device's local function needs
  (hashable: a custom_vjp's non-differentiable argument)."""
  axis_name: str
  n: int  # devices on axis_name
  layout: str
  t: int  # global T
  s: int  # global S
  is_causal: bool
  scale: float
  treedef: jax.tree_util.PyTreeDef  # of the Mods (its leaves travel as a list)
  sides: tuple  # one of Q, KV, BATCH, HEADS, REPLICATED per leaf

  def positions(self, length: int, device):
    """True positions [length / n] of `device`'s tokens (an int or traced index)."""
    return jnp.asarray(layouts.order(self.layout, length, self.n))[device]

  def all_positions(self, length: int):
    """True positions [length] of the tokens in device-major order (what an all-gather holds)."""
    return jnp.asarray(layouts.order(self.layout, length, self.n).reshape(-1))

  def block(self, local_length: int) -> int:
    return block(self.layout, local_length)

  def mods(self, leaves) -> mods_lib.Mods:
    return jax.tree.unflatten(self.treedef, leaves)

  def replace_side(self, leaves, side: str, new):
    """`leaves` with those of `side` replaced, in order, by `new`."""
    it = iter(new)
    return [next(it) if s == side else x for x, s in zip(leaves, self.sides)]

  def of_side(self, leaves, side: str) -> list:
    return [x for x, s in zip(leaves, self.sides) if s == side]
