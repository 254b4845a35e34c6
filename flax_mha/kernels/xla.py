"""The tuned plain graph: the whole [B, H, T, S] logits in one XLA program, shaped for speed.

Same semantics as the oracle (`flax_mha.kernels.reference`), tested against it; the differences are
layout and fusion choices for XLA:CPU (the oracle-vs-xla speed is a column of
`python -m experiments.bench.attention`):
- the scale multiplies the query [T, K] rather than the logits [T, S] when nothing else touches
  the logits (XLA:CPU fuses a logit scale into a mask or bias pass, not into the product);
- plain multi-head attention (G == H) uses a 4-d product rather than the grouped 5-d one;
- the plain softmax has its own JVP, from the weights alone (jax.nn.softmax's keeps exp(x - max)
  and its sum for the backward, which splits the forward into four passes over the logits);
- the masked softmax has its own JVP and zeroes hidden entries and empty rows inside its passes;
- the weights-times-values product keeps the weights' head-major order, transposed after.
Good for small problems; memory is quadratic in T·S (`flax_mha.kernels.chunked` is linear).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from flax_mha.kernels import common
from flax_mha.kernels import dropout
from flax_mha import masks as masks_lib
from flax_mha import quant
from flax_mha import mods as mods_lib
from flax_mha import precision
from flax_mha.kernels import registry


def _kv_dims(x, kv_layout: str):
  """(S, G) of keys or values laid out as `kv_layout`: "BSGK" (the API's) or "BGSK" (head-major:
  each head's keys contiguous, how a KV cache stores them; `flax_mha.cache`)."""
  return (x.shape[1], x.shape[2]) if kv_layout == "BSGK" else (x.shape[2], x.shape[1])


def attention_logits(query_BTHK, key, bias, scale, *, scale_query: bool = False,
                     kv_layout: str = "BSGK"):
  """scale · Q·Kᵀ + bias: [B, H, T, S] in the softmax dtype; GQA without repeating K."""
  b, t, h, k = query_BTHK.shape
  s, g = _kv_dims(key, kv_layout)
  dtype = common.softmax_dtype(query_BTHK.dtype)
  if scale_query:
    query_BTHK = query_BTHK * jnp.asarray(scale, query_BTHK.dtype)
  keys = kv_layout  # "BSGK" or "BGSK", the einsum letters of the dimension key
  if g == h:
    logits_BHTS = jnp.einsum(f"BTHK,{keys.replace('G', 'H')}->BHTS", query_BTHK, key,
                             preferred_element_type=dtype)
  else:
    q_BTGRK = query_BTHK.reshape(b, t, g, h // g, k)
    logits_BGRTS = jnp.einsum(f"BTGRK,{keys}->BGRTS", q_BTGRK, key,
                              preferred_element_type=dtype)
    logits_BHTS = logits_BGRTS.reshape(b, h, t, s)
  if not scale_query:
    logits_BHTS = logits_BHTS * jnp.asarray(scale, dtype)
  if bias is not None:
    logits_BHTS = logits_BHTS + bias.astype(dtype)
  return logits_BHTS


@jax.custom_jvp
def plain_softmax(logits):
  """The softmax over the last axis with nothing hidden: one pass XLA:CPU fuses with the
  product before it (max, exp, sum, scale), and a JVP from the weights alone (jax.nn.softmax
  differentiates exp(x - max) / sum, which keeps both for the backward and splits the pass)."""
  unnormalised = jnp.exp(logits - lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True)))
  return unnormalised / jnp.sum(unnormalised, axis=-1, keepdims=True)


@plain_softmax.defjvp
def _plain_softmax_jvp(primals, tangents):
  weights = plain_softmax(*primals)
  (dot,) = tangents
  return weights, weights * (dot - jnp.sum(weights * dot, axis=-1, keepdims=True))


