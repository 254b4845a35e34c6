"""Rotary position embedding (RoPE, Su et al. 2021, arXiv:2104.09864), half-split convention.

Shapes use the dimension key in `flax_mha/__init__.py`: T length, H heads, K head dim.
"""

from __future__ import annotations


import jax.numpy as jnp
import numpy as np

from flax_mha import checks


def apply_rotary(x, positions, *, max_wavelength: float = 10_000.0):
  """Rotate x [..., T, H, K] by angles position * frequency; returns x's shape and dtype.

  Half-split convention of Llama/Gemma: feature i pairs with feature i + K/2, so with
  x1 = x[..., :K/2], x2 = x[..., K/2:] and angle[..., t, i] = positions[..., t] * freq[i],

    out = concat(x1 * cos(angle) - x2 * sin(angle), x2 * cos(angle) + x1 * sin(angle))
    freq[i] = max_wavelength ** (-2i / K),  i in [0, K/2).

  This matches `transformers`' `rotate_half` (x * cos + rotate_half(x) * sin) and Gemma's
  `apply_rope`, not the interleaved (x[2i], x[2i+1]) pairing of the paper and GPT-J. Applied to
  queries at positions m and keys at positions n, the logits depend only on m - n.

  Args:
    x: [..., T, H, K] floating, K even.
    positions: [..., T] integer or floating; broadcasts against x's leading dims [..., T]
      without growing them: [T] for every example, [B, T] per example (e.g. offset by a
      KV-cache index, or restarting per packed document). May be traced under `jit`.
    max_wavelength: the base of the frequencies (Llama's `rope_theta`), a positive finite
      Python number (static).

  The angles and the rotation are computed in float32 (float64 for float64 x) and cast back,
  so a bfloat16 x, whose 8-bit mantissa cannot tell position 257 from 256, keeps its positions.
  Shapes are static under `jit`; works under `vmap`.
  """
  x, positions = _check(x, positions, max_wavelength)
  k = x.shape[-1]
  compute = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
  # The frequencies depend on static values only: compute them once in float64 NumPy.
  freq = np.asarray(max_wavelength, np.float64) ** (-2.0 * np.arange(k // 2) / k)  # [K/2]
  angle = positions.astype(compute)[..., None, None] * freq.astype(compute)  # [..., T, 1, K/2]
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  x1, x2 = jnp.split(x.astype(compute), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def _check(x, positions, max_wavelength):
  """Validate the arguments of `apply_rotary`; return (x, positions) as jax arrays."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"x must be an array with layout [..., T, H, K], got {type(x).__name__}")
  x = jnp.asarray(x)  # canonical dtype: a NumPy float64 x is float32 when x64 is off
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"x must have a floating dtype, got {x.dtype}")
  if x.ndim < 3:
    raise ValueError(f"x must have rank >= 3 with layout [..., T, H, K], got shape {x.shape}")
  if x.shape[-1] % 2:
    raise ValueError(f"apply_rotary needs an even head dim K, got K={x.shape[-1]}")
  positions = jnp.asarray(positions)
  if not (jnp.issubdtype(positions.dtype, jnp.integer)
          or jnp.issubdtype(positions.dtype, jnp.floating)):
    raise TypeError(f"positions must have an integer or floating dtype, got {positions.dtype}")
  lead = x.shape[:-2]  # [..., T]
  if positions.ndim < 1 or positions.shape[-1] != lead[-1]:
    raise ValueError(
        f"positions must have layout [..., T] with x's T={lead[-1]}, got shape {positions.shape}")
  try:
    ok = np.broadcast_shapes(positions.shape, lead) == lead
  except ValueError:
    ok = False
  if not ok:
    raise ValueError(
        f"positions must broadcast to x's leading dims [..., T] = {lead} without growing them, "
        f"got shape {positions.shape}")
  checks.check_positive_real("max_wavelength", max_wavelength)
  return x, positions
