"""The matrix of `python -m flax_mha.selftest` (`flax_mha.selftest`): its shapes, the options
of `dot_product_attention` it runs at each, the KV cache's steps and paged calls, and the
oracle each is compared with.

Every case builds its inputs from a seeded NumPy generator (the same numbers on every machine)
in float32 and casts them to the dtype under test; the oracle gets those same (rounded) values
in float32 and runs `implementation="reference"` (`flax_mha.kernels.reference`). Arrays that
are options (bias, mask, lengths, positions, sinks) are passed to the jitted function as
arguments, never closed over, so no program holds a constant the size of the logits.

Shapes: B batch, T queries, S keys, H query heads, G key/value heads, K, V head dims; a cache
step's S is its capacity, a paged call's its pages times the page size.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from flax_mha import attention
from flax_mha import cache as cache_lib
from flax_mha.cache import paged as paged_lib


@dataclasses.dataclass(frozen=True)
class Shape:
  """The dims of one dense call (T == S: windows need it)."""
  name: str
  b: int
  t: int
  s: int
  h: int
  g: int
  k: int
  v: int

  @property
  def label(self) -> str:
    return f"B{self.b} T{self.t} S{self.s} H{self.h} G{self.g} K{self.k} V{self.v}"


# small: lengths no block size divides (the kernels' padding is checked); medium: a layer's.
SHAPES = (Shape("small", 2, 100, 100, 4, 4, 64, 64),
          Shape("medium", 2, 1024, 1024, 8, 8, 128, 128))


def _same(shape: Shape) -> Shape:
  return shape


@dataclasses.dataclass(frozen=True)
class Option:
  """One set of `dot_product_attention` options: `make(shape, rng)` -> (static options, arrays
  that are options), `dims(shape)` the shape the option needs (GQA, K != V), `quick` whether
  `--quick` runs it."""
  name: str
  make: Callable[[Shape, np.random.Generator], tuple[dict, dict]]
  dims: Callable[[Shape], Shape] = _same
  quick: bool = False


def _normal(rng, *shape):
  return rng.standard_normal(shape).astype(np.float32)


def _positions(shape: Shape):
  """Row 0 at positions 0 .. T-1; row 1 left-padded (-1) by a fifth of T, then 0, 1, ..."""
  pad = shape.t // 5
  row1 = np.concatenate([np.full(pad, -1), np.arange(shape.t - pad)])
  return np.stack([np.arange(shape.t), row1] + [np.arange(shape.t)] * (shape.b - 2)).astype(
      np.int32)


def _lengths(shape: Shape):
  q = np.asarray([shape.t, shape.t // 2 + 1] + [shape.t] * (shape.b - 2), np.int32)
  kv = np.asarray([shape.s - 3, shape.s // 3] + [shape.s] * (shape.b - 2), np.int32)
  return dict(query_seq_lengths=q, key_value_seq_lengths=kv)


PLAIN = Option("plain", lambda d, rng: ({}, {}))
OPTIONS = (
    PLAIN,
    Option("causal", lambda d, rng: (dict(is_causal=True), {})),
    Option("window", lambda d, rng: (dict(is_causal=True, local_window_size=(d.t // 4, 0)), {})),
    Option("gqa causal", lambda d, rng: (dict(is_causal=True), {}),
           dims=lambda d: dataclasses.replace(d, g=max(1, d.h // 4)), quick=True),
    Option("kv lengths", lambda d, rng: ({}, _lengths(d)), quick=True),
    Option("positions", lambda d, rng: (dict(is_causal=True), dict(
        q_positions=_positions(d), kv_positions=_positions(d)))),
    Option("bias", lambda d, rng: ({}, dict(bias=_normal(rng, 1, d.h, d.t, d.s)))),
    Option("key mask", lambda d, rng: ({}, dict(mask=rng.random((d.b, 1, 1, d.s)) > 0.2))),
    Option("soft cap", lambda d, rng: (dict(is_causal=True, logit_soft_cap=1.0), {})),
    Option("sinks", lambda d, rng: ({}, dict(sinks=_normal(rng, d.h)))),
    Option("dropout", lambda d, rng: (dict(dropout_rate=0.1), dict(
        dropout_rng=jax.random.key(int(rng.integers(2**31)))))),
    Option("K != V", lambda d, rng: ({}, {}), dims=lambda d: dataclasses.replace(d, v=d.k // 2)),
)


def _cast(tree, dtype):
  """Floating leaves of `tree` as jnp arrays of `dtype`; the others (ints, bools, keys) as
  jnp arrays unchanged."""
  def cast(x):
    x = jnp.asarray(x)
    return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
  return jax.tree.map(cast, tree)


def as_float32(tree):
  """`tree` with its floating leaves in float32: the oracle's inputs."""
  return _cast(tree, jnp.float32)


