"""Low-precision products (flax_mha.precision): float32 accumulation against a float64 NumPy
reference, the one-row rule, flax's promotion, the cache's bitwise write; and what the models
hand XLA in bfloat16: no bfloat16-result dot in a decoder step's program (linen, NNX, the
Transformer), no weight conversion inside a batch-1 decoding loop on the CPU, linen and NNX
alike, close to float32, and jit, grad, vmap and scan through them. The cases that compile for
seconds (`check_`: NNX and the Transformer, the mixture of experts, linen against NNX, the
batch-1 loop, the transforms) run in the integration part,
tests/test_precision_integration.py.

Dimension key: B batch, L length, D width, F MLP width, C vocabulary; M rows, N columns of a
product. Prime sizes, so that a swapped axis fails.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments.bench import hlo_bytes
from flax_mha import precision
from flax_mha.models import decoding, lm_nnx
from flax_mha.models.lm import DecoderLM, LMConfig
from flax_mha.models.lm_config import MoE
from flax_mha.models.transformer import Transformer, TransformerConfig

BF16 = jnp.bfloat16
DIMS = (((1,), (0,)), ((), ()))  # [M, D] · [D, N]


def _bf16(rng, *shape):
  return jnp.asarray(rng.standard_normal(shape), BF16)


def _ref(x, w):
  """float64 x · w, x and w as given (already rounded to their dtype)."""
  return np.asarray(x, np.float64) @ np.asarray(w, np.float64)


def _dot_results(fn, *args) -> list[str]:
  """The element types of every dot_general's result in fn's lowered program (before XLA)."""
  text = jax.jit(fn).lower(*args).as_text()
  return re.findall(r"stablehlo\.dot_general.*-> tensor<[^>]*x(\w+)>", text)


@pytest.mark.parametrize("rows", [1, 7])
def test_bf16_products_accumulate_in_float32(rng, rows):
  """bf16 operands: a bf16 result within one bf16 rounding of the float64 product of the same
  operands (a bf16 accumulation over D=257 would be off by far more), from a dot with a float32
  result; float32 operands: a plain float32 dot."""
  x, w = _bf16(rng, rows, 257), _bf16(rng, 257, 11)
  got = precision.dot_general(x, w, DIMS)
  assert got.dtype == BF16
  want = _ref(x, w)
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2**-8, atol=1e-6)
  assert _dot_results(lambda x, w: precision.dot_general(x, w, DIMS), x, w) == ["f32"]
  x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
  np.testing.assert_allclose(precision.dot_general(x32, w32, DIMS), want, rtol=1e-5, atol=1e-4)
  assert precision.dot_general(x32, w32, DIMS).dtype == jnp.float32


def test_a_wider_kernel_is_cast_unless_the_product_has_one_row(rng):
  """bf16 inputs and a float32 kernel (a float32 copy, or mixed precision's parameters): one row
  reads the kernel as it is (float32 operands), several rows cast it to bf16 first (flax's
  semantics: the product in the compute dtype); both return bf16."""
  w32 = jnp.asarray(rng.standard_normal((257, 11)), jnp.float32)
  for rows, operand in ((1, "f32"), (3, "bf16")):
    x = _bf16(rng, rows, 257)
    got = precision.dot_general(x, w32, DIMS)
    assert got.dtype == BF16
    kernel = w32 if rows == 1 else w32.astype(BF16)
    np.testing.assert_allclose(np.asarray(got, np.float64), _ref(x, kernel), rtol=2**-8,
                               atol=1e-6)
    text = jax.jit(lambda x, w: precision.dot_general(x, w, DIMS)).lower(x, w32).as_text()
    assert re.search(rf"stablehlo\.dot_general %\S+, %\S+, .*: \(tensor<{rows}x257x{operand}>",
                     text), text


def test_promote_keeps_only_a_wider_floating_kernel():
  x, b = jnp.ones((2, 3), BF16), jnp.ones((5,), jnp.float32)
  for kernel, kept in ((jnp.ones((3, 5), jnp.float32), True), (jnp.ones((3, 5), BF16), True),
                       (jnp.ones((3, 5), jnp.float16), False)):
    out = precision.promote_dtype(x, kernel, b, dtype=BF16)
    assert [a.dtype for a in (out[0], out[2])] == [BF16, BF16]
    assert out[1].dtype == (kernel.dtype if kept else BF16)
  assert {a.dtype for a in precision.promote_dtype(x, jnp.ones((3, 5)), None)[:2]} == {
      jnp.dtype(jnp.float32)}  # no dtype: flax's result type
  assert precision.promote_dtype_nnx((x, kernel, None), dtype=BF16)[2] is None


@pytest.mark.parametrize("dtype", [BF16, jnp.float16, jnp.float32])
def test_set_at_writes_what_a_scatter_writes(rng, dtype):
  """Bit for bit what `.at[].set(mode="drop")` writes into keys [B, G, C, K] at slots [B, T]
  (the selection [B, T, G, K], as a KV cache's write), a slot past the end dropped."""
  buf = jnp.asarray(rng.standard_normal((3, 2, 7, 5)), dtype)
  new = jnp.asarray(rng.standard_normal((3, 3, 2, 5)), jnp.float32)
  index = (np.arange(3)[:, None], slice(None), np.array([[0, 4, 1], [6, 9, 5], [2, 3, 0]]))
  got = precision.set_at(buf, index, new)
  want = buf.at[index].set(new.astype(dtype), mode="drop")
  assert got.dtype == jnp.dtype(dtype)
  np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))


