"""`flax_mha.explain`: which implementation `implementation=None` runs, why, and what every other
implementation says, on each platform; one decision with the dispatch (`flax_mha.dispatch`).

Everything here reads shapes only (jax.ShapeDtypeStruct): nothing is compiled.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh

import flax_mha
from flax_mha import dispatch
from flax_mha.kernels import registry
from flax_mha.kernels import chunked
from flax_mha import mods as mods_lib

ON_GPU = jax.default_backend() == "gpu"


def shapes(t, s=None, *, b=2, h=4, g=2, k=64, v=None, dtype=jnp.float32):
  """(query [B, T, H, K], key [B, S, G, K], value [B, S, G, V]) as shapes."""
  s = t if s is None else s
  sds = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)
  return sds(b, t, h, k), sds(b, s, g, k), sds(b, s, g, k if v is None else v)


def ids(b, n):
  return jax.ShapeDtypeStruct((b, n), jnp.int32)


@pytest.mark.parametrize("t, s, k, options, picked, says", [
    (64, 64, 64, {}, "xla", "SMALL_LOGITS_ROWS"),
    (640, 640, 64, {}, "rows", "query-row blocks"),
    (256, 256, 64, dict(is_causal=True), "rows", "SMALL_LOGITS_ROWS_CAUSAL"),
    (256, 256, 128, dict(is_causal=True), "xla", "SMALL_LOGITS_ROWS_CAUSAL_WIDE"),
    (512, 512, 128, dict(is_causal=True), "rows", "SMALL_LOGITS_ROWS_CAUSAL_WIDE"),
    (128, 32768, 64, {}, "chunked", "ROWS_MAX_KEYS"),
    (1, 8192, 64, {}, "decode", "DECODE_MIN_KEYS_DENSE"),
    (512, 512, 64, dict(logit_soft_cap=30.0), "xla", "SMALL_LOGITS = "),
    # A window: chunked visits 10 of its 16 tiles, so it takes over at 256² (measured).
    (512, 512, 64, dict(local_window_size=32), "chunked", "SMALL_LOGITS_SPARSE"),
    (512, 512, 64, dict(is_causal=True, local_window_size=(16, 0)), "chunked", "causal, K <= 64"),
    (512, 512, 128, dict(is_causal=True, local_window_size=(128, 0)), "chunked",
     "SMALL_LOGITS_SPARSE"),
    # A window alone: rows over each block's band of keys where the band is at most S/2.
    (4096, 4096, 64, dict(is_causal=True, local_window_size=(128, 0)), "rows", "band of 256"),
    (4096, 4096, 64, dict(local_window_size=(256, 256)), "rows", "ROWS_WINDOW_MIN_LOGITS"),
    (1024, 1024, 64, dict(local_window_size=(256, 256)), "chunked", "over S/2"),
    # Narrow heads with a causal or windowed mask: chunked from 128² (measured).
    (256, 256, 32, dict(is_causal=True, logit_soft_cap=50.0), "chunked", "BANDED_32"),
    (128, 128, 32, dict(is_causal=True, logit_soft_cap=50.0), "xla", "BANDED_32"),
    (256, 256, 32, dict(local_window_size=16), "chunked", "BANDED_32"),
    (256, 256, 32, dict(local_window_size=300), "xla", "SMALL_LOGITS = "),  # no limit: dense
    (256, 256, 32, dict(q_segment_ids=ids(2, 256)), "xla", "SMALL_LOGITS = "),
    # Segment ids are data: how much they hide is unknown at trace time, nothing moves.
    (512, 512, 64, dict(q_segment_ids=ids(2, 512)), "xla", "SMALL_LOGITS = "),
])
def test_explains_the_cpu_choice(t, s, k, options, picked, says):
  q, key, v = shapes(t, s, k=k)
  got = flax_mha.explain(q, key, v, platform="cpu", **options)
  assert (got.implementation, got.platform) == (picked, "cpu")
  assert says in got.reason, got.reason
  assert picked not in got.alternatives
  assert set(got.alternatives) == set(registry.names()) - {picked}
  assert str(got).startswith(f"implementation=None runs {picked!r} on 'cpu': ")
  assert all(f"  {name}: " in str(got) for name in got.alternatives)


def _traced_kernels(monkeypatch, fn, *args) -> set[str]:
  """The registered kernels whose function `fn(*args)` traces (each registry entry wrapped to
  record its name; `lax.platform_dependent` traces every platform's branch)."""
  ran = set()
  for name in registry.names():
    kernel = registry.get(name)

    def recording(*a, kernel=kernel, **kw):
      ran.add(kernel.name)
      return kernel.attention(*a, **kw)
    monkeypatch.setitem(registry._KERNELS, name,  # pylint: disable=protected-access
                        dataclasses.replace(kernel, attention=recording))
  jax.eval_shape(fn, *args)
  return ran


@pytest.mark.parametrize("t, s, causal, options", [
    (64, 64, False, {}), (256, 256, True, {}), (640, 640, False, {}),
    (1, 4096, False, {}), (256, 256, True, dict(local_window_size=(32, 0))),
    (512, 512, True, dict(logit_soft_cap=30.0)),
])
def test_explain_names_the_kernel_a_traced_call_runs(monkeypatch, t, s, causal, options):
  """What a traced `dot_product_attention` actually calls is what `explain` says for each
  platform (its program stages one branch per platform where the choices differ); a planted
  wrong answer of the rule is caught."""
  q, k, v = shapes(t, s)
  call = lambda q, k, v: flax_mha.dot_product_attention(q, k, v, is_causal=causal, **options)
  said = {flax_mha.explain(q, k, v, is_causal=causal, platform=platform, **options).implementation
          for platform in dispatch.PLATFORMS}
  assert _traced_kernels(monkeypatch, call, q, k, v) == said
  wrong = lambda call, choose=dispatch.choose: (
      dispatch.Choice("reference", "planted") if call.platform == "cpu" else choose(call))
  monkeypatch.setattr(dispatch, "choose", wrong)
  assert _traced_kernels(monkeypatch, call, q, k, v) != said


def test_refusals_name_the_option():
  q, k, v = shapes(64)
  got = flax_mha.explain(q, k, v, q_segment_ids=ids(2, 64), dropout_rate=0.1, platform="cpu")
  assert got.alternatives["rows"] == "refuses: it has no dropout"
  assert "segment ids" in got.alternatives["cudnn"]
  assert "has no dropout" in got.alternatives["ring"]
  assert got.alternatives["chunked"] == got.alternatives["reference"] == "runs"
  bias = jax.ShapeDtypeStruct((2, 1, 64, 64), jnp.float32)
  assert "not a bias" in flax_mha.explain(q, k, v, bias).alternatives["ring"]
  with jax.sharding.use_abstract_mesh(AbstractMesh((4,), ("seq",))):
    assert flax_mha.explain(q, k, v, is_causal=True).alternatives["ring"] == "runs"
  assert "needs a mesh with a 'seq' axis" in flax_mha.explain(q, k, v).alternatives["ring"]


def test_platforms():
  """On an accelerator the CPU-tuned kernels are not picked; cuDNN only on 'cuda', and only
  where this process can trace it."""
  q, k, v = shapes(640, dtype=jnp.bfloat16)
  assert flax_mha.explain(q, k, v, platform="cpu").implementation == "rows"
  tpu = flax_mha.explain(q, k, v, platform="tpu")  # from a process without a TPU
  assert tpu.implementation == "xla" and "not 'tpu'" in tpu.alternatives["cudnn"]
  assert "this process has no TPU" in tpu.alternatives["splash"]
  assert "not 'cpu'" in flax_mha.explain(q, k, v, platform="cpu").alternatives["splash"]
  # What splash refuses on 'tpu' (a bias) goes to the plain graph, and explain says why.
  bias = jax.ShapeDtypeStruct((1, 1, 640, 640), jnp.bfloat16)
  tpu_bias = flax_mha.explain(q, k, v, bias, platform="tpu")
  assert tpu_bias.implementation == "xla" and "ACCELERATOR_MAX_LOGITS" in tpu_bias.reason
  assert tpu_bias.alternatives["splash"] == "refuses: splash takes no bias"
  cuda = flax_mha.explain(q, k, v, platform="cuda")
  if ON_GPU:
    assert cuda.implementation == "cudnn"
  else:
    assert cuda.implementation == "xla"
    assert "no CUDA GPU" in cuda.alternatives["cudnn"]
    # The pick says that a GPU process would take cuDNN; a call cuDNN refuses anyway does not.
    assert str(cuda).startswith("implementation=None runs 'xla' on 'cuda': cuDNN would run")
    f32 = shapes(640)
    assert "cuDNN would" not in flax_mha.explain(*f32, platform="cuda").reason
  big = shapes(8192, b=8, h=8, g=8)
  assert flax_mha.explain(*big, is_causal=True, platform="rocm").implementation == "chunked"
  assert flax_mha.explain(*big, is_causal=True, platform="tpu").implementation == "chunked"
  # Decode shapes: the CPU's split-key loop there, the plain graph on an accelerator.
  cache = shapes(1, 8192)
  assert flax_mha.explain(*cache, platform="cpu").implementation == "decode"
  assert flax_mha.explain(*cache, platform="rocm").implementation == "xla"


def test_dense_decode_threshold_is_documented():
  """T=1 without positions or lengths runs decode from DECODE_MIN_KEYS_DENSE keys, the number
  the dispatch rule (module docstring and docs/design.md) states."""
  s = dispatch.DECODE_MIN_KEYS_DENSE
  assert flax_mha.explain(*shapes(1, s // 2), platform="cpu").implementation == "xla"
  assert flax_mha.explain(*shapes(1, s), platform="cpu").implementation == "decode"
  assert f"DECODE_MIN_KEYS_DENSE = {s}" in dispatch.__doc__
  design = (pathlib.Path(__file__).parent.parent / "docs" / "design.md").read_text()
  assert f"from S = {s} without" in design


def test_decode_for_a_cache():
  """Positions make a call cache-like: decode from DECODE_MIN_KEYS keys, not the dense bound."""
  q, k, v = shapes(4, 1024)
  pos = dict(q_positions=ids(2, 4), kv_positions=ids(2, 1024))
  got = flax_mha.explain(q, k, v, is_causal=True, platform="cpu", **pos)
  assert got.implementation == "decode" and "a cache" in got.reason
  assert flax_mha.explain(q, k, v, is_causal=True, platform="cpu").implementation != "decode"


def test_visited_fraction_reads_static_masks_only():
  window = mods_lib.Mods((mods_lib.LocalWindow(32, 32),))
  assert chunked.visited_fraction(512, 512, 64, False, window) == 10 / 16  # 128-blocks, a band
  assert chunked.visited_fraction(512, 512, 64, True, None) == 10 / 16
  band = lambda b, h, q, kv: jnp.abs(q - kv) <= 32
  got = flax_mha.explain(*shapes(2048), mask_mod=band, platform="cpu")
  assert got.implementation == "chunked"
  index_only = mods_lib.Mods((mods_lib.MaskMod(lambda b, h, q, kv: jnp.abs(q - kv) <= 32),))
  assert chunked.visited_fraction(2048, 2048, 64, False, index_only) == 10 / 16  # 512-blocks
  closes_over = mods_lib.Mods((mods_lib.MaskMod(lambda b, h, q, kv, t: q >= kv, consts=(1,)),))
  assert chunked.visited_fraction(2048, 2048, 64, False, closes_over) == 1.0  # data: unknown


def test_checks_arguments():
  q, k, v = shapes(8)
  with pytest.raises(ValueError, match=r"platform must be None or one of \('cpu'"):
    flax_mha.explain(q, k, v, platform="gpu")
  with pytest.raises(TypeError, match="platform must be None or a str, got int"):
    flax_mha.explain(q, k, v, platform=0)
  with pytest.raises(TypeError, match="query must be an array"):
    flax_mha.explain([1.0], k, v)
  with pytest.raises(TypeError, match="unexpected keyword arguments"):
    flax_mha.explain(q, k, v, implementation="xla")
  with pytest.raises(ValueError, match="local_window_size needs T == S"):
    flax_mha.explain(q, shapes(8, 9)[1], shapes(8, 9)[2], local_window_size=2)
  with pytest.raises(TypeError, match="q_segment_ids must have an integer dtype"):
    flax_mha.explain(q, k, v, q_segment_ids=jax.ShapeDtypeStruct((2, 8), jnp.float32))
