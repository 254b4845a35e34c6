"""A non-finite query, key or value through `flax_mha.confine_nonfinite(implementation)` reaches
exactly the rows that read it, in every implementation: its own query row, and the rows that see
its key; hidden keys give nothing, NaN included, forward and backward. By default (no
confinement) a hidden key's 0 · NaN spreads it to every packed document."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_mha
from flax_mha import platforms
from flax_mha.kernels import confine
from flax_mha.kernels import reference
from flax_mha.kernels import registry
from helpers import np_attention, qkv

B, T, H, G, K, V = 2, 11, 6, 3, 5, 7
R = H // G
SEGMENTS = np.array([[0] * 5 + [1] * 6, [0] * 3 + [1] * 4 + [2] * 4])
CAUSAL_SEGMENTS = ((SEGMENTS[:, None, :, None] == SEGMENTS[:, None, None, :])
                   & np.tril(np.ones((T, T), bool)))
# (array, batch, position, head, value): the bad entries, each in a different segment
BAD = (("q", 0, 1, 0, np.nan), ("k", 0, 2, 1, np.inf), ("v", 1, 4, 2, np.nan))


def _runs_here(name: str) -> bool:
  """Whether the registered kernel `name` takes this file's shapes in this process (cuDNN needs
  a GPU, ring a mesh: 'cudnn's marking' below runs cuDNN's way of marking on the oracle)."""
  spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  call = registry.Call.of(spec(B, T, H, K), spec(B, T, G, K), spec(B, T, G, V),
                          platform=platforms.backend_platform())
  return registry.get(name).refuses(call) is None


SINGLE_DEVICE = [name for name in flax_mha.IMPLEMENTATIONS if _runs_here(name)]
CUDNN_WAY = functools.partial(confine.confined, by_visibility=True)


def _inputs():
  q, k, v = qkv(np.random.default_rng(0), t=T, s=T, h=H, g=G, k=K, v=V)
  bad = {"q": q.copy(), "k": k.copy(), "v": v.copy()}
  for name, b, t, h, x in BAD:
    bad[name][b, t, h, 3] = x
  mask = CAUSAL_SEGMENTS.copy()
  mask[1, :, 3] = False  # a row that sees nothing: 0 whatever the others hold
  return (q, k, v), tuple(bad.values()), mask


def _expected_nan(mask):
  """[B, T, H]: the rows a bad entry reaches (its query row; rows that see its key)."""
  nan = np.zeros((B, T, H), bool)
  for name, b, t, h, _ in BAD:
    if name == "q":
      nan[b, t, h] = True
    else:
      nan[b, :, h * R:(h + 1) * R] |= mask[b, 0, :, t][:, None]
  return nan


def _implementation(name):
  if name == "callable":
    return flax_mha.confine_nonfinite(reference.attention)
  if name == "cudnn's marking":
    return lambda q, k, v, bias, mask, **options: CUDNN_WAY(reference.attention)(
        q, k, v, bias, mask, **options)
  return flax_mha.confine_nonfinite(name)


@pytest.mark.parametrize("name", [None, *SINGLE_DEVICE, "callable", "cudnn's marking"])
def test_bad_entries_reach_only_the_rows_that_read_them(name):
  clean, bad, mask = _inputs()
  call = functools.partial(flax_mha.dot_product_attention, mask=mask,
                           implementation=_implementation(name))
  fn = jax.jit(call)
  out = np.asarray(fn(*bad))
  nan = _expected_nan(mask)
  np.testing.assert_array_equal(np.isnan(out).any(-1), nan)
  np.testing.assert_array_equal(np.isnan(out).all(-1), nan)
  want = np_attention(*clean, mask=mask)  # other rows never see the bad entries
  np.testing.assert_allclose(out[~nan], want[~nan], atol=2e-5, rtol=2e-5)
  np.testing.assert_array_equal(out[1, 3], 0.0)
  _, lse = jax.jit(functools.partial(call, return_residual=True))(*bad)
  np.testing.assert_array_equal(np.isnan(lse), nan)
  # A loss that reads no bad row: the gradients of the clean inputs, finite everywhere.
  weights = jnp.asarray(~nan[..., None], jnp.float32)
  grads = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a)) * weights), argnums=(0, 1, 2)))
  chex.assert_tree_all_finite(grads(*bad))
  chex.assert_trees_all_close(grads(*bad), _oracle_grads("mask"), atol=1e-5, rtol=1e-5)


@functools.cache
def _oracle_grads(how: str):
  """The oracle's gradients of the loss the tests take, at the inputs with the bad entries
  set to 0: over the dense `mask`, or over the packed documents by segment ids ('segments')."""
  clean, bad, mask = _inputs()
  if how == "mask":
    nan, oracle = _expected_nan(mask), functools.partial(
        flax_mha.dot_product_attention, mask=mask, implementation="reference")
  else:
    nan, oracle = _segment_nan(), _packed("reference")
    bad = (*clean[:2], bad[2])
  weights = jnp.asarray(~nan[..., None], jnp.float32)
  loss = lambda *a: jnp.sum(jnp.sin(oracle(*a)) * weights)
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*(jnp.where(np.isfinite(x), x, 0)
                                                      for x in bad))


def _segment_nan():
  """[B, T, H]: the rows v[1, 4, 2] reaches: segment 1 of row 1 (positions 3-6), from 4 on."""
  nan = np.zeros((B, T, H), bool)
  nan[1, 4:7, 2 * R:] = True
  return nan


def _packed(implementation):
  """Attention over the packed documents by segment ids (no dense mask)."""
  return functools.partial(flax_mha.dot_product_attention, q_segment_ids=SEGMENTS,
                           kv_segment_ids=SEGMENTS, is_causal=True,
                           implementation=implementation)


def test_by_default_a_nan_value_reaches_other_documents():
  """The default's documented behaviour, which confine_nonfinite exists to avoid."""
  clean, (_, _, v), _ = _inputs()
  out = np.asarray(_packed(None)(*clean[:2], v))
  assert np.isnan(out[1, :3]).any()  # document 0 of row 1 never sees v[1, 4]