@pytest.mark.parametrize("traced", [False, True])
def test_set_at_differentiates_as_a_scatter(rng, traced):
  """The bits carry no derivative: forward and reverse mode through a bf16 write give the
  plain scatter's (the cache's keys and values get their gradients), with the slots traced
  under jit too."""
  buf = jnp.asarray(rng.standard_normal((3, 2, 7, 5)), BF16)
  new = jnp.asarray(rng.standard_normal((3, 3, 2, 5)), BF16)
  rows, slots = np.arange(3)[:, None], np.array([[0, 4, 1], [6, 9, 5], [2, 3, 0]])

  def loss(write, b, n, s):
    return jnp.sum(jnp.sin(write(b, (rows, slice(None), s), n).astype(jnp.float32)))
  plain = lambda b, i, n: b.at[i].set(n, mode="drop")
  grad = lambda write: jax.grad(loss, argnums=(1, 2))(write, buf, new, slots)
  if traced:
    grad = jax.jit(grad, static_argnums=0)
  got, want = grad(precision.set_at), grad(plain)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    assert float(jnp.abs(w.astype(jnp.float32)).max()) > 0
  tangent = jax.jvp(lambda b, n: precision.set_at(b, (rows, slice(None), slots), n), (buf, new),
                    (jnp.ones_like(buf), 2 * jnp.ones_like(new)))[1]
  np.testing.assert_array_equal(np.asarray(tangent, np.float32), np.asarray(
      jnp.ones_like(buf).at[rows, :, slots].set(2, mode="drop"), np.float32))


def test_set_at_converts_no_bf16_cache():
  """The compiled write of a bf16 cache holds no conversion of the cache (a plain scatter
  holds two: to float32 and back), counted by hlo_bytes."""
  buf, new = jnp.zeros((3, 2, 64, 16), BF16), jnp.ones((3, 1, 2, 16), BF16)
  index = (np.arange(3)[:, None], slice(None), np.array([[1], [5], [7]]))
  count = lambda write: hlo_bytes.converts(
      jax.jit(write).lower(buf, new).compile().as_text(), [buf.shape])["shaped_converts"]
  assert count(lambda b, n: b.at[index].set(n, mode="drop")) >= 1
  assert count(lambda b, n: precision.set_at(b, index, n)) == 0


def test_the_row_rule_and_what_explain_says():
  params = {"w": jnp.ones((3, 5), BF16), "n": jnp.ones((5,), jnp.float32),
            "i": jnp.ones((2,), jnp.int32)}
  up = precision.loop_params(params, 1, "cpu")
  assert {k: v.dtype for k, v in up.items()} == {
      "w": jnp.float32, "n": jnp.float32, "i": jnp.int32}
  for rows, platform in ((2, "cpu"), (1, "cuda"), (1, "tpu")):
    assert precision.loop_params(params, rows, platform) is params
  assert "float32 copies" in precision.explain(BF16, 1, "cpu")
  assert "float32 accumulation" in precision.explain(BF16, 8, "cpu")
  assert "float32 copies" not in precision.explain(BF16, 1, "cuda")
  assert precision.explain(jnp.float32, 1, "cpu").startswith("float32: plain")


