"""The Pallas kernels behind `flax_mha.kernels.triton`: a flash-attention forward and its two
backward passes (dQ, dK/dV), written for Pallas' Triton backend (NVIDIA GPUs) and run on any
platform in Pallas interpret mode.

Every kernel sees one (batch, head) and one block of rows; it recomputes a tile's scores with
`_Tile`, which holds everything that decides a score and its visibility:

  scores = score terms(scale · q·kᵀ + bias)          visible = every mask term, and score > -inf

The mask terms are evaluated in the kernel from indices and per-token int32 arrays: top-left
causality and windows on indices (they also bound each row block's loop over key blocks, so
hidden tiles are never visited), segment ids (lengths folded in), sets of positions, each with
its own causality and window, and `mask_mod`s of indices (b, h, q, kv) alone. Score terms (a soft
cap, `score_mod`s of indices) run in the kernel too; the backward takes their derivative with
`jax.jvp`. The block sizes are powers of two, at least 16 (Triton's dot); the caller pads T, S,
K and V to them (`Spec`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flax_mha import mods as mods_lib

LOWEST = float(jnp.finfo(jnp.float32).min)


@dataclasses.dataclass(frozen=True)
class Spec:
  """The static facts of one call: every kernel's configuration (hashable)."""
  t: int  # real query rows (the padded ones are dropped)
  s: int  # real keys (the padded ones are hidden)
  bq: int  # query rows per block
  bk: int  # keys per block
  rep: int  # H // G: query head h reads key/value head h // rep
  scale: float
  causal: bool  # top-left, on indices
  windows: tuple  # ((left, right, sink_tokens), ...) on indices
  positions: tuple  # (causal, window, sink_tokens) of each Positions term
  segmented: bool  # segment ids (and lengths, folded into them) are given
  bias: tuple | None  # (varies over B, varies over H) of the additive bias, or None
  bias_grad: bool  # whether the bias needs its gradient
  mask_mods: tuple  # index-only mods.MaskMod terms
  scores: tuple  # score terms: mods.SoftCap, index-only mods.ScoreMod
  interpret: bool
  num_warps: int = 4
  num_stages: int = 2

  def params(self):
    return plgpu.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)

  def kv_range(self, i, nk: int):
    """Key blocks [lo, hi) that query block i can see through the index terms."""
    lo, hi = _i32(0), _i32(nk)
    row_lo, row_end = i * self.bq, (i + 1) * self.bq
    if self.causal:
      hi = jnp.minimum(hi, ceil_div(row_end, self.bk))
    for left, right, sink_tokens in self.windows:  # keys below sink_tokens: seen by every row
      hi = jnp.minimum(hi, ceil_div(jnp.maximum(row_end + right, sink_tokens), self.bk))
      if not sink_tokens:
        lo = jnp.maximum(lo, _div(jnp.maximum(row_lo - left, 0), self.bk))
    return lo, hi

  def q_range(self, j, nq: int):
    """Query blocks [lo, hi) that can see key block j through the index terms."""
    lo, hi = _i32(0), _i32(nq)
    key_lo, key_end = j * self.bk, (j + 1) * self.bk
    if self.causal:
      lo = jnp.maximum(lo, _div(key_lo, self.bq))
    for left, right, sink_tokens in self.windows:
      first = _div(jnp.maximum(key_lo - right, 0), self.bq)
      lo = jnp.maximum(lo, jnp.where(key_lo < sink_tokens, 0, first))
      if not sink_tokens:
        hi = jnp.minimum(hi, ceil_div(key_end + left, self.bq))
    return lo, hi


def _i32(x):
  return jnp.asarray(x, jnp.int32)


def _div(a, n: int):
  """a // n for non-negative int32 `a` (a program id's arithmetic: no Python floor division)."""
  return lax.div(_i32(a), _i32(n))


def ceil_div(a, n: int):
  """ceil(a / n) of int32 scalars inside a kernel."""
  return _div(_i32(a) + (n - 1), n)


