"""Shared test helpers: an independent float64 NumPy attention, random arrays, jit/no-jit variants.

Dimension key (flax_mha/__init__.py): B batch, T query length, S key length, H query heads,
G key/value heads, K qk head dim, V value head dim, D model width. Tests use distinct prime sizes so a swapped axis
fails instead of broadcasting silently.
"""

from __future__ import annotations

import chex
import jax
import numpy as np
import pytest

# Default prime sizes, each distinct: B=2, T=5, S=7, H=6 (not prime, but a multiple of G=3 and 2),
# K=11, V=13.
DIMS = dict(B=2, T=5, S=7, H=6, G=3, K=11, V=13)


def np_attention(query, key, value=None, bias=None, mask=None, *, is_causal=False, scale=None,
                 return_weights=False):
  """float64 NumPy attention, written independently of flax_mha.

  query [..., T, H, K], key [..., S, G, K], value [..., S, G, V] -> [..., T, H, V]; query head h
  reads key/value head h // (H // G). mask (True = attend) and bias broadcast to [..., H, T, S];
  `is_causal` is top-left aligned. A row with no visible key gets weights 0. With
  `return_weights`, returns (out, weights [..., H, T, S]); out is None when value is None.
  """
  q = np.asarray(query, np.float64)
  k = np.asarray(key, np.float64)
  reps = q.shape[-2] // k.shape[-2]
  k = np.repeat(k, reps, axis=-2)
  scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
  logits = np.einsum("...thk,...shk->...hts", q, k) * scale
  if bias is not None:
    logits = logits + np.asarray(bias, np.float64)
  t, s = logits.shape[-2:]
  visible = np.ones(logits.shape, bool)
  if mask is not None:
    visible = visible & np.asarray(mask, bool)
  if is_causal:
    visible = visible & np.tril(np.ones((t, s), bool))
  logits = np.where(visible, logits, -np.inf)
  row_max = logits.max(axis=-1, keepdims=True, initial=-np.inf)
  row_max = np.where(np.isfinite(row_max), row_max, 0.0)
  e = np.where(visible, np.exp(logits - row_max), 0.0)
  denom = e.sum(axis=-1, keepdims=True)
  weights = e / np.where(denom > 0, denom, 1.0)
  out = None
  if value is not None:
    v = np.repeat(np.asarray(value, np.float64), reps, axis=-2)
    out = np.einsum("...hts,...shv->...thv", weights, v)
  return (out, weights) if return_weights else out


def randn(rng: np.random.Generator, *shape, dtype=np.float32):
  """Standard normal array of `shape` (NumPy, so the reference sees the exact same numbers)."""
  return rng.standard_normal(shape).astype(dtype)


def random_mask(rng: np.random.Generator, *shape, p: float = 0.7):
  """Boolean mask, True (attend) with probability p."""
  return rng.random(shape) < p


def qkv(rng, batch=(DIMS["B"],), t=DIMS["T"], s=DIMS["S"], h=DIMS["H"], g=DIMS["G"],
        k=DIMS["K"], v=DIMS["V"], dtype=np.float32):
  """query [*batch, T, H, K], key [*batch, S, G, K], value [*batch, S, G, V]."""
  return (randn(rng, *batch, t, h, k, dtype=dtype), randn(rng, *batch, s, g, k, dtype=dtype),
          randn(rng, *batch, s, g, v, dtype=dtype))


@pytest.fixture
def rng():
  return np.random.default_rng(0)


@pytest.fixture(params=["with_jit", "without_jit"])
def variant(request):
  """Like chex.variants(with_jit=True, without_jit=True): variant(fn, **jit_kwargs)."""
  if request.param == "with_jit":
    return lambda fn, **kw: jax.jit(fn, **kw)
  return lambda fn, **kw: fn


@pytest.fixture(autouse=True)
def _clear_trace_counter():
  chex.clear_trace_counter()
  yield
