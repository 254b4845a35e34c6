"""flax_mha's Triton flash kernel (`flax_mha.kernels.triton`) without a GPU: one case in Pallas
interpret mode against the oracle; the loop bounds; what it refuses, by name; the Pallas kernels
in what `implementation=None` exports for 'cuda' from this CPU; and the upstream GPU kernels
with silent bugs kept out of reach. Every option in interpret mode, skipped blocks, 16-bit
inputs and transforms are in tests/kernels/test_triton_integration.py."""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_mha
from flax_mha.kernels import triton
from helpers import output_and_grads

B, T, S, H, G, K, V = 2, 7, 11, 6, 3, 5, 13
INTERPRETED = triton.make_attention(interpret=True)
SEG_Q = jnp.asarray([[0, 0, 1, 1, 1, 2, 2], [3, 3, 3, 3, 5, 5, 5]])
SEG_KV = jnp.asarray([[0, 0, 0, 1, 1, 1, 1, 1, 9, 9, 9], [3, 3, 3, 3, 3, 3, 3, 4, 4, 4, 4]])
Q_POS = jnp.asarray([[4, 5, 6, 7, 8, 9, 10], [0, 1, 2, -1, -1, -1, -1]])
KV_POS = jnp.asarray([list(range(S)), [0, 1, 2, 3] + [-1] * (S - 4)])
shared_rng = np.random.default_rng(7)
BIAS = jnp.asarray(shared_rng.standard_normal((1, H, T, S)), jnp.float32)
KEY_MASK = jnp.asarray(shared_rng.random((B, 1, 1, S)) > 0.3)
# name -> (S, options, array options that get gradients). Lengths of 0, empty cache slots and
# the mask_mod's row 4 leave rows that see nothing.
OPTIONS = {
    "plain": (S, {}, {}),
    "causal": (S, dict(is_causal=True), {}),
    "window": (T, dict(local_window_size=(2, 1)), {}),
    "window_sink_tokens_causal": (T, dict(local_window_size=(1, 0), sink_tokens=2,
                                          is_causal=True), {}),
    "segment_ids_causal": (S, dict(q_segment_ids=SEG_Q, kv_segment_ids=SEG_KV,
                                   is_causal=True), {}),
    "lengths": (S, dict(query_seq_lengths=jnp.asarray([5, 7]),
                        key_value_seq_lengths=jnp.asarray([3, 0])), {}),
    "cache_positions": (S, dict(q_positions=Q_POS, kv_positions=KV_POS, is_causal=True,
                                local_window_size=(3, 0)), {}),
    "bias": (S, {}, dict(bias=BIAS)),
    "key_mask": (S, dict(mask=KEY_MASK), {}),
    "bias_and_mask_causal": (S, dict(mask=KEY_MASK, is_causal=True), dict(bias=BIAS)),
    "mask_mod_over_b_and_h": (S, dict(mask_mod=lambda b, h, q, kv: ((q + kv + h + b) % 3 != 1)
                                      & (q != 4)), {}),
    "score_mod": (S, dict(score_mod=lambda s, b, h, q, kv: s - 0.1 * jnp.abs(q - kv) + b), {}),
    "soft_cap": (S, dict(logit_soft_cap=0.5, is_causal=True), {}),
    "sinks": (S, dict(key_value_seq_lengths=jnp.asarray([3, 0])),
              dict(sinks=jnp.asarray([0.5, -1.0, 2.0, 0.0, 1.0, -3.0]))),
}


def shared_inputs(s, dtype=jnp.float32, seed=0, t=T, h=H, g=G):
  rng = np.random.default_rng(seed)
  shapes = ((B, t, h, K), (B, s, g, K), (B, s, g, V))
  return [jnp.asarray(rng.standard_normal(shape), dtype) for shape in shapes]


def shared_attention(implementation, return_residual, options, names=()):
  """(q, k, v, *arrays named `names`) -> out (and lse), through dot_product_attention."""
  def fn(q, k, v, *arrays):
    return flax_mha.dot_product_attention(
        q, k, v, implementation=implementation, return_residual=return_residual, **options,
        **dict(zip(names, arrays)))
  return fn


def shared_check(implementation, s, options, graded, return_residual=False, dtype=jnp.float32,
           tol=5e-6, **shape):
  """Values (and the lse) and the gradients of q, k, v and the `graded` arrays, against the
  oracle."""
  args = [*shared_inputs(s, dtype, **shape), *graded.values()]
  reduce = (lambda r: jnp.sin(r[0])) if return_residual else jnp.sin
  got = output_and_grads(shared_attention(implementation, return_residual, options, tuple(graded)),
                         *args, reduce=reduce)
  want = output_and_grads(shared_attention("reference", return_residual, options, tuple(graded)),
                          *args, reduce=reduce, jit=False)
  as32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)
  chex.assert_trees_all_close(as32(got), as32(want), atol=tol, rtol=tol)


