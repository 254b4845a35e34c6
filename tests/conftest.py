"""The suite's fixtures (a seeded NumPy rng, jit/no-jit variants, chex's trace counter cleared
per test, jax's compiled programs released per file), its hooks and jax's persistent
compilation cache; the helpers that test files import are in tests/helpers.py."""

from __future__ import annotations

import os
import pathlib

import chex
import jax
import numpy as np
import pytest


# jax's persistent compilation cache, for this process and the interpreters tests start (they
# inherit the environment): a rerun after a change compiles only the programs the change
# touched. A JAX_COMPILATION_CACHE_DIR set by the caller wins ("" turns the cache off).
CACHE = pathlib.Path(__file__).resolve().parents[1] / ".cache" / "jax"
CACHE_BYTES = 2 * 2**30  # at session start, oldest entries go until the cache is under this


def pytest_configure(config):
  directory = os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(CACHE))
  if not directory:
    return
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
  if not hasattr(config, "workerinput"):  # once, in pytest-xdist's controller
    prune(pathlib.Path(directory), CACHE_BYTES)


def prune(directory: pathlib.Path, limit: int) -> None:
  """Delete the oldest files (by modification time) of `directory` until it holds at most
  `limit` bytes: jax writes entries without evicting any."""
  if not directory.is_dir():
    return
  files = sorted(((f.stat(), f) for f in directory.iterdir() if f.is_file()),
                 key=lambda entry: entry[0].st_mtime)
  total = sum(stat.st_size for stat, _ in files)
  for stat, path in files:
    if total <= limit:
      return
    path.unlink(missing_ok=True)
    total -= stat.st_size


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


MAPS, MAX_MAPS = pathlib.Path("/proc/self/maps"), pathlib.Path("/proc/sys/vm/max_map_count")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """After each test file, jax's caches are cleared, so the programs only they keep alive are
  freed. XLA:CPU maps about three memory regions per compiled program; a worker that keeps
  every program of a long run reaches the kernel's limit (vm.max_map_count, 65530 by
  default), and then a compile fails and the worker dies (a segfault while the error is
  thrown: it killed CI's integration part). A file whose own programs come near the limit
  fails here by name instead."""
  yield
  jax.clear_caches()
  if MAPS.exists() and MAX_MAPS.exists():
    held, limit = len(MAPS.read_text().splitlines()), int(MAX_MAPS.read_text())
    assert held < limit // 2, (f"this process holds {held} memory maps of the kernel's "
                               f"{limit} after its caches were cleared: something keeps "
                               f"compiled programs alive")


def pytest_collection_modifyitems(items):
  """A multi-device check starts an interpreter of its own: it belongs to the integration part
  (`make test-integration`), never the unit suite."""
  for item in items:
    if item.get_closest_marker("multidevice"):
      item.add_marker(pytest.mark.integration)
