"""The suite's fixtures (a seeded NumPy rng, jit/no-jit variants, chex's trace counter cleared
per test) and its hook; the helpers that test files import are in tests/helpers.py."""

from __future__ import annotations

import chex
import jax
import numpy as np
import pytest


@pytest.fixture
def rng():
  return np.random.default_rng(0)


@pytest.fixture(params=["with_jit", "without_jit"])
def variant(request):
  """Like chex.variants(with_jit=True, without_jit=True): variant(fn, **jit_kwargs)."""
  if request.param == "with_jit":
    return lambda fn, **kw: jax.jit(fn, **kw)
  return lambda fn, **kw: fn


@pytest.fixture(autouse=True)
def _clear_trace_counter():
  chex.clear_trace_counter()
  yield


def pytest_collection_modifyitems(items):
  """A multi-device check starts an interpreter of its own: it belongs to the integration part
  (`make test-integration`), never the unit suite."""
  for item in items:
    if item.get_closest_marker("multidevice"):
      item.add_marker(pytest.mark.integration)
