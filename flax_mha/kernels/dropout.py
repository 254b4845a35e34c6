"""Dropout on attention weights as a pure function of position: every implementation drops the same.

The keep-mask is a counter-based hash (murmur3's 32-bit finaliser) of (rng, b·H + h, t, s), so any
blocking of the [B·H, T, S] weight matrix (the whole matrix, tiles, ring shards) draws the same
mask without materialising it, and implementations can be compared exactly with dropout on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def keep_mask(rng, rate: float, bh, t, s, num_kv: int):
  """Boolean keep-mask (True = keep, probability 1 - rate) at broadcastable integer indices.

  `bh` = b·H + h, `t` the query position, `s` the key position, `num_kv` = S (static).
  """
  if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    rng = jax.random.key_data(rng)
  seed = rng.reshape(-1).astype(jnp.uint32)
  pos = t.astype(jnp.uint32) * jnp.uint32(num_kv) + s.astype(jnp.uint32)
  bits = _fmix32(_fmix32(pos ^ seed[0]) + bh.astype(jnp.uint32) * jnp.uint32(0x9E3779B9) ^ seed[-1])
  threshold = min(int(round((1.0 - rate) * 2.0**32)), 2**32 - 1)
  return bits < jnp.uint32(threshold)


def apply(weights, rate: float, keep):
  """Inverted dropout: kept weights scaled by 1 / (1 - rate), dropped ones 0."""
  return jnp.where(keep, weights * (1.0 / (1.0 - rate)), 0.0)


def drop_weights(weights_BHTS, rate: float, rng):
  """Dropout on a whole weight matrix [B, H, T, S] (what tiled implementations do tile by tile)."""
  b, h, t, s = weights_BHTS.shape
  bh = jnp.arange(b * h).reshape(b, h, 1, 1)
  keep = keep_mask(rng, rate, bh, jnp.arange(t)[:, None], jnp.arange(s)[None, :], s)
  return apply(weights_BHTS, rate, keep)


def _fmix32(h):
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)
