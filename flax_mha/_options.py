"""The keyword conveniences of `dot_product_attention` as mask and score terms (`flax_mha.mods`),
each checked at the boundary with an error that names the argument."""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from flax_mha import _checks
from flax_mha import mods as mods_lib


def build(batch: tuple, t: int, s: int, h: int, dtype, *, local_window_size=None,
          query_seq_lengths=None, key_value_seq_lengths=None, q_segment_ids=None,
          kv_segment_ids=None, logit_soft_cap=None, mask_mod=None,
          score_mod=None) -> mods_lib.Mods:
  """Mods for a call with batch dims `batch`, lengths T, S, H heads and query dtype `dtype`.
  Arrays are flattened to the single batch dim B the implementations see."""
  masks, scores = [], []
  if local_window_size is not None:
    masks.append(_window(local_window_size, t, s))
  if query_seq_lengths is not None or key_value_seq_lengths is not None:
    masks.append(mods_lib.SeqLengths(_lengths("query_seq_lengths", query_seq_lengths, batch),
                                     _lengths("key_value_seq_lengths", key_value_seq_lengths,
                                              batch)))
  if q_segment_ids is not None or kv_segment_ids is not None:
    masks.append(_segments(q_segment_ids, kv_segment_ids, batch, t, s))
  if mask_mod is not None:
    masks.append(_mask_mod(mask_mod, batch, h, t, s))
  if score_mod is not None:
    scores.append(_score_mod(score_mod, dtype))
  if logit_soft_cap is not None:
    scores.append(_soft_cap(logit_soft_cap))
  return mods_lib.Mods(tuple(masks), tuple(scores))


def _window(size, t: int, s: int) -> mods_lib.LocalWindow:
  pair = (size, size) if isinstance(size, numbers.Integral) else size
  ok = (isinstance(pair, tuple) and len(pair) == 2 and
        all(isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 0 for x in pair))
  if not ok:
    raise ValueError("local_window_size must be an int >= 0 or a (left, right) pair of them, "
                     f"got {size!r}")
  if t != s:
    raise ValueError(
        f"local_window_size needs T == S (query i and key i at the same position), got T={t}, "
        f"S={s}: for other alignments (e.g. a KV cache) write the window as a mask_mod over "
        "absolute positions")
  return mods_lib.LocalWindow(int(pair[0]), int(pair[1]))


def _int_array(name: str, x, shape: tuple, layout: str):
  """x as an integer jnp array broadcast to `shape`, or a named error."""
  if not hasattr(x, "dtype") or not hasattr(x, "shape"):
    raise TypeError(f"{name} must be an integer array {layout}, got {type(x).__name__}")
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must have an integer dtype, got {x.dtype}")
  _checks.check_broadcasts_to(name, x.shape, shape, layout)
  return jnp.broadcast_to(jnp.asarray(x), shape)


def _lengths(name: str, lengths, batch: tuple):
  if lengths is None:
    return None
  return _int_array(name, lengths, batch, "[...] (the batch dims)").reshape(math.prod(batch))


def _segments(q_ids, kv_ids, batch: tuple, t: int, s: int) -> mods_lib.Segments:
  if q_ids is None or kv_ids is None:
    if t != s:
      raise ValueError("q_segment_ids and kv_segment_ids must both be given when T != S, got "
                       f"only {'q' if kv_ids is None else 'kv'}_segment_ids")
    q_ids = kv_ids if q_ids is None else q_ids
    kv_ids = q_ids
  b = math.prod(batch)
  return mods_lib.Segments(
      _int_array("q_segment_ids", q_ids, (*batch, t), "[..., T]").reshape(b, t),
      _int_array("kv_segment_ids", kv_ids, (*batch, s), "[..., S]").reshape(b, s))


def _index_specs(batch: tuple, h: int, t: int, s: int):
  b = math.prod(batch)
  spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  return spec(b, 1, 1, 1), spec(1, h, 1, 1), spec(1, 1, t, 1), spec(1, 1, 1, s)


def _mask_mod(fn, batch: tuple, h: int, t: int, s: int) -> mods_lib.MaskMod:
  if not callable(fn):
    raise TypeError(f"mask_mod must be a callable (b, h, q_idx, kv_idx) -> bool, got "
                    f"{type(fn).__name__}")
  out = jax.eval_shape(fn, *_index_specs(batch, h, t, s))
  if not hasattr(out, "dtype") or out.dtype != jnp.bool_:
    raise TypeError("mask_mod must return a boolean array (True = attend), got "
                    f"{getattr(out, 'dtype', type(out).__name__)}")
  b = math.prod(batch)
  try:
    shape = np.broadcast_shapes(out.shape, (b, h, t, s))
  except ValueError:
    shape = None
  if shape != (b, h, t, s) or len(out.shape) > 4:
    raise ValueError(f"mask_mod must broadcast over its index arguments to [B, H, T, S] = "
                     f"{(b, h, t, s)} (elementwise), got an output of shape {out.shape}")
  dims = (1,) * (4 - len(out.shape)) + tuple(out.shape)
  return mods_lib.MaskMod(fn, sizes=(b if dims[0] > 1 else 1, h if dims[1] > 1 else 1))


def _score_mod(fn, dtype) -> mods_lib.ScoreMod:
  """The user's function; when it closes over float arrays, traced once on scalars with those
  arrays hoisted out as explicit (differentiable) consts and applied elementwise."""
  if not callable(fn):
    raise TypeError("score_mod must be a callable (score, b, h, q_idx, kv_idx) -> score, got "
                    f"{type(fn).__name__}")
  dtype = jnp.promote_types(dtype, jnp.float32)
  index = jnp.zeros((), jnp.int32)
  converted, consts = jax.closure_convert(fn, jnp.zeros((), dtype), index, index, index, index)
  out = jax.eval_shape(converted, jax.ShapeDtypeStruct((), dtype), *(index,) * 4, *consts)
  if not hasattr(out, "dtype") or not jnp.issubdtype(out.dtype, jnp.floating) or out.shape:
    raise TypeError("score_mod must map a scalar score to a floating scalar (elementwise), got "
                    f"{getattr(out, 'dtype', type(out).__name__)} of shape "
                    f"{getattr(out, 'shape', None)}")
  if not consts:  # nothing to differentiate: the function itself, broadcasting like mask_mod
    return mods_lib.ScoreMod(fn)
  return mods_lib.ScoreMod(functools.partial(_elementwise, converted, dtype), tuple(consts))


def _elementwise(converted, dtype, s, b, h, q, kv, *consts):
  """converted (traced on scalars) over the broadcast of s and the index arrays."""
  def one(s, b, h, q, kv):
    return converted(s.astype(dtype), b, h, q, kv, *consts).astype(s.dtype)
  return jnp.vectorize(one)(s, *(jnp.asarray(x, jnp.int32) for x in (b, h, q, kv)))


def _soft_cap(cap) -> mods_lib.SoftCap:
  if not isinstance(cap, numbers.Real) or isinstance(cap, bool):
    raise TypeError(f"logit_soft_cap must be a Python float > 0, got {type(cap).__name__}")
  if not (math.isfinite(cap) and cap > 0):
    raise ValueError(f"logit_soft_cap must be a finite number > 0, got {cap}")
  return mods_lib.SoftCap(float(cap))