def _transformed(transform, fn):
  """fn(q, k, v) through `transform`, as a function of the same arguments."""
  if transform == "vmap":  # over a leading axis of 1
    return lambda *a: jax.vmap(fn)(*(x[None] for x in a))[0]
  if transform == "scan":  # two identical steps
    def scanned(*a):
      _, outs = jax.lax.scan(lambda c, xs: (c, fn(*xs)), 0, tuple(jnp.stack([x, x]) for x in a))
      return outs[1]
    return scanned
  if transform == "checkpoint":
    return jax.checkpoint(fn)
  return fn


@pytest.mark.parametrize("transform", ["jit", "vmap", "scan", "checkpoint"])
def test_segment_ids_keep_a_nan_in_its_segment_under_transforms(transform):
  """The packed-document case by segment ids: a NaN value of one document, under jit and
  grad always, and vmap, lax.scan or jax.checkpoint."""
  clean, (_, _, v), _ = _inputs()
  fn = jax.jit(_transformed(transform, _packed(flax_mha.confine_nonfinite())))
  out = np.asarray(fn(*clean[:2], v))
  nan = _segment_nan()
  np.testing.assert_array_equal(np.isnan(out).any(-1), nan)
  want = np_attention(*clean, mask=CAUSAL_SEGMENTS)
  np.testing.assert_allclose(out[~nan], want[~nan], atol=2e-5, rtol=2e-5)
  weights = jnp.asarray(~nan[..., None], jnp.float32)
  grads = jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a)) * weights), argnums=(0, 1, 2))
  chex.assert_trees_all_close(grads(*clean[:2], v), _oracle_grads("segments"), atol=1e-5,
                              rtol=1e-5)


def test_confine_nonfinite_refuses_an_unknown_implementation():
  with pytest.raises(ValueError, match="implementation must be None"):
    flax_mha.confine_nonfinite("nope")


def test_none_confined_stages_each_platforms_choice():
  """confine_nonfinite() lowers None's per-platform choice as None does, each branch
  confined (one program for CPU and GPU, picked at compile time)."""
  spec = jax.ShapeDtypeStruct((2, 256, 4, 8), jnp.float32)
  picks = {p: flax_mha.explain(spec, spec, spec, is_causal=True, platform=p).implementation
           for p in ("cpu", "cuda")}
  assert picks["cpu"] != picks["cuda"]
  fn = jax.jit(lambda q, k, v: flax_mha.dot_product_attention(
      q, k, v, is_causal=True, implementation=flax_mha.confine_nonfinite()))
  text = jax.export.export(fn, platforms=("cpu", "cuda"))(spec, spec, spec).mlir_module()
  assert "stablehlo.case" in text and "is_finite" in text
