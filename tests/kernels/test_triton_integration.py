"""flax_mha's Triton flash kernel (`flax_mha.kernels.triton`) run in Pallas interpret mode
without a GPU: every option it takes, forward and gradient, against the oracle; blocks that its
loop bounds skip; 16-bit inputs; transforms; a bias nothing differentiates; and the kernels
named in what is exported for 'cuda'. The unit part is tests/kernels/test_triton.py (one
interpreted case, the refusals, what None exports, the loop bounds)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import pytest

import flax_mha
from flax_mha.kernels import triton
from helpers import output_and_grads
from test_triton import (BIAS, EXPORTED, INTERPRETED, OPTIONS, SEG_KV, SEG_Q, B, H, K, S,
                         shared_attention, shared_check, shared_inputs, shared_rng)
import test_triton as unit

pytestmark = pytest.mark.integration  # interpret mode: each case compiles Pallas kernels, 1-4 s


@pytest.mark.parametrize("implementation", ["triton"])  # None: the unit part
@pytest.mark.parametrize("name", [*EXPORTED, "bias"])
def test_exports_the_pallas_kernels_for_cuda(name, implementation):
  unit.test_exports_the_pallas_kernels_for_cuda(name, implementation)


def test_a_bias_without_gradient_gets_none_computed():
  """A bias nothing differentiates (a constant here) costs no dBias [B, H, T, S] in the
  backward, which still gives the oracle's q, k and v gradients; a graded one gets it."""
  fn = lambda q, k, v, bias=BIAS: INTERPRETED(q, k, v, bias, None, is_causal=True, scale=0.3,
                                               dropout_rate=0.0, dropout_rng=None)
  args = shared_inputs(S)
  dbias = f"f32[{B},{H},16,16]"  # the padded [B, H, T, S] the kernel would write
  loss = lambda *a: jnp.sum(jnp.sin(fn(*a)))
  assert dbias not in str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*args))
  assert dbias in str(jax.make_jaxpr(jax.grad(loss, argnums=3))(*args, BIAS))
  oracle = lambda q, k, v: flax_mha.dot_product_attention(
      q, k, v, BIAS, is_causal=True, scale=0.3, implementation="reference")
  chex.assert_trees_all_close(output_and_grads(fn, *args),
                              output_and_grads(oracle, *args, jit=False), atol=5e-6, rtol=5e-6)


@pytest.mark.parametrize("return_residual", [False, True])
@pytest.mark.parametrize("name", OPTIONS)
def test_interpreted_matches_oracle(name, return_residual):
  s, options, graded = OPTIONS[name]
  shared_check(INTERPRETED, s, options, graded, return_residual)


# Blocks of 16 over 40 and 56 tokens: the loop bounds of causality and windows skip blocks,
# the last block is padded.
BLOCKED = triton.make_attention(interpret=True, block_q=16, block_kv=16)


@pytest.mark.parametrize("t, s, options, bias", [
    (40, 40, dict(is_causal=True), False),
    (40, 40, dict(local_window_size=(5, 17)), False),
    (40, 40, dict(local_window_size=(3, 0), sink_tokens=18, is_causal=True), False),
    (40, 40, dict(local_window_size=(2, 1), sink_tokens=20), False),
    (40, 56, dict(is_causal=True), False),
    (56, 40, dict(is_causal=True), True),  # dBias: every tile written, hidden ones as 0
])
def test_interpreted_skipped_blocks_match_oracle(t, s, options, bias):
  graded = dict(bias=jnp.asarray(shared_rng.standard_normal((B, 1, t, s)), jnp.float32)) if bias else {}
  shared_check(BLOCKED, s, options, graded, t=t)


def test_interpreted_16_bit_matches_oracle():
  """bfloat16 and float16 with GQA, segment ids and causality, to 16-bit accuracy."""
  options = dict(is_causal=True, q_segment_ids=SEG_Q, kv_segment_ids=SEG_KV)
  for dtype in (jnp.bfloat16, jnp.float16):
    shared_check(INTERPRETED, S, options, {}, dtype=dtype, tol=3e-2, seed=1)


@pytest.mark.parametrize("transform", ["vmap", "scan", "checkpoint"])
def test_interpreted_under_transforms_with_grad(transform):
  """Under vmap (over an extra leading axis), lax.scan over two layers and jax.checkpoint,
  values and gradients equal the oracle's under the same transform."""
  q, k, v = shared_inputs(S)
  options = dict(is_causal=True, q_segment_ids=SEG_Q, kv_segment_ids=SEG_KV)

  def composed(implementation):
    attend = shared_attention(implementation, False, options)
    if transform == "vmap":
      return lambda q, k, v: jax.vmap(attend)(*(jnp.stack([x, -x]) for x in (q, k, v)))
    if transform == "checkpoint":
      return jax.checkpoint(attend)
    def layers(q, k, v):  # two layers: each one's output is the next one's query
      step = lambda x, _: (attend(x, k, v[..., :K]), None)
      return jax.lax.scan(step, q, None, length=2)[0]
    return layers

  got = output_and_grads(composed(INTERPRETED), q, k, v)
  want = output_and_grads(composed("reference"), q, k, v, jit=False)
  chex.assert_trees_all_close(got, want, atol=5e-6, rtol=5e-6)


# Moved from the unit part for its time (5.5 s of Pallas interpret mode).
test_interpreted_gqa_causal_segments_bias_matches_oracle = unit.check_interpreted_gqa_causal_segments_bias_matches_oracle

# Moved from the unit part for its time (5.6 s on the slower type).
test_upstream_kernels_with_silent_bugs_cannot_be_reached = (
    unit.check_upstream_kernels_with_silent_bugs_cannot_be_reached)
