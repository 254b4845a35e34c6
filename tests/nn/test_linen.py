"""flax_mha.nn.linen, the core of the linen front end (projections, GQA, masks, sown weights,
dropout, the KV cache, bad input), against the float64 NumPy forward pass of tests/helpers.py
(np_mha) and flax.linen's attention modules. The modern options are in test_linen_options.py,
decoding under x64 in test_linen_integration.py."""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_mha
from helpers import (DIMS, load_across, np_mha, own_params, random_params, randn,
                     random_mask)

B, T, S, H, G, K, V = (DIMS[d] for d in "BTSHGKV")
DQ, DK, DV, DOUT = 19, 23, 29, 17  # model widths: query, key and value inputs, output
TOL = dict(atol=2e-5, rtol=2e-5)


def _inputs(rng, batch=(B,)):
  return randn(rng, *batch, T, DQ), randn(rng, *batch, S, DK), randn(rng, *batch, S, DV)


@pytest.mark.parametrize("g", [G, 1])  # g = H is covered by the flax comparisons
def test_cross_attention_matches_numpy(rng, variant, g):
  xq, xk, xv = _inputs(rng)
  mask = random_mask(rng, B, 1, T, S)
  model = flax_mha.MultiHeadAttention(
      num_heads=H, num_kv_heads=g, qkv_features=H * K, v_features=H * V, out_features=DOUT)
  params = random_params(model, xq, xk, xv, mask=mask)
  # D the query input (model) width; X, Y, O: key and value input widths and output width,
  # letters outside the dimension key (whose E and P name tile sizes, F the FFN width).
  dims = chex.Dimensions(D=DQ, X=DK, Y=DV, H=H, G=g, K=K, V=V, O=DOUT)
  p = params["params"]
  chex.assert_shape([p["query"]["kernel"], p["key"]["kernel"], p["value"]["kernel"],
                     p["out"]["kernel"], p["out"]["bias"]],
                    [dims["DHK"], dims["XGK"], dims["YGV"], dims["HVO"], dims["O"]])
  out = variant(functools.partial(model.apply, mask=mask))(params, xq, xk, xv)
  chex.assert_shape(out, (B, T, DOUT))
  np.testing.assert_allclose(out, np_mha(params, xq, xk, xv, mask=mask), **TOL)


@pytest.mark.parametrize("batch", [(), (2, 3)])
def test_self_attention_batch_dims(rng, batch):
  x = randn(rng, *batch, T, DQ)
  model = flax_mha.SelfAttention(num_heads=H, num_kv_heads=G, qkv_features=H * K)
  params = random_params(model, x, is_causal=True)
  out = jax.jit(functools.partial(model.apply, is_causal=True))(params, x)
  chex.assert_shape(out, (*batch, T, DQ))
  np.testing.assert_allclose(out, np_mha(params, x, x, x, is_causal=True), **TOL)
  mha = flax_mha.MultiHeadAttention(num_heads=H, num_kv_heads=G, qkv_features=H * K)
  np.testing.assert_allclose(mha.apply(params, x, x, is_causal=True), out, **TOL)


def test_sow_weights(rng):
  xq, xk, xv = _inputs(rng)
  mask = random_mask(rng, B, H, T, S)
  model = flax_mha.MultiHeadAttention(num_heads=H, num_kv_heads=G, qkv_features=H * K)
  params = random_params(model, xq, xk, xv)
  _, state = model.apply(params, xq, xk, xv, mask=mask, sow_weights=True, mutable=["intermediates"])
  (weights,) = state["intermediates"]["attention_weights"]
  chex.assert_shape(weights, (B, H, T, S))
  _, want = np_mha(params, xq, xk, xv, mask=mask, return_weights=True)
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
  """Each side makes its own params (its own tree, values of its own seed); the source's params,
  loaded into the target as they are, give the source's output there."""
  xq, xk, xv = _inputs(rng)
  mask = random_mask(rng, B, 1, T, S)
  mask[..., 0] = True  # flax does not zero fully masked rows
  ours, theirs = _flax_pair()
  models = {"ours": ours, "flax": theirs}
  run = {side: variant(functools.partial(m.apply, mask=mask)) for side, m in models.items()}
  own = own_params(models, xq, xk, xv)
  loaded, other, want, got = load_across(direction, own, run, xq, xk, xv)
  chex.assert_shape(got, (B, T, DOUT))
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  for out in (got, want):
    np.testing.assert_allclose(out, np_mha(loaded, xq, xk, xv, mask=mask), **TOL)
  # The two directions differ: the target's own params give another output.
  assert not np.allclose(got, np_mha(other, xq, xk, xv, mask=mask), atol=1e-3)


