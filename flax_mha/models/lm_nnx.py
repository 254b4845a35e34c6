"""`DecoderLM` as an NNX module, built on `flax_mha.nnx.SelfAttention`.

The linen model's architecture (`flax_mha.models.lm`: rotary positions, GQA, local and global
layers, soft-capped logits, sinks) and its parameter tree, path for path: `load_linen_params`
takes a linen `DecoderLM`'s variables. It is decodable (`init_cache`, `init_paged_cache`,
`logits`): `flax_mha.models.decoding` and `serving` take it with `params` None. Dropout and
remat are the linen model's only (refused here). Shapes: B batch, L length, D d_model, C
vocabulary.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from flax_mha import checks
from flax_mha.models import tokens as tokens_lib
from flax_mha.models import lm
from flax_mha.models.lm import LMConfig
from flax_mha.nn.nnx import SelfAttention


class Block(nnx.Module):
  """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x)), as `flax_mha.models.lm.Block`."""

  def __init__(self, cfg: LMConfig, local: bool, *, rngs: nnx.Rngs):
    d = cfg.d_model
    self.attention_norm = nnx.LayerNorm(d, dtype=cfg.dtype, rngs=rngs)
    self.attention = SelfAttention(
        cfg.num_heads, d, num_kv_heads=cfg.num_kv_heads, dtype=cfg.dtype, use_bias=False,
        normalize_qk=cfg.normalize_qk, attention_options=cfg.attention_options(local),
        implementation=cfg.attention_implementation, rngs=rngs)
    self.mlp_norm = nnx.LayerNorm(d, dtype=cfg.dtype, rngs=rngs)
    self.mlp_in = nnx.Linear(d, cfg.d_ff, dtype=cfg.dtype, rngs=rngs)
    self.mlp_out = nnx.Linear(cfg.d_ff, d, dtype=cfg.dtype, rngs=rngs)

  def __call__(self, x, segment_ids, positions, cache=None):
    """x [B, L, D] -> (x, this layer's updated cache, or None without one)."""
    h = self.attention(self.attention_norm(x), is_causal=cache is None,
                       segment_ids=segment_ids, positions=positions, cache=cache)
    if cache is not None:
      h, cache = h
    x = x + h
    return x + self.mlp_out(nnx.gelu(self.mlp_in(self.mlp_norm(x)))), cache


class DecoderLM(lm.Decodable, nnx.Module):
  """`__call__(tokens [B, L], segment_ids=None, positions=None) -> logits [B, L, C]`, the
  arguments and methods of `flax_mha.models.DecoderLM` (see there), ids unchecked inside `jit`
  likewise."""

  def __init__(self, config: LMConfig, *, rngs: nnx.Rngs):
    if config.dropout_rate or config.remat != "none":
      raise ValueError(f"the NNX DecoderLM has no dropout or remat: LMConfig.dropout_rate must "
                       f"be 0 and remat 'none', got {config.dropout_rate} and {config.remat!r}")
    self.config = config
    self.embed = nnx.Embed(config.vocab_size, config.d_model, dtype=config.dtype,
                           embedding_init=nnx.initializers.normal(stddev=1.0), rngs=rngs)
    for i in range(config.num_layers):  # named as the linen model's blocks
      setattr(self, f"block_{i}", Block(config, config.is_local(i), rngs=rngs))
    self.final_norm = nnx.LayerNorm(config.d_model, dtype=config.dtype, rngs=rngs)

  def __call__(self, tokens, segment_ids=None, positions=None, *, cache=None):
    cfg = self.config
    checks.check_tokens("tokens", tokens)
    checks.check_concrete_token_ids("tokens", tokens, cfg.vocab_size)
    if cache is None:
      segment_ids, positions = lm.one_document(tokens, segment_ids, positions)
    scale = jnp.sqrt(jnp.asarray(cfg.d_model, cfg.dtype))
    x = tokens_lib.embed(self.embed, tokens, cfg.vocab_size).astype(cfg.dtype) * scale
    caches = []
    for i in range(cfg.num_layers):
      x, layer_cache = getattr(self, f"block_{i}")(
          x, segment_ids, positions, None if cache is None else cache[i])
      caches.append(layer_cache)
    logits_BLC = (self.embed.attend(self.final_norm(x)) / scale).astype(jnp.float32)
    return logits_BLC if cache is None else (logits_BLC, tuple(caches))


def load_linen_params(model: DecoderLM, variables) -> DecoderLM:
  """`model` with a linen `DecoderLM`'s variables ({'params': ...}) of the same config loaded in
  place (the trees match path for path); returns `model`."""
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, variables["params"])
  nnx.update(model, state)
  return model
