"""The keyword options of one `dot_product_attention` call (window, lengths, segment ids,
positions, soft cap, mask/score functions, sinks) built into mask and score terms
(`flax_mha.mods`), each checked at the boundary with an error that names the argument.

`OPTIONS` lists their names, `build` turns them into the terms the implementations read. A
layer's record of its own options is another thing: `flax_mha.nn.options.AttentionOptions`.
"""

from __future__ import annotations

import inspect
import math

import jax
import jax.numpy as jnp

from flax_mha import checks
from flax_mha import mods as mods_lib


def build(batch: tuple, t: int, s: int, h: int, dtype, is_causal: bool, *,
          local_window_size=None, query_seq_lengths=None, key_value_seq_lengths=None,
          q_segment_ids=None, kv_segment_ids=None, q_positions=None, kv_positions=None,
          logit_soft_cap=None, mask_mod=None, score_mod=None, sinks=None,
          sink_tokens=0) -> tuple[mods_lib.Mods, bool]:
  """(mods, is_causal for the implementation) for a call with batch dims `batch`, lengths T,
  S, H heads and query dtype `dtype`. Arrays are flattened to the single batch dim B the
  implementations see. With positions, causality and the window compare them (one
  `Positions` term) and the implementation sees is_causal=False."""
  masks, scores = [], []
  checks.check_int("sink_tokens", sink_tokens, lowest=0)
  if sink_tokens and local_window_size is None:
    raise ValueError(f"sink_tokens={sink_tokens} keeps the first tokens visible beyond a "
                     "window: it needs local_window_size")
  if q_positions is not None or kv_positions is not None:
    masks.append(_positions(q_positions, kv_positions, batch, t, s, is_causal,
                            local_window_size, sink_tokens))
    is_causal, local_window_size = False, None
  if local_window_size is not None:
    masks.append(_window(local_window_size, t, s, sink_tokens))
  if query_seq_lengths is not None or key_value_seq_lengths is not None:
    masks.append(mods_lib.SeqLengths(_lengths("query_seq_lengths", query_seq_lengths, batch),
                                     _lengths("key_value_seq_lengths", key_value_seq_lengths,
                                              batch)))
  if q_segment_ids is not None or kv_segment_ids is not None:
    masks.append(_segments(q_segment_ids, kv_segment_ids, batch, t, s))
  if mask_mod is not None:
    masks.append(_mask_mod(mask_mod, batch, h))
  if score_mod is not None:
    scores.append(_score_mod(score_mod, dtype))
  if logit_soft_cap is not None:
    scores.append(_soft_cap(logit_soft_cap))
  return mods_lib.Mods(tuple(masks), tuple(scores), _sinks(sinks, h)), is_causal


# The options' names, written once: the keyword-only parameters of `build`.
OPTIONS = tuple(name for name, p in inspect.signature(build).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY)


def check_names(options) -> None:
  """Raise a TypeError naming any keyword in `options` that is not one of OPTIONS."""
  unknown = set(options) - set(OPTIONS)
  if unknown:
    raise TypeError(f"unexpected keyword arguments {sorted(unknown)}; options are {OPTIONS}")


def _window(size, t: int, s: int, sink_tokens: int) -> mods_lib.LocalWindow:
  left, right = checks.check_window("local_window_size", size)
  if t != s:
    raise ValueError(
        f"local_window_size needs T == S (query i and key i at the same position), got T={t}, "
        f"S={s}: for other alignments (e.g. a KV cache) pass q_positions [..., T] and "
        "kv_positions [..., S], and the window compares those positions")
  # A side wider than the sequence sees all of it: clamped, so int32 positions never overflow.
  return mods_lib.LocalWindow(min(left, s), min(right, s), sink_tokens)


def _positions(q_pos, kv_pos, batch: tuple, t: int, s: int, is_causal: bool, window,
               sink_tokens: int) -> mods_lib.Positions:
  if q_pos is None or kv_pos is None:
    raise ValueError("q_positions and kv_positions must be given together, got only "
                     f"{'q' if kv_pos is None else 'kv'}_positions")
  pair = checks.check_window("local_window_size", window)
  if pair is not None:  # wider than any position: no limit, and no int32 overflow
    pair = tuple(min(side, 2**30) for side in pair)
  b = math.prod(batch)
  return mods_lib.Positions(
      _int_array("q_positions", q_pos, (*batch, t), "[..., T]").reshape(b, t).astype(jnp.int32),
      _int_array("kv_positions", kv_pos, (*batch, s), "[..., S]").reshape(b, s)
      .astype(jnp.int32), causal=bool(is_causal), window=pair, sink_tokens=sink_tokens)


