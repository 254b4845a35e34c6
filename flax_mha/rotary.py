"""Rotary position embedding (RoPE, Su et al. 2021, arXiv:2104.09864) and the variants Hugging Face
checkpoints need: frequency scaling (linear, Llama 3, YaRN, LongRoPE), partial rotation and the
interleaved pairing.

Shapes use the dimension key in `flax_mha/__init__.py`: T length, H heads, K head dim; here also
J = int(K * fraction), the rotated width (J/2 frequencies; the last K - J features pass through).

A `Rope` record holds every option. It is frozen and hashable, so a module carries it as one
attribute and `jit` treats it as static; only x and positions are traced.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from flax_mha import checks


@dataclasses.dataclass(frozen=True)
class LinearScaling:
  """Position interpolation (HF `rope_type="linear"`): every frequency divided by `factor`, the
  same as positions / factor, so `factor` times the trained length maps onto the trained angles."""
  factor: float

  def __post_init__(self):
    checks.check_positive_real("LinearScaling.factor", self.factor)

  def scale(self, freq, max_wavelength: float):
    """(scaled freq [J/2], attention scaling) from the unscaled float64 freq [J/2]."""
    del max_wavelength  # the same factor for every frequency
    return freq / self.factor, 1.0


@dataclasses.dataclass(frozen=True)
class Llama3Scaling:
  """Llama 3.1's scaling (HF `rope_type="llama3"`): with c = original_max_position_embeddings,
  wavelengths 2π/freq below c / high_freq_factor (they turn many times within the trained
  length) are kept, those above c / low_freq_factor are divided by `factor`, and in between the
  two mix as freq·((1 - w) / factor + w) with w = (c / wavelength - low) / (high - low)."""
  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: float

  def __post_init__(self):
    for name in ("factor", "low_freq_factor", "original_max_position_embeddings"):
      checks.check_positive_real(f"Llama3Scaling.{name}", getattr(self, name))
    checks.check_real("Llama3Scaling.high_freq_factor", self.high_freq_factor,
                      above=self.low_freq_factor)

  def scale(self, freq, max_wavelength: float):
    """(scaled freq [J/2], attention scaling) from the unscaled float64 freq [J/2]."""
    del max_wavelength  # the bands are set by the wavelengths alone
    wavelength, c = 2 * np.pi / freq, self.original_max_position_embeddings
    low, high = self.low_freq_factor, self.high_freq_factor
    w = (c / wavelength - low) / (high - low)
    mixed = freq * ((1 - w) / self.factor + w)
    out = np.where(wavelength > c / low, freq / self.factor, mixed)
    return np.where(wavelength < c / high, freq, out), 1.0


@dataclasses.dataclass(frozen=True)
class YarnScaling:
  """YaRN (Peng et al. 2023, arXiv:2309.00071; HF `rope_type="yarn"`): frequency i is kept when
  it turns more than beta_fast times within original_max_position_embeddings, divided by `factor`
  when it turns fewer than beta_slow times, with a linear ramp over i in between; cos and sin
  are multiplied by an attention scaling (so the logits by its square), `attention_factor` when
  given, else 0.1·ln(factor) + 1, or DeepSeek's ratio of that with `mscale` and
  `mscale_all_dim` when both are given. `truncate` rounds the ramp's ends outwards to integers."""
  factor: float
  original_max_position_embeddings: float
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: float | None = None
  mscale: float | None = None
  mscale_all_dim: float | None = None
  truncate: bool = True

  def __post_init__(self):
    for name in ("factor", "original_max_position_embeddings", "beta_slow"):
      checks.check_positive_real(f"YarnScaling.{name}", getattr(self, name))
    checks.check_real("YarnScaling.beta_fast", self.beta_fast, lowest=self.beta_slow)
    checks.check_positive_real("YarnScaling.attention_factor", self.attention_factor,
                               optional=True)
    for name in ("mscale", "mscale_all_dim"):
      if getattr(self, name) is not None:
        checks.check_real(f"YarnScaling.{name}", getattr(self, name), lowest=0)
    _check_bool("YarnScaling.truncate", self.truncate)

  def scale(self, freq, max_wavelength: float):
    """(scaled freq [J/2], attention scaling) from the unscaled float64 freq [J/2]."""
    low, high = self._ramp_ends(2 * freq.size, max_wavelength)
    ramp = np.clip((np.arange(freq.size) - low) / (high - low), 0, 1)  # 1: interpolate
    return freq / self.factor * ramp + freq * (1 - ramp), self.attention_scaling()

  def _ramp_ends(self, j: int, max_wavelength: float):
    """The feature-pair indices where the ramp starts and ends, for J rotated features."""
    def index(turns):  # the i whose wavelength fits `turns` times in the trained length
      ratio = self.original_max_position_embeddings / (turns * 2 * math.pi)
      return j * math.log(ratio) / (2 * math.log(max_wavelength))
    low, high = index(self.beta_fast), index(self.beta_slow)
    if self.truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, j - 1)
    return low, (high + 0.001 if low == high else high)  # as HF: no division by zero

  def attention_scaling(self) -> float:
    """The factor on cos and sin."""
    if self.attention_factor is not None:
      return float(self.attention_factor)

    def mscale(m):
      return 1.0 if self.factor <= 1 else 0.1 * m * math.log(self.factor) + 1.0
    if self.mscale and self.mscale_all_dim:
      return mscale(self.mscale) / mscale(self.mscale_all_dim)
    return mscale(1.0)


