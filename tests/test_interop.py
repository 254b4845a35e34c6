"""PyTorch parity: flax_mha.interop against torch.nn.MultiheadAttention, and the pure function
against torch.nn.functional.scaled_dot_product_attention (GQA, causal, masks, K != V)."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import flax_mha
from flax_mha import interop
from helpers import DIMS, qkv, randn, random_mask

B, T, S = DIMS["B"], DIMS["T"], DIMS["S"]
D, NUM_HEADS = 3 * 7, 3  # the model width (torch embed_dim) and num_heads: head dim 7
TOL = dict(atol=1e-5, rtol=1e-5)


def _torch_mha(seed=0, **kwargs):
  torch.manual_seed(seed)
  module = torch.nn.MultiheadAttention(D, NUM_HEADS, batch_first=True, **kwargs).eval()
  with torch.no_grad():  # torch zero-initialises biases: make them matter
    for name, p in module.named_parameters():
      if "bias" in name:
        p.normal_()
  return module


def _t(x):
  return torch.from_numpy(np.asarray(x))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kdim,vdim", [(None, None), (11, 13)])
def test_matches_torch_multihead_attention(rng, variant, kdim, vdim, bias):
  """Packed in_proj_weight (kdim = vdim = D) and separate q/k/v_proj_weight (kdim, vdim != D),
  with and without biases (torch's bias=False is our use_bias=False)."""
  module = _torch_mha(kdim=kdim, vdim=vdim, bias=bias)
  xq, xk, xv = randn(rng, B, T, D), randn(rng, B, S, kdim or D), randn(rng, B, S, vdim or D)
  with torch.no_grad():
    want, _ = module(_t(xq), _t(xk), _t(xv), need_weights=False)
  params = interop.from_torch_multihead_attention(module.state_dict(), NUM_HEADS)
  model = flax_mha.MultiHeadAttention(num_heads=NUM_HEADS, use_bias=bias)
  out = variant(model.apply)(params, xq, xk, xv)
  chex.assert_shape(out, (B, T, D))
  np.testing.assert_allclose(out, want.numpy(), **TOL)
  # The converted tree has exactly the structure and shapes the module would initialise.
  init = jax.eval_shape(model.init, jax.random.key(0), xq, xk, xv)
  assert jax.tree.structure(params) == jax.tree.structure(init)
  chex.assert_trees_all_equal_shapes(params, init)


def test_matches_torch_with_masks(rng):
  """torch's boolean masks mean True = *ignore*; flax_mha's mean True = attend."""
  module = _torch_mha(seed=1)
  xq, xk = randn(rng, B, T, D), randn(rng, B, S, D)
  key_padding = np.zeros((B, S), bool)
  key_padding[1, 4:] = True  # batch 1 has 4 valid keys
  attn_ignore = np.triu(np.ones((T, S), bool), k=1)  # causal
  with torch.no_grad():
    want, _ = module(_t(xq), _t(xk), _t(xk), key_padding_mask=_t(key_padding),
                     attn_mask=_t(attn_ignore), need_weights=False)
  params = interop.from_torch_multihead_attention(module.state_dict(), NUM_HEADS)
  mask = flax_mha.combine_masks(~key_padding[:, None, None, :], ~attn_ignore)
  out = jax.jit(flax_mha.MultiHeadAttention(num_heads=NUM_HEADS).apply)(params, xq, xk, mask=mask)
  np.testing.assert_allclose(out, want.numpy(), **TOL)


def test_state_dict_of_numpy_arrays(rng):
  module = _torch_mha(seed=2)
  sd_np = {k: v.numpy() for k, v in module.state_dict().items()}
  a = interop.from_torch_multihead_attention(module.state_dict(), NUM_HEADS)
  b = interop.from_torch_multihead_attention(sd_np, NUM_HEADS)
  chex.assert_trees_all_equal(a, b)


def test_bad_state_dicts():
  half_bias = {k: v for k, v in _torch_mha().state_dict().items() if k != "out_proj.bias"}
  with pytest.raises(ValueError, match="both 'in_proj_bias' and 'out_proj.bias'.*or neither"):
    interop.from_torch_multihead_attention(half_bias, NUM_HEADS)
  with pytest.raises(ValueError, match=r"num_heads.*embed_dim=21.*4"):
    interop.from_torch_multihead_attention(_torch_mha().state_dict(), 4)
  with pytest.raises(ValueError, match="add_bias_kv"):
    interop.from_torch_multihead_attention(_torch_mha(add_bias_kv=True).state_dict(), NUM_HEADS)
  with pytest.raises(ValueError, match="out_proj.weight"):
    interop.from_torch_multihead_attention({}, NUM_HEADS)


def _torch_sdpa(q, k, v, mask=None, *, is_causal=False, scale=None):
  """torch SDPA on [..., T, H, K] inputs: it takes [..., H, T, K] and repeats K/V heads itself."""
  to = lambda x: _t(np.swapaxes(x, -2, -3))
  out = F.scaled_dot_product_attention(
      to(q), to(k), to(v), attn_mask=None if mask is None else _t(mask), is_causal=is_causal,
      scale=scale, enable_gqa=q.shape[-2] != k.shape[-2])
  return np.swapaxes(out.numpy(), -2, -3)


@pytest.mark.parametrize("g", [6, 3, 2, 1])
@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_torch_sdpa(rng, g, is_causal):
  q, k, v = qkv(rng, g=g)  # H=6, K=11 != V=13, T=5 != S=7: torch's causal is top-left too
  out = jax.jit(functools.partial(flax_mha.dot_product_attention, is_causal=is_causal))(q, k, v)
  np.testing.assert_allclose(out, _torch_sdpa(q, k, v, is_causal=is_causal), **TOL)


def test_matches_torch_sdpa_masked_scaled_unbatched(rng):
  q, k, v = qkv(rng, batch=(), g=2)
  mask = random_mask(rng, 6, T, S)
  mask[..., 0] = True  # torch gives NaN for fully masked rows
  out = flax_mha.dot_product_attention(q, k, v, mask=mask, scale=0.29)
  chex.assert_shape(out, (T, 6, DIMS["V"]))
  np.testing.assert_allclose(out, _torch_sdpa(q, k, v, mask, scale=0.29), **TOL)


def test_bf16_matches_torch_sdpa_in_float32(rng):
  q, k, v = (np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32) for x in qkv(rng, g=3))
  out = flax_mha.dot_product_attention(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)),
                                       is_causal=True)
  np.testing.assert_allclose(np.asarray(out, np.float32), _torch_sdpa(q, k, v, is_causal=True),
                             atol=3e-2, rtol=3e-2)
