"""Flax linen modules: parameters and projections only; the attention itself is the pure function.

`MultiHeadAttention` keeps the parameter tree of `flax.linen.MultiHeadDotProductAttention`
(`query`/`key`/`value` kernels [D, H, K], `out` kernel [H, V, D_out], and with `normalize_qk`
the scales [K] of `query_ln`/`key_ln`) so checkpoints move both ways.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp

from flax_mha import checks
from flax_mha import precision as precision_lib
from flax_mha.nn import shared
from flax_mha.nn.options import ALIASES, AttentionOptions, Norm, qk_norm

Initializer = Callable[..., Any]
# The projections' products: low-precision operands accumulate in float32 (flax_mha.precision).
_PRODUCTS = precision_lib.layer_keywords(nn.DenseGeneral)


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
    out_use_bias: the output projection's bias, when it differs from use_bias (Qwen2: biases in
      query, key and value only); None follows use_bias.
    dtype: computation dtype (default: inferred from inputs and params).
    param_dtype: parameter dtype.
    precision: precision of the projections.
    kernel_init, out_kernel_init, bias_init: initialisers (out_kernel_init defaults to kernel_init).
    implementation: None, an implementation name or a callable with the internal signature,
      passed through to `flax_mha.dot_product_attention` (which documents and checks it).
    decode: flax's decoding convention, kept for code written against flax: a KV cache in the
      'cache' collection (cached_key, cached_value, cache_index, as flax names them),
      initialised with the full-length input; each later call appends its T tokens and attends
      causally to everything cached. An adapter over the same cache as `cache=` (preferred:
      the cache as data, rolling caches for local layers, rows of different lengths).
    normalize_qk: flax.linen's `normalize_qk` (ViT-22B, arXiv:2302.05442): True for LayerNorm
      over the head dim K of the projected queries and keys (scale [K], no bias, epsilon 1e-6),
      params `query_ln` and `key_ln`; or a `flax_mha.Norm` for another kind (RMSNorm: Qwen3;
      Gemma 3's (1 + scale); over all heads at once with `across_heads`, scales [H·K] and
      [G·K]: OLMo 2), under the same names; applied before rotary and the cache.
    attention_options: a `flax_mha.AttentionOptions`, this layer's own options (soft cap, window,
      sink tokens, rotary, learned sinks): see there.
    logit_soft_cap, local_window_size, sink_tokens, rotary_max_wavelength, learned_sinks: the
      older spelling, aliases of the `AttentionOptions` fields of the same names (not together
      with attention_options).
  """
  num_heads: int
  qkv_features: int | None = None
  out_features: int | None = None
  num_kv_heads: int | None = None
  v_features: int | None = None
  dropout_rate: float = 0.0
  use_bias: bool = True
  out_use_bias: bool | None = None
  dtype: Any = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  kernel_init: Initializer = nn.linear.default_kernel_init
  out_kernel_init: Initializer | None = None
  bias_init: Initializer = nn.initializers.zeros_init()
  implementation: str | Callable | None = None
  decode: bool = False
  normalize_qk: bool | Norm = False
  # Aliases of attention_options' fields (flax_mha.nn.options.ALIASES), for existing code.
  logit_soft_cap: float | None = None
  local_window_size: int | tuple[int, int] | None = None
  rotary_max_wavelength: float | None = None
  sink_tokens: int = 0
  learned_sinks: bool = False
  attention_options: AttentionOptions | None = None

  @nn.compact
  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, mask=None, bias=None,
               is_causal: bool = False, q_segment_ids=None, kv_segment_ids=None,
               q_positions=None, kv_positions=None, deterministic: bool = True,
               dropout_rng=None, sow_weights: bool = False, cache=None):
    """inputs_q [..., T, D_q], inputs_k [..., S, D_k] (default inputs_q), inputs_v [..., S, D_v]
    (default inputs_k; giving inputs_v without inputs_k is an error, as in flax).

    mask broadcasts to [..., H, T, S]: boolean (True = attend) or, as in flax.linen, numeric with
    nonzero = attend (e.g. the float32 masks of `nn.make_causal_mask`, `nn.make_attention_mask`).
    Its dims align from the right, as in jax.nn and flax: a rank-3 mask is [H, T, S], so a
    per-example [B, T, S] mask needs `mask[:, None]` (else B lands on the heads: an error when
    B != H, silently wrong when B == H). A torch-style additive float mask (0 / -inf) is not a
    mask: pass it as `bias`, which is added to the logits and broadcasts to [..., H, T, S] too.
    When its values are concrete, a float mask holding values other than 0 and 1 is refused,
    and so is a mask that hides every key from every query (all False/0, which torch's additive
    mask of a batch without padding is). Under `jit` they are traced and unchecked: nonzero
    = attend, and an all-zero mask leaves every query fully masked, output zero (before the
    output projection's bias) like any fully masked row. torch's boolean masks mean the
    opposite of ours (True = hide): pass `~mask` (docs/tour_modules.md has the table).

    q_segment_ids [..., T], kv_segment_ids [..., S]: ints; a query sees only keys of its own
    segment (packed documents); one alone serves both sides when T == S. Not with `decode`.

    q_positions [..., T], kv_positions [..., S]: integer positions for rotary (they need
    `rotary_max_wavelength`), e.g. restarting per packed document. Defaults: arange(T) for the
    queries, offset by the cache index when decoding; the keys take q_positions when they come
    from inputs_q (inputs_k None or inputs_q itself), else arange(S) (offset likewise).

    cache: a `flax_mha.cache.KVCache` (from `new_cache`) for self-attention of inputs_q
      [B, T, D]: the T tokens, at q_positions [B, T] (default: each row's next positions; a
      negative one is padding), attend causally to the cache and themselves and are written;
      the call then returns (output, updated cache). `is_causal` is implied; no bias or segment
      ids (a mask [B, H|1, T, C] only over a full cache).

    Returns [..., T, out_features] (and the updated cache with `cache=`). With `sow_weights`,
    the weights [..., H, T, S] are sown into 'intermediates' under 'attention_weights'.
    """
    return shared.forward(
        self, inputs_q, inputs_k, inputs_v, mask=mask, bias=bias, is_causal=is_causal,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, q_positions=q_positions,
        kv_positions=kv_positions, sow_weights=sow_weights, cache=cache, decode=self.decode,
        dropout_rng=self._dropout_rng(deterministic, dropout_rng))

  @property
  def options(self) -> AttentionOptions:
    """The record this layer runs with: `attention_options`, or built from the aliases."""
    return AttentionOptions.resolve(self.attention_options,
                                    **{name: getattr(self, name) for name in ALIASES})

  def new_cache(self, batch_size: int, capacity: int, *, in_features: int | None = None,
                dtype=jnp.float32):
    """An empty `flax_mha.cache.KVCache` for `cache=`: full with `capacity` slots, or, for a
    layer with a window (left, right), rolling with sink_tokens + left slots.

    The head dims come from qkv_features and v_features when set, else from the parameters of
    a bound module (`layer.bind(variables).new_cache(B, C)`).
    An unbound linen module with qkv_features None does not know them (linen reads the input
    width D at init, where NNX takes it at construction): pass `in_features` (D) then.
    """
    qkv, v = self._cache_features(in_features)
    g = self.num_heads if self.num_kv_heads is None else self.num_kv_heads
    return shared.new_cache(
        batch_size, capacity, num_heads=self.num_heads, num_kv_heads=g, qkv_features=qkv,
        v_features=v, sink_tokens=self.options.sink_tokens, dtype=dtype,
        window=self.options.local_window_size)

  def _cache_features(self, in_features):
    """(H·K, H·V) for `new_cache`: from the attributes, `in_features`, or the bound params."""
    qkv = self.qkv_features or in_features
    if qkv is not None:
      return qkv, self.v_features or qkv
    params = self.variables.get("params", {}) if self.scope is not None else {}
    if "query" not in params:
      raise ValueError("new_cache needs the head dims, and this module's qkv_features is None "
                       "(they follow from the input width D): pass in_features=D, or call it "
                       "on the module bound to its params, layer.bind(variables).new_cache(...)")
    h = self.num_heads
    return h * params["query"]["kernel"].shape[-1], h * params["value"]["kernel"].shape[-1]

  def _head_dims(self, inputs_q):
    """(H, G, K, V) from the attributes."""
    h = self.num_heads
    g = h if self.num_kv_heads is None else self.num_kv_heads
    qkv = self.qkv_features or inputs_q.shape[-1]
    return h, g, qkv // h, (self.v_features or qkv) // h

  # The steps of `shared.forward` that touch this module's variables (the
  # `shared.FrontEnd` protocol).

  def check_attributes(self, inputs_q, inputs_k, inputs_v):
    """The attributes, checked against the input width (linen reads it at the call)."""
    h = self.num_heads
    checks.check_heads(h, h if self.num_kv_heads is None else self.num_kv_heads)
    qkv = self.qkv_features or inputs_q.shape[-1]
    for name, width in (("qkv_features", qkv), ("v_features", self.v_features or qkv)):
      if width % h:
        raise ValueError(f"{name}={width} must be divisible by num_heads={h}")
    checks.check_rate("dropout_rate", self.dropout_rate)
    shared.check_rotary(self.options.rotary, qkv, h)

  def project_qkv(self, inputs_q, inputs_k, inputs_v):
    """query [..., T, H, K], key [..., S, G, K], value [..., S, G, V] (query/key normalised)."""
    h, g, k_dim, v_dim = self._head_dims(inputs_q)
    dense = functools.partial(
        nn.DenseGeneral, axis=-1, dtype=self.dtype, param_dtype=self.param_dtype,
        kernel_init=self.kernel_init, bias_init=self.bias_init, use_bias=self.use_bias,
        precision=self.precision, **_PRODUCTS)
    query_THK = dense(features=(h, k_dim), name="query")(inputs_q)
    key_SGK = dense(features=(g, k_dim), name="key")(inputs_k)
    value_SGV = dense(features=(g, v_dim), name="value")(inputs_v)
    norm = qk_norm(self.normalize_qk)
    if norm is not None:
      layer = functools.partial(make_norm, norm, dtype=self.dtype, param_dtype=self.param_dtype)
      query_THK = norm.apply(layer(name="query_ln"), query_THK)
      key_SGK = norm.apply(layer(name="key_ln"), key_SGK)
    return query_THK, key_SGK, value_SGV

  def project_out(self, out_THV, in_features: int):
    """The output projection [..., T, H, V] -> [..., T, out_features] (default in_features,
    inputs_q's width D_q)."""
    return nn.DenseGeneral(
        features=self.out_features or in_features, axis=(-2, -1),
        dtype=self.dtype, param_dtype=self.param_dtype,
        kernel_init=self.out_kernel_init or self.kernel_init, bias_init=self.bias_init,
        use_bias=self.use_bias if self.out_use_bias is None else self.out_use_bias,
        precision=self.precision, **_PRODUCTS, name="out")(out_THV)

  def sink_logits(self):
    """The learned sink logits [H] (None without `learned_sinks`)."""
    if not self.options.learned_sinks:
      return None
    return self.param("sinks", nn.initializers.zeros_init(), (self.num_heads,), self.param_dtype)

  def sow_attention_weights(self, weights):
    self.sow("intermediates", "attention_weights", weights)

  def decode_start(self):
    """The cache index once the cache exists, 0 at the init call that sizes it."""
    if self.has_variable("cache", "cached_key"):
      return self.get_variable("cache", "cache_index")
    return 0

  def decode_step(self, query_THK, key_SGK, value_SGV, mask, **options):
    """flax's decode convention: the T new tokens appended to the 'cache' collection at its
    index, attending to what is cached (the output; at the init call, the cache is only made)."""
    initialised = self.has_variable("cache", "cached_key")
    cached_key = self.variable("cache", "cached_key", jnp.zeros, key_SGK.shape, key_SGK.dtype)
    cached_value = self.variable(
        "cache", "cached_value", jnp.zeros, value_SGV.shape, value_SGV.dtype)
    index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
    if not initialised:
      return None
    *batch, max_len, g, k = cached_key.value.shape
    new_len = key_SGK.shape[-3]
    if tuple(key_SGK.shape) != (*batch, new_len, g, k) or new_len > max_len:
      raise ValueError(
          f"decode step: keys must be [..., T<= {max_len}, {g}, {k}] with batch {tuple(batch)} "
          f"as at init, got {tuple(key_SGK.shape)}")
    out_THV, cached_key.value, cached_value.value = shared.flax_decode_step(
        query_THK, key_SGK, value_SGV, cached_key.value, cached_value.value, index.value, mask,
        **options)
    index.value = index.value + new_len
    return out_THV

  def _dropout_rng(self, deterministic: bool, dropout_rng):
    """The rng for dropout on the weights, or None when dropout is off."""
    if self.dropout_rate == 0.0 or deterministic:
      return None
    if dropout_rng is None and not self.has_rng("dropout"):
      raise ValueError(
          f"dropout_rate={self.dropout_rate} with deterministic=False needs a dropout_rng "
          "argument or a 'dropout' rng stream (apply(..., rngs={'dropout': key})), got neither")
    return self.make_rng("dropout") if dropout_rng is None else dropout_rng


