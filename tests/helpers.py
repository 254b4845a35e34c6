"""Test helpers: float64 NumPy references written independently of flax_mha (attention,
the multi-head-attention module, rotary, LayerNorm, windows), random arrays and parameters,
kernel calls, parameter swaps between two sides, grids of cases.

Dimension key (flax_mha/__init__.py): B batch, T query length, S key length, D model width,
H query heads, G key/value heads, K qk head dim, V value head dim. Tests use distinct prime sizes
so a swapped axis fails instead of broadcasting silently.

The tests mirror the package: tests/kernels/ the implementations, tests/nn/ the front ends,
tests/models/ the models, the top level the pure API. tests/ has no __init__.py: test modules
import these helpers with `from helpers import ...` (pytest puts tests/ on sys.path, as it does
each test file's folder), so every test file needs a unique basename. tests/conftest.py holds the
fixtures and hooks alone.
"""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Default prime sizes, each distinct: B=2, T=5, S=7, H=6 (not prime, but a multiple of G=3 and 2),
# K=11, V=13.
DIMS = dict(B=2, T=5, S=7, H=6, G=3, K=11, V=13)


def np_attention(query, key, value=None, bias=None, mask=None, *, is_causal=False, scale=None,
                 soft_cap=None, return_weights=False):
  """float64 NumPy attention, written independently of flax_mha.

  query [..., T, H, K], key [..., S, G, K], value [..., S, G, V] -> [..., T, H, V]; query head h
  reads key/value head h // (H // G). Scores are scale·Q·Kᵀ + bias, then with `soft_cap` c
  c·tanh(scores / c). mask (True = attend) and bias broadcast to [..., H, T, S]; `is_causal` is
  top-left aligned. A row with no visible key gets weights 0. With `return_weights`, returns
  (out, weights [..., H, T, S]); out is None when value is None.
  """
  q = np.asarray(query, np.float64)
  k = np.asarray(key, np.float64)
  reps = q.shape[-2] // k.shape[-2]
  k = np.repeat(k, reps, axis=-2)
  scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
  logits = np.einsum("...thk,...shk->...hts", q, k) * scale
  if bias is not None:
    logits = logits + np.asarray(bias, np.float64)
  if soft_cap is not None:
    logits = soft_cap * np.tanh(logits / soft_cap)
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


def np_rotary(x, positions, max_wavelength=10_000.0):
  """float64 RoPE of x [..., T, H, K] at positions broadcasting to [..., T]: for each frequency
  i < K/2, the pair (x[i], x[i + K/2]) turned by the angle position / max_wavelength^(2i/K)."""
  x = np.asarray(x, np.float64)
  k = x.shape[-1]
  half = k // 2
  pos = np.asarray(positions, np.float64)[..., None]  # [..., T, 1]: one angle for every head
  out = np.empty(np.broadcast_shapes(x.shape, pos.shape + (1,)))
  for i in range(half):
    theta = pos / max_wavelength ** (2.0 * i / k)
    cos, sin = np.cos(theta), np.sin(theta)
    first, second = x[..., i], x[..., i + half]
    out[..., i] = cos * first - sin * second
    out[..., i + half] = sin * first + cos * second
  return out


def np_layer_norm(x, scale, bias=None, epsilon=1e-6):
  """LayerNorm over the last axis in float64 (flax.linen's, epsilon 1e-6 by default)."""
  x = np.asarray(x, np.float64)
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  out = (x - mean) / np.sqrt(var + epsilon) * scale
  return out if bias is None else out + bias


def np_window(t, s, window, offset=0):
  """[T, S]: query i (at position i + offset) sees keys i + offset - left .. + right."""
  left, right = (window, window) if isinstance(window, int) else window
  q, kv = np.arange(t)[:, None] + offset, np.arange(s)[None, :]
  return (kv >= q - left) & (kv <= q + right)


def np_mha(params, xq, xk=None, xv=None, *, mask=None, bias=None, is_causal=False,
           soft_cap=None, normalize_qk=False, rotary=None, return_weights=False):
  """flax_mha's MultiHeadAttention (linen and NNX) in float64 NumPy, from its linen params.

  params: the linen variables {'params': ...} or the 'params' collection itself: query/key/value
  kernels [D_in, H or G, K or V], out kernel [H, V, D_out], biases where the module has them, and
  with `normalize_qk` the LayerNorm scales [K] of query_ln/key_ln. xq [..., T, D_q], xk
  [..., S, D_k] (default xq), xv [..., S, D_v] (default xk). mask, bias, is_causal and soft_cap
  as in `np_attention`; rotary is (max_wavelength, q_positions, kv_positions). Returns
  out [..., T, D_out], or (out, weights [..., H, T, S]) with `return_weights`.
  """
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params.get("params", params))
  xk = xq if xk is None else xk
  xv = xk if xv is None else xv
  proj = lambda x, name: (np.einsum("...d,dhk->...hk", np.asarray(x, np.float64),
                                    p[name]["kernel"]) + p[name].get("bias", 0))
  q, k, v = proj(xq, "query"), proj(xk, "key"), proj(xv, "value")
  if normalize_qk:
    q, k = np_layer_norm(q, p["query_ln"]["scale"]), np_layer_norm(k, p["key_ln"]["scale"])
  if rotary is not None:
    wavelength, q_pos, kv_pos = rotary
    q, k = np_rotary(q, q_pos, wavelength), np_rotary(k, kv_pos, wavelength)
  out_THV, weights = np_attention(q, k, v, bias, mask, is_causal=is_causal, soft_cap=soft_cap,
                                  return_weights=True)
  out = np.einsum("...hv,hvd->...d", out_THV, p["out"]["kernel"]) + p["out"].get("bias", 0)
  return (out, weights) if return_weights else out


