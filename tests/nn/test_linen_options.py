"""The modern options of flax_mha.nn.linen: normalize_qk, logit_soft_cap, local_window_size, rotary
embeddings, segment ids and positions, with and without the KV cache (MQA and the slow decoding
cases: test_linen_options_integration.py).

Checked against flax.linen (normalize_qk) and against the float64 NumPy forward pass of
tests/helpers.py (np_mha: projections, LayerNorm, half-split RoPE, soft cap, masks). Dimension
key (flax_mha/__init__.py): B batch, T query length, S key length, L a shared length, H query
heads, G key/value heads, K qk head dim (even for rotary), V value head dim. Sizes are distinct.
"""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_mha
from helpers import load_across, np_mha, np_window, own_params, random_params, randn

B, T, S, L, H, G, K, V = 2, 5, 7, 11, 6, 3, 22, 13  # K even (K/2 = 11 is odd: a real pairing)
DQ, DK, DV, DOUT = 19, 23, 29, 17  # model widths: query, key and value inputs, output
TOL = dict(atol=3e-5, rtol=3e-5)


def _inputs(rng):
  return randn(rng, B, T, DQ), randn(rng, B, S, DK), randn(rng, B, S, DV)


# ---------------------------------------------------------------- normalize_qk vs flax.linen


def _flax_pair(**kwargs):
  common = dict(num_heads=H, qkv_features=H * K, out_features=DOUT, normalize_qk=True, **kwargs)
  return flax_mha.MultiHeadAttention(**common), nn.MultiHeadDotProductAttention(**common)


def test_normalize_qk_param_tree_identical_to_flax(rng):
  xq, xk, xv = _inputs(rng)
  ours, theirs = _flax_pair()
  init = lambda m: jax.jit(m.init)(jax.random.key(3), xq, xk, xv)
  p_ours, p_theirs = init(ours), init(theirs)
  chex.assert_trees_all_equal_shapes_and_dtypes(p_ours, p_theirs)
  chex.assert_trees_all_equal(p_ours, p_theirs)  # same names, initialisers and rng streams
  chex.assert_shape(p_ours["params"]["query_ln"]["scale"], (K,))
  assert set(p_ours["params"]["key_ln"]) == {"scale"}  # no bias


@pytest.mark.parametrize("qk_scale", [1.0, 1e-3])  # 1e-3: variance ~1e-6, epsilon shows
@pytest.mark.parametrize("direction", ["flax_into_ours", "ours_into_flax"])
def test_normalize_qk_matches_flax(rng, variant, direction, qk_scale):
  """Each side makes its own params (LayerNorm scales too); the source's, loaded into the
  target as they are, give the source's output there."""
  xq, xk, xv = _inputs(rng)
  mask = rng.random((B, 1, T, S)) < 0.7
  mask[..., 0] = True  # flax does not zero fully masked rows
  ours, theirs = _flax_pair()
  models = {"ours": ours, "flax": theirs}
  own = own_params(models, xq, xk, xv)
  for params in own.values():
    for name in ("query", "key"):
      params["params"][name] = jax.tree.map(lambda a: a * qk_scale, params["params"][name])
  run = {side: variant(functools.partial(m.apply, mask=mask)) for side, m in models.items()}
  loaded, other, want, got = load_across(direction, own, run, xq, xk, xv)
  chex.assert_shape(got, (B, T, DOUT))
  np.testing.assert_allclose(got, want, **TOL)
  np_normed = lambda params, **kw: np_mha(params, xq, xk, xv, mask=mask, **kw)
  for out in (got, want):
    np.testing.assert_allclose(out, np_normed(loaded, normalize_qk=True), **TOL)
  # The norm matters: without it the same params give another output.
  assert not np.allclose(got, np_normed(loaded), atol=1e-2)
  # The two directions differ: the target's own params give another output.
  assert not np.allclose(got, np_normed(other, normalize_qk=True), atol=1e-3)