@jax.custom_jvp
def masked_softmax(logits, visible, sinks=None):
  """(weights, lse): the softmax over the last axis of the `visible` entries (None: all) and its
  log-sum-exp; hidden entries, entries at -inf and rows with no visible finite entry get
  weight 0 (no NaN, no uniform row; lse finfo.min). `sinks`, broadcasting to [..., 1], join
  every row's denominator (a logit without a value)."""
  lowest = jnp.finfo(logits.dtype).min
  hidden_to_lowest = logits if visible is None else jnp.where(visible, logits, lowest)
  # Clamping the row max at `lowest` keeps exp finite: a row of -inf logits gives exp(-inf) = 0.
  row_max = jnp.maximum(jnp.max(hidden_to_lowest, axis=-1, keepdims=True), lowest)
  if sinks is not None:
    row_max = jnp.maximum(row_max, sinks)
  row_max = lax.stop_gradient(row_max)
  unnormalised = jnp.exp(hidden_to_lowest - row_max)  # hidden: exp(-big) = 0
  if visible is not None:
    unnormalised = jnp.where(visible, unnormalised, 0.0)
  total = jnp.sum(unnormalised, axis=-1, keepdims=True)
  if sinks is not None:
    total = total + jnp.exp(sinks - row_max)
  weights = unnormalised / jnp.maximum(total, jnp.finfo(logits.dtype).tiny)  # total 0 or >= 1
  return weights, common.row_lse(row_max, total)[..., 0]


@masked_softmax.defjvp
def _masked_softmax_jvp(primals, tangents):
  logits, visible, sinks = primals
  weights, lse = masked_softmax(logits, visible, sinks)
  mean_dot = jnp.sum(weights * tangents[0], axis=-1, keepdims=True)  # d lse
  if sinks is not None:
    mean_dot = mean_dot + jnp.exp(sinks - lse[..., None]) * tangents[2]
  return (weights, lse), (weights * (tangents[0] - mean_dot), mean_dot[..., 0])


def _weights_and_lse(query, key, bias, mask, *, is_causal, scale, dropout_rate, dropout_rng,
                     mods, return_residual, kv_layout):
  """(weights [B, H, T, S] after dropout, lse [B, H, T] or None) in the softmax dtype."""
  sinks = None if mods is None else mods.sinks
  logits = functools.partial(attention_logits, query, key, bias, scale, kv_layout=kv_layout)
  num_kv = _kv_dims(key, kv_layout)[0]
  if mods is None or not (mods.masks or mods.scores):
    alone = bias is None and sinks is None and mask is None
    if alone and is_causal and num_kv:
      # Causality alone leaves every row its first key (top-left alignment), so no row is
      # empty: a constant additive [T, S] term and the library softmax, which XLA:CPU runs at
      # the non-causal speed (a select over the logits costs a causal T=128 call ~1.5x).
      hidden = jnp.finfo(common.softmax_dtype(query.dtype)).min
      causal_bias = jnp.where(masks_lib.causal_mask(query.shape[1], num_kv), 0.0, hidden)
      logits_BHTS = logits(scale_query=True) + causal_bias
      visible, plain = None, True
    else:
      visible = common.visible_mask(mask, is_causal, query.shape[1], num_kv)
      plain = visible is None and alone  # no -inf: the library softmax
      logits_BHTS = logits(scale_query=plain)
  else:
    mods, plain = mods_lib.with_causal(mods, is_causal), False
    logits_BHTS, visible = mods_lib.dense(logits(), mask, mods)
  if plain:
    weights_BHTS = plain_softmax(logits_BHTS)
    lse_BHT = jax.nn.logsumexp(logits_BHTS, axis=-1) if return_residual else None
  else:
    sinks_col = None if sinks is None else sinks.astype(logits_BHTS.dtype)[:, None, None]
    weights_BHTS, lse_BHT = masked_softmax(logits_BHTS, visible, sinks_col)
  if dropout_rate > 0.0:
    weights_BHTS = dropout.drop_weights(weights_BHTS, dropout_rate, dropout_rng)
  return weights_BHTS, lse_BHT


