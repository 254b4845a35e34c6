"""Models built on the front ends: the encoder-decoder `transformer` of "Attention Is All You
Need", the decoder-only `lm` (and `lm_nnx`, its NNX twin), and `decoding` (greedy and beam
search) and `serving` for linen and NNX models alike."""

from flax_mha.models.decoding import beam_search
from flax_mha.models.decoding import greedy_decode
from flax_mha.models.lm import DecoderLM
from flax_mha.models.lm import LMConfig
from flax_mha.models.transformer import Transformer
from flax_mha.models.transformer import TransformerConfig
