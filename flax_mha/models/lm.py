"""A decoder-only language model in today's style, built on `flax_mha.SelfAttention`: one
configurable decoder whose `LMConfig` describes a family.

Rotary positions, grouped-query attention, local (sliding-window) layers alternating with global
ones as in Gemma 2 / Mistral, pre-norm blocks, tied embeddings, and packed documents: every call
takes segment ids (a token attends only within its document) and positions that restart at each
document. The config's other fields describe the families of Hugging Face checkpoints
(`flax_mha.models.hf` holds their presets and loads them): LayerNorm or RMSNorm (Gemma's
1 + scale), post-norms, GELU / SwiGLU / GeGLU MLPs, biases, tied or separate output embeddings,
learned absolute positions, per-layer windows and rope bases, qk-norm, an attention scale and
a final logit soft cap. Shapes: B batch, L length, D d_model, F d_ff, C vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flax_mha import cache as cache_lib
from flax_mha import checks
from flax_mha import remat as remat_lib
from flax_mha.models import tokens as tokens_lib
from flax_mha.nn import PARAM_AXES as ATTENTION_PARAM_AXES
from flax_mha.nn.linen import SelfAttention, make_norm
from flax_mha.nn.options import AttentionOptions, Norm
from flax_mha.rotary import Rope


# Logical axes of every parameter (see `flax_mha.parallel.sharding`): the attention projections', the
# MLP's Megatron split (mlp_in column-, mlp_out row-parallel), the tied embedding and norms.
PARAM_AXES = ATTENTION_PARAM_AXES + (
    (r"mlp_(in|gate)/kernel$", ("embed", "mlp")),
    (r"mlp_gate/bias$", ("mlp",)),
    (r"mlp_in/bias$", ("mlp",)),
    (r"mlp_out/kernel$", ("mlp", "embed")),
    (r"mlp_out/bias$", ("embed",)),
    (r"position_embed/embedding$", (None, "embed")),
    (r"(^|/)embedding$", ("vocab", "embed")),
    (r"lm_head/kernel$", ("embed", "vocab")),
    (r"norm/(scale|bias)$", ("embed",)),
)


MLPS = ("gelu", "swiglu", "geglu")
POSITIONS = ("rotary", "learned")
LAYER_TYPES = ("local", "global")


@dataclasses.dataclass(frozen=True)
class LMConfig:
  """Architecture only; training settings live in the experiment configs. The defaults are
  this repository's own LM; `flax_mha.models.hf.config_from_hf` fills the rest for a family."""
  vocab_size: int                     # C, special ids included
  d_model: int = 128                  # residual width D
  num_heads: int = 4                  # query heads H
  num_kv_heads: int = 2               # key/value heads G (GQA: H / G queries share one)
  num_layers: int = 4                 # blocks
  d_ff: int = 512                     # MLP width F
  local_window: int | None = 16       # keys a local layer sees before the query (None: all global)
  global_every: int = 2               # every n-th block is global, the others local (Gemma 2: 2)
  rotary_max_wavelength: float = 10_000.0  # RoPE base
  logit_soft_cap: float | None = 50.0  # attention logits capped as in Gemma 2
  normalize_qk: bool | Norm = False   # qk-norm: True for LayerNorm (flax's), or a Norm (Qwen3)
  learned_sinks: bool = False         # a learned sink logit per head joins each softmax (gpt-oss)
  sink_tokens: int = 0                # local layers keep the first n tokens visible (StreamingLLM)
  dropout_rate: float = 0.0           # on block outputs
  dtype: Any = jnp.float32            # computation dtype
  attention_implementation: Any = None  # see flax_mha.dot_product_attention
  remat: str = "none"                 # recomputed in training's backward: flax_mha.remat.POLICIES
  # The fields below describe other families (Hugging Face's); their defaults are this LM's.
  param_dtype: Any = jnp.float32      # parameters' dtype (a bfloat16 checkpoint's stay bfloat16)
  head_dim: int | None = None         # K (None: d_model / num_heads; Gemma's is larger)
  norm: Norm = Norm("layer", 1e-6)    # the blocks' and the final norm
  post_norms: bool = False            # norms on the attention's and the MLP's outputs (Gemma 2, 3)
  mlp: str = "gelu"                   # MLPS: gelu(x·in)·out, or gated silu / gelu (SwiGLU, GeGLU)
  mlp_bias: bool = True               # biases in the MLP
  qkv_bias: bool = False              # biases in the query, key and value projections (Qwen2)
  out_bias: bool = False              # a bias in the attention's output projection
  tie_embeddings: bool = True         # the output projection is the embedding's transpose
  scale_embeddings: bool = True       # embeddings times sqrt(D) on the way in (Gemma)
  scale_logits: bool = True           # logits divided by sqrt(D) on the way out (this LM only)
  final_logit_soft_cap: float | None = None  # cap·tanh(logits / cap) on the logits (Gemma 2)
  positions: str = "rotary"           # POSITIONS: rotary, or learned absolute ones (GPT-2)
  max_positions: int = 0              # learned positions' table size (positions >= it are NaN)
  rope: Rope | None = None            # the global layers' rotary (None: rotary_max_wavelength's)
  local_rope: Rope | None = None      # the local layers' rotary (None: the global layers')
  layer_types: tuple[str, ...] | None = None  # LAYER_TYPES per layer (None: global_every's)
  attention_scale: float | None = None  # the logits' scale (None: 1/sqrt(K))

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "num_layers", "d_ff", "global_every"):
      checks.check_int(f"LMConfig.{name}", getattr(self, name))
    checks.check_heads(self.num_heads, self.num_kv_heads,
                        names=("LMConfig.num_heads", "LMConfig.num_kv_heads"))
    if self.head_dim is None and self.d_model % self.num_heads:
      raise ValueError(f"LMConfig.d_model={self.d_model} must be divisible by "
                       f"num_heads={self.num_heads} (or give head_dim)")
    if self.head_dim is not None:
      checks.check_int("LMConfig.head_dim", self.head_dim)
    if self.local_window is not None:
      checks.check_int("LMConfig.local_window", self.local_window, lowest=0)
    checks.check_int("LMConfig.sink_tokens", self.sink_tokens, lowest=0)
    checks.check_rate("LMConfig.dropout_rate", self.dropout_rate)
    remat_lib.check_policy("LMConfig.remat", self.remat)
    self._check_family_fields()

  def _check_family_fields(self):
    for name, value, allowed in (("mlp", self.mlp, MLPS), ("positions", self.positions, POSITIONS)):
      if value not in allowed:
        raise ValueError(f"LMConfig.{name} must be one of {allowed}, got {value!r}")
    if not isinstance(self.norm, Norm):
      raise TypeError(f"LMConfig.norm must be a flax_mha.Norm, got {type(self.norm).__name__}")
    for name in ("rope", "local_rope"):
      if getattr(self, name) is not None and not isinstance(getattr(self, name), Rope):
        raise TypeError(f"LMConfig.{name} must be a flax_mha.rotary.Rope or None, got "
                        f"{type(getattr(self, name)).__name__}")
    if self.positions == "learned":
      checks.check_int("LMConfig.max_positions (learned positions' table)", self.max_positions)
    if self.layer_types is not None:
      if (not isinstance(self.layer_types, tuple) or len(self.layer_types) != self.num_layers
          or any(t not in LAYER_TYPES for t in self.layer_types)):
        raise ValueError(f"LMConfig.layer_types must be a tuple of num_layers={self.num_layers} "
                         f"entries of {LAYER_TYPES}, got {self.layer_types!r}")
      if "local" in self.layer_types and self.local_window is None:
        raise ValueError("LMConfig.layer_types has local layers: give local_window")
    for name in ("final_logit_soft_cap", "attention_scale"):
      checks.check_positive_real(f"LMConfig.{name}", getattr(self, name), optional=True)

  @property
  def k_dim(self) -> int:
    """The head dim K of queries, keys and values."""
    return self.head_dim or self.d_model // self.num_heads

  def attention_options(self, local: bool) -> AttentionOptions:
    """The options of a local (window and sink tokens) or global layer's attention."""
    rope = None
    if self.positions == "rotary":
      rope = self.rope or Rope(self.rotary_max_wavelength)
      rope = self.local_rope or rope if local else rope
    return AttentionOptions(
        logit_soft_cap=self.logit_soft_cap, rope=rope,
        local_window_size=(self.local_window, 0) if local else None,
        sink_tokens=self.sink_tokens if local else 0, learned_sinks=self.learned_sinks,
        scale=self.attention_scale)

  @property
  def position_limit(self) -> int | None:
    """How many positions the model embeds: the learned table's size, None for rotary (any)."""
    return self.max_positions if self.positions == "learned" else None

  def attention_positions(self, positions, cache):
    """The positions a layer's attention takes: rotary angles, or a cache's slots (learned
    positions are added to the embeddings and the attention has no use for them otherwise)."""
    return positions if self.positions == "rotary" or cache is not None else None

  def is_local(self, layer: int) -> bool:
    """`layer_types[layer]` when given; else layers global_every - 1, 2·global_every - 1, ...
    are global and the rest local."""
    if self.layer_types is not None:
      return self.layer_types[layer] == "local"
    return self.local_window is not None and (layer + 1) % self.global_every != 0


