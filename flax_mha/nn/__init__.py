"""Flax front ends over the pure function: `linen` (MultiHeadAttention, SelfAttention, with the
parameter tree of `flax.linen.MultiHeadDotProductAttention`) and `nnx` (the state tree of
`flax.nnx.MultiHeadAttention`). What both share (argument checks, rotary positions, the cache
mask, the attention call: one `forward`) is in `flax_mha.nn.shared`, which imports no flax; a
layer's own options are one record, `AttentionOptions`."""

from flax_mha.nn import linen
from flax_mha.nn import nnx
from flax_mha.nn.linen import MultiHeadAttention
from flax_mha.nn.linen import SelfAttention
from flax_mha.nn.shared import PARAM_AXES
from flax_mha.nn.options import AttentionOptions
