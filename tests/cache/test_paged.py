"""Paged attention (flax_mha.cache.paged) equals attention over the contiguous cache its pages make,
values and gradients, for the decode kernel walking the pages and the gathered path. A paged KV
cache through a front end, and the rest of the grid, are in tests/cache/test_paged_integration.py."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_mha
from flax_mha import cache as cache_lib

from helpers import split_grid

B, H, G, K, V, PAGE, N_PAGES, POOL = 3, 4, 2, 8, 6, 4, 5, 17


def _pool(seed=0, t=2):
  """Query [B, T, H, K], pools [POOL, PAGE, G, K|V], lengths [B] and a scrambled page table."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((B, t, H, K)), jnp.float32)
  k_pages = jnp.asarray(rng.standard_normal((POOL, PAGE, G, K)), jnp.float32)
  v_pages = jnp.asarray(rng.standard_normal((POOL, PAGE, G, V)), jnp.float32)
  lengths = jnp.array([3, 13, 20])  # one page, a partial last page, every page
  table = jnp.asarray(rng.permutation(POOL)[:B * N_PAGES].reshape(B, N_PAGES), jnp.int32)
  return q, k_pages, v_pages, lengths, table


def _contiguous(q, k_pages, v_pages, lengths, table, **kwargs):
  """The same attention written over the gathered cache with positions, by the oracle."""
  t, s = q.shape[1], N_PAGES * PAGE
  gather = lambda pages: pages[table].reshape(B, s, *pages.shape[2:])
  slot = jnp.arange(s)
  return flax_mha.dot_product_attention(
      q, gather(k_pages), gather(v_pages), is_causal=kwargs.pop("is_causal", True),
      q_positions=lengths[:, None] - t + jnp.arange(t),
      kv_positions=jnp.where(slot < lengths[:, None], slot, -1), implementation="reference",
      **kwargs)


OPTIONS = {"plain": {}, "not_causal": dict(is_causal=False),
           "window_soft_cap": dict(local_window_size=(5, 0), logit_soft_cap=2.0),
           "sinks": dict(sinks=jnp.array([0.5, -1.0, 0.0, 2.0])),
           "window_sink_tokens": dict(local_window_size=(3, 0), sink_tokens=2)}


PAGED_GRID = split_grid(
    lambda impl, option, t: impl is None or (impl, option, t) in (("chunked", "sinks", 3),
                                                                   ("xla", "plain", 3)),
    lambda impl, option, t: impl is None and (
        t == 1 and option != "plain" or t == 3 and option in ("not_causal", "window_sink_tokens")),
    [None, "chunked", "xla"], sorted(OPTIONS), [1, 3])


@pytest.mark.parametrize("implementation,option,t", PAGED_GRID.unit)
def test_paged_equals_contiguous_values_and_gradients(implementation, option, t):
  q, k_pages, v_pages, lengths, table = _pool(1, t)
  kwargs = OPTIONS[option]
  fn = functools.partial(flax_mha.paged_attention, lengths=lengths, page_indices=table,
                         implementation=implementation, **kwargs)
  out, lse = jax.jit(lambda q, k, v: fn(q, k, v, return_residual=True))(q, k_pages, v_pages)
  want, want_lse = _contiguous(q, k_pages, v_pages, lengths, table, return_residual=True,
                               **kwargs)
  np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(lse, want_lse, atol=2e-5, rtol=2e-5)
  loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))
  got = jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2)))(q, k_pages, v_pages)
  ref = lambda q, k, v: _contiguous(q, k, v, lengths, table, **kwargs)
  chex.assert_trees_all_close(got, jax.grad(loss(ref), argnums=(0, 1, 2))(q, k_pages, v_pages),
                              atol=2e-5, rtol=2e-5)


def test_pages_a_row_does_not_own_are_never_read():
  q, k_pages, v_pages, lengths, table = _pool(2)
  out = flax_mha.paged_attention(q, k_pages, v_pages, lengths, table)
  owned = np.zeros(POOL, bool)
  for row, n in enumerate(np.asarray(lengths)):
    owned[np.asarray(table[row, :-(-n // PAGE)])] = True
  poisoned = k_pages.at[~owned].set(jnp.nan), v_pages.at[~owned].set(jnp.nan)
  np.testing.assert_allclose(flax_mha.paged_attention(q, *poisoned, lengths, table), out)


def test_writing_past_a_rows_pages_is_an_error():
  """More tokens than the pages hold are refused from the static sizes; tokens that fit but
  land past the row's pages (its positions are data) by the write's own check."""
  cache = cache_lib.PagedKVCache.create(4, 2, jnp.array([[0, 1]]), 1, 4)
  with pytest.raises(ValueError, match="writing 5 tokens into a cache of capacity 4"):
    cache_lib.next_positions(cache, 5)
  k = jnp.zeros((1, 3, 1, 4))
  with pytest.raises(ValueError, match="KV cache overflow: writing position 4"):
    cache_lib.update_pages(cache, k, k, jnp.array([[2, 3, 4]], jnp.int32))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(lengths=jnp.array([1.0, 2.0, 3.0])), TypeError, "lengths must be an integer array"),
    (dict(lengths=jnp.array([1, 2])), ValueError, r"lengths must have shape \[B\] = \(3,\)"),
    (dict(page_indices=jnp.zeros((2, 5), jnp.int32)), ValueError,
     r"page_indices must be integer \[B, n\] with B=3"),
    (dict(v_pages=jnp.zeros((POOL, PAGE + 1, G, V))), ValueError, "agree on P, page and G"),
])
def test_bad_arguments_are_named(kwargs, error, match):
  q, k_pages, v_pages, lengths, table = _pool(4)
  args = dict(query=q, k_pages=k_pages, v_pages=v_pages, lengths=lengths, page_indices=table)
  args.update(kwargs)
  with pytest.raises(error, match=match):
    flax_mha.paged_attention(**args)


def _table_with(row, col, value):
  return _pool(4)[4].at[row, col].set(value)


@pytest.mark.parametrize("kwargs,match", [
    (dict(page_indices=_table_with(1, 2, POOL)), r"page_indices must be in \[0, P\) = "
     r"\[0, 17\), got 17 at \[1, 2\]"),
    (dict(page_indices=_table_with(0, 4, -1)), r"page_indices .* got -1 at \[0, 4\]"),
    (dict(lengths=jnp.array([3, 1, 20])), r"lengths must be in \[T, n·page\] = \[2, 20\].*"
     r"got 1 at \[1\]"),
    (dict(lengths=jnp.array([3, 13, 21])), r"lengths must be in .* got 21 at \[2\]"),
])
def test_concrete_page_table_and_lengths_are_checked(kwargs, match):
  """Eagerly, a page outside the pool or a length outside [T, n·page] is refused by name (under
  jit they are traced: the docstring says what happens); the edges T and n·page are taken."""
  q, k_pages, v_pages, lengths, table = _pool(4)
  args = dict(query=q, k_pages=k_pages, v_pages=v_pages, lengths=lengths, page_indices=table)
  with pytest.raises(ValueError, match=match):
    flax_mha.paged_attention(**{**args, **kwargs})
  edges = jnp.array([2, 13, N_PAGES * PAGE])
  np.testing.assert_allclose(flax_mha.paged_attention(**{**args, "lengths": edges}),
                             _contiguous(q, k_pages, v_pages, edges, table), atol=1e-5)
