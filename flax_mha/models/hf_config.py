"""Hugging Face configs (config.json) as `LMConfig`s: every supported family a preset of the one
configurable decoder, `flax_mha.models.lm.DecoderLM`.

Conventions, where the two libraries say one thing two ways:
- transformers' `sliding_window=W` lets a query see itself and the W - 1 keys before it, so it is
  `local_window=W - 1` here (flax_mha counts the keys before the query).
- Rope scaling ("linear", "llama3", "yarn", "longrope") reads `rope_parameters` (transformers 5) or
  `rope_scaling` (4.x) through `flax_mha.rotary.Rope.from_hf`; any other type is refused by name.
  Gemma 3's per-layer-type rope parameters give its local layers their own base.
- Gemma's `hidden_act="gelu"` is its legacy spelling of the tanh approximation, as transformers
  reads it.
- OLMo 2 normalises only the sublayers' outputs (no pre-norms), and its qk-norm spans all heads
  (`Norm.across_heads`). Phi-3's "longrope" (short and long factors switched by the
  positions, `flax_mha.rotary.LongRopeScaling`) is read, and its 4.x "su" and "yarn" as
  "longrope", as transformers reads them.
- Mixtral and Qwen3-MoE put experts in place of the MLP (`LMConfig.moe`): Mixtral's top
  `num_experts_per_tok` of `num_local_experts` renormalised, Qwen3-MoE's when `norm_topk_prob`,
  on the layers `decoder_sparse_step` and `mlp_only_layers` leave sparse (the others dense,
  `intermediate_size` wide; the experts `moe_intermediate_size`). GLM-4.5 (`glm4_moe`) takes
  DeepSeek V3's router (`MoE.router="sigmoid_groups"`) and shared experts, its first
  `first_k_dense_replace` layers dense; its multi-token prediction layers (the checkpoint's
  layers from num_hidden_layers on) are skipped, as transformers skips them. gpt-oss's experts have
  biases and its clamped unit (`swiglu_alpha`, `swiglu_limit`); its attention learned sinks.
  A quantized checkpoint (`quantization_config`: gpt-oss's MXFP4) is refused: load a
  dequantized one.
- DeepSeek V2 and V3 take latent attention (`LMConfig.mla`, `flax_mha.models.mla`) with its
  rotary over `qk_rope_head_dim` (interleaved pairs) and YaRN's mscale in the softmax scale, and
  experts with shared ones from `first_k_dense_replace` on: V2's softmax router (`topk_method`
  "greedy" or "group_limited_greedy"), V3's GLM-4.5's; both routers' logits in float32, as
  transformers computes them (`MoE.float32_router`).

Anything a family's config sets that this decoder does not implement is refused by name: never
approximated. A key the family needs that the config lacks is a `MissingKey` naming it; a dtype
the decoder does not compute in is an `UnsupportedDtype` naming `dtype`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from flax_mha.models.lm_config import MLA, LMConfig, MoE
from flax_mha.nn.options import Norm
from flax_mha.rotary import Rope

# model_type -> the family whose preset and tensor table serve it.
FAMILIES = {"gpt2": "gpt2", "llama": "llama", "mistral": "llama", "qwen2": "qwen2",
            "qwen3": "qwen3", "gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3",
            "olmo2": "olmo2", "phi3": "phi3", "mixtral": "mixtral", "qwen3_moe": "qwen3_moe",
            "gpt_oss": "gpt_oss", "glm4_moe": "glm4_moe", "deepseek_v2": "deepseek_v2",
            "deepseek_v3": "deepseek_v3"}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# What `config_from_hf(dtype=...)` (and so `hf.load`) takes: float64 only under jax_enable_x64,
# without which jax computes it in float32.
LOAD_DTYPES = (*DTYPES, "float64")
# hidden_act -> (LMConfig.mlp, for the gated families).
_GATED = {"silu": "swiglu", "gelu_pytorch_tanh": "geglu"}


class MissingKey(KeyError, ValueError):
  """A key that the config's family needs and the config lacks: a ValueError (the config is
  wrong), and a KeyError, so that `in` and `.get` on a `_Required` config answer as a dict's."""

  def __str__(self) -> str:  # KeyError's would quote the message
    return str(self.args[0])