@dataclasses.dataclass(frozen=True)
class _Tile:
  """What one kernel instance reads besides Q, K, V: its (b, h), and its refs of bias, ids and
  positions (None / () when absent), each covering the block's rows or keys or all of them."""
  spec: Spec
  b: jax.Array
  h: jax.Array
  bias: object
  q_ids: object
  kv_ids: object
  positions: tuple  # ((q_pos, kv_pos) refs, ...), one pair per Spec.positions

  def scores(self, q, k, q0, k0, q_rows, k_rows, with_derivative=False):
    """(scores, visible[, d scores / d logits]) [bq', bk'] of rows q_rows (a slice of the
    refs) starting at query index q0 against keys k_rows starting at k0."""
    spec = self.spec
    logits = plgpu.dot(q, k, trans_b=True).astype(jnp.float32) * spec.scale
    if self.bias is not None:
      logits = logits + self.bias[q_rows, k_rows].astype(jnp.float32)
    qi = q0 + lax.broadcasted_iota(jnp.int32, logits.shape, 0)
    ki = k0 + lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    terms = mods_lib.Mods(scores=spec.scores)
    score = lambda x: terms.score(x, self.b, self.h, qi, ki)
    if with_derivative and spec.scores:
      scores, slope = jax.jvp(score, (logits,), (jnp.ones_like(logits),))
    else:
      scores, slope = score(logits), None
    visible = (ki < spec.s) & (qi < spec.t) & (scores > -jnp.inf)
    if spec.causal:
      visible &= qi >= ki
    for window in spec.windows:
      visible &= mods_lib.LocalWindow(*window).visible(self.b, self.h, qi, ki)
    if spec.segmented:
      visible &= self.q_ids[q_rows][:, None] == self.kv_ids[k_rows][None, :]
    for (causal, window, sink_tokens), (q_pos, kv_pos) in zip(spec.positions, self.positions):
      term = mods_lib.Positions(None, None, causal, window, sink_tokens)
      visible &= term.visible_at(q_pos[q_rows][:, None], kv_pos[k_rows][None, :])
    for term in spec.mask_mods:
      visible &= term.visible(self.b, self.h, qi, ki)
    return (scores, visible, slope) if with_derivative else (scores, visible)


def tile_weights(scores, visible, lse):
  """exp(score - lse) where visible, 0 elsewhere (no inf on either branch)."""
  return jnp.where(visible, jnp.exp(jnp.where(visible, scores - lse[:, None], 0.0)), 0.0)


def _split(refs, spec: Spec, n_main: int):
  """The kernel's refs: (main refs, bias, (q_ids, kv_ids), position pairs, outputs)."""
  main, rest = refs[:n_main], list(refs[n_main:])
  bias = rest.pop(0) if spec.bias is not None else None
  ids = (rest.pop(0), rest.pop(0)) if spec.segmented else (None, None)
  pos = tuple((rest.pop(0), rest.pop(0)) for _ in spec.positions)
  return main, bias, ids, pos, rest


