"""flax_mha.kernels.chunked against the oracle: gradients, offsets (ring attention) and memory.

Values and gradients on every combination of bias, mask, causality, dropout and head layout are in
tests/kernels/test_implementations.py.

Block sizes (3, 4) divide none of the prime lengths, so every test also covers the padding.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from flax_mha.kernels import chunked
from flax_mha.kernels import reference

B, T, S, H, G, K, V = 2, 7, 11, 6, 3, 5, 13
SMALL = chunked.make_attention(block_q=3, block_k=4)


def _inputs(seed=0, t=T, s=S, h=H, g=G, k=K, v=V):
  rng = np.random.default_rng(seed)
  q, kk, vv = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
               for shape in ((B, t, h, k), (B, s, g, k), (B, s, g, v)))
  bias = jnp.asarray(rng.standard_normal((1, h, t, s)), jnp.float32)
  mask = jnp.asarray(rng.random((B, 1, t, s)) < 0.7)
  return q, kk, vv, bias, mask


def _call(fn, q, k, v, bias, mask, is_causal, dropout_rate):
  return fn(q, k, v, bias, mask, is_causal=is_causal, scale=0.37, dropout_rate=dropout_rate,
            dropout_rng=jax.random.key(7))


@pytest.mark.parametrize("is_causal", [False, True])
def test_check_grads_numerically(is_causal):
  q, k, v, bias, mask = _inputs(1, t=4, s=5, h=2, g=1, k=3, v=2)
  fn = lambda q, k, v, bias: _call(SMALL, q, k, v, bias, mask, is_causal, 0.0)
  check_grads(fn, (q, k, v, bias), order=1, modes=("rev",), atol=5e-2, rtol=5e-2, eps=1e-2)


def test_fully_masked_rows_give_zero_and_finite_grads():
  q, k, v, _, _ = _inputs(2)
  mask = jnp.ones((B, 1, T, S), bool).at[:, :, 2].set(False)
  out = _call(SMALL, q, k, v, None, mask, False, 0.0)
  np.testing.assert_array_equal(out[:, 2], 0.0)
  grads = jax.grad(lambda q, k, v: jnp.sum(_call(SMALL, q, k, v, None, mask, False, 0.0)),
                   argnums=(0, 1, 2))(q, k, v)
  chex.assert_tree_all_finite(grads)
  np.testing.assert_array_equal(grads[0][:, 2], 0.0)


def test_long_bias_broadcast_and_t_ne_s_grads():
  q, k, v, _, _ = _inputs(3, t=13, s=6)
  bias = jnp.asarray(np.random.default_rng(3).standard_normal((B, 1, 1, 6)), jnp.float32)
  f = lambda fn: jax.grad(lambda b: jnp.sum(_call(fn, q, k, v, b, None, True, 0.0) ** 2))
  chex.assert_trees_all_close(f(SMALL)(bias), f(reference.attention)(bias), atol=1e-5)


@pytest.mark.parametrize("q_offset,kv_offset", [(0, 0), (5, 0), (0, 6), (9, 3)])
def test_forward_backward_with_offsets(q_offset, kv_offset):
  """chunked_forward/backward of a shard pair equal the reference on the global causal mask."""
  q, k, v, _, _ = _inputs(4)
  t_pos = q_offset + jnp.arange(T)[:, None]
  visible = t_pos >= kv_offset + jnp.arange(S)[None, :]
  kw = dict(scale=0.37, is_causal=True, block_q=3, block_k=4)
  out, lse = jax.jit(lambda q, k, v, o1, o2: chunked.chunked_forward(
      q, k, v, q_offset=o1, kv_offset=o2, **kw))(q, k, v, q_offset, kv_offset)  # traced offsets
  ref_fn = lambda q, k, v: reference.attention(
      q, k, v, None, visible[None, None], is_causal=False, scale=0.37, dropout_rate=0.0,
      dropout_rng=None)
  chex.assert_trees_all_close(out, ref_fn(q, k, v), atol=2e-6)
  logits = reference.attention_logits(q, k, None, 0.37)
  ref_lse = jax.nn.logsumexp(jnp.where(visible, logits, -jnp.inf), axis=-1)
  ref_lse = jnp.where(visible.any(-1), ref_lse, jnp.finfo(jnp.float32).min)  # no key: finite
  chex.assert_trees_all_close(lse, ref_lse, atol=2e-6)
  dout = jnp.asarray(np.random.default_rng(5).standard_normal(out.shape), jnp.float32)
  grads = chunked.chunked_backward(q, k, v, out, lse, dout, q_offset=q_offset,
                                   kv_offset=kv_offset, **kw)
  _, vjp = jax.vjp(ref_fn, q, k, v)
  chex.assert_trees_all_close(grads, vjp(dout), atol=1e-5)


def test_backward_contributions_sum_over_key_shards():
  """Splitting the keys in two and adding chunked_backward's parts gives the full gradient."""
  q, k, v, _, _ = _inputs(6)
  kw = dict(scale=0.37, is_causal=True, block_q=3, block_k=4)
  out, lse = chunked.chunked_forward(q, k, v, **kw)
  dout = jnp.ones_like(out)
  full = chunked.chunked_backward(q, k, v, out, lse, dout, **kw)
  parts = [chunked.chunked_backward(q, k[:, sl], v[:, sl], out, lse, dout, kv_offset=sl.start,
                                    **kw) for sl in (slice(0, 5), slice(5, S))]
  chex.assert_trees_all_close(parts[0][0] + parts[1][0], full[0], atol=1e-5)
  chex.assert_trees_all_close(jnp.concatenate([parts[0][1], parts[1][1]], 1), full[1], atol=1e-5)


def _fwd_bwd(fn, n, h=8, d=64):
  x = jax.ShapeDtypeStruct((1, n, h, d), jnp.float32)
  loss = lambda q, k, v: jnp.sum(fn(q, k, v, None, None, is_causal=True, scale=d**-0.5,
                                    dropout_rate=0.0, dropout_rng=None))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()


def test_beyond_plain_memory_and_equal_to_reference_on_a_slice():
  """Forward+backward at N=8192, H=8, D=64, where plain attention needs > 4 GiB of temp memory:
  the chunked kernel compiles to < 256 MiB, runs, and its rows 5000..5063 (output and dquery)
  equal the reference computed on just those rows and the keys they see."""
  n, h, d = 8192, 8, 64
  assert _fwd_bwd(reference.attention, n, h, d).memory_analysis().temp_size_in_bytes > 4 * 2**30
  grads = _fwd_bwd(chunked.attention, n, h, d)  # (dq, dk, dv) of sum(out), causal
  assert grads.memory_analysis().temp_size_in_bytes < 256 * 2**20
  q, k, v = (jax.random.normal(key, (1, n, h, d)) for key in jax.random.split(jax.random.key(0), 3))
  kw = dict(scale=d**-0.5, dropout_rate=0.0, dropout_rng=None)
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
