"""The "rows" implementation (query-row blocks, exact softmax): values and gradients against the
oracle on tile plans that exercise every path (many units, padded and causal-segmented query
blocks, T != S, GQA, every broadcast layout of a mask and a bias, rows that see nothing), the
work it skips, and the inputs it refuses by name (more in test_implementations.py). The cases
left to the integration part, and the slow half of the layouts, are in test_rows_integration.py."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_mha
from flax_mha import mods as mods_lib
from flax_mha.kernels import reference
from flax_mha.kernels import rows
from helpers import in_turn, output_and_grads, qkv

SMALL_TILES = rows.make_attention(tile_forward=2**9, tile_backward=2**8)  # many trips and blocks


def _call(fn, q, k, v, is_causal, scale=0.37):
  return fn(q, k, v, None, None, is_causal=is_causal, scale=scale, dropout_rate=0.0,
            dropout_rng=None)


@pytest.mark.parametrize("fn", [rows.attention, SMALL_TILES], ids=["default_tiles", "small"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("t,s,h,g", [(7, 11, 6, 3), (37, 37, 4, 1)])  # more: the integration part
def test_values_and_grads_match_oracle(fn, is_causal, t, s, h, g):
  rng = np.random.default_rng(t * s)
  q, k, v = (jnp.asarray(x) for x in qkv(rng, t=t, s=s, h=h, g=g, k=5, v=3))
  call = lambda f: lambda *a: _call(f, *a, is_causal)
  out, grads = output_and_grads(call(fn), q, k, v)  # one compile: values and gradients
  want_out, want = output_and_grads(call(reference.attention), q, k, v, jit=False)
  chex.assert_trees_all_close(out, want_out, atol=2e-6, rtol=2e-6)
  chex.assert_trees_all_close(grads, want, atol=1e-5, rtol=1e-5)


def check_float64_and_bfloat16():
  rng = np.random.default_rng(1)
  with jax.enable_x64(True):
    q, k, v = (jnp.asarray(x, jnp.float64) for x in qkv(rng, t=20, s=20, h=2, g=1, k=4, v=4))
    out = _call(SMALL_TILES, q, k, v, True)
    chex.assert_type(out, jnp.float64)
    np.testing.assert_allclose(out, _call(reference.attention, q, k, v, True), atol=1e-13)
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in qkv(rng, t=20, s=20, h=2, g=1, k=4, v=4))
  out = _call(SMALL_TILES, q, k, v, True)
  chex.assert_type(out, jnp.bfloat16)
  want = _call(reference.attention, q, k, v, True)
  np.testing.assert_allclose(out.astype(np.float32), want.astype(np.float32), atol=2e-2)


def test_through_the_public_api_with_batch_dims_and_vmap():
  rng = np.random.default_rng(2)
  q, k, v = (jnp.asarray(x) for x in qkv(rng, batch=(2, 3), t=9, s=9, h=4, g=2, k=8, v=8))
  fn = lambda *a, implementation: flax_mha.dot_product_attention(
      *a, is_causal=True, implementation=implementation)
  np.testing.assert_allclose(fn(q, k, v, implementation="rows"),
                             fn(q, k, v, implementation="reference"), atol=2e-6)
  mapped = jax.vmap(lambda *a: fn(*a, implementation="rows"))(q, k, v)
  np.testing.assert_allclose(mapped, fn(q, k, v, implementation="reference"), atol=2e-6)


@pytest.mark.parametrize("t,s,k,v", [(0, 7, 5, 3), (4, 0, 5, 3), (4, 7, 0, 3), (4, 7, 5, 0)])
def test_empty_dims(t, s, k, v):
  """As everywhere: T, S or V = 0 give zeros (S = 0: no key to see); K = 0 the mean of V."""
  rng = np.random.default_rng(3)
  q, key, value = (jnp.asarray(x) for x in qkv(rng, t=t, s=s, h=2, g=1, k=k, v=v))
  fn = lambda *a, implementation: flax_mha.dot_product_attention(
      *a, is_causal=True, implementation=implementation)
  out = fn(q, key, value, implementation="rows")
  np.testing.assert_allclose(out, fn(q, key, value, implementation="reference"), atol=1e-6)
  grads = jax.grad(lambda *a: jnp.sum(fn(*a, implementation="rows")), argnums=(0, 1, 2))(
      q, key, value)
  chex.assert_tree_all_finite(grads)


@pytest.mark.parametrize("t", [1024, 4096])
def test_causal_visits_about_half_the_logits(t):
  """The segments' static key extents cover at most 5/8 of T·S (the lower triangle and the
  blocks' diagonal overhang), and every visible key."""
  for tile in (rows.TILE_FORWARD_CAUSAL, rows.TILE_BACKWARD):
    p = rows.plan(1, t, t, 8, 8, 0.1, True, tile)
    visited = sum((end - first) * p.bq * extent for first, end, extent in p.segments)
    assert visited <= 0.63 * t * t
    assert all(extent >= min(t, end * p.bq) for _, end, extent in p.segments)
    assert p.segments[-1][1] == p.n_q and p.n_q * p.bq >= t