class Block(nn.Module):
  """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x)); with post_norms, each branch's output
  is normalised too (Gemma 2, 3)."""
  config: LMConfig
  local: bool

  def attention(self):
    cfg = self.config
    implementation = remat_lib.attention_implementation(cfg.remat,
                                                        cfg.attention_implementation)
    return SelfAttention(
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
        qkv_features=cfg.num_heads * cfg.k_dim, out_features=cfg.d_model, dtype=cfg.dtype,
        param_dtype=cfg.param_dtype, use_bias=cfg.qkv_bias, out_use_bias=cfg.out_bias,
        normalize_qk=cfg.normalize_qk, attention_options=cfg.attention_options(self.local),
        implementation=implementation, name="attention")

  def norm(self, name: str):
    cfg = self.config
    return make_norm(cfg.norm, dtype=cfg.dtype, param_dtype=cfg.param_dtype, name=name)

  def mlp(self, h):
    """h [B, L, D] -> [B, L, D]: gelu(h·in)·out, or act(h·gate) * (h·in) then ·out."""
    cfg = self.config
    dense = functools.partial(nn.Dense, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                              use_bias=cfg.mlp_bias)
    if cfg.mlp == "gelu":
      return dense(cfg.d_model, name="mlp_out")(nn.gelu(dense(cfg.d_ff, name="mlp_in")(h)))
    act = nn.silu if cfg.mlp == "swiglu" else nn.gelu  # GeGLU: gelu's tanh form, as HF's
    gated = act(dense(cfg.d_ff, name="mlp_gate")(h)) * dense(cfg.d_ff, name="mlp_in")(h)
    return dense(cfg.d_model, name="mlp_out")(gated)

  @nn.compact
  def __call__(self, x, segment_ids, positions, train: bool, *, cache=None):
    """x [B, L, D] -> [B, L, D]; with `cache` (this layer's KVCache): (x, updated cache).
    `train` is static (positional for nn.remat)."""
    cfg = self.config
    drop = nn.Dropout(cfg.dropout_rate, deterministic=not train)
    post = self.norm if cfg.post_norms else lambda name: lambda h: h
    h = self.attention()(self.norm("attention_norm")(x), is_causal=cache is None,
                         segment_ids=segment_ids, positions=cfg.attention_positions(positions, cache),
                         cache=cache)
    if cache is not None:
      h, cache = h
    x = x + drop(post("post_attention_norm")(h))
    h = post("post_mlp_norm")(self.mlp(self.norm("mlp_norm")(x)))
    return x + drop(h) if cache is None else (x + drop(h), cache)


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

  def init_cache(self, tokens, max_length: int, dtype=None):
    """Empty caches, one per layer, for a batch like `tokens` [B, ...] and sequences of up to
    `max_length` tokens (a local layer's cache keeps only its window and sink tokens)."""
    return kv_caches(self.config, tokens.shape[0], max_length, dtype)

  def init_paged_cache(self, batch_size: int, num_pages: int, page_size: int,
                       pages_per_row: int, dtype=None):
    """Caches for serving (`flax_mha.serving.server`): the global layers' keys and values in a
    pool of `num_pages` pages of `page_size` tokens (each row owning up to `pages_per_row`,
    assigned by the host), the local layers' in rolling caches of their window."""
    return paged_caches(self.config, batch_size, num_pages, page_size, pages_per_row, dtype)


