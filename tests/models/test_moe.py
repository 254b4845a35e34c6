"""flax_mha.models.moe: the router against NumPy, the grouped experts against a float64 NumPy
oracle that runs every expert on every token, their compiled FLOPs (they grow with the experts
a token takes, A, not with the experts there are, X), gradients against finite differences and
against the dense computation, the linen layer's gradients, and the refusals of `MoE` and
`LMConfig`. Against transformers' Mixtral and Qwen3-MoE on the same weights:
tests/models/test_hf_integration.py.

Dimension key (flax_mha.models.moe): Y tokens, D width, X experts, A experts a token takes,
F an expert's width. Sizes are distinct primes where they can be.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from flax_mha.models import moe
from flax_mha.models.lm_config import LMConfig, MoE

Y, D, X, A, F = 13, 7, 5, 2, 11


def np_route(logits, top_k, normalize):
  """float64 softmax over X, the top_k probabilities (descending) and their experts."""
  logits = np.asarray(logits, np.float64)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  experts = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
  weights = np.take_along_axis(probs, experts, -1)
  return (weights / weights.sum(-1, keepdims=True) if normalize else weights), experts


def np_experts(x, weights, experts, gate, up, down, biases=(0, 0, 0), clamped=None):
  """The oracle: every expert on every token, SwiGLU (or with `clamped` (alpha, limit)
  gpt-oss's min(g, limit)·sigmoid(alpha·min(g, limit))·(clip(u, ±limit) + 1)), plus each
  expert's `biases` (gate, up, down), combined by the routing weights."""
  x, gate, up, down = (np.asarray(a, np.float64) for a in (x, gate, up, down))
  b_gate, b_up, b_down = (np.asarray(b, np.float64) for b in biases)
  combine = np.zeros((x.shape[0], gate.shape[0]))
  np.add.at(combine, (np.arange(x.shape[0])[:, None], np.asarray(experts)),
            np.asarray(weights, np.float64))
  g = np.einsum("yd,xdf->yxf", x, gate) + b_gate
  u = np.einsum("yd,xdf->yxf", x, up) + b_up
  if clamped is None:
    h = g / (1 + np.exp(-g)) * u
  else:
    alpha, limit = clamped
    g = np.minimum(g, limit)
    h = g / (1 + np.exp(-alpha * g)) * (np.clip(u, -limit, limit) + 1)
  return np.einsum("yxd,yx->yd", np.einsum("yxf,xfd->yxd", h, down) + b_down, combine)


def swiglu(gate, up):
  return jax.nn.silu(gate) * up


def _dense(x, weights, experts, gate, up, down, glu=swiglu):
  """The oracle in jax (for gradients): every expert on every token."""
  combine = jnp.zeros((x.shape[0], gate.shape[0]), weights.dtype).at[
      jnp.arange(x.shape[0])[:, None], experts].add(weights)
  h = glu(jnp.einsum("yd,xdf->yxf", x, gate), jnp.einsum("yd,xdf->yxf", x, up))
  return jnp.einsum("yxf,xfd,yx->yd", h, down, combine)


def _weights(rng, x=X, dtype=np.float32):
  return tuple(rng.standard_normal(s).astype(dtype) for s in ((x, D, F), (x, D, F), (x, F, D)))


def test_the_router_is_a_softmax_top_k_renormalised_or_not(rng):
  logits = rng.standard_normal((Y, X)).astype(np.float32) * 3
  for normalize in (True, False):
    weights, experts = moe.route(jnp.asarray(logits), A, normalize)
    want_weights, want_experts = np_route(logits, A, normalize)
    np.testing.assert_array_equal(experts, want_experts)
    np.testing.assert_allclose(weights, want_weights, rtol=1e-6)
    assert weights.dtype == jnp.float32 and experts.dtype == jnp.int32


def np_route_sigmoid_groups(logits, correction, top_k, groups, normalize, scale):
  """float64: sigmoid scores; choice = scores + correction, groups ranked by the sum of their
  two best, the best kept; the top_k of the kept groups' experts, weighted by their scores."""
  scores = 1 / (1 + np.exp(-np.asarray(logits, np.float64)))
  choice = scores + np.asarray(correction, np.float64)
  count, kept = groups
  y, x = choice.shape
  by_group = np.sort(choice.reshape(y, count, x // count), axis=-1)[..., -2:].sum(-1)
  best = np.argsort(-by_group, axis=-1, kind="stable")[:, :kept]
  allowed = np.zeros((y, x), bool)
  for row in range(y):
    for g in best[row]:
      allowed[row, g * (x // count):(g + 1) * (x // count)] = True
  experts = np.argsort(-np.where(allowed, choice, -np.inf), axis=-1, kind="stable")[:, :top_k]
  weights = np.take_along_axis(scores, experts, -1)
  if normalize:
    weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
  return weights * scale, experts


def test_the_softmax_router_keeps_groups_by_their_best_as_deepseek_v2s(rng):
  """"group_limited_greedy": 6 experts in 3 groups of 2, the 2 groups with the best
  probability kept, top 3 of their experts, times the routed scale, never renormalised. Row 0's
  third best expert (2) lies in the dropped group, so it takes its kept group's weaker one."""
  logits = rng.standard_normal((Y, 6)).astype(np.float32) * 2
  logits[0] = [5.0, 0.0, 4.6, 4.55, 4.7, -3.0]  # groups' bests: 5.0, 4.6, 4.7
  weights, experts = moe.route(jnp.asarray(logits), 3, False, (3, 2), 1.5)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs = probs / probs.sum(-1, keepdims=True)
  best = np.argsort(-probs.reshape(Y, 3, 2).max(-1), axis=-1, kind="stable")[:, :2]
  kept = np.zeros((Y, 6), bool)
  for row in range(Y):
    for g in best[row]:
      kept[row, 2 * g:2 * g + 2] = True
  want_experts = np.argsort(-np.where(kept, probs, 0.0), axis=-1, kind="stable")[:, :3]
  np.testing.assert_array_equal(experts, want_experts)
  np.testing.assert_allclose(weights, 1.5 * np.take_along_axis(probs, want_experts, -1),
                             rtol=1e-5)
  assert np.asarray(experts)[0].tolist() == [0, 4, 1]
  assert np.asarray(moe.route(jnp.asarray(logits), 3, False)[1])[0].tolist() == [0, 4, 2]


@pytest.mark.parametrize("normalize", [True, False])
def test_the_sigmoid_group_router_is_deepseek_v3s(rng, normalize):
  """6 experts in 3 groups of 2, the best 2 groups kept, top 3 of their experts: the correction
  moves the choice (a large one on expert 5 wins it a place), the weights are plain scores."""
  logits = rng.standard_normal((Y, 6)).astype(np.float32) * 2
  correction = np.array([0.0, 0.1, -0.2, 0.0, 0.05, 3.0], np.float32)
  weights, experts = moe.route_sigmoid_groups(jnp.asarray(logits), jnp.asarray(correction), 3,
                                              (3, 2), normalize, 2.5)
  want_weights, want_experts = np_route_sigmoid_groups(logits, correction, 3, (3, 2), normalize,
                                                       2.5)
  np.testing.assert_array_equal(experts, want_experts)
  np.testing.assert_allclose(weights, want_weights, rtol=1e-6)
  assert (np.asarray(experts) == 5).any(axis=1).all()  # the correction's doing
  scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
  np.testing.assert_allclose(weights, 2.5 * np.take_along_axis(scores, np.asarray(experts), -1)
                             / (np.take_along_axis(scores, np.asarray(experts), -1).sum(
                                 -1, keepdims=True) if normalize else 1), rtol=1e-6)


@pytest.mark.parametrize("routing", ["random", "one_expert", "fewer_rows_than_experts"])
def test_the_tiles_hold_every_routed_row_once_with_its_expert(rng, routing):
  m, x = {"random": (26, 5), "one_expert": (26, 5), "fewer_rows_than_experts": (3, 7)}[routing]
  experts = rng.integers(0, x, m) if routing != "one_expert" else np.full(m, 3)
  rows, expert = jax.jit(moe.tiles, static_argnums=1)(jnp.asarray(experts, jnp.int32), x)
  rows, expert = np.asarray(rows), np.asarray(expert)
  held = rows[rows < m]
  assert sorted(held.tolist()) == list(range(m))  # each row once
  for tile in range(rows.shape[0]):
    assert (experts[rows[tile][rows[tile] < m]] == expert[tile]).all()
  assert rows.size <= 2 * m  # slots: at most twice the rows


@pytest.mark.parametrize("routing", ["random", "one_expert", "gpt_oss"])
def test_the_grouped_experts_equal_every_expert_on_every_token(rng, routing):
  """Against the float64 oracle, with some experts taking no token (one_expert: all on one);
  gpt_oss: biases and the clamped unit, its limit low enough that the clamps bite."""
  x = rng.standard_normal((Y, D)).astype(np.float32)
  gate, up, down = _weights(rng)
  weights, experts = np_route(rng.standard_normal((Y, X)), A, True)
  if routing == "one_expert":
    experts = np.stack([np.full(Y, 4), np.full(Y, 1)], -1)
  cfg = CONFIG if routing != "gpt_oss" else dataclasses.replace(
      CONFIG, moe=dataclasses.replace(CONFIG.moe, bias=True, clamped_glu=(1.702, 1.5)))
  biases = ((0, 0, 0) if routing != "gpt_oss" else
            tuple(rng.standard_normal(s).astype(np.float32) for s in ((X, F), (X, F), (X, D))))
  got = jax.jit(moe.experts_mlp, static_argnums=6)(
      x, weights.astype(np.float32), experts.astype(np.int32), gate, up, down,
      moe.gated_unit(cfg), None if routing != "gpt_oss" else biases)
  want = np_experts(x, weights, experts, gate, up, down, biases, cfg.moe.clamped_glu)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def _unrolled(lower: int, upper: int, body, value):
  """`jax.lax.fori_loop` as a Python loop: every iteration in the program."""
  for i in range(lower, upper):
    value = body(i, value)
  return value


def _flops(fn, x_count, a_count, tokens=64):
  shapes = ((tokens, 32), (tokens, a_count), (tokens, a_count), (x_count, 32, 48),
            (x_count, 32, 48), (x_count, 48, 32))
  args = [jax.ShapeDtypeStruct(s, jnp.int32 if i == 2 else jnp.float32)
          for i, s in enumerate(shapes)]
  cost = jax.jit(fn).lower(*args).compile().cost_analysis()
  return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]


def test_compiled_flops_grow_with_the_experts_a_token_takes_not_with_the_experts(monkeypatch):
  """XLA's count of the compiled program, its loop over the tiles unrolled (XLA counts a while
  loop's body once): the grouped experts cost between 1 and 2.5 times the routed rows' matmuls
  (3 of 8·A rows by 32·48) for 4 or 32 experts, and A = 1 to 4; the dense oracle grows with
  X."""
  monkeypatch.setattr(jax.lax, "fori_loop", _unrolled)
  grouped = lambda *a: moe.experts_mlp(*a, swiglu)
  for x_count, a_count in ((4, 2), (32, 2), (16, 1), (16, 4)):
    routed = 3 * 2 * 8 * a_count * 32 * 48
    got = _flops(grouped, x_count, a_count, tokens=8)
    assert routed <= got <= 2.5 * routed, (x_count, a_count, got / routed)
  assert _flops(_dense, 64, 2) > 10 * _flops(_dense, 4, 2)


def _layer(params, x):
  """Router and experts, as `MoEMLP` runs them (top A of X, renormalised)."""
  weights, experts = moe.route(x @ params["router"], A, True)
  return moe.experts_mlp(x, weights, experts, params["gate"], params["up"], params["down"],
                         swiglu)


def check_gradients_equal_finite_differences_and_the_dense_computation(rng):
  """float64: router, experts and inputs against central differences, and the grouped
  computation's gradients against those of every expert on every token (same routing)."""
  with jax.enable_x64(True):
    gate, up, down = _weights(rng, dtype=np.float64)
    params = dict(router=rng.standard_normal((D, X)), gate=gate, up=up, down=down)
    x = rng.standard_normal((Y, D))
    loss = jax.jit(lambda p, x: jnp.sum(jnp.sin(_layer(p, x))))
    check_grads(loss, (params, x), order=1, modes=("rev",), eps=1e-6, atol=1e-6, rtol=1e-6)

    def dense_loss(p, x):
      weights, experts = moe.route(x @ p["router"], A, True)
      return jnp.sum(jnp.sin(_dense(x, weights, experts, p["gate"], p["up"], p["down"])))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10),
                 jax.grad(loss, (0, 1))(params, x), jax.grad(dense_loss, (0, 1))(params, x))


CONFIG = LMConfig(vocab_size=31, d_model=D * 4, num_heads=2, num_kv_heads=1, num_layers=3,
                  d_ff=17, mlp="swiglu", local_window=None,
                  moe=MoE(X, A, F, normalize=False, layers=(0, 2)))


def test_the_linen_layer_trains_its_router_and_experts_and_sows_router_logits(rng):
  """Every parameter of `MoEMLP`, the router's too, gets a nonzero gradient; the router logits
  [B·L, X] are sown (training through the decoder: tests/models/test_moe_integration.py)."""
  x = jnp.asarray(rng.standard_normal((2, 9, CONFIG.d_model)), jnp.float32)
  layer = moe.MoEMLP(CONFIG)

  def run():
    params = layer.init(jax.random.key(0), x)["params"]
    grads = jax.grad(lambda p: jnp.mean(layer.apply({"params": p}, x) ** 2))(params)
    return grads, layer.apply({"params": params}, x, mutable=["intermediates"])[1]
  grads, sown = jax.jit(run)()
  assert jax.tree.map(jnp.shape, grads) == {"router": {"kernel": (CONFIG.d_model, X)},
                                            "gate": (X, CONFIG.d_model, F),
                                            "up": (X, CONFIG.d_model, F),
                                            "down": (X, F, CONFIG.d_model)}
  assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))
  assert sown["intermediates"]["router_logits"][0].shape == (18, X)


