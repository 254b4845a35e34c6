"""A sparse mixture of experts in place of the decoder's dense MLP (Mixtral, Qwen3-MoE,
gpt-oss, DeepSeek V3's router and shared experts): the routers, the experts as one grouped
matmul, and the linen layer (`MoEMLP`; NNX's: `flax_mha.models.moe_nnx`).

Each token's router logits pick its top-A experts out of X (`route`, as transformers' routers
compute it: a float32 softmax over the X logits, the top A probabilities, renormalised to sum
to 1 when `MoE.normalize`; gpt-oss's softmax over the top A logits gives those weights up to
rounding); the token's output is the sum of those experts' gated MLPs weighted by
the probabilities. No expert runs on a token that did not pick it: the M = Y·A (token, expert)
rows are grouped by expert into tiles of one expert each (`tiles`), and a loop takes each
tile's rows through its expert's weights (`experts_mlp`): M to 2·M rows' worth of matmuls,
never Y·X (`jax.lax.ragged_dot`, the grouped matmul's API, computes every group densely on CPU
in jax 0.10; tests/models/test_moe.py reads the compiled FLOPs). The forward adds no auxiliary loss:
the linen layer sows its router logits ('intermediates', 'router_logits', with
`mutable=['intermediates']`) for `load_balancing_loss` when a training wants one.

Dimension key (flax_mha/__init__.py): Y tokens (B·L, flattened), D d_model, X experts, A the
experts each token takes (top-k), M = Y·A routed rows, F an expert's MLP width.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from flax_mha import precision
from flax_mha.models.lm_config import LMConfig

# Logical axes of the layer's parameters (`flax_mha.parallel.sharding`): the experts split over
# the model axis, X/n a device (expert parallelism), or where it does not divide X, each expert
# split as the dense MLP is (gate and up column-, down row-parallel); the router replicated.
PARAM_AXES = (
    (r"moe/router/kernel$", ("embed", None)),
    (r"moe/router/bias$", (None,)),
    (r"moe/(gate|up)$", ("expert", "embed", "mlp")),
    (r"moe/(gate|up)_bias$", ("expert", "mlp")),
    (r"moe/down$", ("expert", "mlp", "embed")),
    (r"moe/down_bias$", ("expert", "embed")),
    (r"moe/correction_bias$", (None,)),
    (r"moe/shared_(gate|up)$", ("embed", "mlp")),
    (r"moe/shared_down$", ("mlp", "embed")),
)


def route(logits_YX, top_k: int, normalize: bool, groups: tuple[int, int] = (1, 1),
          scale: float = 1.0):
  """(weights [Y, A] float32, experts [Y, A] int32) of router logits [Y, X]: softmax over X in
  float32 (float64 logits: float64), the top_k largest probabilities (ties: the lower expert
  first) and their experts, the weights renormalised to sum to 1 when `normalize`
  (transformers' routers), times `scale`. With groups (g, kept) other than (1, 1), DeepSeek
  V2's "group_limited_greedy": the X experts in g groups of equal size, each scored by its best
  probability, the experts outside the best `kept` groups at probability 0 before the top_k."""
  probs_YX = jax.nn.softmax(logits_YX.astype(_wide(logits_YX.dtype)), axis=-1)
  if groups != (1, 1):
    probs_YX = jnp.where(_kept_groups(probs_YX, groups, lambda g: g.max(-1)), probs_YX, 0.0)
  weights_YA, experts_YA = jax.lax.top_k(probs_YX, top_k)
  if normalize:
    weights_YA = weights_YA / weights_YA.sum(-1, keepdims=True)
  return weights_YA * scale, experts_YA.astype(jnp.int32)


def _kept_groups(choice_YX, groups: tuple[int, int], score):
  """[Y, X] bool: the experts of each row's best groups[1] of groups[0] equal groups, each
  group scored by `score` of its choices [Y, groups, X / groups]."""
  y, x = choice_YX.shape
  count, kept = groups
  _, keep = jax.lax.top_k(score(choice_YX.reshape(y, count, x // count)), kept)  # [Y, kept]
  keep_Y_groups = jnp.zeros((y, count), bool).at[jnp.arange(y)[:, None], keep].set(True)
  return jnp.repeat(keep_Y_groups, x // count, axis=1)


def route_sigmoid_groups(logits_YX, correction_X, top_k: int, groups: tuple[int, int],
                         normalize: bool, scale: float):
  """DeepSeek V3's router (GLM-4.5's too): (weights [Y, A] float32, experts [Y, A] int32).

  Scores s = sigmoid(logits) in float32. The choice ranks s + correction_X (the balance term
  trained without an auxiliary loss: it moves the choice, never a weight): the X experts in
  groups[0] groups of equal size, each group scored by the sum of its two best, the best
  groups[1] groups kept, then the top_k experts of those. Their weights are the plain scores,
  renormalised (over a sum plus 1e-20) when `normalize`, times `scale` (routed_scaling_factor),
  as transformers' DeepseekV3TopkRouter computes them (the experts' order differs: theirs is
  unsorted; the output sums over them alike)."""
  wide = _wide(logits_YX.dtype)
  scores_YX = jax.nn.sigmoid(logits_YX.astype(wide))
  choice_YX = scores_YX + correction_X.astype(wide)
  kept_YX = _kept_groups(choice_YX, groups, lambda g: jax.lax.top_k(g, 2)[0].sum(-1))
  choice_YX = jnp.where(kept_YX, choice_YX, -jnp.inf)
  _, experts_YA = jax.lax.top_k(choice_YX, top_k)
  weights_YA = jnp.take_along_axis(scores_YX, experts_YA, axis=-1)
  if normalize:
    weights_YA = weights_YA / (weights_YA.sum(-1, keepdims=True) + 1e-20)
  return weights_YA * scale, experts_YA.astype(jnp.int32)


def router_dtype(cfg: LMConfig):
  """The router's computation dtype: float32 with `MoE.float32_router` (transformers computes
  DeepSeek's and GLM-4.5's logits so, whatever the model's dtype), else the model's."""
  return jnp.promote_types(cfg.dtype, jnp.float32) if cfg.moe.float32_router else cfg.dtype


def router_weights(moe, logits_YX, correction_X=None):
  """(weights [Y, A], experts [Y, A]) of `moe`'s router (`MoE.router`): "softmax" (`route`)
  or "sigmoid_groups" (`route_sigmoid_groups`, with its correction [X])."""
  if moe.router == "softmax":
    return route(logits_YX, moe.top_k, moe.normalize, moe.groups, moe.routed_scale)
  return route_sigmoid_groups(logits_YX, correction_X, moe.top_k, moe.groups, moe.normalize,
                              moe.routed_scale)


def shared_mlp(x_YD, gate_DS, up_DS, down_SD, glu):
  """The shared experts [Y, D]: every token through one gated MLP of width S (DeepSeek's
  n_shared_experts of width F each, side by side)."""
  return precision.einsum("ys,sd->yd", glu(precision.einsum("yd,ds->ys", x_YD, gate_DS),
                                           precision.einsum("yd,ds->ys", x_YD, up_DS)), down_SD)


def tiles(experts_M, num_experts: int):
  """The routed rows, of experts [M], grouped by expert into tiles of one expert each: (rows
  [tiles, block], the routed row each slot holds, M where a slot is empty; expert [tiles],
  each tile's expert).

  block = max(1, M // X) rows a tile, and tiles = (M + min(X, M)·(block - 1)) // block, the
  most that groups of any sizes fill: each expert's rows fill whole tiles but its last, so at
  most M + min(X, M)·block <= 2·M slots in all, whatever the routing. All sizes are static.
  """
  m = experts_M.shape[0]
  block, count = max(1, m // num_experts), tile_count(m, num_experts)
  order_M = jnp.argsort(experts_M, stable=True)  # the rows, grouped by expert
  sizes_X = jnp.bincount(experts_M, length=num_experts)
  starts_X = jnp.cumsum(sizes_X) - sizes_X  # each expert's first place in `order_M`
  tile_counts_X = (sizes_X + block - 1) // block
  tile_ends_X = jnp.cumsum(tile_counts_X)
  tile = jnp.arange(count)
  expert = jnp.minimum(jnp.searchsorted(tile_ends_X, tile, side="right"), num_experts - 1)
  within = (tile - (tile_ends_X[expert] - tile_counts_X[expert]))[:, None] * block + jnp.arange(
      block)[None]  # [tiles, block]: a slot's place within its expert's rows
  used = (within < sizes_X[expert][:, None]) & (tile < tile_ends_X[-1])[:, None]
  place = jnp.minimum(starts_X[expert][:, None] + within, m - 1)
  return jnp.where(used, order_M[place], m), expert


def experts_mlp(x_YD, weights_YA, experts_YA, gate_XDF, up_XDF, down_XFD, glu, biases=None):
  """The experts' outputs [Y, D], x's dtype: sum over each token's A experts e of weight ·
  glu(x·gate[e], x·up[e])·down[e] (each product plus expert e's bias of `biases`, (gate [X, F],
  up [X, F], down [X, D]), when given), every tile of rows through its own expert's weights
  (`tiles`), the weights' sum in float32 (float64 for float64 x). `glu` (`gated_unit`) takes
  the gate's and the up projection's [..., F].

  The tiles run in a loop, each reading its expert's weights in place (a dynamic slice): a
  gather of every tile's weights at once would copy them first, [tiles, D, F] three times
  (3-6x slower on the CPU at D = 2048, F = 768, 32 experts, top 8, for 1 to 128 tokens)."""
  y, a = experts_YA.shape
  rows, expert = tiles(experts_YA.reshape(-1), gate_XDF.shape[0])
  token = rows // a  # [tiles, block]: y in empty slots, which read token y - 1 and add nowhere
  weight = weights_YA.reshape(-1)[jnp.minimum(rows, y * a - 1)][..., None]  # [tiles, block, 1]
  wide = _wide(x_YD.dtype)

  def tile(t, out_YD):
    e = expert[t]
    pick = lambda w_X: jax.lax.dynamic_index_in_dim(w_X, e, keepdims=False)
    bias = (lambda i, h: h) if biases is None else (
        lambda i, h: h + pick(biases[i]).astype(h.dtype))
    x = x_YD[jnp.minimum(token[t], y - 1)]  # [block, D]
    h = glu(bias(0, precision.einsum("bd,df->bf", x, pick(gate_XDF))),
            bias(1, precision.einsum("bd,df->bf", x, pick(up_XDF))))
    out = bias(2, precision.einsum("bf,fd->bd", h, pick(down_XFD))).astype(wide) * weight[t]
    return out_YD.at[token[t]].add(out, mode="drop")

  out = jax.lax.fori_loop(0, expert.shape[0], tile, jnp.zeros((y, x_YD.shape[-1]), wide))
  return out.astype(x_YD.dtype)


def tile_count(rows: int, num_experts: int) -> int:
  """How many tiles `tiles` makes of `rows` routed rows (static): the loop's trip count."""
  block = max(1, rows // num_experts)
  return (rows + min(num_experts, rows) * (block - 1)) // block


def _wide(dtype):
  """float32, or float64 for float64: the routing's and the weighted sum's precision."""
  return jnp.promote_types(dtype, jnp.float32)


def load_balancing_loss(logits_YX, top_k: int, mask_Y=None):
  """transformers' auxiliary loss (`load_balancing_loss_func`) of router logits [Y, X] (the
  layers' concatenated), padding excluded where `mask_Y` is 0: X · sum over experts of the
  share of rows routed to it (top_k per token) times its mean probability."""
  probs_YX = jax.nn.softmax(logits_YX.astype(_wide(logits_YX.dtype)), axis=-1)
  _, experts_YA = jax.lax.top_k(probs_YX, top_k)
  num_experts = logits_YX.shape[-1]
  mask_Y = jnp.ones(logits_YX.shape[:1], jnp.float32) if mask_Y is None else mask_Y.astype(
      jnp.float32)
  routed_X = (jax.nn.one_hot(experts_YA, num_experts) * mask_Y[:, None, None]).sum((0, 1))
  prob_X = (probs_YX * mask_Y[:, None]).sum(0)
  rows = mask_Y.sum()
  return num_experts * jnp.sum((routed_X / rows) * (prob_X / rows))


# The experts' initialiser: lecun normal over each expert's fan-in.
EXPERT_INIT = jax.nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))


