"""flax_mha.nn.nnx: one behavioural suite over both front ends (parity with flax.nnx itself:
tests/nn/test_nnx_flax.py; decoding a sequence step by step: tests/nn/test_nnx_integration.py).

The suite runs each test against the linen module (`flax_mha.MultiHeadAttention`, behind a small
adapter) and the NNX module (`flax_mha.nn.nnx.MultiHeadAttention`), given the same random params
through `linen_params_to_nnx`, and checks both against the float64 NumPy forward pass of
tests/helpers.py (np_mha, with the modern options: rotary, windows, soft cap, normalize_qk,
segment ids).
"""

import functools
import inspect

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_mha
from helpers import DIMS, np_mha, np_window, randn, random_mask
from flax_mha.nn import nnx as fnnx

B, T, S, H, G, K, V = (DIMS[d] for d in "BTSHGKV")
DQ, DK, DV, DOUT = 19, 23, 29, 17  # model widths: query, key and value inputs, output
L = 7  # decoded sequence length
TOL = dict(atol=2e-5, rtol=2e-5)
GQA_KW = dict(num_heads=H, num_kv_heads=G, qkv_features=H * K, v_features=H * V)
KR = 2 * K  # an even qk head dim for rotary (KR/2 odd: a real pairing)
ROPE = 10_000.0
FLAX_ARGS = inspect.signature(nnx.MultiHeadAttention.__init__).parameters  # older flax has fewer
FLAX_HAS_IS_CAUSAL = "is_causal" in inspect.signature(nnx.MultiHeadAttention.__call__).parameters


def _nnx_jit_works() -> bool:
  try:
    nnx.jit(lambda x: x)(jnp.zeros(()))
  except TypeError:  # flax 0.10 passes jax.jit `abstracted_axes`, which jax 0.9 removed
    return False
  return True


NNX_JIT_WORKS = _nnx_jit_works()


def random_params(module):
  """Linen-style params of `module`'s shapes, random (biases non-zero), as NumPy."""
  rng = np.random.default_rng(1)
  shapes = fnnx.nnx_to_linen_params(module)["params"]
  return jax.tree.map(lambda a: randn(rng, *a.shape) * 0.3, shapes)


def randomize(module):
  """Give every nnx.Param of `module` random values (flax's biases start at zero)."""
  rng = np.random.default_rng(2)
  state = nnx.state(module, nnx.Param)
  nnx.update(module, jax.tree.map(lambda a: jnp.asarray(randn(rng, *a.shape) * 0.3), state))
  return module


def pure(state):
  """Nested dicts of arrays from an nnx.State (flax 0.12 deprecates State.to_pure_dict)."""
  return nnx.to_pure_dict(state) if hasattr(nnx, "to_pure_dict") else state.to_pure_dict()


def shared_shapes(module, *filters):
  return jax.tree.map(np.shape, pure(nnx.state(module, *filters)))


def call_sowing(module, *args, **kwargs):
  """(output, attention weights) of `module(*args, sow_weights=True, **kwargs)`."""
  if hasattr(nnx, "capture"):  # flax 0.12.8 deprecates sow outside nnx.capture
    out, sown = nnx.capture(module, nnx.Intermediate)(*args, sow_weights=True, **kwargs)
  else:
    out, sown = module(*args, sow_weights=True, **kwargs), nnx.pop(module, nnx.Intermediate)
  (weights,) = jax.tree.leaves(sown)
  return out, weights


class LinenFrontEnd:
  """`flax_mha.MultiHeadAttention` (linen) behind the calls the suite makes."""

  def __init__(self, params, **kwargs):
    self.model = flax_mha.MultiHeadAttention(**kwargs)
    self.variables = {"params": params}

  def __call__(self, xq, xk=None, xv=None, *, dropout_key=None, sow_weights=False, **kw):
    out, state = self.model.apply(
        self.variables, xq, xk, xv, deterministic=dropout_key is None, dropout_rng=dropout_key,
        sow_weights=sow_weights, mutable=["intermediates"], **kw)
    weights = state["intermediates"]["attention_weights"][0] if sow_weights else None
    return out, weights

  def init_cache(self, shape):
    self.decoder = self.model.clone(decode=True)
    _, state = self.decoder.apply(self.variables, jnp.zeros(shape), mutable=["cache"])
    self.cache = state["cache"]

  def step(self, x):
    out, state = self.decoder.apply({**self.variables, "cache": self.cache}, x,
                                    mutable=["cache"])
    self.cache = state["cache"]
    return out


