"""The KV cache's decode step on NVIDIA GPUs (`flax_mha.kernels.triton_decode`) without a GPU:
the kernel in Pallas interpret mode, run where a CUDA process would run it (the cache's step and
`paged_attention`), equals the XLA step in values and gradients; what it refuses, by name; and
what a decoding step exports for 'cuda' holds it."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_mha
from flax_mha import cache as cache_lib
from flax_mha import _options
from flax_mha import mods as mods_lib
from flax_mha.kernels import decode
from flax_mha.kernels import triton
from flax_mha.kernels import triton_decode
from conftest import output_and_grads

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


@pytest.mark.integration  # each case compiles the kernel in interpret mode: ~2-4 s
@pytest.mark.parametrize("name", [n for n in CACHE_CASES if n != "gqa_one_token"])
def test_cache_step_equals_the_xla_step(name):
  _check_cache_step(name)


def test_cache_step_equals_the_xla_step_gqa():
  _check_cache_step("gqa_one_token")


def _check_cache_step(name):
  g, t, window, sink_tokens, capacity, options = CACHE_CASES[name]
  cache, *args = _cache_case(g, t, window, sink_tokens, capacity)
  options = dict(options)
  sinks = options.pop("sinks", None)
  args += [] if sinks is None else [sinks]
  got = output_and_grads(_step(cache, dict(options, implementation=INTERPRETED)), *args)
  want = output_and_grads(_step(cache, options), *args)
  chex.assert_trees_all_close(got, want, atol=2e-6, rtol=2e-6)


def _paged_case(seed=0, t=2, g=2, page=16, n=3, pool=8, dtype=jnp.float32):
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


@pytest.mark.integration  # the kernel in interpret mode: ~3 s a case
@pytest.mark.parametrize("options", [{}, dict(local_window_size=(20, 0), logit_soft_cap=3.0,
                                              sinks=jnp.asarray([0.5, -1.0, 2.0, 0.0]))],
                         ids=["plain", "window_soft_cap_sinks"])
def test_paged_attention_equals_the_xla_decode(options):
  """Through paged_attention: pages read in place by the table, NaN past each length unseen."""
  q, k_pages, v_pages, lengths, table = _paged_case()
  fn = lambda impl: lambda q, k, v: flax_mha.paged_attention(q, k, v, lengths, table,
                                                             implementation=impl, **options)
  got = output_and_grads(fn(INTERPRETED), q, k_pages, v_pages)
  want = output_and_grads(fn(None), q, k_pages, v_pages)
  assert bool(jnp.isfinite(got[0]).all())
  chex.assert_trees_all_close(got, want, atol=2e-6, rtol=2e-6)


def _over_layers(fn):
  """fn(q, k_pages, v_pages) summed over layers: a lax.scan over stacked [layers, ...] pools."""
  def layers(q, k_layers, v_layers):
    step = lambda total, kv: (total + fn(q, *kv), None)
    zeros = jnp.zeros(q.shape[:-1] + (v_layers.shape[-1],), q.dtype)
    return jax.lax.scan(step, zeros, (k_layers, v_layers))[0]
  return layers


# name -> (transform of fn(q, k_pages, v_pages), how its arguments are built from one case's)
PAGED_TRANSFORMS = {
    "vmap": (lambda f: jax.vmap(f, in_axes=(0, None, None)),
             lambda q, k, v: (jnp.stack([q, -q]), k, v)),
    "scan_over_layers": (_over_layers,
                         lambda q, k, v: (q, jnp.stack([k, 0.5 * k]), jnp.stack([v, 2.0 * v]))),
    "checkpoint": (jax.checkpoint, lambda q, k, v: (q, k, v)),
}


@pytest.mark.integration  # the kernel in interpret mode: ~3 s a case
@pytest.mark.parametrize("transform", sorted(PAGED_TRANSFORMS))
def test_paged_attention_under_transforms(transform):
  """The kernel under vmap (two queries over one pool), a scan over layers (a pool per layer)
  and jax.checkpoint, jitted with gradients: as the XLA decode under the same transform."""
  q, k_pages, v_pages, lengths, table = _paged_case()
  wrap, arguments = PAGED_TRANSFORMS[transform]
  fn = lambda impl: wrap(lambda q, k, v: flax_mha.paged_attention(
      q, k, v, lengths, table, local_window_size=(20, 0), implementation=impl))
  args = arguments(q, k_pages, v_pages)
  got = output_and_grads(fn(INTERPRETED), *args)
  want = output_and_grads(fn(None), *args)
  assert bool(jnp.isfinite(got[0]).all())
  chex.assert_trees_all_close(got, want, atol=2e-6, rtol=2e-6)


@pytest.mark.integration
def test_bfloat16_pages():
  q, k_pages, v_pages, lengths, table = _paged_case(dtype=jnp.bfloat16, t=1)
  v_pages = jnp.nan_to_num(v_pages)
  mods, _ = _options.build((B,), 1, 48, H, q.dtype, True,
                                    q_positions=lengths[:, None] - 1,
                                    kv_positions=jnp.where(jnp.arange(48) < lengths[:, None],
                                                           jnp.arange(48), -1))
  cfg, cfg_bwd = decode.configs(0.25, 0.0, 1, 48, K, 16)
  got, _ = triton_decode.paged_attention(q, k_pages, v_pages, table, lengths, mods, cfg, cfg_bwd,
                                         interpret=True)
  want, _ = decode.paged(q, k_pages, v_pages, table, lengths, mods, cfg, cfg_bwd, 2)
  assert got.dtype == jnp.bfloat16
  chex.assert_trees_all_close(got.astype(jnp.float32), want.astype(jnp.float32), atol=3e-2)


def _mods(**options):
  q_pos, kv_pos = jnp.zeros((B, 1), jnp.int32), jnp.zeros((B, 32), jnp.int32)
  return _options.build((B,), 1, 32, H, jnp.float32, True, q_positions=q_pos,
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
  q, k_pages, v_pages, lengths, table = _paged_case()
  checks = [jax.export.DisabledSafetyCheck.custom_call(triton.CUSTOM_CALL)]
  fn = jax.jit(lambda q, k, v: flax_mha.paged_attention(q, k, v, lengths, table))
  with flax_mha.stage_accelerator_kernels():
    module = jax.export.export(fn, platforms=("cuda",), disabled_checks=checks)(
        q, k_pages, v_pages).mlir_module()
  assert "flax_mha_flash_decode" in module
