"""Multi-head latent attention (MLA: DeepSeek V2, arXiv:2405.04434; V3): the attention, with
no flax (the layers: `flax_mha.models.mla_linen` and `flax_mha.models.mla_nnx`).

Each token's keys and values come from one latent c = norm(x·kv_down[:, :R]) of width R shared
by every head, and one rotary key k_r = rope(x·kv_down[:, R:]) of width P shared likewise.
Head h's key is (c·key_up[:, h], k_r) and its value c·value_up[:, h]; its query (q_n, q_r),
N + P wide, comes from x through one projection or a low-rank pair with a norm between, its
last P features rotated. Logits are q_n·k_n + q_r·k_r times the scale (`LMConfig.
attention_scale`, default 1/sqrt(N + P); DeepSeek's YaRN sets it).

Two ways compute the same attention. The caches (every kind: full, paged with prefix sharing,
int8) hold the latents only; `attend` chooses:
- **expanded** without a cache (training, a whole forward), and over a cache for a prefill (more
  tokens than a step, `flax_mha.dispatch.is_step`): every head's keys and values are made from
  the latents (a cache's: every slot it has, `flax_mha.cache.write_then_read`, so the
  expansion's cost follows the cache's capacity), and `flax_mha.dot_product_attention` runs H
  heads of N + P and V;
- **absorbed** over a cache for a step of a few tokens (decoding): q_n·(c·key_up) =
  (q_n·key_upᵀ)·c, so the query is absorbed into the latent space, (q_n·key_upᵀ, q_r) of
  R + P, and the step is multi-query attention (one key/value head, G = 1) with keys (c, k_r)
  of R + P and values c of R, through `flax_mha.cache.attend` and its dispatch (`explain` says
  what runs); the outputs [R] go through value_up afterwards.

The cache's values repeat the keys' first R features: 2R + P numbers a token and a layer,
against H·(N + P + V) for the same model's plain cache and R + P for transformers' (a kernel
that read the values out of the keys would save the second R; none here does).

Dimension key: B batch, T tokens, D d_model, H heads, R latent (kv_rank), P rotary (rope_dim),
N the query/key features without rotary (nope_dim), V value head dim, Q the query's rank.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from flax_mha import cache as cache_lib
from flax_mha import dispatch
from flax_mha import precision
from flax_mha.attention import dot_product_attention
from flax_mha.models.lm_config import LMConfig
from flax_mha.nn import shared
from flax_mha.nn.options import Norm
from flax_mha.rotary import Rope, apply_rotary

# Logical axes of the layer's parameters (`flax_mha.parallel.sharding`) beside plain attention's
# (`flax_mha.nn.PARAM_AXES`, which serve `query` and `out`): the up projections split by heads,
# the down projections replicated.
PARAM_AXES = (
    (r"attention/query_up/kernel$", (None, "heads", "head_dim")),
    (r"attention/(key_up|value_up)$", (None, "heads", "head_dim")),
    (r"attention/(query_down|kv_down)/kernel$", ("embed", None)),
    (r"attention/(query_down|kv_down)/bias$", (None,)),
    (r"attention/(query|kv)_norm/scale$", (None,)),
)
# The latent norms' epsilon: DeepSeek's q_a_layernorm and kv_a_layernorm take the default.
LATENT_NORM = Norm("rms", 1e-6, use_bias=False)


def rope_of(cfg: LMConfig) -> Rope:
  """The rotary of the queries' and keys' last P features (every layer global)."""
  return cfg.attention_options(local=False).rope


def attend(cfg: LMConfig, query_BTHQ, latent_BTR, rope_key_BTP, key_up_RHN, value_up_RHV, *,
           segment_ids, positions, cache=None, implementation=None):
  """(out [B, T, H, V], updated cache; None without `cache`) of the projected query [B, T, H,
  N + P] (before rotary), latent [B, T, R] (normalised) and rotary key [B, T, P] (before
  rotary), at `positions` [B, T]: without a cache, expanded, causal within `segment_ids`; over
  `cache` (positions: a negative one is padding), written into it, then absorbed for a step
  of a few tokens (`flax_mha.dispatch.is_step`), else (a prefill) expanded over everything it
  holds."""
  mla, rope = cfg.mla, rope_of(cfg)
  n = mla.nope_dim
  q_nope_BTHN = query_BTHQ[..., :n]
  q_rope_BTHP = apply_rotary(query_BTHQ[..., n:], positions, rope=rope)
  k_rope_BT1P = apply_rotary(rope_key_BTP[:, :, None], positions, rope=rope)
  expand = functools.partial(_expanded, key_up_RHN=key_up_RHN, value_up_RHV=value_up_RHV,
                             scale=scale_of(cfg), implementation=implementation)
  if cache is None:
    return expand(q_nope_BTHN, q_rope_BTHP, latent_BTR, k_rope_BT1P,
                  q_segment_ids=segment_ids, kv_segment_ids=segment_ids), None
  key_BT1E, value_BT1R = latent_entries(latent_BTR, k_rope_BT1P)
  if not dispatch.is_step(query_BTHQ.shape[1]):
    cache, (keys_BS1E, _, kv_pos_BS) = cache_lib.write_then_read(
        cache, key_BT1E, value_BT1R, positions, query_BTHQ.dtype)
    r = mla.kv_rank
    out = expand(q_nope_BTHN, q_rope_BTHP, keys_BS1E[:, :, 0, :r], keys_BS1E[:, :, :, r:],
                 q_positions=positions, kv_positions=kv_pos_BS)
    return cache_lib.nan_past_capacity(out, cache), cache
  query_BTHE = absorbed_query(q_nope_BTHN, q_rope_BTHP, key_up_RHN)
  out_BTHR, cache = cache_lib.attend(query_BTHE, key_BT1E, value_BT1R, cache, positions,
                                     scale=scale_of(cfg), implementation=implementation)
  return precision.einsum("bthr,rhv->bthv", out_BTHR, value_up_RHV), cache


def scale_of(cfg: LMConfig) -> float:
  """The logits' scale: `LMConfig.attention_scale`, else 1/sqrt(N + P)."""
  return cfg.attention_scale or cfg.mla.qk_dim ** -0.5


