"""flax_mha.kernels.xla, the tuned plain graph: its masked softmax against jax.nn and finite
differences. Its values and gradients against the oracle are in test_implementations.py."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.test_util import check_grads

from flax_mha.kernels import xla
from flax_mha.kernels.xla import masked_softmax


def check_masked_softmax_equals_softmax_of_visible_entries_and_zeroes_hidden_rows():
  """The masked softmax: visible entries as jax.nn.softmax over them, hidden ones and rows with
  nothing visible 0, the log-sum-exp finfo.min on those; gradients (its own JVP, with and
  without sinks) checked numerically in float64, and finite."""
  logits = jax.random.normal(jax.random.key(3), (2, 3, 5, 7)) * 3
  visible = jax.random.bernoulli(jax.random.key(4), 0.6, (2, 1, 5, 7)).at[0, 0, 2].set(False)
  weights, lse = masked_softmax(logits, visible)
  chex.assert_shape(weights, logits.shape)
  expected = jax.nn.softmax(logits, axis=-1, where=visible)
  np.testing.assert_allclose(weights, jnp.where(visible, expected, 0.0), atol=1e-6)
  np.testing.assert_array_equal(weights[0, :, 2], 0.0)
  want_lse = jax.nn.logsumexp(jnp.where(visible, logits, -jnp.inf), axis=-1)
  np.testing.assert_allclose(lse, jnp.where(visible.any(-1), want_lse, jnp.finfo(jnp.float32).min),
                             rtol=1e-6)
  fn = lambda x: masked_softmax(x, visible)[0] * jnp.arange(7.0)
  assert np.all(np.isfinite(jax.grad(lambda x: fn(x).sum())(logits)))
  with jax.enable_x64(True):  # second-order finite differences need float64's precision
    logits64 = logits.astype(jnp.float64)
    check_grads(fn, (logits64,), order=2, modes=["fwd", "rev"])
    sinks = jnp.linspace(-1.0, 1.0, 3, dtype=jnp.float64)[:, None, None]  # one per head
    check_grads(lambda x, s: masked_softmax(x, visible, s), (logits64, sinks), order=2,
                modes=["fwd", "rev"])


def test_plain_softmax_equals_jax_nn_with_its_own_jvp():
  """The plain path's softmax (its JVP from the weights alone, so the forward stays one pass):
  jax.nn.softmax's values and gradients, to second order in both modes; large logits finite."""
  logits = jax.random.normal(jax.random.key(5), (2, 3, 5, 7)) * 3
  np.testing.assert_allclose(xla.plain_softmax(logits), jax.nn.softmax(logits, axis=-1),
                             rtol=1e-6)
  assert np.all(np.isfinite(xla.plain_softmax(logits.at[0, 0, 0].set(1e30))))
  with jax.enable_x64(True):
    fn = lambda x: xla.plain_softmax(x) * jnp.arange(7.0)
    check_grads(fn, (logits.astype(jnp.float64),), order=2, modes=["fwd", "rev"])
    want = jax.grad(lambda x: jnp.sum(jnp.sin(jax.nn.softmax(x, axis=-1))))(logits)
    got = jax.grad(lambda x: jnp.sum(jnp.sin(xla.plain_softmax(x))))(logits)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
