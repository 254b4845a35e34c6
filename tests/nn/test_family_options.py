"""The attention options that Hugging Face families need, in both front ends: an attention
`scale`, RMSNorm qk-norm (Qwen3's, Gemma 3's one-plus, OLMo 2's across all heads), and rotary
variants through a `Rope` (llama3 and YaRN scaling, a rotated fraction, interleaved pairs).
Each against a float64 NumPy forward pass and under every implementation that takes positions;
decoded through a paged cache. The full and rolling caches and the gradients (checked numerically in float64):
test_family_options_integration.py.

Dimension key (flax_mha/__init__.py): B batch, L length, D width, H query heads, G key/value
heads, K head dim, J the rotated width. Sizes are distinct.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_mha
from flax_mha import cache as cache_lib
from flax_mha.nn import nnx as fnnx
from flax_mha.nn.options import Norm
from flax_mha.rotary import Llama3Scaling, Rope, YarnScaling
from helpers import np_attention, random_params, randn

B, L, H, G, K, D = 2, 11, 6, 3, 20, 19  # K = 20: a fraction of 1/2 rotates J = 10 (J/2 odd)
WINDOW = 4
TOL = dict(atol=3e-5, rtol=3e-5)

CASES = {
    "scale": dict(attention_options=dict(scale=0.31, rotary_max_wavelength=1e4)),
    "rms_qk": dict(normalize_qk=Norm("rms", 1e-6, use_bias=False)),
    "gemma_qk": dict(normalize_qk=Norm("rms_one_plus", 1e-6, use_bias=False)),
    "olmo2_qk": dict(normalize_qk=Norm("rms", 1e-6, use_bias=False, across_heads=True)),
    "llama3": dict(attention_options=dict(rope=Rope(5e5, Llama3Scaling(8.0, 1.0, 4.0, 8.0)))),
    "yarn": dict(attention_options=dict(rope=Rope(1e4, YarnScaling(4.0, 8.0)))),
    "partial_interleaved": dict(attention_options=dict(rope=Rope(1e4, fraction=0.5,
                                                                 interleaved=True))),
    "all": dict(normalize_qk=Norm("rms_one_plus", 1e-6, use_bias=False),
                attention_options=dict(scale=0.4, logit_soft_cap=3.0, rope=Rope(
                    1e6, Llama3Scaling(8.0, 1.0, 4.0, 8.0), fraction=0.5))),
}


def _options(case, window=None):
  opts = dict(CASES[case].get("attention_options", {}))
  if window is not None:
    opts["local_window_size"] = (window, 0)
  return flax_mha.AttentionOptions(**opts)


def shared_linen(case, window=None, **kwargs):
  return flax_mha.SelfAttention(
      num_heads=H, num_kv_heads=G, qkv_features=H * K, out_features=D, use_bias=False,
      normalize_qk=CASES[case].get("normalize_qk", False),
      attention_options=_options(case, window), **kwargs)


def _nnx(case, params, window=None):
  module = fnnx.SelfAttention(
      H, D, H * K, D, num_kv_heads=G, use_bias=False,
      normalize_qk=CASES[case].get("normalize_qk", False),
      attention_options=_options(case, window), rngs=nnx.Rngs(0))
  return fnnx.linen_params_to_nnx(module, params)


def np_rope(x, positions, rope: Rope):
  """float64 rotation of x [..., L, H, K] by `rope`'s frequencies (tested against transformers
  in tests/test_rotary_scaling_integration.py): the first J features turn in pairs (i, i + J/2),
  or (2i, 2i + 1) when interleaved; the rest pass through."""
  x = np.asarray(x, np.float64)
  freq, attention_scaling = rope.frequencies(x.shape[-1])
  j = 2 * len(freq)
  angle = np.asarray(positions, np.float64)[..., None, None] * freq  # [..., L, 1, J/2]
  cos, sin = np.cos(angle) * attention_scaling, np.sin(angle) * attention_scaling
  a, b = ((x[..., 0:j:2], x[..., 1:j:2]) if rope.interleaved else
          (x[..., :j // 2], x[..., j // 2:j]))
  ra, rb = a * cos - b * sin, b * cos + a * sin
  rotated = (np.stack([ra, rb], -1).reshape(*ra.shape[:-1], j) if rope.interleaved
             else np.concatenate([ra, rb], -1))
  return np.concatenate([rotated, x[..., j:]], -1)


def np_rms(x, scale, norm: Norm):
  """x [..., L, H, K] normalised over K, or over H·K at once with across_heads."""
  x = np.asarray(x, np.float64)
  flat = x.reshape(*x.shape[:-2], -1) if norm.across_heads else x
  normed = flat / np.sqrt((flat * flat).mean(-1, keepdims=True) + norm.epsilon)
  return (normed * (1 + scale if norm.kind == "rms_one_plus" else scale)).reshape(x.shape)


def np_forward(params, x, case, window=None):
  """The layer causal over x [B, L, D] in float64 NumPy."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params["params"])
  proj = lambda name: np.einsum("bld,dhk->blhk", np.asarray(x, np.float64), p[name]["kernel"])
  q, k, v = proj("query"), proj("key"), proj("value")
  norm = CASES[case].get("normalize_qk")
  if norm:
    q, k = np_rms(q, p["query_ln"]["scale"], norm), np_rms(k, p["key_ln"]["scale"], norm)
  opts = _options(case)
  rope = opts.rotary
  if rope is not None:
    q, k = np_rope(q, np.arange(L), rope), np_rope(k, np.arange(L), rope)
  visible = np.tril(np.ones((L, L), bool))
  if window is not None:
    visible &= np.arange(L)[None] >= np.arange(L)[:, None] - window
  out = np_attention(q, k, v, mask=visible, scale=opts.scale, soft_cap=opts.logit_soft_cap)
  return np.einsum("blhv,hvd->bld", out, p["out"]["kernel"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_linen_and_nnx_match_numpy(rng, case):
  x = randn(rng, B, L, D)
  model = shared_linen(case)
  params = random_params(model, x)
  want = np_forward(params, x, case)
  got = jax.jit(functools.partial(model.apply, is_causal=True))(params, x)
  np.testing.assert_allclose(got, want, **TOL)
  module = _nnx(case, params)
  np.testing.assert_allclose(module(x, is_causal=True), want, **TOL)


@pytest.mark.parametrize("implementation", ["reference", "xla", "chunked"])
def test_every_implementation_that_takes_positions(rng, implementation):
  """Positions restarting per packed document, the "all" case: each implementation equals the
  oracle ("rows" takes no positions and refuses them by name)."""
  x = randn(rng, B, L, D)
  positions = np.array([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6], list(range(3, 3 + L))], np.int32)
  segments = np.array([[1] * 4 + [2] * 7, [1] * L], np.int32)
  run = lambda impl: shared_linen("all", implementation=impl).apply(
      params, x, is_causal=True, positions=positions, segment_ids=segments)
  params = random_params(shared_linen("all"), x)
  np.testing.assert_allclose(run(implementation), run("reference"), **TOL)


def _decode(model, params, x, cache, chunk=1):
  """The layer over x [B, L, D] a chunk at a time through `cache`: [B, L, D]."""
  step = jax.jit(lambda c, x_t: model.apply(params, x_t, cache=c))
  outs = []
  for start in range(0, L, chunk):
    out, cache = step(cache, x[:, start:start + chunk])
    outs.append(out)
  return jnp.concatenate(outs, axis=1)


def decoded_equals_full(rng, case, kind):
  """Decoding `case` two tokens a step through a full, rolling or paged cache gives the full
  causal call's output (the NumPy forward)."""
  x = randn(rng, B, L, D)
  window = WINDOW if kind == "rolling" else None
  model = shared_linen(case, window)
  params = random_params(model, x)
  want = np_forward(params, x, case, window)
  if kind == "paged":
    pages = np.arange(2 * 3, dtype=np.int32).reshape(B, 3)  # 3 pages of 4 slots a row
    cache = cache_lib.PagedKVCache.create(2 * 3, 4, pages, G, K)
  else:
    cache = model.new_cache(B, L, in_features=D)
  np.testing.assert_allclose(_decode(model, params, x, cache, chunk=2), want, **TOL)


def test_cached_decoding_equals_the_full_causal_call(rng):
  """The paged cache with every option; the other caches and cases:
  test_family_options_integration.py."""
  decoded_equals_full(rng, "all", "paged")


def test_bad_options_are_refused_by_name():
  with pytest.raises(ValueError, match="give rotary_max_wavelength or rope, not both"):
    flax_mha.AttentionOptions(rotary_max_wavelength=1e4, rope=Rope())
  with pytest.raises(TypeError, match="rope must be a flax_mha.rotary.Rope"):
    flax_mha.AttentionOptions(rope=1e4)
  with pytest.raises(ValueError, match="scale"):
    flax_mha.AttentionOptions(scale=-1.0)
  with pytest.raises(TypeError, match="normalize_qk must be a bool or a flax_mha.Norm"):
    shared_linen("scale").clone(normalize_qk="rms").init(jax.random.key(0), jnp.ones((B, L, D)))
  with pytest.raises(ValueError, match="Norm.kind must be one of"):
    Norm("batch")
  with pytest.raises(ValueError, match="Norm.use_bias is a LayerNorm's"):
    Norm("rms", use_bias=True)
  assert Norm("rms") == Norm("rms", 1e-6, use_bias=False) and Norm().use_bias
  with pytest.raises(ValueError, match=r"rotary_max_wavelength needs an even qk head dim K.*"
                                       r"got J = int\(9 \* 0.33+\d*\) = 3"):
    flax_mha.SelfAttention(num_heads=2, qkv_features=18, attention_options=flax_mha.AttentionOptions(
        rope=Rope(fraction=1 / 3))).init(jax.random.key(0), jnp.ones((1, 3, 5)))
