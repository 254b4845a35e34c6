"""Flax front ends over the pure function: `linen` (MultiHeadAttention, SelfAttention, with the
parameter tree of `flax.linen.MultiHeadDotProductAttention`) and `nnx` (the state tree of
`flax.nnx.MultiHeadAttention`). What both share (argument checks, rotary positions, the cache
mask, the attention call: one `forward`) is in `flax_mha.nn.shared`, which imports no flax; a
layer's own options are one record, `AttentionOptions`. The front ends load on first access,
so that `flax_mha.nn.options` (and a config built on it) loads no flax."""

import importlib

from flax_mha.nn.options import AttentionOptions
from flax_mha.nn.shared import PARAM_AXES

_LAZY = {"linen": ("flax_mha.nn.linen", None), "nnx": ("flax_mha.nn.nnx", None),
         "MultiHeadAttention": ("flax_mha.nn.linen", "MultiHeadAttention"),
         "SelfAttention": ("flax_mha.nn.linen", "SelfAttention")}


def __getattr__(name):
  if name not in _LAZY:
    raise AttributeError(f"module 'flax_mha.nn' has no attribute {name!r}")
  module_name, attribute = _LAZY[name]
  module = importlib.import_module(module_name)
  return module if attribute is None else getattr(module, attribute)


def __dir__():
  return sorted(set(globals()) | set(_LAZY))
