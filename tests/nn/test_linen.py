"""flax_mha.nn.linen against a float64 NumPy forward pass and flax.linen's attention modules."""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_mha
from conftest import DIMS, np_attention, randn, random_mask

B, T, S, H, G, K, V = (DIMS[d] for d in "BTSHGKV")
DQ, DK, DV, DOUT = 19, 23, 29, 17  # model widths: query, key and value inputs, output
TOL = dict(atol=2e-5, rtol=2e-5)


def np_module(params, xq, xk, xv, mask=None, *, is_causal=False):
  """MultiHeadAttention's forward pass in float64 NumPy: projections, attention, out projection."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params["params"])
  proj = lambda x, name: np.einsum("...d,dhk->...hk", x, p[name]["kernel"]) + p[name].get("bias", 0)
  out = np_attention(proj(xq, "query"), proj(xk, "key"), proj(xv, "value"), mask=mask,
                     is_causal=is_causal)
  return np.einsum("...hv,hvd->...d", out, p["out"]["kernel"]) + p["out"].get("bias", 0)


def _inputs(rng, batch=(B,)):
  return randn(rng, *batch, T, DQ), randn(rng, *batch, S, DK), randn(rng, *batch, S, DV)


def _init(model, *args, **kwargs):
  """Random params of the shapes `model.init` makes (NumPy: no compile), biases non-zero."""
  shapes = jax.eval_shape(functools.partial(model.init, **kwargs), jax.random.key(0), *args)
  rng = np.random.default_rng(1)
  return jax.tree.map(lambda a: randn(rng, *a.shape, dtype=a.dtype) * 0.3, shapes)


@pytest.mark.parametrize("g", [G, 1])  # g = H is covered by the flax comparisons
def test_cross_attention_matches_numpy(rng, variant, g):
  xq, xk, xv = _inputs(rng)
  mask = random_mask(rng, B, 1, T, S)
  model = flax_mha.MultiHeadAttention(
      num_heads=H, num_kv_heads=g, qkv_features=H * K, v_features=H * V, out_features=DOUT)
  params = _init(model, xq, xk, xv, mask=mask)
  # D, E, P: query, key and value input widths (F is the FFN width); O: output width.
  dims = chex.Dimensions(D=DQ, E=DK, P=DV, H=H, G=g, K=K, V=V, O=DOUT)
  p = params["params"]
  chex.assert_shape([p["query"]["kernel"], p["key"]["kernel"], p["value"]["kernel"],
                     p["out"]["kernel"], p["out"]["bias"]],
                    [dims["DHK"], dims["EGK"], dims["PGV"], dims["HVO"], dims["O"]])
  out = variant(functools.partial(model.apply, mask=mask))(params, xq, xk, xv)
  chex.assert_shape(out, (B, T, DOUT))
  np.testing.assert_allclose(out, np_module(params, xq, xk, xv, mask), **TOL)


@pytest.mark.parametrize("batch", [(), (2, 3)])
def test_self_attention_batch_dims(rng, batch):
  x = randn(rng, *batch, T, DQ)
  model = flax_mha.SelfAttention(num_heads=H, num_kv_heads=G, qkv_features=H * K)
  params = _init(model, x, is_causal=True)
  out = jax.jit(functools.partial(model.apply, is_causal=True))(params, x)
  chex.assert_shape(out, (*batch, T, DQ))
  np.testing.assert_allclose(out, np_module(params, x, x, x, is_causal=True), **TOL)
  mha = flax_mha.MultiHeadAttention(num_heads=H, num_kv_heads=G, qkv_features=H * K)
  np.testing.assert_allclose(mha.apply(params, x, x, is_causal=True), out, **TOL)


def test_sow_weights(rng):
  xq, xk, xv = _inputs(rng)
  mask = random_mask(rng, B, H, T, S)
  model = flax_mha.MultiHeadAttention(num_heads=H, num_kv_heads=G, qkv_features=H * K)
  params = _init(model, xq, xk, xv)
  _, state = model.apply(params, xq, xk, xv, mask=mask, sow_weights=True, mutable=["intermediates"])
  (weights,) = state["intermediates"]["attention_weights"]
  chex.assert_shape(weights, (B, H, T, S))
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params["params"])
  proj = lambda x, name: np.einsum("...d,dhk->...hk", x, p[name]["kernel"]) + p[name].get("bias", 0)
  _, want = np_attention(proj(xq, "query"), proj(xk, "key"), mask=mask, return_weights=True)
  np.testing.assert_allclose(weights, want, **TOL)
  _, state = model.apply(params, xq, xk, xv, mutable=["intermediates"])
  assert "attention_weights" not in state.get("intermediates", {})


def _flax_pair(**kwargs):
  ours = flax_mha.MultiHeadAttention(num_heads=H, qkv_features=H * K, out_features=DOUT, **kwargs)
  theirs = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=H * K, out_features=DOUT,
                                           **kwargs)
  return ours, theirs


def test_param_tree_identical_to_flax(rng):
  xq, xk, xv = _inputs(rng)
  ours, theirs = _flax_pair()
  init = lambda m: jax.jit(m.init)(jax.random.key(3), xq, xk, xv)
  p_ours, p_theirs = init(ours), init(theirs)
  assert jax.tree.structure(p_ours) == jax.tree.structure(p_theirs)
  chex.assert_trees_all_equal_shapes_and_dtypes(p_ours, p_theirs)
  chex.assert_trees_all_equal(p_ours, p_theirs)  # same initialisers, same rng streams


@pytest.mark.parametrize("direction", ["flax_into_ours", "ours_into_flax"])
def test_checkpoint_round_trip_with_flax(rng, variant, direction):
  xq, xk, xv = _inputs(rng)
  mask = random_mask(rng, B, 1, T, S)
  mask[..., 0] = True  # flax does not zero fully masked rows
  ours, theirs = _flax_pair()
  source = theirs if direction == "flax_into_ours" else ours
  params = _init(source, xq, xk, xv)
  out_ours = variant(functools.partial(ours.apply, mask=mask))(params, xq, xk, xv)
  out_theirs = variant(functools.partial(theirs.apply, mask=mask))(params, xq, xk, xv)
  chex.assert_shape(out_ours, (B, T, DOUT))
  np.testing.assert_allclose(out_ours, out_theirs, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(out_ours, np_module(params, xq, xk, xv, mask), **TOL)


def test_flax_self_attention_and_no_bias(rng):
  x = randn(rng, B, T, DQ)
  ours = flax_mha.SelfAttention(num_heads=H, qkv_features=H * K, use_bias=False)
  theirs = nn.SelfAttention(num_heads=H, qkv_features=H * K, use_bias=False)
  params = _init(theirs, x)
  assert jax.tree.structure(_init(ours, x)) == jax.tree.structure(params)
  out = jax.jit(ours.apply)(params, x)
  np.testing.assert_allclose(out, jax.jit(theirs.apply)(params, x), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(out, np_module(params, x, x, x), **TOL)


def test_dropout(rng):
  x = randn(rng, B, T, DQ)
  model = flax_mha.SelfAttention(num_heads=H, qkv_features=H * K, dropout_rate=0.4)
  params = _init(model, x)
  apply = jax.jit(model.apply, static_argnames="deterministic")
  run = lambda key, deterministic: apply(
      params, x, deterministic=deterministic, rngs={"dropout": jax.random.key(key)})
  clean = np_module(params, x, x, x)
  np.testing.assert_allclose(run(0, True), clean, **TOL)  # inactive when deterministic
  np.testing.assert_allclose(jax.jit(model.apply)(params, x), clean, **TOL)  # the default
  np.testing.assert_array_equal(run(0, False), run(0, False))
  assert not np.allclose(run(0, False), run(1, False), atol=1e-3)
  assert not np.allclose(run(0, False), clean, atol=1e-3)
  # With an explicit dropout_rng: ~40% of weights dropped, the rest rescaled by 1 / 0.6.
  _, state = jax.jit(functools.partial(
      model.apply, deterministic=False, sow_weights=True, mutable=["intermediates"]))(
          params, x, dropout_rng=jax.random.key(5))
  (weights,) = state["intermediates"]["attention_weights"]
  weights = np.asarray(weights)
  dropped = weights == 0
  assert abs(dropped.mean() - 0.4) < 0.1
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params["params"])
  proj = lambda name: np.einsum("...d,dhk->...hk", x, p[name]["kernel"]) + p[name]["bias"]
  _, want = np_attention(proj("query"), proj("key"), return_weights=True)
  np.testing.assert_allclose(weights[~dropped], want[~dropped] / 0.6, **TOL)


def _decode_setup(rng, length=7):
  x = randn(rng, B, length, DQ)
  full = flax_mha.SelfAttention(num_heads=H, num_kv_heads=G, qkv_features=H * K)
  params = _init(full, x)
  want = jax.jit(functools.partial(full.apply, is_causal=True))(params, x)
  np.testing.assert_allclose(want, np_module(params, x, x, x, is_causal=True), **TOL)
  decoder = flax_mha.SelfAttention(num_heads=H, num_kv_heads=G, qkv_features=H * K, decode=True)
  cache = jax.eval_shape(decoder.init, jax.random.key(0), x)["cache"]
  dims = chex.Dimensions(B=B, L=length, G=G, K=K)
  chex.assert_shape([cache["cached_key"], cache["cached_value"]], [dims["BLGK"]] * 2)
  cache = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), cache)  # what init fills it with
  return x, decoder, params, cache, want


@pytest.mark.parametrize("chunks", [[1] * 7, [2, 3, 1, 1]])
def test_kv_cache_decode_equals_full_causal(rng, chunks):
  x, decoder, params, cache, want = _decode_setup(rng)

  @jax.jit
  @chex.assert_max_traces(n=len(set(chunks)))  # one trace per chunk size, not per step
  def step(cache, x_chunk):
    out, state = decoder.apply({**params, "cache": cache}, x_chunk, mutable=["cache"])
    return out, state["cache"]

  outs, start = [], 0
  for n in chunks:
    out, cache = step(cache, x[:, start:start + n])
    chex.assert_shape(out, (B, n, DQ))
    outs.append(out)
    start += n
  assert int(cache["cache_index"]) == start
  np.testing.assert_allclose(jnp.concatenate(outs, axis=1), want, atol=1e-5, rtol=1e-5)


def test_kv_cache_decode_with_padding_mask(rng):
  """A per-step key mask over the cache (e.g. left padding) combines with the cache's causality."""
  x, decoder, params, cache, _ = _decode_setup(rng)
  key_valid = np.ones((B, 7), bool)
  key_valid[1, :2] = False  # batch 1 is left-padded by two tokens
  step = jax.jit(lambda cache, x_t: decoder.apply(
      {**params, "cache": cache}, x_t, mask=key_valid[:, None, None, :],  # [B, 1, 1, L]
      mutable=["cache"]))
  outs = []
  for t in range(7):
    out, state = step(cache, x[:, t:t + 1])
    cache = state["cache"]
    outs.append(out)
  want = np_module(params, x, x, x, mask=key_valid[:, None, None, :], is_causal=True)
  np.testing.assert_allclose(jnp.concatenate(outs, axis=1), want, atol=1e-5, rtol=1e-5)


