"""The int8 KV cache (flax_mha.cache with dtype=jnp.int8, flax_mha.quant): a step over a full
int8 cache equals the reference implementation over the cache's dequantized keys and values,
and stays within the quantization's bound of the float cache's answer, by "xla" (the CPU's
choice) and by "decode" (named); every step kernel takes int8 keys, the dense entrance none;
the scales follow the rows and pages; what is refused. The rolling and paged caches' steps,
the Triton decode kernel in Pallas interpret mode, prefills, jit, vmap and gradients, and
generation are in tests/cache/test_cache_int8_integration.py."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_mha
from flax_mha import cache as cache_lib
from flax_mha import call_options
from flax_mha import dispatch
from flax_mha import quant
from flax_mha.kernels import registry
from flax_mha.kernels import triton_decode

B, H, G, K, V = 2, 6, 2, 16, 8
FILL = jnp.asarray([[5], [27]])  # tokens of each row's prompt
INTERPRETED = triton_decode.make_attention(interpret=True)

# name -> (KVCache.create's window and sink_tokens, or "paged"; attention options)
KINDS = {
    "full": (dict(), dict(logit_soft_cap=3.0)),
    "rolling_sink_tokens": (dict(window=8, sink_tokens=2), dict()),
    "paged": ("paged", dict(sinks=jnp.asarray([0.5, -1.0, 2.0, 0.0, 0.3, -0.2]))),
}


def arrays(seed, *shapes):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal(shape) * 2, jnp.float32) for shape in shapes]


def _empty(kind, dtype):
  layout = KINDS[kind][0]
  if layout == "paged":
    table = jnp.asarray(np.random.default_rng(7).permutation(8)[:2 * 3].reshape(2, 3), jnp.int32)
    return cache_lib.PagedKVCache.create(8, 16, table, G, K, V, dtype)
  return cache_lib.KVCache.create(B, 64, G, K, V, dtype, **layout)


def filled(kind, dtype):
  """The cache holding prompts of 5 and 27 tokens (written: a row's padding at -1)."""
  return jax.jit(_fill)(_empty(kind, dtype))


def _fill(cache):
  k, v = arrays(0, (B, 27, G, K), (B, 27, G, V))
  positions = jnp.where(jnp.arange(27) < FILL, jnp.arange(27), -1)
  write = cache_lib.update_pages if hasattr(cache, "k_pages") else cache_lib.update
  return write(cache, k, v, positions)


def _step(cache, q, k, v, options, positions=None):
  return cache_lib.attend(q, k, v, cache, positions, **options)


def jit_step(options):
  """(out, cache) of a step with `options`, jitted (one compile: the tests stay fast)."""
  return jax.jit(lambda c, q, k, v: _step(c, q, k, v, options))


def step_inputs(t=3, seed=1):
  return arrays(seed, (B, t, H, K), (B, t, G, K), (B, t, G, V))


def _dequantized(x, scale):
  return x.astype(jnp.float32) if scale is None else quant.dequantize(x, scale)


def shared_oracle(cache, q, k, v, options, *, quantize: bool = True):
  """The step by the reference implementation over what the cache holds (dequantized) and the
  new tokens (quantized then dequantized when `quantize`), at their positions (jitted)."""
  return jax.jit(lambda c, q, k, v: oracle_graph(c, q, k, v, options, quantize))(cache, q, k, v)


def oracle_graph(cache, q, k, v, options, quantize):
  t = q.shape[1]
  positions = cache_lib.next_positions(cache, t)
  chunk = lambda x: quant.dequantize(*quant.quantize(x)) if quantize else x
  if isinstance(cache, cache_lib.PagedKVCache):
    after = cache_lib.update_pages(cache, k, v, positions)
    table, page = after.page_indices, after.k_pages.shape[1]
    s = table.shape[1] * page
    rows = lambda pool, scale: _dequantized(pool[table], None if scale is None else
                                            scale[table]).reshape(B, s, *pool.shape[2:])
    keys, values = rows(after.k_pages, after.k_scales), rows(after.v_pages, after.v_scales)
    kv_pos = jnp.where(jnp.arange(s) < after.length[:, None], jnp.arange(s), -1)
  else:  # the slots before the step, then the new tokens: each position once
    api = lambda x, scale: _dequantized(x, scale).transpose(0, 2, 1, 3)
    keys = jnp.concatenate([api(cache.key, cache.key_scale), chunk(k)], axis=1)
    values = jnp.concatenate([api(cache.value, cache.value_scale), chunk(v)], axis=1)
    kv_pos = jnp.concatenate([cache.positions, positions], axis=1)
    if cache.window is not None:
      options = dict(options, local_window_size=(cache.window, 0), sink_tokens=cache.sink_tokens)
  return flax_mha.dot_product_attention(q, keys, values, is_causal=True, q_positions=positions,
                                        kv_positions=kv_pos, implementation="reference",
                                        **options)


def _bound(cache, q, k, v):
  """A bound on |int8 step - float step| from the quantization error (flax_mha.quant: <= scale/2
  per element): each logit moves by at most d = K^-1/2·max|q|_1·max(key scale)/2, so the
  weights by a factor within exp(±2d), and the output by at most max(value scale)/2 +
  (exp(2d) - 1)·max|value|."""
  k_scale, v_scale = (cache.key_scale, cache.value_scale) if hasattr(cache, "key_scale") else (
      cache.k_scales, cache.v_scales)
  k_step, v_step = (quant.quantize(x)[1] for x in (k, v))
  key_scale = max(float(jnp.max(k_scale)), float(jnp.max(k_step)))
  value_scale = max(float(jnp.max(v_scale)), float(jnp.max(v_step)))
  d = float(jnp.max(jnp.sum(jnp.abs(q), -1))) / np.sqrt(K) * key_scale / 2
  return value_scale / 2 + np.expm1(2 * d) * value_scale * 127


def check_step(kind, near_float: bool):
  """A step of 3 tokens with implementation=None (on a CPU: "xla" for a contiguous cache,
  "decode" for a paged one), over GQA heads: equal to the oracle over the dequantized cache
  and, with `near_float`, within `_bound` of the float cache's step."""
  options = KINDS[kind][1]
  q, k, v = step_inputs()

  @jax.jit  # one compile for everything: the test stays fast
  def run(cache, float_cache, q, k, v):
    cache = _fill(cache)
    out, after = _step(cache, q, k, v, options)
    float_out = _step(_fill(float_cache), q, k, v, options)[0] if near_float else None
    return cache, out, after.length, float_out, oracle_graph(cache, q, k, v, options, True)

  cache, out, length, want, oracle = run(_empty(kind, jnp.int8), _empty(kind, jnp.float32),
                                         q, k, v)
  chex.assert_trees_all_close(out, oracle, atol=2e-5)
  np.testing.assert_array_equal(length, FILL[:, 0] + 3)
  if near_float:
    err = float(jnp.max(jnp.abs(out - want)))
    assert 0 < err <= _bound(cache, q, k, v), err


def test_int8_step_equals_the_dequantized_oracle():
  check_step("full", near_float=False)  # every kind, and the float cache: the integration file


def test_every_cpu_step_kernel_reads_int8_as_the_oracle():
  """The "xla" step (implementation=None on a CPU) and "decode" (named) over one int8 cache:
  both equal the reference over the dequantized keys and values."""
  q, k, v = step_inputs()
  cache = filled("full", jnp.int8)
  oracle = shared_oracle(cache, q, k, v, {})
  for options in ({}, dict(implementation="decode")):
    out, _ = jit_step(options)(cache, q, k, v)
    chex.assert_trees_all_close(out, oracle, atol=2e-5)


def test_explain_names_the_kernel_that_reads_int8():
  query = jax.ShapeDtypeStruct((B, 1, H, K), jnp.float32)
  said = cache_lib.explain(query, _empty("full", jnp.int8), platform="cpu")
  assert said.implementation == "xla" and said.alternatives["decode"] == "runs"
  long = cache_lib.KVCache.create(B, dispatch.XLA_INT8_MAX_SLOTS + 1, G, K, V, jnp.int8)
  said = cache_lib.explain(query, long, platform="cpu")
  assert said.implementation == "decode" and said.alternatives["xla"] == "runs"
  assert said.reason.startswith("xla refuses (an int8 cache of S = 2049 > XLA_INT8_MAX_SLOTS")
  assert cache_lib.explain(query, cache_lib.KVCache.create(B, 4096, G, K, V), platform="cpu"
                       ).implementation == "xla"  # a float cache's step keeps xla
  assert cache_lib.explain(query, _empty("paged", jnp.int8), platform="cpu").implementation == (
      "decode")
  with flax_mha.stage_accelerator_kernels():
    for kind in ("full", "paged"):
      assert cache_lib.explain(query, _empty(kind, jnp.int8),
                           platform="cuda").implementation == "triton_decode"


def test_every_step_kernel_takes_int8_keys_and_the_dense_entrance_refuses_them():
  """Every kernel of a cache's or a paged step, on every platform, takes an int8 cache's keys
  (xla, decode, and triton_decode where staged); the dense entrance (dot_product_attention,
  whose kernels read floating keys) refuses int8 keys by name."""
  s = 64
  mods, _ = call_options.build((B,), 1, s, H, jnp.float32, True, q_positions=FILL,
                               kv_positions=jnp.broadcast_to(jnp.arange(s), (B, s)))
  int8 = lambda dim: jax.ShapeDtypeStruct((B, s, G, dim), jnp.int8)
  steppers = {"cache": {"xla", "decode", "triton_decode"}, "paged": {"decode", "triton_decode"}}
  with flax_mha.stage_accelerator_kernels():
    for layout, page in (("cache", None), ("paged", 16)):  # where an int8 cache's keys arrive
      for platform in dispatch.PLATFORMS:
        call = registry.Call.of(jnp.zeros((B, 1, H, K)), int8(K), int8(V), is_causal=True,
                                mods=mods, platform=platform, layout=layout, page=page)
        assert call.quantized
        judged = registry.refusals(call)
        takers = {name for name, why in judged.items() if why is None}
        want = steppers[layout] - (set() if platform == "cuda" else {"triton_decode"})
        assert takers == want, (layout, platform, judged)
  with pytest.raises(TypeError, match="key must have a floating dtype, got int8"):
    flax_mha.dot_product_attention(jnp.ones((1, 2, 2, 4)), *(jnp.ones((1, 2, 2, 4), jnp.int8),) * 2)


def _random_int8(cache):
  """`cache` holding random int8 values and scales (what they are does not matter here)."""
  rng = np.random.default_rng(5)
  fill = lambda x: None if x is None else jnp.asarray(
      rng.integers(-127, 128, x.shape) if x.dtype == jnp.int8 else rng.random(x.shape), x.dtype)
  return jax.tree.map(fill, cache)


def test_the_scales_follow_rows_and_pages():
  cache = _random_int8(_empty("full", jnp.int8))
  paged = _random_int8(_empty("paged", jnp.int8))
  src, dst = paged.page_indices[1, :2], jnp.array([6, 7])  # row 1's first pages, copied

  @jax.jit
  def moves(cache, paged):
    return cache.take_row(1), cache.put_row(0, cache.take_row(1)), paged.copy_pages(src, dst)

  row, swapped, copied = moves(cache, paged)
  chex.assert_shape([row.key_scale, row.value_scale], (1, G, 64))
  for name in ("key", "value", "key_scale", "value_scale"):
    np.testing.assert_array_equal(getattr(swapped, name)[0], getattr(cache, name)[1])
  for pool, scales in ((copied.k_pages, copied.k_scales), (copied.v_pages, copied.v_scales)):
    np.testing.assert_array_equal(pool[dst], pool[src])
    np.testing.assert_array_equal(scales[dst], scales[src])
  np.testing.assert_array_equal(copied.k_scales[:6], paged.k_scales[:6])
  assert paged.with_table(paged.page_indices[::-1]).k_scales is paged.k_scales


@pytest.mark.parametrize("make,error,match", [
    (lambda: flax_mha.nnx.MultiHeadAttention(2, 8, rngs=nnx.Rngs(0)).init_cache(
        (1, 4, 8), jnp.int8), TypeError, "dtype must be floating \\(flax's decode cache .* "
     "int8 KV cache is new_cache"),
    (lambda: cache_lib.KVCache.create(B, 8, G, K, dtype=jnp.int32), TypeError,
     "dtype must be a floating dtype or int8 .* got int32"),
    (lambda: cache_lib.PagedKVCache.create(4, 16, jnp.zeros((1, 2), jnp.int32), G, K,
                                           dtype=jnp.uint8), TypeError,
     "dtype must be a floating dtype or int8 .* got uint8"),
    (lambda: flax_mha.paged_attention(
        jnp.ones((1, 1, 2, K)), *(jnp.ones((4, 16, 1, K), jnp.int8),) * 2, jnp.array([3]),
        jnp.zeros((1, 2), jnp.int32)), TypeError, "k_pages and v_pages of int8 need their "
     "scales: pass kv_scales"),
    (lambda: flax_mha.paged_attention(
        jnp.ones((1, 1, 2, K)), *(jnp.ones((4, 16, 1, K), jnp.int8),) * 2, jnp.array([3]),
        jnp.zeros((1, 2), jnp.int32), kv_scales=(jnp.ones((4, 16, 2)),) * 2), ValueError,
     r"k_scales must have shape \[P, page, G\] = \(4, 16, 1\), got \(4, 16, 2\)"),
])
def test_bad_int8_arguments_are_named(make, error, match):
  with pytest.raises(error, match=match):
    make()


def test_pool_bytes():
  """An int8 pool holds K + 4 bytes per token and head (int8 values, a float32 scale)."""
  nbytes = lambda c: sum(x.nbytes for x in jax.tree.leaves((c.k_pages, c.v_pages, c.k_scales,
                                                            c.v_scales)))
  table = jnp.zeros((1, 2), jnp.int32)
  make = lambda dtype: cache_lib.PagedKVCache.create(4, 16, table, G, 128, dtype=dtype)
  assert nbytes(make(jnp.int8)) / nbytes(make(jnp.float32)) == (128 + 4) / (4 * 128)


def check_non_finite_value(kind, implementations):
  """One value entry written as inf through an int8 cache of `kind` (flax_mha.quant: stored as
  -128, read back as NaN, the row's scale from its finite entries): a step by each of
  `implementations` gives a non-finite output at that dim alone, for the heads of its
  key/value head in the row that holds it, as the float cache's step does; every other output
  equals the oracle over the dequantized cache (an inf scale made the whole row's values NaN)."""
  row, position, head, dim = 1, 3, 0, 2
  options = KINDS[kind][1]

  def fill(cache):
    k, v = arrays(0, (B, 27, G, K), (B, 27, G, V))
    v = v.at[row, position, head, dim].set(jnp.inf)
    positions = jnp.where(jnp.arange(27) < FILL, jnp.arange(27), -1)
    write = cache_lib.update_pages if hasattr(cache, "k_pages") else cache_lib.update
    return write(cache, k, v, positions)

  @jax.jit  # one compile for everything: the test stays fast
  def run(cache, float_cache, q, k, v):
    cache, float_cache = fill(cache), fill(float_cache)
    outs = [_step(cache, q, k, v, dict(options, implementation=implementation))[0]
            for implementation in implementations]
    return (_step(float_cache, q, k, v, options)[0], oracle_graph(cache, q, k, v, options, True),
            outs)

  float_out, oracle, outs = run(_empty(kind, jnp.int8), _empty(kind, jnp.float32),
                                *step_inputs(t=1))
  bad = np.zeros(float_out.shape, bool)  # [B, T, H, V]
  bad[row, :, head * (H // G):(head + 1) * (H // G), dim] = True
  np.testing.assert_array_equal(~np.isfinite(float_out), bad)
  for implementation, out in zip(implementations, outs):
    np.testing.assert_array_equal(~np.isfinite(out), bad, err_msg=str(implementation))
    np.testing.assert_allclose(np.where(bad, 0, out), np.where(bad, 0, oracle), atol=2e-5,
                               err_msg=str(implementation))


@pytest.mark.parametrize("kind,implementations", [
    ("full", (None, "decode", "xla")),  # the XLA step, "decode", the dense path
    ("paged", (None, "xla")),  # "decode" over pages, the gathered path
])
def test_a_non_finite_value_entry_reaches_its_own_dim_only(kind, implementations):
  """Every CPU reader of an int8 cache (`check_non_finite_value`); the Triton decode kernel
  interpreted is in tests/cache/test_cache_int8_integration.py."""
  check_non_finite_value(kind, implementations)
