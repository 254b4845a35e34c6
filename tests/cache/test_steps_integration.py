"""The step past its threshold: the integration part of tests/cache/test_steps.py (three caches,
each compiled twice)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_mha import cache as cache_lib
from flax_mha import dispatch
from test_steps import B, G, H, K, shared_caches

pytestmark = pytest.mark.integration


def test_a_step_past_the_threshold_equals_the_step(rng):
  """The same tokens through the step (T = FEW_QUERIES) and through dot_product_attention
  (T = FEW_QUERIES + 1, one more padded query) give the same rows."""
  few = dispatch.FEW_QUERIES
  arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  q, k, v = arr(B, few + 1, H, K), arr(B, few + 1, G, K), arr(B, few + 1, G, K)
  attend = jax.jit(lambda q, k, v, cache, positions: cache_lib.attend(q, k, v, cache,
                                                                     positions)[0])
  for cache in shared_caches().values():
    positions = jnp.broadcast_to(jnp.arange(few + 1, dtype=jnp.int32), (B, few + 1))
    padded = positions.at[:, -1].set(-1)
    step = attend(q[:, :few], k[:, :few], v[:, :few], cache, positions[:, :few])
    dense = attend(q, k, v, cache, padded)
    np.testing.assert_allclose(step, dense[:, :few], atol=2e-6, rtol=2e-6)