def _sinks(sinks, h: int):
  if sinks is None:
    return None
  if not hasattr(sinks, "dtype") or not hasattr(sinks, "shape"):
    raise TypeError(f"sinks must be a floating array [H], got {type(sinks).__name__}")
  if not jnp.issubdtype(sinks.dtype, jnp.floating):
    raise TypeError(f"sinks must have a floating dtype, got {sinks.dtype}")
  if tuple(sinks.shape) != (h,):
    raise ValueError(f"sinks must have shape [H] = ({h},) (one logit per query head), got "
                     f"{tuple(sinks.shape)}")
  return jnp.asarray(sinks)


def _int_array(name: str, x, shape: tuple, layout: str):
  """x as an integer jnp array broadcast to `shape`, or a named error."""
  if not hasattr(x, "dtype") or not hasattr(x, "shape"):
    raise TypeError(f"{name} must be an integer array {layout}, got {type(x).__name__}")
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must have an integer dtype, got {x.dtype}")
  checks.check_broadcasts_to(name, x.shape, shape, layout)
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


def _user_function(name: str, fn, signature: str, examples):
  """Check `fn` is a callable of len(examples) arguments that maps the scalar `examples` to a
  scalar; return (its output's aval, converted fn, consts, positions of the arguments it reads)
  (see `flax_mha.mods.closure_convert`)."""
  if not callable(fn):
    raise TypeError(f"{name} must be a callable {signature}, got {type(fn).__name__}")
  try:
    inspect.signature(fn).bind(*examples)
  except TypeError:
    raise TypeError(f"{name} must take {len(examples)} positional arguments {signature}, got a "
                    f"callable with signature {inspect.signature(fn)}") from None
  except ValueError:  # no signature to read (a builtin): the call below says what is wrong
    pass
  try:
    out = jax.eval_shape(fn, *examples)
    converted, consts, reads = mods_lib.closure_convert(fn, *examples)
  except Exception as e:  # the user's code raised: say whose code and how it was called
    kind = TypeError if isinstance(e, TypeError) else ValueError
    raise kind(f"{name} failed when called with scalar arguments {signature} (it must be "
                  f"elementwise, as in FlexAttention): {e}") from e
  if not hasattr(out, "dtype") or not hasattr(out, "shape"):
    raise TypeError(f"{name} must return an array, got {type(out).__name__}")
  if out.shape:
    raise ValueError(
        f"{name} must be elementwise: called with scalar arguments {signature} it must return "
        f"a scalar, got shape {out.shape}. A function that ignores its indices and returns a "
        "closed-over [T, S] array is not a mod: pass that array as `mask` (or `bias`), or index "
        "it inside the function (m[q_idx, kv_idx])")
  return out, converted, consts, reads


def _mask_mod(fn, batch: tuple, h: int) -> mods_lib.MaskMod:
  index = jnp.zeros((), jnp.int32)
  out, converted, consts, reads = _user_function(
      "mask_mod", fn, "(b, h, q_idx, kv_idx) -> bool", (index,) * 4)
  if out.dtype != jnp.bool_:
    raise TypeError(f"mask_mod must return a boolean array (True = attend), got {out.dtype}")
  sizes = (math.prod(batch) if 0 in reads else 1, h if 1 in reads else 1)
  return mods_lib.MaskMod(converted, sizes, consts)


def _score_mod(fn, dtype) -> mods_lib.ScoreMod:
  """The user's function, traced once on scalars in the softmax dtype; the arrays it closes over
  become explicit consts (the floating ones differentiable)."""
  index = jnp.zeros((), jnp.int32)
  score = jnp.zeros((), jnp.promote_types(dtype, jnp.float32))
  out, converted, consts, _ = _user_function(
      "score_mod", fn, "(score, b, h, q_idx, kv_idx) -> score", (score, *(index,) * 4))
  if not jnp.issubdtype(out.dtype, jnp.floating):
    raise TypeError(f"score_mod must map a scalar score to a floating scalar (elementwise), "
                    f"got {out.dtype}")
  return mods_lib.ScoreMod(converted, consts)


def _soft_cap(cap) -> mods_lib.SoftCap:
  return mods_lib.SoftCap(checks.check_positive_real("logit_soft_cap", cap))
