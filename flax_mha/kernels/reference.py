"""The oracle: attention as the formula on the page, untuned. Every other implementation is
tested against it; speed belongs in `flax_mha.kernels.xla` (the tuned plain graph) and `flax_mha.kernels.chunked`.

  scores = score_mods(scale · Q·Kᵀ + bias)
  weights = softmax_s(scores, over visible s [and the head's sink])      out = weights · V
  lse = log Σ_visible exp(scores) [+ exp(sink)]     (the residual: finfo.min for an empty row)

Inputs are already checked and normalised by `flax_mha.attention`: query [B, T, H, K], key
[B, S, G, K], value [B, S, G, V], bias/mask of rank 4 broadcasting to [B, H, T, S] (or None).
Query head h reads key/value head h // R (R = H / G), as in `jax.nn.dot_product_attention`.

Semantics every implementation follows: a key is visible when the mask, causality and every mask
term of `mods` (windows, lengths, segment ids, `mask_mod`; see `flax_mha.mods`) allow it and its
score is not -inf; a query row with no visible key gets weights 0 and output 0, with
finite gradients. An attention sink (one logit per query head, `mods.sinks`) is one more entry
of every row's softmax, with no value: it takes weight from the keys. Products and the softmax run in float32 for 16-bit inputs and in the input
dtype otherwise (float64 stays float64).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flax_mha.kernels import common
from flax_mha.kernels import dropout
from flax_mha import mods as mods_lib
from flax_mha.kernels import registry


def attention_logits(query_BTHK, key_BSGK, bias, scale):
  """scale · Q·Kᵀ + bias: [B, H, T, S] in the softmax dtype."""
  b, t, h, k = query_BTHK.shape
  s, g = key_BSGK.shape[1:3]
  dtype = common.softmax_dtype(query_BTHK.dtype)
  q_BTGRK = query_BTHK.reshape(b, t, g, h // g, k).astype(dtype)
  logits_BGRTS = jnp.einsum("BTGRK,BSGK->BGRTS", q_BTGRK, key_BSGK.astype(dtype))
  logits_BHTS = logits_BGRTS.reshape(b, h, t, s) * scale
  if bias is not None:
    logits_BHTS = logits_BHTS + bias.astype(dtype)
  return logits_BHTS


def softmax_over_visible(scores, visible, sinks=None):
  """(weights, lse): the softmax over the last axis of the `visible` entries (None: all) that
  are not -inf, and its log-sum-exp [...]. Hidden entries get 0; a row with nothing visible is
  all 0 with lse finfo.min. `sinks` [H] (scores being [B, H, T, S]) join each row's softmax as
  one more entry, always visible, whose weight is dropped. Finite scores make no inf or NaN on
  the way (hidden entries are replaced, never shifted), so it passes `jax.debug_infs`."""
  finite = scores > -jnp.inf
  visible = finite if visible is None else visible & finite
  if sinks is not None:  # the sink as a last column, seen by every row
    rows, s = scores.shape[:-1], scores.shape[-1]
    column = jnp.broadcast_to(sinks.astype(scores.dtype)[:, None, None], (*rows, 1))
    scores = jnp.concatenate([scores, column], axis=-1)
    visible = jnp.concatenate([jnp.broadcast_to(visible, (*rows, s)),
                               jnp.ones((*rows, 1), bool)], axis=-1)
  lowest = jnp.finfo(scores.dtype).min
  row_max = jnp.max(jnp.where(visible, scores, lowest), axis=-1, keepdims=True)
  row_max = jax.lax.stop_gradient(row_max)
  unnormalised = jnp.where(visible, jnp.exp(jnp.where(visible, scores, row_max) - row_max), 0.0)
  total = jnp.sum(unnormalised, axis=-1, keepdims=True)
  weights = unnormalised / jnp.where(total > 0, total, 1.0)
  lse = common.row_lse(row_max, total)[..., 0]
  return (weights if sinks is None else weights[..., :-1]), lse


def _weights_and_lse(query, key, bias, mask, *, is_causal, scale, dropout_rate, dropout_rng,
                     mods=None):
  """(weights [B, H, T, S] after dropout, lse [B, H, T]) in the softmax dtype."""
  mods = mods_lib.with_causal(mods, is_causal)
  scores_BHTS, visible = mods_lib.dense(attention_logits(query, key, bias, scale), mask, mods)
  weights_BHTS, lse_BHT = softmax_over_visible(scores_BHTS, visible, mods.sinks)
  if dropout_rate > 0.0:
    weights_BHTS = dropout.drop_weights(weights_BHTS, dropout_rate, dropout_rng)
  return weights_BHTS, lse_BHT


def attention_weights(query, key, bias, mask, *, is_causal, scale, dropout_rate, dropout_rng,
                      mods=None):
  """Weights [B, H, T, S] in the softmax dtype, after dropout."""
  return _weights_and_lse(query, key, bias, mask, is_causal=is_causal, scale=scale,
                          dropout_rate=dropout_rate, dropout_rng=dropout_rng, mods=mods)[0]


def attention(query, key, value, bias, mask, *, is_causal, scale, dropout_rate, dropout_rng,
              mods=None, return_residual=False):
  """`weights · V`: [B, T, H, V] in the input dtype; with `return_residual`, also the lse
  [B, T, H] in the softmax dtype."""
  weights_BHTS, lse_BHT = _weights_and_lse(
      query, key, bias, mask, is_causal=is_causal, scale=scale, dropout_rate=dropout_rate,
      dropout_rng=dropout_rng, mods=mods)
  b, h, t, s = weights_BHTS.shape
  g, v = value.shape[2:]
  weights_BGRTS = weights_BHTS.reshape(b, g, h // g, t, s)
  out_BTGRV = jnp.einsum("BGRTS,BSGV->BTGRV", weights_BGRTS, value.astype(weights_BHTS.dtype))
  out_BTHV = out_BTGRV.reshape(b, t, h, v).astype(value.dtype)
  return (out_BTHV, lse_BHT.transpose(0, 2, 1)) if return_residual else out_BTHV


KERNEL = registry.register(registry.Kernel(
    "reference", attention, summary="the oracle: the formula on the page, untuned"))