def test_decode_init_with_cross_attention_lengths(rng):
  """Regression: the decode init call built a [S, S] causal mask for a [T, S] logit matrix."""
  xq, xk, xv = _inputs(rng)
  decoder = flax_mha.MultiHeadAttention(num_heads=H, qkv_features=H * K, decode=True)
  out, variables = jax.eval_shape(decoder.init_with_output, jax.random.key(0), xq, xk, xv)
  chex.assert_shape(out, (B, T, DQ))
  chex.assert_shape(variables["cache"]["cached_key"], (B, S, H, K))


def test_flax_float_masks_mean_attend(rng):
  """flax's own masks are float 1/0 (nonzero = attend): same output as the bool mask and as flax."""
  xq, xk, xv = _inputs(rng)
  ours, theirs = _flax_pair()
  self_params = _init(theirs, xq)
  float_causal = nn.make_causal_mask(np.zeros((B, T)))  # [B, 1, T, T] float32
  assert float_causal.dtype == jnp.float32
  bool_causal = np.tril(np.ones((T, T), bool))
  apply = jax.jit(ours.apply)
  got = apply(self_params, xq, mask=float_causal)
  np.testing.assert_allclose(got, apply(self_params, xq, mask=bool_causal), atol=1e-6, rtol=1e-6)
  np.testing.assert_allclose(got, theirs.apply(self_params, xq, mask=float_causal), atol=1e-5,
                             rtol=1e-5)
  np.testing.assert_allclose(got, np_module(self_params, xq, xq, xq, is_causal=True), **TOL)
  # Cross attention with nn.make_attention_mask (float32 too) and an int mask.
  params = _init(theirs, xq, xk, xv)
  q_valid, k_valid = np.ones((B, T)), (np.arange(S) < 4)[None].repeat(B, 0) * 1.0
  float_pad = nn.make_attention_mask(q_valid, k_valid)  # [B, 1, T, S]
  got = ours.apply(params, xq, xk, xv, mask=float_pad)
  np.testing.assert_allclose(got, theirs.apply(params, xq, xk, xv, mask=float_pad), atol=1e-5,
                             rtol=1e-5)
  np.testing.assert_allclose(got, ours.apply(params, xq, xk, xv, mask=float_pad.astype(jnp.int32)))
  np.testing.assert_allclose(got, np_module(params, xq, xk, xv, float_pad != 0), **TOL)


