"""flax_mha.rotary's Hugging Face variants (a `Rope` record: scaled frequencies, partial rotation,
interleaved pairs) against a float64 NumPy reference written here pair by pair from the formulas
(against transformers' own rotary code: tests/test_rotary_scaling_integration.py).

Dimension key (flax_mha/__init__.py): B batch, T length, H heads, K head dim; J the rotated width.
Sizes are distinct (K/2 = 12, and J/2 = 6 or 3 when partial), so a swapped axis fails.
"""

import dataclasses
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import test_util

from flax_mha.rotary import (LinearScaling, Llama3Scaling, LongRopeScaling, Rope, YarnScaling,
                             apply_rotary)
from helpers import np_rotary, randn

B, T, H, K = 2, 5, 7, 24

# Bases and trained lengths put K/2 = 12 frequencies in every band: Llama 3's wavelengths
# 2π·10⁴^(i/12) are < 128 for i <= 3 (kept), in [128, 512] for i = 4, 5 (mixed), > 512 beyond
# (divided); YaRN's ramp over pairs runs from 1 to 6.
CASES = {
    "default": Rope(),
    "base500": Rope(500.0),
    "linear": Rope(scaling=LinearScaling(4.0)),
    "llama3": Rope(scaling=Llama3Scaling(8.0, 1.0, 4.0, 512)),
    "yarn": Rope(scaling=YarnScaling(4.0, 512)),
    "yarn_deepseek": Rope(scaling=YarnScaling(40.0, 512, mscale=1.0, mscale_all_dim=0.5)),
    "yarn_no_truncate": Rope(scaling=YarnScaling(3.0, 512, beta_fast=16, beta_slow=2,
                                                 truncate=False)),
    "yarn_attention_factor": Rope(scaling=YarnScaling(4.0, 512, attention_factor=0.75)),
    "half": Rope(fraction=0.5),
    "quarter": Rope(fraction=0.25),
    "interleaved": Rope(interleaved=True),
    "glm": Rope(fraction=0.5, interleaved=True),
    "all": Rope(2000.0, YarnScaling(4.0, 256), fraction=0.5, interleaved=True),
}


# ---------------------------------------------------------------------------------------------
# The float64 reference, one frequency and one pair at a time.

def np_llama3(f, factor, low, high, context):
  wavelength = 2 * math.pi / f
  if wavelength < context / high:
    return f
  if wavelength > context / low:
    return f / factor
  smooth = (context / wavelength - low) / (high - low)
  return (1 - smooth) * f / factor + smooth * f


def np_yarn_ramp(i, j, base, s):
  """0 (keep the frequency) to 1 (divide it by the factor) over the pair index i."""
  def dim(turns):
    return j * math.log(s.original_max_position_embeddings / (turns * 2 * math.pi)) / (
        2 * math.log(base))
  lo, hi = dim(s.beta_fast), dim(s.beta_slow)
  if s.truncate:
    lo, hi = math.floor(lo), math.ceil(hi)
  lo, hi = max(lo, 0), min(hi, j - 1)
  hi = hi + 0.001 if lo == hi else hi
  return min(max((i - lo) / (hi - lo), 0.0), 1.0)


def np_yarn_attention(s):
  if s.attention_factor is not None:
    return s.attention_factor
  def m(c):
    return 1.0 if s.factor <= 1 else 0.1 * c * math.log(s.factor) + 1.0
  return m(s.mscale) / m(s.mscale_all_dim) if s.mscale and s.mscale_all_dim else m(1.0)


