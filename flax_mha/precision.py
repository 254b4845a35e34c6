"""Products of low-precision floats (bfloat16, float16): float32 accumulation, in the form
XLA runs well.

XLA:CPU hands a dot of bfloat16 operands and a float32 result (`preferred_element_type`) to its
YNNPACK fusion as it is; a dot whose result is bfloat16 it rewrites to float32 operands, the
weights converted at every call, several times slower. So every product of the modules and
models (projections, MLPs, the tied embedding's output product, LM heads; flax's layers take
`dot_general` below) accumulates in float32 and casts its result back to the compute dtype: a
property of the dtype, not a setting. Float32 and wider products are plain.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def is_low(dtype) -> bool:
  """Whether `dtype` is a float narrower than float32 (bfloat16, float16)."""
  dtype = jnp.dtype(dtype)
  return bool(jnp.issubdtype(dtype, jnp.floating)) and dtype.itemsize < 4


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                **kwargs):
  """`lax.dot_general` computing in lhs's dtype (flax's layers pass the input in the compute
  dtype): low-precision operands accumulate in float32 and the result is cast back. An
  explicit `preferred_element_type` is kept. `kwargs` (flax NNX's out_sharding) pass
  through."""
  dot = lambda a, b, **more: lax.dot_general(a, b, dimension_numbers, precision=precision,
                                             **more, **kwargs)
  dtype = lhs.dtype if jnp.issubdtype(lhs.dtype, jnp.floating) else jnp.result_type(lhs, rhs)
  if preferred_element_type is not None:
    return dot(lhs, rhs, preferred_element_type=preferred_element_type)
  lhs, rhs = lhs.astype(dtype), rhs.astype(dtype)
  if not is_low(dtype):
    return dot(lhs, rhs)
  return dot(lhs, rhs, preferred_element_type=jnp.float32).astype(dtype)


def layer_keywords(layer) -> dict:
  """The keywords that give a flax dense layer (the class: linen's Dense or DenseGeneral,
  NNX's Linear or LinearGeneral) this module's products."""
  del layer  # every supported flax takes dot_general
  return {"dot_general": dot_general}


def einsum(subscripts: str, *operands, **kwargs):
  """`jnp.einsum` with `dot_general`'s rule: low-precision operands accumulate in float32,
  the result in their dtype."""
  dtype = jnp.result_type(*operands)
  if not is_low(dtype) or "preferred_element_type" in kwargs:
    return jnp.einsum(subscripts, *operands, **kwargs)
  return jnp.einsum(subscripts, *operands, preferred_element_type=jnp.float32,
                    **kwargs).astype(dtype)


def attend(x, table, dtype=None):
  """x [..., D] · table [C, D]ᵀ -> [..., C], both cast to `dtype` (default: their result
  type) first: a tied embedding as the output projection (flax's `Embed.attend`), with
  `dot_general`'s rule."""
  dtype = jnp.result_type(x, table) if dtype is None else dtype
  return dot_general(x.astype(dtype), table, (((x.ndim - 1,), (1,)), ((), ())))