def test_tiles_stay_within_budget_as_s_grows():
  for s in (512, 8192, 65536):
    p = rows.plan(2, s, s, 8, 2, 0.1, False, rows.TILE_FORWARD)
    assert p.units * 4 * p.bq * s <= max(rows.TILE_FORWARD, 4 * rows.MIN_ROWS * s)


@pytest.mark.parametrize("kwargs, match", [
    (dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), "no dropout"),
    (dict(local_window_size=2, sink_tokens=1), "no lengths.*sink tokens"),
    (dict(key_value_seq_lengths=jnp.array([3])), "no lengths"),
    (dict(mask_mod=lambda b, h, q, kv: q >= kv), "mask/score functions"),
])
def test_refuses_what_it_does_not_take_by_name(kwargs, match):
  x = jnp.ones((1, 4, 2, 8))
  with pytest.raises(ValueError, match=f"implementation='rows' cannot run.*{match}"):
    flax_mha.dot_product_attention(x, x, x, implementation="rows", **kwargs)


def test_forward_mode_is_a_named_error():
  x = jnp.ones((1, 4, 2, 8))
  fn = lambda q: flax_mha.dot_product_attention(q, x, x, implementation="rows")
  with pytest.raises(TypeError, match="implementation='xla' or 'reference' for forward mode"):
    jax.jvp(fn, (x,), (x,))


@pytest.mark.parametrize("tile,error", [(0, ValueError), (-1, ValueError), (2.5, TypeError)])
def test_bad_tile_budget(tile, error):
  with pytest.raises(error, match=f"tile_forward must be a positive int, got .*{tile}"):
    rows.make_attention(tile_forward=tile)
  with pytest.raises(error, match=f"tile_backward must be a positive int, got .*{tile}"):
    rows.make_attention(tile_backward=tile)


def test_unsupported_reason_reads_mods():
  assert rows.unsupported_reason(0.0, mods_lib.Mods()) is None
  window = mods_lib.LocalWindow(1, 1)
  assert rows.unsupported_reason(0.0, mods_lib.Mods(masks=(window,))) is None
  assert "sink tokens" in rows.unsupported_reason(
      0.0, mods_lib.Mods(masks=(mods_lib.LocalWindow(1, 1, sink_tokens=2),)))
  assert "sink tokens" in rows.unsupported_reason(
      0.0, mods_lib.Mods(masks=(window, mods_lib.SeqLengths(None, jnp.array([2])))))


WINDOWS = [(5, 3), (64, 0), (0, 0), (200, 17), (900, 900)]


# With a bias and a mask, each window causal or not in turn; the other (slow) and without them
# (plain): the integration part.
_WINDOW_TURN = in_turn(WINDOWS, (False, True))
WINDOW_CASES = [(w, causal) for w in WINDOWS for causal in (False, True) if _WINDOW_TURN(w, causal)]
OTHER_WINDOW_CASES = [(w, causal) for w in WINDOWS for causal in (False, True)
                      if not _WINDOW_TURN(w, causal)]


