"""flax_mha.nn.linen's KV cache under jax_enable_x64, decoding a whole sequence step by step.
The linen front end's unit part is tests/nn/test_linen.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_linen import decode_setup

pytestmark = pytest.mark.integration  # a sequence decoded step by step: seconds of compiles


def test_decode_under_x64(rng):
  """Regression: under jax_enable_x64 the cache update mixed int64 zeros with the int32 index."""
  with jax.enable_x64(True):
    x, decoder, params, cache, want = decode_setup(rng)
    outs = []
    for t in range(x.shape[1]):
      out, state = decoder.apply({**params, "cache": cache}, x[:, t:t + 1], mutable=["cache"])
      cache = state["cache"]
      outs.append(out)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), want, atol=1e-5, rtol=1e-5)
  assert not jax.config.jax_enable_x64
