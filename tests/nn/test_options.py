"""`flax_mha.AttentionOptions`, the one record of a layer's own options, in both front ends.

Checked against the float64 NumPy forward pass of tests/helpers.py (np_mha). Dimension key
(flax_mha/__init__.py): B batch, L length, H heads, K head dim (even for rotary); sizes distinct.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_mha
from helpers import np_mha, random_params, randn
from flax_mha.nn import nnx as fnnx

B, L, H, K, D = 2, 7, 3, 10, 13
CAP, WAVELENGTH = 2.5, 100.0
TOL = dict(atol=3e-5, rtol=3e-5)
OPTIONS = flax_mha.AttentionOptions(logit_soft_cap=CAP, rotary_max_wavelength=WAVELENGTH)


def _np_reference(params, x):
  positions = np.arange(L)
  return np_mha(params, x, soft_cap=CAP, rotary=(WAVELENGTH, positions, positions))


def test_linen_module_runs_the_record(rng):
  x = randn(rng, B, L, D)
  layer = flax_mha.MultiHeadAttention(num_heads=H, qkv_features=H * K, attention_options=OPTIONS)
  params = random_params(layer, x)
  np.testing.assert_allclose(layer.apply(params, x), _np_reference(params, x), **TOL)


def test_nnx_module_runs_the_record(rng):
  x = randn(rng, B, L, D)
  layer = fnnx.MultiHeadAttention(H, D, H * K, attention_options=OPTIONS, rngs=nnx.Rngs(0))
  params = fnnx.nnx_to_linen_params(layer)
  np.testing.assert_allclose(layer(jnp.asarray(x)), _np_reference(params, x), **TOL)


def test_aliases_build_the_same_record():
  layer = flax_mha.MultiHeadAttention(num_heads=H, logit_soft_cap=CAP,
                                      rotary_max_wavelength=WAVELENGTH)
  assert layer.options == OPTIONS
  nnx_layer = fnnx.MultiHeadAttention(H, D, H * K, logit_soft_cap=CAP,
                                      rotary_max_wavelength=WAVELENGTH, rngs=nnx.Rngs(0))
  assert nnx_layer.options == OPTIONS


def test_record_and_an_alias_together_raise():
  with pytest.raises(ValueError, match=r"\['local_window_size'\] given as attributes"):
    fnnx.MultiHeadAttention(H, D, H * K, local_window_size=3, attention_options=OPTIONS,
                            rngs=nnx.Rngs(0))
  layer = flax_mha.MultiHeadAttention(num_heads=H, qkv_features=H * K, sink_tokens=1,
                                      attention_options=OPTIONS)
  with pytest.raises(ValueError, match=r"\['sink_tokens'\] given as attributes"):
    layer.init(jax.random.key(0), jnp.ones((B, L, D)))


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(logit_soft_cap=0.0), ValueError, "logit_soft_cap"),
    (dict(local_window_size=(2, -1)), ValueError, "local_window_size"),
    (dict(sink_tokens=-1), ValueError, "sink_tokens"),
    (dict(rotary_max_wavelength="10k"), TypeError, "rotary_max_wavelength"),
    (dict(learned_sinks=1), TypeError, "learned_sinks"),
])
def test_bad_options_raise_at_construction_naming_the_field(kwargs, error, message):
  with pytest.raises(error, match=message):
    flax_mha.AttentionOptions(**kwargs)


def test_window_is_stored_as_the_pair_and_keywords_name_pure_api_options():
  options = flax_mha.AttentionOptions(local_window_size=4, logit_soft_cap=CAP)
  assert options.local_window_size == (4, 4)
  # Every option the record holds, the window and sink tokens included (the cache paths place
  # those as their cache needs).
  assert options.keywords() == {"logit_soft_cap": CAP, "local_window_size": (4, 4),
                                "sink_tokens": 0}
  with pytest.raises(TypeError, match="attention_options must be a flax_mha.AttentionOptions"):
    flax_mha.MultiHeadAttention(num_heads=H, qkv_features=H * K,
                                attention_options={"logit_soft_cap": CAP}).init(
                                    jax.random.key(0), jnp.ones((B, L, D)))
