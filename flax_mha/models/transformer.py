"""The encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

Built on `flax_mha.MultiHeadAttention`. Shapes: B batch, S source length, T target length,
D d_model, F d_ff, C vocabulary size. Token id conventions live in `TransformerConfig` (pad 0,
bos 1, eos 2).

Attention weights, with `sow_weights=True` and `mutable=['intermediates']`, are sown at

  encoder/layer_{i}/self_attention/attention_weights   [B, H, S, S]
  decoder/layer_{i}/self_attention/attention_weights   [B, H, T, T]
  decoder/layer_{i}/cross_attention/attention_weights  [B, H, T, S]

(each a 1-tuple, as `Module.sow` stores it).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flax_mha import cache as cache_lib
from flax_mha import checks
from flax_mha import masks as masks_lib
from flax_mha import precision
from flax_mha import remat as remat_lib
from flax_mha.models import decoding
from flax_mha.models import tokens as tokens_lib
from flax_mha.nn import PARAM_AXES as ATTENTION_PARAM_AXES
from flax_mha.nn.linen import MultiHeadAttention


# Logical axes of every parameter (see `flax_mha.parallel.sharding`): the attention projections', the
# FFN's Megatron split (Dense_0 column-, Dense_1 row-parallel), embeddings and norms.
PARAM_AXES = ATTENTION_PARAM_AXES + (
    (r"Dense_0/kernel$", ("embed", "mlp")),
    (r"Dense_0/bias$", ("mlp",)),
    (r"Dense_1/kernel$", ("mlp", "embed")),
    (r"Dense_1/bias$", ("embed",)),
    (r"(^|/)embedding$", ("vocab", "embed")),
    (r"pos_embedding$", ("length", "embed")),
    (r"logits/kernel$", ("embed", "vocab")),
    (r"logits/bias$", ("vocab",)),
    (r"norm/(scale|bias)$", ("embed",)),
)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Architecture only; training settings live in the experiment configs."""
  vocab_size: int                    # shared source/target vocabulary, special ids included
  d_model: int = 128                 # residual stream width D
  num_heads: int = 4                 # query heads H (d_model / H per head)
  num_kv_heads: int | None = None    # key/value heads G for GQA/MQA; None = H (plain MHA)
  num_encoder_layers: int = 2        # the paper's base model has 6; 2 suits toy tasks
  num_decoder_layers: int = 2        # likewise
  d_ff: int = 512                    # FFN hidden width F (the paper uses 4·D)
  dropout_rate: float = 0.1          # on embeddings+positions and every sublayer output
  attention_dropout_rate: float = 0.0  # on attention weights (the paper uses none)
  max_len: int = 256                 # longest sequence the position table covers
  pre_layer_norm: bool = False       # False: the paper's post-LN; True: pre-LN + final norm
  learned_positions: bool = False    # False: the paper's sinusoids; True: a learned table
  share_embeddings: bool = True      # one embedding for source, target and output projection
  pad_id: int = 0                    # masked out of attention; fills decodes after eos
  bos_id: int = 1                    # first decoder input (targets are shifted right)
  eos_id: int = 2                    # ends a target; decoding stops there
  dtype: Any = jnp.float32           # computation dtype; params stay float32
  # None (its default choice), a name in flax_mha.IMPLEMENTATIONS or a callable with their
  # signature: passed through to flax_mha.dot_product_attention, which checks it.
  attention_implementation: str | Callable | None = None
  attention_cls: Any = MultiHeadAttention      # swappable for baselines (same call signature)
  # What training recomputes in the backward (flax_mha.remat.POLICIES): "none", "layer" (each
  # encoder/decoder layer) or "attention" (the attention call only). Values are unchanged.
  remat: str = "none"

  def __post_init__(self):
    positive = ("vocab_size", "d_model", "num_encoder_layers", "num_decoder_layers", "d_ff",
                "max_len")
    for name in positive:
      checks.check_int(f"TransformerConfig.{name}", getattr(self, name))
    kv = self.num_heads if self.num_kv_heads is None else self.num_kv_heads
    checks.check_heads(self.num_heads, kv, names=("TransformerConfig.num_heads",
                                                   "TransformerConfig.num_kv_heads"))
    if self.d_model % self.num_heads:
      raise ValueError(f"TransformerConfig.d_model={self.d_model} must be divisible by "
                       f"num_heads={self.num_heads}")
    for name in ("dropout_rate", "attention_dropout_rate"):
      checks.check_rate(f"TransformerConfig.{name}", getattr(self, name))
    remat_lib.check_policy("TransformerConfig.remat", self.remat)
    ids = {"pad_id": self.pad_id, "bos_id": self.bos_id, "eos_id": self.eos_id}
    for name, value in ids.items():
      if not 0 <= value < self.vocab_size:
        raise ValueError(f"TransformerConfig.{name}={value} must be in [0, vocab_size="
                         f"{self.vocab_size})")
    if len(set(ids.values())) != 3:
      raise ValueError(f"TransformerConfig pad/bos/eos ids must differ, got {ids}")

  def replace(self, **changes) -> "TransformerConfig":
    return dataclasses.replace(self, **changes)