# The models: a tiny bf16 decoder (untied head, GQA, a local layer), and its NNX twin.

CFG = LMConfig(vocab_size=37, d_model=24, num_heads=4, num_kv_heads=2, num_layers=2, d_ff=40,
               local_window=3, dtype=BF16, param_dtype=BF16, tie_embeddings=False,
               mlp="swiglu", mlp_bias=False, scale_embeddings=False, scale_logits=False)


@pytest.fixture(scope="module")
def lm():
  model = DecoderLM(CFG)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 37, (2, 11)), jnp.int32)
  return model, jax.jit(model.init)(jax.random.key(0), tokens), tokens


def _step(model, variables, batch):
  """A jitted decode step of `batch` rows after a prefill: (step fn, its arguments)."""
  tokens = jnp.zeros((batch, 5), jnp.int32)
  prefill = lambda v: decoding.prefill(model, v, (tokens,), tokens, jnp.full((batch,), 5), 9)
  cache, _ = jax.jit(prefill)(variables)
  fn = jax.jit(lambda v, t, c: model.apply(v, t[:, None], c, method="logits"))
  return fn, (variables, jnp.zeros((batch,), jnp.int32), cache)


@pytest.mark.parametrize("tied", [False, True])
def test_a_bf16_decoder_step_hands_xla_no_bf16_result_dot(lm, tied):
  """Every dot of a bf16 decode step (projections, MLP, head or tied embedding, attention)
  has a float32 result, and there are dots to count."""
  model, variables, tokens = lm
  if tied:
    model = DecoderLM(CFG.__class__(**{**CFG.__dict__, "tie_embeddings": True}))
    variables = jax.jit(model.init)(jax.random.key(0), tokens)
  fn, args = _step(model, variables, 3)
  results = _dot_results(fn, *args)
  assert len(results) >= 7 * CFG.num_layers and set(results) == {"f32"}, results


def check_nnx_and_the_transformer_hand_xla_no_bf16_result_dot(lm):
  model, variables, tokens = lm
  module = lm_nnx.load_linen_params(lm_nnx.DecoderLM(CFG, rngs=nnx.Rngs(0)), variables)
  graphdef, state = nnx.split(module)
  call = lambda s, t: nnx.merge(graphdef, s)(t)
  results = _dot_results(call, state, tokens)
  assert len(results) >= 7 * CFG.num_layers and set(results) == {"f32"}, results
  cfg = TransformerConfig(vocab_size=37, d_model=24, num_heads=4, num_encoder_layers=1,
                          num_decoder_layers=1, d_ff=40, max_len=16, dtype=BF16)
  transformer = Transformer(cfg)
  params = jax.jit(transformer.init)(jax.random.key(0), tokens, tokens)
  results = _dot_results(lambda p, s, t: transformer.apply(p, s, t), params, tokens, tokens)
  assert len(results) >= 10 and set(results) == {"f32"}, results


def check_a_bf16_mixture_of_experts_hands_xla_float32_results_and_a_loop_no_weight(lm):
  """The experts' products and the router, linen and NNX, accumulate in float32; a batch-1
  loop on the CPU reads the experts' float32 copies, converting none of them inside it."""
  _, _, tokens = lm
  cfg = CFG.__class__(**{**CFG.__dict__, "moe": MoE(num_experts=3, top_k=2, d_ff=16,
                                                    bias=True)})
  model = DecoderLM(cfg)
  variables = jax.jit(model.init)(jax.random.key(0), tokens)
  fn, args = _step(model, variables, 3)
  results = _dot_results(fn, *args)
  assert len(results) >= 8 * cfg.num_layers and set(results) == {"f32"}, results
  module = lm_nnx.load_linen_params(lm_nnx.DecoderLM(cfg, rngs=nnx.Rngs(0)), variables)
  graphdef, state = nnx.split(module)
  results = _dot_results(lambda s, t: nnx.merge(graphdef, s)(t), state, tokens)
  assert len(results) >= 8 * cfg.num_layers and set(results) == {"f32"}, results
  prompts = tokens[:1, :5]
  compiled = jax.jit(lambda v, p: decoding.generate(model, v, (p,), p, max_new_tokens=4)).lower(
      variables, prompts).compile()
  shapes = [p.shape for p in jax.tree.leaves(variables) if p.ndim == 3]  # the experts'
  counts = hlo_bytes.converts(compiled.as_text(), shapes)
  if jax.default_backend() == "cpu":
    assert counts["loop_shaped_converts"] == 0 and counts["shaped_converts"] >= 3, counts


