"""Flax linen modules: parameters and projections only; the attention itself is the pure function.

`MultiHeadAttention` keeps the parameter tree of `flax.linen.MultiHeadDotProductAttention`
(`query`/`key`/`value` kernels [D, H, K], `out` kernel [H, V, D_out]) so checkpoints move both ways.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp
from jax import lax

from flax_mha import _checks
from flax_mha import masks as masks_lib
from flax_mha.attention import dot_product_attention, dot_product_attention_weights

Initializer = Callable[..., Any]


class MultiHeadAttention(nn.Module):
  """Multi-head attention with GQA/MQA, d_k != d_v, dropout on weights and a KV cache.

  Attributes:
    num_heads: query heads H.
    qkv_features: H·K, the width of the query/key projections (default: inputs_q's width).
    out_features: output width (default: inputs_q's width).
    num_kv_heads: key/value heads G (default H); H must be a multiple of G.
    v_features: H·V, the value width before the output projection (default qkv_features), so
      the value head dim V may differ from the query/key head dim K.
    dropout_rate: dropout on the attention weights, in [0, 1).
    use_bias: biases in the four projections.
    dtype: computation dtype (default: inferred from inputs and params).
    param_dtype: parameter dtype.
    precision: precision of the projections.
    kernel_init, out_kernel_init, bias_init: initialisers (out_kernel_init defaults to kernel_init).
    implementation: None, an implementation name or a callable with the internal signature,
      passed through to `flax_mha.dot_product_attention` (which documents and checks it).
    decode: autoregressive decoding with a KV cache in the 'cache' collection. Initialise with
      the full-length input to size the cache; each later call appends its T tokens and attends
      causally to everything cached (query t sees cached positions <= index + t).
  """
  num_heads: int
  qkv_features: int | None = None
  out_features: int | None = None
  num_kv_heads: int | None = None
  v_features: int | None = None
  dropout_rate: float = 0.0
  use_bias: bool = True
  dtype: Any = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  kernel_init: Initializer = nn.linear.default_kernel_init
  out_kernel_init: Initializer | None = None
  bias_init: Initializer = nn.initializers.zeros_init()
  implementation: str | Callable | None = None
  decode: bool = False

  @nn.compact
  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, mask=None, bias=None,
               is_causal: bool = False, deterministic: bool = True, dropout_rng=None,
               sow_weights: bool = False):
    """inputs_q [..., T, D_q], inputs_k [..., S, D_k] (default inputs_q), inputs_v [..., S, D_v]
    (default inputs_k; giving inputs_v without inputs_k is an error, as in flax).

    mask broadcasts to [..., H, T, S]: boolean (True = attend) or, as in flax.linen, numeric with
    nonzero = attend (e.g. the float32 masks of `nn.make_causal_mask`, `nn.make_attention_mask`).
    A torch-style additive float mask (0 / -inf) is not a mask: pass it as `bias`, which is added
    to the logits and broadcasts to [..., H, T, S] too.

    Returns [..., T, out_features]. With `sow_weights`, the weights [..., H, T, S] are sown into
    'intermediates' under 'attention_weights'.
    """
    if inputs_k is None and inputs_v is not None:
      raise ValueError(
          "inputs_v was given but inputs_k is None: pass inputs_k too (the keys would otherwise "
          "silently be inputs_q); for keys equal to values pass inputs_k only")
    inputs_k = inputs_q if inputs_k is None else inputs_k
    inputs_v = inputs_k if inputs_v is None else inputs_v
    _check_inputs(inputs_q, inputs_k, inputs_v)  # first: _head_dims reads inputs_q.shape
    h, g, k_dim, v_dim = self._head_dims(inputs_q)
    mask = _as_bool_mask(mask)
    dense = functools.partial(
        nn.DenseGeneral, axis=-1, dtype=self.dtype, param_dtype=self.param_dtype,
        kernel_init=self.kernel_init, bias_init=self.bias_init, use_bias=self.use_bias,
        precision=self.precision)
    query_THK = dense(features=(h, k_dim), name="query")(inputs_q)
    key_SGK = dense(features=(g, k_dim), name="key")(inputs_k)
    value_SGV = dense(features=(g, v_dim), name="value")(inputs_v)

    if self.decode:
      key_SGK, value_SGV, mask = self._update_cache(
          key_SGK, value_SGV, mask, query_THK.shape[-3])
      is_causal = False  # the cache mask above already holds causality, with the cache offset

    rng = None
    if self.dropout_rate > 0.0 and not deterministic:
      if dropout_rng is None and not self.has_rng("dropout"):
        raise ValueError(
            f"dropout_rate={self.dropout_rate} with deterministic=False needs a dropout_rng "
            "argument or a 'dropout' rng stream (apply(..., rngs={'dropout': key})), got neither")
      rng = self.make_rng("dropout") if dropout_rng is None else dropout_rng
    rate = self.dropout_rate if rng is not None else 0.0
    out_THV = dot_product_attention(
        query_THK, key_SGK, value_SGV, bias, mask, is_causal=is_causal, dropout_rate=rate,
        dropout_rng=rng, implementation=self.implementation)
    if sow_weights:
      self.sow("intermediates", "attention_weights", dot_product_attention_weights(
          query_THK, key_SGK, bias, mask, is_causal=is_causal, dropout_rate=rate,
          dropout_rng=rng))
    out_features = self.out_features or inputs_q.shape[-1]
    return nn.DenseGeneral(
        features=out_features, axis=(-2, -1), dtype=self.dtype, param_dtype=self.param_dtype,
        kernel_init=self.out_kernel_init or self.kernel_init, bias_init=self.bias_init,
        use_bias=self.use_bias, precision=self.precision, name="out")(out_THV)

  def _head_dims(self, inputs_q):
    """(H, G, K, V) from the attributes, checked."""
    h = self.num_heads
    g = h if self.num_kv_heads is None else self.num_kv_heads
    _checks.check_heads(h, g)
    qkv = self.qkv_features or inputs_q.shape[-1]
    v_features = self.v_features or qkv
    for name, width in (("qkv_features", qkv), ("v_features", v_features)):
      if width % h:
        raise ValueError(f"{name}={width} must be divisible by num_heads={h}")
    _checks.check_dropout_rate(self.dropout_rate)
    return h, g, qkv // h, v_features // h

  def _update_cache(self, key_SGK, value_SGV, mask, num_q: int):
    """Write the new keys/values at the cache index; return the full cache and its mask."""
    initialised = self.has_variable("cache", "cached_key")
    cached_key = self.variable("cache", "cached_key", jnp.zeros, key_SGK.shape, key_SGK.dtype)
    cached_value = self.variable(
        "cache", "cached_value", jnp.zeros, value_SGV.shape, value_SGV.dtype)
    index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
    if not initialised:  # init call: sizes the cache, attends causally like a decoder would
      return key_SGK, value_SGV, masks_lib.combine_masks(
          mask, masks_lib.causal_mask(num_q, key_SGK.shape[-3]))
    *batch, max_len, g, k = cached_key.value.shape
    new_len = key_SGK.shape[-3]
    if tuple(key_SGK.shape) != (*batch, new_len, g, k) or new_len > max_len:
      raise ValueError(
          f"decode step: keys must be [..., T<= {max_len}, {g}, {k}] with batch {tuple(batch)} "
          f"as at init, got {tuple(key_SGK.shape)}")
    cur = index.value
    # Zeros in the index's dtype: under jax_enable_x64 bare 0s are int64, and
    # dynamic_update_slice refuses start indices of mixed types.
    zero = jnp.zeros((), cur.dtype)
    start = (zero,) * len(batch) + (cur, zero, zero)
    cached_key.value = lax.dynamic_update_slice(cached_key.value, key_SGK, start)
    cached_value.value = lax.dynamic_update_slice(cached_value.value, value_SGV, start)
    index.value = cur + new_len
    cache_mask = masks_lib.causal_mask(new_len, max_len, offset=cur)
    return cached_key.value, cached_value.value, masks_lib.combine_masks(mask, cache_mask)


class SelfAttention(MultiHeadAttention):
  """`MultiHeadAttention` of a sequence on itself: called as (inputs, *, mask, ...)."""

  @nn.compact
  def __call__(self, inputs, *, mask=None, bias=None, is_causal: bool = False,
               deterministic: bool = True, dropout_rng=None, sow_weights: bool = False):
    return super().__call__(
        inputs, mask=mask, bias=bias, is_causal=is_causal, deterministic=deterministic,
        dropout_rng=dropout_rng, sow_weights=sow_weights)


def _check_inputs(inputs_q, inputs_k, inputs_v):
  """Module-level input checks, naming the module's own arguments."""
  for name, x, layout in (("inputs_q", inputs_q, "[..., T, D_q]"),
                          ("inputs_k", inputs_k, "[..., S, D_k]"),
                          ("inputs_v", inputs_v, "[..., S, D_v]")):
    _checks.check_array(name, x, 2, layout, floating=False)
  if inputs_k.shape[:-2] != inputs_q.shape[:-2] or inputs_v.shape[:-2] != inputs_q.shape[:-2]:
    raise ValueError(
        "inputs_q, inputs_k and inputs_v must share batch dims [...], got shapes "
        f"{tuple(inputs_q.shape)}, {tuple(inputs_k.shape)} and {tuple(inputs_v.shape)}")
  if inputs_k.shape[-2] != inputs_v.shape[-2]:
    raise ValueError(
        "inputs_k [..., S, D_k] and inputs_v [..., S, D_v] must share the length S, got "
        f"{tuple(inputs_k.shape)} and {tuple(inputs_v.shape)}")


def _as_bool_mask(mask):
  """A boolean mask; numeric masks mean what they mean in flax.linen: nonzero = attend."""
  if mask is None or not hasattr(mask, "dtype") or mask.dtype == jnp.bool_:
    return mask  # None, bool, or not an array: the pure function's checks name the problem
  if not (jnp.issubdtype(mask.dtype, jnp.integer) or jnp.issubdtype(mask.dtype, jnp.floating)):
    raise TypeError(
        "mask must be boolean (True = attend) or integer/float (nonzero = attend, as in "
        f"flax.linen), got dtype {mask.dtype}")
  return mask != 0