class DecoderLM(Decodable, nn.Module):
  """`__call__(tokens [B, L], segment_ids [B, L], positions [B, L]) -> logits [B, L, C]`.

  segment_ids: int, 0 for padding; tokens attend causally within their own segment. Default
    (None): every row one document, all ones.
  positions: int, each token's position within its segment (rotary angles). Default (None):
    0..L-1 in every row.

  Generation (`flax_mha.models.decoding`): `init_cache(tokens, max_length)` makes one KV cache
  per layer (rolling, of the window's size, for local layers) and `logits(tokens, cache,
  positions)` runs T new tokens of one document per row at their positions (default: each
  row's next ones; -1 marks padding) and returns (logits [B, T, C], cache).

  Token ids must lie in [0, vocab_size): an eager call with concrete ids refuses an id outside
  by name (ValueError); inside `jit` ids are traced and not checked: an id outside, negative or
  >= vocab_size, embeds as NaN, so its row's logits are NaN (flax's `nn.Embed` alone would read
  a negative id as row vocab_size + id, finite and wrong). Check ids on the host with
  `flax_mha.checks.check_token_ids` (the experiment runner, generation and serving do). A NaN
  in the activations (a bad id's, or one born in the network) spreads by default through
  attention's weights-times-values product (a hidden key's 0 · NaN = NaN) to every logit of
  its row, other documents included; with
  `attention_implementation=flax_mha.confine_nonfinite()` it stays in the rows that read it,
  at the cost `python -m experiments.bench.confine` measures (docs/benchmark_cpu_confine.md).
  """
  config: LMConfig

  @nn.compact
  def __call__(self, tokens, segment_ids=None, positions=None, *, train: bool = False,
               cache=None):
    cfg = self.config
    checks.check_tokens("tokens", tokens)
    checks.check_concrete_token_ids("tokens", tokens, cfg.vocab_size)
    if cache is None:
      segment_ids, positions = one_document(tokens, segment_ids, positions)
      checks.check_tokens("segment_ids", segment_ids)
      checks.check_tokens("positions", positions)
      if not tokens.shape == segment_ids.shape == positions.shape:
        raise ValueError("tokens, segment_ids and positions must share one shape [B, L], got "
                         f"{tokens.shape}, {segment_ids.shape} and {positions.shape}")
    table = functools.partial(nn.Embed, features=cfg.d_model, param_dtype=cfg.param_dtype,
                              embedding_init=nn.initializers.normal(stddev=1.0))
    embed = table(cfg.vocab_size, name="embed")
    x = embed_tokens(cfg, embed, tokens, positions, (
        table(cfg.max_positions, name="position_embed") if cfg.positions == "learned" else None))
    caches = []
    # `train` is Block's 4th argument (`self` is 0): static under nn.remat.
    block_cls = remat_lib.layer_class(cfg.remat if cache is None else "none", Block, (4,))
    for i in range(cfg.num_layers):
      block = block_cls(cfg, local=cfg.is_local(i), name=f"block_{i}")
      if cache is None:
        x = block(x, segment_ids, positions, train)
      else:
        x, layer_cache = block(x, None, positions, train=train, cache=cache[i])
        caches.append(layer_cache)
    x = make_norm(cfg.norm, dtype=cfg.dtype, param_dtype=cfg.param_dtype, name="final_norm")(x)
    head = embed.attend if cfg.tie_embeddings else nn.Dense(
        cfg.vocab_size, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
        name="lm_head")
    logits_BLC = output_logits(cfg, head(x))
    return logits_BLC if cache is None else (logits_BLC, tuple(caches))


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


