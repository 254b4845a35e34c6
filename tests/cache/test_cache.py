"""The KV cache as data (flax_mha.cache) through both front ends: prefill in one call or in
chunks, then steps, equal to attention over the whole sequence recomputed; rolling caches for
local layers (with sink tokens) stay the window's size; capacity overflow is an error (NaN rows
under jit); the front ends' bad arguments. Rows of different lengths in one batch, and the rest
of the cached-calls grid, are in tests/cache/test_cache_integration.py."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_mha
from flax_mha import cache as cache_lib
from flax_mha.models.lm import DecoderLM, LMConfig

from helpers import split_grid

B, L, D, H, G = 2, 19, 16, 4, 2
OPTIONS = {
    "plain": dict(),
    "rotary_gqa": dict(rotary_max_wavelength=100.0),
    "rolling_window": dict(rotary_max_wavelength=100.0, local_window_size=(4, 0)),
    "rolling_sink_tokens": dict(local_window_size=(4, 0), sink_tokens=2, logit_soft_cap=3.0),
    "soft_cap_learned_sinks": dict(logit_soft_cap=2.0, learned_sinks=True),
}
CHUNKS = {"prefill_then_steps": [7, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
          "chunks": [5, 3, 4, 7], "whole": [L]}


def front_end(kind, kwargs):
  """(call(x, **kw), new_cache(batch, capacity)) for the linen or NNX self-attention."""
  if kind == "linen":
    module = flax_mha.SelfAttention(num_heads=H, num_kv_heads=G, qkv_features=D, **kwargs)
    params = module.init(jax.random.key(1), jnp.zeros((B, L, D)), is_causal=True)
    if "sinks" in params["params"]:
      params["params"]["sinks"] = jnp.array([0.5, -1.0, 2.0, 0.1])
    call = functools.partial(module.apply, params)
    return call, functools.partial(module.new_cache, in_features=D)
  module = flax_mha.nnx.SelfAttention(H, D, D, num_kv_heads=G, rngs=nnx.Rngs(1), **kwargs)
  if module.sinks is not None:
    module.sinks[...] = jnp.array([0.5, -1.0, 2.0, 0.1])
  return module, module.new_cache


CACHED_GRID = split_grid(
    lambda kind, option, chunks: (kind == "linen" and chunks == "prefill_then_steps") or (
        option == "rolling_sink_tokens" and (kind == "linen" or chunks == "chunks")),
    lambda kind, option, chunks: False,
    ["linen", "nnx"], sorted(OPTIONS), sorted(CHUNKS))


@pytest.mark.parametrize("kind,option,chunks", CACHED_GRID.unit)
def test_cached_calls_equal_the_whole_sequence(kind, option, chunks):
  call, new_cache = front_end(kind, OPTIONS[option])
  x = jax.random.normal(jax.random.key(0), (B, L, D))
  want = call(x, is_causal=True)
  cache = new_cache(B, 32)
  if kind == "linen":
    step = jax.jit(lambda x, cache: call(x, cache=cache))
  else:  # the module is an argument of nnx.jit, not a closure
    step = functools.partial(nnx.jit(lambda m, x, cache: m(x, cache=cache)), call)
  outs, start = [], 0
  for size in CHUNKS[chunks]:
    y, cache = step(x[:, start:start + size], cache)
    outs.append(y)
    start += size
  np.testing.assert_allclose(jnp.concatenate(outs, axis=1), want, atol=2e-6, rtol=2e-6)
  np.testing.assert_array_equal(cache.length, [L, L])
  window = OPTIONS[option].get("local_window_size")
  if window is not None:  # a rolling cache: the window (and sink tokens), not the sequence
    assert cache.capacity == window[0] + OPTIONS[option].get("sink_tokens", 0)


def test_linen_new_cache_reads_its_head_dims_from_bound_params():
  """qkv_features None: a bound linen module reads K and V from its kernels (no in_features),
  as NNX's new_cache needs none; unbound, it asks for in_features by name."""
  module = flax_mha.MultiHeadAttention(num_heads=H, num_kv_heads=G, v_features=3 * H)
  x = jnp.zeros((B, L, D))
  params = module.init(jax.random.key(1), x)
  bound = module.bind(params).new_cache(B, 11)
  chex.assert_shape([bound.key, bound.value], [(B, G, 11, D // H), (B, G, 11, 3)])
  theirs = flax_mha.nnx.MultiHeadAttention(H, D, num_kv_heads=G, v_features=3 * H,
                                           rngs=nnx.Rngs(0)).new_cache(B, 11)
  chex.assert_trees_all_equal_shapes_and_dtypes(bound, theirs)
  with pytest.raises(ValueError, match=r"pass in_features=D, or .*bind\(variables\)"):
    module.new_cache(B, 11)


def test_rolling_cache_bytes_do_not_grow_with_the_generated_length():
  module = flax_mha.SelfAttention(num_heads=H, num_kv_heads=G, local_window_size=(8, 0),
                                  sink_tokens=4)
  sizes = {n: sum(x.nbytes for x in jax.tree.leaves(module.new_cache(1, n, in_features=D)))
           for n in (1024, 8192, 65536)}
  assert len(set(sizes.values())) == 1, sizes


def test_writing_past_the_capacity_is_an_error():
  """Eagerly a ValueError; under jit (positions traced) the write is dropped, the row's length
  passes the capacity and its outputs are NaN from then on, the other rows untouched."""
  cache = cache_lib.KVCache.create(2, 4, G, 8)
  k = jnp.ones((2, 3, G, 8))
  cache = cache_lib.update(cache, k, k, cache_lib.next_positions(cache, 3))
  with pytest.raises(ValueError, match="KV cache overflow: writing position 5 into a cache of "
                                       "capacity 4"):
    cache_lib.update(cache, k, k, cache_lib.next_positions(cache, 3))
  step = jax.jit(lambda c, pos: cache_lib.attend(k[:, :1], k[:, :1], k[:, :1], c, pos))
  out, after = step(cache, jnp.array([[3], [4]], jnp.int32))  # row 1 writes past the end
  np.testing.assert_array_equal(after.length, [4, 5])
  assert np.isfinite(out[0]).all() and np.isnan(out[1]).all()
  out, _ = step(after, jnp.array([[-1], [-1]], jnp.int32))  # padding only: still NaN
  assert np.isfinite(out[0]).all() and np.isnan(out[1]).all()


def test_room_made_by_caller_is_part_of_the_trace_key():
  """One jitted function called before, inside and after `room_made_by_caller()`: traced
  anew each time the setting changes, so the check is in the program exactly outside it."""
  cache = cache_lib.KVCache.create(1, 4, G, 8)
  k = jnp.ones((1, 1, G, 8))
  traces = []

  @jax.jit
  def step(cache, positions):
    traces.append(cache_lib.ROOM_MADE_BY_CALLER.value)
    return cache_lib.attend(k, k, k, cache, positions)[0]

  past_the_end = jnp.array([[9]], jnp.int32)
  assert np.isnan(step(cache, past_the_end)).all()
  with cache_lib.room_made_by_caller():
    assert np.isfinite(step(cache, past_the_end)).all()
  assert np.isnan(step(cache, past_the_end)).all()
  assert traces == [False, True]  # the third call reuses the first trace
  with pytest.raises(TypeError, match="made must be a bool"):
    cache_lib.room_made_by_caller("yes")


def check_a_step_under_scan_and_grad():
  """Steps of a cache inside lax.scan, differentiated through: equal to the whole sequence."""
  call, new_cache = front_end("linen", OPTIONS["rolling_window"])
  x = jax.random.normal(jax.random.key(3), (B, L, D))

  def by_steps(x):
    def body(cache, x_t):
      y, cache = call(x_t[:, None], cache=cache)
      return cache, y[:, 0]
    return jax.lax.scan(body, new_cache(B, 32), x.swapaxes(0, 1))[1].swapaxes(0, 1)

  chex.assert_trees_all_close(jax.jit(by_steps)(x), call(x, is_causal=True), atol=2e-6)
  loss = lambda f: lambda x: jnp.sum(jnp.sin(f(x)))
  chex.assert_trees_all_close(jax.grad(loss(by_steps))(x),
                              jax.grad(loss(lambda x: call(x, is_causal=True)))(x), atol=2e-5)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(cache="nope"), TypeError, "cache must be a flax_mha.cache.KVCache"),
    (dict(segment_ids=jnp.zeros((B, 3), jnp.int32)), ValueError,
     "segment_ids is not taken with cache=|q_segment_ids is not taken with cache="),
    (dict(bias=jnp.zeros((B, H, 3, 3))), ValueError, "bias is not taken with cache="),
])
def test_bad_cache_calls_are_named(kwargs, error, match):
  call, new_cache = front_end("linen", {})
  kwargs = dict(dict(cache=new_cache(B, 8)), **kwargs)
  with pytest.raises(error, match=match):
    call(jnp.zeros((B, 3, D)), **kwargs)


