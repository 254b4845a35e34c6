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

from flax_mha import cache as cache_lib
from flax_mha import checks
from flax_mha.nn import _attend

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
    decode: flax's decoding convention, kept for code written against flax: a KV cache in the
      'cache' collection (cached_key, cached_value, cache_index, as flax names them),
      initialised with the full-length input; each later call appends its T tokens and attends
      causally to everything cached. An adapter over the same cache as `cache=` (preferred:
      the cache as data, rolling caches for local layers, rows of different lengths).
    normalize_qk: flax.linen's `normalize_qk` (ViT-22B, arXiv:2302.05442): LayerNorm over the
      head dim K of the projected queries and keys (scale [K], no bias, epsilon 1e-6), params
      `query_ln` and `key_ln`; applied before rotary and the cache.
    logit_soft_cap: static cap > 0: logits become cap·tanh(logits / cap) (Gemma 2).
    local_window_size: static int w or (left, right) pair of ints >= 0: query at position i sees
      keys at positions i - left .. i + right (an int means (w, w)). Without `decode` it needs
      T == S; with `decode` the positions are absolute cache positions (query t at index + t).
    rotary_max_wavelength: None for no rotary embedding, else the RoPE base (e.g. 10_000.0):
      projected queries and keys are rotated by `flax_mha.apply_rotary` at their positions
      (see `__call__`) before the cache write, so the cache holds rotated keys. Needs an even K.
    sink_tokens: static int >= 0, with a window: the first `sink_tokens` positions stay visible
      to every query (StreamingLLM), and a rolling cache keeps them.
    learned_sinks: a learned sink logit per query head (param 'sinks' [H], zeros at init) that
      joins every row's softmax without a value (gpt-oss).
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
  normalize_qk: bool = False
  logit_soft_cap: float | None = None
  local_window_size: int | tuple[int, int] | None = None
  rotary_max_wavelength: float | None = None
  sink_tokens: int = 0
  learned_sinks: bool = False

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
    A float mask holding values other than 0 and 1 is refused when they are concrete; under
    `jit` they are traced and unchecked (nonzero = attend). torch's boolean masks mean the
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
    # checks the inputs first: _head_dims reads inputs_q.shape
    inputs_k, inputs_v, keys_from_q = _attend.resolve_inputs(inputs_q, inputs_k, inputs_v)
    h, g, k_dim, v_dim = self._head_dims(inputs_q)
    _attend.check_call(decode=self.decode,
                       rotary=self.rotary_max_wavelength is not None or cache is not None,
                      q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                      q_positions=q_positions, kv_positions=kv_positions)
    window = checks.check_window("local_window_size", self.local_window_size)
    if cache is not None:
      _attend.check_cache_call(cache, keys_from_q=keys_from_q, inputs_q=inputs_q,
                               q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                               kv_positions=kv_positions, bias=bias, mask=mask, window=window,
                               sink_tokens=self.sink_tokens)
      if q_positions is None:
        q_positions = cache_lib.next_positions(cache, inputs_q.shape[-2])
    query_THK, key_SGK, value_SGV = self._project(inputs_q, inputs_k, inputs_v, h, g, k_dim, v_dim)
    if self.rotary_max_wavelength is not None:
      query_THK, key_SGK = self._rotate(query_THK, key_SGK, q_positions, kv_positions,
                                        keys_from_q)
    mask = _attend.as_bool_mask(mask)
    options = dict(implementation=self.implementation, dropout_rate=self.dropout_rate,
                   dropout_rng=self._dropout_rng(deterministic, dropout_rng),
                   logit_soft_cap=self.logit_soft_cap, sinks=self._sinks(h))
    if cache is not None:
      out_THV, cache = _attend.attend_cached(query_THK, key_SGK, value_SGV, cache, q_positions,
                                             mask, window=window,
                                             sink_tokens=self.sink_tokens, **options)
    elif self.decode and self.has_variable("cache", "cached_key"):
      out_THV = self._decode_step(query_THK, key_SGK, value_SGV, mask, window, options)
    else:
      if self.decode:  # flax's init call sizes the cache and attends like a decoder: causally
        self._decode_step(query_THK, key_SGK, value_SGV, mask, window, options)
        is_causal = True
      out_THV, weights = _attend.attend(
          query_THK, key_SGK, value_SGV, bias, mask, sow=sow_weights, is_causal=is_causal,
          local_window_size=window, sink_tokens=self.sink_tokens, q_segment_ids=q_segment_ids,
          kv_segment_ids=kv_segment_ids, **options)
      if weights is not None:
        self.sow("intermediates", "attention_weights", weights)
    out_features = self.out_features or inputs_q.shape[-1]
    out = nn.DenseGeneral(
        features=out_features, axis=(-2, -1), dtype=self.dtype, param_dtype=self.param_dtype,
        kernel_init=self.out_kernel_init or self.kernel_init, bias_init=self.bias_init,
        use_bias=self.use_bias, precision=self.precision, name="out")(out_THV)
    return out if cache is None else (out, cache)

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
    return _attend.new_cache(
        batch_size, capacity, num_heads=self.num_heads, num_kv_heads=g, qkv_features=qkv,
        v_features=v, sink_tokens=self.sink_tokens, dtype=dtype,
        window=checks.check_window("local_window_size", self.local_window_size))

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
    """(H, G, K, V) from the attributes, checked."""
    h = self.num_heads
    g = h if self.num_kv_heads is None else self.num_kv_heads
    checks.check_heads(h, g)
    qkv = self.qkv_features or inputs_q.shape[-1]
    v_features = self.v_features or qkv
    for name, width in (("qkv_features", qkv), ("v_features", v_features)):
      if width % h:
        raise ValueError(f"{name}={width} must be divisible by num_heads={h}")
    checks.check_rate("dropout_rate", self.dropout_rate)
    checks.check_positive_real("logit_soft_cap", self.logit_soft_cap, optional=True)
    _attend.check_rotary(self.rotary_max_wavelength, qkv, h)
    return h, g, qkv // h, v_features // h

  def _project(self, inputs_q, inputs_k, inputs_v, h, g, k_dim, v_dim):
    """query [..., T, H, K], key [..., S, G, K], value [..., S, G, V] (query/key normalised)."""
    dense = functools.partial(
        nn.DenseGeneral, axis=-1, dtype=self.dtype, param_dtype=self.param_dtype,
        kernel_init=self.kernel_init, bias_init=self.bias_init, use_bias=self.use_bias,
        precision=self.precision)
    query_THK = dense(features=(h, k_dim), name="query")(inputs_q)
    key_SGK = dense(features=(g, k_dim), name="key")(inputs_k)
    value_SGV = dense(features=(g, v_dim), name="value")(inputs_v)
    if self.normalize_qk:
      # epsilon spelled out: flax's normalize_qk uses LayerNorm's default, 1e-6.
      norm = functools.partial(nn.LayerNorm, epsilon=1e-6, use_bias=False, dtype=self.dtype,
                               param_dtype=self.param_dtype)
      query_THK = norm(name="query_ln")(query_THK)
      key_SGK = norm(name="key_ln")(key_SGK)
    return query_THK, key_SGK, value_SGV

  def _rotate(self, query_THK, key_SGK, q_positions, kv_positions, keys_from_q: bool):
    """Queries and keys rotated at their positions (defaults in `__call__`'s docstring)."""
    start = 0  # not decoding, or the init call that sizes the cache
    if self.decode and self.has_variable("cache", "cached_key"):
      start = self.get_variable("cache", "cache_index")
    return _attend.rotate(query_THK, key_SGK, q_positions, kv_positions,
                         keys_from_q=keys_from_q, start=start,
                         max_wavelength=self.rotary_max_wavelength)

  def _sinks(self, num_heads: int):
    """The learned sink logits [H] (None without `learned_sinks`)."""
    if not self.learned_sinks:
      return None
    return self.param("sinks", nn.initializers.zeros_init(), (num_heads,), self.param_dtype)

  def _decode_step(self, query_THK, key_SGK, value_SGV, mask, window, options):
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
    out_THV, cached_key.value, cached_value.value = _attend.flax_decode_step(
        query_THK, key_SGK, value_SGV, cached_key.value, cached_value.value, index.value, mask,
        window=window, sink_tokens=self.sink_tokens, **options)
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