@dataclasses.dataclass(frozen=True)
class Inputs:
  """One case's inputs: `args` (differentiated: query, key, value, or query and pages), `cot`
  the cotangent of the output, `static` options, `arrays` options passed as arguments, and
  `extra` non-differentiated arguments of the case's function (a cache, a page table)."""
  args: tuple
  cot: jax.Array
  static: dict
  arrays: dict
  extra: tuple = ()

  def astype(self, dtype) -> "Inputs":
    return Inputs(_cast(self.args, dtype), _cast(self.cot, dtype), self.static,
                  _cast(self.arrays, dtype), _cast(self.extra, dtype))


def dense_inputs(shape: Shape, option: Option, dtype, seed: int = 0) -> Inputs:
  """Query [B, T, H, K], key [B, S, G, K], value [B, S, G, V] and the option's arguments."""
  rng = np.random.default_rng(seed)
  d = option.dims(shape)
  args = (_normal(rng, d.b, d.t, d.h, d.k), _normal(rng, d.b, d.s, d.g, d.k),
          _normal(rng, d.b, d.s, d.g, d.v))
  static, arrays = option.make(d, rng)
  return Inputs(args, _normal(rng, d.b, d.t, d.h, d.v), static, arrays).astype(dtype)


@functools.cache  # one function per implementation: jit's cache then serves every case
def dense_call(implementation):
  """(query, key, value, arrays, static) -> dot_product_attention's output."""
  def call(query, key, value, arrays, static):
    return attention.dot_product_attention(query, key, value, **static, **arrays,
                                           implementation=implementation)
  return call


# ---- the comparison ----

# max |error| / max |oracle| allowed, by dtype and platform. float32: exact up to summation
# order on a CPU; by default a GPU's float32 matmuls use TF32 (10-bit mantissa) and a TPU's
# bfloat16 passes (the oracle runs at the highest precision, the kernels at their defaults).
# bfloat16: the 16-bit tolerance of the parity tests (tests/kernels/test_triton_integration.py).
TOLERANCES = {"float32": {"cpu": 1e-4, "cuda": 5e-3, "rocm": 5e-3, "tpu": 3e-2},
              "bfloat16": {"cpu": 3e-2, "cuda": 3e-2, "rocm": 3e-2, "tpu": 3e-2}}


def tolerance(dtype: str, platform: str) -> float:
  """The largest scaled error that passes, for `dtype` on `platform`."""
  return TOLERANCES[dtype].get(platform, max(TOLERANCES[dtype].values()))


def scaled_error(got, want) -> float:
  """max over the leaves of max |got - want| / max |want| (inf for a NaN or inf where the
  oracle is finite)."""
  worst = 0.0
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    diff = np.abs(g - w)
    if diff.size == 0:
      continue
    if not np.all(np.isfinite(diff)):
      return float("inf")
    worst = max(worst, float(diff.max() / max(np.abs(w).max(), np.finfo(np.float32).tiny)))
  return worst


# ---- a KV cache's step (flax_mha.cache.attend) ----


@dataclasses.dataclass(frozen=True)
class StepShape:
  """A cache of `capacity` slots whose rows hold `fills` tokens (or a pool of pages of `page`
  tokens, `pages` per row and `pool` in all, rows holding `fills`), H, G, K, V."""
  name: str
  b: int
  capacity: int
  h: int
  g: int
  k: int
  v: int
  fills: tuple[int, ...]
  page: int = 16

  @property
  def label(self) -> str:
    return (f"B{self.b} S{self.capacity} H{self.h} G{self.g} K{self.k} V{self.v} "
            f"fill {'/'.join(map(str, self.fills))}")


STEP_SHAPES = (StepShape("small", 2, 256, 4, 2, 64, 64, (5, 200), page=16),
               StepShape("medium", 2, 2048, 8, 2, 128, 128, (300, 1900), page=64))


@dataclasses.dataclass(frozen=True)
class StepCase:
  """T new tokens with `static` options (and `sinks`), over a full cache or (with `window`) a
  rolling one of `window` slots past `sink_tokens`."""
  name: str
  t: int
  static: dict = dataclasses.field(default_factory=dict)
  sinks: bool = False
  window: int | None = None
  sink_tokens: int = 0
  quick: bool = False


