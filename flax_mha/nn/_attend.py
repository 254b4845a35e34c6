"""What the linen and NNX front ends share: argument checks, rotary positions, the cache mask.

Plain functions of arrays and Python values, no flax: each front end keeps only its parameters
and state (`flax_mha.nn.linen` the linen variables, `flax_mha.nn.nnx` the `nnx.Variable`s) and calls
these, so both attend the same way by construction.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from flax_mha import checks
from flax_mha import masks as masks_lib
from flax_mha import mods as mods_lib
from flax_mha.attention import dot_product_attention, dot_product_attention_weights
from flax_mha.rotary import apply_rotary


# The attention projections' logical axes (see `flax_mha.sharding`): the query/key/value
# kernels [D, H|G, K] column-parallel over heads, `out` [H, V, D] row-parallel; the normalize_qk
# scales [K] and the output bias [D] replicated. Models extend this table with their own.
PARAM_AXES = (
    (r"(query|key|value)/kernel$", ("embed", "heads", "head_dim")),
    (r"(query|key|value)/bias$", ("heads", "head_dim")),
    (r"out/kernel$", ("heads", "head_dim", "embed")),
    (r"out/bias$", ("embed",)),
    (r"(query|key)_ln/scale$", ("head_dim",)),
)


def resolve_inputs(inputs_q, inputs_k, inputs_v):
  """(inputs_k, inputs_v, keys_from_q) with flax's defaults, checked.

  keys_from_q says the keys are computed from inputs_q (the default positions depend on it).
  """
  if inputs_k is None and inputs_v is not None:
    raise ValueError(
        "inputs_v was given but inputs_k is None: pass inputs_k too (the keys would otherwise "
        "silently be inputs_q); for keys equal to values pass inputs_k only")
  keys_from_q = inputs_k is None or inputs_k is inputs_q
  inputs_k = inputs_q if inputs_k is None else inputs_k
  inputs_v = inputs_k if inputs_v is None else inputs_v
  check_inputs(inputs_q, inputs_k, inputs_v)
  return inputs_k, inputs_v, keys_from_q


def check_inputs(inputs_q, inputs_k, inputs_v):
  """Module-level input checks, naming the module's own arguments."""
  for name, x, layout in (("inputs_q", inputs_q, "[..., T, D_q]"),
                          ("inputs_k", inputs_k, "[..., S, D_k]"),
                          ("inputs_v", inputs_v, "[..., S, D_v]")):
    checks.check_array(name, x, 2, layout, floating=False)
  inputs = (inputs_q, inputs_k, inputs_v)
  checks.check_agree("inputs_q, inputs_k and inputs_v", inputs, slice(None, -2),
                     "share batch dims [...]")
  checks.check_agree("inputs_k [..., S, D_k] and inputs_v [..., S, D_v]", inputs[1:],
                     slice(-2, -1), "share the length S")


def check_rotary(wavelength, qkv_features: int, num_heads: int) -> None:
  """rotary_max_wavelength (None: off) is a positive finite Python number, with an even K."""
  if checks.check_positive_real("rotary_max_wavelength", wavelength, optional=True) is None:
    return
  k = qkv_features // num_heads
  if k % 2:
    raise ValueError(
        "rotary_max_wavelength needs an even qk head dim K = qkv_features / num_heads "
        "(the rotation pairs feature i with i + K/2), got "
        f"K={k} (qkv_features={qkv_features}, num_heads={num_heads})")


def check_call(*, decode: bool, rotary: bool, q_segment_ids, kv_segment_ids, q_positions,
               kv_positions) -> None:
  """Checks between the module's options and a call's segment ids and positions."""
  if decode and (q_segment_ids is not None or kv_segment_ids is not None):
    raise ValueError(
        "q_segment_ids/kv_segment_ids are not supported with decode=True (packed decoding "
        "is not implemented): decode one document per batch row, with a padding mask")
  if rotary:
    return
  for name, x in (("q_positions", q_positions), ("kv_positions", kv_positions)):
    if x is not None:
      raise ValueError(
          f"{name} was given but rotary_max_wavelength is None: positions are only used "
          "by the rotary embedding; set rotary_max_wavelength (e.g. 10_000.0)")