class UnsupportedDtype(TypeError):
  """A dtype the decoder does not load and compute in (LOAD_DTYPES)."""


class _Required(Mapping):
  """A config dict whose missing keys raise `MissingKey` naming the key and the family."""

  def __init__(self, config: Mapping, fam: str):
    self._config, self._family = config, fam

  def __getitem__(self, key):
    try:
      return self._config[key]
    except KeyError:
      raise MissingKey(f"the config lacks the key {key!r}, which a {self._family} config "
                       "needs") from None

  def __iter__(self):
    return iter(self._config)

  def __len__(self) -> int:
    return len(self._config)


def family(config: Mapping) -> str:
  """The family of a config dict, or a ValueError naming its model_type."""
  model_type = config.get("model_type")
  if model_type not in FAMILIES:
    raise ValueError(f"model_type {model_type!r} is not supported: supported are "
                     f"{sorted(FAMILIES)} (a multimodal 'gemma3' checkpoint: load its text model, "
                     "model_type 'gemma3_text')")
  return FAMILIES[model_type]


def checkpoint_dtype(config: Mapping):
  """The dtype config.json records (`dtype`, or 4.x's `torch_dtype`; float32 when absent)."""
  name = config.get("dtype") or config.get("torch_dtype") or "float32"
  if name not in DTYPES:
    raise ValueError(f"checkpoint dtype {name!r} is not supported: {sorted(DTYPES)}")
  return DTYPES[name]


def load_dtype(dtype: Any):
  """The NumPy scalar type of `dtype` (a name, a dtype or a scalar type), one of LOAD_DTYPES.

  Raises UnsupportedDtype (a TypeError) naming `dtype` for any other (an integer, complex or
  8-bit float type), and for float64 while jax_enable_x64 is off (jax would compute float32).
  """
  try:
    name = jnp.dtype(dtype).name
  except TypeError:
    name = None
  if name not in LOAD_DTYPES:
    raise UnsupportedDtype(f"dtype must be one of {list(LOAD_DTYPES)} (float64 with "
                           f"jax_enable_x64), got {dtype!r}")
  if name == "float64" and not jax.config.jax_enable_x64:
    raise UnsupportedDtype(f"dtype {dtype!r} (float64) needs jax_enable_x64, which is off: jax "
                           "would compute in float32 (set JAX_ENABLE_X64=1 or "
                           "jax.config.update('jax_enable_x64', True))")
  return jnp.dtype(name).type


def config_from_hf(config: Mapping, *, dtype: Any = None, **overrides) -> LMConfig:
  """The `LMConfig` of a Hugging Face config dict. `dtype` (default: the checkpoint's) is the
  parameters' and the computation's (`load_dtype`); `overrides` set other fields (e.g.
  attention_implementation).

  Raises UnsupportedDtype (a TypeError) for a dtype outside LOAD_DTYPES; MissingKey (a ValueError)
  for a key the family needs that the config lacks; ValueError for anything else the config says
  that the decoder does not implement.
  """
  fam = family(config)
  dtype = checkpoint_dtype(config) if dtype is None else load_dtype(dtype)
  config = _Required(config, fam)
  fields = _GPT2(config) if fam == "gpt2" else _rotary_family(config, fam)
  return LMConfig(**{"dtype": dtype, "param_dtype": dtype, "dropout_rate": 0.0,
                     "learned_sinks": False, "sink_tokens": 0, **fields, **overrides})


def _GPT2(c: Mapping) -> dict:  # pylint: disable=invalid-name
  _refuse(c, activation_function=("gelu_new",), scale_attn_weights=(True, None),
          scale_attn_by_inverse_layer_idx=(False, None), reorder_and_upcast_attn=(False, None),
          add_cross_attention=(False, None))
  d = c["n_embd"]
  return dict(
      vocab_size=c["vocab_size"], d_model=d, num_heads=c["n_head"], num_kv_heads=c["n_head"],
      num_layers=c["n_layer"], d_ff=c.get("n_inner") or 4 * d, local_window=None,
      logit_soft_cap=None, norm=Norm("layer", c.get("layer_norm_epsilon", 1e-5)), mlp="gelu",
      mlp_bias=True, qkv_bias=True, out_bias=True,
      tie_embeddings=_tied(c, True), scale_embeddings=False, scale_logits=False,
      positions="learned", max_positions=c["n_positions"])