@dataclasses.dataclass(frozen=True)
class LongRopeScaling:
  """LongRoPE (Ding et al. 2024, arXiv:2402.13753; HF `rope_type="longrope"`, Phi-3 and Phi-4):
  frequency i divided by short_factor[i], or by long_factor[i] in a call whose positions pass
  original_max_position_embeddings (the largest position + 1 above it); cos and sin multiplied
  by `attention_factor` when given, else sqrt(1 + ln(factor) / ln(original_max_position_
  embeddings)) (1 for a factor <= 1), factor being the checkpoint's context over the original.

  transformers picks the factors once per call for the whole batch, by its largest position:
  here each row picks by its own (the last axis of positions), so a row's angles never depend
  on the rows beside it; the two agree whenever a batch's rows are alike, as in `generate`'s
  decode steps of equal-length prompts. Keys already cached keep the angles they were written
  with, as in transformers."""
  short_factor: tuple
  long_factor: tuple
  original_max_position_embeddings: float
  factor: float = 1.0
  attention_factor: float | None = None

  def __post_init__(self):
    for name in ("short_factor", "long_factor"):
      value = getattr(self, name)
      if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise TypeError(f"LongRopeScaling.{name} must be a sequence of numbers, got "
                        f"{type(value).__name__}")
      for i, f in enumerate(value):
        checks.check_positive_real(f"LongRopeScaling.{name}[{i}]", f)
      object.__setattr__(self, name, tuple(float(f) for f in value))  # hashable
    checks.check_positive_real("LongRopeScaling.original_max_position_embeddings",
                               self.original_max_position_embeddings)
    checks.check_positive_real("LongRopeScaling.factor", self.factor)
    checks.check_positive_real("LongRopeScaling.attention_factor", self.attention_factor,
                               optional=True)

  def _divide(self, freq, name: str):
    factors = getattr(self, name)
    if len(factors) != freq.size:
      raise ValueError(f"LongRopeScaling.{name} must hold one factor per rotated frequency "
                       f"(J/2 = {freq.size}), got {len(factors)}")
    return freq / np.asarray(factors, np.float64)

  def scale(self, freq, max_wavelength: float):
    """(the short freq [J/2], attention scaling) from the unscaled float64 freq [J/2]."""
    del max_wavelength
    return self._divide(freq, "short_factor"), self.attention_scaling()

  def long(self, freq):
    """The long freq [J/2]: a call past original_max_position_embeddings."""
    return self._divide(freq, "long_factor")

  def attention_scaling(self) -> float:
    if self.attention_factor is not None:
      return float(self.attention_factor)
    if self.factor <= 1:
      return 1.0
    return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_position_embeddings))


# HF's `rope_type` -> the record; "default" is no scaling. Others ("dynamic", ...) depend on
# the sequence length in ways a cache cannot keep, and are refused.
SCALINGS = {"linear": LinearScaling, "llama3": Llama3Scaling, "yarn": YarnScaling,
            "longrope": LongRopeScaling}
_HF_ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}


