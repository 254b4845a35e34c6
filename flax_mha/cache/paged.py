"""Attention over a paged KV cache: one pool of fixed-size pages shared by every sequence.

  out = paged_attention(query [B, T, H, K], k_pages [P, page, G, K], v_pages [P, page, G, V],
                        lengths [B], page_indices [B, n])

Row b's cache is its pages page_indices[b, 0 .. n-1] in order (position p in page
page_indices[b, p // page], slot p % page), holding lengths[b] tokens; its T queries are the
last T of them, at positions lengths[b] - T .. lengths[b] - 1, causal by default (the names of
JAX's TPU `paged_attention`, the layout of `dot_product_attention`: pages replace S). A batch of
sequences of very different lengths then holds memory for the tokens it has, rounded up to
pages, not B x the longest. For a few queries (`flax_mha.dispatch.FEW_QUERIES`) the kernel
that `flax_mha.dispatch` chooses walks each row's pages in place (`flax_mha.cache.steps`: the decode
kernel, on 'cuda' the Triton decode kernel; `flax_mha.cache.explain` says which); beyond, and
for the other implementations, the rows' pages are gathered into a contiguous cache. Equal to
`dot_product_attention` over that contiguous cache.

Int8 pools (`flax_mha.quant`, what `flax_mha.cache.PagedKVCache.create(..., dtype=jnp.int8)`
holds) come with their scales, `kv_scales=(k_scales [P, page, G], v_scales [P, page, G])`:
the step kernels dequantize each page they read; the gathered path dequantizes the rows' pages
it gathers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from flax_mha import checks
from flax_mha import dispatch
from flax_mha import quant
from flax_mha.cache import steps
from flax_mha.attention import dot_product_attention
from flax_mha.kernels import triton_decode

def paged_attention(query, k_pages, v_pages, lengths, page_indices, *, is_causal: bool = True,
                    scale: float | None = None, local_window_size=None,
                    logit_soft_cap: float | None = None, sinks=None, sink_tokens: int = 0,
                    return_residual: bool = False, implementation=None, kv_scales=None):
  """Attention of each row's last T tokens over its paged cache (see the module docstring).

  Args:
    query: [B, T, H, K] floating; k_pages [P, page, G, K], v_pages [P, page, G, V], same dtype,
      or int8 with `kv_scales` (k_scales [P, page, G], v_scales [P, page, G] floating).
    lengths: int [B], tokens held per row (T <= length <= n·page).
    page_indices: int [B, n], the pages of each row in order, each in [0, P). Slots past a
      row's length are hidden and their values zeroed, whatever a reused page holds there.
      Concrete lengths and page indices (an eager call) are checked and a bad one is refused by
      name; under `jit` they are traced and unchecked: an index outside [0, P) silently reads
      another page (wrapped or clamped, as jnp indexing does), and a length outside
      [T, n·page] gives numbers with no meaning.
    is_causal, scale, local_window_size, logit_soft_cap, sinks, sink_tokens, return_residual:
      as in `dot_product_attention` (positions: the rows' own).
    implementation: None (dispatch's choice: for up to FEW_QUERIES queries a kernel over the
      pages in place, the decode kernel or on 'cuda' the Triton decode kernel where it takes
      them; else the pages gathered and dot_product_attention's own choice), "decode" (the XLA
      decode kernel in place whatever T), "triton_decode" (the Triton
      decode kernel compiled: 'cuda' only) or
      `flax_mha.kernels.triton_decode.make_attention(interpret=True)` (it, interpreted, on any
      platform), or any implementation of `dot_product_attention` over the gathered pages.

  Returns:
    [B, T, H, V] (and with `return_residual` the lse [B, T, H]).
  """
  _check_pages(query, k_pages, v_pages, page_indices, kv_scales)
  b, t = query.shape[:2]
  lengths = _check_lengths(lengths, b)
  _check_table(lengths, page_indices, t, k_pages.shape[:2])
  q_positions = lengths[:, None] - t + jnp.arange(t, dtype=jnp.int32)
  return positioned_paged_attention(
      query, k_pages, v_pages, page_indices, q_positions, lengths, is_causal=is_causal,
      scale=scale, local_window_size=local_window_size, logit_soft_cap=logit_soft_cap,
      sinks=sinks, sink_tokens=sink_tokens, return_residual=return_residual,
      implementation=implementation, kv_scales=kv_scales)


def positioned_paged_attention(query, k_pages, v_pages, page_indices, q_positions, kv_lengths,
                               *, is_causal: bool = True, scale=None,
                               return_residual: bool = False, implementation=None,
                               kv_scales=None, **options):
  """`paged_attention` with the queries' positions given (q_positions [B, T]; negative: padding,
  seeing nothing): what a paged KV cache's prefill of prompts of different lengths needs."""
  _check_pages(query, k_pages, v_pages, page_indices, kv_scales)
  b, (n, page) = query.shape[0], (page_indices.shape[1], k_pages.shape[1])
  s = n * page
  kernel = triton_decode.named(implementation)
  stepping = kernel is not None or implementation == "decode" or (
      implementation is None and dispatch.is_step(query.shape[1]))
  if stepping:
    out = steps.paged_step(query, k_pages, v_pages, page_indices, q_positions, kv_lengths,
                           is_causal=is_causal, scale=scale, kernel=kernel,
                           forced="decode" if implementation == "decode" else None,
                           return_residual=return_residual, kv_scales=kv_scales, **options)
    if out is not None:
      return out
  implementation = None if kernel is not None else implementation
  slot = jnp.arange(s, dtype=jnp.int32)
  kv_positions = jnp.where(slot < kv_lengths[:, None], slot, -1)
  # Slots past a row's length are hidden; their values are zeroed too, so that whatever a
  # reused page holds there (even NaN) cannot leak through a weight of 0.
  rows = lambda pages: pages[page_indices].reshape(b, s, *pages.shape[2:])
  gather = lambda pages, scales: jnp.where(
      (kv_positions >= 0)[:, :, None, None],
      rows(pages) if scales is None else quant.dequantize(rows(pages), rows(scales), query.dtype),
      0)
  k_scales, v_scales = (None, None) if kv_scales is None else kv_scales
  return dot_product_attention(
      query, gather(k_pages, k_scales), gather(v_pages, v_scales), is_causal=is_causal,
      scale=scale,
      q_positions=q_positions, kv_positions=kv_positions, return_residual=return_residual,
      implementation=implementation, **options)


