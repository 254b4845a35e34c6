"""flax_mha.kernels.chunked against the oracle: gradients, offsets (ring attention), the tiles it
visits and memory.

Values and gradients on every combination of bias, mask, causality, dropout and head layout are in
tests/kernels/test_implementations.py; the N=8192 run in tests/kernels/test_chunked_integration.py.

Block sizes (3, 4) divide none of the prime lengths, so every test also covers the padding.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import flax_mha
from flax_mha import mods as mods_lib
from flax_mha.kernels import chunked
from flax_mha.kernels import reference
from helpers import call_kernel, kernel_inputs, output_and_grads

B, T, S, H, G, K, V = 2, 7, 11, 6, 3, 5, 13
SMALL = chunked.make_attention(block_q=3, block_k=4)


def _inputs(seed=0, t=T, s=S, h=H, g=G, k=K, v=V):
  return kernel_inputs(seed, t=t, s=s, h=h, g=g, k=k, v=v)


@pytest.mark.parametrize("is_causal", [False, True])
def test_check_grads_numerically(is_causal):
  q, k, v, bias, mask = _inputs(1, t=4, s=5, h=2, g=1, k=3, v=2)
  fn = lambda q, k, v, bias: call_kernel(SMALL, q, k, v, bias, mask, is_causal, 0.0)
  check_grads(jax.jit(fn), (q, k, v, bias), order=1, modes=("rev",), atol=5e-2, rtol=5e-2,
              eps=1e-2)


def test_fully_masked_rows_give_zero_and_finite_grads():
  q, k, v, _, _ = _inputs(2)
  mask = jnp.ones((B, 1, T, S), bool).at[:, :, 2].set(False)
  out, grads = output_and_grads(  # the gradients of sum(out)
      lambda q, k, v: call_kernel(SMALL, q, k, v, None, mask, False, 0.0), q, k, v,
      reduce=lambda out: out)
  np.testing.assert_array_equal(out[:, 2], 0.0)
  chex.assert_tree_all_finite(grads)
  np.testing.assert_array_equal(grads[0][:, 2], 0.0)


def test_long_bias_broadcast_and_t_ne_s_grads():
  q, k, v, _, _ = _inputs(3, t=13, s=6)
  bias = jnp.asarray(np.random.default_rng(3).standard_normal((B, 1, 1, 6)), jnp.float32)
  f = lambda fn: jax.grad(lambda b: jnp.sum(call_kernel(fn, q, k, v, b, None, True, 0.0) ** 2))
  chex.assert_trees_all_close(jax.jit(f(SMALL))(bias), f(reference.attention)(bias), atol=1e-5)


OFFSET_KW = dict(scale=0.37, is_causal=True, block_q=3, block_k=4)
# Offsets traced: one compile of each serves every (q_offset, kv_offset) below.
_forward_at = jax.jit(lambda q, k, v, q_offset, kv_offset: chunked.chunked_forward(
    q, k, v, q_offset=q_offset, kv_offset=kv_offset, **OFFSET_KW))
_backward_at = jax.jit(
    lambda q, k, v, out, lse, dout, q_offset, kv_offset: chunked.chunked_backward(
        q, k, v, out, lse, dout, q_offset=q_offset, kv_offset=kv_offset, **OFFSET_KW))


@pytest.mark.parametrize("q_offset,kv_offset", [(0, 0), (5, 0), (0, 6), (9, 3)])
def check_forward_backward_with_offsets(q_offset, kv_offset):
  """chunked_forward/backward of a shard pair equal the reference on the global causal mask."""
  q, k, v, _, _ = _inputs(4)
  t_pos = q_offset + jnp.arange(T)[:, None]
  visible = t_pos >= kv_offset + jnp.arange(S)[None, :]
  out, lse = _forward_at(q, k, v, q_offset, kv_offset)
  ref_fn = lambda q, k, v: reference.attention(
      q, k, v, None, visible[None, None], is_causal=False, scale=0.37, dropout_rate=0.0,
      dropout_rng=None)
  chex.assert_trees_all_close(out, ref_fn(q, k, v), atol=2e-6)
  logits = reference.attention_logits(q, k, None, 0.37)
  ref_lse = jax.nn.logsumexp(jnp.where(visible, logits, -jnp.inf), axis=-1)
  ref_lse = jnp.where(visible.any(-1), ref_lse, jnp.finfo(jnp.float32).min)  # no key: finite
  chex.assert_trees_all_close(lse, ref_lse, atol=2e-6)
  dout = jnp.asarray(np.random.default_rng(5).standard_normal(out.shape), jnp.float32)
  grads = _backward_at(q, k, v, out, lse, dout, q_offset, kv_offset)
  _, vjp = jax.vjp(ref_fn, q, k, v)
  chex.assert_trees_all_close(grads, vjp(dout), atol=1e-5)


def test_backward_contributions_sum_over_key_shards():
  """Splitting the keys in two and adding chunked_backward's parts gives the full gradient."""
  q, k, v, _, _ = _inputs(6)
  out, lse = _forward_at(q, k, v, 0, 0)
  dout = jnp.ones_like(out)
  full = _backward_at(q, k, v, out, lse, dout, 0, 0)
  parts = [_backward_at(q, k[:, sl], v[:, sl], out, lse, dout, 0, sl.start)
           for sl in (slice(0, 5), slice(5, S))]
  chex.assert_trees_all_close(parts[0][0] + parts[1][0], full[0], atol=1e-5)
  chex.assert_trees_all_close(jnp.concatenate([parts[0][1], parts[1][1]], 1), full[1], atol=1e-5)