CACHE_CASES = (
    StepCase("1 token", 1),
    StepCase("3 tokens, window, soft cap", 3, dict(local_window_size=(64, 0),
                                                   logit_soft_cap=2.0), quick=True),
    StepCase("1 token, sinks", 1, sinks=True),
    StepCase("2 tokens, rolling cache", 2, window=64, sink_tokens=4),
)


def cache_inputs(shape: StepShape, case: StepCase, dtype, seed: int = 0) -> Inputs:
  """The step's query [B, T, H, K], key [B, T, G, K], value [B, T, G, V] over a cache whose
  rows hold `shape.fills` tokens (the cache is `extra`)."""
  rng = np.random.default_rng(seed)
  b, t, h, g = shape.b, case.t, shape.h, shape.g
  empty = cache_lib.KVCache.create(b, shape.capacity, g, shape.k, shape.v, jnp.float32,
                                   window=case.window, sink_tokens=case.sink_tokens)
  most = max(shape.fills)
  positions = np.where(np.arange(most) < np.asarray(shape.fills)[:, None], np.arange(most), -1)
  filled = cache_lib.update(empty, jnp.asarray(_normal(rng, b, most, g, shape.k)),
                            jnp.asarray(_normal(rng, b, most, g, shape.v)),
                            jnp.asarray(positions, jnp.int32))
  args = (_normal(rng, b, t, h, shape.k), _normal(rng, b, t, g, shape.k),
          _normal(rng, b, t, g, shape.v))
  arrays = dict(sinks=_normal(rng, h)) if case.sinks else {}
  return Inputs(args, _normal(rng, b, t, h, shape.v), dict(case.static), arrays,
                (filled,)).astype(dtype)


@functools.cache
def cache_call(implementation):
  """(query, key, value, arrays, static, cache) -> the step's output over `cache`."""
  def call(query, key, value, arrays, static, cache):
    return cache_lib.attend(query, key, value, cache, **static, **arrays,
                            implementation=implementation)[0]
  return call


# ---- paged attention (flax_mha.paged_attention) ----


PAGED_CASES = (
    StepCase("1 token", 1),
    StepCase("4 tokens, window, soft cap", 4, dict(local_window_size=(40, 0),
                                                   logit_soft_cap=2.0), quick=True),
    StepCase("1 token, sinks", 1, sinks=True),
)


def paged_inputs(shape: StepShape, case: StepCase, dtype, seed: int = 0) -> Inputs:
  """The query [B, T, H, K] and a pool of pages [P, page, G, K] (and V) that every slot of
  holds numbers (those past a row's length too: a reused page), rows owning pages in a shuffled
  order; `extra` is (lengths [B], page table [B, n])."""
  rng = np.random.default_rng(seed)
  n = shape.capacity // shape.page
  pool = shape.b * n + 3
  table = rng.permutation(pool)[:shape.b * n].reshape(shape.b, n).astype(np.int32)
  args = (_normal(rng, shape.b, case.t, shape.h, shape.k),
          _normal(rng, pool, shape.page, shape.g, shape.k),
          _normal(rng, pool, shape.page, shape.g, shape.v))
  arrays = dict(sinks=_normal(rng, shape.h)) if case.sinks else {}
  extra = (np.asarray(shape.fills, np.int32), table)
  return Inputs(args, _normal(rng, shape.b, case.t, shape.h, shape.v), dict(case.static),
                arrays, extra).astype(dtype)


@functools.cache
def paged_call(implementation):
  """(query, k_pages, v_pages, arrays, static, lengths, table) -> paged_attention's output."""
  def call(query, k_pages, v_pages, arrays, static, lengths, table):
    return paged_lib.paged_attention(query, k_pages, v_pages, lengths, table, **static,
                                     **arrays, implementation=implementation)
  return call


def paged_oracle(query, k_pages, v_pages, arrays, static, lengths, table):
  """The oracle of a paged call, independent of flax_mha.cache.paged: each row's pages gathered in
  order into a contiguous cache, slots past its length hidden by position, and
  `dot_product_attention(implementation="reference")` over it at the rows' last T positions."""
  b, t = query.shape[:2]
  s = table.shape[1] * k_pages.shape[1]
  gather = lambda pages: pages[table].reshape(b, s, *pages.shape[2:])
  slot = jnp.arange(s, dtype=jnp.int32)
  kv_positions = jnp.where(slot < lengths[:, None], slot, -1)
  q_positions = lengths[:, None] - t + jnp.arange(t, dtype=jnp.int32)
  return attention.dot_product_attention(
      query, gather(k_pages), gather(v_pages), is_causal=True, q_positions=q_positions,
      kv_positions=kv_positions, **static, **arrays, implementation="reference")
