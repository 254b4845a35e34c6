"""Products of low-precision floats (bfloat16, float16): float32 accumulation, in the form
XLA runs well.

XLA:CPU hands a dot of bfloat16 operands and a float32 result (`preferred_element_type`) to its
YNNPACK fusion as it is; a dot whose result is bfloat16 it rewrites to float32 operands, the
weights converted at every call, several times slower. So every product of the modules and
models (projections, MLPs, the tied embedding's output product, LM heads; flax's layers take
`dot_general` and `promote_dtype` below) accumulates in float32 and casts its result back to the
compute dtype: a property of the dtype, not a setting. Float32 and wider products are plain.

A product of one row (a batch-1 decode step) reaches no YNNPACK in either dtype: XLA:CPU
converts the bfloat16 weights to float32 at every step. So on the CPU the decoding loops
(`flax_mha.models.decoding`) run one-row steps on float32 copies of the low-precision
parameters, made once per call before the loop (`loop_params`; `explain` says what a call
gets): a layer keeps a kernel wider than its compute dtype as it is and a one-row product reads
it in its own dtype, the activations staying in the compute dtype.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
from jax import lax

ROW_RULE_PLATFORMS = ("cpu",)  # where one-row decode steps read float32 copies of the weights


def is_low(dtype) -> bool:
  """Whether `dtype` is a float narrower than float32 (bfloat16, float16)."""
  dtype = jnp.dtype(dtype)
  return bool(jnp.issubdtype(dtype, jnp.floating)) and dtype.itemsize < 4


def _wider(dtype, other) -> bool:
  """Whether `other` is a float of more bytes than `dtype`."""
  other = jnp.dtype(other)
  return bool(jnp.issubdtype(other, jnp.floating)) and other.itemsize > jnp.dtype(dtype).itemsize


def _rows(lhs, dimension_numbers) -> int:
  """The rows of a product: the size of lhs's free (neither contracting nor batch) dims."""
  (contracting, _), (batch, _) = dimension_numbers
  rows = 1
  for i, size in enumerate(lhs.shape):
    rows *= 1 if i in contracting or i in batch else size
  return rows


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                **kwargs):
  """`lax.dot_general` computing in lhs's dtype (flax's layers pass the input in the compute
  dtype): low-precision operands accumulate in float32 and the result is cast back. A float rhs
  wider than that dtype (a kernel `promote_dtype` kept) is cast to it, but a one-row product
  reads it as it is, the row cast up instead. An explicit `preferred_element_type` is kept.
  `kwargs` (flax NNX's out_sharding) pass through."""
  dot = lambda a, b, **more: lax.dot_general(a, b, dimension_numbers, precision=precision,
                                             **more, **kwargs)
  dtype = lhs.dtype if jnp.issubdtype(lhs.dtype, jnp.floating) else jnp.result_type(lhs, rhs)
  if preferred_element_type is not None:
    return dot(lhs, rhs, preferred_element_type=preferred_element_type)
  if _wider(dtype, rhs.dtype) and _rows(lhs, dimension_numbers) == 1:
    return dot(lhs.astype(rhs.dtype), rhs).astype(dtype)
  lhs, rhs = lhs.astype(dtype), rhs.astype(dtype)
  if not is_low(dtype):
    return dot(lhs, rhs)
  return dot(lhs, rhs, preferred_element_type=jnp.float32).astype(dtype)


def cast(x, dtype):
  """`x` as `dtype`, except a float wider than it, kept as it is: a product's weight, which
  `dot_general` and `einsum` cast (or read as it is in a one-row product)."""
  return x if _wider(dtype, x.dtype) else jnp.asarray(x, dtype)


def promote_dtype(*args, dtype=None, inexact=True):
  """flax.linen's `promote_dtype` for a layer's (inputs, kernel, bias): all cast to `dtype`,
  except a floating kernel wider than it, kept for `dot_general` (which casts it, or reads it
  as it is in a one-row product). Without `dtype`, flax's: all to their result type."""
  del inexact  # the layers' dtypes are floating
  if dtype is None:
    dtype = jnp.result_type(*(x for x in args if x is not None))
  return [None if x is None else cast(x, dtype) if i == 1 else jnp.asarray(x, dtype)
          for i, x in enumerate(args)]


