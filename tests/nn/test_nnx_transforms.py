"""flax_mha.nn.nnx under NNX's transforms (jit, vmap, grad, split/merge), its partition specs and
its argument checks. The behavioural suite and the parity with flax.nnx are in test_nnx.py,
whose sizes and helpers this file shares.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import flax_mha
from helpers import np_mha, randn, random_mask
from flax_mha.nn import nnx as fnnx
from test_nnx import (B, DOUT, DQ, G, GQA_KW, H, K, L, NNX_JIT_WORKS, T, TOL, V, pure,
                      random_params)


def _module_and_params(**kwargs):
  module = fnnx.MultiHeadAttention(in_features=DQ, rngs=nnx.Rngs(0), **{**GQA_KW, **kwargs})
  params = random_params(module)
  return fnnx.linen_params_to_nnx(params, module), params


@pytest.mark.skipif(not NNX_JIT_WORKS, reason="nnx.jit fails with this flax and jax")
def test_nnx_jit_forward_and_decode(rng):
  module, params = _module_and_params()
  x = randn(rng, B, L, DQ)
  forward = nnx.jit(lambda m, x: m(x, is_causal=True))
  want = np_mha(params, x, x, x, is_causal=True)
  np.testing.assert_allclose(forward(module, x), want, **TOL)
  step = nnx.jit(lambda m, x: m(x, decode=True))
  module.init_cache(x.shape)
  outs = [step(module, x[:, t:t + 1]) for t in range(L)]  # the cache updates through nnx.jit
  np.testing.assert_allclose(np.concatenate(outs, axis=1), want, **TOL)
  assert int(module.cache_index[...]) == L


def test_nnx_vmap_over_inputs(rng):
  module, params = _module_and_params()
  xs = randn(rng, 3, T, DQ)
  out = nnx.vmap(lambda m, x: m(x, is_causal=True), in_axes=(None, 0))(module, xs)
  np.testing.assert_allclose(out, np_mha(params, xs, xs, xs, is_causal=True), **TOL)


def test_nnx_vmap_over_modules(rng):
  @nnx.split_rngs(splits=3)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def create(rngs):
    return fnnx.MultiHeadAttention(in_features=DQ, rngs=rngs, **GQA_KW)

  stacked = create(nnx.Rngs(0))
  x = randn(rng, B, T, DQ)
  outs = nnx.vmap(lambda m, x: m(x), in_axes=(0, None))(stacked, x)
  graphdef, state = nnx.split(stacked)
  kernels = []
  for i in range(3):
    one = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))
    params = fnnx.nnx_to_linen_params(one)["params"]
    np.testing.assert_allclose(outs[i], np_mha(params, x, x, x), **TOL)
    kernels.append(params["query"]["kernel"])
  assert np.abs(kernels[0] - kernels[1]).max() > 1e-3  # split_rngs gave each its own init


def test_nnx_grad_equals_linen_grad(rng):
  module, params = _module_and_params(out_features=DOUT, v_features=H * V)
  linen = flax_mha.MultiHeadAttention(out_features=DOUT, **GQA_KW)
  x, mask, bias = randn(rng, B, T, DQ), random_mask(rng, B, 1, T, T), randn(rng, H, T, T)
  loss = lambda out: jnp.sum(jnp.sin(out))
  got = pure(nnx.grad(lambda m: loss(m(x, mask=mask, bias=bias)))(module))
  want = jax.grad(lambda p: loss(linen.apply({"params": p}, x, mask=mask, bias=bias)))(params)
  chex.assert_trees_all_close(got, want, atol=1e-4, rtol=1e-4)


def check_split_merge_and_jitted_functional_call(rng):
  module, _ = _module_and_params()
  x = randn(rng, B, L, DQ)
  module.init_cache(x.shape)
  module(x[:, :3], decode=True)
  graphdef, params, cache = nnx.split(module, nnx.Param, nnx.Cache)
  assert int(pure(cache)["cache_index"]) == 3

  @jax.jit
  def step(params, cache, x):
    m = nnx.merge(graphdef, params, cache)
    out = m(x, decode=True)
    return out, nnx.state(m, nnx.Cache)

  out, cache = step(params, cache, x[:, 3:5])
  np.testing.assert_allclose(out, module(x[:, 3:5], decode=True), **TOL)
  chex.assert_trees_all_close(pure(cache), pure(nnx.state(module, nnx.Cache)))


def test_dropout_modes_and_stored_stream(rng):
  make = lambda seed, **kw: fnnx.MultiHeadAttention(
      in_features=DQ, dropout_rate=0.5, rngs=nnx.Rngs(params=0, dropout=seed), **GQA_KW, **kw)
  module = make(1)
  x = randn(rng, B, T, DQ)
  with pytest.raises(ValueError, match="dropout_rate=0.5 needs `deterministic`"):
    module(x)
  module.eval()
  det = module(x)
  np.testing.assert_array_equal(module(x, deterministic=True), det)
  module.train()
  first, second = module(x), module(x)  # the stored stream advances
  assert np.abs(first - det).max() > 1e-3 and np.abs(second - first).max() > 1e-3
  np.testing.assert_array_equal(make(1, deterministic=False)(x), first)  # same seed, same drop
  assert np.abs(make(2, deterministic=False)(x) - first).max() > 1e-3
  if hasattr(nnx, "view"):
    np.testing.assert_array_equal(nnx.view(module, deterministic=True)(x), det)


def test_partition_specs_are_the_linen_layout():
  module = fnnx.MultiHeadAttention(H, DQ, H * K, num_kv_heads=G, rngs=nnx.Rngs(0))
  specs = pure(nnx.get_partition_spec(nnx.state(module, nnx.Param)))
  qkv = {"kernel": P("embed", "heads", "head_dim"), "bias": P("heads", "head_dim")}
  assert specs == {"query": qkv, "key": qkv, "value": qkv,
                   "out": {"kernel": P("heads", "head_dim", "embed"), "bias": P("embed")}}
  # The same axes as flax_mha.parallel.sharding gives the linen tree: one layout for both front ends.
  mesh = flax_mha.parallel.sharding.make_mesh()
  placed = flax_mha.parallel.sharding.shardings_for(fnnx.nnx_to_linen_params(module)["params"], mesh,
                                           flax_mha.nn.PARAM_AXES)
  want = jax.tree.map(lambda s: flax_mha.parallel.sharding.spec_for(s, (1,) * len(s), mesh), specs,
                      is_leaf=lambda s: isinstance(s, P))
  assert jax.tree.map(lambda s: s.spec, placed) == want


# ---- bad arguments ----

BAD_CONSTRUCTOR = [
    # (kwargs over num_heads=4, in_features=12, error, match)
    (dict(qkv_features=10), ValueError, "qkv_features=10 must be divisible by num_heads=4"),
    (dict(v_features=6), ValueError, "v_features=6 must be divisible by num_heads=4"),
    (dict(num_kv_heads=3), ValueError, "num_heads=4 must be a multiple of num_kv_heads=3"),
    (dict(num_heads=0), ValueError, "num_heads must be a positive int, got 0"),
    (dict(in_features=0), ValueError, "in_features must be a positive int, got 0"),
    (dict(out_features=2.5), TypeError, "out_features must be a positive int, got float 2.5"),
    (dict(dropout_rate=1.0), ValueError, r"dropout_rate must be a finite number in \[0, 1\), got 1.0"),
    (dict(implementation="flash"), ValueError, "implementation must be .*got 'flash'"),
    (dict(rngs=0), TypeError, "rngs must be an nnx.Rngs, got int"),
    (dict(qkv_features=12, rotary_max_wavelength=1e4, num_heads=4), ValueError,
     r"rotary_max_wavelength needs an even qk head dim K.*K=3"),
    (dict(local_window_size=(-1, 2)), ValueError,
     r"local_window_size must be an int >= 0 or a \(left, right\) pair"),
]


@pytest.mark.parametrize("kwargs,error,match", BAD_CONSTRUCTOR)
def test_bad_constructor_args(kwargs, error, match):
  with pytest.raises(error, match=match):
    fnnx.MultiHeadAttention(**{"num_heads": 4, "in_features": 12, "rngs": nnx.Rngs(0),
                               **kwargs})


def test_self_attention_refuses_other_kv_width(rng):
  with pytest.raises(ValueError, match="in_kv_features=8 .* must equal in_features=12"):
    fnnx.SelfAttention(4, 12, in_kv_features=8, rngs=nnx.Rngs(0))
  module = fnnx.SelfAttention(4, 12, num_kv_heads=2, rngs=nnx.Rngs(0))
  x = randn(rng, B, T, 12)
  np.testing.assert_allclose(module(x, is_causal=True),
                             fnnx.MultiHeadAttention.__call__(module, x, is_causal=True), **TOL)


def test_bad_call_args(rng):
  module = fnnx.MultiHeadAttention(4, 12, dropout_rate=0.1, deterministic=False,
                                   rngs=nnx.Rngs(params=0))  # no dropout stream to keep
  x = randn(rng, B, T, 12)
  with pytest.raises(ValueError, match="dropout_rate=0.1 with deterministic=False needs rngs"):
    module(x)
  chex.assert_shape(module(x, rngs=nnx.Rngs(dropout=1)), (B, T, 12))
  with pytest.raises(TypeError, match="rngs must be an nnx.Rngs.*got int"):
    module(x, rngs=3)
  with pytest.raises(ValueError, match=r"inputs_q must have width 12.*\(2, 5, 13\)"):
    module(randn(rng, B, T, 13), deterministic=True)
  with pytest.raises(ValueError, match="decode=True needs a KV cache: call init_cache"):
    module(x, decode=True, deterministic=True)
  module.init_cache((B, L, 12))
  with pytest.raises(ValueError, match=r"keys must be .* batch \(2,\) .*got \(3, 1, 4, 3\)"):
    module(randn(rng, 3, 1, 12), decode=True, deterministic=True)
  with pytest.raises(ValueError, match=r"input_shape must be \[\.\.\., S_max, D\]"):
    module.init_cache((L,))