def gated_unit(cfg: LMConfig):
  """The experts' glu(gate, up): `MoE.clamped_glu`'s (alpha, limit) when set (gpt-oss:
  g·sigmoid(alpha·g)·(u + 1), g = min(gate, limit), u = up clipped to ±limit), else
  `LMConfig.mlp`'s act(gate)·up, silu (SwiGLU) or gelu's tanh form (GeGLU, as the dense MLP's;
  LMConfig checks that the MLP is gated)."""
  if cfg.moe.clamped_glu is not None:
    alpha, limit = cfg.moe.clamped_glu

    def clamped(gate, up):
      gate = jnp.minimum(gate, limit)
      return gate * jax.nn.sigmoid(alpha * gate) * (jnp.clip(up, -limit, limit) + 1)
    return clamped
  act = jax.nn.silu if cfg.mlp == "swiglu" else jax.nn.gelu
  return lambda gate, up: act(gate) * up


class MoEMLP(nn.Module):
  """x [B, L, D] -> [B, L, D]: `config.moe`'s experts (`flax_mha.models.lm_config.MoE`) with
  their `gated_unit`. Params: router/kernel [D, X], gate and up [X, D, F], down [X, F, D]; with
  `MoE.bias`, router/bias [X], gate_bias and up_bias [X, F], down_bias [X, D] (zeros at init);
  with the "sigmoid_groups" router, correction_bias [X] float32 (zeros); with shared experts,
  shared_gate and shared_up [D, S], shared_down [S, D]. Sows the router logits [B·L, X] in
  'intermediates'."""
  config: LMConfig

  @nn.compact
  def __call__(self, x_BLD):
    cfg, moe = self.config, self.config.moe
    d, num_experts, f = cfg.d_model, moe.num_experts, moe.d_ff
    x_YD = x_BLD.reshape(-1, d)
    logits_YX = nn.Dense(num_experts, use_bias=moe.bias, dtype=router_dtype(cfg),
                         param_dtype=cfg.param_dtype, name="router",
                         **precision.layer_keywords(nn.Dense))(x_YD)
    self.sow("intermediates", "router_logits", logits_YX)
    param = lambda name, *shape, init=EXPERT_INIT: precision.cast(self.param(
        name, init, shape, cfg.param_dtype), cfg.dtype)
    biases = None
    if moe.bias:
      zeros = jax.nn.initializers.zeros
      biases = (param("gate_bias", num_experts, f, init=zeros),
                param("up_bias", num_experts, f, init=zeros),
                param("down_bias", num_experts, d, init=zeros))
    correction = None
    if moe.router == "sigmoid_groups":  # float32, as transformers keeps it
      correction = self.param("correction_bias", jax.nn.initializers.zeros, (num_experts,),
                              jnp.float32)
    weights_YA, experts_YA = router_weights(moe, logits_YX, correction)
    x_YD = x_YD.astype(cfg.dtype)
    out_YD = experts_mlp(x_YD, weights_YA, experts_YA,
                         param("gate", num_experts, d, f), param("up", num_experts, d, f),
                         param("down", num_experts, f, d), gated_unit(cfg), biases)
    if moe.shared_d_ff is not None:
      s = moe.shared_d_ff
      dense_init = jax.nn.initializers.lecun_normal()
      out_YD = out_YD + shared_mlp(
          x_YD, param("shared_gate", d, s, init=dense_init),
          param("shared_up", d, s, init=dense_init), param("shared_down", s, d, init=dense_init),
          gated_unit(cfg)).astype(out_YD.dtype)
    return out_YD.reshape(x_BLD.shape)
