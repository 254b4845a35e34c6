"""The KV cache's decode step on NVIDIA GPUs (`flax_mha.kernels.triton_decode`) without a GPU:
the kernel in Pallas interpret mode, run where a CUDA process would run it (the cache's step and
`paged_attention`), equals the XLA step in values and gradients; what it refuses, by name; and
what a decoding step exports for 'cuda' holds it. The other cases of the step and of
paged_attention are in tests/kernels/test_triton_decode_integration.py."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_mha
from flax_mha import cache as cache_lib
from flax_mha import call_options
from flax_mha import mods as mods_lib
from flax_mha.kernels import triton
from flax_mha.kernels import triton_decode
from helpers import output_and_grads

B, H, K, V = 2, 4, 16, 8


# The kernel in Pallas interpret mode, asked for by name: it runs (or is refused by name) where
# a CUDA process runs it compiled; the XLA step it is compared with is what None runs here.
INTERPRETED = triton_decode.make_attention(interpret=True)


def _cache_case(g, t, window, sink_tokens, capacity, seed=0):
  """(cache filled by prompts of 5 and 27 tokens, the step's query, key, value)."""
  rng = np.random.default_rng(seed)
  arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  cache = cache_lib.KVCache.create(B, capacity, g, K, V, window=window, sink_tokens=sink_tokens)
  positions = jnp.where(jnp.arange(27) < jnp.asarray([[5], [27]]), jnp.arange(27), -1)
  _, cache = cache_lib.attend(arr(B, 27, H, K), arr(B, 27, g, K), arr(B, 27, g, V), cache,
                              positions)
  return cache, arr(B, t, H, K), arr(B, t, g, K), arr(B, t, g, V)


# name -> (G, T, window of a rolling cache, its sink tokens, capacity, attention options)
CACHE_CASES = {
    "gqa_one_token": (2, 1, None, 0, 64, {}),
    "mqa_three_tokens_soft_cap_window": (1, 3, None, 0, 70, dict(
        logit_soft_cap=2.0, local_window_size=(9, 0))),
    "rolling_sink_tokens": (4, 2, 8, 2, 64, {}),
    "sinks": (2, 1, None, 0, 300, dict(sinks=jnp.asarray([0.5, -1.0, 2.0, 0.0]))),
}


def _step(cache, options):
  def fn(q, k, v, *sinks):
    extra = dict(sinks=sinks[0]) if sinks else {}
    return cache_lib.attend(q, k, v, cache, **options, **extra)[0]
  return fn


def check_cache_step_equals_the_xla_step_gqa():
  check_cache_step("gqa_one_token")


def check_cache_step(name):
  g, t, window, sink_tokens, capacity, options = CACHE_CASES[name]
  cache, *args = _cache_case(g, t, window, sink_tokens, capacity)
  options = dict(options)
  sinks = options.pop("sinks", None)
  args += [] if sinks is None else [sinks]
  got = output_and_grads(_step(cache, dict(options, implementation=INTERPRETED)), *args)
  want = output_and_grads(_step(cache, options), *args)
  chex.assert_trees_all_close(got, want, atol=2e-6, rtol=2e-6)


def paged_case(seed=0, t=2, g=2, page=16, n=3, pool=8, dtype=jnp.float32):
  """Query, pools whose slots past every length hold NaN (a reused page), lengths, table."""
  rng = np.random.default_rng(seed)
  arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  lengths = jnp.asarray([3, 40])
  table = jnp.asarray(rng.permutation(pool)[:B * n].reshape(B, n), jnp.int32)
  stale = np.zeros((pool, page), bool)
  for row, length in enumerate([3, 40]):
    for slot in range(length, n * page):
      stale[table[row, slot // page], slot % page] = True
  v_pages = jnp.where(stale[:, :, None, None], jnp.nan, arr(pool, page, g, V))
  return arr(B, t, H, K), arr(pool, page, g, K), v_pages, lengths, table


def _mods(**options):
  q_pos, kv_pos = jnp.zeros((B, 1), jnp.int32), jnp.zeros((B, 32), jnp.int32)
  return call_options.build((B,), 1, 32, H, jnp.float32, True, q_positions=q_pos,
                                 kv_positions=kv_pos, **options)[0]


def test_refusals_are_named():
  q = jnp.zeros((B, 1, H, K))
  reason = triton_decode.reason
  assert reason(q, 2, K, V, _mods()) is None
  assert "no dense mask and no dropout" in reason(q, 2, K, V, _mods(), dropout_rate=0.1)
  assert "no dense mask" in reason(q, 2, K, V, _mods(), mask=jnp.ones((B, H, 1, 32), bool))
  assert "not MaskMod" in reason(q, 2, K, V, _mods(mask_mod=lambda b, h, q, kv: q >= kv))
  assert "not ScoreMod" in reason(q, 2, K, V, _mods(score_mod=lambda s, b, h, q, kv: s))
  assert "float32, bfloat16 or float16, got float64" in reason(
      jax.ShapeDtypeStruct(q.shape, jnp.float64), 2, K, V, _mods())
  assert "head dims up to 256" in reason(q, 2, K, 512, _mods())
  assert "pages of a power of two >= 16 tokens, got 12" in reason(q, 2, K, V, _mods(), block=12)
  assert "T·H/G <= 256 query rows, got 512" in reason(jnp.zeros((B, 32, 16, K)), 1, K, V,
                                                      _mods())
  assert "not Positions, Positions" in reason(q, 2, K, V, mods_lib.Mods(
      masks=_mods().masks * 2))


def _decode_step_module(cache, staged: bool, **options) -> str:
  """What one jitted cache step (forward and the query's gradient) lowers to for 'cuda'."""
  def step(q, k, v):
    out, _ = cache_lib.attend(q, k, v, cache, **options)
    return jnp.sum(out ** 2)

  shapes = [jax.ShapeDtypeStruct((B, 1, H, K), jnp.float32),
            jax.ShapeDtypeStruct((B, 1, cache.key.shape[1], K), jnp.float32),
            jax.ShapeDtypeStruct((B, 1, cache.key.shape[1], V), jnp.float32)]
  checks = [jax.export.DisabledSafetyCheck.custom_call(triton.CUSTOM_CALL)]
  # (a decoding loop sizes its cache: no overflow check in the program)
  with flax_mha.stage_accelerator_kernels(staged), cache_lib.room_made_by_caller():
    exported = jax.export.export(jax.jit(jax.value_and_grad(step)), platforms=("cuda",),
                                 disabled_checks=checks)(*shapes)
  return exported.mlir_module()


@pytest.mark.parametrize("window", [None, 8])
def test_a_decode_step_exports_the_kernel_for_cuda(window):
  cache = cache_lib.KVCache.create(B, 512, 2, K, V, window=window)
  module = _decode_step_module(cache, True, logit_soft_cap=5.0)
  assert triton.CUSTOM_CALL in module and "flax_mha_flash_decode" in module
  assert "flax_mha_flash_decode" not in _decode_step_module(cache, False)
  refused = _decode_step_module(cache, True, mask_mod=lambda b, h, q, kv: kv != 3)
  assert "flax_mha_flash_decode" not in refused


def test_paged_attention_exports_the_kernel_for_cuda():
  q, k_pages, v_pages, lengths, table = paged_case()
  checks = [jax.export.DisabledSafetyCheck.custom_call(triton.CUSTOM_CALL)]
  fn = jax.jit(lambda q, k, v: flax_mha.paged_attention(q, k, v, lengths, table))
  with flax_mha.stage_accelerator_kernels():
    module = jax.export.export(fn, platforms=("cuda",), disabled_checks=checks)(
        q, k_pages, v_pages).mlir_module()
  assert "flax_mha_flash_decode" in module