class NnxFrontEnd:
  """`flax_mha.nn.nnx.MultiHeadAttention` behind the same calls."""

  def __init__(self, module):
    self.module = module

  def __call__(self, xq, xk=None, xv=None, *, dropout_key=None, sow_weights=False, **kw):
    kw = dict(deterministic=dropout_key is None, rngs=dropout_key, **kw)
    if sow_weights:
      return call_sowing(self.module, xq, xk, xv, **kw)
    return self.module(xq, xk, xv, **kw), None

  def init_cache(self, shape):
    self.module.init_cache(shape)

  def step(self, x):
    return self.module(x, decode=True)


def front_end(kind, in_features=DQ, in_kv_features=None, in_v_features=None, **kwargs):
  """(the `kind` front end, "linen" or "nnx", its linen params): equal random params in both."""
  module = fnnx.MultiHeadAttention(
      in_features=in_features, in_kv_features=in_kv_features, in_v_features=in_v_features,
      rngs=nnx.Rngs(0), **kwargs)
  params = random_params(module)
  if kind == "linen":
    return LinenFrontEnd(params, **kwargs), params
  return NnxFrontEnd(fnnx.linen_params_to_nnx(params, module)), params


@pytest.fixture(params=["linen", "nnx"])
def make_attention(request):
  """make_attention(**kwargs) -> (front end, linen params), for each front end in turn."""
  return functools.partial(front_end, request.param)


def cross_inputs(rng, batch=(B,)):
  return randn(rng, *batch, T, DQ), randn(rng, *batch, S, DK), randn(rng, *batch, S, DV)


def _make_cross(make_attention, **kwargs):
  return make_attention(in_kv_features=DK, in_v_features=DV, out_features=DOUT,
                        **{**GQA_KW, **kwargs})


# ---- the behavioural suite, both front ends ----


@pytest.mark.parametrize("g", [H, G, 1])
def test_gqa_and_k_ne_v(make_attention, rng, g):
  attn, params = _make_cross(make_attention, num_kv_heads=g)
  # D the query input (model) width; X, Y, O: key and value input widths and output width.
  dims = chex.Dimensions(D=DQ, X=DK, Y=DV, H=H, G=g, K=K, V=V, O=DOUT)
  chex.assert_shape([params["query"]["kernel"], params["key"]["kernel"],
                     params["value"]["kernel"], params["out"]["kernel"]],
                    [dims["DHK"], dims["XGK"], dims["YGV"], dims["HVO"]])
  xq, xk, xv = cross_inputs(rng)
  out, _ = attn(xq, xk, xv)
  chex.assert_shape(out, (B, T, DOUT))
  np.testing.assert_allclose(out, np_mha(params, xq, xk, xv), **TOL)


@pytest.mark.parametrize("dtype", [bool, np.float32, np.int32])
def test_masks_bool_and_numeric(make_attention, rng, dtype):
  attn, params = _make_cross(make_attention)
  xq, xk, xv = cross_inputs(rng)
  mask = random_mask(rng, B, 1, T, S)
  mask[0, 0, 1] = False  # a query that sees nothing: output is the out bias alone
  out, _ = attn(xq, xk, xv, mask=mask.astype(dtype))
  want = np_mha(params, xq, xk, xv, mask=mask)
  np.testing.assert_allclose(out, want, **TOL)
  np.testing.assert_allclose(out[0, 1], params["out"]["bias"], **TOL)