def check_interpreted_gqa_causal_segments_bias_matches_oracle():
  """The unit suite's one interpreted case: GQA, K != V, T != S, causality, segment ids and a
  bias with its gradient, in one compile."""
  shared_check(INTERPRETED, S, dict(is_causal=True, q_segment_ids=SEG_Q, kv_segment_ids=SEG_KV),
         dict(bias=BIAS))


def test_a_row_that_sees_nothing_is_zero_with_lowest_lse():
  q, k, v = shared_inputs(S)
  out, lse = jax.jit(shared_attention(INTERPRETED, True, dict(
      key_value_seq_lengths=jnp.asarray([S, 0]))))(q, k, v)
  np.testing.assert_array_equal(out[1], 0.0)
  np.testing.assert_array_equal(lse[1], jnp.finfo(jnp.float32).min)
  assert np.all(np.abs(out[0]) > 0)


def _shapes(dtype=jnp.float32, t=T, k=K, v=V):
  return (jax.ShapeDtypeStruct((B, t, H, k), dtype), jax.ShapeDtypeStruct((B, t, G, k), dtype),
          jax.ShapeDtypeStruct((B, t, G, v), dtype))


TABLE = jnp.asarray(np.arange(T) % 3)  # closed over by a function: an array, not an index
REFUSED = {
    "dropout": (dict(dropout_rate=0.1), "no dropout"),
    "mask_mod over an array": (dict(mask_mod=lambda b, h, q, kv: TABLE[q] > kv),
                               "not ones over arrays"),
    "score_mod over an array": (dict(score_mod=lambda s, b, h, q, kv: s + TABLE[kv]),
                                "not ones over arrays"),
}


@pytest.mark.parametrize("what", REFUSED)
def test_refuses_by_name_and_explain_says_so(what):
  options, reason = REFUSED[what]
  with flax_mha.stage_accelerator_kernels():
    said = flax_mha.explain(*_shapes(), platform="cuda", **options)
  assert said.implementation != "triton" and reason in said.alternatives["triton"]
  if "dropout_rate" in options:
    options = dict(options, dropout_rng=jax.random.key(0))
  with pytest.raises(ValueError, match=f"implementation='triton' cannot run: .*{reason}"):
    jax.eval_shape(functools.partial(flax_mha.dot_product_attention, implementation=INTERPRETED,
                                     **options), *_shapes())


def test_refuses_other_platforms_dtypes_and_wide_heads():
  said = lambda *shapes, platform="cuda": flax_mha.explain(
      *shapes, platform=platform).alternatives["triton"]
  assert "NVIDIA GPUs (platform 'cuda'), not 'tpu'" in said(*_shapes(), platform="tpu")
  with jax.enable_x64(True):
    assert "float32, bfloat16 or float16, got float64" in said(*_shapes(jnp.float64))
  assert "head dims up to 256, got K=16, V=320" in said(*_shapes(k=16, v=320))
  assert said(*_shapes()) == "refuses: " + triton.NOT_STAGED


def _exported_module(implementation, options, dtype=jnp.float32, bias=False, g=G) -> str:
  """The StableHLO of forward+backward (of the bias too, with `bias`) through
  `implementation`, exported for 'cuda'."""
  def loss(q, k, v, *bias):
    out = flax_mha.dot_product_attention(q, k, v, *bias, implementation=implementation,
                                         **options)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  shapes = [*_shapes(dtype)] + ([jax.ShapeDtypeStruct((1, H, T, T), jnp.float32)] if bias else [])
  if g != G:
    shapes[1:3] = [jax.ShapeDtypeStruct(x.shape[:2] + (g,) + x.shape[3:], dtype)
                   for x in shapes[1:3]]
  fn = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(shapes)))))
  checks = [jax.export.DisabledSafetyCheck.custom_call(triton.CUSTOM_CALL)]
  return jax.export.export(fn, platforms=("cuda",), disabled_checks=checks)(*shapes).mlir_module()


KERNELS = ("flax_mha_flash_forward", "flax_mha_flash_dq", "flax_mha_flash_dkv")
# Every option the kernel takes, exported for 'cuda' by name and through None (which stages it
# here inside stage_accelerator_kernels() only); bfloat16 plain is what cuDNN takes on a GPU.
EXPORTED = {name: options for name, (s, options, graded) in OPTIONS.items()
            if s == T or not (options.keys() & {"kv_segment_ids", "kv_positions", "mask"})}
EXPORTED |= {"segment_ids": dict(q_segment_ids=SEG_Q),
             "cache_positions": dict(q_positions=Q_POS, kv_positions=Q_POS, is_causal=True),
             "key_mask": dict(mask=jnp.ones((B, 1, 1, T), bool)), "bfloat16_plain": {},
             "sinks": dict(sinks=jnp.ones((H,)), is_causal=True)}


