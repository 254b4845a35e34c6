"""The oracle: attention as the formula on the page, untuned. Every other implementation is
tested against it; speed belongs in `flax_mha.kernels.xla` (the tuned plain graph) and `flax_mha.kernels.chunked`.

  scores = score_mods(scale · Q·Kᵀ + bias)
  weights = softmax_s(scores, over visible s)       out = weights · V

Inputs are already checked and normalised by `flax_mha.attention`: query [B, T, H, K], key
[B, S, G, K], value [B, S, G, V], bias/mask of rank 4 broadcasting to [B, H, T, S] (or None).
Query head h reads key/value head h // R (R = H / G), as in `jax.nn.dot_product_attention`.

Semantics every implementation follows: a key is visible when the mask, causality and every mask
term of `mods` (windows, lengths, segment ids, `mask_mod`; see `flax_mha.mods`) allow it and its
score is not -inf; a query row with no visible key gets weights 0 and output 0, with
finite gradients. Products and the softmax run in float32 for 16-bit inputs and in the input
dtype otherwise (float64 stays float64).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flax_mha.kernels import _shared
from flax_mha.kernels import _dropout
from flax_mha import mods as mods_lib


def attention_logits(query_BTHK, key_BSGK, bias, scale):
  """scale · Q·Kᵀ + bias: [B, H, T, S] in the softmax dtype."""
  b, t, h, k = query_BTHK.shape
  s, g = key_BSGK.shape[1:3]
  dtype = _shared.softmax_dtype(query_BTHK.dtype)
  q_BTGRK = query_BTHK.reshape(b, t, g, h // g, k).astype(dtype)
  logits_BGRTS = jnp.einsum("BTGRK,BSGK->BGRTS", q_BTGRK, key_BSGK.astype(dtype))
  logits_BHTS = logits_BGRTS.reshape(b, h, t, s) * scale
  if bias is not None:
    logits_BHTS = logits_BHTS + bias.astype(dtype)
  return logits_BHTS


def softmax_over_visible(scores, visible):
  """Softmax over the last axis of the `visible` entries (None: all) that are not -inf; the rest
  get 0, and a row with no such entry is all 0. Finite scores make no inf or NaN on the way
  (hidden entries are replaced, never shifted), so it passes `jax.debug_infs`."""
  finite = scores > -jnp.inf
  visible = finite if visible is None else visible & finite
  lowest = jnp.finfo(scores.dtype).min
  row_max = jnp.max(jnp.where(visible, scores, lowest), axis=-1, keepdims=True)
  row_max = jax.lax.stop_gradient(row_max)
  unnormalised = jnp.where(visible, jnp.exp(jnp.where(visible, scores, row_max) - row_max), 0.0)
  total = jnp.sum(unnormalised, axis=-1, keepdims=True)
  return unnormalised / jnp.where(total > 0, total, 1.0)


def attention_weights(query, key, bias, mask, *, is_causal, scale, dropout_rate, dropout_rng,
                      mods=None):
  """Weights [B, H, T, S] in the softmax dtype, after dropout."""
  mods = mods_lib.with_causal(mods, is_causal)
  scores_BHTS, visible = mods_lib.dense(attention_logits(query, key, bias, scale), mask, mods)
  weights_BHTS = softmax_over_visible(scores_BHTS, visible)
  if dropout_rate > 0.0:
    weights_BHTS = _dropout.drop_weights(weights_BHTS, dropout_rate, dropout_rng)
  return weights_BHTS


def attention(query, key, value, bias, mask, *, is_causal, scale, dropout_rate, dropout_rng,
              mods=None):
  """`weights · V`: [B, T, H, V] in the input dtype."""
  weights_BHTS = attention_weights(query, key, bias, mask, is_causal=is_causal, scale=scale,
                                   dropout_rate=dropout_rate, dropout_rng=dropout_rng, mods=mods)
  b, h, t, s = weights_BHTS.shape
  g, v = value.shape[2:]
  weights_BGRTS = weights_BHTS.reshape(b, g, h // g, t, s)
  out_BTGRV = jnp.einsum("BGRTS,BSGV->BTGRV", weights_BGRTS, value.astype(weights_BHTS.dtype))
  return out_BTGRV.reshape(b, t, h, v).astype(value.dtype)
