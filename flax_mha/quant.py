"""Symmetric int8 quantization per row: what an int8 KV cache (`flax_mha.cache`) stores.

  q, scale = quantize(x)             # x [..., K] floating -> q [..., K] int8, scale [...] float32
  x_hat = dequantize(q, scale, dtype)

Each row of the last axis (one token's key or value in one head) gets its own scale,
max|x| / 127 over the row's finite entries; those are rounded to the nearest multiple of it and
clipped to [-127, 127]. Per finite element, |x - dequantize(q, scale)| <= scale / 2 =
max|finite entries of the row| / 254, up to float32 rounding: a row's error is bounded by its
own largest finite entry. A row of zeros gets scale 0 and dequantizes to zeros (no NaN or inf).

A non-finite entry (inf, -inf or NaN) is stored as NONFINITE = -128, the one code the symmetric
range leaves unused, and dequantizes to NaN: it stays where it was, non-finite, and never
reaches the scale, so the row's finite entries keep their values and their bound (an inf in the
scale would turn every entry of the row into NaN). Its sign and kind (inf or NaN) are not kept:
an attention output that reads it is non-finite either way. A row with no finite entry gets
scale 0. `dequantize` is the one reading of that rule: every reader of an int8 cache (the XLA
step, the decode kernels, paged attention, the Triton decode kernel) calls it. Both functions
are elementwise and free of data-dependent shapes, so `jit` and `vmap` take them as they are.

Quantizing has no derivative (rounding): `quantize` raises a TypeError under `jax.grad` or
`jax.jvp` when its input carries a tangent, rather than give a gradient that is silently zero;
an int8 cache is for inference. `dequantize` is differentiable in the scale (the int8 values
have no gradient, and a non-finite entry adds nothing to the scale's).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LEVELS = 127  # quantized finite values lie in [-LEVELS, LEVELS]
NONFINITE = -LEVELS - 1  # -128: the code of a non-finite entry, read back as NaN
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
  scale = max|x| / 127 over the row's finite entries, q = round(x / scale) clipped to
  [-127, 127], and NONFINITE (-128) where x is inf or NaN (see the module docstring)."""
  if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"x must be a floating array, got "
                    f"{getattr(x, 'dtype', type(x).__name__)}")
  x = _forward_only(x).astype(jnp.float32)
  finite = jnp.isfinite(x)
  scale = jnp.max(jnp.where(finite, jnp.abs(x), 0.0), axis=-1) / LEVELS
  safe = jnp.where(scale > 0, scale, 1.0)  # a row of zeros: q = 0 whatever the divisor
  q = jnp.clip(jnp.round(jnp.where(finite, x, 0.0) / safe[..., None]), -LEVELS, LEVELS)
  return jnp.where(finite, q, NONFINITE).astype(DTYPE), scale


def dequantize(q, scale, dtype=jnp.float32):
  """q [..., K] int8 times its rows' scale [...], in `dtype`; NaN where q is NONFINITE."""
  x = q.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]
  return jnp.where(q == NONFINITE, jnp.nan, x).astype(dtype)


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
