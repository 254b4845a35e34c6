"""The tensor tables of the Hugging Face loader (`flax_mha.models.hf`): for each family, which
checkpoint tensor fills which of our parameters, through which transform (as data). Dimension
key: D d_model, H heads, G kv heads, K head dim, F MLP width, X experts; MLA's R latent, P
rotary, N the query/key features without rotary, V value head dim, Q the query's rank.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np


@dataclasses.dataclass(frozen=True)
class Rule:
  """One checkpoint tensor `name` ({i}: a layer index) fills `targets`, our parameter paths
  ('/'-joined, {i} likewise), through the transform named `transform` (TRANSFORMS). With
  `stack`, the name's {e} (an expert's index) picks the row of each target that the tensor
  fills: one expert of a stacked parameter [X, ...]."""
  name: str
  targets: tuple[str, ...]
  transform: str = "same"
  stack: bool = False


def _heads(n: str):
  """[n·K, D] (torch's Linear [out, in]) -> [D, n, K]."""
  return lambda x, c: (x.T.reshape(x.shape[1], getattr(c, n), -1),)


def _split3(x, c):
  """GPT-2's fused Conv1D [D, 3·H·K] (or bias [3·H·K]) -> query, key, value [D, H, K]
  (biases [H, K])."""
  return tuple(p.reshape(*p.shape[:-1], c.num_heads, -1) for p in np.split(x, 3, axis=-1))


def _split_qkv_rows(x, c):
  """Phi-3's fused qkv_proj [(H + 2·G)·K, D] -> query [D, H, K], key and value [D, G, K]."""
  k, h, g = c.k_dim, c.num_heads, c.num_kv_heads
  parts = np.split(x, [h * k, (h + g) * k], axis=0)
  return tuple(p.T.reshape(x.shape[1], n, k) for p, n in zip(parts, (h, g, g)))


def _split_kv_up(x, c):
  """MLA's kv_b_proj [H·(N + V), R] -> key_up [R, H, N], value_up [R, H, V]."""
  up = x.T.reshape(x.shape[1], c.num_heads, -1)
  return up[..., :c.mla.nope_dim], up[..., c.mla.nope_dim:]


# name -> (checkpoint array [torch's layout], LMConfig) -> our arrays, one per target.
TRANSFORMS = {
    "same": lambda x, c: (x,),
    "t": lambda x, c: (x.T,),  # torch's Linear [out, in] -> [in, out]
    "q": _heads("num_heads"),
    "kv": _heads("num_kv_heads"),
    "o": lambda x, c: (x.T.reshape(c.num_heads, -1, x.shape[0]),),  # [D, H·K] -> [H, K, D]
    "q_bias": lambda x, c: (x.reshape(c.num_heads, -1),),
    "kv_bias": lambda x, c: (x.reshape(c.num_kv_heads, -1),),
    "qkv": _split3,
    "heads_in": lambda x, c: (x.reshape(c.num_heads, -1, x.shape[-1]),),  # [H·K, D] -> [H, K, D]
    "qkv_rows": _split_qkv_rows,
    "kv_up": _split_kv_up,
    "gate_up": lambda x, c: tuple(p.T for p in np.split(x, 2, axis=0)),  # [2F, D] -> 2 x [D, F]
    # gpt-oss's experts [X, D, 2F] (biases [X, 2F]), gate and up interleaved -> 2 x [X, D, F].
    "interleaved": lambda x, c: (x[..., 0::2], x[..., 1::2]),
}

_LAYER = "model.layers.{i}."
_BLOCK = "block_{i}/"
_ATTN = _BLOCK + "attention/"


def _llama_table(norms: dict[str, str], extra=(), *, fused: bool = False,
                 attention=None) -> tuple[Rule, ...]:
  """The Llama-shaped tables: embeddings, q/k/v/o (with optional biases; or `attention`'s
  rules), the gated MLP, the block norms named by `norms` (checkpoint name -> ours) and `extra`
  rules; `fused`: q/k/v in one qkv_proj and gate/up in one gate_up_proj (Phi-3)."""
  attn = [Rule(_LAYER + f"self_attn.{p}_proj.weight", (_ATTN + f"{ours}/kernel",), t)
          for p, ours, t in (("q", "query", "q"), ("k", "key", "kv"), ("v", "value", "kv"),
                             ("o", "out", "o")) if not fused or p == "o"]
  attn += [Rule(_LAYER + f"self_attn.{p}_proj.bias", (_ATTN + f"{ours}/bias",), t)
           for p, ours, t in (("q", "query", "q_bias"), ("k", "key", "kv_bias"),
                              ("v", "value", "kv_bias"), ("o", "out", "same"))]
  mlp = [Rule(_LAYER + f"mlp.{p}_proj.weight", (_BLOCK + f"mlp_{ours}/kernel",), "t")
         for p, ours in (("gate", "gate"), ("up", "in"), ("down", "out"))
         if not fused or p == "down"]
  if fused:
    attn.append(Rule(_LAYER + "self_attn.qkv_proj.weight",
                     tuple(_ATTN + f"{p}/kernel" for p in ("query", "key", "value")), "qkv_rows"))
    mlp.append(Rule(_LAYER + "mlp.gate_up_proj.weight",
                    (_BLOCK + "mlp_gate/kernel", _BLOCK + "mlp_in/kernel"), "gate_up"))
  if attention is not None:
    attn = list(attention)
  block_norms = [Rule(_LAYER + f"{theirs}.weight", (_BLOCK + f"{ours}/scale",))
                 for theirs, ours in norms.items()]
  return (Rule("model.embed_tokens.weight", ("embed/embedding",)),
          Rule("model.norm.weight", ("final_norm/scale",)),
          Rule("lm_head.weight", ("lm_head/kernel",), "t"),
          *attn, *mlp, *block_norms, *extra)


_LLAMA_NORMS = {"input_layernorm": "attention_norm", "post_attention_layernorm": "mlp_norm"}
_GEMMA2_NORMS = {"input_layernorm": "attention_norm",
                 "post_attention_layernorm": "post_attention_norm",
                 "pre_feedforward_layernorm": "mlp_norm",
                 "post_feedforward_layernorm": "post_mlp_norm"}
_OLMO2_NORMS = {"post_attention_layernorm": "post_attention_norm",
                "post_feedforward_layernorm": "post_mlp_norm"}
_QK_NORMS = (Rule(_LAYER + "self_attn.q_norm.weight", (_ATTN + "query_ln/scale",)),
             Rule(_LAYER + "self_attn.k_norm.weight", (_ATTN + "key_ln/scale",)))


_MOE = _BLOCK + "moe/"
# gpt-oss: learned sinks; the router's bias; the experts stored stacked, [in, out] already.
_GPT_OSS = (
    Rule(_LAYER + "self_attn.sinks", (_ATTN + "sinks",)),
    Rule(_LAYER + "mlp.router.weight", (_MOE + "router/kernel",), "t"),
    Rule(_LAYER + "mlp.router.bias", (_MOE + "router/bias",)),
    Rule(_LAYER + "mlp.experts.gate_up_proj", (_MOE + "gate", _MOE + "up"), "interleaved"),
    Rule(_LAYER + "mlp.experts.gate_up_proj_bias", (_MOE + "gate_bias", _MOE + "up_bias"),
         "interleaved"),
    Rule(_LAYER + "mlp.experts.down_proj", (_MOE + "down",)),
    Rule(_LAYER + "mlp.experts.down_proj_bias", (_MOE + "down_bias",)),
)


def _experts(prefix: str, names: tuple[str, str, str]) -> tuple[Rule, ...]:
  """A mixture of experts' router `prefix`gate.weight [X, D] and each expert's gate, up and
  down projections, `prefix`experts.{e}.<name>.weight, as the rows of moe/gate, up, down."""
  return (Rule(_LAYER + prefix + "gate.weight", (_MOE + "router/kernel",), "t"),
          *(Rule(_LAYER + prefix + "experts.{e}." + theirs + ".weight", (_MOE + ours,), "t",
                 stack=True) for theirs, ours in zip(names, ("gate", "up", "down"))))


# Qwen3-MoE's and GLM-4.5's experts: mlp.gate and mlp.experts.{e}.(gate|up|down)_proj.
_MLP_EXPERTS = _experts("mlp.", ("gate_proj", "up_proj", "down_proj"))
# DeepSeek's shared experts (V2, V3, GLM-4.5).
_SHARED_EXPERTS = tuple(Rule(_LAYER + f"mlp.shared_experts.{p}_proj.weight",
                             (_MOE + f"shared_{p}",), "t") for p in ("gate", "up", "down"))
# DeepSeek V3's router (GLM-4.5's): the correction bias beside the router's kernel.
_CORRECTION = (Rule(_LAYER + "mlp.gate.e_score_correction_bias", (_MOE + "correction_bias",)),)
# Latent attention (DeepSeek V2, V3; `flax_mha.models.mla`): the query's one projection or
# low-rank pair with its norm, the latent's down projection and norm, kv_b_proj split in two.
_MLA = (
    *(Rule(_LAYER + f"self_attn.{theirs}.weight", (_ATTN + f"{ours}/kernel",), t)
      for theirs, ours, t in (("q_proj", "query", "q"), ("q_a_proj", "query_down", "t"),
                              ("q_b_proj", "query_up", "q"), ("kv_a_proj_with_mqa", "kv_down", "t"),
                              ("o_proj", "out", "o"))),
    *(Rule(_LAYER + f"self_attn.{theirs}.bias", (_ATTN + f"{ours}/bias",))
      for theirs, ours in (("q_a_proj", "query_down"), ("kv_a_proj_with_mqa", "kv_down"),
                           ("o_proj", "out"))),
    Rule(_LAYER + "self_attn.q_a_layernorm.weight", (_ATTN + "query_norm/scale",)),
    Rule(_LAYER + "self_attn.kv_a_layernorm.weight", (_ATTN + "kv_norm/scale",)),
    Rule(_LAYER + "self_attn.kv_b_proj.weight", (_ATTN + "key_up", _ATTN + "value_up"), "kv_up"),
)


def _gpt2_table() -> tuple[Rule, ...]:
  """GPT-2 (names without the `transformer.` prefix, which the loader strips): Conv1D weights
  are [in, out] already."""
  h = "h.{i}."
  rules = [Rule("wte.weight", ("embed/embedding",)),
           Rule("wpe.weight", ("position_embed/embedding",)),
           Rule(h + "attn.c_attn.weight", tuple(_ATTN + f"{p}/kernel" for p in
                                                ("query", "key", "value")), "qkv"),
           Rule(h + "attn.c_attn.bias", tuple(_ATTN + f"{p}/bias" for p in
                                              ("query", "key", "value")), "qkv"),
           Rule(h + "attn.c_proj.weight", (_ATTN + "out/kernel",), "heads_in"),
           Rule(h + "attn.c_proj.bias", (_ATTN + "out/bias",)),
           Rule(h + "mlp.c_fc.weight", (_BLOCK + "mlp_in/kernel",)),
           Rule(h + "mlp.c_fc.bias", (_BLOCK + "mlp_in/bias",)),
           Rule(h + "mlp.c_proj.weight", (_BLOCK + "mlp_out/kernel",)),
           Rule(h + "mlp.c_proj.bias", (_BLOCK + "mlp_out/bias",))]
  for theirs, ours in (("h.{i}.ln_1", _BLOCK + "attention_norm"),
                       ("h.{i}.ln_2", _BLOCK + "mlp_norm"), ("ln_f", "final_norm")):
    rules += [Rule(f"{theirs}.weight", (f"{ours}/scale",)),
              Rule(f"{theirs}.bias", (f"{ours}/bias",))]
  return tuple(rules)


TABLES = {
    "gpt2": _gpt2_table(),
    "llama": _llama_table(_LLAMA_NORMS),
    "qwen2": _llama_table(_LLAMA_NORMS),
    "qwen3": _llama_table(_LLAMA_NORMS, _QK_NORMS),
    "gemma": _llama_table(_LLAMA_NORMS),
    "gemma2": _llama_table(_GEMMA2_NORMS),
    "gemma3": _llama_table(_GEMMA2_NORMS, _QK_NORMS),
    "olmo2": _llama_table(_OLMO2_NORMS, _QK_NORMS),
    "phi3": _llama_table(_LLAMA_NORMS, fused=True),
    "mixtral": _llama_table(_LLAMA_NORMS, _experts("block_sparse_moe.", ("w1", "w3", "w2"))),
    "qwen3_moe": _llama_table(_LLAMA_NORMS, _QK_NORMS + _MLP_EXPERTS),
    "gpt_oss": _llama_table(_LLAMA_NORMS, _GPT_OSS),
    "glm4_moe": _llama_table(_LLAMA_NORMS, _QK_NORMS + _MLP_EXPERTS + _SHARED_EXPERTS
                             + _CORRECTION),
    "deepseek_v2": _llama_table(_LLAMA_NORMS, _MLP_EXPERTS + _SHARED_EXPERTS, attention=_MLA),
    "deepseek_v3": _llama_table(_LLAMA_NORMS, _MLP_EXPERTS + _SHARED_EXPERTS + _CORRECTION,
                                attention=_MLA),
}
# Buffers that older checkpoints saved beside the parameters (GPT-2's causal mask): skipped.
IGNORED = {"gpt2": re.compile(r"h\.\d+\.attn\.(masked_)?bias")}
# The prefix a family's tensor names carry and its table leaves out.
PREFIX = {"gpt2": "transformer."}
_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")
# The families whose checkpoints hold multi-token prediction layers past num_hidden_layers.
_MTP = ("glm4_moe", "deepseek_v3")


def ignored(fam: str, short: str, num_layers: int) -> bool:
  """Whether the checkpoint's tensor `short` is one the model does not use: `IGNORED`'s, or a
  layer past the model's (GLM-4.5's and DeepSeek V3's multi-token prediction layers, which
  transformers skips too)."""
  if fam in IGNORED and IGNORED[fam].fullmatch(short):
    return True
  layer = _LAYER_INDEX.match(short) if fam in _MTP else None
  return layer is not None and int(layer.group(1)) >= num_layers
