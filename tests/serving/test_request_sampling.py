"""Each request's own sampling in serving (flax_mha.serving.Server.submit's sampler, seed and
ignore_stop_tokens): the rows' restriction against a NumPy oracle, bad arguments named. A seeded
request's draws against the model's own logits and keys, greedy rows beside sampled ones and
ignore_stop_tokens are in tests/serving/test_request_sampling_integration.py."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from flax_mha import serving
from flax_mha.models import sampling

from test_serving import lm


def restrict_oracle(logits, temperature, top_k, top_p):
  """One row, in float64: scaled; below the k-th largest (ties kept) out; then out where the
  mass of the strictly more likely tokens, renormalised, reaches top_p."""
  x = np.asarray(logits, np.float64) / temperature
  if top_k:
    x = np.where(x < np.sort(x)[::-1][top_k - 1], -np.inf, x)
  if top_p < 1:
    order = np.argsort(-x, kind="stable")
    probs = np.exp(x[order] - x[order][0])
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    x[order[before >= top_p]] = -np.inf
  return x


def test_each_rows_restriction_matches_a_numpy_oracle():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(6, 13)).astype(np.float32)
  logits[2, [3, 7]] = logits[2].max() + 1  # a tie at the top
  params = [(1.0, 0, 1.0), (0.5, 3, 1.0), (2.0, 2, 1.0), (1.0, 0, 0.6), (0.7, 5, 0.8),
            (1.3, 13, 0.95)]
  t, k, p = (np.array(c, dtype) for c, dtype in zip(zip(*params), (np.float32, np.int32,
                                                                    np.float32)))
  got = np.asarray(sampling.restrict_rows(jnp.asarray(logits), t, k, p))
  for row, (temperature, top_k, top_p) in enumerate(params):
    want = restrict_oracle(logits[row], temperature, top_k, top_p)
    np.testing.assert_array_equal(np.isinf(got[row]), np.isinf(want), err_msg=f"row {row}")
    np.testing.assert_allclose(got[row][~np.isinf(want)], want[~np.isinf(want)], rtol=1e-6)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(sampler="greedy"), TypeError, "sampler must be a Greedy.. or a Sampling"),
    (dict(seed=-1), ValueError, r"seed must be None or an int in \[0, 2\*\*31\), got -1"),
    (dict(seed=2**31), ValueError, r"seed must be None or an int in \[0, 2\*\*31\)"),
    (dict(seed=1.0), ValueError, r"seed must be None or an int"),
    (dict(ignore_stop_tokens=1), TypeError, "ignore_stop_tokens must be a bool, got int"),
])
def test_bad_request_sampling_is_named(kwargs, error, match):
  model, params = lm()
  server = serving.Server(model, params, batch_size=1, page_size=4, num_pages=8, max_length=16)
  with pytest.raises(error, match=match):
    server.submit([1, 2], 3, **kwargs)
  assert not server.busy
