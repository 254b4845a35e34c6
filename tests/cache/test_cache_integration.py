"""The KV cache at the cases tests/cache/test_cache.py leaves out: rows of different lengths through a
whole front end, and (slow) the rest of the cached-calls grid through that file's own test."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_cache as unit


pytestmark = pytest.mark.integration  # a whole model end to end: seconds of compiles

# Cases of tests/cache/test_cache.py that compile for seconds: the unit part skips them
# (`check_` there), the integration part runs them here.
test_a_step_under_scan_and_grad = (
    unit.check_a_step_under_scan_and_grad)


@pytest.mark.parametrize("kind,option,chunks", unit.CACHED_GRID.integration)
def test_cached_calls_equal_the_whole_sequence(kind, option, chunks):
  unit.test_cached_calls_equal_the_whole_sequence(kind, option, chunks)


def test_rows_of_different_lengths_need_no_left_padding():
  """Two prompts of 9 and 4 tokens right-padded in one batch (positions -1 on the padding),
  then steps at each row's own position: each row equals its own computation alone."""
  call, new_cache = unit.front_end("linen", unit.OPTIONS["rotary_gqa"])
  x = jax.random.normal(jax.random.key(2), (unit.B, 12, unit.D))
  lengths = np.array([9, 4])
  prompt_pos = np.where(np.arange(9) < lengths[:, None], np.arange(9), -1)
  y, cache = call(x[:, :9], positions=jnp.asarray(prompt_pos), cache=new_cache(unit.B, 16))
  np.testing.assert_array_equal(cache.length, lengths)
  steps = []
  for n in range(3):  # row 0 continues at 9, 10, 11; row 1 at 4, 5, 6
    tokens = jnp.stack([x[0, 9 + n], x[1, 4 + n]])[:, None]
    out, cache = call(tokens, cache=cache)
    steps.append(out)
  for row, n in enumerate(lengths):
    alone = call(x[row, :n + 3][None], is_causal=True)[0]
    np.testing.assert_allclose(y[row, :n], alone[:n], atol=2e-6, rtol=2e-6)
    np.testing.assert_allclose(jnp.stack([s[row, 0] for s in steps]), alone[n:n + 3],
                               atol=2e-6, rtol=2e-6)


# Moved from the unit part for its time (5 s).
test_a_chunk_longer_than_the_cache_is_refused_while_tracing = unit.check_a_chunk_longer_than_the_cache_is_refused_while_tracing
