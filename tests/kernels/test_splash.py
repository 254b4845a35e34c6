"""Splash attention (`flax_mha.kernels.splash`) without a TPU: what it refuses, by name; a row
that sees nothing; and the Pallas kernel in what `implementation=None` exports for 'tpu' from
this CPU. Every option it maps, forward and gradient, in Pallas interpret mode against the
oracle, is in tests/kernels/test_splash_integration.py."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_mha
from flax_mha import platforms
from flax_mha.kernels import splash

B, T, S, H, G, K, V = 2, 7, 11, 6, 3, 5, 13
# Interpret mode takes query blocks of 8 (splash's key blocks stay 128): the smallest shapes.
INTERPRETED = splash.make_attention(interpret=True, block_q=8)
SEG_Q = jnp.asarray([[0, 0, 1, 1, 1, 2, 2], [3, 3, 3, 3, 5, 5, 5]])
SEG_KV = jnp.asarray([[0, 0, 0, 1, 1, 1, 1, 1, 9, 9, 9], [3, 3, 3, 3, 3, 3, 3, 4, 4, 4, 4]])
SINKS = jnp.asarray([0.5, -1.0, 2.0, 0.0, 1.0, -3.0])
# name -> (S, options): T == S where a window needs it. Lengths of 0 and the mask_mod's row 4
# leave rows that see nothing.
OPTIONS = {
    "plain": (S, {}),
    "causal": (S, dict(is_causal=True)),
    "window": (T, dict(local_window_size=(2, 1))),
    "window_sink_tokens_causal": (T, dict(local_window_size=(1, 0), sink_tokens=2,
                                          is_causal=True)),
    "segment_ids": (S, dict(q_segment_ids=SEG_Q, kv_segment_ids=SEG_KV)),
    "lengths": (S, dict(query_seq_lengths=jnp.asarray([5, 7]),
                        key_value_seq_lengths=jnp.asarray([3, 0]))),
    "soft_cap": (S, dict(logit_soft_cap=0.5, is_causal=True)),
    "sinks": (S, dict(sinks=SINKS, query_seq_lengths=jnp.asarray([5, 7]))),
    "mask_mod": (S, dict(mask_mod=lambda b, h, q, kv: ((q + kv + h) % 3 != 1) & (q != 4))),
}


def shared_inputs(s, dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  shapes = ((B, T, H, K), (B, s, G, K), (B, s, G, V))
  return [jnp.asarray(rng.standard_normal(shape), dtype) for shape in shapes]


def shared_attention(implementation, return_residual, options):
  """(q, k, v[, sinks]) -> out (and lse), through dot_product_attention."""
  def fn(q, k, v, sinks=None):
    extra = {} if sinks is None else dict(sinks=sinks)
    return flax_mha.dot_product_attention(q, k, v, implementation=implementation,
                                          return_residual=return_residual, **options, **extra)
  return fn


def test_a_row_that_sees_nothing_is_zero_with_lowest_lse():
  """Key lengths of 0 hide every key of the second example: output 0, lse finfo.min (splash
  alone gives such rows the mean of V). One compile, forward only."""
  q, k, v = shared_inputs(S)
  out, lse = jax.jit(shared_attention(INTERPRETED, True, dict(
      key_value_seq_lengths=jnp.asarray([S, 0]))))(q, k, v)
  np.testing.assert_array_equal(out[1], 0.0)
  np.testing.assert_array_equal(lse[1], jnp.finfo(jnp.float32).min)
  assert np.all(np.abs(out[0]) > 0)


def test_kernels_are_built_once_per_static_shape():
  """The splash masks (block sparsity) are built once per static configuration: a second trace
  of the same shapes, with the mask_mod traced anew, builds nothing."""
  q, k, v = shared_inputs(S)
  options = dict(mask_mod=lambda b, h, q, kv: (q + kv) % 2 == 0)
  jax.eval_shape(shared_attention(INTERPRETED, False, options), q, k, v)
  built = len(splash._KERNELS)  # pylint: disable=protected-access
  options = dict(mask_mod=lambda b, h, q, kv: (q + kv) % 2 == 0)
  jax.eval_shape(shared_attention(INTERPRETED, False, options), q, k, v)
  assert len(splash._KERNELS) == built  # pylint: disable=protected-access


def _shapes(dtype=jnp.float32, s=T):
  return (jax.ShapeDtypeStruct((B, T, H, K), dtype), jax.ShapeDtypeStruct((B, s, G, K), dtype),
          jax.ShapeDtypeStruct((B, s, G, V), dtype))


TABLE = jnp.asarray(np.arange(T) % 3)  # closed over by a mask_mod: an array, not an index
REFUSED = {
    "a bias": (dict(bias=jax.ShapeDtypeStruct((1, H, T, T), jnp.float32)), "no bias"),
    "a mask": (dict(mask=jax.ShapeDtypeStruct((1, 1, T, T), jnp.bool_)), "no dense mask"),
    "dropout": (dict(dropout_rate=0.1), "no dropout"),
    "score_mod": (dict(score_mod=lambda s, b, h, q, kv: s * 2), "no score_mod"),
    "positions": (dict(q_positions=jnp.zeros((B, T), jnp.int32),
                       kv_positions=jnp.zeros((B, T), jnp.int32)), "no positions"),
    "mask_mod over b": (dict(mask_mod=lambda b, h, q, kv: b == q), "not the batch index"),
    "mask_mod over an array": (dict(mask_mod=lambda b, h, q, kv: TABLE[q] > kv),
                               "not one over arrays"),
}


@pytest.mark.parametrize("what", REFUSED)
def test_refuses_by_name_and_explain_says_so(what):
  options, reason = REFUSED[what]
  said = flax_mha.explain(*_shapes(), platform="tpu", **options)
  assert said.implementation != "splash" and reason in said.alternatives["splash"]
  arrays = [jnp.zeros(x.shape, x.dtype) for x in _shapes()]
  options = {name: (jnp.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x)
             for name, x in options.items()}
  if "dropout_rate" in options:
    options["dropout_rng"] = jax.random.key(0)
  with pytest.raises(ValueError, match=f"implementation='splash' cannot run: .*{reason}"):
    jax.eval_shape(functools.partial(flax_mha.dot_product_attention, implementation=INTERPRETED,
                                     **options), *arrays)


def test_refuses_other_platforms_and_dtypes():
  assert "TPU kernel (platform 'tpu'), not 'cpu'" in flax_mha.explain(
      *_shapes(), platform="cpu").alternatives["splash"]
  said = flax_mha.explain(*_shapes(jnp.float16), platform="tpu")
  assert "float32 or bfloat16, got float16" in said.alternatives["splash"]


# Every option splash maps, exported for 'tpu' from this CPU, by name and through None (which
# stages splash here inside stage_accelerator_kernels() only).
EXPORTED = {name: options for name, (s, options) in OPTIONS.items() if s == T}
EXPORTED |= {"segment_ids": dict(q_segment_ids=SEG_Q), "soft_cap": OPTIONS["soft_cap"][1],
             "lengths": dict(query_seq_lengths=jnp.asarray([5, 7]),
                             key_value_seq_lengths=jnp.asarray([3, 0])),
             "sinks": dict(sinks=SINKS, is_causal=True), "plain": {}, "causal": dict(is_causal=True),
             "mask_mod": OPTIONS["mask_mod"][1], "bfloat16_causal": dict(is_causal=True)}


def _exported_module(implementation, options, dtype) -> str:
  """The StableHLO of forward+backward through `implementation`, exported for 'tpu'."""
  def loss(q, k, v):
    out = flax_mha.dot_product_attention(q, k, v, implementation=implementation, **options)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  return jax.export.export(fn, platforms=("tpu",))(*_shapes(dtype)).mlir_module()


@pytest.mark.parametrize("implementation", ["splash", None])
@pytest.mark.parametrize("name", EXPORTED)
def test_exports_the_pallas_kernel_for_tpu(name, implementation):
  """Forward and backward lowered for 'tpu' hold splash's Pallas kernels (their TPU custom
  calls), named or through None inside stage_accelerator_kernels(); explain says splash takes
  the options there, bar the TPU outside it, and None picks it inside."""
  options = EXPORTED[name]
  dtype = jnp.bfloat16 if name.startswith("bfloat16") else jnp.float32
  said = flax_mha.explain(*_shapes(dtype), platform="tpu", **options)
  assert said.alternatives["splash"] == "refuses: " + splash.NOT_STAGED
  with flax_mha.stage_accelerator_kernels():
    assert flax_mha.explain(*_shapes(dtype), platform="tpu", **options).implementation == "splash"
    module = _exported_module(implementation, options, dtype)
  assert module.count("tpu_custom_call") >= 3  # forward, dq, dkv


def test_none_does_not_stage_splash_without_a_tpu():
  """A CPU process traces every platform's branch of None: outside
  stage_accelerator_kernels() splash, whose masks are processed in NumPy while tracing, is left
  out of them (the 'tpu' branch is xla/chunked here), and explain says why."""
  options = EXPORTED["mask_mod"]
  assert "tpu_custom_call" not in _exported_module(None, options, jnp.float32)
  said = flax_mha.explain(*_shapes(), platform="tpu", **options)
  assert said.implementation != "splash" and "stage_accelerator_kernels() is off" in said.reason


def test_staging_is_part_of_the_trace_cache_key():
  """One jitted function traced before, inside and after stage_accelerator_kernels(): each
  export traces anew for the setting in force, not a cached trace of the other."""
  def loss(q, k, v):
    return jnp.sum(flax_mha.dot_product_attention(q, k, v, is_causal=True))

  fn = jax.jit(loss)
  export = lambda: jax.export.export(fn, platforms=("tpu",))(*_shapes()).mlir_module()
  assert "tpu_custom_call" not in export()
  with flax_mha.stage_accelerator_kernels():
    assert "tpu_custom_call" in export()
    with flax_mha.stage_accelerator_kernels(False):
      assert "tpu_custom_call" not in export()
  assert "tpu_custom_call" not in export()
  with pytest.raises(TypeError, match="enabled must be a bool, got str"):
    flax_mha.stage_accelerator_kernels("tpu")


def test_staging_is_part_of_the_dispatch_cache_key():
  """A jitted function called (not exported) before, inside and after the setting: jit's fast
  dispatch path keeps no program traced for the other setting."""
  traces = []

  @jax.jit
  def fn(x):
    traces.append(platforms.STAGE_ACCELERATOR_KERNELS.value)
    return x + 1

  fn(1.0)
  with flax_mha.stage_accelerator_kernels():
    fn(1.0)
  fn(1.0)
  assert traces == [False, True]


def test_refuses_x64_mode_by_name():
  """Under jax_enable_x64 jax's splash kernel fails to trace (int64 Python ints in its index
  maps): refused by name, float32 inputs and all."""
  q, k, v = _shapes(jnp.float32)
  with jax.enable_x64(True):
    said = flax_mha.explain(q, k, v, platform="tpu").alternatives["splash"]
    assert "jax_enable_x64" in said
    with (flax_mha.stage_accelerator_kernels(),  # staged: else refused for want of a TPU
          pytest.raises(ValueError, match="splash does not trace under jax_enable_x64")):
      jax.eval_shape(lambda q, k, v: flax_mha.dot_product_attention(
          q, k, v, implementation="splash"), q, k, v)