def check_linen_and_nnx_agree_in_bf16_and_bf16_is_close_to_float32(lm):
  model, variables, tokens = lm
  module = lm_nnx.load_linen_params(lm_nnx.DecoderLM(CFG, rngs=nnx.Rngs(0)), variables)
  got = model.apply(variables, tokens)
  np.testing.assert_array_equal(module(tokens), got)
  cfg32 = CFG.__class__(**{**CFG.__dict__, "dtype": jnp.float32, "param_dtype": jnp.float32})
  want = DecoderLM(cfg32).apply(jax.tree.map(lambda p: p.astype(jnp.float32), variables), tokens)
  scale = float(jnp.abs(want).max())
  np.testing.assert_allclose(got, want, atol=0.05 * scale)  # bf16: 8 bits of mantissa


def check_a_batch_1_cpu_loop_converts_no_weight_and_keeps_the_tokens(lm):
  """On the CPU a batch-1 generation converts the bf16 weights once, before its loop (none
  inside: the loop's products read the float32 copies), and gives the tokens of its rows
  generated at batch 2 (bf16 weights) where their logits are not near a tie."""
  model, variables, tokens = lm
  prompts = tokens[:1, :5]
  compiled = jax.jit(lambda v, p: decoding.generate(model, v, (p,), p, max_new_tokens=6)).lower(
      variables, prompts).compile()
  shapes = [p.shape for p in jax.tree.leaves(variables) if p.ndim == 2]
  counts = hlo_bytes.converts(compiled.as_text(), shapes)
  if jax.default_backend() == "cpu":
    assert counts["loop_shaped_converts"] == 0 and counts["shaped_converts"] >= 4, counts
  one = compiled(variables, prompts)
  two = decoding.generate(model, variables, (tokens[:2, :5],), tokens[:2, :5], max_new_tokens=6)
  np.testing.assert_array_equal(one[0], two[0])


def check_jit_grad_vmap_and_scan_through_bf16_products(lm):
  """grad: bf16 parameter gradients close to the float32 model's; vmap over examples equals
  the batched call; a lax.scan of decode steps equals the steps one by one."""
  model, variables, tokens = lm
  loss = lambda v, t: jnp.mean(model.apply(v, t).astype(jnp.float32) ** 2)
  grads = jax.jit(jax.grad(loss))(variables, tokens)
  assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(BF16)}
  up = lambda tree: jax.tree.map(lambda p: p.astype(jnp.float32), tree)
  cfg32 = CFG.__class__(**{**CFG.__dict__, "dtype": jnp.float32, "param_dtype": jnp.float32})
  grads32 = jax.grad(lambda v, t: jnp.mean(DecoderLM(cfg32).apply(v, t) ** 2))(
      up(variables), tokens)
  flat, flat32 = (np.concatenate([np.ravel(g) for g in jax.tree.leaves(up(t))])
                  for t in (grads, grads32))
  assert np.dot(flat, flat32) / np.linalg.norm(flat) / np.linalg.norm(flat32) > 0.99
  each = jax.vmap(lambda t: model.apply(variables, t[None])[0])(tokens)
  np.testing.assert_allclose(np.asarray(each, np.float32), model.apply(variables, tokens),
                             atol=0.05 * float(jnp.abs(each).max()))
  fn, (v, token, cache) = _step(model, variables, 2)
  step = lambda c, t: fn(v, t, c)[::-1]
  scanned = jax.lax.scan(step, cache, jnp.stack([token, token + 1, token + 2]))[1]
  for i in range(3):
    logits, cache = fn(v, token + i, cache)
    np.testing.assert_array_equal(scanned[i], logits)
