"""Mods under the transforms a model composes, and what a -inf logit and an odd mod mean.

Regression tests of issue 17: mask_mod/score_mod closing over arrays computed inside a
`lax.scan` body, `jax.checkpoint` or `vmap` (with `jax.grad`) in every implementation that takes
mods; a soft cap or score_mod never un-hides a key that a -inf bias hides; a mod that is not
elementwise, or has the wrong signature, is refused naming the argument; windows wider than the
sequence; no inf or NaN made inside any implementation (`jax.debug_infs`).
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_mha
from flax_mha.kernels import chunked
from conftest import np_attention

B, T, H, G, K = 2, 11, 4, 2, 8  # T prime: no block size divides it
IMPLS = {"reference": "reference", "xla": "xla", "chunked": "chunked",
         "chunked_small": chunked.make_attention(block_q=3, block_k=4)}
DOCS = np.array([[0] * 4 + [1] * 7, [0] * 9 + [1] * 2], np.int32)


def _qkv(seed=0, dtype=np.float32):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.standard_normal(shape), dtype)
               for shape in ((B, T, H, K), (B, T, G, K), (B, T, G, K)))


def _layer(x_BTHK, kv_BTGK, docs_BT, table_H, impl):
  """One attention layer whose mask_mod closes over integer ids and whose score_mod closes
  over a float table, both traced values of the caller."""
  return flax_mha.dot_product_attention(
      x_BTHK, kv_BTGK, kv_BTGK, is_causal=True, implementation=impl,
      mask_mod=lambda b, h, q, kv: docs_BT[b, q] == docs_BT[b, kv],
      score_mod=lambda s, b, h, q, kv: s + table_H[h])


def _scan(impl):
  def loss(x, kv, table):
    def body(carry, _):
      docs = jnp.asarray(DOCS) + (jnp.sum(carry) > 1e9).astype(jnp.int32)  # made in the body
      return _layer(carry, kv, docs, table, impl), None
    return jnp.sum(jnp.sin(jax.lax.scan(body, x, None, length=2)[0]))
  return loss


def _checkpoint(impl):
  def loss(x, kv, table):
    layer = jax.checkpoint(lambda x, docs: _layer(x, kv, docs, table, impl))
    return jnp.sum(jnp.sin(layer(x, jnp.asarray(DOCS) * (x[0, 0, 0, 0] < 1e9))))
  return loss


def _vmap(impl):
  def loss(x, kv, table):
    one = lambda x, kv, docs: _layer(x[None], kv[None], docs[None], table, impl)[0]
    return jnp.sum(jnp.sin(jax.vmap(one)(x, kv, jnp.asarray(DOCS))))
  return loss


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("transform", [_scan, _checkpoint, _vmap],
                         ids=["scan", "checkpoint", "vmap"])
def test_mods_closing_over_traced_arrays_under_transforms_with_grad(impl, transform):
  q, k, _ = _qkv(1)
  table = jnp.asarray([0.3, -0.2, 0.1, 0.5])
  grad = jax.value_and_grad(transform(IMPLS[impl]), argnums=(0, 1, 2))
  got = jax.jit(grad)(q, k, table)
  want = jax.value_and_grad(transform("reference"), argnums=(0, 1, 2))(q, k, table)
  chex.assert_trees_all_close(got, want, atol=2e-5, rtol=2e-5)
  assert float(jnp.abs(got[1][2]).max()) > 0  # the table's gradient flows


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("mods", [dict(logit_soft_cap=2.0),
                                  dict(score_mod=lambda s, b, h, q, kv: 2.0 * jnp.tanh(s / 2.0)),
                                  dict(score_mod=lambda s, b, h, q, kv: jnp.maximum(s, -1.0))],
                         ids=["soft_cap", "tanh_score_mod", "clamping_score_mod"])
def test_minus_inf_bias_stays_hidden_through_score_terms(impl, mods):
  """cap·tanh(-inf / cap) = -cap would make a hidden key visible: it must stay hidden, a row
  hidden entirely stays 0, and the bias gradient there is 0."""
  q, k, v = _qkv(2)
  bias = np.zeros((B, 1, T, T), np.float32)
  bias[:, :, :, 7:] = -np.inf  # keys 7.. hidden from every query
  bias[0, 0, 3, :] = -np.inf  # query 3 of example 0 sees nothing
  bias = jnp.asarray(bias)
  fn = functools.partial(flax_mha.dot_product_attention, implementation=IMPLS[impl], **mods)
  out = fn(q, k, v, bias)
  np.testing.assert_array_equal(out[0, 3], 0.0)
  # The same function with the hidden keys removed: they contribute nothing.
  cut = fn(q, k[:, :7], v[:, :7], jnp.where(jnp.isfinite(bias[..., :7]), 0.0, -jnp.inf))
  np.testing.assert_allclose(out, cut, atol=2e-6, rtol=2e-6)
  dbias = jax.grad(lambda b: jnp.sum(fn(q, k, v, b) ** 2))(bias)
  chex.assert_tree_all_finite(dbias)
  np.testing.assert_array_equal(dbias[..., 7:], 0.0)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_score_mod_returning_minus_inf_hides_the_key(impl):
  """FlexAttention's idiom: a score_mod may hide a key by returning -inf."""
  q, k, v = _qkv(3)
  mod = lambda s, b, h, q, kv: jnp.where(kv > q, -jnp.inf, s)
  out = flax_mha.dot_product_attention(q, k, v, score_mod=mod, implementation=IMPLS[impl])
  np.testing.assert_allclose(out, np_attention(q, k, v, is_causal=True), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", ["reference", None, "chunked", "chunked_small"])
def test_dense_array_as_mask_mod_is_refused_by_name(impl):
  dense_TS = jnp.tril(jnp.ones((T, T), bool))
  q, k, v = _qkv(4)
  with pytest.raises(ValueError, match=r"mask_mod must be elementwise.*shape \(11, 11\).*"
                                       r"pass that array as `mask`"):
    flax_mha.dot_product_attention(q, k, v, mask_mod=lambda b, h, qi, kv: dense_TS,
                                   implementation=IMPLS.get(impl, impl))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(mask_mod=lambda b, h, q: q > 0), TypeError,
     r"mask_mod must take 4 positional arguments \(b, h, q_idx, kv_idx\) -> bool, got a "
     r"callable with signature \(b, h, q\)"),
    (dict(score_mod=lambda b, h, q, kv: q > kv), TypeError,
     r"score_mod must take 5 positional arguments \(score, b, h, q_idx, kv_idx\)"),
    (dict(mask_mod=lambda s, b, h, q, kv: q > kv), TypeError,
     "mask_mod must take 4 positional arguments"),
    (dict(score_mod=lambda s, b, h, q, kv: s[..., :1]), ValueError,
     r"score_mod failed when called with scalar arguments .* elementwise"),
    (dict(score_mod=lambda s, b, h, q, kv: jnp.stack([s, s])), ValueError,
     r"score_mod must be elementwise: .* got shape \(2,\)"),
])
def test_mods_of_the_wrong_shape_or_signature_are_named(kwargs, error, match):
  q, k, v = _qkv(5)
  with pytest.raises(error, match=match):
    flax_mha.dot_product_attention(q, k, v, **kwargs)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_window_wider_than_the_sequence_is_no_limit(impl):
  q, k, v = _qkv(6)
  fn = jax.jit(lambda q: flax_mha.dot_product_attention(
      q, k, v, local_window_size=(2**40, 0), implementation=IMPLS[impl]))
  np.testing.assert_allclose(fn(q), np_attention(q, k, v, is_causal=True), atol=2e-5,
                             rtol=2e-5)


