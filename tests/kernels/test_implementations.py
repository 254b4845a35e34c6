"""One semantics for every implementation: the oracle against independent references, and every
other implementation against the oracle.

The oracle (`flax_mha.kernels.reference`) is checked against float64 NumPy and finite
differences; every other implementation against it, values and gradients, on every combination
of bias, mask, causality, dropout and head layout, and on the inputs where implementations used
to disagree: rows hidden by a -inf bias, rows of finfo.min logits, float64, empty dims. The cases
left to the integration part (and the slow rest of the combinations) run the same tests in
tests/kernels/test_implementations_integration.py.
"""

from __future__ import annotations

import functools
import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import flax_mha
from flax_mha import platforms
from flax_mha.kernels import chunked
from flax_mha.kernels import reference
from flax_mha.kernels import registry
from flax_mha.kernels import rows
from helpers import (DIMS, call_kernel, in_turn, kernel_inputs, np_attention, output_and_grads,
                     qkv, randn, random_mask, split_grid)

B, T, S, H, G, K, V = 2, 7, 11, 6, 3, 5, 13
_inputs = functools.partial(kernel_inputs, t=T, s=S, h=H, g=G, k=K, v=V)
# Besides every registered kernel, variants whose tiles divide none of the prime lengths (block
# sizes 3, 4): the padding is covered too. A variant is refused where its kernel is.
VARIANTS = {"chunked_small_blocks": ("chunked", chunked.make_attention(block_q=3, block_k=4)),
            "rows_one_unit": ("rows", rows.make_attention(2**5, 2**5))}


def runs_here(name: str, dropout_rate: float = 0.0, h: int = H, g: int = G) -> bool:
  """Whether the registered kernel `name` takes a call of this file's shapes in this process
  (cuDNN needs a GPU, ring a mesh: their own files test them)."""
  spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  call = registry.Call.of(spec(B, T, h, K), spec(B, S, g, K), spec(B, S, g, V),
                          dropout_rate=dropout_rate, platform=platforms.backend_platform())
  return registry.get(name).refuses(call) is None


# Every registered kernel that runs here besides the oracle, read from the registry.
TUNED = {name: fn for name, fn in flax_mha.IMPLEMENTATIONS.items()
         if name != "reference" and runs_here(name)}
TUNED.update({name: fn for name, (base, fn) in VARIANTS.items() if base in TUNED})
SINGLE_DEVICE = [name for name in flax_mha.IMPLEMENTATIONS if runs_here(name)]


# ---- the oracle against independent references ----