class GridParts(NamedTuple):
  unit: list  # the unit file's combinations, as tuples
  integration: list  # the integration file's, as pytest params (the slow ones marked)


def split_grid(keep, later, *axes) -> GridParts:
  """Every combination of the axes, for a test whose cases a unit file and an integration file
  share: the unit file runs those `keep(*combination)` accepts and `later` rejects; the
  integration file those `later` accepts, and, marked slow, those `keep` rejects. The unit suite
  still covers each value of each axis, `make test-slow` the rest of the full product."""
  combinations = list(itertools.product(*axes))
  return GridParts(
      unit=[c for c in combinations if keep(*c) and not later(*c)],
      integration=[pytest.param(*c, marks=() if keep(*c) else pytest.mark.slow)
                   for c in combinations if later(*c) or not keep(*c)])


def in_turn(first, second, period=None):
  """A keep rule (for `split_grid`, or a list of cases): (a, b) where b's place in `second`
  minus a's place in `first` is 0 modulo `period` (default len(second)): each value of `first`
  meets every period-th value of `second`, starting one place further than the value before."""
  first, second = list(first), list(second)
  period = period or len(second)
  return lambda a, b: (second.index(b) - first.index(a)) % period == 0


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


def kernel_inputs(seed=0, *, t, s, h, g, k, v, dtype=np.float32):
  """The array arguments of an implementation in flax_mha.kernels, as jax arrays of `dtype`:
  query [B, T, H, K], key [B, S, G, K], value [B, S, G, V], bias [1, H, T, S] and a random
  mask [B, 1, T, S] (B = 2), drawn from `seed`."""
  rng = np.random.default_rng(seed)
  q, key, value = (jnp.asarray(x, dtype) for x in qkv(rng, t=t, s=s, h=h, g=g, k=k, v=v))
  bias = jnp.asarray(rng.standard_normal((1, h, t, s)), dtype)
  mask = jnp.asarray(rng.random((DIMS["B"], 1, t, s)) < 0.7)
  return q, key, value, bias, mask


def call_kernel(fn, q, k, v, bias=None, mask=None, is_causal=False, dropout_rate=0.0, scale=0.37):
  """`fn` (an implementation's internal signature) with scale 0.37 and dropout key 7."""
  return fn(q, k, v, bias, mask, is_causal=is_causal, scale=scale, dropout_rate=dropout_rate,
            dropout_rng=jax.random.key(7))


def output_and_grads(fn, *args, jit=True, reduce=jnp.sin):
  """(fn(*args), the gradients of sum(reduce(fn(*args))) with respect to every argument), forward
  and backward traced together: one compile under `jit` (the default), eager without."""
  def loss(*a):
    out = fn(*a)
    return jnp.sum(reduce(out)), out

  value_and_grad = jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True)
  (_, out), grads = (jax.jit(value_and_grad) if jit else value_and_grad)(*args)
  return out, grads


def random_params(model, *args, seed=1, **kwargs):
  """{'params': random arrays of the shapes `model.init(key, *args, **kwargs)` makes}: NumPy, so
  nothing compiles, every leaf non-trivial (biases and LayerNorm scales too); `seed` picks them."""
  shapes = jax.eval_shape(functools.partial(model.init, **kwargs), jax.random.key(0), *args)
  rng = np.random.default_rng(seed)
  return {"params": jax.tree.map(lambda a: randn(rng, *a.shape, dtype=a.dtype) * 0.3,
                                 shapes["params"])}


def own_params(models, *args, **kwargs):
  """{side: random_params(model, *args, **kwargs)} for each side of `models` ({side: module}), a
  seed per side: each side's own tree (from its own init) with values of its own. A parameter
  swap loads one side's into the other, so the two directions load different params."""
  return {side: random_params(model, *args, seed=seed, **kwargs)
          for seed, (side, model) in enumerate(models.items())}


def load_across(direction, own, run, *args):
  """A parameter swap '<source>_into_<target>' between two sides: `own` holds each side's own
  params (own_params), `run[side](params, *args)` calls a side. Checks that the source's tree is
  the target's own, as it must be to load as it is; returns (the source's params, the target's
  own params, the source's output, the target's output on the source's params)."""
  source, target = direction.split("_into_")
  chex.assert_trees_all_equal_shapes_and_dtypes(own[source], own[target])
  loaded = own[source]
  return loaded, own[target], run[source](loaded, *args), run[target](loaded, *args)
