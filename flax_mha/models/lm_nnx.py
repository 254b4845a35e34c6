"""`DecoderLM` as an NNX module, built on `flax_mha.nnx.SelfAttention`.

The linen model's architecture (`flax_mha.models.lm`, never imported here: rotary positions, GQA, local and global
layers, soft-capped logits, sinks) and its parameter tree, path for path: `load_linen_params`
takes a linen `DecoderLM`'s variables. It is decodable (`init_cache`, `init_paged_cache`,
`logits`): `flax_mha.models.decoding` and `serving` take it with `params` None. Dropout and
remat are the linen model's only (refused here). Shapes: B batch, L length, D d_model, C
vocabulary.
"""

from __future__ import annotations

import functools

from flax import nnx

from flax_mha import checks
from flax_mha import precision
from flax_mha.models import lm_shared
from flax_mha.models.mla_nnx import LatentAttention
from flax_mha.models.moe_nnx import MoEMLP
from flax_mha.models.lm_config import LMConfig
from flax_mha.nn.nnx import SelfAttention, make_norm


class Block(nnx.Module):
  """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x)) (post_norms: each branch's output
  normalised too; without pre_norms only the outputs), as `flax_mha.models.lm.Block`."""

  def __init__(self, cfg: LMConfig, local: bool, *, rngs: nnx.Rngs, sparse: bool = False):
    d, f = cfg.d_model, cfg.d_ff
    norm = lambda: make_norm(cfg.norm, d, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                             rngs=rngs)
    dense = functools.partial(nnx.Linear, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                              use_bias=cfg.mlp_bias, **precision.layer_keywords(nnx.Linear),
                              rngs=rngs)
    self.config = cfg
    if cfg.pre_norms:
      self.attention_norm, self.mlp_norm = norm(), norm()
    self.attention = LatentAttention(
        cfg, rngs=rngs, implementation=cfg.attention_implementation) if cfg.mla else SelfAttention(
        cfg.num_heads, d, qkv_features=cfg.num_heads * cfg.k_dim, out_features=d,
        num_kv_heads=cfg.num_kv_heads, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
        use_bias=cfg.qkv_bias, out_use_bias=cfg.out_bias, normalize_qk=cfg.normalize_qk,
        attention_options=cfg.attention_options(local),
        implementation=cfg.attention_implementation, rngs=rngs)
    if sparse:  # experts in place of the MLP (`flax_mha.models.moe`)
      self.moe = MoEMLP(cfg, rngs=rngs)
    else:
      if cfg.mlp != "gelu":
        self.mlp_gate = dense(d, f)
      self.mlp_in, self.mlp_out = dense(d, f), dense(f, d)
    if cfg.post_norms:
      self.post_attention_norm, self.post_mlp_norm = norm(), norm()

  def mlp(self, h):
    """As the linen Block's: gelu(h·in)·out, or act(h·gate) * (h·in) then ·out (or the
    experts', sparse)."""
    if hasattr(self, "moe"):
      return self.moe(h)
    if self.config.mlp == "gelu":
      return self.mlp_out(nnx.gelu(self.mlp_in(h)))
    act = nnx.silu if self.config.mlp == "swiglu" else nnx.gelu
    return self.mlp_out(act(self.mlp_gate(h)) * self.mlp_in(h))

  def __call__(self, x, segment_ids, positions, cache=None):
    """x [B, L, D] -> (x, this layer's updated cache, or None without one)."""
    norm = lambda name, h: getattr(self, name)(h) if hasattr(self, name) else h  # if it has one
    h = self.attention(norm("attention_norm", x), is_causal=cache is None,
                       segment_ids=segment_ids,
                       positions=self.config.attention_positions(positions, cache), cache=cache)
    if cache is not None:
      h, cache = h
    x = x + norm("post_attention_norm", h)
    return x + norm("post_mlp_norm", self.mlp(norm("mlp_norm", x))), cache


class DecoderLM(lm_shared.Decodable, nnx.Module):
  """`__call__(tokens [B, L], segment_ids=None, positions=None) -> logits [B, L, C]`, the
  arguments and methods of `flax_mha.models.DecoderLM` (see there), ids unchecked inside `jit`
  likewise."""

  def __init__(self, config: LMConfig, *, rngs: nnx.Rngs):
    if config.dropout_rate or config.remat != "none":
      raise ValueError(f"the NNX DecoderLM has no dropout or remat: LMConfig.dropout_rate must "
                       f"be 0 and remat 'none', got {config.dropout_rate} and {config.remat!r}")
    self.config = config
    table = functools.partial(nnx.Embed, features=config.d_model, dtype=config.dtype,
                              param_dtype=config.param_dtype,
                              embedding_init=nnx.initializers.normal(stddev=1.0), rngs=rngs)
    self.embed = table(config.vocab_size)
    if config.positions == "learned":
      self.position_embed = table(config.max_positions)
    for i in range(config.num_layers):  # named as the linen model's blocks
      setattr(self, f"block_{i}", Block(config, config.is_local(i), rngs=rngs,
                                        sparse=config.is_sparse(i)))
    self.final_norm = make_norm(config.norm, config.d_model, dtype=config.dtype,
                                param_dtype=config.param_dtype, rngs=rngs)
    if not config.tie_embeddings:
      self.lm_head = nnx.Linear(config.d_model, config.vocab_size, use_bias=False,
                                dtype=config.dtype, param_dtype=config.param_dtype,
                                **precision.layer_keywords(nnx.Linear), rngs=rngs)

  def __call__(self, tokens, segment_ids=None, positions=None, *, cache=None):
    cfg = self.config
    checks.check_tokens("tokens", tokens)
    checks.check_concrete_token_ids("tokens", tokens, cfg.vocab_size)
    if cache is None:
      segment_ids, positions = lm_shared.one_document(tokens, segment_ids, positions)
    x = lm_shared.embed_tokens(cfg, self.embed, tokens, positions,
                        getattr(self, "position_embed", None))
    caches = []
    for i in range(cfg.num_layers):
      x, layer_cache = getattr(self, f"block_{i}")(
          x, segment_ids, positions, None if cache is None else cache[i])
      caches.append(layer_cache)
    x = self.final_norm(x)
    head = (self.lm_head if not cfg.tie_embeddings else
            lambda x: precision.attend(x, self.embed.embedding[...]))
    logits_BLC = lm_shared.output_logits(cfg, head(x))
    return logits_BLC if cache is None else (logits_BLC, tuple(caches))


def load_linen_params(model: DecoderLM, variables) -> DecoderLM:
  """`model` with a linen `DecoderLM`'s variables ({'params': ...}) of the same config loaded in
  place (the trees match path for path); returns `model`."""
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, variables["params"])
  nnx.update(model, state)
  return model
