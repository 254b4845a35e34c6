"""Tiny random Hugging Face checkpoints, built offline, and transformers' own outputs on them.

`save_tiny(family, directory)` writes a randomly initialised causal LM of one family (safetensors,
config.json, generation_config.json) plus a byte-level BPE `tokenizer.json` trained here; the
model's vocabulary C is the tokenizer's. `hf_logits` and `hf_generate` are the reference: the
other side's own model on the same weights, in float32 with eager attention.

Dimension key: B batch, L padded length, C vocabulary. Token arrays here are NumPy int32.

`llama_tensors` and `write_checkpoint` write a Llama checkpoint with NumPy alone (safetensors).

torch, transformers, tokenizers and safetensors are imported inside the functions, so this module
imports without them (a test that needs them calls pytest.importorskip first).
"""

from __future__ import annotations

import copy
import functools
import json
import pathlib
import random
from typing import TYPE_CHECKING

import numpy as np
import pytest

if TYPE_CHECKING:  # imported lazily below
  import tokenizers

FAMILIES = ("gpt2", "llama", "llama3", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3",
            "olmo2", "phi3", "mixtral", "qwen3_moe", "qwen3_moe_sparse", "gpt_oss", "glm4_moe",
            "deepseek_v2", "deepseek_v2_lite", "deepseek_v3")

# The families whose end-to-end generation tests run in CI (the others are marked slow, their
# logits still compared in CI): one of each code path, a plain decoder (llama), learned
# positions (gpt2), local and global layers with soft caps (gemma3), fused projections (phi3),
# sparse MoE layers (qwen3_moe_sparse), sinks with biased experts (gpt_oss), latent attention
# over latent caches with DeepSeek's router (deepseek_v3).
CI_FAMILIES = ("gpt2", "llama", "gemma3", "phi3", "qwen3_moe_sparse", "gpt_oss", "deepseek_v3")


def ci_families(ci=CI_FAMILIES):
  """pytest params of FAMILIES: those not in `ci` marked slow (`make test-slow`)."""
  return [pytest.param(f, marks=[] if f in ci else [pytest.mark.slow], id=f) for f in FAMILIES]


PAD, BOS, EOS = 0, 1, 2
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")  # ids 0, 1, 2, in this order
VOCAB_SIZE = 300

# Init scale: large enough that the logits are peaked (the top-2 gap of greedy argmax is far
# above float noise) and that a misplaced tensor changes the logits visibly.
INIT_STD = 0.2

# The transformers 5.x spelling of rotary settings is `rope_parameters`, a dict holding
# `rope_type` and `rope_theta` (the old `rope_scaling` / `rope_theta` kwargs are converted into
# it). Gemma 3 keys it by layer type: {"sliding_attention": {...}, "full_attention": {...}}, which
# replaces `rope_local_base_freq` and a `rope_scaling` that applied to the global layers only.
_LLAMA = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
          "tie_word_embeddings": False,
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}

# Llama 3.1 scaling. original_max_position_embeddings is 64, not 16: with head_dim 16 and base
# 5e5 the wavelengths are 2π·5e5^(i/8) ≈ 6.3, 32, 167, ..., so the bands (< 64/4 = 16 unchanged,
# > 64/1 = 64 divided by the factor, smoothed between) each hold at least one frequency.
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}

_GEMMA3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
}