def _forward_kernel(*refs, spec: Spec):
  """One block of query rows of one (b, h): online softmax over its key blocks."""
  b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  (q_ref, k_ref, v_ref), bias, ids, pos, (o_ref, lse_ref) = _split(refs, spec, 3)
  tile = _Tile(spec, b, h, bias, *ids, pos)
  q = q_ref[...]
  bq, bk = spec.bq, spec.bk

  def step(j, carry):
    acc, m, l = carry
    keys = pl.ds(j * bk, bk)
    k, v = k_ref[keys, :], v_ref[keys, :]
    scores, visible = tile.scores(q, k, i * bq, j * bk, slice(None), keys)
    m_new = jnp.maximum(m, jnp.max(jnp.where(visible, scores, LOWEST), axis=1))
    p = tile_weights(scores, visible, m_new)
    correction = jnp.exp(m - m_new)
    acc = acc * correction[:, None] + plgpu.dot(p.astype(v.dtype), v).astype(jnp.float32)
    return acc, m_new, l * correction + jnp.sum(p, axis=1)

  lo, hi = spec.kv_range(i, k_ref.shape[0] // bk)
  init = (jnp.zeros((bq, v_ref.shape[-1]), jnp.float32), jnp.full((bq,), LOWEST, jnp.float32),
          jnp.zeros((bq,), jnp.float32))
  acc, m, l = lax.fori_loop(lo, hi, step, init)
  seen = l > 0
  o_ref[...] = (acc / jnp.where(seen, l, 1.0)[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), LOWEST)


def _dq_kernel(*refs, spec: Spec):
  """dQ (and dBias) of one block of query rows: over its key blocks."""
  b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), bias, ids, pos, outs = _split(refs, spec, 6)
  tile = _Tile(spec, b, h, bias, *ids, pos)
  q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
  bq, bk = spec.bq, spec.bk

  def step(j, dq):
    keys = pl.ds(j * bk, bk)
    k, v = k_ref[keys, :], v_ref[keys, :]
    scores, visible, slope = tile.scores(q, k, i * bq, j * bk, slice(None), keys, True)
    p = tile_weights(scores, visible, lse)
    dp = plgpu.dot(do, v, trans_b=True).astype(jnp.float32)
    ds = p * (dp - delta[:, None])
    ds = ds if slope is None else jnp.where(visible, ds * slope, 0.0)
    if spec.bias_grad:
      outs[1][:, keys] = ds
    return dq + plgpu.dot(ds.astype(k.dtype), k).astype(jnp.float32)

  nk = k_ref.shape[0] // bk
  # dBias is written tile by tile: every tile, hidden ones as 0, when the bias needs it.
  lo, hi = (0, nk) if spec.bias_grad else spec.kv_range(i, nk)
  dq = lax.fori_loop(lo, hi, step, jnp.zeros(q.shape, jnp.float32))
  outs[0][...] = (dq * spec.scale).astype(outs[0].dtype)