@pytest.mark.parametrize("window,is_causal", WINDOW_CASES)
@pytest.mark.parametrize("dense", [True], ids=["bias_and_mask"])
def test_windows_match_oracle(window, is_causal, dense):
  """A window visits one band of keys per block of rows (a band wider than S falls back to
  the full extent): values and gradients, with bias and mask read at the band's keys, GQA, T
  not a multiple of the block, rows that see nothing (the mask) giving 0."""
  t, h, g = 300, 4, 2
  rng = np.random.default_rng(sum(window))
  q, k, v = (jnp.asarray(x) for x in qkv(rng, t=t, s=t, h=h, g=g, k=8, v=4))
  bias = jnp.asarray(rng.standard_normal((2, 1, t, t)), jnp.float32) if dense else None
  mask = jnp.asarray(rng.random((2, h, 1, t)) < 0.8) if dense else None
  call = lambda impl: lambda q, k, v, bias: flax_mha.dot_product_attention(
      q, k, v, bias, mask, is_causal=is_causal, local_window_size=window, implementation=impl)
  out, grads = output_and_grads(call("rows"), q, k, v, bias)
  want_out, want = output_and_grads(call("reference"), q, k, v, bias, jit=False)
  chex.assert_trees_all_close(out, want_out, atol=2e-6, rtol=2e-6)
  chex.assert_trees_all_close(grads, want, atol=1e-5, rtol=1e-5)


def _band_layer(impl):
  return lambda q, k, v: flax_mha.dot_product_attention(
      q, k, v, is_causal=True, local_window_size=(20, 0), implementation=impl)


BAND_TRANSFORMS = {
    "vmap": jax.vmap,  # over the batch: each call sees [T, H, K]
    "scan": lambda f: lambda q, k, v: jax.lax.scan(lambda x, _: (f(x, k, v), None), q, None,
                                                   length=2)[0],
    "checkpoint": lambda f: jax.checkpoint(f),
}


@pytest.mark.parametrize("transform", sorted(BAND_TRANSFORMS))
def test_window_band_under_transforms_with_grad(transform):
  """The band path (dynamic key starts inside the block loop) under vmap, a scan over layers
  and jax.checkpoint, jitted, with gradients: as the oracle under the same transform."""
  rng = np.random.default_rng(3)
  q, k, v = (jnp.asarray(x) for x in qkv(rng, batch=(1,), t=400, s=400, h=4, g=4, k=8, v=8))
  assert rows.plan(1, 400, 400, 4, 4, 0.1, True, rows.TILE_FORWARD, (20, 0)).band
  wrap = BAND_TRANSFORMS[transform]
  out, grads = output_and_grads(wrap(_band_layer("rows")), q, k, v)
  want_out, want = output_and_grads(wrap(_band_layer("reference")), q, k, v, jit=False)
  chex.assert_trees_all_close(out, want_out, atol=2e-6, rtol=2e-6)
  chex.assert_trees_all_close(grads, want, atol=1e-5, rtol=1e-5)


def test_window_band_visits_work_proportional_to_the_window():
  """Each block of WINDOW_ROWS rows visits WINDOW_ROWS + left (+ right) keys: the band, not S."""
  for is_causal, window, width in ((True, (512, 0), 512), (False, (100, 60), 160)):
    p = rows.plan(1, 16384, 16384, 8, 8, 0.1, is_causal, rows.TILE_FORWARD, window)
    assert p.band and p.segments == ((0, p.n_q, rows.WINDOW_ROWS + width),)
  assert not rows.plan(1, 256, 256, 8, 8, 0.1, False, rows.TILE_FORWARD, (200, 0)).band


TILES = {"default": (None, rows.TILE_BACKWARD), "units_part_of_a_batch": (2**9, 2**9),
         "one_unit": (2**6, 2**6)}
