"""Paged attention at the cases tests/cache/test_paged.py leaves out: a paged KV cache through a whole
front end equals a contiguous one, and the grid's cells for the integration part ((slow) the
rest of it) through that file's own test."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_mha
from flax_mha import cache as cache_lib
import test_paged as unit
from test_paged import B, G, H, K, N_PAGES, PAGE, POOL

pytestmark = pytest.mark.integration  # a whole model end to end: seconds of compiles


@pytest.mark.parametrize("implementation,option,t", unit.PAGED_GRID.integration)
def test_paged_equals_contiguous_values_and_gradients(implementation, option, t):
  unit.test_paged_equals_contiguous_values_and_gradients(implementation, option, t)


def test_a_paged_cache_through_the_front_end_equals_a_contiguous_one():
  module = flax_mha.SelfAttention(num_heads=H, num_kv_heads=G, qkv_features=H * K,
                                  rotary_max_wavelength=100.0, logit_soft_cap=3.0)
  x = jax.random.normal(jax.random.key(0), (B, 11, 16))
  params = module.init(jax.random.key(1), x, is_causal=True)
  table = jnp.asarray(np.random.default_rng(3).permutation(POOL)[:B * N_PAGES].reshape(
      B, N_PAGES), jnp.int32)
  paged = cache_lib.PagedKVCache.create(POOL, PAGE, table, G, K)
  contiguous = module.new_cache(B, N_PAGES * PAGE, in_features=16)
  outs = {}
  step = jax.jit(lambda x, cache: module.apply(params, x, cache=cache))
  for name, cache in (("paged", paged), ("contiguous", contiguous)):
    y, cache = step(x[:, :7], cache)
    steps = [y]
    for t in range(7, 11):
      y, cache = step(x[:, t:t + 1], cache)
      steps.append(y)
    outs[name] = jnp.concatenate(steps, axis=1)
  np.testing.assert_allclose(outs["paged"], outs["contiguous"], atol=2e-6, rtol=2e-6)
  np.testing.assert_allclose(outs["paged"], module.apply(params, x, is_causal=True), atol=2e-6)
