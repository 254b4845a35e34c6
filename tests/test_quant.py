"""Symmetric int8 quantization per row (flax_mha.quant) against a float64 NumPy reference: the
values, the bound |x - dequantize(quantize(x))| <= scale / 2, rows of zeros, what it refuses,
and no silent gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_mha import quant


def _np_quantize(x):
  """The formula on the page, in float64: scale = max|x| / 127, q = round(x / scale)."""
  x = np.asarray(x, np.float64)
  scale = np.abs(x).max(axis=-1) / 127.0
  q = np.clip(np.rint(x / np.where(scale > 0, scale, 1.0)[..., None]), -127, 127)
  return q.astype(np.int8), scale


def test_quantize_equals_the_numpy_reference_within_its_bound(rng):
  x = rng.standard_normal((3, 5, 7, 11)).astype(np.float32) * np.array([1e-3, 1.0, 40.0])[
      :, None, None, None]
  q, scale = jax.jit(quant.quantize)(x)
  assert q.dtype == jnp.int8 and scale.dtype == jnp.float32 and scale.shape == (3, 5, 7)
  want_q, want_scale = _np_quantize(x)
  np.testing.assert_allclose(scale, want_scale, rtol=1e-6)
  # float32 division can round a value lying on .5 the other way: at most one level apart
  assert np.abs(np.asarray(q, np.int32) - want_q).max() <= 1
  assert (np.asarray(q) == want_q).mean() > 0.999
  back = np.asarray(jax.jit(quant.dequantize)(q, scale), np.float64)
  bound = want_scale[..., None] / 2 * (1 + 1e-5)
  assert (np.abs(back - x) <= bound).all()
  assert np.abs(np.asarray(q)).max() == 127  # each row's largest entry uses the full range


def test_a_row_of_zeros_dequantizes_to_zeros():
  x = np.zeros((2, 4, 8), np.float32)
  x[0, 1] = np.arange(8.0) - 3
  q, scale, back = jax.jit(lambda x: (*quant.quantize(x), quant.dequantize(
      *quant.quantize(x), jnp.bfloat16)))(x)
  assert scale[1, 0] == 0 and (q[1] == 0).all()
  assert back.dtype == jnp.bfloat16 and np.isfinite(np.asarray(back, np.float32)).all()
  np.testing.assert_array_equal(np.asarray(back[1], np.float32), 0)


def test_16_bit_inputs_and_vmap():
  x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 6, 16)), jnp.bfloat16)
  (q, scale), (vq, vscale), back = jax.jit(lambda x: (
      quant.quantize(x), jax.vmap(quant.quantize)(x),
      quant.dequantize(*quant.quantize(x))))(x)
  np.testing.assert_array_equal(q, vq)
  np.testing.assert_array_equal(scale, vscale)
  err = np.abs(np.asarray(back, np.float32) - np.asarray(x, np.float32))
  assert (err <= np.asarray(scale)[..., None] / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("x,match", [
    (jnp.ones((2, 3), jnp.int32), "x must be a floating array, got int32"),
    ([1.0, 2.0], "x must be a floating array, got list"),
])
def test_bad_inputs_are_named(x, match):
  with pytest.raises(TypeError, match=match):
    quant.quantize(x)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.bool_, "nope"])
def test_cache_dtypes_other_than_float_and_int8_are_refused(dtype):
  with pytest.raises(TypeError, match="dtype must be a floating dtype or int8"):
    quant.check_cache_dtype(dtype)
  assert quant.check_cache_dtype(jnp.int8) == jnp.int8
  assert quant.check_cache_dtype("bfloat16") == jnp.bfloat16


def test_no_silent_gradient():
  """Through quantize: a TypeError naming it; through dequantize, the scale's gradient."""
  x = np.linspace(-1.0, 2.0, 8, dtype=np.float32).reshape(2, 4)
  with pytest.raises(TypeError, match="quantize has no derivative"):
    jax.jit(jax.grad(lambda x: jnp.sum(quant.dequantize(*quant.quantize(x)))))(x)
  q, scale = jax.jit(quant.quantize)(x)
  grad = jax.jit(jax.grad(lambda s: jnp.sum(quant.dequantize(q, s))))(scale)
  np.testing.assert_allclose(grad, np.asarray(q, np.float32).sum(-1))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_non_finite_entry_stays_where_it_was(dtype):
  """inf, -inf and NaN entries are stored as NONFINITE (-128) and read back as NaN, only where
  they were: the scale comes from the row's finite entries (the NumPy reference over them),
  which keep their bound; a row with no finite entry gets scale 0; the scale's gradient takes
  nothing from them."""
  rng = np.random.default_rng(3)
  x = rng.standard_normal((4, 13)).astype(np.float32) * 5
  x[0, 2], x[1, [0, 7]], x[2, 5] = np.inf, (-np.inf, np.nan), np.nan
  x[3] = [np.inf, -np.inf, np.nan] * 4 + [np.inf]
  bad = ~np.isfinite(x)
  q, scale = jax.jit(quant.quantize)(jnp.asarray(x, dtype))
  assert quant.NONFINITE == -128
  np.testing.assert_array_equal(np.asarray(q) == quant.NONFINITE, bad)
  finite = np.asarray(jnp.asarray(x, dtype), np.float64)
  want_q, want_scale = _np_quantize(np.where(bad, 0.0, finite))
  np.testing.assert_allclose(scale, want_scale, rtol=1e-6)
  assert scale[3] == 0 and np.isfinite(np.asarray(scale)).all()
  assert np.abs(np.asarray(q, np.int32) - want_q)[~bad].max() <= 1
  back = np.asarray(jax.jit(quant.dequantize, static_argnums=2)(q, scale, dtype), np.float64)
  assert np.isnan(back[bad]).all() and np.isfinite(back[~bad]).all()
  err = np.abs(back - finite)[~bad]
  assert (err <= np.broadcast_to(want_scale[:, None], x.shape)[~bad] / 2 * (1 + 1e-5)
          + (0.0 if dtype == jnp.float32 else 4e-3 * np.abs(finite[~bad]))).all()
  grad = jax.grad(lambda s: jnp.nansum(quant.dequantize(q, s)))(scale)
  np.testing.assert_allclose(grad, np.where(bad, 0, np.asarray(q, np.float32)).sum(-1))
