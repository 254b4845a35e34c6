"""Run under XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/test_ring_attention.py does).

Ring attention over 4 sequence shards (x 2 batch shards) must equal the float64 NumPy attention
of tests/conftest.py in values and single-device `flax_mha.reference` in gradients: causal and
not, MHA, GQA and MQA, T != S, V != K.
Prints one 'OK ...' per check.
"""

import jax
import jax.numpy as jnp
import numpy as np

import flax_mha
from flax_mha import reference, sharding
from flax_mha.ring_attention import ring_attention
from tests.conftest import np_attention

B, H, K, V = 2, 6, 5, 7  # distinct sizes so a swapped axis fails

CASES = (  # (name, T, S, G, is_causal); T and S multiples of the 4 sequence shards
    ("full", 12, 20, H, False),
    ("gqa_causal", 12, 16, 3, True),
    ("mqa_full", 8, 12, 1, False),
)


def loss(attention):
  def fn(q, k, v):
    return jnp.sum(jnp.sin(attention(q, k, v)) * jnp.arange(V))
  return jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2)))


def single_device(is_causal, mask=None):
  return lambda q, k, v: reference.attention(q, k, v, None, mask, is_causal=is_causal,
                                             scale=K**-0.5, dropout_rate=0.0, dropout_rng=None)


def check_masked_via_dot_product_attention(rng):
  """implementation='ring' under jax.set_mesh on data x model x seq = 2 x 2 x 2, with masks."""
  t, s, g = 8, 12, 2
  q = jnp.asarray(rng.standard_normal((B, t, H, K)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((B, s, g, K)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((B, s, g, V)), jnp.float32)
  key_padding = (jnp.arange(s) < jnp.array([s, 5])[:, None])[:, None, None, :]  # [B, 1, 1, S]
  full = key_padding & jnp.asarray(rng.random((B, 1, t, s)) < 0.7)
  full = full.at[1, :, 3].set(False)  # a query row with no visible key: output 0
  mesh = sharding.make_mesh(data=2, model=2, seq=2)
  for name, mask, is_causal in (("key_padding_causal", key_padding, True),
                                ("full_mask", full, False)):
    ring = lambda q, k, v: flax_mha.dot_product_attention(
        q, k, v, mask=mask, is_causal=is_causal, implementation="ring")
    with jax.set_mesh(mesh):
      out = jax.jit(ring)(q, k, v)
      got_l, got_g = loss(ring)(q, k, v)
    assert out.sharding.spec == jax.sharding.PartitionSpec("data", "seq", "model"), out.sharding
    want = np_attention(q, k, v, mask=mask, is_causal=is_causal)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    want_l, want_g = loss(single_device(is_causal, mask))(q, k, v)
    np.testing.assert_allclose(got_l, want_l, rtol=1e-5, atol=1e-4)
    for x, a, b in zip("qkv", got_g, want_g):
      assert np.all(np.isfinite(a)), f"d{x}"
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=f"d{x}")
    print(f"OK {name} max|out - float64|={float(np.abs(out - want).max()):.1e}")


def main():
  assert jax.device_count() == 8, jax.device_count()
  mesh = sharding.make_mesh(data=2, seq=4)
  rng = np.random.default_rng(0)
  for name, t, s, g, is_causal in CASES:
    q = jnp.asarray(rng.standard_normal((B, t, H, K)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, s, g, K)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, s, g, V)), jnp.float32)
    ring = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, is_causal=is_causal,
                                          batch_axis="data")
    out = jax.jit(ring)(q, k, v)
    assert out.sharding.spec == jax.sharding.PartitionSpec("data", "seq"), out.sharding.spec
    assert out.addressable_shards[0].data.shape == (B // 2, t // 4, H, V)
    want = np_attention(q, k, v, is_causal=is_causal)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    got_l, got_g = loss(ring)(q, k, v)
    want_l, want_g = loss(single_device(is_causal))(q, k, v)
    np.testing.assert_allclose(got_l, want_l, rtol=1e-5, atol=1e-4)
    for x, a, b in zip("qkv", got_g, want_g):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=f"d{x}")
    print(f"OK {name} max|out - float64|={float(np.abs(out - want).max()):.1e}")
  check_masked_via_dot_product_attention(rng)


if __name__ == "__main__":
  main()
