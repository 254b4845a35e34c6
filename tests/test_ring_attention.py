"""flax_mha.ring_attention: 4 sequence shards equal single-device attention, values and grads.

The 8-device checks run in a subprocess (tests/multidevice/check_ring.py); argument checks run
here on the single CPU device.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from flax_mha import sharding
from flax_mha.ring_attention import ring_attention
from tests.conftest import np_attention
from tests.multidevice.run import run_check


@pytest.mark.multidevice
def test_ring_matches_single_device_on_8_devices():
  lines = run_check("check_ring.py")
  assert [line.split()[1] for line in lines] == ["full", "gqa_causal", "mqa_full"]


@pytest.mark.parametrize("is_causal", [False, True])
def test_one_device_ring_is_plain_attention(rng, is_causal):
  q, k, v = (rng.standard_normal(s).astype(np.float32)
             for s in ((2, 5, 6, 11), (2, 5, 3, 11), (2, 5, 3, 13)))
  out = ring_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                       mesh=sharding.make_mesh(), is_causal=is_causal)
  np.testing.assert_allclose(out, np_attention(q, k, v, is_causal=is_causal), atol=1e-5)


def test_rejects_bad_shapes():
  mesh = sharding.make_mesh()
  with pytest.raises(ValueError, match=r"\[B, T, H, K\]"):
    ring_attention(jnp.ones((5, 6, 7)), jnp.ones((5, 6, 7)), jnp.ones((5, 6, 7)), mesh=mesh)