def test_decode_under_x64(rng):
  """Regression: under jax_enable_x64 the cache update mixed int64 zeros with the int32 index."""
  with jax.enable_x64(True):
    x, decoder, params, cache, want = _decode_setup(rng)
    outs = []
    for t in range(x.shape[1]):
      out, state = decoder.apply({**params, "cache": cache}, x[:, t:t + 1], mutable=["cache"])
      cache = state["cache"]
      outs.append(out)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), want, atol=1e-5, rtol=1e-5)
  assert not jax.config.jax_enable_x64


def test_callable_implementation_is_passed_through(rng):
  """A callable `implementation` reaches dot_product_attention with the internal signature."""
  xq, xk, xv = _inputs(rng)
  calls = []

  def spy(query, key, value, bias, mask, **kwargs):
    calls.append((query.shape, key.shape, value.shape))
    return flax_mha.IMPLEMENTATIONS["reference"](query, key, value, bias, mask, **kwargs)

  model = flax_mha.MultiHeadAttention(num_heads=H, num_kv_heads=G, qkv_features=H * K,
                                      v_features=H * V, implementation=spy)
  params = _init(model, xq, xk, xv)
  out = model.apply(params, xq, xk, xv, is_causal=True)
  assert calls[-1] == ((B, T, H, K), (B, S, G, K), (B, S, G, V))
  np.testing.assert_allclose(out, np_module(params, xq, xk, xv, is_causal=True), **TOL)
