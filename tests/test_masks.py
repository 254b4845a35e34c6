"""flax_mha.masks against NumPy constructions, and masked attention against truncated inputs."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_mha
from flax_mha import masks
from helpers import DIMS, np_attention, qkv

B, T, S, H = (DIMS[d] for d in "BTSH")


def test_padding_mask(variant):
  lengths = np.array([[0, 3, 7], [5, 1, 2]])
  out = variant(masks.padding_mask, static_argnums=1)(lengths, 7)
  chex.assert_shape(out, (2, 3, 7))
  chex.assert_type(out, bool)
  want = np.array([[[j < n for j in range(7)] for n in row] for row in lengths])
  np.testing.assert_array_equal(out, want)


def test_make_attention_mask(rng, variant):
  q_valid, k_valid = rng.random((B, T)) < 0.6, rng.random((B, S)) < 0.6
  out = variant(masks.make_attention_mask)(q_valid, k_valid)
  chex.assert_shape(out, (B, 1, T, S))
  want = np.einsum("bt,bs->bts", q_valid.astype(int), k_valid.astype(int))[:, None] > 0
  np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("t,s,offset", [(5, 5, 0), (5, 7, 0), (7, 5, 0), (3, 11, 4), (1, 13, 12)])
def test_causal_mask(variant, t, s, offset):
  out = variant(masks.causal_mask, static_argnums=(0, 1))(t, s, offset)  # offset traced under jit
  chex.assert_shape(out, (t, s))
  np.testing.assert_array_equal(out, np.tril(np.ones((t, s), bool), k=offset))


def test_causal_mask_default_square():
  np.testing.assert_array_equal(masks.causal_mask(5), np.tril(np.ones((5, 5), bool)))


def test_causal_mask_matches_is_causal(rng):
  q, k, v = qkv(rng)
  out = jax.jit(flax_mha.dot_product_attention)(q, k, v, mask=masks.causal_mask(T, S))
  np.testing.assert_allclose(out, np_attention(q, k, v, is_causal=True), atol=2e-5, rtol=2e-5)


def test_segment_mask(rng, variant):
  q_ids = np.array([[1, 1, 2, 2, 2], [0, 3, 3, 3, 4]])
  k_ids = np.array([[1, 2, 2, 5, 1, 1, 2], [3, 3, 0, 4, 4, 9, 0]])
  out = variant(masks.segment_mask)(q_ids, k_ids)
  chex.assert_shape(out, (2, 1, 5, 7))
  want = np.array([[[qi == ki for ki in kr] for qi in qr] for qr, kr in zip(q_ids, k_ids)])
  np.testing.assert_array_equal(out[:, 0], want)
  self_mask = masks.segment_mask(q_ids)
  chex.assert_shape(self_mask, (2, 1, 5, 5))
  np.testing.assert_array_equal(self_mask[:, 0], q_ids[:, :, None] == q_ids[:, None, :])


def test_combine_masks(rng):
  a, b = rng.random((B, 1, T, S)) < 0.5, rng.random((1, H, T, S)) < 0.5
  c = np.tril(np.ones((T, S), bool))
  out = masks.combine_masks(a, None, b, c)
  chex.assert_shape(out, (B, H, T, S))
  np.testing.assert_array_equal(out, a & b & c)
  np.testing.assert_array_equal(masks.combine_masks(None, a), a)
  assert masks.combine_masks(None, None) is None
  assert masks.combine_masks() is None


def test_segment_mask_packed_equals_separate_sequences(rng):
  """Two sequences packed into one row attend exactly as if run separately."""
  ids = np.array([1, 1, 1, 2, 2, 2, 2])  # lengths 3 and 4
  q, k, v = qkv(rng, batch=(), t=7, s=7)
  mask = masks.combine_masks(masks.segment_mask(ids), masks.causal_mask(7))
  packed = jax.jit(flax_mha.dot_product_attention)(q, k, v, mask=mask)
  for lo, hi in ((0, 3), (3, 7)):
    alone = np_attention(q[lo:hi], k[lo:hi], v[lo:hi], is_causal=True)
    np.testing.assert_allclose(packed[lo:hi], alone, atol=1e-5, rtol=1e-5)


def test_padding_mask_equals_truncated_keys(rng):
  """Masking padded keys equals attending to the unpadded prefix only (a NumPy reference)."""
  q, k, v = qkv(rng)
  lengths = np.array([3, 6])
  mask = masks.make_attention_mask(np.ones((B, T), bool), masks.padding_mask(lengths, S))
  out = jax.jit(flax_mha.dot_product_attention)(q, k, v, mask=mask)
  for b, n in enumerate(lengths):
    want = np_attention(q[b], k[b, :n], v[b, :n])
    np.testing.assert_allclose(out[b], want, atol=2e-5, rtol=2e-5)


def test_masks_do_not_retrace_for_new_values():
  @jax.jit
  @chex.assert_max_traces(n=1)
  def fn(lengths, offset, q_ids, k_ids):
    return masks.combine_masks(
        masks.make_attention_mask(masks.padding_mask(lengths, T), masks.padding_mask(lengths, S)),
        masks.causal_mask(T, S, offset), masks.segment_mask(q_ids, k_ids))

  for i in range(3):
    q_ids = jnp.array([[0, 0, i, 1, 1], [2, 2, 2, 2, i]])
    out = fn(jnp.array([i, 4]), i, q_ids, jnp.concatenate([q_ids, q_ids[:, :2]], axis=1))
    chex.assert_shape(out, (B, 1, T, S))
