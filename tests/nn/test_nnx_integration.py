"""flax_mha.nn.nnx and the linen front end decoding a sequence step by step, equal to the whole
sequence recomputed (plain and with the modern options, GQA and MQA). The behavioural suite over
both front ends is the unit part, tests/nn/test_nnx.py, whose front ends this uses."""

import functools

import numpy as np
import pytest

from helpers import np_mha, randn
from test_nnx import (DQ, GQA_KW, KR, MODERN_CONFIGS, TOL, B, G, H, L, causal_visible,
                      np_modern, front_end)

import test_nnx_transforms as test_nnx_transforms_cases

import test_nnx_flax as test_nnx_flax_cases

pytestmark = pytest.mark.integration  # decoding step by step: one compile per step shape

# Cases of tests/nn/test_nnx_flax.py that compile for seconds: the unit part skips them
# (`check_` there), the integration part runs them here.
test_outputs_and_grads_equal_flax = (
    test_nnx_flax_cases.check_outputs_and_grads_equal_flax)

# Cases of tests/nn/test_nnx_transforms.py that compile for seconds: the unit part skips them
# (`check_` there), the integration part runs them here.
test_split_merge_and_jitted_functional_call = (
    test_nnx_transforms_cases.check_split_merge_and_jitted_functional_call)


@pytest.fixture(params=["linen", "nnx"])
def make_attention(request):
  """test_nnx.py's: make_attention(**kwargs) -> (front end, linen params), each in turn."""
  return functools.partial(front_end, request.param)


@pytest.mark.parametrize("g", [G, 1])  # G = H: test_decode_equals_flax
def test_decode_equals_recompute(make_attention, rng, g):
  attn, params = make_attention(**{**GQA_KW, "num_kv_heads": g})
  x = randn(rng, B, L, DQ)
  attn.init_cache((B, L, DQ))
  outs = [attn.step(x[:, a:b]) for a, b in ((0, 2), (2, 3), (3, 6), (6, 7))]  # T = 2, 1, 3, 1
  want = np_mha(params, x, x, x, is_causal=True)
  np.testing.assert_allclose(np.concatenate(outs, axis=1), want, **TOL)


@pytest.mark.parametrize("g", [G, 1])
def test_modern_decode_equals_recompute(make_attention, rng, g):
  """Rotary at cache_index + arange(T), the window at absolute cache positions, GQA."""
  config = MODERN_CONFIGS["all"]
  attn, params = make_attention(**{**GQA_KW, "num_kv_heads": g, "qkv_features": H * KR,
                                   **config})
  x = randn(rng, B, L, DQ)
  full, _ = attn(x, is_causal=True)
  attn.init_cache((B, L, DQ))
  outs = [attn.step(x[:, a:b]) for a, b in ((0, 2), (2, 3), (3, 6), (6, 7))]  # T = 2, 1, 3, 1
  np.testing.assert_allclose(np.concatenate(outs, axis=1), full, **TOL)
  np.testing.assert_allclose(full, np_modern(params, config, x, causal_visible(config)),
                             **TOL)