def _rotary_family(c: Mapping, fam: str) -> dict:
  """The fields of the rotary families (Llama, Mistral, Qwen2/3, Gemma 1-3, OLMo 2, Phi-3,
  Mixtral, Qwen3-MoE, gpt-oss)."""
  gemma = fam.startswith("gemma")
  act = c.get("hidden_activation") or c.get("hidden_act", "silu")
  if gemma and act == "gelu":  # Gemma's legacy spelling of the tanh approximation
    act = "gelu_pytorch_tanh"
  if act not in _GATED:
    raise ValueError(f"hidden_act {act!r} is not supported: {sorted(_GATED)}")
  _refuse(c, mlp_bias=(False, None), attention_dropout=(0.0, 0, None),
          quantization_config=(None,))
  if fam == "phi3":
    c = _phi3_rope(c)
  heads = c["num_attention_heads"]
  k = c.get("head_dim") or c["hidden_size"] // heads
  if fam.startswith("deepseek"):  # the rotary's width (its own head_dim: K is MLA's)
    k = c["qk_rope_head_dim"]
  layer_types = _layer_types(c, fam)
  window = c.get("sliding_window") if "local" in (layer_types or ()) else None
  fields = dict(
      vocab_size=c["vocab_size"], d_model=c["hidden_size"], num_heads=heads,
      num_kv_heads=c.get("num_key_value_heads") or heads, num_layers=c["num_hidden_layers"],
      d_ff=c["intermediate_size"], head_dim=k, layer_types=layer_types,
      local_window=None if window is None else window - 1,
      logit_soft_cap=c.get("attn_logit_softcapping"),
      final_logit_soft_cap=c.get("final_logit_softcapping"),
      norm=Norm("rms_one_plus" if gemma else "rms", c.get("rms_norm_eps", 1e-6), use_bias=False),
      pre_norms=fam != "olmo2", post_norms=fam in ("gemma2", "gemma3", "olmo2"),
      mlp=_GATED[act], mlp_bias=False,
      qkv_bias=fam == "qwen2" or bool(c.get("attention_bias", False)),
      out_bias=bool(c.get("attention_bias", False)) and fam not in ("qwen2", "glm4_moe"),
      tie_embeddings=_tied(c, gemma or fam == "qwen2"), scale_embeddings=gemma,
      scale_logits=False, positions="rotary", **_ropes(c, k, layer_types))
  if fam in ("mixtral", "qwen3_moe", "gpt_oss"):
    fields["moe"] = _moe(c, fam)
  if fam == "glm4_moe":
    fields["moe"] = _sigmoid_group_moe(c)
  if fam == "gpt_oss":
    fields["learned_sinks"] = True
  if fam.startswith("deepseek"):
    fields.update(_deepseek(c, fam))
  if fam in ("qwen3", "gemma3", "olmo2", "qwen3_moe") or c.get("use_qk_norm"):
    fields["normalize_qk"] = Norm("rms_one_plus" if gemma else "rms", c.get("rms_norm_eps", 1e-6),
                                  use_bias=False, across_heads=fam == "olmo2")
  if "query_pre_attn_scalar" in c and fam != "gemma":
    fields["attention_scale"] = c["query_pre_attn_scalar"] ** -0.5
  return fields


def _sigmoid_group_moe(c: Mapping) -> MoE | None:
  """GLM-4.5's experts, DeepSeek V3's: sigmoid scores with a correction bias, `n_group`
  groups of which `topk_group` kept, renormalised with `norm_topk_prob`."""
  _refuse(c, scoring_func=("sigmoid", None))
  return _shared_expert_moe(c, "sigmoid_groups", (c.get("n_group", 1), c.get("topk_group", 1)),
                            normalize=bool(c.get("norm_topk_prob", True)))


