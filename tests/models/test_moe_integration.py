"""The decoder with experts trains (its loss falls, every parameter moves), and the auxiliary
loss equals transformers' `load_balancing_loss_func` on the same router logits. Integration:
whole-model compiles and torch. Unit tests: tests/models/test_moe.py; Mixtral and Qwen3-MoE
checkpoints against transformers: tests/models/test_hf_integration.py.

Dimension key (flax_mha.models.moe): Y tokens, X experts, A experts a token takes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_mha.models import lm, moe
from flax_mha.models.lm_config import LMConfig, MoE

import test_moe as test_moe_cases

pytestmark = pytest.mark.integration

# Cases of tests/models/test_moe.py that compile for seconds: the unit part skips them
# (`check_` there), the integration part runs them here.
test_gradients_equal_finite_differences_and_the_dense_computation = (
    test_moe_cases.check_gradients_equal_finite_differences_and_the_dense_computation)


def test_the_decoder_with_experts_trains(rng):
  """30 steps of gradient descent on one batch (next-token cross-entropy, layers 0 and 2
  sparse, 1 dense): the loss falls by half and every parameter, routers included, moves."""
  cfg = LMConfig(vocab_size=31, d_model=28, num_heads=2, num_kv_heads=1, num_layers=3, d_ff=17,
                 mlp="swiglu", local_window=None, moe=MoE(5, 2, 11, layers=(0, 2)))
  model = lm.DecoderLM(cfg)
  tokens = jnp.asarray(rng.integers(0, 31, (4, 12)), jnp.int32)
  params = model.init(jax.random.key(0), tokens)["params"]

  def loss(p):
    logits = model.apply({"params": p}, tokens[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))

  @jax.jit
  def step(p):
    value, grads = jax.value_and_grad(loss)(p)
    return jax.tree.map(lambda a, g: a - 0.5 * g, p, grads), value

  values, trained = [], params
  for _ in range(31):  # the last value: the loss after 30 steps
    trained, value = step(trained)
    values.append(float(value))
  assert values[-1] < 0.5 * values[0], values
  moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), params, trained)
  assert all(jax.tree.leaves(moved)), moved


@pytest.mark.parametrize("masked", [False, True])
def test_the_load_balancing_loss_equals_transformers(rng, masked):
  torch = pytest.importorskip("torch")
  modeling = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
  layers, batch, length, x_count, a_count = 3, 2, 7, 5, 2
  logits = rng.standard_normal((layers, batch * length, x_count)).astype(np.float32)
  mask = (np.arange(length)[None] < np.array([[7], [4]])).astype(np.int64) if masked else None
  want = modeling.load_balancing_loss_func(
      tuple(torch.from_numpy(layer) for layer in logits), x_count, a_count,
      None if mask is None else torch.from_numpy(mask))
  got = moe.load_balancing_loss(logits.reshape(-1, x_count), a_count,
                                None if mask is None else np.tile(mask.reshape(-1), layers))
  np.testing.assert_allclose(got, float(want), rtol=1e-5)
