"""The "rows" implementation at the cases tests/kernels/test_rows.py leaves out, most through
that file's own tests: T > S and T not a multiple of the block, windows without bias and mask,
the band path in several trips with sinks, and (slow) the rest of the mask and bias layouts
and of the windows with them."""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from flax_mha import mods as mods_lib
from flax_mha.kernels import reference
from flax_mha.kernels import rows
from helpers import output_and_grads, qkv
import test_rows as unit


pytestmark = pytest.mark.integration  # forward+backward compiles of up to 300 rows: seconds a case

# Cases of tests/kernels/test_rows.py that compile for seconds: the unit part skips them
# (`check_` there), the integration part runs them here.
test_rows_that_see_nothing_give_zero_and_finite_grads = (
    unit.check_rows_that_see_nothing_give_zero_and_finite_grads)
test_float64_and_bfloat16 = (
    unit.check_float64_and_bfloat16)


@pytest.mark.parametrize("fn", [rows.attention, unit.SMALL_TILES], ids=["default_tiles", "small"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("t,s,h,g", [(11, 7, 6, 6), (40, 24, 2, 2)])
def test_values_and_grads_match_oracle(fn, is_causal, t, s, h, g):
  unit.test_values_and_grads_match_oracle(fn, is_causal, t, s, h, g)


@pytest.mark.parametrize("window,is_causal,dense", [
    *((window, is_causal, False) for window in unit.WINDOWS for is_causal in (False, True)),
    *(pytest.param(window, is_causal, True, marks=pytest.mark.slow)
      for window, is_causal in unit.OTHER_WINDOW_CASES)])
def test_windows_match_oracle(window, is_causal, dense):
  unit.test_windows_match_oracle(window, is_causal, dense)


@pytest.mark.slow
@pytest.mark.parametrize("tiles, bias_shape, mask_shape, is_causal", unit.SLOW_LAYOUT_CASES)
def test_bias_and_mask_of_every_broadcast_shape(tiles, bias_shape, mask_shape, is_causal):
  unit.test_bias_and_mask_of_every_broadcast_shape(tiles, bias_shape, mask_shape, is_causal)


@pytest.mark.parametrize("window, is_causal", [((30, 10), False), ((40, 0), True)])
def test_window_band_in_trips_with_sinks_and_t_not_s(window, is_causal):
  """The band path in several trips (one batch element each: small tiles), T != S, sinks, a
  bias of full batch and head dims whose gradient each trip adds at its own rows and keys, and
  a mask: values and gradients (sinks' too) as the oracle's."""
  rng = np.random.default_rng(11)
  t, s, h, g = 200, 330, 4, 2
  q, k, v = (jnp.asarray(x) for x in qkv(rng, batch=(3,), t=t, s=s, h=h, g=g, k=8, v=4))
  bias = jnp.asarray(rng.standard_normal((3, h, t, s)), jnp.float32)
  mask = jnp.asarray(rng.random((3, 1, 1, s)) < 0.9)
  sinks = jnp.asarray(rng.standard_normal(h), jnp.float32)
  mods = mods_lib.Mods(masks=(mods_lib.LocalWindow(*window),), sinks=sinks)
  assert rows.plan(3, t, s, h, g, 0.3, is_causal, 2**6, window).band
  call = lambda f: lambda q, k, v, bias, sinks: f(
      q, k, v, bias, mask, is_causal=is_causal, scale=0.3, dropout_rate=0.0, dropout_rng=None,
      mods=mods_lib.Mods(masks=mods.masks, sinks=sinks))
  args = (q, k, v, bias, sinks)
  out, grads = output_and_grads(call(rows.make_attention(2**6, 2**6)), *args)
  want_out, want = output_and_grads(call(reference.attention), *args, jit=False)
  chex.assert_trees_all_close(out, want_out, atol=2e-6, rtol=2e-6)
  chex.assert_trees_all_close(grads, want, atol=1e-5, rtol=1e-5)
