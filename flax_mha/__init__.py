"""flax_mha: multi-head attention for JAX.

Pure functions (`dot_product_attention`, masks, head splitting) -> Flax linen modules
(`MultiHeadAttention`, `SelfAttention`) -> the Transformer. See README.md.
"""

from flax_mha import interop
from flax_mha import masks
from flax_mha.attention import IMPLEMENTATIONS
from flax_mha.attention import dot_product_attention
from flax_mha.attention import dot_product_attention_weights
from flax_mha.attention import merge_heads
from flax_mha.attention import split_heads
from flax_mha.masks import causal_mask
from flax_mha.masks import combine_masks
from flax_mha.masks import make_attention_mask
from flax_mha.masks import padding_mask
from flax_mha.masks import segment_mask
from flax_mha.modules import MultiHeadAttention
from flax_mha.modules import SelfAttention
from flax_mha.transformer import Transformer
from flax_mha.transformer import TransformerConfig
from flax_mha.decoding import beam_search
from flax_mha.decoding import greedy_decode
from flax_mha import sharding
from flax_mha.ring_attention import ring_attention

__version__ = "0.1.0"