def test_flax_self_attention_and_no_bias(rng):
  x = randn(rng, B, T, DQ)
  ours = flax_mha.SelfAttention(num_heads=H, qkv_features=H * K, use_bias=False)
  theirs = nn.SelfAttention(num_heads=H, qkv_features=H * K, use_bias=False)
  params = random_params(theirs, x)
  assert jax.tree.structure(random_params(ours, x)) == jax.tree.structure(params)
  out = jax.jit(ours.apply)(params, x)
  np.testing.assert_allclose(out, jax.jit(theirs.apply)(params, x), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(out, np_mha(params, x, x, x), **TOL)


def test_dropout(rng):
  x = randn(rng, B, T, DQ)
  model = flax_mha.SelfAttention(num_heads=H, qkv_features=H * K, dropout_rate=0.4)
  params = random_params(model, x)
  apply = jax.jit(model.apply, static_argnames="deterministic")
  run = lambda key, deterministic: apply(
      params, x, deterministic=deterministic, rngs={"dropout": jax.random.key(key)})
  clean = np_mha(params, x, x, x)
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
  _, want = np_mha(params, x, return_weights=True)
  np.testing.assert_allclose(weights[~dropped], want[~dropped] / 0.6, **TOL)


def decode_setup(rng, length=7):
  x = randn(rng, B, length, DQ)
  full = flax_mha.SelfAttention(num_heads=H, num_kv_heads=G, qkv_features=H * K)
  params = random_params(full, x)
  want = jax.jit(functools.partial(full.apply, is_causal=True))(params, x)
  np.testing.assert_allclose(want, np_mha(params, x, x, x, is_causal=True), **TOL)
  decoder = flax_mha.SelfAttention(num_heads=H, num_kv_heads=G, qkv_features=H * K, decode=True)
  cache = jax.eval_shape(decoder.init, jax.random.key(0), x)["cache"]
  dims = chex.Dimensions(B=B, L=length, G=G, K=K)
  chex.assert_shape([cache["cached_key"], cache["cached_value"]], [dims["BLGK"]] * 2)
  cache = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), cache)  # what init fills it with
  return x, decoder, params, cache, want


@pytest.mark.parametrize("chunks", [[1] * 7, [2, 3, 1, 1]])
def test_kv_cache_decode_equals_full_causal(rng, chunks):
  x, decoder, params, cache, want = decode_setup(rng)

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
  x, decoder, params, cache, _ = decode_setup(rng)
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
  want = np_mha(params, x, x, x, mask=key_valid[:, None, None, :], is_causal=True)
  np.testing.assert_allclose(jnp.concatenate(outs, axis=1), want, atol=1e-5, rtol=1e-5)


def test_decode_init_with_cross_attention_lengths(rng):
  """Regression: the decode init call built a [S, S] causal mask for a [T, S] logit matrix. The
  init call attends as a decoder at position 0 would (causal, top-left, over the S keys it is
  given) and sizes an empty cache [B, S, G, K]."""
  xq, xk, xv = _inputs(rng)
  decoder = flax_mha.MultiHeadAttention(num_heads=H, num_kv_heads=G, qkv_features=H * K,
                                        decode=True)
  out, variables = jax.jit(decoder.init_with_output)(jax.random.key(0), xq, xk, xv)
  chex.assert_shape(out, (B, T, DQ))
  cache = variables["cache"]
  chex.assert_shape([cache["cached_key"], cache["cached_value"]], [(B, S, G, K)] * 2)
  np.testing.assert_allclose(out, np_mha(variables, xq, xk, xv, is_causal=True), **TOL)
  assert not np.allclose(out, np_mha(variables, xq, xk, xv), atol=1e-3)  # causality shows
  np.testing.assert_array_equal(cache["cached_key"], 0.0)  # the init call writes nothing
  assert int(cache["cache_index"]) == 0