@pytest.mark.parametrize("implementation", [None])  # "triton" by name: the integration part
@pytest.mark.parametrize("name", [*EXPORTED, "bias"])
def test_exports_the_pallas_kernels_for_cuda(name, implementation):
  """Forward and backward lowered for 'cuda' hold the three Triton kernels, named or through
  None inside stage_accelerator_kernels(); None picks it there, the GPU bar outside."""
  options, bias = EXPORTED.get(name, {}), name == "bias"
  dtype = jnp.bfloat16 if name.startswith("bfloat16") else jnp.float32
  with flax_mha.stage_accelerator_kernels():
    assert flax_mha.explain(*_shapes(dtype), platform="cuda", **options).implementation == "triton"
    module = _exported_module(implementation, options, dtype, bias)
  assert module.count(triton.CUSTOM_CALL) >= 3 and all(k in module for k in KERNELS)


def test_none_does_not_stage_the_kernel_without_a_gpu():
  """Outside stage_accelerator_kernels() a CPU process's 'cuda' branch is xla/chunked."""
  module = _exported_module(None, dict(is_causal=True, local_window_size=4))
  assert triton.CUSTOM_CALL not in module


def check_upstream_kernels_with_silent_bugs_cannot_be_reached():
  """Two upstream kernels give silently wrong results: jax's GPU Triton `attention.mha` with GQA
  (its K/V blocks index query heads) and tokamax's Mosaic TPU kernel's dK/dV with a boolean
  mask and GQA. No flax_mha module imports either; what None exports for GQA with causality and
  a mask function holds flax_mha's own kernels on 'cuda' and splash on 'tpu', and those kernels
  match the oracle there (test_interpreted_* in test_triton_integration.py and
  test_splash_integration.py)."""
  package = pathlib.Path(flax_mha.__file__).parent
  sources = "\n".join(p.read_text() for p in package.rglob("*.py"))
  assert "pallas.ops.gpu" not in sources and "import tokamax" not in sources
  options = dict(is_causal=True, mask_mod=lambda b, h, q, kv: (q + kv) % 3 != 1)
  with flax_mha.stage_accelerator_kernels():
    cuda = _exported_module(None, options, g=1)
    tpu = jax.export.export(jax.jit(jax.grad(lambda q, k, v: jnp.sum(
        flax_mha.dot_product_attention(q, k, v, **options)), argnums=(1, 2))),
        platforms=("tpu",))(*_shapes()).mlir_module()
  assert all(k in cuda for k in KERNELS) and "mha_forward" not in cuda
  assert "splash" in tpu and "tokamax" not in tpu
  shared_check(INTERPRETED, S, options, {}, g=1)  # MQA: 6 query heads on one key/value head


@pytest.mark.parametrize("options", [
    dict(causal=True), dict(windows=((5, 17, 0),)), dict(causal=True, windows=((3, 0, 18),)),
    dict(causal=True, windows=((20, 2, 0), (40, 0, 0))), dict(windows=((0, 0, 0),)),
    dict(windows=((3, 0, 40),)), dict(windows=((3, 2, 18),))])
def test_loop_bounds_are_the_tiles_the_index_terms_leave_visible(options):
  """Each block's loop visits exactly the blocks between its first and last one holding a
  visible entry (bands: no gap between), or none, for query blocks over keys and key blocks
  over queries."""
  t, s, bq, bk = 64, 96, 16, 32
  spec = triton.tiles.Spec(t=t, s=s, bq=bq, bk=bk, rep=1, scale=1.0, causal=False, windows=(),
                           positions=(), segmented=False, bias=None, bias_grad=False,
                           mask_mods=(), scores=(), interpret=True)
  spec = dataclasses.replace(spec, **options)
  q, kv = np.arange(t)[:, None], np.arange(s)[None, :]
  visible = np.ones((t, s), bool)
  if spec.causal:
    visible &= q >= kv
  for left, right, sink_tokens in spec.windows:
    visible &= ((kv >= q - left) & (kv <= q + right)) | (kv < sink_tokens)
  tiles_seen = visible.reshape(t // bq, bq, s // bk, bk).any(axis=(1, 3))
  def check(bounds, row):
    lo, hi = (int(x) for x in bounds)
    if not row.any():  # a block nothing sees: an empty loop
      assert lo >= hi
    else:
      assert (lo, hi) == (int(np.argmax(row)), len(row) - int(np.argmax(row[::-1])))
  for i in range(t // bq):
    check(spec.kv_range(i, s // bk), tiles_seen[i])
  for j in range(s // bk):
    check(spec.q_range(j, t // bq), tiles_seen[:, j])
