"""What the linen and NNX front ends share: the forward (`forward`: checks, projections, rotary
positions, the caches, the attention call) and its steps.

Plain functions of arrays and Python values, no flax: each front end keeps only its parameters
and state (`flax_mha.nn.linen` the linen variables, `flax_mha.nn.nnx` the `nnx.Variable`s) and
hands itself to `forward`, so both attend the same way by construction.
"""

from __future__ import annotations

import functools
import math
import typing
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flax_mha import cache as cache_lib
from flax_mha import checks
from flax_mha.attention import dot_product_attention, dot_product_attention_weights
from flax_mha.nn.options import AttentionOptions, Norm
from flax_mha.rotary import apply_rotary


# The attention projections' logical axes (see `flax_mha.parallel.sharding`): the query/key/value
# kernels [D, H|G, K] column-parallel over heads, `out` [H, V, D] row-parallel; the normalize_qk
# scales [K] and the output bias [D] replicated. Models extend this table with their own.
PARAM_AXES = (
    (r"(query|key|value)/kernel$", ("embed", "heads", "head_dim")),
    (r"(query|key|value)/bias$", ("heads", "head_dim")),
    (r"out/kernel$", ("heads", "head_dim", "embed")),
    (r"out/bias$", ("embed",)),
    (r"(query|key)_ln/scale$", ("head_dim",)),
    (r"(^|/)sinks$", ("heads",)),
)


def rms_norm(x, scale, norm: Norm, *, dtype=None):
  """x / sqrt(mean(x², last axis) + epsilon) · scale (or · (1 + scale) for Gemma's kind) of an
  RMS `Norm`, computed in float32 (float64 for float64 x) and cast to `dtype` (default x's), as
  Hugging Face's RMSNorms."""
  compute = jnp.promote_types(x.dtype, jnp.float32)
  xc = x.astype(compute)
  normed = xc * jax.lax.rsqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + norm.epsilon)
  scale = scale.astype(compute)
  return (normed * (1 + scale if norm.kind == "rms_one_plus" else scale)).astype(
      dtype or x.dtype)


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


def check_rotary(rope, qkv_features: int, num_heads: int) -> None:
  """The layer's rotation (a `Rope`, or None: off) fits its qk head dim K: an even rotated
  width."""
  if rope is None:
    return
  k = qkv_features // num_heads
  try:
    rope.rotated_width(k)
  except ValueError as e:
    raise ValueError(
        "rotary_max_wavelength needs an even qk head dim K = qkv_features / num_heads (the "
        "rotation pairs features; with a `rope`, an even rotated width int(K * fraction)), got "
        f"K={k} (qkv_features={qkv_features}, num_heads={num_heads}): {e}") from None


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
          f"{name} was given but rotary_max_wavelength is None (and so is rope): positions are "
          "only used by the rotary embedding; set rotary_max_wavelength (e.g. 10_000.0)")


def rotate(query_THK, key_SGK, q_positions, kv_positions, *, keys_from_q: bool, start,
           rope):
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
  rotate_at = functools.partial(apply_rotary, rope=rope)
  return rotate_at(query_THK, q_positions), rotate_at(key_SGK, kv_positions)


def _check_positions(name: str, positions, lead: tuple, layout: str):
  """Integer positions broadcasting to the projections' leading dims [..., T] (or [..., S])."""
  checks.check_array(name, positions, 1, layout, floating=False)
  if not jnp.issubdtype(positions.dtype, jnp.integer):
    raise TypeError(f"{name} must have an integer dtype, got {positions.dtype}")
  checks.check_broadcasts_to(name, positions.shape, lead, layout)