class RMSNorm(nn.Module):
  """A `Norm` of the RMS kinds over the last axis: param 'scale' [D] (ones at init, zeros for
  Gemma's one-plus kind); float32 inside, `dtype` out (default the input's)."""
  norm: Norm
  dtype: Any = None
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", self.norm.scale_init, (x.shape[-1],), self.param_dtype)
    return shared.rms_norm(x, scale, self.norm, dtype=self.dtype)


def make_norm(norm: Norm, *, dtype=None, param_dtype=jnp.float32, name=None) -> nn.Module:
  """The linen layer of `norm`: flax's `LayerNorm` for kind "layer", else `RMSNorm`."""
  if norm.kind == "layer":
    return nn.LayerNorm(epsilon=norm.epsilon, use_bias=norm.use_bias, dtype=dtype,
                        param_dtype=param_dtype, name=name)
  return RMSNorm(norm, dtype=dtype, param_dtype=param_dtype, name=name)


class SelfAttention(MultiHeadAttention):
  """`MultiHeadAttention` of a sequence on itself: called as (inputs, *, mask, ...).

  `segment_ids` [..., L] and `positions` [..., L] serve both queries and keys (see the parent's
  q_segment_ids and q_positions).
  """

  @nn.compact
  def __call__(self, inputs, *, mask=None, bias=None, is_causal: bool = False,
               segment_ids=None, positions=None, deterministic: bool = True, dropout_rng=None,
               sow_weights: bool = False, cache=None):
    return super().__call__(
        inputs, mask=mask, bias=bias, is_causal=is_causal, q_segment_ids=segment_ids,
        kv_segment_ids=segment_ids, q_positions=positions, deterministic=deterministic,
        dropout_rng=dropout_rng, sow_weights=sow_weights, cache=cache)
