"""The decoder with experts trains (its loss falls, every parameter moves), and the auxiliary
loss equals transformers' `load_balancing_loss_func` on the same router logits; DeepSeek V3's
router and shared experts equal transformers' DeepseekV3MoE on the same weights. Integration:
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


@pytest.mark.parametrize("normalize", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_deepseek_v3s_router_and_shared_experts_equal_transformers(rng, normalize):
  """`MoEMLP` (linen and NNX) with the "sigmoid_groups" router and shared experts against
  transformers' DeepseekV3MoE on the same weights: 8 experts in 4 groups, the best 2 kept, top
  3, a correction bias, a routed scale of 2.5, 2 shared experts."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from flax import nnx
  from transformers.models.deepseek_v3 import modeling_deepseek_v3
  from flax_mha.models import moe_nnx
  d, x_count, f, shared = 24, 8, 10, 2
  theirs = modeling_deepseek_v3.DeepseekV3MoE(transformers.DeepseekV3Config(
      hidden_size=d, moe_intermediate_size=f, n_routed_experts=x_count, num_experts_per_tok=3,
      n_group=4, topk_group=2, norm_topk_prob=normalize, routed_scaling_factor=2.5,
      n_shared_experts=shared, hidden_act="silu")).eval()
  cfg = LMConfig(vocab_size=31, d_model=d, num_heads=2, num_kv_heads=1, num_layers=1, d_ff=17,
                 mlp="swiglu", local_window=None,
                 moe=MoE(x_count, 3, f, normalize=normalize, router="sigmoid_groups",
                         groups=(4, 2), routed_scale=2.5, shared_d_ff=shared * f))
  draw = lambda *shape: rng.standard_normal(shape).astype(np.float32) * 0.5
  params = {"router": {"kernel": draw(d, x_count)}, "correction_bias": draw(x_count),
            "gate": draw(x_count, d, f), "up": draw(x_count, d, f), "down": draw(x_count, f, d),
            "shared_gate": draw(d, shared * f), "shared_up": draw(d, shared * f),
            "shared_down": draw(shared * f, d)}
  as_torch = lambda a: torch.nn.Parameter(torch.from_numpy(np.ascontiguousarray(a)))
  theirs.gate.weight = as_torch(params["router"]["kernel"].T)
  theirs.gate.e_score_correction_bias.copy_(torch.from_numpy(params["correction_bias"]))
  theirs.experts.gate_up_proj = as_torch(np.concatenate(
      [params["gate"], params["up"]], axis=2).transpose(0, 2, 1))
  theirs.experts.down_proj = as_torch(params["down"].transpose(0, 2, 1))
  for name in ("gate", "up", "down"):
    getattr(theirs.shared_experts, f"{name}_proj").weight = as_torch(params[f"shared_{name}"].T)
  h = draw(2, 7, d)
  with torch.no_grad():
    want = theirs(torch.from_numpy(h)).numpy()
  layer = moe.MoEMLP(cfg)
  got = layer.apply({"params": params}, jnp.asarray(h))
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  twin = moe_nnx.MoEMLP(cfg, rngs=nnx.Rngs(0))
  nnx.update(twin, nnx.State(jax.tree.map(jnp.asarray, params)))
  np.testing.assert_allclose(twin(jnp.asarray(h)), want, atol=2e-5, rtol=2e-5)