def check_cache_call(cache, *, keys_from_q: bool, inputs_q, q_segment_ids, kv_segment_ids,
                     kv_positions, bias, mask, window, sink_tokens: int) -> None:
  """What a call with `cache=` takes: self-attention of [B, T, D] inputs, positions rather
  than segment ids or a bias, a mask only over a full cache, the module's own window."""
  if not isinstance(cache, (cache_lib.KVCache, cache_lib.PagedKVCache)):
    raise TypeError(f"cache must be a flax_mha.cache.KVCache (see the module's new_cache) or "
                    f"PagedKVCache, got {type(cache).__name__}")
  if not keys_from_q:
    raise ValueError("cache= caches self-attention: pass inputs_q only (keys and values come "
                     "from it)")
  rows = cache.length.shape[0]
  if inputs_q.ndim != 3 or inputs_q.shape[0] != rows:
    raise ValueError(f"with cache=, inputs_q must be [B, T, D] with the cache's batch B={rows}, "
                     f"got shape {tuple(inputs_q.shape)}")
  for name, x in (("q_segment_ids", q_segment_ids), ("kv_segment_ids", kv_segment_ids),
                  ("bias", bias), ("kv_positions", kv_positions)):
    if x is not None:
      raise ValueError(f"{name} is not taken with cache= (one document per row: positions "
                       "say where each token is, a negative one marks padding)")
  rolling = getattr(cache, "window", None)
  if mask is not None and not cache.takes_mask:
    raise ValueError("mask is only taken with a full KVCache (a rolling or paged cache's slots "
                     "move): mark padding with negative positions")
  if rolling is not None and (window is None or cache.window != window[0] or
                              cache.sink_tokens != sink_tokens):
    raise ValueError(f"a rolling cache of window {cache.window} and sink_tokens "
                     f"{cache.sink_tokens} must come from the same layer: this one has "
                     f"local_window_size={window}, sink_tokens={sink_tokens}")


def cached_attention(query_BTHK, key_BTGK, value_BTGV, cache, positions_BT, mask, *,
                  implementation, dropout_rate: float, dropout_rng, local_window_size=None,
                  sink_tokens: int = 0, **options):
  """(output [B, T, H, V], updated cache) of both front ends' cached step (flax_mha.cache): a
  full cache compares the layer's window by position, a rolling one brings its own."""
  if getattr(cache, "window", None) is None and local_window_size is not None:
    options.update(local_window_size=local_window_size, sink_tokens=sink_tokens)
  options.update(dropout_rate=dropout_rate if dropout_rng is not None else 0.0,
                 dropout_rng=dropout_rng)
  if mask is not None:
    options["mask"] = mask
  return cache_lib.attend(query_BTHK, key_BTGK, value_BTGV, cache, positions_BT,
                          implementation=implementation, **options)


def new_cache(batch_size: int, capacity: int, *, num_heads: int, num_kv_heads: int,
              qkv_features: int, v_features: int, window, sink_tokens: int, dtype):
  """An empty KVCache for one layer: rolling (window + sink tokens) for a causal local layer,
  full otherwise."""
  left = None if window is None else window[0]
  return cache_lib.KVCache.create(batch_size, capacity, num_kv_heads, qkv_features // num_heads,
                                  v_features // num_heads, dtype, window=left,
                                  sink_tokens=sink_tokens if left is not None else 0)


def flax_cache(cached_key, cached_value, index):
  """flax's decode cache (keys [..., S_max, G, K], values, one scalar index) as a KVCache
  with one batch dim: slots below the index filled, every row at the same position."""
  *batch, capacity, g, k = cached_key.shape
  b = math.prod(batch)
  filled = jnp.arange(capacity, dtype=jnp.int32)
  positions = jnp.broadcast_to(jnp.where(filled < index, filled, -1), (b, capacity))
  head_major = lambda x: jnp.asarray(x).reshape(b, capacity, g, -1).transpose(0, 2, 1, 3)
  return cache_lib.KVCache(head_major(cached_key), head_major(cached_value), positions,
                           jnp.full((b,), index, jnp.int32))