def test_additive_float_mask_refused(make_attention, rng):
  """torch's additive attn_mask (0 = attend, -inf = hide) read as flax's nonzero = attend would
  be inverted: refused eagerly, pointing at `bias`, which computes what torch means."""
  attn, params = _make_cross(make_attention)
  xq, xk, xv = cross_inputs(rng)
  keep = random_mask(rng, B, 1, T, S)
  additive = np.where(keep, 0.0, -np.inf).astype(np.float32)
  with pytest.raises(ValueError, match=r"mask must hold only 0 and 1.*-inf.*torch.*`bias`"):
    attn(xq, xk, xv, mask=additive)
  out, _ = attn(xq, xk, xv, bias=additive)
  np.testing.assert_allclose(out, np_mha(params, xq, xk, xv, mask=keep), **TOL)


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_a_mask_hiding_every_key_is_refused_when_concrete(make_attention, rng, dtype):
  """torch's additive attn_mask of a batch without padding is all zeros (0 = keep): read as
  flax's mask it hides every key from every query, every output the out bias alone, without a
  word. Refused when concrete, naming torch's convention and `bias`; one 1 anywhere passes
  (a query that sees nothing is legitimate); traced (inside `jit`) it cannot be read and runs
  as documented: every query fully masked. A boolean all-False mask says what it means (an
  all-padding batch) and runs."""
  attn, params = _make_cross(make_attention)
  xq, xk, xv = cross_inputs(rng)
  zeros = np.zeros((B, 1, T, S), dtype)
  message = (r"mask hides every key from every query.*True/1 = attend.*torch's additive "
             r"attn_mask means 0 = attend, -inf = hide.*`bias`")
  for mask in (zeros, zeros[0, 0]):  # [B, 1, T, S] and [T, S]
    with pytest.raises(ValueError, match=message):
      attn(xq, xk, xv, mask=mask)
  one = zeros.copy()
  one[1, 0, 2, 3] = 1  # one query of one example sees one key; every other query nothing
  out, _ = attn(xq, xk, xv, mask=one)
  np.testing.assert_allclose(out, np_mha(params, xq, xk, xv, mask=one != 0), **TOL)
  traced, _ = jax.jit(lambda mask: attn(xq, xk, xv, mask=mask))(zeros)
  np.testing.assert_allclose(traced, np.broadcast_to(params["out"]["bias"], traced.shape), **TOL)
  hidden, _ = attn(xq, xk, xv, mask=zeros.astype(bool))
  np.testing.assert_allclose(hidden, traced, **TOL)


def test_bias(make_attention, rng):
  attn, params = _make_cross(make_attention)
  xq, xk, xv = cross_inputs(rng)
  bias = randn(rng, 1, H, T, S) * 2
  out, _ = attn(xq, xk, xv, bias=bias)
  np.testing.assert_allclose(out, np_mha(params, xq, xk, xv, bias=bias), **TOL)


@pytest.mark.parametrize("batch", [(), (B,), (2, 3)])
def test_is_causal_with_mask(make_attention, rng, batch):
  attn, params = make_attention(**GQA_KW)
  x = randn(rng, *batch, T, DQ)
  mask = random_mask(rng, *batch, H, T, T)
  out, _ = attn(x, mask=mask, is_causal=True)
  chex.assert_shape(out, (*batch, T, DQ))
  want = np_mha(params, x, x, x, mask=mask, is_causal=True)
  np.testing.assert_allclose(out, want, **TOL)


def test_sow_weights(make_attention, rng):
  attn, params = _make_cross(make_attention)
  xq, xk, xv = cross_inputs(rng)
  mask = random_mask(rng, B, H, T, S)
  out, weights = attn(xq, xk, xv, mask=mask, sow_weights=True)
  want_out, want_weights = np_mha(params, xq, xk, xv, mask=mask, return_weights=True)
  chex.assert_shape(weights, (B, H, T, S))
  np.testing.assert_allclose(weights, want_weights, **TOL)
  np.testing.assert_allclose(out, want_out, **TOL)