def _check_scales(k_pages, v_pages, kv_scales) -> None:
  """int8 pools with float scales [P, page, G] each (`flax_mha.quant`)."""
  if not k_pages.dtype == v_pages.dtype == quant.DTYPE:
    raise TypeError(f"with kv_scales, k_pages and v_pages must be int8, got {k_pages.dtype} and "
                    f"{v_pages.dtype}")
  if not isinstance(kv_scales, (tuple, list)) or len(kv_scales) != 2:
    raise TypeError(f"kv_scales must be a pair (k_scales, v_scales), got "
                    f"{type(kv_scales).__name__}")
  for name, x in zip(("k_scales", "v_scales"), kv_scales):
    checks.check_array(name, x, 3, "[P, page, G]")
    if tuple(x.shape) != tuple(k_pages.shape[:3]):
      raise ValueError(f"{name} must have shape [P, page, G] = {tuple(k_pages.shape[:3])}, got "
                       f"{tuple(x.shape)}")


def _check_lengths(lengths, batch: int):
  if not hasattr(lengths, "dtype") or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise TypeError(f"lengths must be an integer array [B], got "
                    f"{getattr(lengths, 'dtype', type(lengths).__name__)}")
  if tuple(lengths.shape) != (batch,):
    raise ValueError(f"lengths must have shape [B] = ({batch},), got {tuple(lengths.shape)}")
  return jnp.asarray(lengths, jnp.int32)


def _check_table(lengths, page_indices, t: int, pool: tuple) -> None:
  """Concrete lengths in [T, n·page] and page indices in [0, P) (traced ones pass unread)."""
  (num_pages, page), n = pool, page_indices.shape[1]
  if not isinstance(page_indices, jax.core.Tracer):
    table = np.asarray(page_indices)
    bad = (table < 0) | (table >= num_pages)
    if bad.any():
      row, col = np.argwhere(bad)[0]
      raise ValueError(f"page_indices must be in [0, P) = [0, {num_pages}), got "
                       f"{table[row, col]} at [{row}, {col}]")
  if not isinstance(lengths, jax.core.Tracer):
    held = np.asarray(lengths)
    bad = (held < t) | (held > n * page)
    if bad.any():
      row = np.argwhere(bad)[0][0]
      raise ValueError(f"lengths must be in [T, n·page] = [{t}, {n * page}] (the T queries are "
                       f"the last T tokens of each row's n={n} pages of {page}), got "
                       f"{held[row]} at [{row}]")


def _check_pages(query, k_pages, v_pages, page_indices, kv_scales=None) -> None:
  checks.check_array("query", query, 4, "[B, T, H, K]")
  if kv_scales is None and quant.DTYPE in (getattr(k_pages, "dtype", None),
                                           getattr(v_pages, "dtype", None)):
    raise TypeError("k_pages and v_pages of int8 need their scales: pass kv_scales=(k_scales, "
                    "v_scales), each [P, page, G] (flax_mha.quant)")
  checks.check_array("k_pages", k_pages, 4, "[P, page, G, K]", floating=kv_scales is None)
  checks.check_array("v_pages", v_pages, 4, "[P, page, G, V]", floating=kv_scales is None)
  for name, x, rank in (("query", query, 4), ("k_pages", k_pages, 4), ("v_pages", v_pages, 4)):
    if x.ndim != rank:
      raise ValueError(f"{name} must have rank {rank}, got shape {tuple(x.shape)}")
  if kv_scales is None and not query.dtype == k_pages.dtype == v_pages.dtype:
    raise TypeError(f"query, k_pages and v_pages must share one dtype (or k_pages and v_pages "
                    f"be int8 with kv_scales), got {query.dtype}, {k_pages.dtype} and "
                    f"{v_pages.dtype}")
  if kv_scales is not None:
    _check_scales(k_pages, v_pages, kv_scales)
  checks.check_agree("k_pages [P, page, G, K] and v_pages [P, page, G, V]", (k_pages, v_pages),
                     slice(0, 3), "agree on P, page and G")
  checks.check_agree("query [B, T, H, K] and k_pages [P, page, G, K]", (query, k_pages),
                     slice(-1, None), "share the head dim K")
  checks.check_heads(query.shape[2], k_pages.shape[2], names=("query heads H",
                                                              "key/value heads G"))
  if (not hasattr(page_indices, "dtype") or not jnp.issubdtype(page_indices.dtype, jnp.integer)
      or page_indices.ndim != 2 or page_indices.shape[0] != query.shape[0]):
    raise ValueError(f"page_indices must be integer [B, n] with B={query.shape[0]}, got "
                     f"{getattr(page_indices, 'dtype', None)} "
                     f"{tuple(getattr(page_indices, 'shape', ()))}")