def sinusoidal_positions(max_len: int, d_model: int) -> np.ndarray:
  """The paper's table [max_len, D]: sin on even features, cos on odd, wavelengths to 10000·2π."""
  pos = np.arange(max_len)[:, None]
  inv_freq = np.exp(-np.log(10000.0) * np.arange(0, d_model, 2) / d_model)
  table = np.zeros((max_len, d_model), np.float32)
  table[:, 0::2] = np.sin(pos * inv_freq)
  table[:, 1::2] = np.cos(pos * inv_freq[: d_model // 2])
  return table


class AddPositions(nn.Module):
  """x [B, L, D] + the position table at arange(L), or at `positions` [B, L] (generation: each
  row's own positions; a negative one, padding, reads position 0)."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, x, positions=None):
    cfg = self.config
    length = x.shape[-2]
    if positions is None and length > cfg.max_len:
      raise ValueError(f"sequence length {length} exceeds TransformerConfig.max_len={cfg.max_len}")
    if cfg.learned_positions:
      table = self.param("pos_embedding", nn.initializers.normal(0.02), (cfg.max_len, cfg.d_model))
    else:
      table = jnp.asarray(sinusoidal_positions(cfg.max_len, cfg.d_model))
    rows = table[:length] if positions is None else table[jnp.maximum(positions, 0)]
    return x + rows.astype(x.dtype)


class FeedForward(nn.Module):
  """Position-wise FFN: Dense(F) -> ReLU -> Dense(D)."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    dense = functools.partial(nn.Dense, dtype=cfg.dtype, **precision.layer_keywords(nn.Dense))
    return dense(cfg.d_model, name="Dense_1")(nn.relu(dense(cfg.d_ff, name="Dense_0")(x)))


class Residual(nn.Module):
  """Post-LN `LN(x + drop(f(x)))` (the paper) or pre-LN `x + drop(f(LN(x)))`."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, x, sublayer, *, train: bool):
    cfg = self.config
    norm = nn.LayerNorm(dtype=cfg.dtype, name="norm")
    drop = nn.Dropout(cfg.dropout_rate, deterministic=not train)
    if cfg.pre_layer_norm:
      return x + drop(sublayer(norm(x)))
    return norm(x + drop(sublayer(x)))


def _attention(cfg: TransformerConfig, name: str):
  implementation = remat_lib.attention_implementation(cfg.remat, cfg.attention_implementation)
  return cfg.attention_cls(
      num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
      dropout_rate=cfg.attention_dropout_rate, dtype=cfg.dtype,
      implementation=implementation, name=name)


class EncoderLayer(nn.Module):
  config: TransformerConfig

  @nn.compact
  def __call__(self, x, mask, train: bool, sow_weights: bool):
    """x [B, S, D] -> [B, S, D]; `train` and `sow_weights` static (positional for nn.remat)."""
    cfg = self.config
    attn = _attention(cfg, "self_attention")
    x = Residual(cfg, name="attention_block")(
        x, lambda y: attn(y, mask=mask, deterministic=not train, sow_weights=sow_weights),
        train=train)
    return Residual(cfg, name="ffn_block")(x, FeedForward(cfg, name="ffn"), train=train)


class DecoderLayer(nn.Module):
  config: TransformerConfig

  @nn.compact
  def __call__(self, x, memory, self_mask, cross_mask, train: bool, sow_weights: bool, *,
               cache=None):
    """x [B, T, D] -> [B, T, D]; with `cache` (its self-attention KVCache): (x, cache)."""
    cfg = self.config
    self_attn = _attention(cfg, "self_attention")
    cross_attn = _attention(cfg, "cross_attention")
    caches = []

    def self_attention(y):
      if cache is None:
        return self_attn(y, mask=self_mask, is_causal=True, deterministic=not train,
                         sow_weights=sow_weights)
      y, new_cache = self_attn(y, deterministic=not train, cache=cache)
      caches.append(new_cache)
      return y

    x = Residual(cfg, name="self_attention_block")(x, self_attention, train=train)
    x = Residual(cfg, name="cross_attention_block")(
        x, lambda y: cross_attn(y, memory, mask=cross_mask, deterministic=not train,
                                sow_weights=sow_weights), train=train)
    x = Residual(cfg, name="ffn_block")(x, FeedForward(cfg, name="ffn"), train=train)
    return x if cache is None else (x, caches[0])


class Stack(nn.Module):
  """Embedding (scaled by √D) + positions + dropout, then layers, then (pre-LN) a final norm."""
  config: TransformerConfig
  layer: Any                 # EncoderLayer or DecoderLayer
  num_layers: int
  embed: nn.Module

  @nn.compact
  def __call__(self, tokens, *layer_args, train: bool, sow_weights: bool, caches=None,
               positions=None):
    """The stack's output [B, L, D]; with `caches` (one per layer): (output, caches)."""
    cfg = self.config
    x = tokens_lib.embed(self.embed, tokens, cfg.vocab_size).astype(cfg.dtype) * jnp.sqrt(
        jnp.asarray(cfg.d_model, cfg.dtype))
    x = AddPositions(cfg, name="positions")(x, positions)
    x = nn.Dropout(cfg.dropout_rate, deterministic=not train)(x)
    new_caches = []
    # train and sow_weights follow the layer_args; counted from `self`, which is 0.
    layer_cls = remat_lib.layer_class(cfg.remat if caches is None else "none", self.layer,
                                      (len(layer_args) + 2, len(layer_args) + 3))
    for i in range(self.num_layers):
      layer = layer_cls(cfg, name=f"layer_{i}")
      if caches is None:
        x = layer(x, *layer_args, train, sow_weights)
      else:
        x, layer_cache = layer(x, *layer_args, train=train, sow_weights=sow_weights,
                               cache=caches[i])
        new_caches.append(layer_cache)
    if cfg.pre_layer_norm:
      x = nn.LayerNorm(dtype=cfg.dtype, name="final_norm")(x)
    return x if caches is None else (x, tuple(new_caches))


class Transformer(nn.Module):
  """Encoder-decoder Transformer: `__call__(src [B, S], tgt_in [B, T]) -> logits [B, T, C]`.

  Token ids must lie in [0, vocab_size): an eager call with concrete ids refuses an id outside
  by name (ValueError); inside `jit` they are not checked: an id outside, negative or >=
  vocab_size, embeds as NaN (flax's `nn.Embed` alone would read a negative id as row
  vocab_size + id, finite and wrong). `flax_mha.models.decoding` and
  the experiment runner check ids on the host (`flax_mha.checks.check_token_ids`). A NaN in
  the activations reaches, by default, every position of its row through attention (a masked
  key's 0 · NaN = NaN); `attention_implementation=flax_mha.confine_nonfinite()` keeps it
  in the positions that attend to it (see `flax_mha.confine_nonfinite` for the cost).
  """
  config: TransformerConfig

  def setup(self):
    cfg = self.config
    embed = functools.partial(
        nn.Embed, cfg.vocab_size, cfg.d_model,
        embedding_init=nn.initializers.normal(stddev=cfg.d_model**-0.5))
    self.tgt_embed = embed(name="embed" if cfg.share_embeddings else "tgt_embed")
    self.src_embed = self.tgt_embed if cfg.share_embeddings else embed(name="src_embed")
    if not cfg.share_embeddings:
      self.logits_dense = nn.Dense(cfg.vocab_size, dtype=cfg.dtype,
                                   **precision.layer_keywords(nn.Dense), name="logits")
    self.encoder = Stack(cfg, EncoderLayer, cfg.num_encoder_layers, self.src_embed)
    self.decoder = Stack(cfg, DecoderLayer, cfg.num_decoder_layers, self.tgt_embed)

  def __call__(self, src, tgt_in, *, train: bool = False, sow_weights: bool = False):
    memory, src_valid = self.encode(src, train=train, sow_weights=sow_weights)
    return self.decode(tgt_in, memory, src_valid, train=train, sow_weights=sow_weights)

  def encode(self, src, *, train: bool = False, sow_weights: bool = False):
    """src [B, S] int -> (memory [B, S, D], src_valid [B, S] bool)."""
    checks.check_tokens("src", src)
    checks.check_concrete_token_ids("src", src, self.config.vocab_size)
    src_valid = src != self.config.pad_id
    mask = masks_lib.make_attention_mask(src_valid, src_valid)
    return self.encoder(src, mask, train=train, sow_weights=sow_weights), src_valid

  def decode(self, tgt_in, memory, src_valid, *, train: bool = False, sow_weights: bool = False):
    """tgt_in [B, T] int (shifted right), memory [B, S, D] -> logits [B, T, C] float32."""
    checks.check_tokens("tgt_in", tgt_in)
    checks.check_concrete_token_ids("tgt_in", tgt_in, self.config.vocab_size)
    cfg = self.config
    # Padding sits at the end of targets, so the causal mask already hides it from real queries;
    # the key-padding mask is for the (unused) rows of pad queries.
    self_mask = (tgt_in != cfg.pad_id)[:, None, None, :]
    x_BTD = self.decoder(tgt_in, memory, self_mask, src_valid[:, None, None, :], train=train,
                         sow_weights=sow_weights)
    return self._logits(x_BTD)

  def init_cache(self, src, max_length: int, dtype=None):
    """The decoding state for `flax_mha.models.decoding`: the source encoded once, and one
    self-attention KV cache per decoder layer for targets of up to `max_length` tokens."""
    cfg = self.config
    checks.check_int("max_length", max_length, highest=cfg.max_len)
    memory, src_valid = self.encode(src)
    g = cfg.num_heads if cfg.num_kv_heads is None else cfg.num_kv_heads
    k = cfg.d_model // cfg.num_heads
    layers = tuple(cache_lib.KVCache.create(src.shape[0], max_length, g, k, k, dtype or cfg.dtype)
                   for _ in range(cfg.num_decoder_layers))
    return {"memory": memory, "src_valid": src_valid, "layers": layers}

  def logits(self, tokens, cache, positions=None):
    """(logits [B, T, C], cache) of T new target tokens per row at `positions` (default: each
    row's next ones), attending to the cached ones and the encoded source."""
    checks.check_tokens("tokens", tokens)
    checks.check_concrete_token_ids("tokens", tokens, self.config.vocab_size)
    if positions is None:
      positions = cache_lib.next_positions(cache["layers"][0], tokens.shape[1])
    x_BTD, layers = self.decoder(tokens, cache["memory"], None,
                                 cache["src_valid"][:, None, None, :], train=False,
                                 sow_weights=False, caches=cache["layers"], positions=positions)
    return self._logits(x_BTD), dict(cache, layers=layers)

  def _logits(self, x_BTD):
    """The output projection: the shared embedding's transpose, or its own dense layer."""
    logits_BTC = (precision.attend(x_BTD, self.tgt_embed.embedding)
                  if self.config.share_embeddings else self.logits_dense(x_BTD))
    return logits_BTC.astype(jnp.float32)


# Decoding's conveniences for this model (`flax_mha.models.decoding`): from its bos token, to
# its eos.

def greedy_decode(config: TransformerConfig | Transformer, params, src, *, max_len: int,
                  cache_dtype=None):
  """Greedy decoding: src [B, S] int -> tokens [B, max_len] int32. `config` may be the model;
  `cache_dtype` as in `generate`."""
  model, src = _transformer(config, src, max_len)
  return decoding.generate(model, {"params": params}, (src,), _bos(model, src), max_new_tokens=max_len,
                  stop_tokens=(model.config.eos_id,), pad_id=model.config.pad_id,
                  cache_dtype=cache_dtype)


def beam_search(config: TransformerConfig | Transformer, params, src, *, max_len: int,
                beam_size: int = 4, alpha: float = 0.6, cache_dtype=None):
  """Beam search with the GNMT length penalty ((5 + len) / 6)^alpha; returns the best beam.

  src [B, S] int -> tokens [B, max_len] int32. `beam_size=1` is greedy decoding; `cache_dtype`
  as in `generate`.
  """
  model, src = _transformer(config, src, max_len)
  return decoding.generate_beam(model, {"params": params}, (src,), _bos(model, src),
                       max_new_tokens=max_len, beam_size=beam_size, alpha=alpha,
                       stop_tokens=(model.config.eos_id,), pad_id=model.config.pad_id,
                       cache_dtype=cache_dtype)


def _transformer(config, src, max_len):
  """The inference model (no dropout) for `config` (or a model), after checking the arguments."""
  config = config.config if isinstance(config, Transformer) else config
  if not isinstance(config, TransformerConfig):
    raise TypeError(
        f"config must be a TransformerConfig or Transformer, got {type(config).__name__}")
  checks.check_tokens("src", src)
  if not isinstance(src, jax.core.Tracer):  # under jit the ids are traced: the caller's job
    checks.check_token_ids("src", src, config.vocab_size)
  checks.check_int("max_len", max_len, highest=config.max_len)
  return Transformer(config.replace(dropout_rate=0.0, attention_dropout_rate=0.0)), src


def _bos(model: Transformer, src):
  return jnp.full((src.shape[0], 1), model.config.bos_id, jnp.int32)