def test_dropout_on_weights_per_rng(make_attention, rng):
  rate = 0.3
  attn, params = _make_cross(make_attention, dropout_rate=rate)
  xq, xk, xv = cross_inputs(rng)
  key1, key2 = jax.random.key(1), jax.random.key(2)
  out1, dropped = attn(xq, xk, xv, dropout_key=key1, sow_weights=True)
  np.testing.assert_array_equal(attn(xq, xk, xv, dropout_key=key1)[0], out1)
  assert np.abs(attn(xq, xk, xv, dropout_key=key2)[0] - out1).max() > 1e-3
  want_out, want_weights = np_mha(params, xq, xk, xv, return_weights=True)
  np.testing.assert_allclose(attn(xq, xk, xv)[0], want_out, **TOL)  # deterministic
  # Every weight is dropped or scaled by 1 / (1 - rate); about `rate` of them are dropped.
  kept = np.asarray(dropped) != 0
  np.testing.assert_allclose(np.where(kept, dropped, 0) * (1 - rate),
                             np.where(kept, want_weights, 0), **TOL)
  assert abs((1 - kept.mean()) - rate) < 0.1, 1 - kept.mean()
  # ... and the output is made of exactly those weights.
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  value_BSGV = np.einsum("bsd,dgv->bsgv", xv, p["value"]["kernel"]) + p["value"]["bias"]
  out_BTHV = np.einsum("bhts,bshv->bthv", np.asarray(dropped, np.float64),
                       np.repeat(value_BSGV, H // G, axis=-2))
  np.testing.assert_allclose(
      out1, np.einsum("bthv,hvd->btd", out_BTHV, p["out"]["kernel"]) + p["out"]["bias"], **TOL)


def test_inputs_v_without_inputs_k(make_attention, rng):
  attn, _ = make_attention(**GQA_KW)
  x = randn(rng, B, T, DQ)
  with pytest.raises(ValueError, match="inputs_v was given but inputs_k is None"):
    attn(x, None, x)


MODERN_CONFIGS = {
    "rotary": dict(rotary_max_wavelength=ROPE),
    "window": dict(local_window_size=(2, 1)),
    "soft_cap": dict(logit_soft_cap=3.0),
    "normalize_qk": dict(normalize_qk=True),
    "all": dict(rotary_max_wavelength=ROPE, local_window_size=(3, 0), logit_soft_cap=2.0,
                normalize_qk=True),
}


def np_modern(params, config, x, visible, positions=None):
  """The float64 forward of self-attention on x [B, L, DQ] under `config`."""
  positions = np.arange(x.shape[-2]) if positions is None else positions
  wavelength = config.get("rotary_max_wavelength")
  return np_mha(
      params, x, x, x, mask=visible, soft_cap=config.get("logit_soft_cap"),
      normalize_qk=config.get("normalize_qk", False),
      rotary=None if wavelength is None else (wavelength, positions, positions))


def causal_visible(config, n=L):
  visible = np.tril(np.ones((n, n), bool))
  if "local_window_size" in config:
    visible &= np_window(n, n, config["local_window_size"])
  return visible


@pytest.mark.parametrize("name", list(MODERN_CONFIGS))
def test_modern_options(make_attention, rng, name):
  config = MODERN_CONFIGS[name]
  attn, params = make_attention(**{**GQA_KW, "qkv_features": H * KR, **config})
  x = randn(rng, B, L, DQ)
  out, _ = attn(x, is_causal=True)
  want = np_modern(params, config, x, causal_visible(config))
  np.testing.assert_allclose(out, want, **TOL)


def test_rotary_positions_and_segment_ids(make_attention, rng):
  """Packed documents: per-row segment ids, positions restarting per document."""
  config = dict(rotary_max_wavelength=ROPE)
  attn, params = make_attention(**{**GQA_KW, "qkv_features": H * KR, **config})
  x = randn(rng, B, L, DQ)
  ids = np.array([[0] * 4 + [1] * (L - 4), [0] * 2 + [1] * (L - 2)], np.int32)  # [B, L]
  positions = np.stack([np.r_[np.arange(4), np.arange(L - 4)],
                        np.r_[np.arange(2), np.arange(L - 2)]]).astype(np.int32)
  out, _ = attn(x, q_segment_ids=ids, kv_segment_ids=ids, q_positions=positions,
                kv_positions=positions)
  visible = (ids[:, :, None] == ids[:, None, :])[:, None]  # [B, 1, L, L]
  np.testing.assert_allclose(out, np_modern(params, config, x, visible, positions), **TOL)


def test_cross_segment_ids(make_attention, rng):
  attn, params = _make_cross(make_attention, logit_soft_cap=4.0)
  xq, xk, xv = cross_inputs(rng)
  q_ids = np.array([[0, 0, 1, 1, 2], [0, 1, 1, 1, 1]], np.int32)  # [B, T]
  kv_ids = np.array([[0, 1, 1, 2, 2, 2, 2], [0, 0, 0, 1, 1, 1, 1]], np.int32)  # [B, S]
  out, weights = attn(xq, xk, xv, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                      sow_weights=True)
  visible = q_ids[:, None, :, None] == kv_ids[:, None, None, :]
  want, want_weights = np_mha(params, xq, xk, xv, mask=visible, soft_cap=4.0,
                              return_weights=True)
  np.testing.assert_allclose(out, want, **TOL)
  np.testing.assert_allclose(weights, want_weights, **TOL)


def test_segment_ids_refused_when_decoding(make_attention, rng):
  attn, _ = make_attention(**GQA_KW)
  attn.init_cache((B, L, DQ))
  ids = np.zeros((B, 1), np.int32)
  decode = {"decode": True} if isinstance(attn, NnxFrontEnd) else {}
  call = attn.module if isinstance(attn, NnxFrontEnd) else functools.partial(
      attn.decoder.apply, {**attn.variables, "cache": attn.cache}, mutable=["cache"])
  with pytest.raises(ValueError, match="segment_ids are not supported with decode=True"):
    call(randn(rng, B, 1, DQ), q_segment_ids=ids, **decode)


def test_positions_need_rotary(make_attention, rng):
  attn, _ = make_attention(**GQA_KW)
  with pytest.raises(ValueError, match="q_positions was given but rotary_max_wavelength is"):
    attn(randn(rng, B, T, DQ), q_positions=np.arange(T))


# ---- the two front ends against each other ----


def test_dropout_same_key_same_output_in_both_front_ends(rng):
  module = fnnx.MultiHeadAttention(H, DQ, H * K, num_kv_heads=G, dropout_rate=0.4,
                                   rngs=nnx.Rngs(0))
  params = random_params(module)
  fnnx.linen_params_to_nnx(params, module)
  linen = flax_mha.MultiHeadAttention(num_heads=H, qkv_features=H * K, num_kv_heads=G,
                                      dropout_rate=0.4)
  x, key = randn(rng, B, T, DQ), jax.random.key(7)
  want = linen.apply({"params": params}, x, deterministic=False, dropout_rng=key)
  np.testing.assert_allclose(module(x, deterministic=False, rngs=key), want, **TOL)


@pytest.mark.parametrize("use_bias", [True, False])
def test_conversion_round_trip(rng, use_bias):
  module = fnnx.MultiHeadAttention(H, DQ, H * K, DOUT, G, DK, v_features=H * V,
                                   use_bias=use_bias, rngs=nnx.Rngs(0))
  linen = flax_mha.MultiHeadAttention(num_heads=H, qkv_features=H * K, out_features=DOUT,
                                      num_kv_heads=G, v_features=H * V, use_bias=use_bias)
  xq, xk, _ = cross_inputs(rng)
  want = linen.init(jax.random.key(3), xq, xk)  # linen's own init: its tree, its shapes
  fnnx.linen_params_to_nnx(want, module)
  got = fnnx.nnx_to_linen_params(module)
  chex.assert_trees_all_equal(got, want)
  np.testing.assert_allclose(module(xq, xk), linen.apply(want, xq, xk), **TOL)
  assert ("bias" in got["params"]["query"]) == use_bias


def test_linen_params_to_nnx_takes_nnx_updates_order_too(rng):
  """(module, params), nnx.update's order, loads the same as (params, module)."""
  module = fnnx.MultiHeadAttention(H, DQ, H * K, rngs=nnx.Rngs(0))
  params = random_params(module)
  assert fnnx.linen_params_to_nnx(module, {"params": params}) is module
  chex.assert_trees_all_equal(fnnx.nnx_to_linen_params(module), {"params": params})
  with pytest.raises(TypeError, match="module must be a flax_mha.nn.nnx.MultiHeadAttention"):
    fnnx.linen_params_to_nnx(params, params)


def test_conversion_errors():
  module = fnnx.MultiHeadAttention(H, DQ, H * K, rngs=nnx.Rngs(0))
  params = random_params(module)
  with pytest.raises(ValueError, match=r"missing \['out/bias'\]"):
    fnnx.linen_params_to_nnx({**params, "out": {"kernel": params["out"]["kernel"]}}, module)
  bad = {**params, "key": {**params["key"], "kernel": params["key"]["kernel"][:, :1]}}
  with pytest.raises(ValueError, match=r"params\['key'\]\['kernel'\] must have shape "
                                       r"\(19, 6, 11\).*got \(19, 1, 11\)"):
    fnnx.linen_params_to_nnx(bad, module)
  with pytest.raises(TypeError, match="module must be a flax_mha.nn.nnx.MultiHeadAttention"):
    fnnx.nnx_to_linen_params(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