def _dkv_kernel(*refs, spec: Spec):
  """dK and dV of one block of keys, for one query head: over its query blocks."""
  b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), bias, ids, pos, (dk_ref, dv_ref) = _split(
      refs, spec, 6)
  tile = _Tile(spec, b, h, bias, *ids, pos)
  k, v = k_ref[...], v_ref[...]
  bq, bk = spec.bq, spec.bk

  def step(i, carry):
    dk, dv = carry
    rows = pl.ds(i * bq, bq)
    q, do = q_ref[rows, :], do_ref[rows, :]
    scores, visible, slope = tile.scores(q, k, i * bq, j * bk, rows, slice(None), True)
    p = tile_weights(scores, visible, lse_ref[rows])
    dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True).astype(jnp.float32)
    dp = plgpu.dot(do, v, trans_b=True).astype(jnp.float32)
    ds = p * (dp - delta_ref[rows][:, None])
    ds = ds if slope is None else jnp.where(visible, ds * slope, 0.0)
    return dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True).astype(jnp.float32), dv

  lo, hi = spec.q_range(j, q_ref.shape[0] // bq)
  init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  dk, dv = lax.fori_loop(lo, hi, step, init)
  dk_ref[...] = dk * spec.scale
  dv_ref[...] = dv


def _extra_specs(spec: Spec, rows, keys):
  """BlockSpecs of the bias, ids and positions, given how the kernel's grid (b, h, x) maps to
  its row block (`rows`: (size, index of x)) and key block (`keys`)."""
  (nr, row_block), (nk, key_block) = rows, keys
  specs = []
  if spec.bias is not None:
    over_b, over_h = spec.bias
    specs.append(pl.BlockSpec((None, None, nr, nk), lambda b, h, x: (
        b if over_b else 0, h if over_h else 0, row_block(x), key_block(x))))
  pair = [pl.BlockSpec((None, nr), lambda b, h, x: (b, row_block(x))),
          pl.BlockSpec((None, nk), lambda b, h, x: (b, key_block(x)))]
  specs += pair if spec.segmented else []
  return specs + pair * len(spec.positions)


def _heads(length, dim, head):
  """A [B, length, heads, dim] array's block of one head (`head(h)`), `length` rows from
  block `index(x)`."""
  return lambda index: pl.BlockSpec((None, length, None, dim),
                                    lambda b, h, x: (b, index(x), head(h), 0))


def forward(spec: Spec, q, k, v, extras, out_dtype=None):
  """(out [B, Tp, H, Vp] in `out_dtype` (None: V's), lse [B, H, Tp] float32) of padded inputs;
  `extras` = the bias, ids and positions that `spec` says are given, in that order."""
  (b, tp, h, kp), sp, vp = q.shape, k.shape[1], v.shape[-1]
  nq = tp // spec.bq
  kv_head = lambda h: h // spec.rep
  at = lambda x: x
  in_specs = [_heads(spec.bq, kp, at)(at), _heads(sp, kp, kv_head)(lambda x: 0),
              _heads(sp, vp, kv_head)(lambda x: 0),
              *_extra_specs(spec, (spec.bq, at), (sp, lambda x: 0))]
  return pl.pallas_call(
      functools.partial(_forward_kernel, spec=spec), grid=(b, h, nq), in_specs=in_specs,
      out_specs=[_heads(spec.bq, vp, at)(at),
                 pl.BlockSpec((None, None, spec.bq), lambda b, h, i: (b, h, i))],
      out_shape=[jax.ShapeDtypeStruct((b, tp, h, vp), out_dtype or v.dtype),
                 jax.ShapeDtypeStruct((b, h, tp), jnp.float32)],
      compiler_params=spec.params(), interpret=spec.interpret, name="flax_mha_flash_forward",
  )(q, k, v, *extras)


def backward(spec: Spec, q, k, v, extras, do, lse, delta):
  """(dq [B, Tp, H, Kp], dk, dv [B, Sp, H, *] per query head, float32, dbias [B, H, Tp, Sp] or
  None) from the forward's lse and delta = rowsum(dO·O) - d lse [B, H, Tp] (float32)."""
  (b, tp, h, kp), sp, vp = q.shape, k.shape[1], v.shape[-1]
  nq, nk = tp // spec.bq, sp // spec.bk
  at, zero, same = (lambda x: x), (lambda x: 0), (lambda h: h)
  kv_head = lambda h: h // spec.rep
  stats = lambda n, index: pl.BlockSpec((None, None, n), lambda b, h, x: (b, h, index(x)))
  dq_specs = [_heads(spec.bq, kp, same)(at), _heads(sp, kp, kv_head)(zero),
              _heads(sp, vp, kv_head)(zero), _heads(spec.bq, vp, same)(at),
              stats(spec.bq, at), stats(spec.bq, at),
              *_extra_specs(spec, (spec.bq, at), (sp, zero))]
  out_specs = [_heads(spec.bq, kp, same)(at)]
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
  if spec.bias_grad:
    out_specs.append(pl.BlockSpec((None, None, spec.bq, sp), lambda b, h, i: (b, h, i, 0)))
    out_shape.append(jax.ShapeDtypeStruct((b, h, tp, sp), jnp.float32))
  dq, *dbias = pl.pallas_call(
      functools.partial(_dq_kernel, spec=spec), grid=(b, h, nq), in_specs=dq_specs,
      out_specs=out_specs, out_shape=out_shape, compiler_params=spec.params(),
      interpret=spec.interpret, name="flax_mha_flash_dq")(q, k, v, do, lse, delta, *extras)
  dkv_specs = [_heads(tp, kp, same)(zero), _heads(spec.bk, kp, kv_head)(at),
               _heads(spec.bk, vp, kv_head)(at), _heads(tp, vp, same)(zero),
               stats(tp, zero), stats(tp, zero),
               *_extra_specs(spec, (tp, zero), (spec.bk, at))]
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, spec=spec), grid=(b, h, nk), in_specs=dkv_specs,
      out_specs=[_heads(spec.bk, kp, same)(at), _heads(spec.bk, vp, same)(at)],
      out_shape=[jax.ShapeDtypeStruct((b, sp, h, kp), jnp.float32),
                 jax.ShapeDtypeStruct((b, sp, h, vp), jnp.float32)],
      compiler_params=spec.params(), interpret=spec.interpret, name="flax_mha_flash_dkv",
  )(q, k, v, do, lse, delta, *extras)
  return dq, dk, dv, (dbias[0] if dbias else None)