def _shared_expert_moe(c: Mapping, router: str, groups: tuple[int, int],
                       normalize: bool) -> MoE | None:
  """DeepSeek's experts under `router`: `routed_scaling_factor`, `n_shared_experts` shared
  experts of `moe_intermediate_size` each, the router's logits in float32 (as transformers
  computes them); the first `first_k_dense_replace` layers dense (None when no layer or no
  expert is left)."""
  count = c.get("num_local_experts") or c["n_routed_experts"]
  first = c.get("first_k_dense_replace", 0)
  layers = tuple(range(first, c["num_hidden_layers"]))
  if not count or not layers:
    return None
  shared = c.get("n_shared_experts") or 0
  return MoE(count, c["num_experts_per_tok"], c["moe_intermediate_size"], normalize=normalize,
             layers=layers, router=router, groups=groups,
             routed_scale=float(c.get("routed_scaling_factor", 1.0)),
             shared_d_ff=shared * c["moe_intermediate_size"] if shared else None,
             float32_router=True)


def _deepseek(c: Mapping, fam: str) -> dict:
  """DeepSeek V2's and V3's fields: latent attention (`LMConfig.mla`; `q_lora_rank` None: one
  query projection, V2-Lite), its rotary over the qk_rope_head_dim features (interleaved
  pairs: V2 always, V3 unless `rope_interleave` is false), the softmax scale times YaRN's
  mscale(factor, mscale_all_dim)² as transformers scales it, and the experts: V2's softmax
  router ("greedy", or "group_limited_greedy" keeping `topk_group` of `n_group` groups by
  their best expert), V3's sigmoid one, each times `routed_scaling_factor`, with shared
  experts, on the layers from `first_k_dense_replace` on. V2's router never renormalises
  (transformers' DeepseekV2TopkRouter; DeepSeek's own code would with norm_topk_prob, so a
  config asking for it is refused rather than read two ways)."""
  heads, rope_dim = c["num_attention_heads"], c["qk_rope_head_dim"]
  if c.get("num_key_value_heads", heads) != heads:
    raise ValueError(f"num_key_value_heads={c['num_key_value_heads']} must equal "
                     f"num_attention_heads={heads} for latent attention (every head reads the "
                     "latent)")
  mla = MLA(c["kv_lora_rank"], rope_dim, c["qk_nope_head_dim"], c["v_head_dim"],
            q_rank=c.get("q_lora_rank"))
  interleaved = fam == "deepseek_v2" or bool(c.get("rope_interleave", True))
  rope = Rope.from_hf(c, rope_dim, interleaved=interleaved)
  scale = mla.qk_dim ** -0.5
  params = c.get("rope_parameters") or c.get("rope_scaling") or {}
  if params.get("rope_type", params.get("type", "default")) != "default" and params.get(
      "mscale_all_dim"):
    factor = params["factor"]
    mscale = 0.1 * params["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
    scale *= mscale * mscale
  return dict(mla=mla, rope=rope, local_rope=None, attention_scale=scale, head_dim=None,
              num_kv_heads=heads, local_window=None, moe=(
                  _softmax_group_moe(c) if fam == "deepseek_v2" else _sigmoid_group_moe(c)))


def _softmax_group_moe(c: Mapping) -> MoE | None:
  """DeepSeek V2's experts: a softmax router's top `num_experts_per_tok`, from `topk_group` of
  `n_group` groups with "group_limited_greedy", times `routed_scaling_factor`, never
  renormalised; shared experts; the first `first_k_dense_replace` layers dense."""
  _refuse(c, topk_method=("greedy", "group_limited_greedy"), norm_topk_prob=(False, None),
          scoring_func=("softmax", None))
  limited = c["topk_method"] == "group_limited_greedy"
  groups = (c["n_group"], c["topk_group"]) if limited else (1, 1)
  return _shared_expert_moe(c, "softmax", groups, normalize=False)


def _moe(c: Mapping, fam: str) -> MoE | None:
  """The experts of Mixtral (every layer, renormalised) and Qwen3-MoE (the layers (i + 1) %
  decoder_sparse_step == 0 outside mlp_only_layers, renormalised when norm_topk_prob; None when
  num_experts is 0). transformers 5 saves num_experts as num_local_experts."""
  _refuse(c, router_jitter_noise=(0.0, 0, None))
  count = c.get("num_local_experts") if "num_local_experts" in c else c["num_experts"]
  if fam == "mixtral":
    return MoE(count, c["num_experts_per_tok"], c["intermediate_size"], normalize=True)
  if fam == "gpt_oss":  # a softmax over the top k logits: the top k probabilities renormalised
    return MoE(count, c["num_experts_per_tok"], c["intermediate_size"], normalize=True,
               bias=True, clamped_glu=(c.get("swiglu_alpha", 1.702), c.get("swiglu_limit", 7.0)))
  dense = set(c.get("mlp_only_layers") or ())
  step = c.get("decoder_sparse_step", 1)
  layers = tuple(i for i in range(c["num_hidden_layers"])
                 if i not in dense and count > 0 and (i + 1) % step == 0)
  if not layers:
    return None
  return MoE(count, c["num_experts_per_tok"], c["moe_intermediate_size"],
             normalize=bool(c.get("norm_topk_prob", False)), layers=layers)


def _phi3_rope(c: Mapping) -> Mapping:
  """Phi-3's config with its rope as transformers reads it: the default, or "longrope" (a 4.x
  config's "su" and "yarn" are read as "longrope", as transformers' Phi3Config does); any other
  type refused by name."""
  key = "rope_parameters" if c.get("rope_parameters") else "rope_scaling"
  params = c.get(key) or {}
  kind = params.get("rope_type", params.get("type", "default"))
  if kind in ("su", "yarn"):
    params = {k: v for k, v in params.items() if k != "type"} | {"rope_type": "longrope"}
    return {**c, key: params}
  if kind not in ("default", "longrope"):
    raise ValueError(f"rope scaling type {kind!r} is not supported for phi3: it takes the "
                     "default rope or 'longrope'")
  return c


def _layer_types(c: Mapping, fam: str) -> tuple[str, ...] | None:
  """Each layer local or global: config.layer_types when given; else all local for a config
  with a sliding window (Mistral), all global otherwise."""
  types = c.get("layer_types")
  n = c["num_hidden_layers"]
  if types is None:
    uses_window = c.get("sliding_window") is not None and c.get("use_sliding_window", True)
    types = ["sliding_attention" if uses_window else "full_attention"] * n
  names = {"sliding_attention": "local", "full_attention": "global"}
  unknown = sorted(set(types) - set(names))
  if unknown or len(types) != n:
    raise ValueError(f"layer_types {types} must be {n} of {sorted(names)} (unknown: {unknown})")
  if "sliding_attention" in types and not c.get("sliding_window"):
    raise ValueError(f"layer_types has sliding layers but sliding_window is "
                     f"{c.get('sliding_window')!r}")
  if fam == "gemma" and "sliding_attention" in types:
    raise ValueError("Gemma (1) has no sliding layers; got layer_types with some")
  return tuple(names[t] for t in types)


def _ropes(c: Mapping, k: int, layer_types) -> dict:
  """rope (the global layers') and local_rope (the local ones', where it differs)."""
  params = c.get("rope_parameters") or c.get("rope_scaling") or {}
  per_type = params and all(isinstance(v, Mapping) for v in params.values())
  if not per_type:
    rope = Rope.from_hf(c, k)
    local = rope
    if "rope_local_base_freq" in c:  # Gemma 3 in transformers 4.x: scaling on global only
      local = Rope(max_wavelength=c["rope_local_base_freq"])
    return dict(rope=rope, local_rope=None if local == rope else local)
  rope = Rope.from_hf(c, k, layer_type="full_attention") if "full_attention" in params else None
  local = (Rope.from_hf(c, k, layer_type="sliding_attention")
           if "sliding_attention" in params else None)
  if rope is None:  # every layer local
    rope, local = local, None
  return dict(rope=rope, local_rope=local if "local" in (layer_types or ()) else None)


def _tied(c: Mapping, default: bool) -> bool:
  tied = c.get("tie_word_embeddings")
  return default if tied is None else bool(tied)


def _refuse(c: Mapping, **supported) -> None:
  """Raise a ValueError naming the first key whose value is not among its supported ones
  (an absent key reads as None)."""
  for key, values in supported.items():
    if c.get(key) not in values:
      raise ValueError(f"{key}={c.get(key)!r} is not supported (supported: "
                       f"{[v for v in values if v is not None]})")