CASES = {
    "mask": lambda rng: dict(mask=jnp.asarray(rng.random((B, 1, T, T)) < 0.5).at[0, 0, 2]
                             .set(False)),
    "causal": lambda rng: dict(is_causal=True),
    "lengths": lambda rng: dict(query_seq_lengths=jnp.array([3, 11]),
                                key_value_seq_lengths=jnp.array([0, 11])),
    "segments_soft_cap": lambda rng: dict(q_segment_ids=jnp.asarray(DOCS), logit_soft_cap=3.0),
    "window_mask": lambda rng: dict(local_window_size=(2, 0),
                                    mask=jnp.asarray(rng.random((B, 1, T, T)) < 0.5)),
}


@pytest.mark.parametrize("impl", ["reference", "xla", "chunked", "rows"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_no_inf_or_nan_is_made_inside(impl, case, dtype):
  """With `jax.debug_infs`, op by op (no jit), forward and gradient: finite input, masks hiding
  whole rows, and no implementation writes an inf anywhere."""
  kwargs = CASES[case](np.random.default_rng(7))
  if impl == "rows" and set(kwargs) - {"mask", "is_causal"}:
    pytest.skip("rows takes bias, mask and is_causal only")
  with jax.enable_x64(dtype == np.float64), jax.debug_infs(True):
    q, k, v = _qkv(8, dtype)
    loss = lambda q: jnp.sum(flax_mha.dot_product_attention(q, k, v, implementation=impl,
                                                            **kwargs) ** 2)
    value, grad = jax.value_and_grad(loss)(q)
  chex.assert_tree_all_finite((value, grad))
