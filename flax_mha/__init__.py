"""flax_mha: multi-head attention for JAX.

The package is layered in rooms, each a set of top-level modules or a folder; a module imports
only from its own room or rooms listed before it, and the import graph between modules has no
circle (tests/test_layering.py reads this list):

  checks, mods, masks, rotary, platforms, call_options, interop, quant, precision
              the base every layer shares: argument checks, mask and score terms, rotary,
              the platform at hand, a call's options record, torch weights, an int8 cache's
              quantization, low-precision products accumulating in float32
  kernels/    the implementations behind `implementation=` (reference, the oracle; xla, rows,
              chunked, decode, cudnn, splash, triton, triton_decode) and what they share
  dispatch    what None runs on each platform, and why (reads the kernels' registry only)
  parallel/   scale-out: meshes and placement (`sharding`), sequence parallelism
              (`seq_parallel`: ring, all-gather, Ulysses; their layouts and mask terms)
  attention, remat
              the entry (dot_product_attention, explain, checks of its arguments; importing it
              registers every implementation), and what a training step recomputes
  cache/      the KV cache as data (int8 too), the steps that read it, paged
              attention, `attend` and `explain` (see `flax_mha.cache`)
  nn/         the front ends: `linen` (MultiHeadAttention, SelfAttention) and `nnx`
  models/     the Transformer, the decoder-only LM (its config, linen and NNX, its mixture of
              experts), decoding and sampling, Hugging Face checkpoints
  serving/    the page pool, the compiled serving loop, the Server and `serve`
  selftest/   `python -m flax_mha.selftest`: every kernel on this device against the oracle
  experiments/
              beside the package: data, training, benchmarks; imports anything

The rooms up to cache/ load no flax (`remat.layer_class`
imports flax.linen only when a model calls it); nothing in flax_mha/ imports experiments/. No
module imports an underscore name of another module: what several modules use is public
internal API.

`import flax_mha` loads no flax: the front ends and models (`flax_mha.MultiHeadAttention`,
`flax_mha.nnx`, `flax_mha.Transformer`, ...) load on first access.

The dimension key, used in docstrings ("query: [B, T, H, K]"), einsum strings
('BTHK,BSHK->BHTS') and name suffixes (`logits_BHTS`) throughout the package, tests and
experiments:

  B batch              T query (target) length     S key/value (source) length
  D model width        H query heads               G key/value heads (GQA/MQA; G divides H)
  R = H / G            K query/key head dim        V value head dim
  F FFN width          C vocabulary size           W beam width
  J the rotated width of a head (rotary's partial rotation: K · fraction)
  L a length where query and key length are the same thing (tokens [B, L])
  Q, P                 rows of a query tile and columns of a key tile (flax_mha.kernels.chunked)
  U, E                 (batch, key head) units per trip and the keys a tile reaches
                       (flax_mha.kernels.rows)
  X, A                 experts, and the experts each token takes (top-k; flax_mha.models.moe)
  Y, M                 tokens of a batch flattened (B·L), and their Y·A routed rows

`jax.nn.dot_product_attention` and gemma call the heads N and the head dim H; here H is the head
count. Sizes without a letter above get their own, never a reused one.
"""

import importlib

from flax_mha import cache
from flax_mha import checks
from flax_mha import dispatch
from flax_mha import interop
from flax_mha import masks
from flax_mha import mods
from flax_mha.cache import paged
from flax_mha import platforms
from flax_mha import quant
from flax_mha import remat
from flax_mha import rotary
from flax_mha.parallel import sharding
from flax_mha.cache import steps
from flax_mha.attention import IMPLEMENTATIONS
from flax_mha.attention import confine_nonfinite
from flax_mha.attention import dot_product_attention
from flax_mha.attention import dot_product_attention_weights
from flax_mha.attention import explain
from flax_mha.attention import merge_heads
from flax_mha.attention import split_heads
from flax_mha.dispatch import stage_accelerator_kernels
from flax_mha.parallel.seq_parallel import attention as ring_implementation
from flax_mha.parallel.seq_parallel import ring_attention
from flax_mha.parallel.seq_parallel import sequence_parallel_attention
from flax_mha.parallel.seq_parallel import sequence_parallel_implementation
from flax_mha.masks import causal_mask
from flax_mha.masks import combine_masks
from flax_mha.masks import make_attention_mask
from flax_mha.masks import padding_mask
from flax_mha.masks import segment_mask
from flax_mha.cache.paged import paged_attention
from flax_mha.remat import remat_implementation
from flax_mha.rotary import Rope
from flax_mha.rotary import apply_rotary

__version__ = "0.1.0"

# Public names that need flax, loaded on first access: name -> (module, attribute or None for
# the module itself).
_LAZY = {
    "nn": ("flax_mha.nn", None),
    "models": ("flax_mha.models", None),
    "nnx": ("flax_mha.nn.nnx", None),
    "linen": ("flax_mha.nn.linen", None),
    "MultiHeadAttention": ("flax_mha.nn.linen", "MultiHeadAttention"),
    "SelfAttention": ("flax_mha.nn.linen", "SelfAttention"),
    "AttentionOptions": ("flax_mha.nn.options", "AttentionOptions"),
    "Norm": ("flax_mha.nn.options", "Norm"),
    "Transformer": ("flax_mha.models.transformer", "Transformer"),
    "TransformerConfig": ("flax_mha.models.transformer", "TransformerConfig"),
    "DecoderLM": ("flax_mha.models.lm", "DecoderLM"),
    "LMConfig": ("flax_mha.models.lm_config", "LMConfig"),
    "beam_search": ("flax_mha.models.transformer", "beam_search"),
    "greedy_decode": ("flax_mha.models.transformer", "greedy_decode"),
}


def __getattr__(name):
  if name not in _LAZY:
    raise AttributeError(f"module 'flax_mha' has no attribute {name!r}")
  module_name, attribute = _LAZY[name]
  module = importlib.import_module(module_name)
  value = module if attribute is None else getattr(module, attribute)
  globals()[name] = value  # later accesses skip this function
  return value


def __dir__():
  return sorted(set(globals()) | set(_LAZY))