def kv_caches(cfg: LMConfig, batch_size: int, max_length: int, dtype=None) -> tuple:
  """`DecoderLM.init_cache`'s caches (shared by the NNX twin, `flax_mha.models.lm_nnx`)."""
  checks.check_int("max_length", max_length)
  k = cfg.k_dim
  return tuple(
      cache_lib.KVCache.create(
          batch_size, max_length, cfg.num_kv_heads, k, k, dtype or cfg.dtype,
          window=cfg.local_window if cfg.is_local(i) else None,
          sink_tokens=cfg.sink_tokens if cfg.is_local(i) else 0)
      for i in range(cfg.num_layers))


def paged_caches(cfg: LMConfig, batch_size: int, num_pages: int, page_size: int,
                 pages_per_row: int, dtype=None) -> tuple:
  """`DecoderLM.init_paged_cache`'s caches (shared by the NNX twin)."""
  k = cfg.k_dim
  table = jnp.zeros((batch_size, pages_per_row), jnp.int32)
  return tuple(
      cache_lib.KVCache.create(batch_size, pages_per_row * page_size, cfg.num_kv_heads, k, k,
                               dtype or cfg.dtype, window=cfg.local_window,
                               sink_tokens=cfg.sink_tokens)
      if cfg.is_local(i) else
      cache_lib.PagedKVCache.create(num_pages, page_size, table, cfg.num_kv_heads, k, k,
                                    dtype or cfg.dtype)
      for i in range(cfg.num_layers))