def _family_spec(family):
  """(config class name, model class name, config kwargs) for one family."""
  if family == "gpt2":
    return "GPT2Config", "GPT2LMHeadModel", {
        "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128, "tie_word_embeddings": True,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
  if family == "llama":
    return "LlamaConfig", "LlamaForCausalLM", dict(_LLAMA)
  if family == "llama3":
    return "LlamaConfig", "LlamaForCausalLM", dict(_LLAMA, rope_parameters=_LLAMA3_ROPE)
  if family == "mistral":
    # A key is visible when q - 8 < k <= q (masking_utils.sliding_window_overlay), so a 20+ token
    # sequence goes past the window.
    return "MistralConfig", "MistralForCausalLM", dict(_LLAMA, sliding_window=8)
  if family == "qwen2":
    return "Qwen2Config", "Qwen2ForCausalLM", dict(_LLAMA, tie_word_embeddings=True)
  if family == "qwen3":
    # head_dim 32 != hidden / heads = 16, so a loader cannot infer it from the width.
    return "Qwen3Config", "Qwen3ForCausalLM", dict(_LLAMA, head_dim=32)
  if family == "gemma":
    # GemmaConfig spells the activation `hidden_act`; Gemma 2 and 3 spell it `hidden_activation`.
    return "GemmaConfig", "GemmaForCausalLM", dict(
        _LLAMA, head_dim=32, num_key_value_heads=1, hidden_act="gelu_pytorch_tanh",
        tie_word_embeddings=True)
  if family == "gemma2":
    # query_pre_attn_scalar 24 makes the attention scale 24**-0.5, not head_dim**-0.5; the
    # default layer_types alternate sliding, full, sliding.
    return "Gemma2Config", "Gemma2ForCausalLM", dict(
        _LLAMA, num_hidden_layers=3, head_dim=16, hidden_activation="gelu_pytorch_tanh",
        sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, tie_word_embeddings=True)
  if family == "gemma3":
    return "Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        _LLAMA, num_hidden_layers=3, head_dim=16, hidden_activation="gelu_pytorch_tanh",
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=8, query_pre_attn_scalar=16, rope_parameters=_GEMMA3_ROPE,
        tie_word_embeddings=True)
  if family == "olmo2":
    return "Olmo2Config", "Olmo2ForCausalLM", dict(_LLAMA)
  if family == "phi3":
    # Phi-3 mini's sliding window (every layer), Phi-4 mini's partial rotary (half of K) and
    # both's LongRoPE; an original context of 40 tokens, which the family tests' sequences stay
    # within (the short factors) and test_hf_integration's LongRoPE test passes (the long ones).
    return "Phi3Config", "Phi3ForCausalLM", dict(
        _LLAMA, sliding_window=8, original_max_position_embeddings=40, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.3, 1.9, 2.6], "long_factor": [1.5, 4.0, 9.0, 17.0]})
  if family == "mixtral":
    # 5 experts, top 2, every layer; Mixtral 8x7B's config has no sliding window.
    return "MixtralConfig", "MixtralForCausalLM", dict(
        _LLAMA, num_local_experts=5, num_experts_per_tok=2, intermediate_size=40)
  if family == "qwen3_moe":
    # Qwen3-30B-A3B's variant: every layer sparse, top-k weights not renormalised.
    return "Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        _LLAMA, head_dim=32, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
        norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[])
  if family == "qwen3_moe_sparse":
    # The other variants: renormalised, every 2nd layer sparse but layer 3 (mlp_only_layers),
    # the dense layers intermediate_size wide: layers 0 and 2 dense, 1 sparse, 3 dense.
    return "Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        _LLAMA, num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=24, norm_topk_prob=True, decoder_sparse_step=2,
        mlp_only_layers=[3])
  if family == "gpt_oss":
    # Sliding and full layers alternating, YaRN (truncate off, as gpt-oss's), learned sinks,
    # biases in attention, router and experts; swiglu_limit 1.5 so that the clamps bite.
    return "GptOssConfig", "GptOssForCausalLM", dict(
        _LLAMA, head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=40,
        sliding_window=8, swiglu_limit=1.5, max_position_embeddings=2048, rope_parameters={
            "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "original_max_position_embeddings": 64, "truncate": False})
  if family == "glm4_moe":
    # GLM-4.5's: DeepSeek V3's router (sigmoid scores, a correction bias, 8 experts in 4
    # groups of which 2 kept, top 3, a routed scale) with a shared expert, layer 0 dense
    # (first_k_dense_replace), qk-norm, biases in q/k/v, half the head rotated.
    return "Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        _LLAMA, num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
        topk_group=2, moe_intermediate_size=24, n_shared_experts=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5})
  if family.startswith("deepseek"):
    return _deepseek_spec(family)
  raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