def flax_decode_step(query_THK, key_SGK, value_SGV, cached_key, cached_value, index, mask,
                     **kwargs):
  """(output [..., T, H, V], new cached_key, new cached_value) of a flax-style decode step: the
  T tokens appended at `index` (every row alike), attending causally to what is cached."""
  batch, t = query_THK.shape[:-3], query_THK.shape[-3]
  cache = flax_cache(cached_key, cached_value, index)
  flat = lambda x: x.reshape(-1, *x.shape[len(batch):])
  if mask is not None:  # [..., H|1, T, S_max] over the flattened batch
    mask = jnp.asarray(mask)
    mask = mask.reshape((1,) * (len(batch) + 3 - mask.ndim) + mask.shape)
    mask = flat(jnp.broadcast_to(mask, (*batch, *mask.shape[len(batch):])))
  positions = jnp.broadcast_to(index + jnp.arange(t, dtype=jnp.int32), (cache.key.shape[0], t))
  out, cache = cached_attention(flat(query_THK), flat(key_SGK), flat(value_SGV), cache,
                                positions, mask, **kwargs)
  unflat = lambda x: x.reshape(*batch, *x.shape[1:])
  flax_layout = lambda x: unflat(x.transpose(0, 2, 1, 3))  # back to [..., S_max, G, K]
  return unflat(out), flax_layout(cache.key), flax_layout(cache.value)


def as_bool_mask(mask):
  """A boolean mask; numeric masks mean what they mean in flax.linen: nonzero = attend.

  When its values are concrete, a numeric mask that reads as torch's additive `attn_mask`
  (0 = attend, -inf = hide, which would read inverted here) is refused: a float mask holding
  anything but 0 and 1, and a numeric mask of zeros alone, which hides every key from every
  query (torch's additive mask of a batch without padding). A boolean mask says what it means
  and is taken as it is, all False included (the padding mask of a batch of padding alone,
  such as a Transformer initialised with zeros: every query's output is that of a fully
  masked row). Under `jit` the values are traced and cannot be read: a numeric mask then means
  nonzero = attend, unchecked, and an all-zero one gives every query a fully masked row's
  output (zeros before the output projection).
  """
  if mask is None or not hasattr(mask, "dtype") or mask.dtype == jnp.bool_:
    return mask  # None, bool, or not an array: the pure function's checks name the problem
  _check_numeric(mask)
  if not isinstance(mask, jax.core.Tracer):
    _check_sees_a_key(np.asarray(mask))
  return mask != 0


def _check_numeric(mask) -> None:
  """Raise unless the numeric mask is integer or float, a float one holding only 0 and 1 when
  concrete."""
  if not (jnp.issubdtype(mask.dtype, jnp.integer) or jnp.issubdtype(mask.dtype, jnp.floating)):
    raise TypeError(
        "mask must be boolean (True = attend) or integer/float (nonzero = attend, as in "
        f"flax.linen), got dtype {mask.dtype}")
  if jnp.issubdtype(mask.dtype, jnp.floating) and not isinstance(mask, jax.core.Tracer):
    _check_zero_one(np.asarray(mask))


def _check_zero_one(mask) -> None:
  """Raise unless the float mask holds only 0 and 1 (flax's masks)."""
  bad = (mask != 0) & (mask != 1)
  if bad.any():
    raise ValueError(
        f"mask must hold only 0 and 1 when float (flax's convention: nonzero = attend), got "
        f"{mask[bad].flat[0]} at index {tuple(int(i) for i in np.argwhere(bad)[0])}: this looks "
        "like torch's additive attn_mask (0 = attend, -inf = hide), which as a mask would "
        "attend where torch hides. Pass it as `bias` (added to the logits), or a boolean mask "
        "(True = attend)")


def _check_sees_a_key(mask) -> None:
  """Raise when the concrete numeric mask hides every key from every query (zeros alone).

  Judged on the whole mask, not row by row: a query that sees nothing (a padded one) is
  legitimate, a mask under which no query of any batch row or head sees anything is torch's
  additive convention read as flax's.
  """
  if mask.size and not mask.any():
    raise ValueError(
        f"mask hides every key from every query: it holds only zeros, shape "
        f"{tuple(mask.shape)}, so every query would attend to nothing (output zero). "
        "flax's masks mean True/1 = attend; torch's additive attn_mask means 0 = attend, "
        "-inf = hide, so its mask of a batch without padding is all zeros: pass an additive "
        "mask as `bias` (added to the logits), or a boolean mask with True = attend (None "
        "attends everywhere)")