def test_the_load_balancing_loss_is_transformers_formula(rng):
  """X · sum_e (rows routed to e / real tokens) · (mean probability of e), padding excluded."""
  logits = rng.standard_normal((Y, X)).astype(np.float32)
  mask = (np.arange(Y) < 9).astype(np.int32)
  _, experts = np_route(logits, A, False)
  probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  routed = np.array([(experts[:9] == e).sum() for e in range(X)]) / 9
  want = X * np.sum(routed * probs[:9].mean(0))
  np.testing.assert_allclose(moe.load_balancing_loss(logits, A, mask), want, rtol=1e-5)


@pytest.mark.parametrize("change, error", [
    (dict(moe=MoE(X, A, F, layers=(3,))), r"LMConfig.moe.layers \[3\] past num_layers=3"),
    (dict(mlp="gelu"), r"LMConfig.moe's experts are gated MLPs: mlp must be 'swiglu'"),
    (dict(moe="mixtral"), r"LMConfig.moe must be a MoE or None, got str"),
])
def test_a_config_the_experts_cannot_take_is_refused_by_name(change, error):
  with pytest.raises((ValueError, TypeError), match=error):
    dataclasses.replace(CONFIG, **change)


def test_moe_checks_its_fields():
  with pytest.raises(ValueError, match=r"MoE.top_k=6 must be at most num_experts=5"):
    MoE(5, 6, F)
  with pytest.raises(ValueError, match=r"MoE.layers must be None or a tuple"):
    MoE(5, 2, F, layers=[0])
  with pytest.raises(ValueError, match=r"MoE.router must be 'softmax' or 'sigmoid_groups', "
                                       r"got 'sigmoid'"):
    MoE(6, 2, F, router="sigmoid")
  with pytest.raises(ValueError, match=r"MoE.groups=\(4, 1\) must split num_experts=6"):
    MoE(6, 2, F, groups=(4, 1))
  with pytest.raises(ValueError, match=r"MoE.top_k=3 is more than the 1 kept groups hold \(2"):
    MoE(6, 3, F, groups=(3, 1))
  with pytest.raises(ValueError, match=r"MoE.groups=\(4, 2\) must split num_experts=6"):
    MoE(6, 2, F, router="sigmoid_groups", groups=(4, 2))
  with pytest.raises(ValueError, match=r"MoE.groups=\(6, 1\) must split num_experts=6 into "
                                       r"groups of 2 or more"):
    MoE(6, 1, F, router="sigmoid_groups", groups=(6, 1))
  with pytest.raises(ValueError, match=r"MoE.top_k=5 is more than the 2 kept groups hold \(4"):
    MoE(6, 5, F, router="sigmoid_groups", groups=(3, 2))
  with pytest.raises(ValueError, match=r"MoE.shared_d_ff must be a positive int"):
    MoE(6, 2, F, shared_d_ff=0)