def test_flax_float_masks_mean_attend(rng):
  """flax's own masks are float 1/0 (nonzero = attend): same output as the bool mask and as flax."""
  xq, xk, xv = _inputs(rng)
  ours, theirs = _flax_pair()
  self_params = random_params(theirs, xq)
  float_causal = nn.make_causal_mask(np.zeros((B, T)))  # [B, 1, T, T] float32
  assert float_causal.dtype == jnp.float32
  bool_causal = np.tril(np.ones((T, T), bool))
  apply = jax.jit(ours.apply)
  got = apply(self_params, xq, mask=float_causal)
  np.testing.assert_allclose(got, apply(self_params, xq, mask=bool_causal), atol=1e-6, rtol=1e-6)
  np.testing.assert_allclose(got, theirs.apply(self_params, xq, mask=float_causal), atol=1e-5,
                             rtol=1e-5)
  np.testing.assert_allclose(got, np_mha(self_params, xq, xq, xq, is_causal=True), **TOL)
  # Cross attention with nn.make_attention_mask (float32 too) and an int mask.
  params = random_params(theirs, xq, xk, xv)
  q_valid, k_valid = np.ones((B, T)), (np.arange(S) < 4)[None].repeat(B, 0) * 1.0
  float_pad = nn.make_attention_mask(q_valid, k_valid)  # [B, 1, T, S]
  got = ours.apply(params, xq, xk, xv, mask=float_pad)
  np.testing.assert_allclose(got, theirs.apply(params, xq, xk, xv, mask=float_pad), atol=1e-5,
                             rtol=1e-5)
  np.testing.assert_allclose(got, ours.apply(params, xq, xk, xv, mask=float_pad.astype(jnp.int32)))
  np.testing.assert_allclose(got, np_mha(params, xq, xk, xv, mask=float_pad != 0), **TOL)


def test_callable_implementation_is_passed_through(rng):
  """A callable `implementation` reaches dot_product_attention with the internal signature."""
  xq, xk, xv = _inputs(rng)
  calls = []

  def spy(query, key, value, bias, mask, **kwargs):
    calls.append((query.shape, key.shape, value.shape))
    return flax_mha.IMPLEMENTATIONS["reference"](query, key, value, bias, mask, **kwargs)

  model = flax_mha.MultiHeadAttention(num_heads=H, num_kv_heads=G, qkv_features=H * K,
                                      v_features=H * V, implementation=spy)
  params = random_params(model, xq, xk, xv)
  out = model.apply(params, xq, xk, xv, is_causal=True)
  assert calls[-1] == ((B, T, H, K), (B, S, G, K), (B, S, G, V))
  np.testing.assert_allclose(out, np_mha(params, xq, xk, xv, is_causal=True), **TOL)


# ---- bad input ----


D = 12
f32 = functools.partial(np.ones, dtype=np.float32)
X = f32((B, T, D))


def _module(**kwargs):
  return flax_mha.MultiHeadAttention(**{"num_heads": 3, **kwargs})


def _init_call(module, *args, **kwargs):
  return lambda: module.init(jax.random.key(0), *args, **kwargs)


