"""flax_mha.parallel.ring: 4 sequence shards equal single-device attention, values and grads.

Argument checks, the strategy rule and traces on abstract meshes run here on the single CPU
device; the 8-device checks (in a subprocess, tests/multidevice/check_ring.py) and compiles on
one-device meshes are in tests/parallel/test_ring_integration.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh

import flax_mha
from flax_mha import mods as mods_lib
from flax_mha.parallel import sharding
from flax_mha import ring_implementation
from flax_mha.parallel import layouts, seq_parallel
from flax_mha.parallel.seq_parallel import ring_attention
from helpers import np_attention, output_and_grads, qkv


def test_float64_in_float64_accuracy_out(rng):
  with jax.enable_x64(True):
    q, k, v = (x.astype(jnp.float64) for x in qkv(rng))
    out, (grad,) = output_and_grads(  # one compile: values and gradients
        lambda q: ring_attention(q, k, v, mesh=sharding.make_mesh(), is_causal=True), q)
    assert out.dtype == jnp.float64
    np.testing.assert_allclose(out, np_attention(q, k, v, is_causal=True), atol=1e-12)
    _, (want,) = output_and_grads(lambda q: flax_mha.dot_product_attention(
        q, k, v, is_causal=True, implementation="reference"), q, jit=False)
    np.testing.assert_allclose(grad, want, atol=1e-12)


def test_rejects_bad_shapes():
  mesh = sharding.make_mesh()
  with pytest.raises(ValueError, match=r"\[B, T, H, K\]"):
    ring_attention(jnp.ones((5, 6, 7)), jnp.ones((5, 6, 7)), jnp.ones((5, 6, 7)), mesh=mesh)


@pytest.mark.parametrize("kwargs, match", [
    (dict(), r"axis_name='seq' must be an axis of the mesh \('data', 'model'\)"),
    (dict(axis_name="data", batch_axis="batch"),
     r"batch_axis='batch' must be None or an axis of the mesh \('data', 'model'\)"),
    (dict(axis_name="data", head_axis="heads"),
     r"head_axis='heads' must be None or an axis of the mesh \('data', 'model'\)"),
    (dict(axis_name="data", batch_axis="data"),
     r"axis_name='data', batch_axis='data' and head_axis=None must be different"),
])
def test_rejects_axes_the_mesh_lacks(kwargs, match):
  """Regression: a mesh without 'seq' raised a bare KeyError."""
  x = jnp.ones((2, 6, 6, 4))
  with pytest.raises(ValueError, match=match):
    ring_attention(x, x, x, mesh=jax.make_mesh((1, 1), ("data", "model")), **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch_axis="data"), r"batch_axis='data' of size 2 must divide the batch B=3"),
    (dict(head_axis="model"), r"head_axis='model' of size 3 must divide .* H=6 and .* G=2"),
    (dict(axis_name="model"), r"axis_name='model' of size 3 must divide .* T=12 and .* S=4"),
])
def test_rejects_axes_that_do_not_divide(kwargs, match):
  """Sizes are checked before shard_map runs, so an abstract mesh tests them on one device."""
  q, k = jnp.ones((3, 12, 6, 4)), jnp.ones((3, 4, 2, 4))
  mesh = AbstractMesh((2, 3, 4), ("data", "model", "seq"))
  with pytest.raises(ValueError, match=match):
    ring_attention(q, k, k, mesh=mesh, **kwargs)


def test_ring_implementation_says_what_it_needs():
  """Needs the core's `implementation=<callable>` (flax_mha.attention)."""
  x = jnp.ones((1, 4, 2, 8))
  with pytest.raises(ValueError, match="needs a mesh with a 'seq' axis"):
    flax_mha.dot_product_attention(x, x, x, implementation=ring_implementation)
  with pytest.raises(ValueError, match="not a bias"):
    with jax.set_mesh(sharding.make_mesh()):
      flax_mha.dot_product_attention(x, x, x, bias=jnp.zeros((4, 4)),
                                     implementation=ring_implementation)