@pytest.mark.parametrize("direction", ["flax_into_ours", "ours_into_flax"])
def test_normalize_qk_decode_matches_flax(rng, direction):
  """One token at a time (flax's decode mode): each side makes its own params; the source's,
  loaded into the target, give the source's outputs, cache layout and contents."""
  x = randn(rng, B, L, DQ)
  ours, theirs = _flax_pair(decode=True)
  models = {"ours": ours, "flax": theirs}
  v_ours = jax.eval_shape(ours.init, jax.random.key(0), x)
  v_theirs = jax.eval_shape(theirs.init, jax.random.key(0), x)
  chex.assert_trees_all_equal_shapes_and_dtypes(v_ours, v_theirs)
  zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), v_ours["cache"])

  def decoder(model):
    def decode(params):
      step = jax.jit(lambda cache, x_t: model.apply({**params, "cache": cache}, x_t,
                                                    mutable=["cache"]))
      cache, outs = zeros, []
      for t in range(L):
        out, state = step(cache, x[:, t:t + 1])
        cache = state["cache"]
        outs.append(out)
      return jnp.concatenate(outs, axis=1), cache
    return decode

  run = {side: decoder(m) for side, m in models.items()}
  loaded, other, (want, want_cache), (got, got_cache) = load_across(
      direction, own_params(models, x), run)
  np.testing.assert_allclose(got, want, **TOL)
  chex.assert_trees_all_close(got_cache, want_cache, atol=1e-5, rtol=1e-5)
  causal = np.tril(np.ones((L, L), bool))
  for out in (got, want):
    np.testing.assert_allclose(out, np_mha(loaded, x, mask=causal, normalize_qk=True), **TOL)
  # The two directions differ: the target's own params give another output.
  assert not np.allclose(got, np_mha(other, x, mask=causal, normalize_qk=True), atol=1e-3)


# ---------------------------------------------------------------- soft cap and local window


def _self_model(**kwargs):
  return flax_mha.SelfAttention(num_heads=H, qkv_features=H * K, v_features=H * V,
                                out_features=DOUT, **kwargs)


def _by_hand(params, x, **options):
  """Projections from the params, then flax_mha.dot_product_attention, then the out projection."""
  p = params["params"]
  proj = lambda name: jnp.einsum("...d,dhk->...hk", x, p[name]["kernel"]) + p[name]["bias"]
  out = flax_mha.dot_product_attention(proj("query"), proj("key"), proj("value"), **options)
  return jnp.einsum("...hv,hvd->...d", out, p["out"]["kernel"]) + p["out"]["bias"]


SOFT_CAP_AND_WINDOW = [  # (cap, window, is_causal)
    (None, 2, False), (3.0, None, False), (1.7, (3, 0), False), (2.3, (2, 4), True),
    (0.9, 1, True)]


@pytest.mark.parametrize("g", [G])  # MQA (g = 1): test_linen_options_integration.py
@pytest.mark.parametrize("cap,window,is_causal", SOFT_CAP_AND_WINDOW)
def test_soft_cap_and_window(rng, variant, g, cap, window, is_causal):
  x = randn(rng, B, L, DQ)
  model = _self_model(num_kv_heads=g, logit_soft_cap=cap, local_window_size=window)
  params = random_params(model, x)
  apply = variant(functools.partial(model.apply, is_causal=is_causal, sow_weights=True,
                                    mutable=["intermediates"]))
  out, state = apply(params, x)
  chex.assert_shape(out, (B, L, DOUT))
  options = dict(is_causal=is_causal, logit_soft_cap=cap, local_window_size=window)
  np.testing.assert_allclose(out, _by_hand(params, x, **options), atol=1e-5, rtol=1e-5)
  visible = np.tril(np.ones((L, L), bool)) if is_causal else np.ones((L, L), bool)
  if window is not None:
    visible &= np_window(L, L, window)
  want, want_weights = np_mha(params, x, x, x, mask=visible, soft_cap=cap, return_weights=True)
  np.testing.assert_allclose(out, want, **TOL)
  (weights,) = state["intermediates"]["attention_weights"]
  np.testing.assert_allclose(weights, want_weights, **TOL)  # sown with the same options
  # Each option changes the result (so the test can fail if one is dropped).
  if cap is not None:
    assert not np.allclose(out, np_mha(params, x, x, x, mask=visible), atol=1e-3)
  if window is not None:
    plain = np.tril(np.ones((L, L), bool)) if is_causal else None
    assert not np.allclose(out, np_mha(params, x, x, x, mask=plain, soft_cap=cap),
                           atol=1e-3)


