"""Public attention functions: one interface, several implementations.

Layout follows `jax.nn` and flax: query [..., T, H, K], key [..., S, G, K], value [..., S, G, V],
output [..., T, H, V], with any number of leading batch dims (none included). Masks and biases
broadcast to [..., H, T, S]. Everything here is a pure function (no flax import); shapes, dtypes,
`is_causal`, `scale`, `dropout_rate` and `implementation` are static under `jit`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
from jax import lax

from flax_mha import call_options
from flax_mha import checks
from flax_mha import dispatch
from flax_mha import kernels  # importing the package registers every implementation
from flax_mha.parallel import seq_parallel  # registers "ring", after the package's kernels
from flax_mha.kernels import common
from flax_mha.kernels import confine
from flax_mha.kernels import reference
from flax_mha.kernels import registry
from flax_mha.kernels import xla

# name -> the registered implementation's function: a live read-only view of
# `flax_mha.kernels.registry` (a kernel registered later is listed at once).
IMPLEMENTATIONS: Mapping[str, Callable] = registry.FUNCTIONS
del kernels, seq_parallel


def default_implementation(query, key, value, bias, mask, *, is_causal: bool,
                           dropout_rate: float, mods=None, platform: str | None = None) -> str:
  """What `implementation=None` runs for flattened inputs (query [B, T, H, K], key [B, S, G, K],
  value [B, S, G, V]; arrays or shapes) on `platform` (None: the default backend's), decided at
  trace time from static facts by the rule in `flax_mha.dispatch` (`flax_mha.explain` says
  which and why). Every choice computes the same function (`flax_mha.kernels.reference`)."""
  return dispatch.choose(registry.Call.of(
      query, key, value, bias, mask, is_causal=is_causal, dropout_rate=dropout_rate, mods=mods,
      platform=dispatch.check_platform(platform))).name


def dot_product_attention(query, key, value, bias=None, mask=None, *, is_causal: bool = False,
                          scale: float | None = None, local_window_size=None,
                          query_seq_lengths=None, key_value_seq_lengths=None,
                          q_segment_ids=None, kv_segment_ids=None, q_positions=None,
                          kv_positions=None, logit_soft_cap: float | None = None,
                          mask_mod=None, score_mod=None, sinks=None, sink_tokens: int = 0,
                          dropout_rate: float = 0.0, dropout_rng=None,
                          return_residual: bool = False,
                          implementation: str | Callable | None = None):
  """Scaled dot-product attention `softmax(score_mods(Q·Kᵀ·scale + bias), masked)·V`.

  Args:
    query: [..., T, H, K] floating.
    key: [..., S, G, K], same dtype; H must be a multiple of G (GQA/MQA: query head h reads
      key/value head h // (H // G); K/V are never materialised H times).
    value: [..., S, G, V]; V may differ from K.
    bias: optional additive bias, floating, broadcastable to [..., H, T, S]. A logit at -inf
      hides its key, exactly like a False in `mask`, whatever `logit_soft_cap` or `score_mod`
      would make of it (a soft cap never turns -inf into -cap).
    mask: optional boolean mask, True = attend, broadcastable to [..., H, T, S]. Numeric masks
      are refused rather than guessed at: flax's float 1/0 masks (`flax.linen.make_causal_mask`)
      mean `mask.astype(bool)`; torch-style additive float masks (0 / -inf) belong in `bias`.
      Dims align from the right (as in jax.nn and flax): a rank-3 mask is [H, T, S], so a
      per-example [B, T, S] mask needs `mask[:, None]` (B == H would otherwise pass unnoticed).
    is_causal: static; query i sees keys j <= i (top-left aligned when T != S).
    scale: static finite multiplier of the logits; default 1/sqrt(K).
    local_window_size: static int w or (left, right): query i sees keys i - left .. i + right
      (jax.nn's meaning; an int is (w, w)); needs T == S. A side wider than the sequence is no
      limit on that side.
    query_seq_lengths, key_value_seq_lengths: int [...] (the batch dims): queries at or beyond
      their length see nothing (output 0), keys beyond theirs are hidden (jax.nn's meaning;
      jax.nn gives padded query rows the mean of V instead of 0). Never materialised as [T, S].
    q_segment_ids, kv_segment_ids: int [..., T] and [..., S]: a query sees only keys of its own
      segment (packed documents); one alone serves both sides when T == S. Linear memory.
    q_positions, kv_positions: int [..., T] and [..., S], given together: absolute token
      positions. `is_causal` and `local_window_size` then compare positions instead of indices
      (kv_pos <= q_pos; q_pos - left <= kv_pos <= q_pos + right; T and S may differ), and a
      negative position is padding or an empty cache slot, seen by and seeing nothing: the
      layout of a KV cache (`flax_mha.cache`), in any order, rolling or paged.
    logit_soft_cap: static float cap > 0: scores become cap·tanh(scores / cap) before masking
      (Gemma 2), after `bias` and `score_mod`.
    mask_mod: `fn(b, h, q_idx, kv_idx) -> bool`, True = visible, ANDed with everything above
      (FlexAttention's `mask_mod`): traced once on int32 scalars (b the flattened batch, h the
      query head, positions top-left aligned) and applied elementwise, so it must return a
      scalar there; a function that ignores its indices and returns a dense [T, S] array is
      refused (pass the array as `mask`). It may close over arrays, traced ones included
      (ids computed inside a scanned or rematerialised layer).
    score_mod: `fn(score, b, h, q_idx, kv_idx) -> score`, elementwise (traced on scalars like
      `mask_mod`), applied to `scale·Q·Kᵀ + bias` before the soft cap and masking
      (FlexAttention's `score_mod`); returning -inf hides the key. Floating arrays it closes
      over get gradients (e.g. a learned relative-position table).
      Chunked implementations skip key/query tiles that the masks above hide entirely, and
      evaluate no mask on tiles they leave entirely visible (see `flax_mha.mods`).
    sinks: optional floating [H], one learned logit per query head that joins every row's
      softmax without a value (attention sinks, as in gpt-oss and JAX's splash attention):
      it takes weight from the keys; no score term or mask touches it. Differentiable.
    sink_tokens: static int >= 0, with `local_window_size`: the first `sink_tokens` positions
      stay visible to every query beyond the window (StreamingLLM's attention sinks, which a
      rolling KV cache keeps).
    dropout_rate: static rate of dropout on the attention weights, in [0, 1).
    dropout_rng: one `jax.random.key` (or raw uint32 key), required when dropout_rate > 0. The
      keep-mask is a pure function of (rng, batch·head, t, s), so every implementation drops the
      same weights.
    return_residual: static; also return the softmax statistics: (out, lse) with lse
      [..., T, H] the log-sum-exp of each row's visible scores (and sink), as jax.nn's
      `return_residual`, in float32 (float64 for float64 inputs) rather than the input dtype.
      A row that sees nothing has lse finfo(lse.dtype).min (its sink, with sinks): finite, so
      partial results merge by `out = Σ exp(lse_i - logaddexp(lse...)) · out_i` with no
      special case. The lse carries no gradient (as jax.nn's).
    implementation: None (the best available for the platform the program is lowered for,
      chosen at trace time by the rule in `flax_mha.dispatch`; `flax_mha.explain` says which
      and why), a name in `IMPLEMENTATIONS` (the registered kernels,
      `flax_mha.kernels.registry`; "ring" runs over the context mesh's 'seq' axis), or a
      callable with their signature (e.g. `flax_mha.sequence_parallel_implementation(...)`:
      other sequence-parallel strategies and layouts). Every implementation computes the same
      function; one that cannot take a call refuses it by name (`explain` lists the reasons).
      Forward-mode autodiff (`jax.jvp`, `jax.jacfwd`) works with "reference" and "xla" only
      (the others have custom VJPs): ask for "xla" explicitly for forward mode.

  Returns:
    [..., T, H, V] in the input dtype. Products and softmax run in float32 for 16-bit inputs, in
    the input dtype otherwise. A query row with no visible key (all masked, or every logit -inf)
    gets output 0 and finite gradients, never NaN. Empty inputs (T, S or V = 0) give zeros.
  """
  arguments = dict(locals())  # the options by name, as call_options.OPTIONS lists them
  options = {name: arguments[name] for name in call_options.OPTIONS}
  q, k, v, bias4, mask4, scale, mods, is_causal = _prepare(
      query, key, value, bias, mask, is_causal, scale, dropout_rate, dropout_rng, options)
  if not isinstance(return_residual, bool):
    raise TypeError(f"return_residual must be a Python bool, got {type(return_residual).__name__}")
  out_shape = (*query.shape[:-1], value.shape[-1])
  if 0 in (q.shape[0], q.shape[1], k.shape[1], v.shape[-1]):
    return _empty(query, out_shape, mods, return_residual)
  fn = _resolve(implementation, q, k, v, bias4, mask4, is_causal, dropout_rate, mods)
  extra = {}  # plain callables need neither
  if mods.masks or mods.scores or mods.sinks is not None:
    extra["mods"] = mods
  if return_residual:
    extra["return_residual"] = True
  result = fn(q, k, v, bias4, mask4, is_causal=is_causal, scale=scale,
              dropout_rate=float(dropout_rate), dropout_rng=dropout_rng, **extra)
  if not return_residual:
    return result.reshape(out_shape)
  out_BTHV, lse_BTH = result
  return out_BTHV.reshape(out_shape), lax.stop_gradient(lse_BTH).reshape(query.shape[:-1])


def explain(query, key, value, bias=None, mask=None, *, is_causal: bool = False,
            scale: float | None = None, dropout_rate: float = 0.0, dropout_rng=None,
            platform: str | None = None, **options) -> dispatch.Explanation:
  """Which implementation `dot_product_attention(..., implementation=None)` runs for these
  arguments on `platform`, why, and what every other implementation says about them.

  Takes `dot_product_attention`'s arguments (arrays, or `jax.ShapeDtypeStruct` for shapes
  only; `options` as there: local_window_size, segment ids, mask_mod, ...), checked the same
  way, and `platform`: 'cpu', 'cuda', 'rocm' or 'tpu', the one the program is lowered for
  (None: the default backend's). Nothing is computed.

  Returns:
    a `flax_mha.dispatch.Explanation`: `.implementation` (the name None runs), `.reason`,
    `.platform`, `.alternatives` (every other name, ring included -> "runs" or
    "refuses: <why>") and, with a 'seq' mesh axis in context, `.sequence_parallel`: what
    `sequence_parallel_implementation("auto")` runs and why (None otherwise); `str()` of it
    reads as a short report.
  """
  platform = dispatch.check_platform(platform)
  if dropout_rng is None and isinstance(dropout_rate, float) and dropout_rate > 0.0:
    dropout_rng = jax.random.key(0)  # a stand-in: no choice reads the key
  given = dict(query=query, key=key, value=value, bias=bias, mask=mask, **options)
  arrays = {name: x for name, x in given.items() if hasattr(x, "shape") and hasattr(x, "dtype")}
  found = []

  def decide(arrays):  # traced on shapes: options made of arrays need no values
    args = {**given, **arrays}
    q, k, v, bias4, mask4, _, mods, causal = _prepare(
        *(args.pop(name) for name in ("query", "key", "value", "bias", "mask")), is_causal,
        scale, dropout_rate, dropout_rng, args)
    found.append(dispatch.explanation(registry.Call.of(
        q, k, v, bias4, mask4, is_causal=causal, dropout_rate=float(dropout_rate), mods=mods,
        platform=platform)))

  jax.eval_shape(decide, arrays)
  return found[0]


def _empty(query, out_shape, mods, return_residual):
  """The result of a call with T, S or V = 0 (or no batch): zeros, and the lse of rows that
  see no key (their sink, if any)."""
  out = jnp.zeros(out_shape, query.dtype)
  if not return_residual:
    return out
  dtype = common.softmax_dtype(query.dtype)
  no_key = jnp.finfo(dtype).min if mods.sinks is None else mods.sinks.astype(dtype)
  return out, jnp.broadcast_to(no_key, query.shape[:-1])


def dot_product_attention_weights(query, key, bias=None, mask=None, *, is_causal: bool = False,
                                  scale: float | None = None, dropout_rate: float = 0.0,
                                  dropout_rng=None, **options):
  """Attention weights [..., H, T, S] (softmax dtype), as used by `dot_product_attention`.

  Same arguments and conventions as `dot_product_attention` (`options`: local_window_size,
  the sequence lengths, segment ids, logit_soft_cap, mask_mod, score_mod), without `value` and
  `implementation`; computed by the
  oracle (`flax_mha.kernels.reference`). Rows with no visible key are all zero. Materialises the
  [..., H, T, S] matrix: for plots and small inputs.
  """
  value = key[..., :0]  # shape-only stand-in so the shared checks apply
  q, k, _, bias4, mask4, scale, mods, is_causal = _prepare(
      query, key, value, bias, mask, is_causal, scale, dropout_rate, dropout_rng, options)
  *batch, t, h, _ = query.shape
  if 0 in (q.shape[0], t, k.shape[1]):
    return jnp.zeros((*batch, h, t, k.shape[1]), common.softmax_dtype(query.dtype))
  weights_BHTS = reference.attention_weights(
      q, k, bias4, mask4, is_causal=is_causal, scale=scale,
      dropout_rate=float(dropout_rate), dropout_rng=dropout_rng, mods=mods)
  return weights_BHTS.reshape(*batch, *weights_BHTS.shape[1:])


def split_heads(x, num_heads: int):
  """[..., T, H·K] -> [..., T, H, K]."""
  checks.check_array("x", x, 2, "[..., T, H*K]", floating=False)
  checks.check_int("num_heads", num_heads)
  if x.shape[-1] % num_heads:
    raise ValueError(
        f"x's last dim ({x.shape[-1]}) must be divisible by num_heads={num_heads}")
  return x.reshape(*x.shape[:-1], num_heads, x.shape[-1] // num_heads)


def merge_heads(x):
  """[..., T, H, K] -> [..., T, H·K]."""
  checks.check_array("x", x, 3, "[..., T, H, K]", floating=False)
  return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


def _resolve(implementation, q, k, v, bias, mask, is_causal, dropout_rate, mods,
             wrap=None) -> Callable:
  """The implementation function that `implementation` names (or is); for None, the choice for
  each platform, staged by `lax.platform_dependent` where they differ. `wrap(name, fn)`, when
  given, is applied to each function that may run (name None for a callable)."""
  check_implementation(implementation)
  wrap = wrap or _as_is
  if callable(implementation):
    return wrap(None, implementation)
  if implementation is not None:
    return wrap(implementation, IMPLEMENTATIONS[implementation])
  call = registry.Call.of(q, k, v, bias, mask, is_causal=is_causal, dropout_rate=dropout_rate,
                          mods=mods, platform="cpu")
  picks = {platform: dispatch.choose(dataclasses.replace(call, platform=platform)).name
           for platform in dispatch.PLATFORMS}
  if len(set(picks.values())) == 1:
    return wrap(picks["cpu"], IMPLEMENTATIONS[picks["cpu"]])
  return functools.partial(_per_platform, picks, wrap)


def _as_is(name, fn):
  del name
  return fn


def _per_platform(picks: dict, wrap, query, key, value, bias, mask, *, dropout_rng, mods=None,
                  **static):
  """The implementation picks[platform] (through `wrap`) for the platform the program is
  lowered for (`dispatch.staged`: one branch survives each lowering)."""
  def branch(name):
    def run(query, key, value, bias, mask, dropout_rng, mods):
      extra = {} if mods is None else dict(mods=mods)
      return wrap(name, IMPLEMENTATIONS[name])(query, key, value, bias, mask,
                                               dropout_rng=dropout_rng, **static, **extra)
    return run
  return dispatch.staged(picks, branch, query, key, value, bias, mask, dropout_rng, mods)


def confine_nonfinite(implementation: str | Callable | None = None) -> Callable:
  """`implementation` (None, a name in IMPLEMENTATIONS, or a callable) as an implementation
  callable for `dot_product_attention(implementation=...)` and the modules, that keeps a
  non-finite query, key or value in the rows that read it.

  By default a NaN or inf in one key's key or value vector reaches rows that give that key no
  weight (a hidden key's 0 · NaN = NaN, forward and backward), so one bad entry of one packed
  document makes every document of its row NaN. Through this callable a row's output (and lse)
  is NaN exactly when its own query holds a non-finite entry or it gives a bad key weight > 0
  (with cuDNN: when its mask, bias and causality leave a bad key visible); every other row, and
  every gradient a loss on those rows takes, is the one computed as if the bad entries were 0.
  None resolves per platform at trace time exactly as in `dot_product_attention`. A callable
  receives one more value column (V + 1: each key's badness). The cost (two isfinite passes,
  one more value column, the marking) is measured by `python -m experiments.bench.confine`
  (docs/benchmark_cpu_confine.md). Works under jit, grad, vmap, scan and checkpoint.
  """
  check_implementation(implementation)

  def attention(q, k, v, bias, mask, *, is_causal, dropout_rate, mods=None, **options):
    fn = _resolve(implementation, q, k, v, bias, mask, is_causal, dropout_rate, mods,
                  wrap=confine.for_kernel)
    extra = {} if mods is None else dict(mods=mods)
    return fn(q, k, v, bias, mask, is_causal=is_causal, dropout_rate=dropout_rate, **extra,
              **options)

  attention.__name__ = f"confine_nonfinite_{getattr(implementation, '__name__', implementation)}"
  return attention


def check_implementation(implementation) -> None:
  """None, a callable, or a name in IMPLEMENTATIONS; the error says how to ask for the other
  sequence-parallel strategies."""
  if implementation is None or callable(implementation):
    return
  if not isinstance(implementation, str) or implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"implementation must be None, a callable or one of {sorted(IMPLEMENTATIONS)}, got "
        f"{implementation!r} (sequence-parallel strategies other than 'ring', over a device "
        "mesh: the callable flax_mha.sequence_parallel_implementation(strategy, layout))")


def _prepare(query, key, value, bias, mask, is_causal, scale, dropout_rate, dropout_rng, options):
  """Check everything, then flatten the batch dims: ([B,T,H,K], [B,S,G,K], [B,S,G,V], bias,
  mask, scale, mods, is_causal for the implementation)."""
  bias4, mask4, scale, mods, is_causal = _checked(
      query, key, value, bias, mask, is_causal, scale, dropout_rate, dropout_rng, options)
  batch = query.shape[:-3]
  # jnp arrays: a NumPy input would stay NumPy through the reshape, and a kernel's custom VJP
  # (eager grad) would index it with traced block numbers.
  flat = lambda x: jnp.asarray(x).reshape(math.prod(batch), *x.shape[len(batch):])
  return flat(query), flat(key), flat(value), bias4, mask4, scale, mods, is_causal


def _checked(query, key, value, bias, mask, is_causal, scale, dropout_rate, dropout_rng, options):
  """The checks of every argument (key and value may be shapes only: jax.ShapeDtypeStruct) and
  what they make: (bias, mask of rank 4 over the flattened batch, scale, mods, is_causal for
  the implementation)."""
  checks.check_qkv(query, key, value)
  checks.check_is_causal(is_causal)
  *batch, t, h, k = query.shape
  scale = checks.checked_scale(scale, k)
  checks.check_dropout(dropout_rate, dropout_rng)
  s = key.shape[-3]
  target = (*batch, h, t, s)
  if bias is not None:
    checks.check_broadcast("bias", bias, target, boolean=False)
  if mask is not None:
    checks.check_broadcast("mask", mask, target, boolean=True)
  call_options.check_names(options)
  mods, is_causal = call_options.build(tuple(batch), t, s, h, query.dtype, is_causal, **options)
  return _flatten_batch(bias, batch), _flatten_batch(mask, batch), scale, mods, is_causal


def attention_head_major(query_BTHK, key_BGSK, value_BGSV, mask=None, *, is_causal: bool = False,
                         scale: float | None = None, dropout_rate: float = 0.0,
                         dropout_rng=None, **options):
  """`dot_product_attention` by the xla kernel over head-major keys and values ([B, G, S, K],
  [B, G, S, V]: a KV cache's layout, `flax_mha.cache`): a dense product each head reads
  contiguously, for a few queries over a cache. Same checks and options (no bias)."""
  api = lambda x: jax.ShapeDtypeStruct((x.shape[0], x.shape[2], x.shape[1], x.shape[3]), x.dtype)
  _, mask4, scale, mods, is_causal = _checked(query_BTHK, api(key_BGSK), api(value_BGSV), None,
                                              mask, is_causal, scale, dropout_rate, dropout_rng,
                                              options)
  extra = dict(mods=mods) if mods.masks or mods.scores or mods.sinks is not None else {}
  return xla.attention(query_BTHK, key_BGSK, value_BGSV, None, mask4, is_causal=is_causal,
                       scale=scale, dropout_rate=float(dropout_rate), dropout_rng=dropout_rng,
                       kv_layout="BGSK", **extra)


def _flatten_batch(x, batch):
  """Rank-4 [B or 1, H or 1, T or 1, S or 1] view of a mask/bias broadcasting to [*batch, H, T, S]."""
  if x is None:
    return None
  x = jnp.asarray(x)
  x = x.reshape((1,) * (len(batch) + 3 - x.ndim) + x.shape)  # pad to rank len(batch) + 3
  lead, tail = x.shape[:len(batch)], x.shape[len(batch):]
  if all(d == 1 for d in lead):
    return x.reshape(1, *tail)
  return jnp.broadcast_to(x, (*batch, *tail)).reshape(math.prod(batch), *tail)

