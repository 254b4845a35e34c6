"""`flax_mha.models.moe.MoEMLP` as an NNX module: the same routers, grouped experts and shared
experts, the same parameter tree (router/kernel [D, X], gate and up [X, D, F], down [X, F, D],
the biases of `MoE.bias`, correction_bias and the shared experts'). Dimension key as in
`flax_mha.models.moe`.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from flax_mha import precision
from flax_mha.models import moe
from flax_mha.models.lm_config import LMConfig


class MoEMLP(nnx.Module):
  """x [B, L, D] -> [B, L, D], as the linen `MoEMLP` (which also sows its router logits; this
  one keeps no state beyond its parameters)."""

  def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs):
    d, num_experts, f = cfg.d_model, cfg.moe.num_experts, cfg.moe.d_ff
    self.config = cfg
    self.router = nnx.Linear(d, num_experts, use_bias=cfg.moe.bias, dtype=moe.router_dtype(cfg),
                             param_dtype=cfg.param_dtype, rngs=rngs,
                             **precision.layer_keywords(nnx.Linear))
    param = lambda *shape, init=moe.EXPERT_INIT: nnx.Param(
        init(rngs.params(), shape, cfg.param_dtype))
    self.gate = param(num_experts, d, f)
    self.up = param(num_experts, d, f)
    self.down = param(num_experts, f, d)
    if cfg.moe.bias:  # zeros at init, as the linen layer's
      zeros = nnx.initializers.zeros
      self.gate_bias = param(num_experts, f, init=zeros)
      self.up_bias = param(num_experts, f, init=zeros)
      self.down_bias = param(num_experts, d, init=zeros)
    if cfg.moe.router == "sigmoid_groups":  # float32, as the linen layer's
      self.correction_bias = nnx.Param(jnp.zeros((num_experts,), jnp.float32))
    if cfg.moe.shared_d_ff is not None:
      s, dense_init = cfg.moe.shared_d_ff, nnx.initializers.lecun_normal()
      self.shared_gate = param(d, s, init=dense_init)
      self.shared_up = param(d, s, init=dense_init)
      self.shared_down = param(s, d, init=dense_init)

  def __call__(self, x_BLD):
    cfg = self.config
    x_YD = x_BLD.reshape(-1, cfg.d_model)
    correction = (self.correction_bias[...] if cfg.moe.router == "sigmoid_groups" else None)
    weights_YA, experts_YA = moe.router_weights(cfg.moe, self.router(x_YD), correction)
    weight = lambda p: precision.cast(p[...], cfg.dtype)
    biases = None
    if cfg.moe.bias:
      biases = (weight(self.gate_bias), weight(self.up_bias), weight(self.down_bias))
    x_YD = x_YD.astype(cfg.dtype)
    out_YD = moe.experts_mlp(x_YD, weights_YA, experts_YA, weight(self.gate),
                             weight(self.up), weight(self.down), moe.gated_unit(cfg), biases)
    if cfg.moe.shared_d_ff is not None:
      out_YD = out_YD + moe.shared_mlp(x_YD, weight(self.shared_gate), weight(self.shared_up),
                                       weight(self.shared_down),
                                       moe.gated_unit(cfg)).astype(out_YD.dtype)
    return out_YD.reshape(x_BLD.shape)
