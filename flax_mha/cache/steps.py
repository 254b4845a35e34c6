"""A few queries over a KV cache, read where it lies: the step of a contiguous cache
(`flax_mha.cache.attend`) and paged attention over a page pool (`flax_mha.cache.paged`), each with
the kernel that `flax_mha.dispatch` chooses for its `registry.Call` (layout "cache" or
"paged") on each platform, staged with `lax.platform_dependent` where the platforms' choices
differ, as `dot_product_attention` stages its own. Past FEW_QUERIES queries (a prefill) the
dispatch says "dense": the caller hands the keys to `dot_product_attention`.

Each kernel owns its entry for each layout it takes (`registry.Kernel.entries`, read by
`registry.entry`): "xla", dense over the smallest power-of-two prefix of slots that holds every
filled one (a `lax.switch` over static prefixes: the step costs what is filled, not the
capacity; `flax_mha.kernels.xla.cache_entry`); "decode", the decode kernel walking each row's
key blocks (a contiguous cache's slots, or its pages) in place; "triton_decode", the Triton
decode kernel (on 'cuda'), which reads a row's filled blocks or pages in place. `flax_mha.cache.explain`
says which runs for a step, and why.

An int8 cache (`flax_mha.quant`) comes with its scales (`kv_scales`): "decode" and
"triton_decode" dequantize each block they load, "xla" the filled prefix its branch reads,
inside the product's fusion. The step's `registry.Call` records it as keys and values of
dtype int8.

Shapes: B batch, T new tokens, H query heads, G key/value heads, K, V head dims, S slots (a
cache's capacity, or a row's pages times the page size), P pages.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp

from flax_mha import call_options
from flax_mha import checks
from flax_mha import dispatch
from flax_mha.attention import attention_head_major
from flax_mha.kernels import decode
from flax_mha.kernels import registry
from flax_mha.kernels import triton_decode

# While `explain` traces a step on shapes, the step's Calls are recorded here.
_RECORDED = contextvars.ContextVar("flax_mha_steps_recorded", default=None)


def _call(query_BTHK, keys_BSGK, values_BSGV, mask, mods, dropout_rate, layout, page=None):
  call = registry.Call.of(query_BTHK, keys_BSGK, values_BSGV, None, mask, is_causal=True,
                          dropout_rate=dropout_rate, mods=mods, platform="cpu", layout=layout,
                          page=page)
  recorded = _RECORDED.get()
  if recorded is not None:
    recorded.append(call)
  return call


@contextlib.contextmanager
def recording():
  """A context in which every step's `registry.Call` traced is appended to the list it gives
  (`flax_mha.cache.explain` traces a step on shapes and reads what it would run)."""
  recorded = []
  token = _RECORDED.set(recorded)
  try:
    yield recorded
  finally:
    _RECORDED.reset(token)


def _api(x_BGSK):
  return jax.ShapeDtypeStruct((x_BGSK.shape[0], x_BGSK.shape[2], x_BGSK.shape[1],
                               x_BGSK.shape[3]), x_BGSK.dtype)


def _run(call, kernel, picks, entry_args, operands, layout):
  """The chosen entry for `call` (by name: `kernel` asked for, refused by name when it cannot
  take the call), staged per platform where the platforms' choices (`picks`) differ."""
  if kernel is not None:  # its platform is checked where it is traced and lowered
    triton_decode.require(kernel, triton_decode.options_reason(call))
    return registry.entry(kernel.name, layout)(*operands, kernel=kernel, **entry_args)
  entry = lambda name: functools.partial(registry.entry(name, layout),
                                         kernel=triton_decode.KERNEL, **entry_args)
  return dispatch.staged(picks, entry, *operands)