LAYOUTS = [  # (bias shape, mask shape) for q [2, 9, 8, 4], k [2, 13, 4, 4]
    ((1, 8, 9, 13), (2, 1, 9, 13)), ((2, 1, 1, 13), (1, 8, 1, 13)), ((2, 8, 9, 1), (2, 8, 9, 13)),
    (None, (2, 1, 1, 13)), ((1, 1, 9, 13), None)]


def _layout_cases():
  """Every layout with every tile plan, causal and not, in two parts: this file's, every other
  (tile plan, layout) pair, causality alternating (each tile plan meets two or three layouts,
  each layout one or two tile plans, both causalities on the whole); the rest, slow:
  test_rows_integration.py. A case's id numbers its shapes by its place in both parts."""
  unit, slow = [], []
  for i, (tiles, (bias_shape, mask_shape)) in enumerate(
      (tiles, layout) for tiles in TILES for layout in LAYOUTS):
    for is_causal in (False, True):
      index = len(unit) + len(slow)
      shapes = ["None" if shape is None else f"{name}_shape{index}"
                for name, shape in (("bias", bias_shape), ("mask", mask_shape))]
      kept = i % 2 == 0 and is_causal == bool(i // 2 % 2)
      (unit if kept else slow).append(pytest.param(
          tiles, bias_shape, mask_shape, is_causal, id="-".join([tiles, *shapes, str(is_causal)])))
  return unit, slow


LAYOUT_CASES, SLOW_LAYOUT_CASES = _layout_cases()


@pytest.mark.parametrize("tiles, bias_shape, mask_shape, is_causal", LAYOUT_CASES)
def test_bias_and_mask_of_every_broadcast_shape(tiles, bias_shape, mask_shape, is_causal):
  """Trips that cover whole batch elements, part of one (G=4: 2 or 1 key heads per trip) or a
  single unit read the right part of every mask/bias layout; dbias sums the broadcast dims."""
  rng = np.random.default_rng(7)
  q, k, v = (jnp.asarray(x) for x in qkv(rng, t=9, s=13, h=8, g=4, k=4, v=3))
  bias = None if bias_shape is None else jnp.asarray(rng.standard_normal(bias_shape), jnp.float32)
  mask = None if mask_shape is None else jnp.asarray(rng.random(mask_shape) < 0.6)
  call = lambda f: lambda q, k, v, b=None: f(q, k, v, b, mask, is_causal=is_causal, scale=0.4,
                                             dropout_rate=0.0, dropout_rng=None)
  args = (q, k, v) if bias is None else (q, k, v, bias)
  out, grads = output_and_grads(call(rows.make_attention(*TILES[tiles])), *args)
  want_out, want = output_and_grads(call(reference.attention), *args, jit=False)
  chex.assert_trees_all_close(out, want_out, atol=2e-6)
  chex.assert_trees_all_close(grads, want, atol=1e-5, rtol=1e-5)


def check_rows_that_see_nothing_give_zero_and_finite_grads():
  rng = np.random.default_rng(8)
  q, k, v = (jnp.asarray(x) for x in qkv(rng, t=300, s=300, h=2, g=1, k=4, v=3))
  mask = np.ones((2, 1, 300, 300), bool)
  mask[0, 0, 7] = False  # one query row sees no key
  bias = np.zeros((2, 1, 300, 300), np.float32)
  bias[1, 0, 11] = -np.inf  # one row's logits are all -inf
  call = lambda f, *a: f(*a, jnp.asarray(bias), jnp.asarray(mask), is_causal=True, scale=0.5,
                         dropout_rate=0.0, dropout_rng=None)
  out = call(SMALL_TILES, q, k, v)
  np.testing.assert_array_equal(out[0, 7], 0.0)
  np.testing.assert_array_equal(out[1, 11], 0.0)
  np.testing.assert_allclose(out, call(reference.attention, q, k, v), atol=2e-6)
  grads = jax.grad(lambda *a: jnp.sum(call(SMALL_TILES, *a) ** 2), argnums=(0, 1, 2))(q, k, v)
  chex.assert_tree_all_finite(grads)
  np.testing.assert_array_equal(grads[0][0, 7], 0.0)
