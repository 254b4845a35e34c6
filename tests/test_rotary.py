"""flax_mha.rotary.apply_rotary against the float64 NumPy rotation of tests/helpers.py, built pair
by pair.

Dimension key (flax_mha/__init__.py): B batch, T query length, S key length, H heads, K head dim.
Sizes are distinct (K/2 = 7 too) so a swapped axis fails instead of broadcasting silently.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_mha.rotary import apply_rotary
from helpers import np_rotary, randn

B, T, S, H, K = 2, 5, 11, 3, 14


@pytest.mark.parametrize("pos_shape,offset", [((T,), 0), ((B, T), 0), ((T,), 1000),
                                              ((B, T), 1000), ((B, 1, T), 0)])
def test_matches_numpy(rng, variant, pos_shape, offset):
  x = randn(rng, B, 1, T, H, K) if len(pos_shape) == 3 else randn(rng, B, T, H, K)
  # Non-contiguous, unsorted positions: a permutation of a sparse range plus an offset.
  positions = (offset + rng.permutation(7 * T)[:T] + np.zeros(pos_shape)).astype(np.int32)
  if len(pos_shape) > 1:
    positions = positions + np.arange(B).reshape(B, *([1] * (len(pos_shape) - 1))) * 13
  fn = variant(chex.assert_max_traces(apply_rotary, n=1))
  out = fn(jnp.asarray(x), jnp.asarray(positions))  # positions traced under jit
  chex.assert_shape(out, x.shape)
  chex.assert_type(out, jnp.float32)
  # A float32 angle near 1000 rad is rounded to its ulp, 2**-14 ~ 6e-5; NumPy's is not.
  np.testing.assert_allclose(out, np_rotary(x, positions), atol=1e-4 if offset else 2e-5)


def test_float_positions_and_max_wavelength(rng, variant):
  x = randn(rng, T, H, K)
  positions = rng.uniform(-50, 50, T).astype(np.float32)
  out = variant(functools.partial(apply_rotary, max_wavelength=500))(x, positions)
  np.testing.assert_allclose(out, np_rotary(x, positions, 500.0), atol=2e-5)


def test_relative_position(rng, variant):
  """<rot(q, m), rot(k, n)> depends only on m - n."""
  q, k = randn(rng, T, H, K), randn(rng, S, H, K)
  m, n = rng.permutation(40)[:T], rng.permutation(40)[:S]
  rot = variant(apply_rotary)

  def logits_HTS(shift_q, shift_k):
    return jnp.einsum("THK,SHK->HTS", rot(q, m + shift_q), rot(k, n + shift_k))

  base = logits_HTS(0, 0)
  for shift in (1, 37, 1000):
    np.testing.assert_allclose(logits_HTS(shift, shift), base, atol=2e-3, rtol=1e-4)
  # Not trivially constant: moving one side alone changes the logits.
  assert np.abs(logits_HTS(3, 0) - base).max() > 0.1


def test_norm_preserved_and_zero_is_identity(rng, variant):
  x = randn(rng, B, T, H, K)
  rot = variant(apply_rotary)
  out = rot(x, rng.integers(0, 5000, (B, T)))
  np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
  np.testing.assert_allclose(rot(x, np.zeros(T, np.int32)), x, rtol=0, atol=0)


def test_bfloat16_keeps_large_positions(rng, variant):
  x = randn(rng, B, T, H, K)
  positions = 5000 + np.arange(T)  # bfloat16 would round all of these to 5000 or 5024
  rot = variant(apply_rotary)
  out = rot(jnp.asarray(x, jnp.bfloat16), positions)
  chex.assert_type(out, jnp.bfloat16)
  want = rot(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), positions)
  np.testing.assert_allclose(out.astype(np.float32), want, atol=3e-2, rtol=1e-2)
  np.testing.assert_allclose(
      out.astype(np.float32), np_rotary(jnp.asarray(x, jnp.bfloat16), positions), atol=3e-2)


def test_float64(rng):
  x = randn(rng, B, T, H, K, dtype=np.float64)
  positions = 1000 + rng.permutation(9 * T)[:T]
  with jax.enable_x64(True):
    out = jax.jit(apply_rotary)(jnp.asarray(x), jnp.asarray(positions))
    chex.assert_type(out, jnp.float64)
    np.testing.assert_allclose(out, np_rotary(x, positions), atol=1e-12, rtol=0)


def test_gradient_is_inverse_rotation(rng, variant):
  """d/dx <rot(x, p), g> = rot(x, p)^T g = g rotated by -angle."""
  x, cotangent = randn(rng, B, T, H, K), randn(rng, B, T, H, K)
  positions = rng.integers(0, 300, (B, T))
  grad = variant(jax.grad(lambda x: jnp.sum(apply_rotary(x, positions) * cotangent)))(x)
  np.testing.assert_allclose(grad, np_rotary(cotangent, -positions), atol=2e-5)


def test_vmap_matches_batched_call(rng):
  x, positions = randn(rng, B, T, H, K), rng.integers(0, 100, (B, T))
  np.testing.assert_allclose(jax.vmap(apply_rotary)(x, positions), apply_rotary(x, positions),
                             atol=1e-6)
  shared = positions[0]
  np.testing.assert_allclose(jax.vmap(apply_rotary, in_axes=(0, None))(x, shared),
                             apply_rotary(x, shared), atol=1e-6)


X = np.ones((B, T, H, K), np.float32)
POS = np.arange(T)
BAD = [
    # (name, args, kwargs, error, match)
    ("x not an array", ([[[1.0] * K]], POS), {}, TypeError, r"x must be an array.*list"),
    ("integer x", (X.astype(np.int32), POS), {}, TypeError, r"x must have a floating.*int32"),
    ("complex x", (X.astype(np.complex64), POS), {}, TypeError, r"x must .*complex64"),
    ("x rank 2", (X[0, 0], POS), {}, ValueError, r"x must have rank >= 3.*\(3, 14\)"),
    ("odd K", (np.ones((T, H, 7), np.float32), POS), {}, ValueError,
     r"apply_rotary needs an even head dim K, got K=7"),
    ("positions wrong T", (X, np.arange(T + 2)), {}, ValueError,
     r"positions .*\[\.\.\., T\].*T=5.*\(7,\)"),
    ("positions scalar", (X, np.int32(3)), {}, ValueError, r"positions .*T=5.*\(\)"),
    ("positions wrong batch", (X, np.zeros((B + 1, T), np.int32)), {}, ValueError,
     r"positions must broadcast to .*\(2, 5\).*\(3, 5\)"),
    ("positions grow x", (X[0], np.zeros((B, T), np.int32)), {}, ValueError,
     r"positions must broadcast to .*\(5,\).*\(2, 5\)"),
    ("bool positions", (X, np.ones(T, bool)), {}, TypeError, r"positions must .*bool"),
    ("complex positions", (X, np.ones(T, np.complex64)), {}, TypeError,
     r"positions must .*complex64"),
    ("max_wavelength zero", (X, POS), dict(max_wavelength=0.0), ValueError,
     r"max_wavelength must be a finite number > 0, got 0\.0"),
    ("max_wavelength negative", (X, POS), dict(max_wavelength=-10), ValueError,
     r"max_wavelength.*-10"),
    ("max_wavelength inf", (X, POS), dict(max_wavelength=float("inf")), ValueError,
     r"max_wavelength.*inf"),
    ("max_wavelength array", (X, POS), dict(max_wavelength=jnp.float32(1e4)), TypeError,
     r"max_wavelength must be a finite number > 0, got .*Array"),
    ("max_wavelength str", (X, POS), dict(max_wavelength="1e4"), TypeError,
     r"max_wavelength must be a finite number > 0, got str"),
    ("max_wavelength bool", (X, POS), dict(max_wavelength=True), TypeError,
     r"max_wavelength must be a finite number > 0, got bool"),
]


@pytest.mark.parametrize("name,args,kwargs,error,match", BAD, ids=[b[0] for b in BAD])
def test_bad_input(name, args, kwargs, error, match):
  with pytest.raises(error, match=match):
    apply_rotary(*args, **kwargs)


def test_bad_input_under_jit():
  with pytest.raises(ValueError, match=r"positions must broadcast"):
    jax.jit(apply_rotary)(X, np.zeros((B + 1, T), np.int32))
