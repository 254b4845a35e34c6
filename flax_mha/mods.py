"""Mask and score functions over (b, h, q_idx, kv_idx): one mechanism for every kind of visibility.

Causality, sliding windows, sequence lengths, packed documents (segment ids), soft-capped logits
and FlexAttention-style user functions are each a term of one of two kinds:

- a mask term says which (b, h, q_idx, kv_idx) are visible (`visible`), and what it knows about
  a rectangular tile of the [T, S] matrix (`tile_map`): whether some entry of the tile may be
  visible (`maybe`) and whether every entry is (`full`). Tiles nobody may see are skipped; tiles
  everybody sees are computed without evaluating a mask. Terms that follow from static shapes
  (causal, windows, a `mask_mod` reading only indices) answer with NumPy arrays at trace time;
  data-dependent ones (lengths, segment ids, a `mask_mod` over traced arrays) answer with jnp
  arrays, computed cheaply at run time.
- a score term maps the logits (`score`): soft-capping, or a user's `score_mod`.

Index arguments are int32 arrays that broadcast against each other: b indexes the flattened
batch, h the query head, q_idx and kv_idx absolute positions (top-left aligned). Functions must
be elementwise over them, as in `torch.nn.attention.flex_attention`. Terms are pytrees: arrays
are leaves, functions and sizes static. A user's function is traced once on scalars
(`closure_convert`): the arrays it closes over become leaves too, so they travel as data through
custom VJPs, `lax.scan`, `jax.checkpoint` and `vmap`.

A score at -inf (from a -inf bias) stays hidden whatever the score terms do with it: `Mods.score`
hands them 0 there and puts -inf back, so a soft cap cannot turn it into -cap.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np


class Tiles(NamedTuple):
  """A tile grid over [T, S]: tile (i, j) holds query positions [q_lo[i], q_hi[i]) and key
  positions [kv_lo[j], kv_hi[j]) (absolute: offsets added; padding beyond T, S excluded)."""
  q_lo: Any   # [n_q, 1]
  q_hi: Any
  kv_lo: Any  # [1, n_k]
  kv_hi: Any
  bq: int
  bk: int
  t: int
  s: int
  q_offset: Any
  kv_offset: Any


def make_tiles(t: int, s: int, bq: int, bk: int, q_offset=0, kv_offset=0) -> Tiles:
  """NumPy bounds when the offsets are Python ints (tile maps known at trace time), else jnp."""
  n_q, n_k = -(-t // bq), -(-s // bk)
  q_lo, kv_lo = np.arange(n_q)[:, None] * bq, np.arange(n_k)[None, :] * bk
  q_hi, kv_hi = np.minimum(q_lo + bq, t), np.minimum(kv_lo + bk, s)
  static = isinstance(q_offset, int) and isinstance(kv_offset, int)
  shift = (lambda x, o: x + o) if static else (lambda x, o: jnp.asarray(x) + o)
  return Tiles(shift(q_lo, q_offset), shift(q_hi, q_offset), shift(kv_lo, kv_offset),
               shift(kv_hi, kv_offset), bq, bk, t, s, q_offset, kv_offset)


def _pytree(cls):
  """A frozen dataclass as a pytree; fields marked static=True are aux data (hashed)."""
  fields = dataclasses.fields(cls)
  return jax.tree_util.register_dataclass(
      cls, data_fields=[f.name for f in fields if not f.metadata.get("static")],
      meta_fields=[f.name for f in fields if f.metadata.get("static")])


def _static(**kwargs):
  return dataclasses.field(metadata={"static": True}, **kwargs)


@_pytree
@dataclasses.dataclass(frozen=True)
class Causal:
  """q_idx >= kv_idx (top-left aligned, as `is_causal`)."""

  def visible(self, b, h, q, kv):
    del b, h
    return q >= kv

  def tile_map(self, tl: Tiles):
    return tl.q_hi - 1 >= tl.kv_lo, tl.q_lo >= tl.kv_hi - 1


@_pytree
@dataclasses.dataclass(frozen=True)
class LocalWindow:
  """q_idx - left <= kv_idx <= q_idx + right (jax.nn's `local_window_size`), or kv_idx below
  `sink_tokens` (StreamingLLM: the first tokens stay visible to every query)."""
  left: int = _static()
  right: int = _static()
  sink_tokens: int = _static(default=0)

  def visible(self, b, h, q, kv):
    del b, h
    return in_window(q, kv, (self.left, self.right), self.sink_tokens)

  def tile_map(self, tl: Tiles):
    maybe = (tl.kv_hi - 1 >= tl.q_lo - self.left) & (tl.kv_lo <= tl.q_hi - 1 + self.right)
    full = (tl.kv_lo >= tl.q_hi - 1 - self.left) & (tl.kv_hi - 1 <= tl.q_lo + self.right)
    if self.sink_tokens:
      maybe, full = maybe | (tl.kv_lo < self.sink_tokens), full | (tl.kv_hi <= self.sink_tokens)
    return maybe, full


def in_window(q, kv, window, sink_tokens: int):
  """Positions kv within (left, right) of q, or among the first `sink_tokens`."""
  inside = (kv >= q - window[0]) & (kv <= q + window[1])
  return inside | (kv < sink_tokens) if sink_tokens else inside


@_pytree
@dataclasses.dataclass(frozen=True)
class SeqLengths:
  """q_idx < q_lengths[b] and kv_idx < kv_lengths[b] (either may be None)."""
  q_lengths: Any  # [B] int or None
  kv_lengths: Any

  def visible(self, b, h, q, kv):
    del h
    ok = True
    if self.q_lengths is not None:
      ok = q < self.q_lengths[b]
    if self.kv_lengths is not None:
      ok = ok & (kv < self.kv_lengths[b])
    return ok

  def tile_map(self, tl: Tiles):
    maybe = full = True
    for lengths, lo, hi in ((self.q_lengths, tl.q_lo, tl.q_hi),
                            (self.kv_lengths, tl.kv_lo, tl.kv_hi)):
      if lengths is not None:
        per_b = lengths[:, None, None]  # [B, 1, 1] against the [n_q, n_k] grid
        maybe = maybe & (lo[None] < per_b)
        full = full & (hi[None] <= per_b)
    return jnp.any(maybe, axis=0), jnp.all(full, axis=0)


@_pytree
@dataclasses.dataclass(frozen=True)
class Segments:
  """q_ids[b, q_idx] == kv_ids[b, kv_idx]: packed documents. Positions index the id arrays
  directly, so offsets must be 0 (sequence parallelism hands each device the ids of its own
  tokens: `flax_mha.parallel.seqmods`)."""
  q_ids: Any  # [B, T] int
  kv_ids: Any  # [B, S] int

  def visible(self, b, h, q, kv):
    del h
    return self.q_ids[b, q] == self.kv_ids[b, kv]

  def tile_map(self, tl: Tiles):
    """Per-tile min/max of the ids: disjoint ranges see nothing; one id on both sides sees all."""
    q_min, q_max = _tile_min_max(self.q_ids, tl.bq)  # [B, n_q, 1]
    kv_min, kv_max = _tile_min_max(self.kv_ids, tl.bk)
    kv_min, kv_max = kv_min.transpose(0, 2, 1), kv_max.transpose(0, 2, 1)  # [B, 1, n_k]
    maybe = (q_max >= kv_min) & (q_min <= kv_max)
    full = (q_min == q_max) & (kv_min == kv_max) & (q_min == kv_min)
    return jnp.any(maybe, axis=0), jnp.all(full, axis=0)


def _tile_min_max(ids_BL, block: int):
  """Min and max of ids [B, L] per block of `block` positions (edge-padded): [B, n, 1] each."""
  b, length = ids_BL.shape
  n = -(-length // block)
  tiles = jnp.pad(ids_BL, ((0, 0), (0, n * block - length)), mode="edge").reshape(b, n, block)
  return tiles.min(axis=-1, keepdims=True), tiles.max(axis=-1, keepdims=True)


def closure_convert(fn, *examples):
  """(converted, consts, reads): `fn` traced once on the scalar `examples`, as
  `converted(*args, *consts)` applied elementwise over broadcasting args, the arrays it closes
  over made explicit `consts` (leaves, not hidden state: traced ones survive scan, remat and
  custom VJPs), and `reads`, the positions of the arguments its result depends on."""
  # Traced outside any mesh context and with jnp's inner jits inlined: a jaxpr (and a nested
  # jit's parameters) remember the context mesh of their trace, and this one is evaluated
  # wherever the caller runs, inside shard_map too.
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())), jax.disable_jit():
    closed = jax.make_jaxpr(fn)(*examples)
  jaxpr = closed.jaxpr
  converted = functools.partial(_elementwise, jaxpr, tuple(v.aval.dtype for v in jaxpr.invars))
  return converted, tuple(closed.consts), _reads(jaxpr)


def _elementwise(jaxpr, dtypes, *args):
  """The scalar `jaxpr` over the broadcast of its inputs (the first len(dtypes) args; the rest
  are its consts)."""
  inputs, consts = args[:len(dtypes)], args[len(dtypes):]
  one = lambda *xs: jax.core.eval_jaxpr(jaxpr, consts, *xs)[0]
  return jnp.vectorize(one)(*(jnp.asarray(x, d) for x, d in zip(inputs, dtypes)))


def _reads(jaxpr) -> frozenset:
  """Positions of the inputs that the (first) output of `jaxpr` depends on."""
  deps = {v: {i} for i, v in enumerate(jaxpr.invars)}
  for eqn in jaxpr.eqns:
    used = set().union(*(deps.get(v, set()) for v in eqn.invars
                         if not isinstance(v, jex.Literal)))
    deps.update((v, used) for v in eqn.outvars)
  out = jaxpr.outvars[0]
  return frozenset(() if isinstance(out, jex.Literal) else deps.get(out, ()))


@_pytree
@dataclasses.dataclass(frozen=True)
class Positions:
  """Visibility by absolute token positions rather than by index: query b, i at q_pos[b, i]
  sees key b, j at kv_pos[b, j] when both are >= 0 (a negative position is padding or an
  empty cache slot: it sees and is seen by nothing), and, with `causal`, kv_pos <= q_pos, and
  with a window, q_pos - left <= kv_pos <= q_pos + right. What `is_causal` and
  `local_window_size` mean when a call gives positions (a KV cache, a rolling buffer, pages).
  Like `Segments`, indices address the arrays directly (offsets must be 0)."""
  q_pos: Any  # [B, T] int
  kv_pos: Any  # [B, S] int
  causal: bool = _static(default=False)
  window: tuple | None = _static(default=None)  # (left, right)
  sink_tokens: int = _static(default=0)  # with a window: positions below it stay visible

  def visible(self, b, h, q, kv):
    del h
    return self.visible_at(self.q_pos[b, q], self.kv_pos[b, kv])

  def visible_at(self, q, kv):
    """Visibility of keys at positions kv from queries at positions q (int arrays)."""
    ok = (q >= 0) & (kv >= 0)
    if self.causal:
      ok = ok & (kv <= q)
    if self.window is not None:
      ok = ok & in_window(q, kv, self.window, self.sink_tokens)
    return ok

  def tile_map(self, tl: Tiles):
    """From each tile's valid position range: nothing valid or out of reach sees nothing;
    everything valid and in reach sees everything."""
    (q_lo, q_hi, q_all), (kv_lo, kv_hi, kv_all) = (
        _valid_range(self.q_pos, tl.bq), _valid_range(self.kv_pos, tl.bk))
    kv_lo, kv_hi, kv_all = (x.transpose(0, 2, 1) for x in (kv_lo, kv_hi, kv_all))
    maybe = (q_hi >= 0) & (kv_hi >= 0)  # some valid entry on each side
    full = q_all & kv_all
    if self.causal:
      maybe, full = maybe & (kv_lo <= q_hi), full & (kv_hi <= q_lo)
    if self.window is not None:
      left, right = self.window
      near_maybe = (kv_hi >= q_lo - left) & (kv_lo <= q_hi + right)
      near_full = (kv_lo >= q_hi - left) & (kv_hi <= q_lo + right)
      if self.sink_tokens:
        near_maybe = near_maybe | (kv_lo < self.sink_tokens)
        near_full = near_full | (kv_hi < self.sink_tokens)
      maybe, full = maybe & near_maybe, full & near_full
    return jnp.any(maybe, axis=0), jnp.all(full, axis=0)


def _valid_range(pos_BL, block: int):
  """Per block of `block` positions of pos [B, L]: (min, max) of the valid (>= 0) positions
  (max -1 where none is valid) and whether all are valid, each [B, n, 1]."""
  b, length = pos_BL.shape
  n = -(-length // block)
  tiles = jnp.pad(pos_BL, ((0, 0), (0, n * block - length)), constant_values=-1)
  tiles = tiles.reshape(b, n, block)
  valid = tiles >= 0
  big = jnp.iinfo(tiles.dtype).max
  lo = jnp.where(valid, tiles, big).min(axis=-1, keepdims=True)
  hi = tiles.max(axis=-1, keepdims=True)
  # Padding beyond L is not a position of this array: a partly padded last block is "all
  # valid" when its real entries are (the kernel masks padded keys itself).
  real = (jnp.arange(n * block) < length).reshape(1, n, block)
  return lo, hi, jnp.all(valid | ~real, axis=-1, keepdims=True)


@_pytree
@dataclasses.dataclass(frozen=True)
class MaskMod:
  """A user's `mask_mod(b, h, q_idx, kv_idx) -> bool`, as `fn(b, h, q, kv, *consts)`.

  `consts` are the arrays it closes over (see `closure_convert`); `sizes` = (B, H) where the
  function reads b / h, 1 where it ignores them: the extent over which its tile map is
  evaluated.
  """
  fn: Callable = _static()  # fn(b, h, q, kv, *consts)
  sizes: tuple = _static(default=(1, 1))
  consts: tuple = ()

  def visible(self, b, h, q, kv):
    return self.fn(b, h, q, kv, *self.consts)

  def tile_map(self, tl: Tiles):
    """The function on every real (q, kv), one row of tiles at a time, reduced per tile: at
    trace time when it reads only indices, at run time when it reads traced arrays."""
    concrete = not any(isinstance(c, jax.core.Tracer) for c in self.consts)
    if concrete and isinstance(tl.q_offset, int) and isinstance(tl.kv_offset, int):
      with jax.ensure_compile_time_eval():
        maybe, full = self._reduce(tl)
      if not isinstance(maybe, jax.core.Tracer):
        return np.asarray(maybe), np.asarray(full)
    return self._reduce(tl)

  def _reduce(self, tl: Tiles):
    n_q, n_k = tl.q_lo.shape[0], tl.kv_lo.shape[1]
    b = jnp.arange(self.sizes[0]).reshape(-1, 1, 1, 1)
    h = jnp.arange(self.sizes[1]).reshape(1, -1, 1, 1)
    kv_pos = jnp.arange(n_k * tl.bk)
    kv = (kv_pos + tl.kv_offset).reshape(1, 1, 1, -1)
    kv_real = (kv_pos < tl.s).reshape(n_k, tl.bk)

    def row(i):
      q_pos = i * tl.bq + jnp.arange(tl.bq)
      q = (q_pos + tl.q_offset).reshape(1, 1, -1, 1)
      v = jnp.broadcast_to(self.visible(b, h, q, kv), (*self.sizes, tl.bq, n_k * tl.bk))
      v = v.reshape(*self.sizes, tl.bq, n_k, tl.bk)
      real = (q_pos < tl.t)[:, None, None] & kv_real  # [bq, n_k, bk]
      return jnp.any(v & real, axis=(0, 1, 2, 4)), jnp.all(v | ~real, axis=(0, 1, 2, 4))

    return jax.lax.map(row, jnp.arange(n_q))


@_pytree
@dataclasses.dataclass(frozen=True)
class SoftCap:
  """cap · tanh(score / cap) (Gemma 2)."""
  cap: float = _static()

  def score(self, s, b, h, q, kv):
    del b, h, q, kv
    return self.cap * jnp.tanh(s / self.cap)


@_pytree
@dataclasses.dataclass(frozen=True)
class ScoreMod:
  """A user's `score_mod(score, b, h, q_idx, kv_idx) -> score`, as `fn(s, b, h, q, kv,
  *consts)`; the arrays it closes over are `consts` (see `closure_convert`), so the floating
  ones get gradients (e.g. a learned relative-position table)."""
  fn: Callable = _static()  # fn(s, b, h, q, kv, *consts)
  consts: tuple = ()

  def score(self, s, b, h, q, kv):
    return self.fn(s, b, h, q, kv, *self.consts).astype(s.dtype)


@_pytree
@dataclasses.dataclass(frozen=True)
class Mods:
  """Everything beyond the dense `mask` and `bias`: mask terms (ANDed), score terms (applied
  in order to `scale · Q·Kᵀ + bias`, before masking) and attention sinks: one logit per query
  head [H] that joins every row's softmax without a value (no score term touches it)."""
  masks: tuple = ()
  scores: tuple = ()
  sinks: Any = None  # [H] floating, or None

  def visible(self, b, h, q, kv):
    """AND of the mask terms (None when there are none)."""
    out = None
    for term in self.masks:
      v = term.visible(b, h, q, kv)
      out = v if out is None else out & v
    return out

  def score(self, s, b, h, q, kv):
    """The score terms applied in order; entries at -inf stay at -inf (hidden)."""
    if not self.scores:
      return s
    hidden = s == -jnp.inf
    out = jnp.where(hidden, 0.0, s).astype(s.dtype)  # a finite stand-in: no NaN in any term
    for term in self.scores:
      out = term.score(out, b, h, q, kv)
    return jnp.where(hidden, -jnp.inf, out)

  def tile_map(self, tl: Tiles):
    """(maybe, full) [n_q, n_k] of all mask terms together (NumPy when all are static)."""
    n_q, n_k = tl.q_lo.shape[0], tl.kv_lo.shape[1]
    maybe, full = np.ones((n_q, n_k), bool), np.ones((n_q, n_k), bool)
    for term in self.masks:
      m, f = term.tile_map(tl)
      maybe, full = maybe & m, full & f
    return maybe, full


def narrowest_window(mods: Mods | None) -> int | None:
  """Keys the narrowest window of `mods` spans (left + right + 1), or None without one."""
  spans = [t.left + t.right + 1 for t in (mods.masks if mods else ())
           if isinstance(t, LocalWindow)]
  spans += [t.window[0] + t.window[1] + 1 for t in (mods.masks if mods else ())
            if isinstance(t, Positions) and t.window is not None]
  return min(spans, default=None)


def with_causal(mods: Mods | None, is_causal: bool) -> Mods:
  """`mods` (or none) with the causal term added when `is_causal`."""
  mods = Mods() if mods is None else mods
  return dataclasses.replace(mods, masks=(Causal(), *mods.masks)) if is_causal else mods


def index_grid(b: int, h: int, t: int, s: int):
  """Broadcastable (b, h, q, kv) int32 index arrays over a whole [B, H, T, S] matrix."""
  ar = lambda n: jnp.arange(n, dtype=jnp.int32)
  return (ar(b).reshape(-1, 1, 1, 1), ar(h).reshape(1, -1, 1, 1), ar(t).reshape(1, 1, -1, 1),
          ar(s).reshape(1, 1, 1, -1))


def dense(logits_BHTS, mask, mods: Mods):
  """The whole matrix's scores and visibility: (mods' scores of `logits`, mask AND mods' masks
  as a boolean broadcasting to [B, H, T, S], or None when everything is visible)."""
  idx = index_grid(*logits_BHTS.shape)
  visible = mods.visible(*idx)
  if mask is not None:
    visible = mask if visible is None else mask & visible
  return mods.score(logits_BHTS, *idx), visible