def cache_step(query_BTHK, keys_BGSK, values_BGSV, kv_pos_BS, q_positions_BT, *, prefixes,
               kernel=None, forced: str | None = None, kv_scales=None, **options):
  """A few queries over a contiguous cache's slots (keys head-major, with a rolling cache's
  chunk after its slots and `prefixes` False), with the kernel `dispatch` chooses for the
  step, `kernel` (a `triton_decode.DecodeKernel`) when asked for by name, or the kernel named
  `forced` ("decode", whatever the number of queries): [B, T, H, V]; None when the choice is
  "dense" or `forced` refuses the call (the caller hands the keys to dot_product_attention).
  `kv_scales`: (key scales, value scales) [B, G, S] of int8 keys and values, else None."""
  mask = options.pop("mask", None)
  k_dim = query_BTHK.shape[-1]
  mods, call = _step_call(query_BTHK, keys_BGSK, values_BGSV, kv_pos_BS, q_positions_BT, mask,
                          options)
  entry_args = dict(q_positions=q_positions_BT, mask=mask, options=options, prefixes=prefixes,
                    mods=mods, scale=checks.checked_scale(options.get("scale"), k_dim),
                    kv_scales=kv_scales, head_major_attention=attention_head_major)
  operands = (query_BTHK, keys_BGSK, values_BGSV, kv_pos_BS)
  if forced is not None:
    if registry.get(forced).refuses(call) is not None:
      return None
    return registry.entry(forced, "cache")(*operands, kernel=None, **entry_args)
  picks = None if kernel is not None else dispatch.per_platform(call)  # once per platform
  if picks is not None and picks["cpu"] == "dense":
    return None
  return _run(call, kernel, picks, entry_args, operands, "cache")


def _step_call(query_BTHK, keys_BGSK, values_BGSV, kv_pos_BS, q_positions_BT, mask, options):
  """(mods over the whole cache, the step's `registry.Call`)."""
  b, t, h, _ = query_BTHK.shape
  opts = {k: v for k, v in options.items() if k not in ("scale", "dropout_rate", "dropout_rng")}
  mods, _ = call_options.build((b,), t, kv_pos_BS.shape[1], h, query_BTHK.dtype, True,
                               q_positions=q_positions_BT, kv_positions=kv_pos_BS, **opts)
  call = _call(query_BTHK, _api(keys_BGSK), _api(values_BGSV), mask, mods,
               options.get("dropout_rate", 0.0), "cache")
  return mods, call


def paged_step(query, k_pages, v_pages, page_indices, q_positions, kv_lengths, *,
               is_causal: bool, scale, kernel=None, forced: str | None = None,
               dropout_rate: float = 0.0, return_residual: bool = False, kv_scales=None,
               **options):
  """A few queries over each row's pages read in place, with the kernel `dispatch` chooses,
  `kernel` (a `triton_decode.DecodeKernel`) or the kernel named `forced` ("decode", whatever
  the number of queries); None when the choice is "dense" or `forced` refuses the call (the
  caller gathers the pages). [B, T, H, V] (and the lse [B, T, H] with `return_residual`).
  `kv_scales`: (k_scales, v_scales) [P, page, G] of int8 pools, else None."""
  mods, call, cfg, cfg_bwd = _paged_call(query, k_pages, v_pages, page_indices, q_positions,
                                         kv_lengths, is_causal, scale, dropout_rate, options)
  entry_args = dict(mods=mods, cfg=cfg, cfg_bwd=cfg_bwd, kv_scales=kv_scales)
  operands = (query, k_pages, v_pages, page_indices, kv_lengths)
  if forced is not None:
    if registry.get(forced).refuses(call) is not None:
      return None
    out, lse_BHT = registry.entry(forced, "paged")(*operands, **entry_args)
  else:
    picks = None if kernel is not None else dispatch.per_platform(call)  # once per platform
    if picks is not None and picks["cpu"] == "dense":
      return None
    out, lse_BHT = _run(call, kernel, picks, entry_args, operands, "paged")
  lse_BTH = jax.lax.stop_gradient(lse_BHT.transpose(0, 2, 1))
  return (out, lse_BTH) if return_residual else out


def _paged_call(query, k_pages, v_pages, page_indices, q_positions, kv_lengths, is_causal,
                scale, dropout_rate, options):
  """(mods, the paged `registry.Call`, the decode kernel's configs)."""
  (b, t, h, k_dim), (n, page) = query.shape, (page_indices.shape[1], k_pages.shape[1])
  s = n * page
  slot = jnp.arange(s, dtype=jnp.int32)
  kv_positions = jnp.where(slot < kv_lengths[:, None], slot, -1)
  opts = {k: v for k, v in options.items() if k != "dropout_rng"}
  mods, _ = call_options.build((b,), t, s, h, query.dtype, is_causal, q_positions=q_positions,
                               kv_positions=kv_positions, **opts)
  scale = checks.checked_scale(scale, k_dim)
  cfg, cfg_bwd = decode.configs(scale, 0.0, t, s, k_dim, block_k=decode.paged_block(page, n))
  spec = lambda pages: jax.ShapeDtypeStruct((b, s, *pages.shape[2:]), pages.dtype)
  call = _call(query, spec(k_pages), spec(v_pages), None, mods, dropout_rate, "paged", page)
  return mods, call, cfg, cfg_bwd