def latent_entries(latent_BTR, k_rope_BT1P):
  """What the cache holds of each token: (key [B, T, 1, R + P], the latent and the rotated
  rotary key; value [B, T, 1, R], the latent)."""
  latent_BT1R = latent_BTR[:, :, None]
  key = jnp.concatenate([latent_BT1R, k_rope_BT1P.astype(latent_BT1R.dtype)], axis=-1)
  return key, latent_BT1R


def absorbed_query(q_nope_BTHN, q_rope_BTHP, key_up_RHN):
  """The step's query [B, T, H, R + P]: its first N features absorbed through key_up into the
  latent space, then its rotated P."""
  q_latent_BTHR = precision.einsum("bthn,rhn->bthr", q_nope_BTHN, key_up_RHN)
  return jnp.concatenate([q_latent_BTHR, q_rope_BTHP.astype(q_latent_BTHR.dtype)], axis=-1)


def _expanded(q_nope_BTHN, q_rope_BTHP, latent_BSR, k_rope_BS1P, *, key_up_RHN, value_up_RHV,
              scale, implementation, **visible):
  """Every head's keys and values made from the S latents, then plain causal attention of the
  T queries over them (`visible`: segment ids, or the queries' and slots' positions)."""
  h = key_up_RHN.shape[1]
  k_nope_BSHN = precision.einsum("bsr,rhn->bshn", latent_BSR, key_up_RHN)
  value_BSHV = precision.einsum("bsr,rhv->bshv", latent_BSR, value_up_RHV)
  k_rope_BSHP = jnp.broadcast_to(k_rope_BS1P, (*k_rope_BS1P.shape[:2], h, k_rope_BS1P.shape[-1]))
  query = jnp.concatenate([q_nope_BTHN, q_rope_BTHP.astype(q_nope_BTHN.dtype)], axis=-1)
  key = jnp.concatenate([k_nope_BSHN, k_rope_BSHP.astype(k_nope_BSHN.dtype)], axis=-1)
  return dot_product_attention(query, key, value_BSHV, is_causal=True, scale=scale,
                               implementation=implementation, **visible)


def explain(cfg: LMConfig, cache, num_tokens: int = 1, *, platform: str | None = None,
            implementation=None) -> str:
  """What a cached call of `num_tokens` tokens a row runs in a latent-attention layer, and why:
  a prefill's expanded attention, or the absorbed multi-query step's dispatch over `cache`
  (`flax_mha.cache.explain`, nothing computed)."""
  _, key_dim, value_dim = cfg.cache_dims
  if not dispatch.is_step(num_tokens):
    return (f"latent attention, expanded: T = {num_tokens} tokens > FEW_QUERIES = "
            f"{dispatch.FEW_QUERIES}, a prefill: every slot's latent is expanded into "
            f"{cfg.num_heads} heads' keys and values, then dot_product_attention (its own "
            "choice runs)")
  rows = cache.length.shape[0]
  query = jax.ShapeDtypeStruct((rows, num_tokens, cfg.num_heads, key_dim), cfg.dtype)
  positions = jax.ShapeDtypeStruct((rows, num_tokens), jnp.int32)
  told = cache_lib.explain(query, cache, positions, platform=platform,
                           scale=scale_of(cfg),
                           implementation=implementation)
  return (f"latent attention, absorbed: {cfg.num_heads} query heads over one latent head (keys "
          f"{key_dim} = R + P, values {value_dim} = R); {told.implementation}: {told.reason}")


def check_call(cfg: LMConfig, inputs, cache, is_causal: bool) -> None:
  """What a latent layer's call takes (both front ends'): causal attention; a `KVCache` or
  `PagedKVCache` of one head of R + P and R (as `DecoderLM.init_cache` makes it) for inputs
  [B, T, D] of its batch."""
  if cache is None:
    if not is_causal:
      raise ValueError("latent attention is causal: is_causal must be True without a cache")
    return
  shared.check_cache_call(cache, keys_from_q=True, inputs_q=inputs, q_segment_ids=None,
                          kv_segment_ids=None, kv_positions=None, bias=None, mask=None,
                          window=None, sink_tokens=0)
  paged = isinstance(cache, cache_lib.PagedKVCache)
  key, value = (cache.k_pages, cache.v_pages) if paged else (cache.key, cache.value)
  heads = key.shape[2] if paged else key.shape[1]
  got = (heads, key.shape[-1], value.shape[-1])
  if got != cfg.cache_dims:
    raise ValueError(f"a latent attention layer's cache must hold (heads, key dim, value dim) "
                     f"= {cfg.cache_dims} (1, R + P, R), got {got}: make it with the model's "
                     "init_cache or init_paged_cache")
