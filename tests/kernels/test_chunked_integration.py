"""flax_mha.kernels.chunked at N=8192, run (slow: `make test-slow`): its rows equal the reference
on a slice. The unit part is tests/kernels/test_chunked.py, which compiles the same program
without running it to measure its memory."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import pytest

from flax_mha.kernels import chunked
from flax_mha.kernels import reference
from test_chunked import fwd_bwd

import test_chunked as test_chunked_cases

pytestmark = pytest.mark.integration

# Cases of tests/kernels/test_chunked.py that compile for seconds: the unit part skips them
# (`check_` there), the integration part runs them here.
test_forward_backward_with_offsets = (
    test_chunked_cases.check_forward_backward_with_offsets)


@pytest.mark.slow  # runs forward+backward at N=8192: ~10 s of CPU
def test_beyond_plain_memory_equal_to_reference_on_a_slice():
  """At N=8192, H=8, D=64 the chunked kernel runs, and its rows 5000..5063 (output and dquery)
  equal the reference computed on just those rows and the keys they see."""
  n, h, k_dim = 8192, 8, 64
  grads = fwd_bwd(chunked.attention, n, h, k_dim)  # (dq, dk, dv) of sum(out), causal
  q, k, v = (jax.random.normal(key, (1, n, h, k_dim))
             for key in jax.random.split(jax.random.key(0), 3))
  kw = dict(scale=k_dim**-0.5, dropout_rate=0.0, dropout_rng=None)
  dq, _, _ = grads(q, k, v)
  out = jax.jit(lambda q, k, v: chunked.attention(q, k, v, None, None, is_causal=True, **kw))(
      q, k, v)
  lo, hi = 5000, 5064  # causal: these rows see keys [0, hi)
  mask = (jnp.arange(lo, hi)[:, None] >= jnp.arange(hi))[None, None]
  ref, vjp = jax.vjp(lambda q_rows: reference.attention(q_rows, k[:, :hi], v[:, :hi], None, mask,
                                                         is_causal=False, **kw), q[:, lo:hi])
  chex.assert_trees_all_close(out[:, lo:hi], ref, atol=2e-5)
  chex.assert_trees_all_close(dq[:, lo:hi], vjp(jnp.ones_like(ref))[0], atol=1e-4)
  chex.assert_tree_all_finite(dq)