@pytest.mark.parametrize("kwargs, match", [
    (dict(strategy="tree"), r"strategy must be one of \('ring', 'all_gather', 'ulysses', 'auto'\)"),
    (dict(layout="random"), r"layout must be one of \('contiguous', 'zigzag', 'striped'\)"),
    (dict(strategy="ulysses"), r"query heads \(6\) and key/value heads \(2\) per device to be "
     r"multiples of 4"),
    (dict(layout="zigzag"), r"must divide the query length T=12 and the key length S=4 twice"),
    (dict(bias=jnp.zeros((12, 4))), r"strategy='ring' takes a mask, not a bias"),
])
def test_sequence_parallel_says_what_it_takes(kwargs, match):
  q, k = jnp.ones((3, 12, 6, 4)), jnp.ones((3, 4, 2, 4))
  mesh = AbstractMesh((4,), ("seq",))
  with pytest.raises(ValueError, match=match):
    flax_mha.sequence_parallel_attention(q, k, k, mesh=mesh, **kwargs)


def test_implementation_factory_checks_its_arguments():
  with pytest.raises(ValueError, match="strategy must be one of"):
    flax_mha.sequence_parallel_implementation("rings")
  with pytest.raises(ValueError, match="layout must be one of"):
    flax_mha.sequence_parallel_implementation("ring", "zig-zag")
  assert flax_mha.sequence_parallel_implementation() == ring_implementation  # a value: hashable


def test_layouts_hold_every_token_once():
  """zigzag: device d holds chunks d and 2n-1-d; striped: token t on device t mod n."""
  np.testing.assert_array_equal(layouts.order("zigzag", 8, 2),
                                [[0, 1, 6, 7], [2, 3, 4, 5]])
  np.testing.assert_array_equal(layouts.order("striped", 6, 3), [[0, 3], [1, 4], [2, 5]])
  for layout in layouts.LAYOUTS:
    perm = layouts.order(layout, 24, 3).reshape(-1)
    np.testing.assert_array_equal(np.sort(perm), np.arange(24))
    np.testing.assert_array_equal(perm[layouts.inverse(perm)], np.arange(24))
  with pytest.raises(ValueError, match="multiple of 6, got 9"):
    layouts.order("zigzag", 9, 3)


WINDOW = mods_lib.Mods((mods_lib.LocalWindow(128, 0),))  # 128 keys back: 1/32 of 4096
MQA = ((1, 4096, 8, 64), (1, 4096, 1, 64))


# shapes, heads, extra options, the strategy auto picks, a phrase of its reason
AUTO_CASES = [
    (((1, 4096, 8, 64), (1, 4096, 8, 64)), (8, 8), {}, "ulysses", "all-to-alls move"),  # MHA
    (MQA, (8, 1), {}, "all_gather", "fit one device"),  # one K/V head: gathering it is cheap
    (MQA, (8, 1), dict(is_causal=True), "all_gather", "fit one device"),  # causal: half visible
    # A narrow window: each query shard sees about one shard of keys, the ring holds two.
    (MQA, (8, 1), dict(is_causal=True, mods=WINDOW), "ring", "0.062 of the tiles visible"),
    # A band over 32768 keys: its tile map is evaluated on every tile (~15 s): the integration
    # part (tests/parallel/test_ring_integration.py).
    (((1, 32768, 8, 64), (1, 32768, 1, 64)), (8, 1), dict(mods=mods_lib.Mods((
        mods_lib.MaskMod(lambda b, h, q, kv: jnp.abs(q - kv) <= 64),))), "ring",
     "0.046 of the tiles"),
    (MQA, (8, 1), dict(mods=mods_lib.Mods((mods_lib.MaskMod(
        lambda b, h, q, kv, w: jnp.abs(q - kv) <= w, consts=(64,)),))),
     "all_gather", "fit one device"),  # a mask_mod over arrays: data, its sparsity unknown
    (MQA, (8, 1), dict(mods=mods_lib.Mods((mods_lib.LocalWindow(1024, 0),))), "all_gather",
     "fit one device"),  # a window of 2 shards: more than one visible
    (MQA, (8, 1), dict(mods=WINDOW, bias=0.0), "all_gather", "a bias"),  # the ring takes none
    (((1, 2**22, 8, 64), (1, 2**22, 1, 64)), (8, 1), {}, "ring", "exceed"),  # K/V > 256 MiB
    (((1, 2**22, 8, 64), (1, 2**22, 1, 64)), (8, 1), {"bias": 0.0}, "all_gather", "a bias"),
]
# pytest's own ids for these values, kept for each case wherever it runs
AUTO_IDS = [f"shapes{i}-heads{i}-extra{i}-{want}-{why}"
            for i, (_, _, _, want, why) in enumerate(AUTO_CASES)]
