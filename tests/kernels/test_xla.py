"""flax_mha.kernels.xla, the tuned plain graph: its masked softmax against jax.nn and finite
differences. Its values and gradients against the oracle are in test_implementations.py."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.test_util import check_grads

from flax_mha.kernels.xla import masked_softmax


def test_masked_softmax_equals_softmax_of_visible_entries_and_zeroes_hidden_rows():
  """The masked softmax: visible entries as jax.nn.softmax over them, hidden
  ones and rows with nothing visible 0; gradients (its own JVP) checked numerically, and finite."""
  logits = jax.random.normal(jax.random.key(3), (2, 3, 5, 7)) * 3
  visible = jax.random.bernoulli(jax.random.key(4), 0.6, (2, 1, 5, 7)).at[0, 0, 2].set(False)
  weights = masked_softmax(logits, visible)
  chex.assert_shape(weights, logits.shape)
  expected = jax.nn.softmax(logits, axis=-1, where=visible)
  np.testing.assert_allclose(weights, jnp.where(visible, expected, 0.0), atol=1e-6)
  np.testing.assert_array_equal(weights[0, :, 2], 0.0)
  fn = lambda x: masked_softmax(x, visible) * jnp.arange(7.0)
  check_grads(fn, (logits,), order=2, modes=["fwd", "rev"])
  assert np.all(np.isfinite(jax.grad(lambda x: fn(x).sum())(logits)))