# ---------------------------------------------------------------- rotary


@pytest.mark.parametrize("wavelength", [10_000.0, 97.0])
@pytest.mark.parametrize("case", ["self_default", "self_positions", "cross_default",
                                  "cross_positions"])
def test_rotary_matches_numpy(rng, variant, wavelength, case):
  xq, xk, xv = _inputs(rng)
  model = flax_mha.MultiHeadAttention(num_heads=H, num_kv_heads=G, qkv_features=H * K,
                                      v_features=H * V, out_features=DOUT,
                                      rotary_max_wavelength=wavelength)
  kwargs = {}
  if case.startswith("self"):
    xk = xv = xq
    q_pos = kv_pos = np.arange(T)
    if case == "self_positions":  # restarting per packed document, per batch row
      q_pos = kv_pos = np.array([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]], np.int32) + 3
      kwargs = dict(q_positions=q_pos)
    call = lambda params, **kw: model.apply(params, xq, **kw)
  else:
    q_pos, kv_pos = np.arange(T), np.arange(S)
    if case == "cross_positions":
      q_pos, kv_pos = rng.integers(0, 50, (B, T)), rng.integers(0, 50, (S,))
      kwargs = dict(q_positions=q_pos, kv_positions=kv_pos)
    call = lambda params, **kw: model.apply(params, xq, xk, xv, **kw)
  params = random_params(model, xq, xk, xv)
  out = variant(lambda params, kw: call(params, **kw))(params, kwargs)  # positions traced
  chex.assert_shape(out, (B, T, DOUT))
  want = np_mha(params, xq, xk, xv, rotary=(wavelength, q_pos, kv_pos))
  np.testing.assert_allclose(out, want, **TOL)
  assert not np.allclose(out, np_mha(params, xq, xk, xv), atol=1e-3)  # rotary did something


def test_rotary_logits_shift_invariant(rng):
  """Shifting every position by the same amount leaves self-attention unchanged (RoPE is
  relative); a plain module would not see positions at all."""
  x = randn(rng, B, L, DQ)
  model = _self_model(rotary_max_wavelength=10_000.0)
  params = random_params(model, x)
  apply = jax.jit(functools.partial(model.apply, is_causal=True))
  base = apply(params, x)
  np.testing.assert_allclose(apply(params, x, positions=np.arange(L) + 37), base, atol=2e-4)
  np.testing.assert_allclose(apply(params, x, positions=np.arange(L)), base, atol=1e-6)
  assert not np.allclose(apply(params, x, positions=np.arange(L) * 3), base, atol=1e-3)


# ---------------------------------------------------------------- decode == full recompute


DECODE_CASES = {
    "rotary": dict(rotary_max_wavelength=10_000.0),
    "window": dict(local_window_size=3),
    "window_pair": dict(local_window_size=(2, 5)),  # right is hidden by causality anyway
    "gqa": dict(num_kv_heads=G),
    "mqa_soft_cap": dict(num_kv_heads=1, logit_soft_cap=2.0),
    "normalize_qk": dict(normalize_qk=True),
    "everything": dict(num_kv_heads=G, normalize_qk=True, rotary_max_wavelength=500.0,
                       local_window_size=(4, 1), logit_soft_cap=3.0),
}


# The options whose cache mask or positions move with the step's width: decoded two tokens a
# step too (the rest two a step: test_linen_options_integration.py, slow).
TWO_A_STEP = ("rotary", "window", "everything")


@pytest.mark.parametrize("case,chunk", [(case, chunk) for case in sorted(DECODE_CASES)
                                        for chunk in (1, 2) if chunk == 1 or case in TWO_A_STEP])