@pytest.mark.parametrize("g", [6, 3, 1])
@pytest.mark.parametrize("is_causal", [False, True])
def test_oracle_matches_numpy(rng, g, is_causal):
  """The oracle every other implementation is tested against, against float64 NumPy."""
  b, t, s, h = (DIMS[d] for d in "BTSH")
  q, k, v = qkv(rng, g=g)
  bias, mask = randn(rng, b, 1, t, s), random_mask(rng, 1, h, t, s)
  out = flax_mha.dot_product_attention(q, k, v, bias, mask, is_causal=is_causal,
                                       implementation="reference")
  np.testing.assert_allclose(out, np_attention(q, k, v, bias, mask, is_causal=is_causal),
                             atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("implementation", ["reference", "xla"])
def test_gradients_check_grads(rng, implementation):
  """Forward- and reverse-mode gradients (GQA, causal, bias, mask) against finite differences."""
  q, k, v = qkv(rng, t=3, s=5, h=6, g=3, k=7, v=2)
  bias, mask = randn(rng, 1, 6, 3, 5), random_mask(rng, 1, 1, 3, 5)
  mask[..., 0] = True
  with jax.enable_x64(True):
    args = [jnp.asarray(x, jnp.float64) for x in (q, k, v, bias)]
    fn = jax.jit(lambda q, k, v, b: flax_mha.dot_product_attention(
        q, k, v, b, mask, is_causal=True, implementation=implementation))
    check_grads(fn, args, order=1, modes=["fwd", "rev"])


# ---- every other implementation against the oracle ----


# Every combination of bias, mask, causal and dropout, each part of it (below) taking the head
# layouts (GQA, MHA, MQA) in turn.
OPTIONS = list(itertools.product([False, True], [False, True], [False, True], [0.0, 0.25]))
LAYOUTS = [(H, G), (H, H), (H, 1)]


def _oracle_cases():
  """Each implementation on every combination of the options it takes (rows: no dropout), in two
  parts: this file's, a covering array in which every pair of options meets in each of its four
  settings (of four options, the combinations with none or three on; of three, none or two),
  and each head layout comes; the rest, slow: test_implementations_integration.py. Each compile
  is ~1-3 s (chunked's most)."""
  unit, slow = [], []
  for name in TUNED:
    base = VARIANTS.get(name, (name,))[0]
    covering = (0, 3) if runs_here(base, 0.25) else (0, 2)
    for options in OPTIONS:
      part = unit if sum(map(bool, options)) in covering else slow
      layouts = [heads for heads in LAYOUTS if runs_here(base, options[3], *heads)]
      if not layouts:
        continue
      heads = layouts[sum(p.values[0] == name for p in part) % len(layouts)]
      part.append(pytest.param(name, *options, heads, id="-".join(
          [name, *map(str, options), f"heads{heads[0]}x{heads[1]}"])))
  return unit, slow


ORACLE_CASES, SLOW_ORACLE_CASES = _oracle_cases()


@pytest.mark.parametrize("name,use_bias,use_mask,is_causal,dropout_rate,heads", ORACLE_CASES)
def test_values_and_grads_match_oracle(name, use_bias, use_mask, is_causal, dropout_rate, heads):
  q, k, v, bias, mask = _inputs(h=heads[0], g=heads[1])
  bias, mask = (bias if use_bias else None), (mask if use_mask else None)
  args = (q, k, v) if bias is None else (q, k, v, bias)
  call = lambda fn: lambda q, k, v, b=None: call_kernel(fn, q, k, v, b, mask, is_causal,
                                                        dropout_rate)
  out, grads = output_and_grads(call(TUNED[name]), *args)  # one compile: values and gradients
  want, want_grads = output_and_grads(call(reference.attention), *args, jit=False)
  chex.assert_trees_all_close(out, want, atol=2e-6, rtol=2e-6)
  chex.assert_trees_all_close(grads, want_grads, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("implementation", [None, *SINGLE_DEVICE])
@pytest.mark.parametrize("n", [8])  # None: "xla" (600², None's "rows": the integration part)
def test_rows_hidden_by_minus_inf_bias_give_zero_and_finite_grads(implementation, n):
  rng = np.random.default_rng(n)
  q, k, v = (jnp.asarray(x) for x in qkv(rng, t=n, s=n, h=2, g=1, k=4, v=3))
  bias = np.where(rng.random((B, 1, n, n)) < 0.3, -np.inf, 0.0).astype(np.float32)
  bias[0, 0, 3, :] = -np.inf  # one row sees nothing
  bias[1, 0, :, 5:] = -np.inf  # a band of hidden keys
  fn = functools.partial(flax_mha.dot_product_attention, bias=jnp.asarray(bias),
                         implementation=implementation)
  out = jax.jit(fn)(q, k, v)
  np.testing.assert_array_equal(out[0, 3], 0.0)
  np.testing.assert_allclose(out, np_attention(q, k, v, bias), atol=2e-5, rtol=2e-5)
  grads = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=(0, 1, 2)))(q, k, v)
  chex.assert_tree_all_finite(grads)
  np.testing.assert_array_equal(grads[0][0, 3], 0.0)


