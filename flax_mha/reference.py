"""The reference implementation: plain, readable attention that every faster one is tested against.

Inputs here are already checked and normalised by `flax_mha.attention`:
query [B, T, H, K], key [B, S, G, K], value [B, S, G, V], bias/mask of rank 4 broadcasting to
[B, H, T, S] (or None), `scale` a number, `is_causal` a Python bool. Head h reads key/value head
h // (H // G), as in `jax.nn.dot_product_attention` and torch's `enable_gqa`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from flax_mha import masks as masks_lib

# Hidden logits take this value inside `masked_softmax` (finite: no inf - inf).
MASK_VALUE = float(jnp.finfo(jnp.float32).min)


def softmax_dtype(dtype) -> jnp.dtype:
  """Softmax runs in float32 for 16-bit inputs, in the input dtype otherwise."""
  return jnp.promote_types(dtype, jnp.float32)


def visible_mask(mask, is_causal: bool, num_q: int, num_kv: int):
  """The boolean [.., T, S] mask that `mask` and `is_causal` make together (None: all visible)."""
  causal = masks_lib.causal_mask(num_q, num_kv) if is_causal else None
  return masks_lib.combine_masks(mask, causal)


def attention_logits(query_BTHK, key_BSGK, bias, scale, *, scale_query: bool = False):
  """Scaled logits [B, H, T, S] in the softmax dtype, bias added; GQA without repeating K.

  `scale_query` multiplies the query [T, K] rather than the logits [T, S]: cheaper when nothing
  else touches the logits before the softmax (XLA:CPU fuses a logit scale into a mask or bias
  pass, not into the product). Same value either way, up to rounding.
  """
  b, t, h, k = query_BTHK.shape
  s, g = key_BSGK.shape[1:3]
  f32 = softmax_dtype(query_BTHK.dtype)
  if scale_query:
    query_BTHK = query_BTHK * jnp.asarray(scale, query_BTHK.dtype)
  if g == h:  # plain multi-head: a 4-d product is ~25% faster on CPU than the grouped one
    logits_BHTS = jnp.einsum("BTHK,BSHK->BHTS", query_BTHK, key_BSGK, preferred_element_type=f32)
  else:
    q_BTGRK = query_BTHK.reshape(b, t, g, h // g, k)
    logits_BGRTS = jnp.einsum("BTGRK,BSGK->BGRTS", q_BTGRK, key_BSGK, preferred_element_type=f32)
    logits_BHTS = logits_BGRTS.reshape(b, h, t, s)
  if not scale_query:
    logits_BHTS = logits_BHTS * jnp.asarray(scale, f32)
  if bias is not None:
    logits_BHTS = logits_BHTS + bias.astype(logits_BHTS.dtype)
  return logits_BHTS


def dropout_keep_mask(rng, rate: float, bh, t, s, num_kv: int):
  """Keep-mask for dropout on attention weights, a pure function of (rng, bh, t, s).

  A counter-based hash (murmur3's finaliser) of the flat position, so that any blocking of the
  [B·H, T, S] weight matrix draws the same mask: chunked implementations reproduce the reference
  exactly. `bh`, `t`, `s` are broadcastable integer index arrays; `bh` = b·H + h.
  """
  if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    rng = jax.random.key_data(rng)
  seed = rng.reshape(-1).astype(jnp.uint32)
  pos = t.astype(jnp.uint32) * jnp.uint32(num_kv) + s.astype(jnp.uint32)
  bits = _fmix32(_fmix32(pos ^ seed[0]) + bh.astype(jnp.uint32) * jnp.uint32(0x9E3779B9) ^ seed[-1])
  threshold = min(int(round((1.0 - rate) * 2.0**32)), 2**32 - 1)
  return bits < jnp.uint32(threshold)


def _fmix32(h):
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def attention_weights(query, key, bias, mask, *, is_causal, scale, dropout_rate, dropout_rng):
  """Softmax weights [B, H, T, S] in the softmax dtype, with dropout; fully masked rows are zero."""
  visible = visible_mask(mask, is_causal, query.shape[1], key.shape[1])
  # Scaling the query when the logits get no other elementwise pass: up to 1.15x faster
  # forward+backward at N = 128-512, but slower with a mask (side-by-side runs of both variants,
  # D=64, H=8, on the 2-core CPU).
  scale_query = visible is None and bias is None
  logits_BHTS = attention_logits(query, key, bias, scale, scale_query=scale_query)
  b, h, t, s = logits_BHTS.shape
  if visible is None:
    weights_BHTS = jax.nn.softmax(logits_BHTS, axis=-1)
  else:
    weights_BHTS = masked_softmax(logits_BHTS, visible)
  if dropout_rate > 0.0:
    bh = jnp.arange(b * h).reshape(b, h, 1, 1)
    keep = dropout_keep_mask(
        dropout_rng, dropout_rate, bh, jnp.arange(t)[:, None], jnp.arange(s)[None, :], s)
    weights_BHTS = jnp.where(keep, weights_BHTS / (1.0 - dropout_rate), 0.0)
  return weights_BHTS


@jax.custom_jvp
def masked_softmax(logits, visible):
  """Softmax over the last axis of the `visible` entries; hidden ones, and rows with no visible
  entry at all, get weight 0 (no NaN, no uniform row). The zeroing sits in the softmax's own
  passes: a separate "does this row see a key" reduction and output select cost ~10% of a small
  Transformer's training step on CPU (experiments/benchmark_training.py: 0.95x of flax.linen
  before, 1.07x after)."""
  row_max = jnp.max(jnp.where(visible, logits, MASK_VALUE), axis=-1, keepdims=True)
  unnormalised = jnp.where(visible, jnp.exp(logits - lax.stop_gradient(row_max)), 0.0)
  total = jnp.sum(unnormalised, axis=-1, keepdims=True)
  return unnormalised / jnp.maximum(total, jnp.finfo(logits.dtype).tiny)  # total is 0 or >= 1


@masked_softmax.defjvp
def _masked_softmax_jvp(primals, tangents):
  logits, visible = primals
  weights = masked_softmax(logits, visible)
  logits_dot = tangents[0]
  return weights, weights * (logits_dot - jnp.sum(weights * logits_dot, axis=-1, keepdims=True))


def apply_weights(weights_BHTS, value_BSGV):
  """Weighted sum of values: [B, H, T, S] x [B, S, G, V] -> [B, T, H, V], GQA without repeats.

  The product keeps the weights' head-major order and the result is transposed after: asking
  the product for [B, T, H, V] directly made XLA:CPU's forward ~2x slower at N <= 256.
  """
  b, h, t, s = weights_BHTS.shape
  g, v = value_BSGV.shape[2:]
  weights_BHTS = weights_BHTS.astype(value_BSGV.dtype)
  if g == h:
    out_BHTV = jnp.einsum("BHTS,BSHV->BHTV", weights_BHTS, value_BSGV)
  else:
    weights_BGRTS = weights_BHTS.reshape(b, g, h // g, t, s)
    out_BHTV = jnp.einsum("BGRTS,BSGV->BGRTV", weights_BGRTS, value_BSGV).reshape(b, h, t, v)
  return out_BHTV.transpose(0, 2, 1, 3)


def attention(query, key, value, bias, mask, *, is_causal, scale, dropout_rate, dropout_rng):
  """Reference `softmax(QKᵀ·scale + bias, masked)·V`: [B, T, H, V]; fully masked rows give 0."""
  weights_BHTS = attention_weights(query, key, bias, mask, is_causal=is_causal, scale=scale,
                                   dropout_rate=dropout_rate, dropout_rng=dropout_rng)
  return apply_weights(weights_BHTS, value)
