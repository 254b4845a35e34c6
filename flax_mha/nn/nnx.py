"""Flax NNX modules: the same attention as `flax_mha.nn.linen`, as first-class `nnx.Module`s.

`MultiHeadAttention` takes `flax.nnx.MultiHeadAttention`'s constructor arguments (num_heads,
in_features, qkv_features, out_features, num_kv_heads, in_kv_features, dtype, ..., rngs) and,
for the arguments both have, builds the same state tree: `query`/`key`/`value` LinearGeneral
with kernel [D, H, K] (key/value [D_kv, G, K]) and bias [H, K], `out` with kernel [H, V, D_out]
and bias [D_out]; so `nnx.update(ours, nnx.state(theirs, nnx.Param))` loads flax's weights. It
adds what the linen module has and flax's lacks or does differently: K != V (`v_features`,
`in_v_features`), `bias`, `implementation`, decode steps of any length T, its own options
(`attention_options`: soft cap, window, rotary embeddings, sinks), segment ids and positions. With `normalize_qk` it adds
flax's `query_ln`/`key_ln` (`nnx.LayerNorm`, scale [K]), as `flax.nnx.MultiHeadAttention` does.
The checks and the masks they share live in `flax_mha.nn.shared`. Dropout on the weights
is flax_mha's (a hash of the position, never broadcast), so it matches the linen module's for the
same key, not flax's.

`linen_params_to_nnx` and `nnx_to_linen_params` move parameters between this module and
`flax_mha.MultiHeadAttention` (whose tree equals `flax.linen.MultiHeadDotProductAttention`'s).

Every parameter carries the logical axes that `flax_mha.nn.PARAM_AXES` gives its path (read them
with `nnx.get_partition_spec(nnx.state(module))`), the layout that `flax_mha.parallel.sharding.shardings_for`
gives the linen tree with that table. They are metadata only, so creating a
module never needs a mesh (`eager_sharding=False`).
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Mapping
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax import traverse_util

from flax_mha import checks
from flax_mha import precision as precision_lib
from flax_mha.nn import shared
from flax_mha.nn.options import ALIASES, AttentionOptions, Norm, qk_norm
from flax_mha.parallel import sharding
from flax_mha.attention import check_implementation

Initializer = Callable[..., Any]

# The four projections, in the order of flax's state tree.
PROJECTIONS = ("query", "key", "value", "out")
# The LayerNorms of normalize_qk, named as in flax (nnx and linen).
QK_NORMS = ("query_ln", "key_ln")

# flax 0.10 (the floor in pyproject.toml) has no nnx.data, Variable.set_value or RngStream.fork.
_data = getattr(nnx, "data", lambda x: x)


def _set(variable, value) -> None:
  """variable := value, in every supported flax."""
  if hasattr(variable, "set_value"):
    variable.set_value(value)
  else:
    variable.value = value


class MultiHeadAttention(nnx.Module):
  """Multi-head attention with GQA/MQA, K != V, dropout on the weights and a KV cache.

  Args:
    num_heads: query heads H.
    in_features: width D of inputs_q.
    qkv_features: H·K, the query/key width (default in_features).
    out_features: output width (default in_features).
    num_kv_heads: key/value heads G (default H); H must be a multiple of G.
    in_kv_features: width of inputs_k (default in_features).
    v_features: H·V, the value width before `out` (default qkv_features): V may differ from K.
    in_v_features: width of inputs_v (default in_kv_features).
    dtype, param_dtype, precision: as in `flax.nnx.MultiHeadAttention`.
    use_bias, kernel_init, out_kernel_init, bias_init, out_bias_init: likewise.
    out_use_bias: the output projection's bias when it differs from use_bias (Qwen2: biases in
      query, key and value only); None follows use_bias.
    dropout_rate: dropout on the attention weights, in [0, 1).
    deterministic: default of the call argument (needed when dropout_rate > 0); `eval()`,
      `train()` and `nnx.view` set it.
    implementation: None, a name in `flax_mha.IMPLEMENTATIONS` or a callable, passed to
      `flax_mha.dot_product_attention`.
    decode: default of the call argument: KV-cache decoding after `init_cache`.
    normalize_qk: True for LayerNorm over K of the projected queries and keys (scale [K], no
      bias, epsilon 1e-6), `query_ln`/`key_ln` as in flax; or a `flax_mha.Norm` of another
      kind (RMSNorm, Gemma's one-plus; over all heads at once with `across_heads`: OLMo 2),
      under the same names; applied before rotary and the cache.
    attention_options: a `flax_mha.AttentionOptions`, this layer's own options (soft cap, window,
      sink tokens, rotary, learned sinks): see there.
    logit_soft_cap, local_window_size, sink_tokens, rotary_max_wavelength, learned_sinks: the
      older spelling, aliases of the `AttentionOptions` fields of the same names (not together
      with attention_options).
    rngs: `nnx.Rngs` for the parameters; with dropout, its 'dropout' stream (or 'default', as
      in flax) is forked and kept as the call's default, if it has one.
  """

  def __init__(self, num_heads: int, in_features: int, qkv_features: int | None = None,
               out_features: int | None = None, num_kv_heads: int | None = None,
               in_kv_features: int | None = None, *, v_features: int | None = None,
               in_v_features: int | None = None, dtype: Any = None,
               param_dtype: Any = jnp.float32, dropout_rate: float = 0.0,
               deterministic: bool | None = None, precision: Any = None,
               kernel_init: Initializer = nnx.initializers.lecun_normal(),
               out_kernel_init: Initializer | None = None,
               bias_init: Initializer = nnx.initializers.zeros_init(),
               out_bias_init: Initializer | None = None, use_bias: bool = True,
               out_use_bias: bool | None = None,
               implementation: str | Callable | None = None, decode: bool = False,
               normalize_qk: bool | Norm = False, logit_soft_cap: float | None = None,
               local_window_size: int | tuple[int, int] | None = None,
               rotary_max_wavelength: float | None = None, sink_tokens: int = 0,
               learned_sinks: bool = False, attention_options: AttentionOptions | None = None,
               rngs: nnx.Rngs):
    aliases = {name: value for name, value in locals().items() if name in ALIASES}
    self.attention_options = AttentionOptions.resolve(attention_options, **aliases)
    self.num_heads = num_heads
    self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    checks.check_heads(self.num_heads, self.num_kv_heads)
    width = lambda name, value, default: checks.check_int(name, default if value is None else value)
    self.in_features = checks.check_int("in_features", in_features)
    self.in_kv_features = width("in_kv_features", in_kv_features, in_features)
    self.in_v_features = width("in_v_features", in_v_features, self.in_kv_features)
    self.qkv_features = width("qkv_features", qkv_features, in_features)
    self.v_features = width("v_features", v_features, self.qkv_features)
    self.out_features = width("out_features", out_features, in_features)
    for name in ("qkv_features", "v_features"):
      if getattr(self, name) % num_heads:
        raise ValueError(f"{name}={getattr(self, name)} must be divisible by "
                         f"num_heads={num_heads}")
    self.head_dim = self.qkv_features // num_heads  # K, named as flax names it
    self.v_head_dim = self.v_features // num_heads  # V
    checks.check_rate("dropout_rate", dropout_rate)
    shared.check_rotary(self.options.rotary, self.qkv_features, num_heads)
    check_implementation(implementation)
    if not isinstance(rngs, nnx.Rngs):
      raise TypeError(f"rngs must be an nnx.Rngs, got {type(rngs).__name__}")
    self.dtype, self.param_dtype, self.precision = dtype, param_dtype, precision
    self.dropout_rate, self.deterministic = dropout_rate, deterministic
    self.use_bias, self.implementation, self.decode = use_bias, implementation, decode
    self.normalize_qk = normalize_qk

    linear = functools.partial(
        _linear, dtype=dtype, param_dtype=param_dtype, precision=precision,
        use_bias=use_bias, rngs=rngs)
    h, g, k, v = num_heads, self.num_kv_heads, self.head_dim, self.v_head_dim
    self.query = linear("query", self.in_features, (h, k), kernel_init, bias_init)
    self.key = linear("key", self.in_kv_features, (g, k), kernel_init, bias_init)
    self.value = linear("value", self.in_v_features, (g, v), kernel_init, bias_init)
    norm = qk_norm(normalize_qk)
    layer = functools.partial(_qk_norm, norm=norm, dtype=dtype, param_dtype=param_dtype,
                              rngs=rngs)
    self.query_ln = layer(norm.width(h, k), "query_ln") if norm else _data(None)
    self.key_ln = layer(norm.width(g, k), "key_ln") if norm else _data(None)
    self.out_use_bias = use_bias if out_use_bias is None else out_use_bias
    self.out = linear("out", (h, v), self.out_features, out_kernel_init or kernel_init,
                      out_bias_init or bias_init, axis=(-2, -1), use_bias=self.out_use_bias)
    self.sinks = _data(None)
    if self.options.learned_sinks:  # zeros at init, as a linen module's 'sinks' param
      init = _partitioned(nnx.initializers.zeros_init(), "sinks", 1)
      self.sinks = nnx.Param(init(rngs.params(), (h,), param_dtype))
    self.rngs = _dropout_stream(rngs) if dropout_rate > 0 else None
    self.cached_key: nnx.Cache | None = _data(None)
    self.cached_value: nnx.Cache | None = _data(None)
    self.cache_index: nnx.Cache | None = _data(None)

  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, mask=None, bias=None,
               is_causal: bool = False, q_segment_ids=None, kv_segment_ids=None,
               q_positions=None, kv_positions=None, deterministic: bool | None = None,
               rngs=None, sow_weights: bool = False, decode: bool | None = None, cache=None):
    """inputs_q [..., T, in_features], inputs_k [..., S, in_kv_features] (default inputs_q),
    inputs_v [..., S, in_v_features] (default inputs_k).

    mask (bool, True = attend; or numeric, nonzero = attend, as in flax) and bias (added to the
    logits) broadcast to [..., H, T, S], as `flax_mha.MultiHeadAttention`'s: a rank-3 mask is
    [H, T, S], a float mask of values other than 0/1 (torch's additive one: pass it as `bias`)
    and a mask that hides every key from every query (all False/0, as torch's additive mask of
    a batch without padding is) are refused when concrete; unchecked under `jit`, where an
    all-zero mask leaves every query fully masked, output zero (before the output projection's
    bias). `deterministic` and `decode` default to the attributes; `rngs` (an `nnx.Rngs`, an
    `nnx.RngStream` or one key) to the stream kept at construction.
    With `decode`, the T new tokens are appended to the cache and query t sees cached positions
    <= index + t. q_segment_ids [..., T], kv_segment_ids [..., S] and q_positions [..., T],
    kv_positions [..., S] mean what they mean in `flax_mha.MultiHeadAttention` (segment ids
    not with decode; positions only with rotary, defaulting to arange, offset by the cache
    index when decoding). `cache`: a `flax_mha.cache.KVCache` (from `new_cache`), as in
    `flax_mha.MultiHeadAttention`: the call returns (output, updated cache). Returns
    [..., T, out_features]; with `sow_weights`, the weights [..., H, T, S] are sown as
    `nnx.Intermediate` 'attention_weights', as flax does (collect them with
    `nnx.capture(module, nnx.Intermediate)`, or `nnx.pop` before flax 0.12.8).
    """
    decode = self.decode if decode is None else decode
    return shared.forward(
        self, inputs_q, inputs_k, inputs_v, mask=mask, bias=bias, is_causal=is_causal,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, q_positions=q_positions,
        kv_positions=kv_positions, sow_weights=sow_weights, cache=cache, decode=decode,
        dropout_rng=self._dropout_rng(deterministic, rngs))

  @property
  def options(self) -> AttentionOptions:
    """The record this layer runs with (`attention_options`, or built from the aliases)."""
    return self.attention_options

  def new_cache(self, batch_size: int, capacity: int, dtype: Any = jnp.float32):
    """An empty `flax_mha.cache.KVCache` for `cache=`: full with `capacity` slots, or for a
    layer with a window (left, right), rolling with sink_tokens + left slots."""
    return shared.new_cache(
        batch_size, capacity, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
        qkv_features=self.qkv_features, v_features=self.v_features,
        window=self.options.local_window_size, sink_tokens=self.options.sink_tokens,
        dtype=dtype)

  def init_cache(self, input_shape, dtype: Any = jnp.float32) -> None:
    """An empty KV cache for `decode`: input_shape [..., S_max, D] of the whole sequence.

    The cache holds keys [..., S_max, G, K], values [..., S_max, G, V] and the index of the
    next position (the `nnx.Cache` variables cached_key, cached_value, cache_index, as in flax).
    `dtype` must be the dtype the key/value projections compute in (floating: an int8 cache
    is `new_cache(..., dtype=jnp.int8)`, passed as `cache=`).
    """
    shape = tuple(input_shape)
    if len(shape) < 2 or not all(isinstance(d, numbers.Integral) and d >= 0 for d in shape):
      raise ValueError(f"input_shape must be [..., S_max, D] of non-negative ints, got {shape}")
    if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
      raise TypeError(f"dtype must be floating (flax's decode cache holds the keys as the "
                      f"projections compute them), got {jnp.dtype(dtype)}; an int8 KV cache is "
                      "new_cache(batch_size, capacity, dtype=jnp.int8), passed as cache=")
    g = self.num_kv_heads
    self.cached_key = nnx.Cache(jnp.zeros((*shape[:-1], g, self.head_dim), dtype))
    self.cached_value = nnx.Cache(jnp.zeros((*shape[:-1], g, self.v_head_dim), dtype))
    self.cache_index = nnx.Cache(jnp.array(0, jnp.int32))

  def set_view(self, deterministic: bool | None = None, decode: bool | None = None):
    """What `nnx.view(module, deterministic=..., decode=...)` sets."""
    if deterministic is not None:
      self.deterministic = deterministic
    if decode is not None:
      self.decode = decode

  # The steps of `shared.forward` that touch this module's variables (the
  # `shared.FrontEnd` protocol).

  def check_attributes(self, inputs_q, inputs_k, inputs_v) -> None:
    for name, x, want in (("inputs_q", inputs_q, self.in_features),
                          ("inputs_k", inputs_k, self.in_kv_features),
                          ("inputs_v", inputs_v, self.in_v_features)):
      if x.shape[-1] != want:
        raise ValueError(f"{name} must have width {want} (the module's features), got shape "
                         f"{tuple(x.shape)}")

  def project_qkv(self, inputs_q, inputs_k, inputs_v):
    """query [..., T, H, K], key [..., S, G, K], value [..., S, G, V] (query/key normalised)."""
    query_THK, key_SGK = self.query(inputs_q), self.key(inputs_k)
    norm = qk_norm(self.normalize_qk)
    if norm is not None:
      query_THK, key_SGK = norm.apply(self.query_ln, query_THK), norm.apply(self.key_ln, key_SGK)
    return query_THK, key_SGK, self.value(inputs_v)

  def project_out(self, out_THV, in_features: int):
    return self.out(out_THV)

  def sink_logits(self):
    return None if self.sinks is None else self.sinks[...]

  def sow_attention_weights(self, weights):
    self.sow(nnx.Intermediate, "attention_weights", weights)

  def decode_start(self):
    """The position of the next cached token (checked to exist)."""
    if self.cached_key is None:
      raise ValueError("decode=True needs a KV cache: call init_cache(input_shape) first")
    return self.cache_index[...]

  def decode_step(self, query_THK, key_SGK, value_SGV, mask, **options):
    """flax's decode convention: the T new tokens appended to the `nnx.Cache` variables at
    the cache index, attending to what is cached."""
    cur = self.decode_start()
    cache_SGK, cache_SGV = self.cached_key[...], self.cached_value[...]
    *batch, max_len, g, _ = cache_SGK.shape
    new_len = key_SGK.shape[-3]
    for name, new, cache in (("keys", key_SGK, cache_SGK), ("values", value_SGV, cache_SGV)):
      if new.shape != (*batch, new_len, *cache.shape[-2:]) or new_len > max_len:
        raise ValueError(
            f"decode step: {name} must be [..., T <= {max_len}, {g}, {cache.shape[-1]}] with "
            f"batch {tuple(batch)} as in init_cache, got {tuple(new.shape)}")
      if new.dtype != cache.dtype:
        raise TypeError(f"decode step: {name} are {new.dtype} but init_cache made a "
                        f"{cache.dtype} cache: pass init_cache(..., dtype={new.dtype})")
    out_THV, cache_SGK, cache_SGV = shared.flax_decode_step(
        query_THK, key_SGK, value_SGV, cache_SGK, cache_SGV, cur, mask, **options)
    _set(self.cached_key, cache_SGK)
    _set(self.cached_value, cache_SGV)
    _set(self.cache_index, cur + new_len)
    return out_THV

  def _dropout_rng(self, deterministic, rngs):
    """The dropout key for this call, or None when no dropout applies."""
    if self.dropout_rate == 0.0:
      return None
    deterministic = self.deterministic if deterministic is None else deterministic
    if deterministic is None:
      raise ValueError(
          f"dropout_rate={self.dropout_rate} needs `deterministic`: pass it to the constructor "
          "or the call, or set it with eval()/train()/nnx.view; got None for both")
    if deterministic:
      return None
    rngs = self.rngs if rngs is None else rngs
    if rngs is None:
      raise ValueError(
          f"dropout_rate={self.dropout_rate} with deterministic=False needs rngs at the call "
          "(an nnx.Rngs with a 'dropout' stream, an RngStream or a key), got None; the "
          "constructor's rngs had no 'dropout' or 'default' stream to keep")
    if isinstance(rngs, nnx.Rngs):
      return rngs.dropout()
    if isinstance(rngs, nnx.RngStream):
      return rngs()
    if isinstance(rngs, jax.Array):
      return rngs
    raise TypeError(f"rngs must be an nnx.Rngs, an nnx.RngStream or a jax.random.key, got "
                    f"{type(rngs).__name__}")


class SelfAttention(MultiHeadAttention):
  """`MultiHeadAttention` of a sequence on itself: called as (inputs, *, mask, ...).

  `segment_ids` [..., L] and `positions` [..., L] serve both queries and keys (see the parent's
  q_segment_ids and q_positions).
  """

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    if self.in_kv_features != self.in_features or self.in_v_features != self.in_features:
      raise ValueError(
          f"SelfAttention reads one input: in_kv_features={self.in_kv_features} and "
          f"in_v_features={self.in_v_features} must equal in_features={self.in_features}")

  def __call__(self, inputs, *, mask=None, bias=None, is_causal: bool = False,
               segment_ids=None, positions=None, deterministic: bool | None = None, rngs=None,
               sow_weights: bool = False, decode: bool | None = None, cache=None):
    return super().__call__(
        inputs, mask=mask, bias=bias, is_causal=is_causal, q_segment_ids=segment_ids,
        kv_segment_ids=segment_ids, q_positions=positions, deterministic=deterministic,
        rngs=rngs, sow_weights=sow_weights, decode=decode, cache=cache)


def linen_params_to_nnx(params, module: MultiHeadAttention) -> MultiHeadAttention:
  """Load params of `flax_mha.MultiHeadAttention` into `module` in place; return `module`.

  `params` is the linen variables ({'params': {...}}) or their 'params' entry; its tree must be
  the one `nnx_to_linen_params(module)` makes (same names and shapes). Values are cast to the
  module's parameter dtypes. The two arguments are told apart by type (a module, a mapping), so
  `nnx.update`'s order, (module, params), works as well.
  """
  if isinstance(params, MultiHeadAttention) and isinstance(module, Mapping):
    params, module = module, params
  if not isinstance(module, MultiHeadAttention):
    raise TypeError(f"module must be a flax_mha.nn.nnx.MultiHeadAttention, got "
                    f"{type(module).__name__}")
  if isinstance(params, Mapping) and set(params) == {"params"}:
    params = params["params"]
  want = traverse_util.flatten_dict(nnx_to_linen_params(module)["params"], sep="/")
  got = _check_tree(params, want)
  for path, current in want.items():
    variable = module
    for name in path.split("/"):
      variable = getattr(variable, name)
    _set(variable, jnp.asarray(got[path], current.dtype))
  return module


def nnx_to_linen_params(module: MultiHeadAttention) -> dict:
  """{'params': {'query'|'key'|'value'|'out': {'kernel', 'bias'}}} for
  `flax_mha.MultiHeadAttention` built with the same arguments (no 'bias' without use_bias),
  with normalize_qk {'query_ln'|'key_ln': {'scale'}}, with learned sinks 'sinks' [H]."""
  if not isinstance(module, MultiHeadAttention):
    raise TypeError(f"module must be a flax_mha.nn.nnx.MultiHeadAttention, got "
                    f"{type(module).__name__}")
  params = {}
  for name in PROJECTIONS:
    layer = getattr(module, name)
    params[name] = {"kernel": layer.kernel[...]}
    if module.out_use_bias if name == "out" else module.use_bias:
      params[name]["bias"] = layer.bias[...]  # without, flax 0.10 keeps Param(None), later None
  for name in QK_NORMS if module.normalize_qk else ():
    params[name] = {"scale": getattr(module, name).scale[...]}
  if module.sinks is not None:
    params["sinks"] = module.sinks[...]
  return {"params": params}


def _linear(name, in_features, out_features, kernel_init, bias_init, *, axis=-1, **kwargs):
  """An `nnx.LinearGeneral` whose params carry PARAM_AXES' logical axes for `name`."""
  out = (out_features,) if isinstance(out_features, int) else out_features
  ins = (in_features,) if isinstance(in_features, int) else in_features
  return nnx.LinearGeneral(
      in_features, out_features, axis=axis,
      kernel_init=_partitioned(kernel_init, f"{name}/kernel", len(ins) + len(out)),
      bias_init=_partitioned(bias_init, f"{name}/bias", len(out)),
      **precision_lib.layer_keywords(nnx.LinearGeneral), **kwargs)


def _qk_norm(width: int, name: str, *, norm: Norm, **kwargs) -> nnx.Module:
  """The qk-norm over `width`: K (flax's: LayerNorm, scale only, epsilon 1e-6), or all heads'
  (`Norm.across_heads`)."""
  return make_norm(norm, width, partition=_partitioned_as(f"{name}/scale"), **kwargs)


class RMSNorm(nnx.Module):
  """A `Norm` of the RMS kinds over the last axis: param 'scale' [D] (ones at init, zeros for
  Gemma's one-plus kind); float32 inside, `dtype` out (default the input's)."""

  def __init__(self, norm: Norm, num_features: int, *, scale_init, dtype=None,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    self.norm, self.dtype = norm, dtype
    self.scale = nnx.Param(scale_init(rngs.params(), (num_features,), param_dtype))

  def __call__(self, x):
    return shared.rms_norm(x, self.scale[...], self.norm, dtype=self.dtype)


def make_norm(norm: Norm, num_features: int, *, partition=lambda init: init, **kwargs):
  """The NNX layer of `norm`: `nnx.LayerNorm` for kind "layer", else `RMSNorm`; `partition`
  annotates the scale's initialiser (e.g. with logical axes)."""
  scale_init = partition(norm.scale_init)
  if norm.kind == "layer":
    return nnx.LayerNorm(num_features, epsilon=norm.epsilon, use_bias=norm.use_bias,
                         scale_init=scale_init, **kwargs)
  return RMSNorm(norm, num_features, scale_init=scale_init, **kwargs)


def _partitioned_as(path: str):
  """`_partitioned` for a 1-d parameter at `path`, as a function of the initialiser."""
  return lambda init: _partitioned(init, path, 1)


def _partitioned(init: Initializer, path: str, ndim: int) -> Initializer:
  """`init` annotated with the logical axes of `path` in `flax_mha.nn.PARAM_AXES`."""
  # Metadata only: eager sharding would need a mesh (and logical rules) to create a module.
  return nnx.with_partitioning(init, sharding.logical_axes(path, ndim, shared.PARAM_AXES), eager_sharding=False)


def _dropout_stream(rngs: nnx.Rngs):
  """The module's own dropout stream: flax's 'dropout' (falling back to 'default'), forked.

  None when `rngs` has neither: a call with deterministic=False must then bring its own rngs.
  """
  try:
    stream = rngs.dropout
  except AttributeError:
    return None
  return stream.fork() if hasattr(stream, "fork") else rngs  # flax 0.10: share the Rngs


def _check_tree(params, want) -> dict:
  """`params` flattened to {'a/b': leaf}, or an error unless it has exactly the paths and shapes
  of `want` (flattened likewise)."""
  if not isinstance(params, Mapping):
    raise TypeError(f"params must be a dict of linen params, got {type(params).__name__}")
  got = traverse_util.flatten_dict(dict(params), sep="/")
  if got.keys() != want.keys():
    raise ValueError(
        f"params must hold {sorted(want)} for this module, got {sorted(got)} (missing "
        f"{sorted(want.keys() - got.keys())}, unexpected {sorted(got.keys() - want.keys())})")
  for path, current in want.items():
    shape = tuple(np.shape(got[path]))
    if shape != tuple(current.shape):
      where = "".join(f"['{name}']" for name in path.split("/"))
      raise ValueError(f"params{where} must have shape {tuple(current.shape)} for this module, "
                       f"got {shape}")
  return got