def apply_weights(weights_BHTS, value, kv_layout: str = "BSGK"):
  """[B, H, T, S] x values [B, S, G, V] (or [B, G, S, V]) -> [B, T, H, V]: the product in the
  weights' head-major order, then a transpose of the (small) result."""
  b, h, t, s = weights_BHTS.shape
  g, v = _kv_dims(value, kv_layout)[1], value.shape[-1]
  weights_BHTS = weights_BHTS.astype(value.dtype)
  values = kv_layout.replace("K", "V")
  if g == h:
    out_BHTV = precision.einsum(f"BHTS,{values.replace('G', 'H')}->BHTV", weights_BHTS, value)
  else:
    weights_BGRTS = weights_BHTS.reshape(b, g, h // g, t, s)
    out_BHTV = precision.einsum(f"BGRTS,{values}->BGRTV", weights_BGRTS, value)
    out_BHTV = out_BHTV.reshape(b, h, t, v)
  return out_BHTV.transpose(0, 2, 1, 3)


def attention(query, key, value, bias, mask, *, is_causal, scale, dropout_rate, dropout_rng,
              mods=None, return_residual=False, kv_layout: str = "BSGK"):
  """[B, T, H, V] in the input dtype (and with `return_residual` the lse [B, T, H]), as
  `flax_mha.kernels.reference.attention`; keys and values may be head-major (kv_layout="BGSK",
  a KV cache's layout)."""
  weights_BHTS, lse_BHT = _weights_and_lse(
      query, key, bias, mask, is_causal=is_causal, scale=scale, dropout_rate=dropout_rate,
      dropout_rng=dropout_rng, mods=mods, return_residual=return_residual, kv_layout=kv_layout)
  out_BTHV = apply_weights(weights_BHTS, value, kv_layout)
  return (out_BTHV, lse_BHT.transpose(0, 2, 1)) if return_residual else out_BTHV


MIN_PREFIX = 256  # the "xla" step attends over the smallest of MIN_PREFIX·2^i slots


def prefixes_of(capacity: int) -> list[int]:
  sizes, size = [], MIN_PREFIX
  while size < capacity:
    sizes.append(size)
    size *= 2
  return sizes + [capacity]


def cache_entry(query_BTHK, keys, values, kv_pos, *, q_positions, mask, options, prefixes,
                kv_scales, head_major_attention, **unused):
  """A KV cache's step (layout "cache"): dense over the smallest prefix of slots holding every
  filled one (a lax.switch over static prefixes); without `prefixes` (a rolling cache with its
  chunk), over all. An int8 cache's prefix is dequantized inside its branch, in the product's
  fusion: the branch reads the filled prefix's int8 slots, never the capacity's.
  `head_major_attention` is `flax_mha.attention.attention_head_major` (the entrance a layer
  up, handed in), which builds the prefix's mods and runs this kernel."""
  del unused  # the kernel, the mods and the scale of the other entries
  capacity = keys.shape[2]

  def over(size):
    def prefix_attention(q, k, v, kv_pos, *scales):
      k, v = k[:, :, :size], v[:, :, :size]
      if scales:
        k, v = (quant.dequantize(x, s[:, :, :size], q.dtype) for x, s in zip((k, v), scales))
      return head_major_attention(q, k, v,
                                  None if mask is None else mask[..., :size], is_causal=True,
                                  q_positions=q_positions, kv_positions=kv_pos[:, :size],
                                  **options)
    return prefix_attention

  sizes = prefixes_of(capacity) if prefixes else [capacity]
  operands = (query_BTHK, keys, values, kv_pos, *(kv_scales or ()))
  if len(sizes) == 1:
    return over(sizes[0])(*operands)
  filled = jnp.max(jnp.where(kv_pos >= 0, jnp.arange(capacity) + 1, 0))
  index = jnp.minimum(jnp.searchsorted(jnp.asarray(sizes), filled), len(sizes) - 1)
  return jax.lax.switch(index, [over(size) for size in sizes], *operands)


KERNEL = registry.register(registry.Kernel(
    "xla", attention, summary="the same graph shaped for XLA: the fastest for small "
    "T·S", layouts=("dense", "cache"), entries={"cache": cache_entry}))
