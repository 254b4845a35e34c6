"""The registry: one `Kernel` per implementation, and everything that lists implementations
(the names `implementation=` takes, explain's alternatives) read from it, so a new kernel is one
`register` call away from every call site."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_mha
from flax_mha.kernels import reference
from flax_mha.kernels import registry
from helpers import np_attention, qkv


def test_every_implementation_is_registered_once_in_order():
  assert registry.names() == ("reference", "xla", "chunked", "rows", "cudnn", "splash", "triton",
                              "decode", "ring")
  assert tuple(flax_mha.IMPLEMENTATIONS) == registry.names()
  for name in registry.names():
    assert flax_mha.IMPLEMENTATIONS[name] is registry.get(name).attention
  with pytest.raises(ValueError, match="'xla' is already registered"):
    registry.register(registry.Kernel("xla", reference.attention))
  with pytest.raises(TypeError, match="must be a registry.Kernel"):
    registry.register(reference.attention)
  with pytest.raises(KeyError, match="no implementation named 'nope'"):
    registry.get("nope")
  with pytest.raises(TypeError):
    flax_mha.IMPLEMENTATIONS["mine"] = reference.attention  # read-only


@pytest.fixture
def plugin():
  """A kernel registered for one test: the oracle under another name, refusing causal calls."""
  refuses = lambda call: "it takes no causal calls" if call.is_causal else None
  kernel = registry.register(registry.Kernel("plugin", reference.attention, refuses, "a test"))
  yield kernel
  registry.unregister("plugin")


def test_a_registered_kernel_is_named_explained_and_runs(plugin, rng):
  """One register call: the name is taken by dot_product_attention, and explain lists the
  kernel with its verdict; unregistered afterwards, it is gone everywhere."""
  q, k, v = qkv(rng)
  out = flax_mha.dot_product_attention(q, k, v, implementation="plugin")
  np.testing.assert_allclose(out, np_attention(q, k, v), atol=2e-5, rtol=2e-5)
  assert "plugin" in flax_mha.IMPLEMENTATIONS
  assert flax_mha.explain(q, k, v).alternatives["plugin"] == "runs"
  causal = flax_mha.explain(q, k, v, is_causal=True).alternatives["plugin"]
  assert causal == "refuses: it takes no causal calls"


def test_unregistered_names_are_refused(rng):
  q, k, v = qkv(rng)
  assert "plugin" not in flax_mha.IMPLEMENTATIONS
  with pytest.raises(ValueError, match="implementation must be None, a callable or one of"):
    flax_mha.dot_product_attention(q, k, v, implementation="plugin")


def test_the_call_record_holds_static_facts_only():
  q = jnp.ones((2, 5, 6, 11))
  k = jax.ShapeDtypeStruct((2, 7, 3, 11), jnp.float32)
  call = registry.Call.of(q, k, k, is_causal=True, dropout_rate=0.25, platform="tpu")
  assert isinstance(call.query, jax.ShapeDtypeStruct) and call.bias is None
  assert call.dims == dict(B=2, T=5, H=6, K=11, S=7, G=3, V=11)
  assert call.is_causal and call.dropout_rate == 0.25 and call.mods is None


def test_ring_is_named_and_refuses_without_a_mesh(rng):
  q, k, v = qkv(rng)
  verdict = flax_mha.explain(q, k, v).alternatives["ring"]
  assert verdict.startswith("refuses: it needs a mesh with a 'seq' axis in context")
  with pytest.raises(ValueError, match="needs a mesh with a 'seq' axis in context"):
    flax_mha.dot_product_attention(q, k, v, implementation="ring")