def test_a_rolling_cache_belongs_to_its_window():
  call, _ = front_end("linen", dict(local_window_size=(4, 0)))
  other = cache_lib.KVCache.create(B, 32, G, D // H, window=6)
  with pytest.raises(ValueError, match="a rolling cache of window 6"):
    call(jnp.zeros((B, 1, D)), cache=other)


def check_a_chunk_longer_than_the_cache_is_refused_while_tracing():
  """Under jit a chunk of T > capacity tokens at the next positions (static sizes) is a
  ValueError at trace time, the overflow message its first line (not XLA's callback error
  around a traceback), for the cache and for a model's prefill (DecoderLM.logits). A padded
  chunk (serving's prefill buckets) writes only its real tokens: not refused by its length."""
  cache = cache_lib.KVCache.create(1, 4, G, 8)
  k = jnp.zeros((1, 5, G, 8))
  jitted = jax.jit(lambda c: cache_lib.attend(k, k, k, c)[1])
  with pytest.raises(ValueError) as info:
    jitted(cache)
  assert str(info.value).splitlines()[0] == (
      "KV cache overflow: writing 5 tokens into a cache of capacity 4; make the cache larger "
      "(capacity >= prompt + new tokens)")
  lm = DecoderLM(LMConfig(vocab_size=11, d_model=16, num_heads=2, num_kv_heads=1, num_layers=2,
                          d_ff=16, local_window=None))
  tokens = jnp.ones((1, 5), jnp.int32)
  params = lm.init(jax.random.key(0), tokens)
  lm_cache = lm.apply(params, tokens, 4, method=DecoderLM.init_cache)
  with pytest.raises(ValueError) as info:
    jax.jit(lambda c: lm.apply(params, tokens, c, method=DecoderLM.logits))(lm_cache)
  assert str(info.value).splitlines()[0].startswith("KV cache overflow: writing 5 tokens")
