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

import functools

import flax.linen as nn

from flax_mha import checks
from flax_mha import precision
from flax_mha import remat as remat_lib
from flax_mha.models import mla, mla_linen, moe
from flax_mha.models.lm_config import LMConfig
from flax_mha.models.lm_shared import Decodable, embed_tokens, one_document, output_logits
from flax_mha.nn.linen import SelfAttention, make_norm
from flax_mha.nn.shared import PARAM_AXES as ATTENTION_PARAM_AXES


# Logical axes of every parameter (see `flax_mha.parallel.sharding`): the attention projections', the
# MLP's Megatron split (mlp_in column-, mlp_out row-parallel), the tied embedding and norms.
PARAM_AXES = ATTENTION_PARAM_AXES + mla.PARAM_AXES + moe.PARAM_AXES + (
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


class Block(nn.Module):
  """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x)); with post_norms, each branch's output
  is normalised too (Gemma 2, 3), and without pre_norms only the outputs are (OLMo 2)."""
  config: LMConfig
  local: bool
  sparse: bool = False  # experts in place of the MLP (`flax_mha.models.moe`)

  def attention(self):
    cfg = self.config
    implementation = remat_lib.attention_implementation(cfg.remat,
                                                        cfg.attention_implementation)
    if cfg.mla is not None:
      return mla_linen.LatentAttention(cfg, implementation, name="attention")
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
    """h [B, L, D] -> [B, L, D]: gelu(h·in)·out, or act(h·gate) * (h·in) then ·out (or each
    token's experts' of that, sparse)."""
    cfg = self.config
    if self.sparse:
      return moe.MoEMLP(cfg, name="moe")(h)
    dense = functools.partial(nn.Dense, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                              use_bias=cfg.mlp_bias, **precision.layer_keywords(nn.Dense))
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
    pre, post = (self.norm if on else lambda name: lambda h: h
                 for on in (cfg.pre_norms, cfg.post_norms))
    h = self.attention()(pre("attention_norm")(x), is_causal=cache is None,
                         segment_ids=segment_ids, positions=cfg.attention_positions(positions, cache),
                         cache=cache)
    if cache is not None:
      h, cache = h
    x = x + drop(post("post_attention_norm")(h))
    h = post("post_mlp_norm")(self.mlp(pre("mlp_norm")(x)))
    return x + drop(h) if cache is None else (x + drop(h), cache)


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
      block = block_cls(cfg, local=cfg.is_local(i), sparse=cfg.is_sparse(i), name=f"block_{i}")
      if cache is None:
        x = block(x, segment_ids, positions, train)
      else:
        x, layer_cache = block(x, None, positions, train=train, cache=cache[i])
        caches.append(layer_cache)
    x = make_norm(cfg.norm, dtype=cfg.dtype, param_dtype=cfg.param_dtype, name="final_norm")(x)
    if cfg.tie_embeddings:
      head = functools.partial(precision.attend, table=embed.embedding)
    else:
      head = nn.Dense(cfg.vocab_size, use_bias=False, dtype=cfg.dtype,
                      param_dtype=cfg.param_dtype, **precision.layer_keywords(nn.Dense),
                      name="lm_head")
    logits_BLC = output_logits(cfg, head(x))
    return logits_BLC if cache is None else (logits_BLC, tuple(caches))