@dataclasses.dataclass(frozen=True)
class Rope:
  """Every rotary option in one static, hashable record.

  Attributes:
    max_wavelength: the base of the frequencies (HF's `rope_theta`), a finite number > 0:
      freq[i] = max_wavelength ** (-2i / J), i in [0, J/2).
    scaling: None, or a `LinearScaling`, `Llama3Scaling`, `YarnScaling` or `LongRopeScaling`
      applied to freq.
    fraction: the rotated share of the head dim (HF's `partial_rotary_factor`), in (0, 1]:
      the first J = int(K * fraction) features are rotated (J even), the rest pass through.
    interleaved: pair feature 2i with 2i + 1 (GPT-J, Cohere, GLM, the paper) instead of i with
      i + J/2 (Llama, Gemma, GPT-NeoX: HF's `rotate_half`).
  """
  max_wavelength: float = 10_000.0
  scaling: LinearScaling | Llama3Scaling | YarnScaling | LongRopeScaling | None = None
  fraction: float = 1.0
  interleaved: bool = False

  def __post_init__(self):
    checks.check_positive_real("max_wavelength", self.max_wavelength)
    if self.scaling is not None and not isinstance(self.scaling, tuple(SCALINGS.values())):
      raise TypeError(f"scaling must be None or one of {[c.__name__ for c in SCALINGS.values()]}"
                      f", got {type(self.scaling).__name__}")
    checks.check_real("fraction", self.fraction, above=0, highest=1)
    _check_bool("interleaved", self.interleaved)

  def rotated_width(self, head_dim: int) -> int:
    """J = int(head_dim * fraction), as HF truncates it; raises unless J is even and > 0."""
    j = int(head_dim * self.fraction)
    if self.fraction == 1 and j % 2:
      raise ValueError(f"apply_rotary needs an even head dim K, got K={head_dim}")
    if j % 2 or j == 0:
      raise ValueError(
          f"apply_rotary needs an even rotated width J = int(K * fraction) > 0, got "
          f"J = int({head_dim} * {self.fraction}) = {j}")
    return j

  def _unscaled(self, head_dim: int):
    j = self.rotated_width(head_dim)
    return np.asarray(self.max_wavelength, np.float64) ** (-2.0 * np.arange(j // 2) / j)

  def frequencies(self, head_dim: int):
    """(freq [J/2] float64, attention scaling): HF's (inv_freq, attention_scaling)."""
    freq = self._unscaled(head_dim)
    if self.scaling is None:
      return freq, 1.0
    return self.scaling.scale(freq, self.max_wavelength)

  def long_frequencies(self, head_dim: int):
    """LongRoPE's freq [J/2] float64 for a row whose positions pass the original context
    (`LongRopeScaling`); None for every other scaling."""
    if not isinstance(self.scaling, LongRopeScaling):
      return None
    return self.scaling.long(self._unscaled(head_dim))

  def apply(self, x, positions):
    """`apply_rotary(x, positions, rope=self)`."""
    return apply_rotary(x, positions, rope=self)

  @classmethod
  def from_hf(cls, config: Mapping, head_dim: int, *, interleaved: bool = False,
              layer_type: str | None = None) -> Rope:
    """The Rope of a Hugging Face config dict (config.json, `PretrainedConfig.to_dict()`), or
    of its `rope_scaling` / `rope_parameters` dict alone.

    Reads rope_theta (default 10_000), the fraction (`partial_rotary_factor`, GPT-NeoX's
    `rotary_pct` or GPT-J's `rotary_dim` / head_dim) and the scaling's `rope_type` (or `type`)
    with its parameters; `original_max_position_embeddings` falls back as in HF. A scaling
    type outside SCALINGS, or a key its record lacks, is an error: nothing is guessed.

    Args:
      config: the dict.
      head_dim: K, to check the rotated width (and to read `rotary_dim`).
      interleaved: the pairing, which configs do not record: the family's modeling code says
        (True for GPT-J, Cohere, GLM).
      layer_type: the entry of a per-layer-type `rope_parameters` (e.g. "sliding_attention").
    """
    if not isinstance(config, Mapping):
      raise TypeError(f"config must be a dict, got {type(config).__name__}")
    checks.check_int("head_dim", head_dim)
    params = _hf_params(config, layer_type)
    rope = cls(max_wavelength=params.get("rope_theta", config.get("rope_theta", 10_000.0)),
               scaling=_hf_scaling(params, config), fraction=_hf_fraction(params, config, head_dim),
               interleaved=interleaved)
    rope.rotated_width(head_dim)
    return rope


def _check_bool(name: str, value) -> None:
  if not isinstance(value, bool):
    raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def _hf_params(config: Mapping, layer_type: str | None) -> Mapping:
  """The rope parameters dict of an HF config (or the config itself when it is one)."""
  if "rope_type" in config or "type" in config:
    params = config
  else:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
  if layer_type is not None:
    if layer_type not in params:
      raise ValueError(f"layer_type {layer_type!r} is not in rope_parameters {sorted(params)}")
    return params[layer_type]
  if params and all(isinstance(v, Mapping) for v in params.values()):
    raise ValueError(f"rope_parameters is per layer type {sorted(params)}: pass layer_type")
  return params


def _hf_fraction(params: Mapping, config: Mapping, head_dim: int) -> float:
  """partial_rotary_factor, else rotary_pct, else rotary_dim / head_dim, else 1."""
  for fraction in (params.get("partial_rotary_factor"), config.get("partial_rotary_factor"),
                   config.get("rotary_pct")):
    if fraction is not None:
      return fraction
  rotary_dim = config.get("rotary_dim")
  if rotary_dim is None:
    return 1.0
  fraction = rotary_dim / head_dim
  if int(head_dim * fraction) != rotary_dim:
    raise ValueError(f"rotary_dim={rotary_dim} is not a share of head_dim={head_dim}")
  return fraction


def _hf_scaling(params: Mapping, config: Mapping):
  """The scaling record of HF rope parameters, or None for "default"."""
  name = params.get("rope_type", params.get("type", "default"))
  if name == "default":
    return None
  if name not in SCALINGS:
    raise ValueError(f"rope scaling type {name!r} is not supported; supported: "
                     f"{['default', *SCALINGS]}")
  cls = SCALINGS[name]
  fields = {f.name: f for f in dataclasses.fields(cls)}
  unknown = set(params) - set(fields) - _HF_ROPE_KEYS
  if unknown:
    raise ValueError(f"rope scaling {name!r} has no parameters {sorted(unknown)}; it takes "
                     f"{sorted(fields)}")
  kwargs = {k: v for k, v in params.items() if k in fields and v is not None}
  if "original_max_position_embeddings" in fields:  # HF's standardization, Phi-3's first
    context = config.get("original_max_position_embeddings",
                         kwargs.get("original_max_position_embeddings",
                                    config.get("max_position_embeddings")))
    if context is not None:
      kwargs["original_max_position_embeddings"] = context
  original = kwargs.get("original_max_position_embeddings")
  if cls is LongRopeScaling and "factor" not in kwargs and original:
    # HF: the checkpoint's context over the original one (Phi-3 records no factor)
    kwargs["factor"] = config.get("max_position_embeddings", original) / original
  missing = [n for n, f in fields.items() if f.default is dataclasses.MISSING and n not in kwargs]
  if missing:
    raise ValueError(f"rope scaling {name!r} needs {missing}, got keys {sorted(params)}")
  return cls(**kwargs)


def apply_rotary(x, positions, *, max_wavelength: float | None = None, rope: Rope | None = None):
  """Rotate x [..., T, H, K] by angles position * frequency; returns x's shape and dtype.

  By default the half-split convention of Llama/Gemma: feature i pairs with feature i + K/2, so
  with x1 = x[..., :K/2], x2 = x[..., K/2:] and angle[..., t, i] = positions[..., t] * freq[i],

    out = concat(x1 * cos(angle) - x2 * sin(angle), x2 * cos(angle) + x1 * sin(angle))
    freq[i] = max_wavelength ** (-2i / K),  i in [0, K/2).

  This matches `transformers`' `rotate_half` (x * cos + rotate_half(x) * sin) and Gemma's
  `apply_rope`. A `Rope` record adds HF's variants: scaled frequencies (and YaRN's and
  LongRoPE's factor on cos and sin; LongRoPE's frequencies chosen per row, by its largest
  position), rotating only the first J = int(K * fraction) features (K/2 above becomes J/2), and
  the interleaved pairing (x[2i], x[2i+1]) of the paper and GPT-J. Applied to queries at
  positions m and keys at positions n with the same frequencies, the logits depend only on
  m - n.

  Args:
    x: [..., T, H, K] floating; the rotated width must be even.
    positions: [..., T] integer or floating; broadcasts against x's leading dims [..., T]
      without growing them: [T] for every example, [B, T] per example (e.g. offset by a
      KV-cache index, or restarting per packed document). May be traced under `jit`.
    max_wavelength: the base of the frequencies (Llama's `rope_theta`), a positive finite
      Python number (static); default 10_000. Not with `rope`, which carries its own.
    rope: a `Rope` (static), or None for `Rope(max_wavelength)`.

  The angles and the rotation are computed in float32 (float64 for float64 x) and cast back,
  so a bfloat16 x, whose 8-bit mantissa cannot tell position 257 from 256, keeps its positions.
  Shapes are static under `jit`; works under `vmap`.
  """
  rope = _resolve(max_wavelength, rope)
  x, positions = _check(x, positions)
  compute = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
  # The frequencies depend on static values only: computed once in float64 NumPy.
  freq, attention_scaling = rope.frequencies(x.shape[-1])  # [J/2]
  at = positions.astype(compute)[..., None, None]
  angle = at * freq.astype(compute)  # [..., T, 1, J/2]
  long_freq = rope.long_frequencies(x.shape[-1])
  if long_freq is not None:  # LongRoPE: each row's factors by its largest position
    original = rope.scaling.original_max_position_embeddings
    longer = jnp.max(at, axis=-3, keepdims=True) + 1 > original  # [..., 1, 1, 1]
    angle = jnp.where(longer, at * long_freq.astype(compute), angle)
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  if attention_scaling != 1:
    cos, sin = cos * attention_scaling, sin * attention_scaling
  j = 2 * freq.size
  xc = x.astype(compute)
  out = (_rotate_interleaved if rope.interleaved else _rotate_half_split)(xc[..., :j], cos, sin)
  if j < x.shape[-1]:
    out = jnp.concatenate([out, xc[..., j:]], axis=-1)
  return out.astype(x.dtype)


def _rotate_half_split(x, cos, sin):
  """x [..., J] with pairs (x[i], x[i + J/2]) turned by the angles of cos, sin [..., J/2]."""
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _rotate_interleaved(x, cos, sin):
  """x [..., J] with pairs (x[2i], x[2i + 1]) turned by the angles of cos, sin [..., J/2]."""
  x1, x2 = x[..., 0::2], x[..., 1::2]
  return jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)


def _resolve(max_wavelength, rope) -> Rope:
  """The Rope of `apply_rotary`'s keywords."""
  if rope is None:
    return Rope(10_000.0 if max_wavelength is None else max_wavelength)
  if not isinstance(rope, Rope):
    raise TypeError(f"rope must be a flax_mha.rotary.Rope or None, got {type(rope).__name__}")
  if max_wavelength is not None:
    raise ValueError(f"give max_wavelength or rope, not both: rope carries max_wavelength="
                     f"{rope.max_wavelength}, got max_wavelength={max_wavelength}")
  return rope


def _check(x, positions):
  """Validate x and positions of `apply_rotary`; return them as jax arrays."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"x must be an array with layout [..., T, H, K], got {type(x).__name__}")
  x = jnp.asarray(x)  # canonical dtype: a NumPy float64 x is float32 when x64 is off
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"x must have a floating dtype, got {x.dtype}")
  if x.ndim < 3:
    raise ValueError(f"x must have rank >= 3 with layout [..., T, H, K], got shape {x.shape}")
  positions = jnp.asarray(positions)
  if not (jnp.issubdtype(positions.dtype, jnp.integer)
          or jnp.issubdtype(positions.dtype, jnp.floating)):
    raise TypeError(f"positions must have an integer or floating dtype, got {positions.dtype}")
  lead = x.shape[:-2]  # [..., T]
  if positions.ndim < 1 or positions.shape[-1] != lead[-1]:
    raise ValueError(
        f"positions must have layout [..., T] with x's T={lead[-1]}, got shape {positions.shape}")
  try:
    ok = np.broadcast_shapes(positions.shape, lead) == lead
  except ValueError:
    ok = False
  if not ok:
    raise ValueError(
        f"positions must broadcast to x's leading dims [..., T] = {lead} without growing them, "
        f"got shape {positions.shape}")
  return x, positions