def rotate(query_THK, key_SGK, q_positions, kv_positions, *, keys_from_q: bool, start,
           max_wavelength: float):
  """query [..., T, H, K] and key [..., S, G, K] rotated at their positions.

  Defaults: queries at start + arange(T) (start is the cache index when decoding, else 0);
  keys at the queries' positions when they come from inputs_q, else at start + arange(S).
  """
  if q_positions is None:
    q_positions = start + jnp.arange(query_THK.shape[-3])
  if kv_positions is None:
    kv_positions = q_positions if keys_from_q else start + jnp.arange(key_SGK.shape[-3])
  _check_positions("q_positions", q_positions, query_THK.shape[:-2], "[..., T]")
  _check_positions("kv_positions", kv_positions, key_SGK.shape[:-2], "[..., S]")
  rotate_at = functools.partial(apply_rotary, max_wavelength=max_wavelength)
  return rotate_at(query_THK, q_positions), rotate_at(key_SGK, kv_positions)


def _check_positions(name: str, positions, lead: tuple, layout: str):
  """Integer positions broadcasting to the projections' leading dims [..., T] (or [..., S])."""
  checks.check_array(name, positions, 1, layout, floating=False)
  if not jnp.issubdtype(positions.dtype, jnp.integer):
    raise TypeError(f"{name} must have an integer dtype, got {positions.dtype}")
  checks.check_broadcasts_to(name, positions.shape, lead, layout)


def write_cache(cache, new, index):
  """`cache` [..., S_max, G, X] with `new` [..., T, G, X] written at position `index`."""
  # Zeros in the index's dtype: under jax_enable_x64 bare 0s are int64, and
  # dynamic_update_slice refuses start indices of mixed types.
  zero = jnp.zeros((), index.dtype)
  start = (zero,) * (cache.ndim - 3) + (index, zero, zero)
  return lax.dynamic_update_slice(cache, new, start)


def cache_mask(mask, num_q: int, num_kv: int, window, offset):
  """mask AND causal AND window [T, S], query i at absolute position i + offset, key j at j
  (the predicates of `flax_mha.mods`, at those positions)."""
  terms = [mods_lib.Causal()]
  if window is not None:  # a side wider than the cache is no limit (and no int32 overflow)
    terms.append(mods_lib.LocalWindow(*(min(w, num_kv) for w in window)))
  q_pos = jnp.arange(num_q)[:, None] + offset
  visible_TS = mods_lib.Mods(tuple(terms)).visible(None, None, q_pos, jnp.arange(num_kv)[None])
  return masks_lib.combine_masks(mask, visible_TS)


def as_bool_mask(mask):
  """A boolean mask; numeric masks mean what they mean in flax.linen: nonzero = attend."""
  if mask is None or not hasattr(mask, "dtype") or mask.dtype == jnp.bool_:
    return mask  # None, bool, or not an array: the pure function's checks name the problem
  if not (jnp.issubdtype(mask.dtype, jnp.integer) or jnp.issubdtype(mask.dtype, jnp.floating)):
    raise TypeError(
        "mask must be boolean (True = attend) or integer/float (nonzero = attend, as in "
        f"flax.linen), got dtype {mask.dtype}")
  return mask != 0


def attend(query_THK, key_SGK, value_SGV, bias, mask, *, implementation, sow: bool,
           dropout_rate: float, dropout_rng, **options):
  """(output [..., T, H, V], weights [..., H, T, S] when `sow`, else None) of both front ends'
  attention step; without a dropout rng (deterministic) no dropout runs. `options` are the rest
  of dot_product_attention's keyword arguments."""
  options.update(dropout_rate=dropout_rate if dropout_rng is not None else 0.0,
                 dropout_rng=dropout_rng)
  out_THV = dot_product_attention(query_THK, key_SGK, value_SGV, bias, mask,
                                  implementation=implementation, **options)
  weights = None
  if sow:
    weights = dot_product_attention_weights(query_THK, key_SGK, bias, mask, **options)
  return out_THV, weights
