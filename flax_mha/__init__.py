"""flax_mha: multi-head attention for JAX.

Pure functions (`dot_product_attention`, masks, head splitting) -> Flax linen modules
(`MultiHeadAttention`, `SelfAttention`) -> the Transformer. See README.md.

The dimension key, used in docstrings ("query: [B, T, H, K]"), einsum strings
('BTHK,BSHK->BHTS') and name suffixes (`logits_BHTS`) throughout the package, tests and
experiments:

  B batch              T query (target) length     S key/value (source) length
  D model width        H query heads               G key/value heads (GQA/MQA; G divides H)
  R = H / G            K query/key head dim        V value head dim
  F FFN width          C vocabulary size           W beam width
  L a length where query and key length are the same thing (tokens [B, L])
  Q, P                 rows of a query tile and columns of a key tile (flax_mha.chunked)
  U, E                 (batch, key head) units per trip and the keys a tile reaches
                       (flax_mha.rows)

`jax.nn.dot_product_attention` and gemma call the heads N and the head dim H; here H is the head
count. Sizes without a letter above get their own, never a reused one.
"""

from flax_mha import interop
from flax_mha import masks
from flax_mha import mods
from flax_mha import nnx
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
from flax_mha.rotary import apply_rotary
from flax_mha.transformer import Transformer
from flax_mha.transformer import TransformerConfig
from flax_mha.decoding import beam_search
from flax_mha.decoding import greedy_decode
from flax_mha import sharding
from flax_mha.ring_attention import attention as ring_implementation
from flax_mha.ring_attention import ring_attention

__version__ = "0.1.0"

