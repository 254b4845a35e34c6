"""Models built on the front ends: the encoder-decoder `transformer` of "Attention Is All You
Need" (with its greedy and beam decoding), the decoder-only LM (`lm_config` its config, `lm` the
linen model, `lm_nnx` its NNX twin, `lm_shared` what both share, `moe` and `moe_nnx` its
mixture of experts), `decoding` and `sampling`
for linen and NNX models alike, and Hugging Face checkpoints (`hf`, `hf_config`). The names
below load on first access: importing a config loads no model."""

import importlib

_LAZY = {"beam_search": "flax_mha.models.transformer", "greedy_decode": "flax_mha.models.transformer",
         "DecoderLM": "flax_mha.models.lm", "LMConfig": "flax_mha.models.lm_config",
         "Transformer": "flax_mha.models.transformer",
         "TransformerConfig": "flax_mha.models.transformer"}


def __getattr__(name):
  if name not in _LAZY:
    raise AttributeError(f"module 'flax_mha.models' has no attribute {name!r}")
  return getattr(importlib.import_module(_LAZY[name]), name)


def __dir__():
  return sorted(set(globals()) | set(_LAZY))
