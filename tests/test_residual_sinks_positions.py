"""Attention sinks, the softmax statistics (`return_residual`) and positions, in every
implementation: against a float64 NumPy reference written here, values and gradients.

A sink is one more logit per query head in every row's softmax, with no value; the residual is
each row's log-sum-exp [..., T, H] (finfo.min for a row that sees nothing, or its sink);
positions make causality and windows compare absolute positions, negative ones being padding.
Half the sinks' cases run in tests/test_residual_sinks_positions_integration.py.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_mha
from flax_mha.kernels import chunked, decode, rows
from helpers import in_turn, qkv, split_grid

B, T, S, H, G, K, V = 2, 7, 11, 6, 3, 5, 4
IMPLS = {"reference": "reference", "xla": "xla", "chunked": "chunked",
         "chunked_small": chunked.make_attention(block_q=3, block_k=4), "rows": "rows",
         "rows_one_unit": rows.make_attention(2**5, 2**5), "default": None,
         "decode": "decode", "decode_small": decode.make_attention(block_k=2, splits=3)}


def np_stats(q, k, v, *, visible, sinks=None, scale=None):
  """float64 (out [B, T, H, V], lse [B, T, H]) with a sink column; empty rows: 0 and
  finfo.min (the sink's value with sinks)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  r = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, r, axis=2), np.repeat(v, r, axis=2)
  scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
  logits = np.einsum("bthk,bshk->bhts", q, k) * scale
  visible = np.broadcast_to(visible, logits.shape)
  if sinks is not None:
    column = np.broadcast_to(np.asarray(sinks, np.float64)[:, None], logits.shape[:-1])
    logits = np.concatenate([logits, column[..., None]], -1)
    visible = np.concatenate([visible, np.ones(visible.shape[:-1] + (1,), bool)], -1)
  shown = np.where(visible, logits, -np.inf)
  top = np.max(shown, -1, keepdims=True, initial=-np.inf)
  top = np.where(np.isfinite(top), top, 0.0)
  e = np.where(visible, np.exp(shown - top), 0.0)
  total = e.sum(-1, keepdims=True)
  weights = e / np.where(total > 0, total, 1)
  lse = np.where(total[..., 0] > 0, top[..., 0] + np.log(np.where(total > 0, total, 1))[..., 0],
                 np.finfo(np.float32).min)
  if sinks is not None:
    weights = weights[..., :-1]
  return np.einsum("bhts,bshv->bthv", weights, v), lse.transpose(0, 2, 1)


def _inputs(seed=0, t=T, s=S):
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(x) for x in qkv(rng, t=t, s=s, h=H, g=G, k=K, v=V))
  mask = rng.random((B, 1, t, s)) < 0.6
  mask[0, 0, 2] = False  # a row that sees nothing
  sinks = jnp.asarray(rng.standard_normal(H), jnp.float32)
  return q, k, v, jnp.asarray(mask), sinks


# Sinks with causality and neither, each implementation one of the two in turn; the other one
# (slow) and one without the other: the integration part.
_SINKS_TURN = in_turn(sorted(IMPLS), (False, True))
SINKS_CASES = [(impl, flag, flag) for impl in sorted(IMPLS) for flag in (False, True)
               if _SINKS_TURN(impl, flag)]
OTHER_SINKS_CASES = [(impl, flag, flag) for impl in sorted(IMPLS) for flag in (False, True)
                     if not _SINKS_TURN(impl, flag)]


@pytest.mark.parametrize("impl,with_sinks,is_causal", SINKS_CASES)
def test_sinks_and_lse_match_numpy_values_and_gradients(impl, with_sinks, is_causal):
  q, k, v, mask, sinks = _inputs(1)
  sinks = sinks if with_sinks else None
  visible = np.asarray(mask) & (np.tril(np.ones((T, S), bool)) if is_causal else True)
  fn = functools.partial(flax_mha.dot_product_attention, mask=mask, is_causal=is_causal,
                         return_residual=True, implementation=IMPLS[impl])
  out, lse = jax.jit(lambda q, k, v, s: fn(q, k, v, sinks=s))(q, k, v, sinks)
  want_out, want_lse = np_stats(q, k, v, visible=visible, sinks=sinks)
  np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(lse, want_lse, atol=2e-5, rtol=2e-5)
  chex.assert_shape(lse, (B, T, H))
  loss = lambda name: lambda q, k, v, s: jnp.sum(jnp.sin(flax_mha.dot_product_attention(
      q, k, v, mask=mask, is_causal=is_causal, sinks=s, implementation=name)))
  argnums = (0, 1, 2, 3) if with_sinks else (0, 1, 2)
  got = jax.jit(jax.grad(loss(IMPLS[impl]), argnums=argnums))(q, k, v, sinks)
  want = jax.grad(loss("reference"), argnums=argnums)(q, k, v, sinks)
  chex.assert_trees_all_close(got, want, atol=2e-5, rtol=2e-5)
  chex.assert_tree_all_finite(got)


