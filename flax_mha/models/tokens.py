"""Token ids into embeddings, the same way in every model: an id outside [0, C) embeds as NaN.

flax's `Embed` (linen and NNX) reads its rows with `jnp.take`, whose default mode fills an id
>= C with NaN but wraps a negative one to row C + id: finite logits, silently wrong. Eagerly
the models refuse both by name (`flax_mha.checks.check_concrete_token_ids`); inside `jit` the
ids are traced and cannot be refused, so `embed` makes both loud alike.
"""

from __future__ import annotations

import jax.numpy as jnp


def embed(embedding, tokens, vocab_size: int):
  """embedding(tokens) [..., D] for tokens [...] (ints), NaN in every feature of a token whose
  id lies outside [0, vocab_size), negative ones included; other tokens' rows are untouched."""
  x = embedding(tokens)
  outside = (tokens < 0) | (tokens >= vocab_size)
  return jnp.where(outside[..., None], jnp.nan, x)