def plain_attention(query_THK, key_SGK, value_SGV, bias, mask, *, implementation, sow: bool,
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


class FrontEnd(typing.Protocol):
  """What `forward` asks of a front end (linen's and NNX's modules): its record and settings,
  and the steps that touch its variables."""
  options: AttentionOptions  # the layer's own attention options
  implementation: Any  # dot_product_attention's `implementation`
  dropout_rate: float

  def check_attributes(self, inputs_q, inputs_k, inputs_v) -> None:
    """Refuse attributes that do not fit the inputs (widths, heads, rates)."""

  def project_qkv(self, inputs_q, inputs_k, inputs_v) -> tuple[Any, Any, Any]:
    """(query [..., T, H, K], key [..., S, G, K], value [..., S, G, V]), normalised."""

  def sink_logits(self) -> Any:
    """The learned sink logits [H], or None."""

  def decode_start(self) -> Any:
    """flax's decode cache index (0 before the cache exists)."""

  def decode_step(self, query_THK, key_SGK, value_SGV, mask, **options) -> Any:
    """flax's decode convention: the output, or None when the call only made the cache
    (linen's init call, which then attends causally)."""

  def sow_attention_weights(self, weights) -> None:
    """Keep the attention weights [..., H, T, S] (sow_weights=True)."""

  def project_out(self, out_THV, in_features: int) -> Any:
    """[..., T, H, V] -> [..., T, out_features] (in_features: inputs_q's width D_q)."""


def forward(front: FrontEnd, inputs_q, inputs_k, inputs_v, *, mask, bias, is_causal: bool, q_segment_ids,
            kv_segment_ids, q_positions, kv_positions, sow_weights: bool, cache, decode: bool,
            dropout_rng):
  """Both front ends' call: output [..., T, out_features], or (output, updated cache) with
  `cache`. Check, project, rotate, then attend (through `cache`, flax's decode cache, or
  plainly) and project out.

  `front` is the module, which holds the parameters and state: a `FrontEnd`.
  """
  inputs_k, inputs_v, keys_from_q = resolve_inputs(inputs_q, inputs_k, inputs_v)
  front.check_attributes(inputs_q, inputs_k, inputs_v)
  opts = front.options
  rotary = opts.rotary
  check_call(decode=decode, rotary=rotary is not None or cache is not None,
             q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
             q_positions=q_positions, kv_positions=kv_positions)
  if cache is not None:
    check_cache_call(cache, keys_from_q=keys_from_q, inputs_q=inputs_q,
                     q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                     kv_positions=kv_positions, bias=bias, mask=mask,
                     window=opts.local_window_size, sink_tokens=opts.sink_tokens)
    if q_positions is None:
      q_positions = cache_lib.next_positions(cache, inputs_q.shape[-2])
  query_THK, key_SGK, value_SGV = front.project_qkv(inputs_q, inputs_k, inputs_v)
  if rotary is not None:
    query_THK, key_SGK = rotate(
        query_THK, key_SGK, q_positions, kv_positions, keys_from_q=keys_from_q,
        start=front.decode_start() if decode and cache is None else 0, rope=rotary)
  mask = as_bool_mask(mask)
  options = dict(implementation=front.implementation, dropout_rate=front.dropout_rate,
                 dropout_rng=dropout_rng, sinks=front.sink_logits(), **opts.keywords())
  if cache is not None:
    out_THV, cache = cached_attention(query_THK, key_SGK, value_SGV, cache, q_positions, mask,
                                      **options)
    return front.project_out(out_THV, inputs_q.shape[-1]), cache
  out_THV = None
  if decode:
    out_THV = front.decode_step(query_THK, key_SGK, value_SGV, mask, **options)
  if out_THV is None:  # not decoding, or flax's init call, which attends like a decoder
    out_THV, weights = plain_attention(
        query_THK, key_SGK, value_SGV, bias, mask, sow=sow_weights, is_causal=is_causal or decode,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, **options)
    if weights is not None:
      front.sow_attention_weights(weights)
  return front.project_out(out_THV, inputs_q.shape[-1])
