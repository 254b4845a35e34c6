"""flax_mha.attention: dot_product_attention and its weights against independent references.

References: a float64 NumPy attention (helpers.np_attention), jax.nn.dot_product_attention
(K == V only) and jax.test_util.check_grads.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import flax_mha
from helpers import DIMS, np_attention, qkv, randn, random_mask

B, T, S, H, K, V = (DIMS[d] for d in "BTSHKV")
TOL = dict(atol=2e-5, rtol=2e-5)


class DotProductAttentionTest(chex.TestCase):
  """Each case runs under jit and without it."""

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(  # (g, is_causal, with_bias, with_mask)
      (6, False, False, False), (6, True, True, True), (3, False, True, True),
      (3, True, False, True), (2, True, True, False), (1, False, False, True),
      (1, True, True, True))
  def test_matches_numpy(self, g, is_causal, with_bias, with_mask):
    rng = np.random.default_rng(g)
    q, k, v = qkv(rng, g=g)
    bias = randn(rng, B, 1, T, S) if with_bias else None  # broadcast over heads
    mask = random_mask(rng, 1, H, T, S) if with_mask else None  # broadcast over batch
    fn = self.variant(functools.partial(flax_mha.dot_product_attention, is_causal=is_causal))
    out = fn(q, k, v, bias, mask)
    dims = chex.Dimensions(B=B, T=T, H=H, V=V)
    chex.assert_shape(out, dims["BTHV"])
    chex.assert_type(out, jnp.float32)
    want = np_attention(q, k, v, bias, mask, is_causal=is_causal)
    np.testing.assert_allclose(out, want, **TOL)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(3, 1)
  def test_weights_match_numpy(self, g):
    rng = np.random.default_rng(1)
    q, k, _ = qkv(rng, g=g)
    mask = random_mask(rng, B, 1, 1, S)
    fn = self.variant(functools.partial(flax_mha.dot_product_attention_weights, is_causal=True))
    weights = fn(q, k, mask=mask)
    chex.assert_shape(weights, chex.Dimensions(B=B, H=H, T=T, S=S)["BHTS"])
    _, want = np_attention(q, k, mask=mask, is_causal=True, return_weights=True)
    np.testing.assert_allclose(weights, want, **TOL)

  @chex.variants(with_jit=True, without_jit=True)
  def test_scale(self):
    rng = np.random.default_rng(2)
    q, k, v = qkv(rng)
    out = self.variant(functools.partial(flax_mha.dot_product_attention, scale=0.37))(q, k, v)
    np.testing.assert_allclose(out, np_attention(q, k, v, scale=0.37), **TOL)


@pytest.mark.parametrize("batch", [(), (3,), (2, 3)])
def test_leading_batch_dims(rng, variant, batch):
  q, k, v = qkv(rng, batch=batch)
  mask = random_mask(rng, *batch, H, T, S)
  out = variant(flax_mha.dot_product_attention)(q, k, v, mask=mask)
  chex.assert_shape(out, (*batch, T, H, V))
  np.testing.assert_allclose(out, np_attention(q, k, v, mask=mask), **TOL)


def test_vmap_of_unbatched_equals_batched(rng):
  q, k, v = qkv(rng)
  bias, mask = randn(rng, B, H, T, S), random_mask(rng, B, 1, T, S)
  fn = functools.partial(flax_mha.dot_product_attention, is_causal=True)
  batched = jax.jit(fn)(q, k, v, bias, mask)
  vmapped = jax.jit(jax.vmap(fn))(q, k, v, bias, mask)
  chex.assert_shape(vmapped, (B, T, H, V))
  np.testing.assert_allclose(vmapped, batched, **TOL)
  # Nested vmap over two batch dims equals the rank-5 call.
  q2, k2, v2 = qkv(rng, batch=(2, 3))
  nested = jax.jit(jax.vmap(jax.vmap(flax_mha.dot_product_attention)))(q2, k2, v2)
  np.testing.assert_allclose(nested, np_attention(q2, k2, v2), **TOL)


@pytest.mark.parametrize("g", [6, 3, 1])
@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_jax_nn(rng, g, is_causal):
  q, k, v = qkv(rng, g=g, v=K)  # jax.nn needs V == K
  bias, mask = randn(rng, B, H, T, S), random_mask(rng, B, 1, T, S, p=0.8)
  mask[..., 0] = True  # jax.nn does not zero fully masked rows: keep every row visible
  fn = jax.jit(functools.partial(flax_mha.dot_product_attention, is_causal=is_causal))
  out = fn(q, k, v, bias, mask)
  want = jax.jit(jax.nn.dot_product_attention, static_argnames="is_causal")(
      q, k, v, bias, mask, is_causal=is_causal)
  chex.assert_shape(out, (B, T, H, K))
  np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n", [8, 640])  # None picks "xla" at 8 x 8, "rows" at 640 x 640
def test_default_implementation_equals_numpy_at_both_regimes(n):
  rng = np.random.default_rng(n)
  q, k, v = qkv(rng, t=n, s=n, h=2, g=1, k=4, v=3)
  bias, mask = randn(rng, B, 1, n, n), random_mask(rng, B, 2, n, n, p=0.9)
  picked = flax_mha.attention.default_implementation(
      q, k, v, bias, mask, is_causal=True, dropout_rate=0.0)
  assert picked == ("xla" if n == 8 else "rows")
  out = jax.jit(functools.partial(flax_mha.dot_product_attention, is_causal=True))(
      q, k, v, bias, mask)
  np.testing.assert_allclose(out, np_attention(q, k, v, bias, mask, is_causal=True), **TOL)


@pytest.mark.parametrize("n, k, is_causal, dropout_rate, picked", [
    (256, 64, False, 0.0, "xla"), (512, 64, False, 0.0, "rows"),
    (128, 64, True, 0.0, "xla"), (256, 64, True, 0.0, "rows"),
    (8192, 64, True, 0.0, "rows"), (16384, 64, False, 0.0, "chunked"),
    (16384, 64, True, 0.0, "chunked"),
    (512, 64, False, 0.1, "xla"), (1024, 64, False, 0.1, "chunked"),
    (256, 64, True, 0.1, "xla"), (512, 64, True, 0.1, "chunked"), (512, 128, True, 0.1, "xla"),
])
def test_default_implementation_on_cpu(n, k, is_causal, dropout_rate, picked):
  """Without dropout or mods (mask and bias or not): xla, then rows, then chunked past
  ROWS_MAX_KEYS; with dropout (which rows refuses): xla for small logits, chunked beyond."""
  if jax.default_backend() != "cpu":
    pytest.skip("the CPU rule")
  x = jax.ShapeDtypeStruct((1, n, 2, k), jnp.float32)
  mask = jax.ShapeDtypeStruct((1, 1, n, n), jnp.bool_)
  for m in (None, mask):
    got = flax_mha.attention.default_implementation(x, x, x, None, m, is_causal=is_causal,
                                                    dropout_rate=dropout_rate)
    assert got == picked


def test_causal_receptive_field(rng):
  """d out[i] / d (query, key, value)[j] is exactly 0 for every j > i (query: every j != i)."""
  t = 7
  q, k, v = qkv(rng, batch=(), t=t, s=t)
  fn = functools.partial(flax_mha.dot_product_attention, is_causal=True)
  jacs = jax.jit(jax.jacrev(fn, argnums=(0, 1, 2)))(q, k, v)  # each [T, H, V, T_in, ., .]
  size_q, size_k, size_v = (np.abs(np.asarray(j)).sum(axis=(1, 2, 4, 5)) for j in jacs)
  later = np.triu(np.ones((t, t), bool), k=1)
  np.testing.assert_array_equal(size_k[later], 0.0)
  np.testing.assert_array_equal(size_v[later], 0.0)
  np.testing.assert_array_equal(size_q[~np.eye(t, dtype=bool)], 0.0)
  # ... and every earlier position does matter (out[0] = value[0], whatever query/key[0] are).
  assert (size_v[~later] > 1e-3).all()
  assert (size_k[1:][~later[1:]] > 1e-3).all() and (np.diag(size_q)[1:] > 1e-3).all()


@pytest.mark.parametrize("g", [3, 1])
def test_bf16_close_to_f32_reference(rng, variant, g):
  q, k, v = qkv(rng, g=g)
  mask = random_mask(rng, B, 1, T, S)
  bf16 = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
  out = variant(flax_mha.dot_product_attention)(*bf16, mask=mask)
  chex.assert_type(out, jnp.bfloat16)
  chex.assert_shape(out, (B, T, H, V))
  chex.assert_tree_all_finite(out)
  want = np_attention(*[np.asarray(x, np.float32) for x in bf16], mask=mask)
  np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=3e-2, rtol=3e-2)
  weights = flax_mha.dot_product_attention_weights(*bf16[:2], mask=mask)
  chex.assert_type(weights, jnp.float32)  # the softmax ran in float32


def test_fully_masked_rows_give_zero_and_finite_grads(rng):
  q, k, v = qkv(rng)
  mask = random_mask(rng, B, H, T, S)
  mask[0, 2, 3, :] = False  # one (batch, head, query) row sees nothing
  mask[1, :, :, :] = False  # a whole batch element sees nothing
  fn = jax.jit(lambda q, k, v: flax_mha.dot_product_attention(q, k, v, mask=mask))
  out = fn(q, k, v)
  np.testing.assert_array_equal(out[0, 3, 2], 0.0)
  np.testing.assert_array_equal(out[1], 0.0)
  np.testing.assert_allclose(out, np_attention(q, k, v, mask=mask), **TOL)
  grads = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=(0, 1, 2)))(q, k, v)
  chex.assert_tree_all_finite(grads)
  np.testing.assert_array_equal(grads[1][1], 0.0)  # masked keys get no gradient
  weights = flax_mha.dot_product_attention_weights(q, k, mask=mask)
  np.testing.assert_array_equal(weights[1], 0.0)


def test_dropout(rng):
  """Deterministic per rng, different across rngs, drops ~rate, rescales kept weights."""
  q, k, _ = qkv(rng, t=31, s=37)
  rate = 0.3
  weights_fn = functools.partial(jax.jit(functools.partial(
      flax_mha.dot_product_attention_weights, dropout_rate=rate)), q, k)
  clean = np.asarray(jax.jit(flax_mha.dot_product_attention_weights)(q, k))
  w1 = np.asarray(weights_fn(dropout_rng=jax.random.key(1)))
  np.testing.assert_array_equal(w1, weights_fn(dropout_rng=jax.random.key(1)))
  w2 = np.asarray(weights_fn(dropout_rng=jax.random.key(2)))
  assert (w1 != w2).mean() > 0.2
  dropped = w1 == 0
  assert abs(dropped.mean() - rate) < 0.02, dropped.mean()
  np.testing.assert_allclose(w1[~dropped], clean[~dropped] / (1 - rate), rtol=1e-5)
  # Per (batch, head) the dropped pattern differs: no accidental reuse across B·H.
  assert (dropped[0, 0] != dropped[1, 0]).any() and (dropped[0, 0] != dropped[0, 1]).any()
  # The output is the value-weighted sum of exactly these weights.
  _, _, v = qkv(rng, t=31, s=37)
  out = jax.jit(functools.partial(flax_mha.dot_product_attention, dropout_rate=rate))(
      q, k, v, dropout_rng=jax.random.key(1))
  want = np.einsum("bhts,bshv->bthv", w1.astype(np.float64), np.repeat(v, H // DIMS["G"], -2))
  np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)
  # A raw uint32 key works too and is deterministic.
  raw = functools.partial(weights_fn, dropout_rng=jax.random.PRNGKey(3))
  np.testing.assert_array_equal(raw(), raw())


def test_no_retrace_for_new_values(rng):
  @jax.jit
  @chex.assert_max_traces(n=1)
  def fn(q, k, v, bias, mask, dropout_rng):
    return flax_mha.dot_product_attention(
        q, k, v, bias, mask, is_causal=True, dropout_rate=0.1, dropout_rng=dropout_rng)

  for seed in range(3):
    q, k, v = qkv(np.random.default_rng(seed))
    fn(q, k, v, randn(rng, B, H, T, S), random_mask(rng, B, 1, T, S), jax.random.key(seed))


def test_split_and_merge_heads(rng, variant):
  x = randn(rng, B, T, H * K)
  heads = variant(flax_mha.split_heads, static_argnums=1)(x, H)
  chex.assert_shape(heads, (B, T, H, K))
  np.testing.assert_array_equal(heads[:, :, 1, :], x[:, :, K:2 * K])  # head-major features
  np.testing.assert_array_equal(variant(flax_mha.merge_heads)(heads), x)
  np.testing.assert_array_equal(flax_mha.merge_heads(flax_mha.split_heads(x[0], H)), x[0])


def test_split_and_merge_heads_any_dtype():
  x = jnp.arange(2 * T * H * K, dtype=jnp.int32).reshape(2, T, H * K)
  heads = flax_mha.split_heads(x, H)
  chex.assert_shape(heads, (2, T, H, K))
  assert heads.dtype == jnp.int32
  np.testing.assert_array_equal(flax_mha.merge_heads(heads), x)