def test_decode_equals_full_causal(rng, case, chunk):
  config = DECODE_CASES[case]
  x = randn(rng, B, L, DQ)
  full = _self_model(**config)
  params = random_params(full, x)
  want = jax.jit(functools.partial(full.apply, is_causal=True))(params, x)
  decoder = _self_model(decode=True, **config)
  cache = jax.eval_shape(decoder.init, jax.random.key(0), x)["cache"]
  cache = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), cache)
  step = jax.jit(lambda cache, x_t: decoder.apply({**params, "cache": cache}, x_t,
                                                  mutable=["cache"]))
  outs = []
  for start in range(0, L, chunk):  # L is odd: the last chunk of 2 is a single token
    out, state = step(cache, x[:, start:start + chunk])
    cache = state["cache"]
    outs.append(out)
  assert int(cache["cache_index"]) == L
  np.testing.assert_allclose(jnp.concatenate(outs, axis=1), want, atol=1e-5, rtol=1e-5)
  # The full forward against NumPy: the decode comparison is not of two equal mistakes.
  visible = np.tril(np.ones((L, L), bool))
  if "local_window_size" in config:
    visible &= np_window(L, L, config["local_window_size"])
  wavelength = config.get("rotary_max_wavelength")
  rotary = None if wavelength is None else (wavelength, np.arange(L), np.arange(L))
  np.testing.assert_allclose(want, np_mha(
      params, x, x, x, mask=visible, soft_cap=config.get("logit_soft_cap"),
      normalize_qk=config.get("normalize_qk", False), rotary=rotary), **TOL)


def test_decode_with_explicit_positions(rng):
  """positions given at each decode step override cache_index + arange(T)."""
  x = randn(rng, B, L, DQ)
  config = dict(rotary_max_wavelength=10_000.0, num_kv_heads=G)
  positions = np.stack([np.arange(L) + 4, np.arange(L) * 2])  # [B, L], per batch row
  params = random_params(_self_model(**config), x)
  want = np_mha(params, x, x, x, mask=np.tril(np.ones((L, L), bool)),
                rotary=(10_000.0, positions, positions))
  decoder = _self_model(decode=True, **config)
  cache = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                       jax.eval_shape(decoder.init, jax.random.key(0), x)["cache"])
  step = jax.jit(lambda cache, x_t, pos: decoder.apply(
      {**params, "cache": cache}, x_t, positions=pos, mutable=["cache"]))
  outs = []
  for t in range(L):
    out, state = step(cache, x[:, t:t + 1], positions[:, t:t + 1])
    cache = state["cache"]
    outs.append(out)
  np.testing.assert_allclose(jnp.concatenate(outs, axis=1), want, **TOL)


# ---------------------------------------------------------------- segment ids


def test_segment_ids_equal_mask(rng, variant):
  xq, xk, xv = _inputs(rng)
  q_ids = np.array([[0, 0, 1, 1, 2], [0, 1, 1, 1, 1]], np.int32)  # [B, T]
  kv_ids = np.array([[0, 1, 1, 2, 2, 2, 2], [0, 0, 0, 1, 1, 1, 1]], np.int32)  # [B, S]
  model = flax_mha.MultiHeadAttention(num_heads=H, num_kv_heads=G, qkv_features=H * K,
                                      out_features=DOUT, logit_soft_cap=4.0)
  params = random_params(model, xq, xk, xv)
  mask = flax_mha.segment_mask(q_ids, kv_ids)  # [B, 1, T, S]
  out = variant(lambda p, q_ids, kv_ids: model.apply(
      p, xq, xk, xv, q_segment_ids=q_ids, kv_segment_ids=kv_ids))(params, q_ids, kv_ids)
  np.testing.assert_allclose(out, model.apply(params, xq, xk, xv, mask=mask), atol=1e-6)
  visible = q_ids[:, None, :, None] == kv_ids[:, None, None, :]
  np.testing.assert_allclose(out, np_mha(params, xq, xk, xv, mask=visible, soft_cap=4.0),
                             **TOL)
  assert not np.allclose(out, np_mha(params, xq, xk, xv, soft_cap=4.0), atol=1e-3)


