"""`flax_mha.models.mla.LatentAttention` as an NNX module: the same attention (expanded without
a cache, absorbed over one), the same parameter tree. Dimension key as in
`flax_mha.models.mla`.
"""

from __future__ import annotations

import functools

from flax import nnx

from flax_mha import precision
from flax_mha.models import mla
from flax_mha.models.lm_config import LMConfig
from flax_mha.nn.nnx import make_norm


class LatentAttention(nnx.Module):
  """x [B, L, D] -> [B, L, D] (and the updated cache with `cache=`), as the linen layer."""

  def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs, implementation=None):
    m, d, h = cfg.mla, cfg.d_model, cfg.num_heads
    self.config, self.implementation = cfg, implementation
    linear = functools.partial(nnx.LinearGeneral, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                               **precision.layer_keywords(nnx.LinearGeneral), rngs=rngs)
    norm = functools.partial(make_norm, mla.LATENT_NORM, dtype=cfg.dtype,
                             param_dtype=cfg.param_dtype, rngs=rngs)
    if m.q_rank is None:
      self.query = linear(d, (h, m.qk_dim), use_bias=False)
    else:
      self.query_down = linear(d, m.q_rank, use_bias=cfg.qkv_bias)
      self.query_norm = norm(m.q_rank)
      self.query_up = linear(m.q_rank, (h, m.qk_dim), use_bias=False)
    self.kv_down = linear(d, m.kv_rank + m.rope_dim, use_bias=cfg.qkv_bias)
    self.kv_norm = norm(m.kv_rank)
    init = nnx.initializers.lecun_normal(in_axis=0, out_axis=(1, 2))
    self.key_up = nnx.Param(init(rngs.params(), (m.kv_rank, h, m.nope_dim), cfg.param_dtype))
    self.value_up = nnx.Param(init(rngs.params(), (m.kv_rank, h, m.v_dim), cfg.param_dtype))
    self.out = linear((h, m.v_dim), d, axis=(-2, -1), use_bias=cfg.out_bias)

  def __call__(self, x_BTD, *, segment_ids=None, positions=None, is_causal: bool = True,
               cache=None):
    cfg, m = self.config, self.config.mla
    mla.check_call(cfg, x_BTD, cache, is_causal)
    if m.q_rank is None:
      query = self.query(x_BTD)
    else:
      query = self.query_up(self.query_norm(self.query_down(x_BTD)))
    kv = self.kv_down(x_BTD)
    weight = lambda p: precision.cast(p[...], cfg.dtype)
    out, cache = mla.attend(cfg, query, self.kv_norm(kv[..., :m.kv_rank]), kv[..., m.kv_rank:],
                            weight(self.key_up), weight(self.value_up),
                            segment_ids=segment_ids, positions=positions, cache=cache,
                            implementation=self.implementation)
    out = self.out(out)
    return out if cache is None else (out, cache)
