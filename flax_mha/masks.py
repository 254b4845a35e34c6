"""Boolean attention masks (True = attend) that broadcast to [..., H, T, S].

All helpers are jit-compatible: lengths, offsets and segment ids may be traced; sizes are static.
"""

from __future__ import annotations

import jax.numpy as jnp

from flax_mha import checks


def padding_mask(lengths, max_len: int):
  """Valid-token mask [..., L] from lengths [...]: position i is valid when i < length."""
  lengths = jnp.asarray(lengths)
  if not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise TypeError(f"lengths must be integers, got dtype {lengths.dtype}")
  checks.check_int("max_len", max_len, lowest=0)
  return jnp.arange(max_len) < lengths[..., None]


def make_attention_mask(query_valid, key_valid):
  """Pairwise mask [..., 1, T, S] from per-token masks query_valid [..., T] and key_valid [..., S]."""
  query_valid, key_valid = jnp.asarray(query_valid), jnp.asarray(key_valid)
  for name, x in (("query_valid", query_valid), ("key_valid", key_valid)):
    if x.dtype != jnp.bool_:
      raise TypeError(f"{name} must be boolean, got dtype {x.dtype}")
    if x.ndim < 1:
      raise ValueError(f"{name} must have rank >= 1 ([..., length]), got shape {x.shape}")
  return (query_valid[..., None, :, None] & key_valid[..., None, None, :])


def causal_mask(num_q: int, num_kv: int | None = None, offset=0):
  """Causal mask [T, S]: query i (at absolute position i + offset) sees keys j <= i + offset.

  With offset 0 this is the top-left aligned mask of `jax.nn.dot_product_attention(is_causal=True)`
  and torch's SDPA. In KV-cache decoding, `offset` is the number of tokens already cached.
  """
  num_kv = num_q if num_kv is None else num_kv
  q_pos = jnp.arange(num_q)[:, None] + offset
  return jnp.arange(num_kv)[None, :] <= q_pos


def segment_mask(query_segment_ids, key_segment_ids=None):
  """Mask [..., 1, T, S] for packed sequences: tokens attend within their own segment only."""
  key_segment_ids = query_segment_ids if key_segment_ids is None else key_segment_ids
  q, k = jnp.asarray(query_segment_ids), jnp.asarray(key_segment_ids)
  return q[..., None, :, None] == k[..., None, None, :]


def combine_masks(*masks):
  """Logical AND of the given masks, skipping None; None if every mask is None."""
  for i, m in enumerate(masks):  # i is the argument's position, None included
    if m is not None and getattr(m, "dtype", None) != jnp.bool_:
      raise TypeError(
          f"masks[{i}] must be a boolean array, got {getattr(m, 'dtype', type(m).__name__)}")
  present = [m for m in masks if m is not None]
  if not present:
    return None
  out = present[0]
  for m in present[1:]:
    out = jnp.logical_and(out, m)
  return out
