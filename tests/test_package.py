"""The package: `import flax_mha` and its pure API load no flax; the front ends and models load on
first access under the names the README shows."""

import os
import subprocess
import sys

import pytest

import flax_mha
from tests.multidevice.run import ROOT


def test_the_pure_api_loads_no_flax():
  """`import flax_mha`, a call of dot_product_attention (and explain, masks, mods, rotary,
  sharding): neither flax nor optax is imported; the front ends load on first access."""
  code = """
import sys
import jax.numpy as jnp
import flax_mha
x = jnp.ones((1, 4, 2, 8))
flax_mha.dot_product_attention(x, x, x, is_causal=True, mask_mod=lambda b, h, q, k: q >= k,
                               implementation="chunked")
flax_mha.apply_rotary(x, jnp.arange(4))
flax_mha.explain(x, x, x, local_window_size=2, platform="cuda")
flax_mha.padding_mask(jnp.array([3]), 4)
flax_mha.sharding.make_mesh()
loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('flax', 'optax'))
assert not loaded, loaded
flax_mha.nnx, flax_mha.SelfAttention  # loaded on first access
assert 'flax' in sys.modules
"""
  subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, env=dict(
      os.environ, JAX_PLATFORMS="cpu"))


def test_lazy_names_are_the_front_ends_and_models():
  """The names that load on first access are the objects of the modules that define them."""
  from flax_mha.models import decoding, lm, transformer  # pylint: disable=import-outside-toplevel
  from flax_mha.nn import linen, nnx  # pylint: disable=import-outside-toplevel
  assert flax_mha.nnx is nnx and flax_mha.linen is linen
  assert flax_mha.MultiHeadAttention is linen.MultiHeadAttention
  assert flax_mha.SelfAttention is linen.SelfAttention
  assert flax_mha.Transformer is transformer.Transformer
  assert flax_mha.TransformerConfig is transformer.TransformerConfig
  assert flax_mha.DecoderLM is lm.DecoderLM and flax_mha.LMConfig is lm.LMConfig
  assert flax_mha.greedy_decode is decoding.greedy_decode
  assert flax_mha.beam_search is decoding.beam_search
  assert {"MultiHeadAttention", "nnx", "Transformer"} <= set(dir(flax_mha))
  with pytest.raises(AttributeError, match="module 'flax_mha' has no attribute 'Nope'"):
    flax_mha.Nope  # pylint: disable=pointless-statement