def np_frequencies(rope, k, long=False):
  """(inv_freq [J/2], attention scaling) in float64."""
  j = int(k * rope.fraction)
  s, freqs = rope.scaling, []
  for i in range(j // 2):
    f = 1.0 / rope.max_wavelength ** (2.0 * i / j)
    if isinstance(s, LinearScaling):
      f = f / s.factor
    elif isinstance(s, Llama3Scaling):
      f = np_llama3(f, s.factor, s.low_freq_factor, s.high_freq_factor,
                    s.original_max_position_embeddings)
    elif isinstance(s, YarnScaling):
      ramp = np_yarn_ramp(i, j, rope.max_wavelength, s)
      f = ramp * f / s.factor + (1 - ramp) * f
    elif isinstance(s, LongRopeScaling):
      f = f / (s.long_factor if long else s.short_factor)[i]
    freqs.append(f)
  if isinstance(s, LongRopeScaling):
    return np.array(freqs), (s.attention_factor or math.sqrt(
        1 + math.log(s.factor) / math.log(s.original_max_position_embeddings)))
  return np.array(freqs), (np_yarn_attention(s) if isinstance(s, YarnScaling) else 1.0)


def np_rope(x, positions, rope, long=False):
  """x [..., T, H, K] turned pair by pair; features from J on pass through; long: LongRoPE's
  long factors."""
  x = np.asarray(x, np.float64)
  k = x.shape[-1]
  freqs, scale = np_frequencies(rope, k, long)
  j = 2 * len(freqs)
  pairs = ([(2 * i, 2 * i + 1) for i in range(j // 2)] if rope.interleaved
           else [(i, i + j // 2) for i in range(j // 2)])
  pos = np.asarray(positions, np.float64)[..., None]  # [..., T, 1]
  out = np.array(np.broadcast_to(x, np.broadcast_shapes(x.shape, pos.shape + (1,))))
  for f, (a, b) in zip(freqs, pairs):
    cos, sin = scale * np.cos(pos * f), scale * np.sin(pos * f)
    out[..., a] = cos * x[..., a] - sin * x[..., b]
    out[..., b] = sin * x[..., a] + cos * x[..., b]
  return out


def test_reference_matches_np_rotary(rng):
  """The reference of the default Rope is the older, independent np_rotary."""
  x, positions = randn(rng, T, H, K), rng.integers(0, 99, T)
  np.testing.assert_allclose(np_rope(x, positions, Rope(500.0)), np_rotary(x, positions, 500.0),
                             rtol=0, atol=1e-13)


# ---------------------------------------------------------------------------------------------
# Against the reference.

@pytest.mark.parametrize("name", CASES)
def test_frequencies_match_numpy(name):
  freq, scale = CASES[name].frequencies(K)
  want_freq, want_scale = np_frequencies(CASES[name], K)
  np.testing.assert_allclose(freq, want_freq, rtol=1e-13)
  assert scale == pytest.approx(want_scale, rel=1e-13)


def test_frequency_bands_are_all_reached():
  """The cases above exercise every branch: Llama 3 keeps, mixes and divides; YaRN ramps."""
  base = Rope().frequencies(K)[0]
  ratio = base / CASES["llama3"].frequencies(K)[0]
  assert ratio[0] == 1 and ratio[-1] == 8 and np.any((ratio > 1) & (ratio < 8))
  ratio = base / CASES["yarn"].frequencies(K)[0]
  assert ratio[0] == 1 and ratio[-1] == 4 and np.any((ratio > 1) & (ratio < 4))
  assert CASES["yarn"].frequencies(K)[1] == pytest.approx(0.1 * math.log(4) + 1)


@pytest.mark.parametrize("name", CASES)
def test_matches_numpy(rng, variant, name):
  rope = CASES[name]
  x = randn(rng, B, T, H, K)
  positions = rng.permutation(60)[:B * T].reshape(B, T).astype(np.int32)
  fn = variant(chex.assert_max_traces(rope.apply, n=1))
  out = fn(jnp.asarray(x), jnp.asarray(positions))  # positions traced under jit
  chex.assert_shape(out, x.shape)
  chex.assert_type(out, jnp.float32)
  np.testing.assert_allclose(out, np_rope(x, positions, rope), atol=2e-5)


@pytest.mark.parametrize("name", ["linear", "yarn_deepseek", "glm", "all"])
def test_float64(rng, name):
  x = randn(rng, B, T, H, K, dtype=np.float64)
  positions = 1000 + rng.permutation(9 * T)[:T]
  with jax.enable_x64(True):
    out = jax.jit(CASES[name].apply)(jnp.asarray(x), jnp.asarray(positions))
    chex.assert_type(out, jnp.float64)
    np.testing.assert_allclose(out, np_rope(x, positions, CASES[name]), atol=1e-12, rtol=0)


def test_bfloat16_keeps_dtype_and_positions(rng):
  rope = CASES["all"]
  x = jnp.asarray(randn(rng, B, T, H, K), jnp.bfloat16)
  positions = 5000 + np.arange(T)  # bfloat16 would round all of these to 5000 or 5024
  out = jax.jit(rope.apply)(x, positions)
  chex.assert_type(out, jnp.bfloat16)
  np.testing.assert_allclose(out.astype(np.float32), np_rope(x, positions, rope), atol=3e-2)


def test_default_rope_is_apply_rotary(rng):
  x, positions = randn(rng, B, T, H, K), rng.integers(0, 300, (B, T))
  np.testing.assert_array_equal(apply_rotary(x, positions, rope=Rope()),
                                apply_rotary(x, positions))
  np.testing.assert_array_equal(Rope(500.0).apply(x, positions),
                                apply_rotary(x, positions, max_wavelength=500.0))


@pytest.mark.parametrize("name", ["half", "quarter", "glm", "all"])
def test_partial_passes_the_rest_through(rng, name):
  x = randn(rng, B, T, H, K)
  out = CASES[name].apply(x, rng.integers(1, 300, (B, T)))
  j = int(K * CASES[name].fraction)
  np.testing.assert_array_equal(out[..., j:], x[..., j:])
  assert np.abs(out[..., :j] - x[..., :j]).max() > 0.1


@pytest.mark.parametrize("name", ["llama3", "glm", "all"])
def test_relative_position(rng, name):
  """<rot(q, m), rot(k, n)> depends only on m - n, for every variant."""
  rope, s = CASES[name], 11
  q, k = randn(rng, T, H, K), randn(rng, s, H, K)
  m, n = rng.permutation(40)[:T], rng.permutation(40)[:s]
  rot = jax.jit(rope.apply)

  def logits_HTS(shift_q, shift_k):
    return jnp.einsum("THK,SHK->HTS", rot(q, m + shift_q), rot(k, n + shift_k))

  base = logits_HTS(0, 0)
  np.testing.assert_allclose(logits_HTS(37, 37), base, atol=2e-4, rtol=1e-4)
  assert np.abs(logits_HTS(3, 0) - base).max() > 0.1


@pytest.mark.parametrize("name", ["yarn_deepseek", "all"])
def test_gradient(rng, name):
  x = randn(rng, T, H, K, dtype=np.float64)
  positions = rng.integers(0, 300, T)
  with jax.enable_x64(True):
    test_util.check_grads(lambda x: CASES[name].apply(x, positions), (jnp.asarray(x),), order=1,
                          modes=("fwd", "rev"))
    # The rotation is linear in x, so d/dx <rot(x), g> is the reference applied to g^T.
    g = randn(rng, T, H, K, dtype=np.float64)
    grad = jax.grad(lambda x: jnp.sum(CASES[name].apply(x, positions) * g))(jnp.asarray(x))
    eye = np.eye(K)[:, None, None, :] * np.ones((K, T, H, 1))  # [K (basis), T, H, K]
    columns = np_rope(eye, positions, CASES[name])  # column e of the map: rot(e_e)
    np.testing.assert_allclose(grad, np.einsum("eTHk,THk->THe", columns, g), atol=1e-12)


@pytest.mark.parametrize("name", ["llama3", "glm", "all"])
def test_vmap_matches_batched_call(rng, name):
  rope = CASES[name]
  x, positions = randn(rng, B, T, H, K), rng.integers(0, 100, (B, T))
  np.testing.assert_allclose(jax.vmap(rope.apply)(x, positions), rope.apply(x, positions),
                             atol=1e-6)
  np.testing.assert_allclose(jax.vmap(rope.apply, in_axes=(0, None))(x, positions[0]),
                             rope.apply(x, positions[0]), atol=1e-6)


def test_rope_is_one_static_hashable_record(rng):
  """Equal records hash alike, so a module attribute or a static argument retraces only when
  an option changes."""
  same = Rope(500.0, Llama3Scaling(8.0, 1.0, 4.0, 512), 0.5, True)
  assert same == dataclasses.replace(CASES["llama3"], max_wavelength=500.0, fraction=0.5,
                                     interleaved=True)
  assert hash(same) == hash(Rope(500.0, Llama3Scaling(8, 1, 4, 512), 0.5, True))
  x, positions = randn(rng, T, H, K), np.arange(T)
  fn = jax.jit(chex.assert_max_traces(apply_rotary, n=2), static_argnames="rope")
  fn(x, positions, rope=same)
  fn(x, positions, rope=Rope(500.0, Llama3Scaling(8.0, 1.0, 4.0, 512), 0.5, True))
  fn(x, positions, rope=Rope(500.0))  # a second trace; a third would fail


LONG = LongRopeScaling(tuple(1.0 + 0.25 * i for i in range(K // 2)),
                       tuple(3.0 + 2.0 * i for i in range(K // 2)), 16, factor=8.0)


@pytest.mark.parametrize("jit", [False, True])
def test_longrope_turns_each_row_by_its_own_largest_position(rng, jit):
  """Row 0 stays within the original context (largest position 15: 16 tokens), row 1 passes
  it (16): short and long factors, each row by its own, traced positions alike; cos and sin
  scaled by sqrt(1 + ln 8 / ln 16)."""
  rope = Rope(scaling=LONG)
  x = randn(rng, B, T, H, K)
  positions = np.stack([np.arange(11, 16), np.arange(12, 17)])
  apply = jax.jit(rope.apply) if jit else rope.apply
  got = np.asarray(apply(x, positions))
  np.testing.assert_allclose(got[0], np_rope(x[0], positions[0], rope), atol=1e-5)
  np.testing.assert_allclose(got[1], np_rope(x[1], positions[1], rope, long=True), atol=1e-5)
  assert rope.frequencies(K)[1] == pytest.approx(math.sqrt(1 + math.log(8) / math.log(16)))
  one = np.asarray(apply(x[:, -1:], positions[:, -1:]))  # a decode step: its own position
  np.testing.assert_allclose(one, got[:, -1:], atol=1e-6)


# ---------------------------------------------------------------------------------------------
# From a Hugging Face config dict.

LLAMA31 = {"rope_theta": 500000.0, "head_dim": 128, "max_position_embeddings": 131072,
           "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
FROM_HF = [
    ("llama31", LLAMA31, 128, {}, Rope(500000.0, Llama3Scaling(8.0, 1.0, 4.0, 8192))),
    ("scaling dict alone", dict(LLAMA31["rope_scaling"], rope_theta=5e5), 128, {},
     Rope(5e5, Llama3Scaling(8.0, 1.0, 4.0, 8192))),
    ("no rope keys", {"hidden_size": 64}, 16, {}, Rope()),
    ("qwen yarn, old 'type'", {"rope_theta": 1e6, "max_position_embeddings": 32768,
                               "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": 32768}},
     128, {}, Rope(1e6, YarnScaling(4.0, 32768))),
    ("yarn context from max_position_embeddings, None betas as HF",
     {"max_position_embeddings": 4096,
      "rope_parameters": {"rope_type": "yarn", "factor": 2, "beta_fast": None, "mscale": 1,
                          "mscale_all_dim": 1}},
     64, {}, Rope(scaling=YarnScaling(2, 4096, mscale=1, mscale_all_dim=1))),
    ("phi3: the top-level context wins", {"original_max_position_embeddings": 4096,
                                          "rope_scaling": {"type": "yarn", "factor": 32.0,
                                                           "original_max_position_embeddings": 1}},
     96, {}, Rope(scaling=YarnScaling(32.0, 4096))),
    ("v5 rope_parameters", {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     64, {}, Rope(scaling=LinearScaling(2.0), fraction=0.5)),
    ("neox rotary_pct", {"rotary_pct": 0.25, "rope_theta": 10000}, 128, {}, Rope(fraction=0.25)),
    ("phi partial_rotary_factor", {"partial_rotary_factor": 0.4}, 80, {}, Rope(fraction=0.4)),
    ("gptj rotary_dim", {"rotary_dim": 64}, 256, {"interleaved": True},
     Rope(fraction=0.25, interleaved=True)),
    ("glm", {"partial_rotary_factor": 0.5, "rope_theta": 10000.0}, 128, {"interleaved": True},
     Rope(fraction=0.5, interleaved=True)),
    ("phi3 longrope: factor from the contexts", {
        "original_max_position_embeddings": 4096, "max_position_embeddings": 131072,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.5], "long_factor": [2, 3]}},
     4, {}, Rope(scaling=LongRopeScaling((1.0, 1.5), (2.0, 3.0), 4096, factor=32.0))),
    ("per layer type", {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                               "rope_theta": 1e6},
                                            "sliding_attention": {"rope_type": "default",
                                                                  "rope_theta": 1e4}}},
     256, {"layer_type": "full_attention"}, Rope(1e6, LinearScaling(8.0))),
]


@pytest.mark.parametrize("name,config,head_dim,kwargs,want", FROM_HF,
                         ids=[c[0] for c in FROM_HF])
def test_from_hf(name, config, head_dim, kwargs, want):
  assert Rope.from_hf(config, head_dim, **kwargs) == want


# ---------------------------------------------------------------------------------------------
# Refused by name.

X = np.ones((T, H, K), np.float32)
POS = np.arange(T)
BAD_ROPE = [
    # (name, constructor, error, match)
    ("fraction zero", lambda: Rope(fraction=0.0), ValueError,
     r"fraction must be a finite number in \(0, 1\], got 0\.0"),
    ("fraction above one", lambda: Rope(fraction=1.5), ValueError, r"fraction .*got 1\.5"),
    ("fraction negative", lambda: Rope(fraction=-0.5), ValueError, r"fraction .*got -0\.5"),
    ("fraction str", lambda: Rope(fraction="0.5"), TypeError, r"fraction must be .*got str"),
    ("max_wavelength zero", lambda: Rope(0.0), ValueError, r"max_wavelength .*> 0, got 0\.0"),
    ("interleaved int", lambda: Rope(interleaved=1), TypeError,
     r"interleaved must be a bool, got int 1"),
    ("scaling dict", lambda: Rope(scaling={"rope_type": "linear", "factor": 2.0}), TypeError,
     (r"scaling must be None or one of \['LinearScaling', 'Llama3Scaling', 'YarnScaling', "
      r"'LongRopeScaling'\], got dict")),
    ("linear factor zero", lambda: LinearScaling(0.0), ValueError,
     r"LinearScaling\.factor must be a finite number > 0, got 0\.0"),
    ("linear factor negative", lambda: LinearScaling(-2), ValueError,
     r"LinearScaling\.factor .*got -2"),
    ("llama3 factor zero", lambda: Llama3Scaling(0, 1.0, 4.0, 8192), ValueError,
     r"Llama3Scaling\.factor .*got 0"),
    ("llama3 high <= low", lambda: Llama3Scaling(8.0, 4.0, 4.0, 8192), ValueError,
     r"Llama3Scaling\.high_freq_factor must be a finite number > 4\.0, got 4\.0"),
    ("llama3 context", lambda: Llama3Scaling(8.0, 1.0, 4.0, 0), ValueError,
     r"Llama3Scaling\.original_max_position_embeddings .*got 0"),
    ("yarn factor negative", lambda: YarnScaling(-4.0, 4096), ValueError,
     r"YarnScaling\.factor .*got -4\.0"),
    ("yarn betas swapped", lambda: YarnScaling(4.0, 4096, beta_fast=1, beta_slow=32), ValueError,
     r"YarnScaling\.beta_fast must be a finite number >= 32, got 1"),
    ("yarn attention_factor", lambda: YarnScaling(4.0, 4096, attention_factor=0.0), ValueError,
     r"YarnScaling\.attention_factor .*got 0\.0"),
    ("yarn truncate", lambda: YarnScaling(4.0, 4096, truncate="yes"), TypeError,
     r"YarnScaling\.truncate must be a bool, got str"),
    # apply_rotary
    ("odd rotated width", lambda: Rope(fraction=0.25).apply(np.ones((T, H, 20)), POS),
     ValueError,
     r"even rotated width J = int\(K \* fraction\) > 0, got J = int\(20 \* 0\.25\) = 5"),
    ("nothing rotated", lambda: Rope(fraction=0.01).apply(X, POS), ValueError,
     r"int\(24 \* 0\.01\) = 0"),
    ("odd K", lambda: Rope(interleaved=True).apply(np.ones((T, H, 7), np.float32), POS),
     ValueError, r"apply_rotary needs an even head dim K, got K=7"),
    ("rope and max_wavelength", lambda: apply_rotary(X, POS, max_wavelength=500.0, rope=Rope()),
     ValueError, r"give max_wavelength or rope, not both.*max_wavelength=500\.0"),
    ("rope not a Rope", lambda: apply_rotary(X, POS, rope={"fraction": 0.5}), TypeError,
     r"rope must be a flax_mha\.rotary\.Rope or None, got dict"),
    # from_hf
    ("dynamic", lambda: Rope.from_hf({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, 64),
     ValueError,
     (r"rope scaling type 'dynamic' is not supported; supported: "
      r"\['default', 'linear', 'llama3', 'yarn', 'longrope'\]")),
    ("longrope factors too few",
     lambda: Rope(scaling=LongRopeScaling((1.0,) * 5, (2.0,) * 12, 8)).apply(X, POS),
     ValueError, r"LongRopeScaling\.short_factor must hold one factor per rotated frequency "
                 r"\(J/2 = 12\), got 5"),
    ("longrope factor not positive", lambda: LongRopeScaling((1.0, 0.0), (1.0, 1.0), 8),
     ValueError, r"LongRopeScaling\.short_factor\[1\]"),
    ("longrope factors not a list", lambda: LongRopeScaling(2.0, (1.0,), 8), TypeError,
     r"LongRopeScaling\.short_factor must be a sequence of numbers, got float"),
    ("longrope without its factors",
     lambda: Rope.from_hf({"rope_type": "longrope", "short_factor": [1.0]}, 64), ValueError,
     r"rope scaling 'longrope' needs \['long_factor', 'original_max_position_embeddings'\]"),
    ("missing key", lambda: Rope.from_hf({"rope_type": "llama3", "factor": 8.0}, 64), ValueError,
     (r"rope scaling 'llama3' needs \['low_freq_factor', 'high_freq_factor', "
      r"'original_max_position_embeddings'\]")),
    ("unknown key", lambda: Rope.from_hf({"rope_type": "linear", "factor": 2.0, "beta": 1}, 64),
     ValueError, r"rope scaling 'linear' has no parameters \['beta'\]"),
    ("bad factor", lambda: Rope.from_hf({"rope_type": "linear", "factor": 0}, 64), ValueError,
     r"LinearScaling\.factor .*got 0"),
    ("odd width from hf", lambda: Rope.from_hf({"partial_rotary_factor": 0.25}, 20), ValueError,
     r"int\(20 \* 0\.25\) = 5"),
    ("rotary_dim not a share", lambda: Rope.from_hf({"rotary_dim": 300}, 256), ValueError,
     r"fraction .*got 1\.17"),
    ("per layer without layer_type",
     lambda: Rope.from_hf({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, 64),
     ValueError, r"rope_parameters is per layer type \['full_attention'\]: pass layer_type"),
    ("unknown layer_type",
     lambda: Rope.from_hf({"rope_parameters": {"a": {}}}, 64, layer_type="b"), ValueError,
     r"layer_type 'b' is not in rope_parameters \['a'\]"),
    ("config not a dict", lambda: Rope.from_hf([("rope_theta", 1e4)], 64), TypeError,
     r"config must be a dict, got list"),
    ("head_dim float", lambda: Rope.from_hf({}, 64.0), TypeError,
     r"head_dim must be a positive int, got float"),
]


@pytest.mark.parametrize("name,make,error,match", BAD_ROPE, ids=[b[0] for b in BAD_ROPE])
def test_bad_input(name, make, error, match):
  with pytest.raises(error, match=match):
    make()