def test_packed_documents_equal_separate_runs(rng, variant):
  """Two documents packed in one row with segment_ids and restarting positions give what each
  document gives alone: SelfAttention's `segment_ids` and `positions` serve both sides."""
  n1, n2 = 4, 7
  x = randn(rng, B, n1 + n2, DQ)
  ids = np.array([0] * n1 + [1] * n2, np.int32)[None].repeat(B, 0)
  positions = np.concatenate([np.arange(n1), np.arange(n2)]).astype(np.int32)
  model = _self_model(num_kv_heads=G, rotary_max_wavelength=10_000.0, local_window_size=(3, 0))
  params = random_params(model, x)
  packed = variant(lambda p, ids, pos: model.apply(
      p, x, segment_ids=ids, positions=pos, is_causal=True))(params, ids, positions)
  alone = jax.jit(functools.partial(model.apply, is_causal=True))
  want = jnp.concatenate([alone(params, x[:, :n1]), alone(params, x[:, n1:])], axis=1)
  np.testing.assert_allclose(packed, want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- bad input


X = np.zeros((B, T, 12), np.float32)


def _call(module_kwargs, *args, **call_kwargs):
  module = flax_mha.MultiHeadAttention(**{"num_heads": 3, **module_kwargs})
  return lambda: module.init(jax.random.key(0), *args, **call_kwargs)


IDS = np.zeros((B, T), np.int32)
BAD = [
    ("odd K with rotary", _call(dict(qkv_features=9, rotary_max_wavelength=1e4), X), ValueError,
     r"rotary_max_wavelength needs an even qk head dim K.*K=3 \(qkv_features=9, num_heads=3\)"),
    ("rotary wavelength", _call(dict(rotary_max_wavelength=-1.0), X), ValueError,
     "rotary_max_wavelength must be a finite number > 0, got -1.0"),
    ("segment ids with decode", _call(dict(decode=True), X, q_segment_ids=IDS), ValueError,
     "q_segment_ids/kv_segment_ids are not supported with decode=True"),
    ("kv segment ids with decode", _call(dict(decode=True), X, kv_segment_ids=IDS), ValueError,
     "q_segment_ids/kv_segment_ids are not supported with decode=True"),
    ("negative window", _call(dict(local_window_size=(-1, -2)), X), ValueError,
     r"local_window_size must be an int >= 0 or a \(left, right\) pair.*\(-1, -2\)"),
    ("negative window decode", _call(dict(local_window_size=(-1, -2), decode=True), X),
     ValueError, r"local_window_size must be an int >= 0 or a \(left, right\) pair"),
    ("window T != S", _call(dict(local_window_size=2), X, np.zeros((B, S, 12), np.float32)),
     ValueError, "local_window_size needs T == S"),
    ("positions without rotary", _call({}, X, q_positions=IDS), ValueError,
     "q_positions was given but rotary_max_wavelength is None"),
    ("float positions", _call(dict(rotary_max_wavelength=1e4), X,
                              q_positions=np.zeros((B, T), np.float32)), TypeError,
     "q_positions must have an integer dtype, got float32"),
    ("kv_positions shape", _call(dict(rotary_max_wavelength=1e4), X,
                                 kv_positions=np.zeros((B, T + 1), np.int32)), ValueError,
     r"kv_positions must broadcast to \[\.\.\., S\] = \(2, 5\), got shape \(2, 6\)"),
]


@pytest.mark.parametrize("call,error,match", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_rejects(call, error, match):
  with pytest.raises(error, match=match):
    call()


def test_options_off_keep_the_plain_param_tree(rng):
  """Only normalize_qk adds parameters; soft cap, window and rotary add none."""
  x = randn(rng, B, L, DQ)
  plain = jax.eval_shape(_self_model().init, jax.random.key(0), x)
  modern = jax.eval_shape(_self_model(logit_soft_cap=2.0, local_window_size=3,
                                      rotary_max_wavelength=1e4).init, jax.random.key(0), x)
  assert jax.tree.structure(plain) == jax.tree.structure(modern)
  normed = jax.eval_shape(_self_model(normalize_qk=True).init, jax.random.key(0), x)
  assert set(normed["params"]) - set(plain["params"]) == {"query_ln", "key_ln"}
