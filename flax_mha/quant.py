"""Symmetric int8 quantization per row: what an int8 KV cache (`flax_mha.cache`) stores.

  q, scale = quantize(x)             # x [..., K] floating -> q [..., K] int8, scale [...] float32
  x_hat = dequantize(q, scale, dtype)

Each row of the last axis (one token's key or value in one head) gets its own scale,
max|x| / 127 over the row; the values are rounded to the nearest multiple of it and clipped to
[-127, 127] (-128 is never used, so the range is symmetric). Per element,
|x - dequantize(q, scale)| <= scale / 2 = max|row| / 254, up to float32 rounding: a row's
error is bounded by its own largest entry. A row of zeros gets scale 0 and dequantizes to
zeros (no NaN or inf). Both functions are elementwise and free of data-dependent shapes, so
`jit` and `vmap` take them as they are.

Quantizing has no derivative (rounding): `quantize` raises a TypeError under `jax.grad` or
`jax.jvp` when its input carries a tangent, rather than give a gradient that is silently zero;
an int8 cache is for inference. `dequantize` is differentiable in the scale (the int8 values
have no gradient).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LEVELS = 127  # quantized values lie in [-LEVELS, LEVELS]
DTYPE = jnp.int8


@jax.custom_jvp
def _forward_only(x):
  """x, refusing a tangent (see the module docstring)."""
  return x


def _forward_only_jvp(primals, tangents):
  (x,), (dx,) = primals, tangents
  if not isinstance(dx, jax.custom_derivatives.SymbolicZero):
    raise TypeError("flax_mha.quant.quantize has no derivative (it rounds): an int8 KV cache is "
                    "for inference; differentiate through a floating cache (dtype=jnp.float32 "
                    "or the model's dtype) instead")
  return x, dx


_forward_only.defjvp(_forward_only_jvp, symbolic_zeros=True)


def quantize(x):
  """(q [..., K] int8, scale [...] float32) of floating x [..., K], per row of the last axis:
  scale = max|x| / 127, q = round(x / scale) clipped to [-127, 127] (see the module docstring
  for the error bound)."""
  if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"x must be a floating array, got "
                    f"{getattr(x, 'dtype', type(x).__name__)}")
  x = _forward_only(x).astype(jnp.float32)
  scale = jnp.max(jnp.abs(x), axis=-1) / LEVELS
  safe = jnp.where(scale > 0, scale, 1.0)  # a row of zeros: q = 0 whatever the divisor
  q = jnp.clip(jnp.round(x / safe[..., None]), -LEVELS, LEVELS).astype(DTYPE)
  return q, scale


def dequantize(q, scale, dtype=jnp.float32):
  """q [..., K] int8 times its rows' scale [...], in `dtype`."""
  return (q.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]).astype(dtype)


def check_cache_dtype(dtype):
  """A KV cache's dtype: floating, or int8 (quantized on write: this module); any other dtype
  is refused by name. Returns it as a numpy dtype."""
  try:
    dtype = jnp.dtype(dtype)
  except TypeError:
    raise TypeError(f"dtype must be a floating dtype or int8, got {dtype!r}") from None
  if dtype != DTYPE and not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"dtype must be a floating dtype or int8 (an int8 cache, quantized per "
                    f"token and head: flax_mha.quant), got {dtype}")
  return dtype


def is_quantized(dtype) -> bool:
  """Whether an array of `dtype` is quantized (int8) rather than floating."""
  return jnp.dtype(dtype) == DTYPE
