"""flax_mha.ring_attention: 4 sequence shards equal single-device attention, values and grads.

The 8-device checks run in a subprocess (tests/multidevice/check_ring.py); argument checks run
here on the single CPU device.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_mha
from flax_mha import sharding
from flax_mha.ring_attention import ring_attention
from tests.conftest import np_attention
from tests.multidevice.run import run_check


@pytest.mark.multidevice
def test_ring_matches_single_device_on_8_devices():
  lines = run_check("check_ring.py")
  assert [line.split()[1] for line in lines] == ["full", "gqa_causal", "mqa_full",
                                                 "key_padding_causal", "full_mask"]


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


def test_ring_implementation_on_a_one_device_mesh(rng):
  q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
             for s in ((2, 5, 6, 11), (2, 7, 3, 11), (2, 7, 3, 13)))
  mask = jnp.asarray(rng.random((2, 1, 5, 7)) < 0.6)
  with jax.set_mesh(sharding.make_mesh()):
    out = flax_mha.dot_product_attention(q, k, v, mask=mask, implementation="ring")
  np.testing.assert_allclose(out, np_attention(q, k, v, mask=mask), atol=1e-5)


def test_ring_implementation_says_what_it_needs():
  x = jnp.ones((1, 4, 2, 8))
  with pytest.raises(ValueError, match="needs a mesh with a 'seq' axis"):
    flax_mha.dot_product_attention(x, x, x, implementation="ring")
  with pytest.raises(ValueError, match="not bias or dropout"):
    with jax.set_mesh(sharding.make_mesh()):
      flax_mha.dot_product_attention(x, x, x, bias=jnp.zeros((4, 4)), implementation="ring")
