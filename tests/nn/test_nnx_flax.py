"""flax_mha.nn.nnx against flax.nnx.MultiHeadAttention: the same state tree, outputs and
gradients, sown weights, normalize_qk, decoding, and the linen module through nnx.bridge."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_mha
from helpers import randn, random_mask
from flax_mha.nn import nnx as fnnx
from test_nnx import (B, DK, DOUT, DQ, DV, FLAX_ARGS, FLAX_HAS_IS_CAUSAL, G, GQA_KW, H, K, L, S,
                      T, TOL, call_sowing, cross_inputs, pure, randomize, shared_shapes)

FLAX_CONFIGS = [kw for kw in (
    dict(in_features=H * K),  # every width from in_features
    dict(qkv_features=H * K, out_features=DOUT, in_kv_features=DK),
    dict(qkv_features=H * K, use_bias=False, dropout_rate=0.2),
    dict(qkv_features=H * K, num_kv_heads=G),
) if set(kw) <= set(FLAX_ARGS)]


def _pair(**kwargs):
  """(ours, flax's) with the same constructor args, ours loaded with flax's random params."""
  kwargs = {"in_features": DQ, **kwargs}
  theirs = randomize(nnx.MultiHeadAttention(H, rngs=nnx.Rngs(1), **kwargs))
  ours = fnnx.MultiHeadAttention(H, rngs=nnx.Rngs(0), **kwargs)
  nnx.update(ours, nnx.state(theirs, nnx.Param))
  return ours, theirs


@pytest.mark.parametrize("kwargs", FLAX_CONFIGS)
def test_state_tree_equals_flax(kwargs):
  kwargs = {"in_features": DQ, **kwargs}
  ours = fnnx.MultiHeadAttention(H, rngs=nnx.Rngs(0), **kwargs)
  theirs = nnx.MultiHeadAttention(H, rngs=nnx.Rngs(0), **kwargs)
  assert shared_shapes(ours) == shared_shapes(theirs)  # every collection: params, and rngs with dropout
  assert set(shared_shapes(ours, nnx.Param)) == {"query", "key", "value", "out"}


@pytest.mark.parametrize("kwargs", FLAX_CONFIGS)
def check_outputs_and_grads_equal_flax(rng, kwargs):
  ours, theirs = _pair(decode=False, deterministic=True, **kwargs)
  xq = randn(rng, B, T, ours.in_features)
  xk = randn(rng, B, S, ours.in_kv_features)
  mask = random_mask(rng, B, 1, T, S).astype(np.float32)  # flax's 1/0 convention
  np.testing.assert_allclose(ours(xq, xk, mask=mask), theirs(xq, xk, mask=mask), **TOL)
  loss = lambda m: jnp.sum(jnp.sin(m(xq, xk, mask=mask)))
  grads_ours = pure(nnx.grad(loss)(ours))
  grads_theirs = pure(nnx.grad(loss)(theirs))
  chex.assert_trees_all_close(grads_ours, grads_theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not FLAX_HAS_IS_CAUSAL, reason="this flax's nnx attention has no is_causal")
def test_is_causal_equals_flax(rng):
  ours, theirs = _pair(decode=False, qkv_features=H * K)
  x = randn(rng, B, T, DQ)
  np.testing.assert_allclose(ours(x, is_causal=True), theirs(x, is_causal=True), **TOL)


def test_sow_weights_equal_flax(rng):
  ours, theirs = _pair(decode=False, qkv_features=H * K)
  x, mask = randn(rng, B, T, DQ), random_mask(rng, B, H, T, T)
  out, weights = call_sowing(ours, x, mask=mask)
  want_out, want_weights = call_sowing(theirs, x, mask=mask)
  np.testing.assert_allclose(weights, want_weights, **TOL)
  np.testing.assert_allclose(out, want_out, **TOL)


@pytest.mark.skipif("normalize_qk" not in FLAX_ARGS, reason="this flax has no normalize_qk")
def test_normalize_qk_state_and_outputs_equal_flax(rng):
  ours, theirs = _pair(decode=False, qkv_features=H * K, normalize_qk=True)
  assert shared_shapes(ours, nnx.Param) == shared_shapes(theirs, nnx.Param)
  assert shared_shapes(ours, nnx.Param)["query_ln"] == {"scale": (K,)}
  assert np.abs(theirs.query_ln.scale[...] - 1).max() > 1e-3  # randomize reached the scales
  xq, xk = randn(rng, B, T, DQ), randn(rng, B, S, DQ)
  np.testing.assert_allclose(ours(xq, xk), theirs(xq, xk), **TOL)
  # and the linen tree of the same weights is the linen module's
  linen = flax_mha.MultiHeadAttention(num_heads=H, qkv_features=H * K, normalize_qk=True)
  np.testing.assert_allclose(linen.apply(fnnx.nnx_to_linen_params(ours), xq, xk),
                             theirs(xq, xk), **TOL)


@pytest.mark.parametrize("g", [None] + ([G] if "num_kv_heads" in FLAX_ARGS else []))
def test_decode_equals_flax(rng, g):
  gqa = {} if g is None else dict(num_kv_heads=g)
  ours, theirs = _pair(decode=True, qkv_features=H * K, **gqa)
  x = randn(rng, B, L, DQ)
  ours.init_cache(x.shape)
  theirs.init_cache(x.shape)
  for t in range(L):  # flax decodes one token a call
    np.testing.assert_allclose(ours(x[:, t:t + 1]), theirs(x[:, t:t + 1]), **TOL)
  np.testing.assert_allclose(ours.cached_value[...], theirs.cached_value[...], **TOL)
  assert int(ours.cache_index[...]) == int(theirs.cache_index[...]) == L


def test_bridge_to_nnx_equals_native(rng):
  xq, xk, xv = cross_inputs(rng)
  linen = flax_mha.MultiHeadAttention(out_features=DOUT, **GQA_KW)
  bridge = nnx.bridge.ToNNX(linen, rngs=nnx.Rngs(0))
  nnx.bridge.lazy_init(bridge, xq, xk, xv)
  ours = randomize(fnnx.MultiHeadAttention(
      in_features=DQ, in_kv_features=DK, in_v_features=DV, out_features=DOUT,
      rngs=nnx.Rngs(0), **GQA_KW))
  assert shared_shapes(bridge, nnx.Param) == shared_shapes(ours, nnx.Param)
  nnx.update(bridge, nnx.state(ours, nnx.Param))
  mask, bias = random_mask(rng, B, 1, T, S), randn(rng, H, T, S)
  np.testing.assert_allclose(bridge(xq, xk, xv, mask=mask, bias=bias),
                             ours(xq, xk, xv, mask=mask, bias=bias), **TOL)
