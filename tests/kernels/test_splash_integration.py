"""Splash attention (`flax_mha.kernels.splash`) run in Pallas interpret mode without a TPU: every
option it maps, forward and gradient, against the oracle, in float32 and bfloat16. What it
refuses and what None exports for 'tpu' are the unit part, tests/kernels/test_splash.py."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import pytest

from helpers import output_and_grads
from test_splash import INTERPRETED, OPTIONS, SEG_KV, SEG_Q, S, shared_attention, shared_inputs

pytestmark = pytest.mark.integration  # each case compiles splash's three Pallas kernels: 3-9 s


@pytest.mark.parametrize("return_residual", [False, True])
@pytest.mark.parametrize("name", OPTIONS)
def test_interpreted_matches_oracle(name, return_residual):
  """Values, the lse and the gradients of q, k, v (and sinks) against the oracle."""
  s, options = OPTIONS[name]
  options = dict(options)
  args = shared_inputs(s)
  if "sinks" in options:
    args.append(options.pop("sinks"))
  reduce = (lambda r: jnp.sin(r[0])) if return_residual else jnp.sin
  got = output_and_grads(shared_attention(INTERPRETED, return_residual, options), *args,
                         reduce=reduce)
  want = output_and_grads(shared_attention("reference", return_residual, options), *args,
                          reduce=reduce, jit=False)
  chex.assert_trees_all_close(got, want, atol=5e-6, rtol=5e-6)


def test_interpreted_bfloat16_matches_oracle():
  """bfloat16 inputs, GQA, segment ids and causality: values and gradients to bf16 accuracy."""
  options = dict(is_causal=True, q_segment_ids=SEG_Q, kv_segment_ids=SEG_KV)
  args = shared_inputs(S, jnp.bfloat16, seed=1)
  got = output_and_grads(shared_attention(INTERPRETED, False, options), *args)
  want = output_and_grads(shared_attention("reference", False, options), *args, jit=False)
  chex.assert_trees_all_close(jax.tree.map(lambda x: x.astype(jnp.float32), got),
                              jax.tree.map(lambda x: x.astype(jnp.float32), want),
                              atol=3e-2, rtol=3e-2)
