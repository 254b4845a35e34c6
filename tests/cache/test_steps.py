"""One chooser for every entrance: a KV cache's step and paged attention get their kernel from
`flax_mha.dispatch` (layouts "cache" and "paged" of one `registry.Call`), with one threshold
for "a few queries", and `flax_mha.cache.explain` says what runs on each platform and why."""

from __future__ import annotations

import ast
import pathlib

import jax
import jax.numpy as jnp
import pytest

import flax_mha
from flax_mha import cache as cache_lib
from flax_mha import call_options
from flax_mha import checks
from flax_mha import dispatch
from flax_mha.kernels import registry
from flax_mha.kernels import triton_decode

B, H, G, K = 2, 4, 2, 16


def _query(t):
  return jax.ShapeDtypeStruct((B, t, H, K), jnp.float32)


def shared_caches():
  return {"contiguous": cache_lib.KVCache.create(B, 64, G, K),
          "rolling": cache_lib.KVCache.create(B, 64, G, K, window=8),
          "paged": cache_lib.PagedKVCache.create(8, 16, jnp.zeros((B, 4), jnp.int32), G, K)}


def test_the_step_kernels_are_registered_by_layout():
  assert registry.names("cache") == ("xla", "decode", "triton_decode")
  assert registry.names("paged") == ("decode", "triton_decode")
  assert "triton_decode" not in flax_mha.IMPLEMENTATIONS
  kernel = registry.get("triton_decode")
  assert (kernel.platform, kernel.staged) == ("cuda", True)
  with pytest.raises(ValueError, match="implementation must be None, a callable or one of"):
    flax_mha.dot_product_attention(*(jnp.ones((B, 8, H, K)),) * 3, implementation="triton_decode")


def test_each_kernel_owns_its_entry_for_each_layout_it_takes():
  """Every kernel that declares a layout but "dense" carries its own entry for it (what the
  steps and the ring call), and nothing else does; an entry missing is named."""
  for name in registry.names("cache") + registry.names("paged") + registry.names("ring_block"):
    kernel = registry.get(name)
    assert set(kernel.entries) == set(kernel.layouts) - {"dense"}, name
    assert all(registry.entry(name, layout) is kernel.entries[layout]
               for layout in kernel.entries)
  assert registry.entry("xla", "dense") is registry.get("xla").attention
  with pytest.raises(KeyError, match="kernel 'rows' has no entry for the layout 'cache'"):
    registry.entry("rows", "cache")


@pytest.mark.parametrize("kind, on_cpu", [("contiguous", "xla"), ("rolling", "xla"),
                                          ("paged", "decode")])
def test_explain_names_the_step_kernel_per_platform(kind, on_cpu):
  cache = shared_caches()[kind]
  said = cache_lib.explain(_query(1), cache, platform="cpu")
  assert said.implementation == on_cpu and "FEW_QUERIES = 32" in said.reason
  assert said.alternatives["triton_decode"].startswith("refuses: the Triton decode kernel is for "
                                                       "NVIDIA GPUs")
  cuda = cache_lib.explain(_query(1), cache, platform="cuda")
  assert cuda.implementation == on_cpu and "stage_accelerator_kernels()" in cuda.reason
  with flax_mha.stage_accelerator_kernels():
    assert cache_lib.explain(_query(1), cache, platform="cuda").implementation == "triton_decode"
    masked = cache_lib.explain(_query(1), cache, platform="cuda",
                           mask_mod=lambda b, h, i, j: i >= j)
    assert masked.implementation == on_cpu and "not MaskMod" in masked.reason
  assert cache_lib.explain(_query(1), cache, platform="tpu").implementation == on_cpu


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_one_threshold_for_a_few_queries(kind):
  """FEW_QUERIES queries are a step on every entrance, one more are not (the keys then go to
  dot_product_attention)."""
  cache = shared_caches()[kind]
  few = dispatch.FEW_QUERIES
  assert cache_lib.explain(_query(few), cache, platform="cpu").implementation != "dense"
  beyond = cache_lib.explain(_query(few + 1), cache, platform="cpu")
  assert beyond.implementation == "dense" and f"> FEW_QUERIES = {few}" in beyond.reason
  residual = cache_lib.explain(_query(1), cache, platform="cpu", return_residual=True)
  assert residual.implementation == ("dense" if kind == "contiguous" else "decode")


def test_the_decode_kernel_named_is_refused_by_its_options():
  cache = shared_caches()["contiguous"]
  interpreted = triton_decode.make_attention(interpret=True)
  q = jnp.ones((B, 1, H, K))
  with pytest.raises(ValueError, match="implementation='triton_decode' cannot run: .*dropout"):
    cache_lib.attend(q, q[:, :, :G], q[:, :, :G], cache, implementation=interpreted,
                     dropout_rate=0.5, dropout_rng=jax.random.key(0))


def kernel_imports(source: str) -> set[str]:
  """The kernel modules and packages a module's source imports, by their dotted names (`from
  flax_mha import kernels` is the package, `flax_mha.kernels`)."""
  tree = ast.parse(source)
  imported = {node.module + "." + alias.name if isinstance(node, ast.ImportFrom) else alias.name
              for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
              for alias in node.names}
  return {name for name in imported
          if name == "flax_mha.kernels" or name.startswith("flax_mha.kernels.")}


def test_dispatch_reads_the_kernels_through_the_registry():
  """The rule imports no kernel module nor the kernels' package (which registers them: that
  import once made a circle through ring): what it asks of a kernel is its `refuses`, its
  declared platform and staging, and its `hints`."""
  assert kernel_imports(pathlib.Path(dispatch.__file__).read_text()) == {
      "flax_mha.kernels.registry"}
  for planted in ("from flax_mha import kernels\n", "import flax_mha.kernels\n",
                  "from flax_mha.kernels import decode\n"):
    assert kernel_imports(planted + "from flax_mha.kernels import registry\n") != {
        "flax_mha.kernels.registry"}

@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@pytest.mark.parametrize("t", [1, dispatch.FEW_QUERIES + 1])
def test_a_cached_call_decides_once(monkeypatch, kind, t):
  """A prefill past FEW_QUERIES queries through a cache checks its q/k/v once, builds its mods
  once and chooses once for each platform (it built and chose twice: the step's entrance first
  found "dense", then dot_product_attention started over); a step chooses once per platform
  (its "xla" entry builds its own prefix's mods)."""
  counts = {"build": 0, "choose cpu": 0, "check_qkv": 0}

  def counting(name, fn, only=lambda *a, **k: True):
    def counted(*args, **kwargs):
      counts[name] += bool(only(*args, **kwargs))
      return fn(*args, **kwargs)
    return counted
  monkeypatch.setattr(call_options, "build", counting("build", call_options.build))
  monkeypatch.setattr(dispatch, "choose", counting(
      "choose cpu", dispatch.choose, lambda call: call.platform == "cpu"))
  monkeypatch.setattr(checks, "check_qkv", counting("check_qkv", checks.check_qkv))
  cache = shared_caches()[kind]
  q = _query(t)
  jax.eval_shape(lambda q, c: cache_lib.attend(q, q[:, :, :G], q[:, :, :G], c), q, cache)
  if t > dispatch.FEW_QUERIES:
    assert counts == {"build": 1, "choose cpu": 1, "check_qkv": 1}
  assert counts["choose cpu"] == 1