# DeepSeek's latent attention, small: a latent of 16 (R), 8 rotary features (P), 12 without
# (N), values of 10 (V); 6 experts of 24 in 3 groups, 2 shared, layer 0 dense.
_DEEPSEEK = dict(
    _LLAMA, num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8,
    qk_nope_head_dim=12, v_head_dim=10, q_lora_rank=24, n_routed_experts=6,
    num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=2,
    first_k_dense_replace=1, n_group=3, topk_group=2)
# YaRN as DeepSeek's checkpoints set it (mscale, mscale_all_dim), over an original context of
# 32 so the factor matters; mscale_all_dim != mscale, so both the rotary's factor and the
# softmax scale's change.
_DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                  "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
                  "mscale": 1.0, "mscale_all_dim": 0.8}


def _deepseek_spec(family):
  """DeepSeek V2 (its softmax router keeping 2 of 3 groups by their best expert, YaRN), V2-Lite
  (one query projection, q_lora_rank None; the plain top-k; the default rope), V3 (the sigmoid
  router with its correction bias, renormalised, a routed scale; YaRN; interleaved rotary)."""
  if family == "deepseek_v2":
    return "DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        _DEEPSEEK, topk_method="group_limited_greedy", routed_scaling_factor=1.5,
        rope_parameters=_DEEPSEEK_YARN)
  if family == "deepseek_v2_lite":
    return "DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        _DEEPSEEK, q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1)
  if family == "deepseek_v3":
    return "DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        _DEEPSEEK, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_parameters=_DEEPSEEK_YARN)
  raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def _corpus():
  """A few hundred English-like sentences, the same every call."""
  words = ["the", "a", "one", "every", "small", "large", "red", "blue", "green", "old", "new",
           "quick", "slow", "bright", "dark", "cat", "dog", "bird", "fish", "tree", "river",
           "stone", "house", "garden", "city", "road", "window", "light", "sound", "model",
           "layer", "token", "head", "query", "key", "value", "runs", "jumps", "reads", "writes",
           "sees", "finds", "makes", "takes", "moves", "holds", "over", "under", "near", "behind",
           "through", "into", "with", "from", "and", "but", "then", "while", "because", "today",
           "tonight", "again", "never", "always", "quietly", "softly"]
  rnd = random.Random(0)
  sentences = []
  for _ in range(400):
    n = rnd.randint(4, 12)
    sentence = " ".join(rnd.choice(words) for _ in range(n))
    sentences.append(sentence[0].upper() + sentence[1:] + rnd.choice(".!?,;"))
  return sentences


