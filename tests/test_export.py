"""GPU and TPU readiness without the hardware: `jax.export` lowers forward+backward of every
implementation for 'cuda' and 'tpu' from this CPU, with and without mask/score terms and options,
and `implementation=None` lowers the choice of the platform it is lowered for, not the CPU's.

Lowering only (no compile for those platforms); the ring's export runs on 8 emulated devices in
tests/multidevice/check_ring.py. A compiled accelerator kernel named here is refused by name in
tests/test_export_integration.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_mha

ACCELERATORS = ("cuda", "tpu")
B, H, G, K = 2, 4, 2, 16
# name -> options: plain causal, mask/score functions, a window with a soft cap, segment ids.
OPTIONS = {
    "causal": dict(is_causal=True),
    "mods": dict(mask_mod=lambda b, h, q, kv: (q + kv) % 3 != 1,
                 score_mod=lambda s, b, h, q, kv: s - 0.01 * jnp.abs(q - kv)),
    "window_soft_cap": dict(is_causal=True, local_window_size=(8, 0), logit_soft_cap=30.0),
    "segment_ids": dict(q_segment_ids=jnp.repeat(jnp.arange(2), 32)[None].repeat(B, 0)),
}


def shapes(t):
  return (jax.ShapeDtypeStruct((B, t, H, K), jnp.float32),
          jax.ShapeDtypeStruct((B, t, G, K), jnp.float32),
          jax.ShapeDtypeStruct((B, t, G, K), jnp.float32))


def _taking(options: str) -> list[str]:
  """The registered kernels that take a call with `options` here, as explain reports them
  (cuDNN needs a CUDA GPU in the process, ring a mesh: check_ring.py exports the ring)."""
  said = flax_mha.explain(*shapes(64), platform="cpu", **OPTIONS[options])
  return [said.implementation, *(n for n, v in said.alternatives.items() if v == "runs")]


# None and every registered kernel that takes the options, read from the registry.
CASES = [(name, options) for options in OPTIONS for name in (None, *_taking(options))]


def fwd_bwd(implementation, **options):
  """jit: (q, k, v) -> (loss, (dq, dk, dv)) through dot_product_attention."""
  def loss(q, k, v):
    out = flax_mha.dot_product_attention(q, k, v, implementation=implementation, **options)
    return jnp.sum(out * out)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def export(fn, platforms, t):
  return jax.export.export(fn, platforms=platforms)(*shapes(t))


@pytest.mark.parametrize("implementation, options", CASES)
@pytest.mark.parametrize("platform", ACCELERATORS)
def test_exports_for_gpu_and_tpu(implementation, options, platform):
  """One platform per export: a program lowered for 'tpu' and another platform at once cannot
  hold splash's Pallas TPU kernel, which None picks on 'tpu' in a process with a TPU (jax
  lowers every `platform_dependent` branch for each platform of the module)."""
  exported = export(fwd_bwd(implementation, **OPTIONS[options]), (platform,), 64)
  assert exported.platforms == (platform,)
  loss, grads = exported.out_avals[0], exported.out_avals[1:]
  assert loss.shape == () and [g.shape for g in grads] == [x.shape for x in shapes(64)]


def _loops(module_text: str) -> bool:
  """Whether a lowered module holds a loop: "rows" and "chunked" do, the plain graph does not."""
  return "stablehlo.while" in module_text


@pytest.mark.parametrize("t, options, on_cpu", [
    (256, dict(is_causal=True), "rows"),  # T·S beyond the CPU's crossover
    (512, dict(local_window_size=16), "chunked"),  # a band: chunked skips most tiles on CPU
])
def test_none_lowers_the_platforms_choice(t, options, on_cpu):
  fn = fwd_bwd(None, **options)
  q, k, v = shapes(t)
  assert flax_mha.explain(q, k, v, platform="cpu", **options).implementation == on_cpu
  assert flax_mha.explain(q, k, v, platform="cuda", **options).implementation == "xla"
  assert flax_mha.explain(q, k, v, platform="tpu", **options).implementation == "xla"
  assert not _loops(export(fn, ("cuda",), t).mlir_module())  # the CPU's pick left out
  tpu = export(fn, ("tpu",), t).mlir_module()  # no TPU here: splash is not staged
  assert not _loops(tpu) and "tpu_custom_call" not in tpu
  assert _loops(export(fn, ("cpu",), t).mlir_module())
  both = export(fn, ("cpu", "cuda"), t).mlir_module()  # both branches, picked at compile time
  assert _loops(both) and "stablehlo.case" in both


def test_none_runs_the_cpu_choice_here(rng):
  """Under jit and eagerly, None on this CPU computes what its CPU pick does (the other
  platforms' branch left out), values and gradients."""
  x = [jnp.asarray(rng.standard_normal(s.shape), jnp.float32) for s in shapes(160)]
  assert flax_mha.explain(*x, is_causal=True, platform="cpu").implementation == "rows"
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  jax.tree.map(close, fwd_bwd(None, is_causal=True)(*x), fwd_bwd("rows", is_causal=True)(*x))
  close(flax_mha.dot_product_attention(*x, is_causal=True),
        flax_mha.dot_product_attention(*x, is_causal=True, implementation="rows"))


def check_the_decode_kernel_is_refused_by_name_here():
  """The Triton decode kernel named for a cache step or paged_attention: refused here compiled,
  run interpreted; a step it cannot take is refused with its reason."""
  from flax_mha import cache as cache_lib
  from flax_mha.kernels import triton_decode
  cache = cache_lib.KVCache.create(B, 32, G, K)
  q, k = jnp.ones((B, 1, H, K)), jnp.ones((B, 1, G, K))
  with pytest.raises(ValueError, match="'triton_decode' is a 'cuda' kernel and this process "
                                       r"has no 'cuda' device .*make_attention\(interpret"):
    cache_lib.attend(q, k, k, cache, implementation="triton_decode")
  interpreted = triton_decode.make_attention(interpret=True)
  np.testing.assert_allclose(cache_lib.attend(q, k, k, cache, implementation=interpreted)[0],
                             cache_lib.attend(q, k, k, cache)[0], atol=1e-6)
  with pytest.raises(ValueError, match="implementation='triton_decode' cannot run: .*not MaskMod"):
    cache_lib.attend(q, k, k, cache, implementation=interpreted,
                     mask_mod=lambda b, h, i, j: i >= j)
  with pytest.raises(TypeError, match="interpret must be a bool"):
    triton_decode.make_attention(interpret="yes")
