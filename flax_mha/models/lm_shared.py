"""What the decoder's two front ends share (`flax_mha.models.lm`, linen; `lm_nnx`, NNX), with no
flax: the decoding contract both keep (`Decodable`), the embedding of tokens and learned
positions, the output logits, the default positions and the caches. Shapes: B batch, L length,
D d_model, C vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from flax_mha import cache as cache_lib
from flax_mha import checks
from flax_mha.models import tokens as tokens_lib
from flax_mha.models.lm_config import LMConfig


class Decodable:
  """The decoding contract (`flax_mha.models.decoding`) that both DecoderLMs, linen's and
  NNX's, keep with the same three methods: `self(tokens, segment_ids, positions, cache=...)`
  and `self.config` are all they read. (Plain methods: linen leaves them unwrapped, and they
  touch no variable but through the wrapped `__call__`.)"""

  @property
  def position_limit(self) -> int | None:
    """How many positions the model embeds (`LMConfig.position_limit`): generation refuses a
    prompt and max_new_tokens that pass it (`flax_mha.models.decoding.check_positions`)."""
    return self.config.position_limit

  def logits(self, tokens, cache, positions=None):
    """(logits [B, T, C], cache) of T new tokens per row, one document per row (see `DecoderLM`)."""
    if positions is None:
      positions = cache_lib.next_positions(cache[0], tokens.shape[1])
    return self(tokens, None, positions, cache=cache)

  def init_cache(self, tokens, max_length: int, dtype=None, rollback: int = 0):
    """Empty caches, one per layer, for a batch like `tokens` [B, ...] and sequences of up to
    `max_length` tokens (a local layer's cache keeps only its window and sink tokens, and
    `rollback` slots more: what a rollback of that many tokens needs, `KVCache.rollback`)."""
    return kv_caches(self.config, tokens.shape[0], max_length, dtype, rollback)

  def init_paged_cache(self, batch_size: int, num_pages: int, page_size: int,
                       pages_per_row: int, dtype=None, rollback: int = 0):
    """Caches for serving (`flax_mha.serving.server`): the global layers' keys and values in a
    pool of `num_pages` pages of `page_size` tokens (each row owning up to `pages_per_row`,
    assigned by the host), the local layers' in rolling caches of their window (and
    `rollback` slots more, as `init_cache`'s)."""
    return paged_caches(self.config, batch_size, num_pages, page_size, pages_per_row, dtype,
                        rollback)


def embed_tokens(cfg: LMConfig, embed, tokens, positions, position_embed=None):
  """The blocks' input [B, L, D] (linen's and NNX's models alike): the tokens' embeddings
  (an id outside [0, C) NaN), times sqrt(D) with scale_embeddings, plus the learned position
  embeddings with position_embed (a negative position, padding, reads row 0; one >= the
  table's size is refused by name when concrete, and NaN inside `jit`, as a token id outside
  the vocabulary)."""
  x = tokens_lib.embed(embed, tokens, cfg.vocab_size).astype(cfg.dtype)
  if cfg.scale_embeddings:
    x = x * jnp.sqrt(jnp.asarray(cfg.d_model, cfg.dtype))
  if position_embed is not None:
    _check_concrete_positions(positions, cfg.max_positions)
    x = x + tokens_lib.embed(position_embed, jnp.maximum(positions, 0),
                             cfg.max_positions).astype(cfg.dtype)
  return x


def _check_concrete_positions(positions, table_size: int) -> None:
  """Concrete positions (eager calls) below the learned table's size, else a ValueError naming
  the first past it; traced ones (inside `jit`) embed as NaN there."""
  if isinstance(positions, jax.core.Tracer):
    return
  past = np.argwhere(np.asarray(positions) >= table_size)
  if past.size:
    where = tuple(int(i) for i in past[0])
    raise ValueError(f"positions holds {int(np.asarray(positions)[where])} at {where}, past the "
                     f"learned positions' table [0, {table_size}) (LMConfig.max_positions)")


def output_logits(cfg: LMConfig, logits_BLC):
  """The output projection's result as float32 logits: divided by sqrt(D) with scale_logits,
  then soft-capped with final_logit_soft_cap."""
  if cfg.scale_logits:
    logits_BLC = logits_BLC / jnp.sqrt(jnp.asarray(cfg.d_model, cfg.dtype))
  logits_BLC = logits_BLC.astype(jnp.float32)
  cap = cfg.final_logit_soft_cap
  return logits_BLC if cap is None else cap * jnp.tanh(logits_BLC / cap)


def one_document(tokens, segment_ids=None, positions=None):
  """(segment_ids, positions), each defaulting to one document a row at positions 0..L-1."""
  if segment_ids is None:
    segment_ids = jnp.ones(tokens.shape, jnp.int32)
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  return segment_ids, positions


def kv_caches(cfg: LMConfig, batch_size: int, max_length: int, dtype=None,
              rollback: int = 0) -> tuple:
  """`DecoderLM.init_cache`'s caches (shared by the NNX twin, `flax_mha.models.lm_nnx`)."""
  checks.check_int("max_length", max_length)
  g, k, v = cfg.cache_dims
  return tuple(
      cache_lib.KVCache.create(
          batch_size, max_length, g, k, v, dtype or cfg.dtype,
          window=cfg.local_window if cfg.is_local(i) else None,
          sink_tokens=cfg.sink_tokens if cfg.is_local(i) else 0, rollback=rollback)
      for i in range(cfg.num_layers))


def paged_caches(cfg: LMConfig, batch_size: int, num_pages: int, page_size: int,
                 pages_per_row: int, dtype=None, rollback: int = 0) -> tuple:
  """`DecoderLM.init_paged_cache`'s caches (shared by the NNX twin)."""
  g, k, v = cfg.cache_dims
  table = jnp.zeros((batch_size, pages_per_row), jnp.int32)
  return tuple(
      cache_lib.KVCache.create(batch_size, pages_per_row * page_size, g, k, v,
                               dtype or cfg.dtype, window=cfg.local_window,
                               sink_tokens=cfg.sink_tokens, rollback=rollback)
      if cfg.is_local(i) else
      cache_lib.PagedKVCache.create(num_pages, page_size, table, g, k, v, dtype or cfg.dtype)
      for i in range(cfg.num_layers))
