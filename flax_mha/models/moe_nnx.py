"""`flax_mha.models.moe.MoEMLP` as an NNX module: the same router and grouped experts, the same
parameter tree (router/kernel [D, X], gate and up [X, D, F], down [X, F, D], and the biases of
`MoE.bias`). Dimension key as
in `flax_mha.models.moe`.
"""

from __future__ import annotations

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
    self.router = nnx.Linear(d, num_experts, use_bias=cfg.moe.bias, dtype=cfg.dtype,
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

  def __call__(self, x_BLD):
    cfg = self.config
    x_YD = x_BLD.reshape(-1, cfg.d_model)
    weights_YA, experts_YA = moe.route(self.router(x_YD), cfg.moe.top_k, cfg.moe.normalize)
    weight = lambda p: precision.cast(p[...], cfg.dtype)
    biases = None
    if cfg.moe.bias:
      biases = (weight(self.gate_bias), weight(self.up_bias), weight(self.down_bias))
    out_YD = moe.experts_mlp(x_YD.astype(cfg.dtype), weights_YA, experts_YA, weight(self.gate),
                             weight(self.up), weight(self.down), moe.gated_unit(cfg), biases)
    return out_YD.reshape(x_BLD.shape)
