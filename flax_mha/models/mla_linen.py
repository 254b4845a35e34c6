"""`flax_mha.models.mla`'s latent attention as a linen layer (the decoder's, `flax_mha.models.lm`,
with `LMConfig.mla`; NNX's twin: `flax_mha.models.mla_nnx`). Dimension key as in
`flax_mha.models.mla`.
"""

from __future__ import annotations

import functools

import flax.linen as nn

from flax_mha import precision
from flax_mha.models import mla
from flax_mha.models.lm_config import LMConfig
from flax_mha.nn.linen import make_norm


class LatentAttention(nn.Module):
  """x [B, L, D] -> [B, L, D] (and the updated cache with `cache=`): `config.mla`'s latent
  attention (`flax_mha.models.mla.attend`: expanded without a cache, absorbed over one).

  Params, with DeepSeek's checkpoint names: query/kernel [D, H, N + P] (q_proj), or query_down
  (kernel [D, Q], bias with qkv_bias; q_a_proj), query_norm/scale [Q] (q_a_layernorm) and
  query_up/kernel [Q, H, N + P] (q_b_proj); kv_down (kernel [D, R + P], bias with qkv_bias;
  kv_a_proj_with_mqa), kv_norm/scale [R] (kv_a_layernorm), key_up [R, H, N] and value_up
  [R, H, V] (kv_b_proj, split); out (kernel [H, V, D], bias with out_bias; o_proj)."""
  config: LMConfig
  implementation: object = None

  @nn.compact
  def __call__(self, x_BTD, *, segment_ids=None, positions=None, is_causal: bool = True,
               cache=None):
    cfg, m = self.config, self.config.mla
    mla.check_call(cfg, x_BTD, cache, is_causal)
    dense = functools.partial(nn.DenseGeneral, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                              **precision.layer_keywords(nn.DenseGeneral))
    norm = functools.partial(make_norm, mla.LATENT_NORM, dtype=cfg.dtype,
                             param_dtype=cfg.param_dtype)
    heads = (cfg.num_heads, m.qk_dim)
    if m.q_rank is None:
      query = dense(heads, use_bias=False, name="query")(x_BTD)
    else:
      low = norm(name="query_norm")(dense(m.q_rank, use_bias=cfg.qkv_bias,
                                          name="query_down")(x_BTD))
      query = dense(heads, use_bias=False, name="query_up")(low)
    kv = dense(m.kv_rank + m.rope_dim, use_bias=cfg.qkv_bias, name="kv_down")(x_BTD)
    latent = norm(name="kv_norm")(kv[..., :m.kv_rank])
    up = lambda name, width: precision.cast(self.param(
        name, nn.initializers.lecun_normal(in_axis=0, out_axis=(1, 2)),
        (m.kv_rank, cfg.num_heads, width), cfg.param_dtype), cfg.dtype)
    out, cache = mla.attend(cfg, query, latent, kv[..., m.kv_rank:], up("key_up", m.nope_dim),
                            up("value_up", m.v_dim), segment_ids=segment_ids,
                            positions=positions, cache=cache,
                            implementation=self.implementation)
    out = dense(cfg.d_model, axis=(-2, -1), use_bias=cfg.out_bias, name="out")(out)
    return out if cache is None else (out, cache)