def check_reference_sink_gradient_matches_finite_differences_in_float64():
  with jax.enable_x64(True):
    q, k, v, mask, sinks = (x.astype(jnp.float64) if x.dtype != bool else x for x in _inputs(2))
    f = lambda s: flax_mha.dot_product_attention(q, k, v, mask=mask, sinks=s,
                                                 implementation="reference")
    jax.test_util.check_grads(f, (sinks,), order=1, modes=["rev", "fwd"])


POSITIONS_IMPLS = ["reference", "xla", "chunked", "chunked_small", "default", "decode",
                   "decode_small"]
WINDOWS = [None, (3, 0), (2, 1)]
# Each implementation with one window in turn; the rest (slow): the integration part.
POSITIONS_GRID = split_grid(
    in_turn(POSITIONS_IMPLS, WINDOWS), lambda impl, window: False, POSITIONS_IMPLS, WINDOWS)


@pytest.mark.parametrize("impl,window", POSITIONS_GRID.unit)
def test_positions_match_numpy(impl, window):
  """Keys in a scrambled cache order with empty slots (-1), queries at absolute positions, two
  of them padding (-1): causality and the window compare positions."""
  q, k, v, _, sinks = _inputs(3)
  rng = np.random.default_rng(4)
  kv_pos = np.stack([rng.permutation(S) - 2 for _ in range(B)])  # -2, -1: empty slots
  q_pos = np.array([[3, 4, 5, 6, 7, -1, -1], [8, 9, 2, 5, 6, 7, 0]])
  visible = (kv_pos[:, None, None, :] >= 0) & (q_pos[:, None, :, None] >= 0)
  visible &= kv_pos[:, None, None, :] <= q_pos[:, None, :, None]
  if window is not None:
    visible &= kv_pos[:, None, None, :] >= q_pos[:, None, :, None] - window[0]
  fn = lambda q, k, v, s: flax_mha.dot_product_attention(
      q, k, v, is_causal=True, local_window_size=window, q_positions=jnp.asarray(q_pos),
      kv_positions=jnp.asarray(kv_pos), sinks=s, return_residual=True,
      implementation=IMPLS[impl])
  out, lse = jax.jit(fn)(q, k, v, sinks)
  want_out, want_lse = np_stats(q, k, v, visible=visible, sinks=sinks)
  np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(lse, want_lse, atol=2e-5, rtol=2e-5)


def test_empty_inputs_give_the_no_key_residual():
  q, k, v, _, sinks = _inputs(5)
  out, lse = flax_mha.dot_product_attention(q, k[:, :0], v[:, :0], return_residual=True)
  np.testing.assert_array_equal(out, 0.0)
  np.testing.assert_array_equal(lse, np.finfo(np.float32).min)
  _, lse = flax_mha.dot_product_attention(q, k[:, :0], v[:, :0], sinks=sinks,
                                          return_residual=True)
  np.testing.assert_array_equal(lse, np.broadcast_to(sinks, (B, T, H)))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(sinks=jnp.zeros((4,))), ValueError, r"sinks must have shape \[H\] = \(6,\)"),
    (dict(sinks=jnp.zeros((6,), jnp.int32)), TypeError, "sinks must have a floating dtype"),
    (dict(q_positions=jnp.zeros((B, T), jnp.int32)), ValueError,
     "q_positions and kv_positions must be given together"),
    (dict(q_positions=jnp.zeros((B, T)), kv_positions=jnp.zeros((B, S), jnp.int32)),
     TypeError, "q_positions must have an integer dtype"),
    (dict(return_residual=1), TypeError, "return_residual must be a Python bool"),
])
def test_bad_arguments_are_named(kwargs, error, match):
  q, k, v, _, _ = _inputs(6)
  with pytest.raises(error, match=match):
    flax_mha.dot_product_attention(q, k, v, **kwargs)


def test_rows_takes_sinks_but_cudnn_refuses_them():
  q, k, v, _, sinks = _inputs(7)
  flax_mha.dot_product_attention(q, k, v, sinks=sinks, implementation="rows")
  with pytest.raises(ValueError, match="implementation='cudnn' cannot run"):
    flax_mha.dot_product_attention(q, k, v, sinks=sinks, implementation="cudnn")