@functools.cache
def _tokenizer_json():
  """The trained tokenizer, serialised (trained once per process)."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers

  tok = tokenizers.Tokenizer(models.BPE())
  # GPT-2's byte level: every byte is a token, so any text round-trips and no <unk> is needed.
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(_corpus(), trainer=trainer)
  return tok.to_str()


def train_tokenizer(path) -> tokenizers.Tokenizer:
  """Writes `path/tokenizer.json` (byte-level BPE, C ≈ 300; <pad> 0, <bos> 1, <eos> 2).

  Deterministic: the same file every call. Returns the tokenizer.
  """
  import tokenizers

  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  tok = tokenizers.Tokenizer.from_str(_tokenizer_json())
  tok.save(str(path / "tokenizer.json"))
  return tok


def _randomise(model, family, seed):
  """Redraws every parameter (tied ones once) and the routers' correction buffers from
  N(0, INIT_STD); norm weights around 1.

  Gemma's RMSNorm multiplies by (1 + w), so its norm weights are centred at 0. Gemma also
  multiplies the embedding by sqrt(D) = 8, and with tied embeddings the last token's own row
  then dominates the residual and wins the argmax: greedy decoding repeats one token, which hides
  cache and position bugs. So Gemma's embedding is drawn 8 times smaller and its final norm
  scale 8 times larger (w around 7): the logits keep the scale of the other families.
  """
  import torch

  gen = torch.Generator().manual_seed(seed)
  gemma = family.startswith("gemma")
  scale = model.config.hidden_size ** 0.5 if gemma else 1.0
  final_norm = model.get_decoder().norm.weight if gemma else None
  for module in model.modules():
    is_norm = "norm" in type(module).__name__.lower()
    for name, p in module.named_parameters(recurse=False):
      value = torch.randn(p.shape, generator=gen, dtype=torch.float32) * INIT_STD
      if p is model.get_input_embeddings().weight:
        value /= scale
      elif p is final_norm:
        value = scale * (1.0 + value) - 1.0
      elif is_norm and name == "weight" and not gemma:
        value += 1.0
      with torch.no_grad():
        p.copy_(value)
    for name, b in module.named_buffers(recurse=False):
      if name == "e_score_correction_bias":  # DeepSeek's router balance term: a saved buffer
        with torch.no_grad():
          b.copy_(torch.randn(b.shape, generator=gen, dtype=torch.float32) * INIT_STD)


def save_tiny(family: str, directory, *, dtype: str = "float32", max_shard_size: str | None = None,
              seed: int = 0) -> pathlib.Path:
  """Saves a tiny random causal LM of `family` and its tokenizer.json into `directory`.

  dtype: "float32" or "bfloat16" (the weights are rounded to bf16 before saving).
  max_shard_size: e.g. "20KB" writes several model-0000i-of-0000n.safetensors files and
  model.safetensors.index.json; None writes one model.safetensors.
  Returns the directory.
  """
  import torch
  import transformers

  if dtype not in ("float32", "bfloat16"):
    raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
  directory = pathlib.Path(directory)
  tok = train_tokenizer(directory)
  config_name, model_name, kwargs = _family_spec(family)
  kwargs = copy.deepcopy(kwargs)  # transformers fills rope_parameters dicts in place
  config = getattr(transformers, config_name)(
      vocab_size=tok.get_vocab_size(), pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
      use_cache=True, attn_implementation="eager", **kwargs)
  torch.manual_seed(seed)  # construction draws from the global generator; _randomise redraws all
  model = getattr(transformers, model_name)(config).eval()
  _randomise(model, family, seed)
  gen_config = model.generation_config
  gen_config.pad_token_id, gen_config.bos_token_id, gen_config.eos_token_id = PAD, BOS, EOS
  model = model.to(getattr(torch, dtype))
  save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
  model.save_pretrained(directory, safe_serialization=True, **save_kwargs)
  return directory


def _load(directory, dtype: str = "float32"):
  """The saved model in `dtype` (computing in it) with eager attention, in eval mode."""
  import torch
  import transformers

  model = transformers.AutoModelForCausalLM.from_pretrained(
      directory, attn_implementation="eager", dtype=getattr(torch, dtype))  # not `torch_dtype`
  return model.eval()


def hf_logits(directory, tokens, attention_mask, position_ids, dtype: str = "float32"
              ) -> np.ndarray:
  """transformers' logits computed in `dtype`: tokens, attention_mask, position_ids [B, L]
  ints -> float32 [B, L, C]."""
  import torch

  model = _load(directory, dtype)
  as_torch = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int64))
  with torch.no_grad():
    out = model(input_ids=as_torch(tokens), attention_mask=as_torch(attention_mask),
                position_ids=as_torch(position_ids), use_cache=False)
  return out.logits.float().numpy()


def hf_generate(directory, prompts, max_new_tokens) -> list[list[int]]:
  """transformers' greedy continuation: for each prompt (token-id lists, any lengths), its
  max_new_tokens new tokens, the prompts batched with left padding."""
  import torch

  model = _load(directory)
  tokens, mask, _ = left_padded(prompts)
  gen_config = model.generation_config
  # eos_token_id None rather than min_new_tokens: min_new_tokens works by setting the eos logit to
  # -inf, which would change which token is the argmax; without an eos nothing stops generation
  # and no logit is touched, so each new token is the plain argmax. All settings go in the config
  # (transformers 5 deprecates a generation_config passed together with generation kwargs).
  gen_config.update(eos_token_id=None, pad_token_id=PAD, max_new_tokens=max_new_tokens,
                    do_sample=False, num_beams=1)
  tokens = torch.from_numpy(tokens.astype(np.int64))
  with torch.no_grad():
    out = model.generate(tokens, attention_mask=torch.from_numpy(mask.astype(np.int64)),
                         generation_config=gen_config)
  new = out[:, tokens.shape[1]:].tolist()
  if any(len(row) != max_new_tokens for row in new):
    raise RuntimeError(f"generate returned {[len(r) for r in new]} tokens, not {max_new_tokens}")
  return new


def left_padded(prompts):
  """Prompts (token-id lists) -> tokens, attention_mask, position_ids, each int32 [B, L].

  Padding (id 0) on the left. Positions are the ones transformers' generate derives
  (GenerationMixin._prepare_position_ids_for_generation in 5.24): cumsum(mask) - 1, with padding
  set to 0 (older versions set it to 1; padding is masked, so its position never matters).
  """
  length = max(len(p) for p in prompts)
  tokens = np.full((len(prompts), length), PAD, np.int32)
  mask = np.zeros((len(prompts), length), np.int32)
  for b, p in enumerate(prompts):
    if p:
      tokens[b, length - len(p):] = p
      mask[b, length - len(p):] = 1
  positions = np.where(mask == 1, np.cumsum(mask, axis=-1) - 1, 0).astype(np.int32)
  return tokens, mask, positions


def right_padded(prompts):
  """Prompts (token-id lists) -> tokens, attention_mask, position_ids, each int32 [B, L].

  Padding (id 0) on the right; positions 0..L-1 in every row; mask 1 on real tokens.
  """
  length = max(len(p) for p in prompts)
  tokens = np.full((len(prompts), length), PAD, np.int32)
  mask = np.zeros((len(prompts), length), np.int32)
  for b, p in enumerate(prompts):
    tokens[b, :len(p)] = p
    mask[b, :len(p)] = 1
  positions = np.broadcast_to(np.arange(length, dtype=np.int32), tokens.shape).copy()
  return tokens, mask, positions


def llama_tensors(config: dict, rng) -> dict:
  """Every tensor of a Llama config dict (untied, without biases) in torch's layouts, drawn
  from N(0, 1) as float32: a checkpoint written without torch."""
  c, d, f = config["vocab_size"], config["hidden_size"], config["intermediate_size"]
  h, g = config["num_attention_heads"], config["num_key_value_heads"]
  k = config.get("head_dim") or d // h
  t = {"model.embed_tokens.weight": (c, d), "model.norm.weight": (d,), "lm_head.weight": (c, d)}
  for i in range(config["num_hidden_layers"]):
    p = f"model.layers.{i}."
    t.update({p + "self_attn.q_proj.weight": (h * k, d), p + "self_attn.k_proj.weight": (g * k, d),
              p + "self_attn.v_proj.weight": (g * k, d), p + "self_attn.o_proj.weight": (d, h * k),
              p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
              p + "mlp.down_proj.weight": (d, f), p + "input_layernorm.weight": (d,),
              p + "post_attention_layernorm.weight": (d,)})
  return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in t.items()}


def write_checkpoint(directory, config: dict, tensors: dict, *, shards: int = 1) -> pathlib.Path:
  """Writes config.json and `tensors` (safetensors, with NumPy) into `directory`: one
  model.safetensors, or `shards` files model-0000i-of-0000n.safetensors (the tensors dealt out
  in turn) and model.safetensors.index.json. Returns the directory."""
  from safetensors.numpy import save_file

  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  (directory / "config.json").write_text(json.dumps(config))
  if shards == 1:
    save_file(tensors, str(directory / "model.safetensors"))
    return directory
  names, weight_map = sorted(tensors), {}
  for i in range(shards):
    file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
    save_file({name: tensors[name] for name in names[i::shards]}, str(directory / file))
    weight_map.update({name: file for name in names[i::shards]})
  (directory / "model.safetensors.index.json").write_text(
      json.dumps({"metadata": {}, "weight_map": weight_map}))
  return directory
