"""Parity with tokamax (JAX's kernel library): flax_mha.dot_product_attention against
tokamax.dot_product_attention's XLA implementations, values and gradients, over the options both
take (causal, GQA, K != V, windows, sequence lengths, soft-cap, bias, mask).

Where we differ on purpose: a query row at or beyond its `query_seq_lengths` gives 0 here and
the mean of the values in tokamax (jax.nn's meaning), so those rows are not compared.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_mha

tokamax = pytest.importorskip("tokamax")
from absl import flags  # noqa: E402  (tokamax reads absl flags; pytest's argv is not theirs)

if not flags.FLAGS.is_parsed():
  flags.FLAGS(["pytest"])

# A peer's parity, compiling both systems' programs: in the integration part.
pytestmark = pytest.mark.integration
B, T, H, G, K, V = 2, 24, 4, 2, 8, 8
LENGTHS = dict(query_seq_lengths=jnp.array([24, 13]), key_value_seq_lengths=jnp.array([20, 9]))
CASES = {
    "plain": {},
    "causal": dict(is_causal=True),
    "window": dict(local_window_size=(5, 2)),
    "causal window": dict(is_causal=True, local_window_size=(6, 0)),
    "lengths": LENGTHS,
    "soft cap": dict(logits_soft_cap=5.0),
    "bias and mask": "dense",
}


def _inputs(v_dim=V):
  keys = jax.random.split(jax.random.key(0), 5)
  q = jax.random.normal(keys[0], (B, T, H, K))
  k = jax.random.normal(keys[1], (B, T, G, K))
  v = jax.random.normal(keys[2], (B, T, G, v_dim))
  bias = jax.random.normal(keys[3], (B, H, T, T))
  mask = jax.random.bernoulli(keys[4], 0.7, (B, 1, T, T)).at[..., 0].set(True)
  return q, k, v, bias, mask


def _calls(case, v_dim=V):
  """(ours, tokamax's) as functions of (q, k, v), and the query rows to compare [B, T]."""
  q, k, v, bias, mask = _inputs(v_dim)
  options = dict(bias=bias, mask=mask) if case == "dense" else dict(case)
  ours_options = dict(options)
  if "logits_soft_cap" in ours_options:
    ours_options["logit_soft_cap"] = ours_options.pop("logits_soft_cap")
  rows = jnp.arange(T) < options.get("query_seq_lengths", jnp.full((B,), T))[:, None]
  ours = lambda q, k, v: flax_mha.dot_product_attention(q, k, v, **ours_options)
  return ours, options, (q, k, v), rows


@pytest.mark.parametrize("implementation", ["xla", "xla_chunked"])
@pytest.mark.parametrize("name", list(CASES))
def test_values_and_gradients_match_tokamax(name, implementation):
  ours, options, (q, k, v), rows = _calls(CASES[name])
  theirs = lambda q, k, v: tokamax.dot_product_attention(
      q, k, v, implementation=implementation, **options)
  keep = rows[:, :, None, None]
  np.testing.assert_allclose(jnp.where(keep, ours(q, k, v), 0), jnp.where(keep, theirs(q, k, v), 0),
                             atol=2e-5, rtol=2e-5)
  cotangent = jax.random.normal(jax.random.key(9), (B, T, H, V)) * keep
  grads = [jax.vjp(f, q, k, v)[1](cotangent) for f in (ours, theirs)]
  for name_, ours_grad, their_grad in zip("qkv", *grads):
    np.testing.assert_allclose(ours_grad, their_grad, atol=5e-5, rtol=5e-5, err_msg=f"d{name_}")


def test_value_head_dim_differs_from_key_head_dim():
  ours, _, (q, k, v), _ = _calls(dict(is_causal=True), v_dim=12)
  want = tokamax.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
  assert want.shape == (B, T, H, 12)
  np.testing.assert_allclose(ours(q, k, v), want, atol=2e-5, rtol=2e-5)