AUTO_LATER = (4,)  # the band over 32768 keys


@pytest.mark.parametrize("shapes, heads, extra, want, why",
                         [c for i, c in enumerate(AUTO_CASES) if i not in AUTO_LATER],
                         ids=[n for i, n in enumerate(AUTO_IDS) if i not in AUTO_LATER])
def test_auto_strategy_rule(shapes, heads, extra, want, why):
  (q, k) = (jax.ShapeDtypeStruct(shape, jnp.float32) for shape in shapes)
  name, reason = seq_parallel.choose_strategy(q, k, k, n=8, heads=heads, **extra)
  assert (name, why in reason) == (want, True), reason


def test_explain_says_what_auto_runs():
  """With a 'seq' axis in context, flax_mha.explain prints auto's strategy and its reason."""
  q, k = (jax.ShapeDtypeStruct(shape, jnp.float32) for shape in MQA)
  assert flax_mha.explain(q, k, k, is_causal=True).sequence_parallel is None  # no mesh
  with jax.sharding.use_abstract_mesh(AbstractMesh((8,), ("seq",))):
    windowed = str(flax_mha.explain(q, k, k, is_causal=True, local_window_size=(128, 0)))
    causal = flax_mha.explain(q, k, k, is_causal=True).sequence_parallel
  assert "sequence_parallel_implementation('auto') runs 'ring' on seq=8: the static masks" in (
      windowed)
  assert causal.startswith("runs 'all_gather' on seq=8: all keys and values"), causal


def _ppermutes(jaxpr, trips: int = 1) -> list[tuple[int, bool]]:
  """(times it runs, whether it sends a loop-carried value as it came in) for every ppermute of
  `jaxpr` and the jaxprs inside it, a scan's body `length` times."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "ppermute":
      found.append((trips, all(any(x is y for y in jaxpr.invars) for x in eqn.invars)))
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else (param,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          found += _ppermutes(inner, trips * eqn.params.get("length", 1))
  return found


def test_ring_sends_n_minus_1_times_before_computing():
  """The ring's loop has n - 1 trips, each sending K and V on as they came into the trip (no
  dependence on the trip's compute, so XLA may overlap the two); the last shard is computed
  after the loop. The backward's loop has n trips, each sending K and V as they came in and
  dK, dV after adding to them (those wait for the compute)."""
  n = 4
  x = jax.ShapeDtypeStruct((1, 16, 2, 8), jnp.float32)
  ring = lambda q, k, v: seq_parallel.sequence_parallel_attention(
      q, k, v, mesh=AbstractMesh((n,), ("seq",)), strategy="ring", is_causal=True)
  forward = _ppermutes(jax.make_jaxpr(ring)(x, x, x).jaxpr)
  assert forward == [(n - 1, True)] * 2  # K and V, n - 1 hops, straight from the loop's carry
  grads = jax.make_jaxpr(jax.grad(lambda q, k, v: jnp.sum(ring(q, k, v)), argnums=(0, 1, 2)))
  both = _ppermutes(grads(x, x, x).jaxpr)
  backward = both[len(forward):]
  assert both[:len(forward)] == forward
  assert sorted(backward) == [(n, False)] * 2 + [(n, True)] * 2
