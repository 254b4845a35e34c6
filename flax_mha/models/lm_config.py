"""`LMConfig`: the architecture of the one configurable decoder (`flax_mha.models.lm`, linen;
`flax_mha.models.lm_nnx`, NNX), a family's description. Importing it loads no flax, so the NNX
model and the Hugging Face config reader (`flax_mha.models.hf_config`) read a config without
the linen model. Shapes: D d_model, F d_ff, C vocabulary, K head dim.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from flax_mha import checks
from flax_mha import remat as remat_lib
from flax_mha.nn.options import AttentionOptions, Norm
from flax_mha.rotary import LongRopeScaling, Rope


MLPS = ("gelu", "swiglu", "geglu")
POSITIONS = ("rotary", "learned")
LAYER_TYPES = ("local", "global")


@dataclasses.dataclass(frozen=True)
class MoE:
  """A sparse mixture of experts in place of the dense MLP (`flax_mha.models.moe`): each token's
  router picks `top_k` of `num_experts` gated MLPs of width `d_ff` (Mixtral, Qwen3-MoE), and
  shared experts every token goes through (DeepSeek V3, GLM-4.5)."""
  num_experts: int                    # X
  top_k: int                          # A, the experts each token takes
  d_ff: int                           # each expert's MLP width (LMConfig.d_ff: the dense layers')
  normalize: bool = True              # top-k weights renormalised (Qwen3-MoE: norm_topk_prob)
  layers: tuple[int, ...] | None = None  # the layers with experts, the others dense (None: all)
  bias: bool = False                  # biases in the router and the experts (gpt-oss)
  clamped_glu: tuple[float, float] | None = None  # (alpha, limit): gpt-oss's unit (moe.gated_unit)
  router: str = "softmax"             # or "sigmoid_groups" (DeepSeek V3): moe.router_weights
  groups: tuple[int, int] = (1, 1)    # (expert groups, groups a token keeps): DeepSeek's
  routed_scale: float = 1.0           # the routed weights' factor (routed_scaling_factor)
  shared_d_ff: int | None = None      # the shared experts' width (n_shared · d_ff), None: none
  float32_router: bool = False        # router logits in float32 (DeepSeek's, GLM-4.5's)

  def __post_init__(self):
    for name in ("num_experts", "top_k", "d_ff"):
      checks.check_int(f"MoE.{name}", getattr(self, name))
    if not isinstance(self.bias, bool):
      raise TypeError(f"MoE.bias must be a bool, got {type(self.bias).__name__}")
    if self.clamped_glu is not None:
      if not isinstance(self.clamped_glu, tuple) or len(self.clamped_glu) != 2:
        raise ValueError(f"MoE.clamped_glu must be None or (alpha, limit), got "
                         f"{self.clamped_glu!r}")
      for name, value in zip(("alpha", "limit"), self.clamped_glu):
        checks.check_positive_real(f"MoE.clamped_glu's {name}", value)
    if self.top_k > self.num_experts:
      raise ValueError(f"MoE.top_k={self.top_k} must be at most num_experts={self.num_experts}")
    for name in ("normalize", "float32_router"):
      if not isinstance(getattr(self, name), bool):
        raise TypeError(f"MoE.{name} must be a bool, got {type(getattr(self, name)).__name__}")
    if self.layers is not None and (not isinstance(self.layers, tuple) or not all(
        isinstance(i, int) and i >= 0 for i in self.layers)):
      raise ValueError(f"MoE.layers must be None or a tuple of layer indices, got {self.layers!r}")
    self._check_router()

  def _check_router(self):
    """The router's fields: groups that divide the experts and hold top_k (of at least 2
    experts each for "sigmoid_groups", which scores a group by its best two)."""
    if self.router not in ("softmax", "sigmoid_groups"):
      raise ValueError(f"MoE.router must be 'softmax' or 'sigmoid_groups', got {self.router!r}")
    if self.shared_d_ff is not None:
      checks.check_int("MoE.shared_d_ff", self.shared_d_ff)
    checks.check_positive_real("MoE.routed_scale", self.routed_scale)
    if (not isinstance(self.groups, tuple) or len(self.groups) != 2
        or not all(isinstance(g, int) and g > 0 for g in self.groups)):
      raise ValueError(f"MoE.groups must be (groups, kept groups) of positive ints, got "
                       f"{self.groups!r}")
    groups, kept = self.groups
    smallest = 2 if self.router == "sigmoid_groups" else 1
    if self.num_experts % groups or self.num_experts // groups < smallest or kept > groups:
      raise ValueError(f"MoE.groups=({groups}, {kept}) must split num_experts="
                       f"{self.num_experts} into groups of {smallest} or more and keep at most "
                       "all")
    if self.top_k > kept * (self.num_experts // groups):
      raise ValueError(f"MoE.top_k={self.top_k} is more than the {kept} kept groups hold "
                       f"({kept * (self.num_experts // groups)} experts)")


@dataclasses.dataclass(frozen=True)
class MLA:
  """Multi-head latent attention (DeepSeek V2, V3; `flax_mha.models.mla`) in place of the
  attention's key and value projections: each token's keys and values come from one latent of
  width R (normalised), shared by every head, plus one rotary key of width P shared likewise;
  the caches hold those (`LMConfig.cache_dims`), not every head's keys and values. Each head's
  query has N features without rotary and P with it (`LMConfig.rope`, over P)."""
  kv_rank: int                        # R, the latent's width (HF's kv_lora_rank)
  rope_dim: int                       # P, the rotary query and key features (qk_rope_head_dim)
  nope_dim: int                       # N, each head's query and key features without rotary
  v_dim: int                          # V, each head's value width (v_head_dim)
  q_rank: int | None = None           # the query's low rank (q_lora_rank; None: one projection)

  def __post_init__(self):
    for name in ("kv_rank", "rope_dim", "nope_dim", "v_dim"):
      checks.check_int(f"MLA.{name}", getattr(self, name))
    if self.q_rank is not None:
      checks.check_int("MLA.q_rank", self.q_rank)
    if self.rope_dim % 2:
      raise ValueError(f"MLA.rope_dim must be even (rotary pairs), got {self.rope_dim}")

  @property
  def qk_dim(self) -> int:
    """N + P, each head's query and key width (the default scale is its inverse square root)."""
    return self.nope_dim + self.rope_dim


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
  pre_norms: bool = True              # norms on the attention's and the MLP's inputs (not OLMo 2)
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
  moe: MoE | None = None              # experts in place of the MLP (None: every layer dense)
  mla: MLA | None = None              # latent attention in every layer (None: plain attention)

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
    if self.norm.across_heads:
      raise ValueError("LMConfig.norm normalises the residual: across_heads is a qk-norm's "
                       "(normalize_qk)")
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
    if self.moe is not None:
      if not isinstance(self.moe, MoE):
        raise TypeError(f"LMConfig.moe must be a MoE or None, got {type(self.moe).__name__}")
      if self.mlp == "gelu":
        raise ValueError("LMConfig.moe's experts are gated MLPs: mlp must be 'swiglu' or "
                         "'geglu', got 'gelu'")
      past = [i for i in self.moe.layers or () if i >= self.num_layers]
      if past:
        raise ValueError(f"LMConfig.moe.layers {past} past num_layers={self.num_layers}")
    self._check_mla()

  def _check_mla(self):
    """Latent attention: global layers of rotary positions, without the plain attention's own
    options (qk-norm, learned sinks, a soft cap)."""
    if self.mla is None:
      return
    if not isinstance(self.mla, MLA):
      raise TypeError(f"LMConfig.mla must be a MLA or None, got {type(self.mla).__name__}")
    local = [i for i in range(self.num_layers) if self.is_local(i)]
    unsupported = {"local layers (set local_window=None)": local,
                   "positions='learned'": self.positions == "learned",
                   "normalize_qk": self.normalize_qk, "learned_sinks": self.learned_sinks,
                   "logit_soft_cap": self.logit_soft_cap is not None}
    taken = [name for name, value in unsupported.items() if value]
    if taken:
      raise ValueError(f"LMConfig.mla (latent attention) takes global rotary layers only, "
                       f"without {taken}")

  @property
  def k_dim(self) -> int:
    """The head dim K of queries, keys and values (plain attention's)."""
    return self.head_dim or self.d_model // self.num_heads

  @property
  def cache_dims(self) -> tuple[int, int, int]:
    """(G, K, V) of each layer's cache: the key/value heads and head dims, or with `mla` one
    latent "head" whose keys are the latent and the rotary key (R + P) and whose values the
    latent (R)."""
    if self.mla is not None:
      return 1, self.mla.kv_rank + self.mla.rope_dim, self.mla.kv_rank
    return self.num_kv_heads, self.k_dim, self.k_dim

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

  @property
  def longrope_context(self) -> float | None:
    """Where a LongRoPE rope switches from its short to its long factors (the smaller original
    context of the global and local ropes'); None without one."""
    contexts = [r.scaling.original_max_position_embeddings for r in (self.rope, self.local_rope)
                if r is not None and isinstance(r.scaling, LongRopeScaling)]
    return min(contexts) if contexts else None

  def attention_positions(self, positions, cache):
    """The positions a layer's attention takes: rotary angles, or a cache's slots (learned
    positions are added to the embeddings and the attention has no use for them otherwise)."""
    return positions if self.positions == "rotary" or cache is not None else None

  def is_sparse(self, layer: int) -> bool:
    """Whether `layer` has experts (`moe`) rather than the dense MLP."""
    return self.moe is not None and (self.moe.layers is None or layer in self.moe.layers)

  def is_local(self, layer: int) -> bool:
    """`layer_types[layer]` when given; else layers global_every - 1, 2·global_every - 1, ...
    are global and the rest local."""
    if self.layer_types is not None:
      return self.layer_types[layer] == "local"
    return self.local_window is not None and (layer + 1) % self.global_every != 0