def test_chunked_forward_mode_is_a_named_error():
  q, k, v, _, _ = _inputs(3)
  fn = lambda q: flax_mha.dot_product_attention(q, k, v, implementation="chunked")
  for transform in (lambda: jax.jvp(fn, (q,), (q,)), lambda: jax.jacfwd(fn)(q)):
    with pytest.raises(TypeError, match="implementation='xla' or 'reference' for forward mode"):
      transform()


# ---- the tiles it visits ----


def _visits(t, s, bq, bk, mods, mask=None):
  q = jnp.zeros((B, t, H, K))
  cfg = chunked.Config(1.0, 0.0, bq, bk)  # pylint: disable=protected-access
  ctx = chunked.tile_context(q, q[:, :s], None, mask, None, mods, cfg, 0, 0)  # pylint: disable=protected-access
  return np.asarray(ctx.rows.full_count), np.asarray(ctx.rows.partial_count), ctx.rows


def test_tiles_causal_window_are_known_at_trace_time():
  """Causal over 8 x 8 tiles: 28 below the diagonal unmasked, 8 on it masked, 28 skipped; a
  window of 16 keeps only the band; a mask_mod spelling causality gives causal's tiles."""
  full, partial, rows = _visits(64, 64, 8, 8, mods_lib.with_causal(None, True))
  assert isinstance(rows.full_count, np.ndarray)  # static: computed while tracing
  assert full.sum() == 28 and partial.sum() == 8
  full, partial, _ = _visits(64, 64, 8, 8, mods_lib.Mods((mods_lib.LocalWindow(16, 0),)))
  assert (full + partial).max() <= 4 and full.sum() + partial.sum() < 64 * 0.5
  spelled = mods_lib.Mods((mods_lib.MaskMod(lambda b, h, q, kv: q >= kv),))
  full2, partial2, rows2 = _visits(64, 64, 8, 8, spelled)
  assert isinstance(rows2.full_count, np.ndarray)
  assert full2.sum() == 28 and partial2.sum() == 8


def test_tiles_of_segments_come_from_min_max_at_run_time():
  """Two documents of 32 in 64 tokens, 8 x 8 tiles: the 2 x 16 same-document tiles are all
  visible and nothing else is visited."""
  ids = jnp.asarray(np.repeat([[0, 1]], B, axis=0).repeat(32, axis=1))
  full, partial, rows = _visits(64, 64, 8, 8, mods_lib.Mods((mods_lib.Segments(ids, ids),)))
  assert not isinstance(rows.full_count, np.ndarray)
  assert full.sum() == 32 and partial.sum() == 0


def test_dense_mask_tiles_are_skipped():
  mask = jnp.zeros((B, 1, 1, 64), bool).at[..., :16].set(True)  # key padding: 16 real keys
  full, partial, _ = _visits(64, 64, 8, 8, mods_lib.Mods(), mask=mask)
  assert full.sum() == 8 * 2 and partial.sum() == 0


def test_segment_ids_memory_is_linear():
  """fwd+bwd with segment ids at N=16384, H=1: XLA temp memory far below the [T, S] matrix."""
  n = 16384
  x = jax.ShapeDtypeStruct((1, n, 1, 64), jnp.float32)
  ids = jax.ShapeDtypeStruct((1, n), jnp.int32)
  loss = lambda q, k, v, ids: jnp.sum(flax_mha.dot_product_attention(
      q, k, v, q_segment_ids=ids, implementation="chunked"))
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x, ids).compile()
  assert compiled.memory_analysis().temp_size_in_bytes < 64 * 2**20  # [T, S] f32: 1 GiB


# ---- memory ----


def fwd_bwd(fn, n, h=8, k_dim=64):
  x = jax.ShapeDtypeStruct((1, n, h, k_dim), jnp.float32)
  loss = lambda q, k, v: jnp.sum(fn(q, k, v, None, None, is_causal=True, scale=k_dim**-0.5,
                                    dropout_rate=0.0, dropout_rng=None))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()


def test_beyond_plain_memory():
  """Forward+backward at N=8192, H=8, D=64 (compiled, not run): plain attention needs > 4 GiB of
  temp memory, the chunked kernel < 256 MiB."""
  temp_bytes = lambda fn: fwd_bwd(fn, 8192, 8, 64).memory_analysis().temp_size_in_bytes
  assert temp_bytes(reference.attention) > 4 * 2**30
  assert temp_bytes(chunked.attention) < 256 * 2**20