@pytest.mark.parametrize("implementation", SINGLE_DEVICE)
def test_finite_lowest_logits_are_a_uniform_row_not_a_hidden_one(implementation):
  """A bias row of finfo.min is finite: all logits equal, so the output is the mean of V."""
  q, k, v, _, _ = _inputs(1)
  bias = jnp.zeros((1, 1, T, S)).at[..., 2, :].set(jnp.finfo(jnp.float32).min)
  out = flax_mha.dot_product_attention(q, k, v, bias, implementation=implementation)
  mean_v = jnp.repeat(v.mean(axis=1), H // G, axis=1)  # [B, H, V]
  np.testing.assert_allclose(out[:, 2], mean_v, atol=1e-5)


# Causal for every other implementation; without causality for each (the integration part),
# causal for the others (slow).
FLOAT64_CAUSAL = SINGLE_DEVICE[::2]


@pytest.mark.parametrize("implementation", FLOAT64_CAUSAL)
@pytest.mark.parametrize("is_causal", [True])
def test_float64_in_float64_accuracy_out(implementation, is_causal):
  with jax.enable_x64(True):
    q, k, v, bias, mask = _inputs(2, dtype=np.float64)
    fn = functools.partial(flax_mha.dot_product_attention, is_causal=is_causal,
                           implementation=implementation)
    out = fn(q, k, v, bias, mask)
    chex.assert_type(out, jnp.float64)
    want = np_attention(q, k, v, bias, mask, is_causal=is_causal)
    np.testing.assert_allclose(out, want, atol=1e-12, rtol=1e-12)
    loss = lambda fn: lambda *a: jnp.sum(jnp.sin(fn(*a, bias, mask)))
    grads = jax.grad(loss(fn), argnums=(0, 1, 2))(q, k, v)
    oracle = functools.partial(fn, implementation="reference")
    want_grads = jax.grad(loss(oracle), argnums=(0, 1, 2))(q, k, v)
    chex.assert_type(grads, jnp.float64)
    chex.assert_trees_all_close(grads, want_grads, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("implementation", ["reference", "xla"])
def test_forward_mode_equals_reverse_mode(implementation):
  q, k, v, bias, mask = _inputs(3)
  fn = lambda q: flax_mha.dot_product_attention(q, k, v, bias, mask, is_causal=True,
                                                 implementation=implementation)
  fwd, rev = jax.jacfwd(fn)(q), jax.jacrev(fn)(q)
  np.testing.assert_allclose(fwd, rev, atol=1e-5)


EMPTY_DIMS = [(0, 7, 5, 3), (4, 0, 5, 3), (4, 7, 0, 3), (4, 7, 5, 0)]  # T, S, K, V: one is 0
# Each implementation with two of the four in turn; the other two (slow): the integration part.
EMPTY_GRID = split_grid(
    in_turn([None, *SINGLE_DEVICE], EMPTY_DIMS, period=2),
    lambda implementation, dims: False, [None, *SINGLE_DEVICE], EMPTY_DIMS)


@pytest.mark.parametrize("implementation,dims", EMPTY_GRID.unit)
def test_empty_dims(implementation, dims):
  """T = 0 or V = 0: an empty result; S = 0: no key to see, output 0; K = 0: logits 0,
  uniform weights, the mean of V."""
  t, s, k, v = dims
  rng = np.random.default_rng(4)
  q, key, value = qkv(rng, t=t, s=s, h=2, g=1, k=k, v=v)
  mask = np.ones((B, 1, t, s), bool)
  fn = functools.partial(flax_mha.dot_product_attention, implementation=implementation)
  out = jax.jit(fn)(q, key, value, mask=mask)
  chex.assert_shape(out, (B, t, 2, v))
  want = np_attention(q, key, value, mask=mask, scale=1.0 if k == 0 else None)  # 0 · inf
  np.testing.assert_allclose(out, want, atol=1e-6)
  grads = jax.grad(lambda *a: jnp.sum(fn(*a, mask=mask)), argnums=(0, 1, 2))(q, key, value)
  chex.assert_tree_all_finite(grads)
  weights = flax_mha.dot_product_attention_weights(q, key, mask=mask)
  chex.assert_shape(weights, (B, 2, t, s))


def test_a_callable_implementation_is_called_with_flat_batch():
  calls = []

  def spy(q, k, v, bias, mask, **kwargs):
    calls.append((q.shape, None if mask is None else mask.shape, kwargs["scale"]))
    return reference.attention(q, k, v, bias, mask, **kwargs)

  rng = np.random.default_rng(5)
  q, k, v = qkv(rng, batch=(2, 3))
  s = k.shape[-3]
  mask = np.ones((2, 3, 1, 1, s), bool)
  out = flax_mha.dot_product_attention(q, k, v, mask=mask, scale=0.5, implementation=spy)
  assert calls == [((6, *q.shape[2:]), (6, 1, 1, s), 0.5)]
  np.testing.assert_allclose(out, np_attention(q, k, v, mask=mask, scale=0.5), atol=2e-5)