def promote_dtype_nnx(args, /, *, dtype=None, inexact=True):
  """`promote_dtype` with flax NNX's signature (one tuple of arrays)."""
  return tuple(promote_dtype(*args, dtype=dtype, inexact=inexact))


def layer_keywords(layer) -> dict:
  """The keywords that give a flax dense layer (the class: linen's Dense or DenseGeneral,
  NNX's Linear or LinearGeneral) this module's products: `dot_general`, and `promote_dtype`
  in linen's or NNX's signature where the layer takes one (flax 0.10.6 and later; before, the
  layer casts a kernel to the compute dtype itself, so a one-row step of float32 copies reads
  them cast back)."""
  keywords = {"dot_general": dot_general}
  if "promote_dtype" in inspect.signature(layer.__init__).parameters:
    nnx = layer.__module__.startswith("flax.nnx")
    keywords["promote_dtype"] = promote_dtype_nnx if nnx else promote_dtype
  return keywords


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


def set_at(x, index, values):
  """`x.at[index].set(values, mode="drop")` (values cast to x's dtype), a low-precision float x
  written as its bits (unsigned ints of its width): XLA:CPU converts the whole operand of a
  bfloat16 scatter to float32 and back, where the bits' scatter copies it once each way at
  most (a KV cache's write: python -m experiments.bench.bf16_cpu --part cache). Derivatives
  are the plain scatter's (the bits carry none)."""
  values = jnp.asarray(values).astype(x.dtype)
  if not is_low(x.dtype):
    return x.at[index].set(values, mode="drop")
  bits = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
  as_bits = lambda a: lax.bitcast_convert_type(a, bits)

  @jax.custom_jvp  # the index closed over: ints (and slices), no derivative
  def write(x, values):
    return lax.bitcast_convert_type(as_bits(x).at[index].set(as_bits(values), mode="drop"),
                                    x.dtype)

  @write.defjvp
  def _(primals, tangents):
    """The scatter's own derivative (a cache writes each slot once), in a form linear in the
    tangents that reverse mode transposes: x's kept where nothing is written, plus the values
    added where they are."""
    x_dot, values_dot = tangents
    written = jnp.zeros(x_dot.shape, bool).at[index].set(True, mode="drop")
    return write(*primals), jnp.where(written, jnp.zeros_like(x_dot), x_dot) + jnp.zeros_like(
        x_dot).at[index].add(values_dot, mode="drop")

  return write(x, values)


def row_rule(rows: int, platform: str) -> bool:
  """Whether decode steps of `rows` rows on `platform` read float32 copies of low-precision
  parameters: one row on the CPU."""
  return rows == 1 and platform in ROW_RULE_PLATFORMS


def loop_params(params, rows: int, platform: str):
  """`params` with every low-precision float leaf as float32 where `row_rule` holds, else as
  they are: what a decoding loop of `rows`-row steps carries."""
  if not row_rule(rows, platform):
    return params
  up = lambda x: x.astype(jnp.float32) if is_low(getattr(x, "dtype", jnp.int32)) else x
  return jax.tree.map(up, params)


def explain(dtype, rows: int, platform: str) -> str:
  """What products of compute dtype `dtype` do in decode steps of `rows` rows on `platform`."""
  dtype = jnp.dtype(dtype)
  if not is_low(dtype):
    return f"{dtype}: plain products in {dtype}"
  plain = (f"{dtype}: {dtype} operands, float32 accumulation, the result cast to {dtype} "
           "(XLA:CPU's YNNPACK takes such products as they are)")
  if not row_rule(rows, platform):
    return plain
  return (f"{dtype}, {rows} row on {platform!r}: float32 products on float32 copies of the "
          f"weights, made once per decoding call before its loop, activations and caches in "
          f"{dtype}; a one-row {dtype} product reaches no YNNPACK on XLA:CPU, which would "
          f"convert the weights at every step (python -m experiments.bench.bf16_cpu)")

