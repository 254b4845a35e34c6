"""The training loss, shared by the encoder-decoder and the decoder-only runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from experiments.tasks import PAD


def cross_entropy(logits_BTC, targets_BT, label_smoothing: float):
  """(sum of per-token losses, sum of correct argmaxes, number of target tokens), pad excluded.

  logits_BTC: [B, T, C] with C the vocabulary size; targets_BT: [B, T] int ids.

  The loss is the smoothed cross-entropy minus its minimum (the smoothed labels' entropy), so a
  perfect model scores 0 as in flax's wmt example.
  """
  weights_BT = (targets_BT != PAD).astype(jnp.float32)
  labels_BTC = optax.smooth_labels(jax.nn.one_hot(targets_BT, logits_BTC.shape[-1]),
                                   label_smoothing)
  entropy_BT = -jnp.sum(jax.scipy.special.xlogy(labels_BTC, labels_BTC), axis=-1)
  loss_BT = optax.softmax_cross_entropy(logits_BTC, labels_BTC) - entropy_BT
  correct_BT = jnp.argmax(logits_BTC, axis=-1) == targets_BT
  return jnp.sum(loss_BT * weights_BT), jnp.sum(correct_BT * weights_BT), jnp.sum(weights_BT)