BAD_MODULE = [
    ("qkv_features", _init_call(_module(qkv_features=10), X), ValueError,
     "qkv_features=10 must be divisible by num_heads=3"),
    ("default qkv_features", _init_call(_module(num_heads=5), X), ValueError,
     "qkv_features=12 must be divisible by num_heads=5"),
    ("v_features", _init_call(_module(v_features=7), X), ValueError,
     "v_features=7 must be divisible by num_heads=3"),
    ("num_kv_heads", _init_call(_module(num_heads=6, num_kv_heads=4), X), ValueError,
     "num_heads=6 must be a multiple of num_kv_heads=4"),
    ("num_heads", _init_call(_module(num_heads=0), X), ValueError,
     "num_heads must be a positive int, got 0"),
    ("dropout_rate", _init_call(_module(dropout_rate=1.5), X), ValueError,
     r"dropout_rate must be a finite number in \[0, 1\), got 1.5"),
    ("inputs_q rank", _init_call(_module(), f32((D,))), ValueError,
     r"inputs_q must have rank >= 2 with layout \[\.\.\., T, D_q\], got shape \(12,\)"),
    ("batch mismatch", _init_call(_module(), X, f32((3, S, D))), ValueError,
     r"share batch dims.*\(2, 5, 12\), \(3, 7, 12\)"),
    ("key/value length", _init_call(_module(), X, f32((B, S, D)), f32((B, S + 2, D))), ValueError,
     r"inputs_k.*inputs_v.*length S.*\(2, 7, 12\) and \(2, 9, 12\)"),
    # Integer and float masks are flax's (nonzero = attend); other dtypes are refused.
    ("mask dtype", _init_call(_module(), X, mask=np.ones((T, T), np.complex64)), TypeError,
     "mask must be boolean.*or integer/float.*complex64"),
    ("mask shape", _init_call(_module(), X, mask=np.ones((B, 4, T, T), bool)), ValueError,
     r"mask must broadcast to \[\.\.\., H, T, S\] = \(2, 3, 5, 5\), got shape \(2, 4, 5, 5\)"),
    ("implementation", _init_call(_module(implementation="nope"), X), ValueError,
     "implementation must be None.*one of .*got 'nope'"),
]


@pytest.mark.parametrize("call,error,match", [c[1:] for c in BAD_MODULE],
                         ids=[c[0] for c in BAD_MODULE])
def test_module_rejects(call, error, match):
  with pytest.raises(error, match=match):
    call()


def test_module_dropout_needs_rng():
  module = flax_mha.SelfAttention(num_heads=3, dropout_rate=0.5)
  params = module.init(jax.random.key(0), X)
  match = "dropout_rate=0.5 with deterministic=False needs a dropout_rng"
  with pytest.raises(ValueError, match=match):
    module.apply(params, X, deterministic=False)
  module.apply(params, X)  # deterministic (the default) needs no rng


def test_module_decode_step_shape():
  module = flax_mha.SelfAttention(num_heads=3, decode=True)
  cache = module.init(jax.random.key(0), X)["cache"]
  params = flax_mha.SelfAttention(num_heads=3).init(jax.random.key(0), X)
  with pytest.raises(ValueError, match=r"decode step.*T<= 5.*got \(2, 6, 3, 4\)"):
    module.apply({**params, "cache": cache}, f32((B, T + 1, D)), mutable=["cache"])
  with pytest.raises(ValueError, match=r"decode step.*batch \(2,\).*got \(3, 1, 3, 4\)"):
    module.apply({**params, "cache": cache}, f32((3, 1, D)), mutable=["cache"])


def test_module_non_array_inputs_name_the_argument():
  """Regression: a list as inputs_q gave AttributeError (_head_dims read .shape before checks)."""
  with pytest.raises(TypeError, match="inputs_q must be an array .*got list"):
    _module().init(jax.random.key(0), X.tolist())
  with pytest.raises(TypeError, match="inputs_k must be an array .*got tuple"):
    _module().init(jax.random.key(0), X, (1.0, 2.0))


def test_module_inputs_v_without_inputs_k():
  """Regression: inputs_v with inputs_k None silently took the keys from inputs_q (flax raises)."""
  module = _module()
  params = module.init(jax.random.key(0), X)
  with pytest.raises(ValueError, match="inputs_v was given but inputs_k is None: pass inputs_k"):
    module.apply(params, X, inputs_v=f32((B, T, D)))
  with pytest.raises(ValueError, match="pass inputs_k too"):
    module.apply(params, X, None, f32((B, T, D)))
