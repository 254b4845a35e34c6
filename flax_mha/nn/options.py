"""`AttentionOptions`: a layer's own attention options, one frozen record.

The linen and NNX modules take it as one attribute, `attention_options=`, and hand it to the
shared forward (`flax_mha.nn.shared.forward`), which passes its fields to
`flax_mha.dot_product_attention` by name. A new option is a new field here: a field named as one of
the pure function's keyword options (`flax_mha.call_options.OPTIONS`) reaches the plain call with no
other change (the `cache=` and `decode` paths pass the fields on too, but each option there is
only as tested as its own cache tests).

The modules' older per-option attributes (`logit_soft_cap=...`) are kept as aliases of the
first fields (ALIASES): `AttentionOptions.resolve` turns either spelling into the record.
"""

from __future__ import annotations

import dataclasses

import jax

from flax_mha import call_options
from flax_mha import checks
from flax_mha.rotary import Rope


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
  """A layer's static attention options, checked at construction.

  Attributes:
    logit_soft_cap: None, or a cap > 0: logits become cap·tanh(logits / cap) (Gemma 2).
    local_window_size: None, an int w or a (left, right) pair of ints >= 0 (stored as the
      pair): query at position i sees keys at positions i - left .. i + right. Without a cache
      it needs T == S; when decoding the positions are absolute cache positions.
    sink_tokens: int >= 0, with a window: the first `sink_tokens` positions stay visible to every
      query (StreamingLLM), and a rolling cache keeps them.
    rotary_max_wavelength: None for no rotary embedding, else the RoPE base (e.g. 10_000.0):
      projected queries and keys are rotated by `flax_mha.apply_rotary` at their positions before
      the cache write. Needs an even qk head dim K.
    learned_sinks: a learned sink logit per query head (param 'sinks' [H], zeros at init) that
      joins every row's softmax without a value (gpt-oss).
    rope: a `flax_mha.rotary.Rope` (scaled frequencies, a rotated fraction of K, interleaved
      pairs: Hugging Face's variants), the fuller spelling of rotary_max_wavelength (give one
      of the two): queries and keys are rotated by it before the cache write.
    scale: the logits' scale, None for 1/sqrt(K) (Gemma 2 and 3: query_pre_attn_scalar**-0.5).
  """
  logit_soft_cap: float | None = None
  local_window_size: int | tuple[int, int] | None = None
  sink_tokens: int = 0
  rotary_max_wavelength: float | None = None
  learned_sinks: bool = False
  rope: Rope | None = None
  scale: float | None = None

  def __post_init__(self):
    checks.check_positive_real("logit_soft_cap", self.logit_soft_cap, optional=True)
    object.__setattr__(self, "local_window_size",
                       checks.check_window("local_window_size", self.local_window_size))
    checks.check_int("sink_tokens", self.sink_tokens, lowest=0)
    checks.check_positive_real("rotary_max_wavelength", self.rotary_max_wavelength,
                               optional=True)
    if not isinstance(self.learned_sinks, bool):
      raise TypeError(f"learned_sinks must be a bool, got {type(self.learned_sinks).__name__}")
    if self.rope is not None and not isinstance(self.rope, Rope):
      raise TypeError(f"rope must be a flax_mha.rotary.Rope or None, got "
                      f"{type(self.rope).__name__}")
    if self.rope is not None and self.rotary_max_wavelength is not None:
      raise ValueError(f"give rotary_max_wavelength or rope, not both: rope carries "
                       f"max_wavelength={self.rope.max_wavelength}, got rotary_max_wavelength="
                       f"{self.rotary_max_wavelength}")
    checks.check_positive_real("scale", self.scale, optional=True)

  @property
  def rotary(self) -> Rope | None:
    """The rotation queries and keys get: `rope`, Rope(rotary_max_wavelength), or None."""
    if self.rope is not None or self.rotary_max_wavelength is None:
      return self.rope
    return Rope(self.rotary_max_wavelength)

  def keywords(self) -> dict:
    """The fields that are `dot_product_attention` keyword options, by name: every one the
    record holds (a cache path places the window and sink tokens as its cache needs), and the
    scale when one is set."""
    keywords = {name: getattr(self, name) for name in _FIELDS if name in call_options.OPTIONS}
    if self.scale is not None:
      keywords["scale"] = self.scale
    return keywords

  @classmethod
  def resolve(cls, record: "AttentionOptions | None", **aliases) -> "AttentionOptions":
    """The record a module runs with: `record`, or one built from the alias attributes (the
    names in ALIASES). Giving both, with an alias off its default, is an error."""
    if record is None:
      return cls(**aliases)
    if not isinstance(record, cls):
      raise TypeError(f"attention_options must be a flax_mha.AttentionOptions, got "
                      f"{type(record).__name__}")
    changed = sorted(name for name, value in aliases.items() if value != _DEFAULTS[name])
    if changed:
      raise ValueError(f"{changed} given as attributes and attention_options given too: pass "
                       "them in attention_options only")
    return record


_FIELDS = tuple(field.name for field in dataclasses.fields(AttentionOptions))
_DEFAULTS = {field.name: field.default for field in dataclasses.fields(AttentionOptions)}
# The modules' older per-option attributes: aliases of these fields, kept for existing code.
# New options are fields only, reached through `attention_options=`.
ALIASES = ("logit_soft_cap", "local_window_size", "sink_tokens", "rotary_max_wavelength",
           "learned_sinks")


NORM_KINDS = ("layer", "rms", "rms_one_plus")


@dataclasses.dataclass(frozen=True)
class Norm:
  """A normalisation's kind, epsilon and bias: the model norms of `flax_mha.models.LMConfig` and
  the modules' qk-norm (`normalize_qk=Norm(...)`). Its parameter is 'scale' [D] in every kind
  (and 'bias' for a LayerNorm with use_bias).

  Attributes:
    kind: "layer": LayerNorm, (x - mean) / std · scale + bias (flax's `LayerNorm`; GPT-2);
      "rms": RMSNorm, x / rms(x) · scale, scale ones at init (Llama, Mistral, Qwen);
      "rms_one_plus": Gemma's RMSNorm, x / rms(x) · (1 + scale), scale zeros at init.
      The RMS kinds compute in float32 and cast the result to the layer's dtype, as Hugging
      Face's do.
    epsilon: added to the variance (or mean square) before the root, a number > 0.
    use_bias: a LayerNorm's bias (None: True for a LayerNorm; the RMS kinds have none).
    across_heads: a qk-norm's reach: False normalises each head over its K (Qwen3, Gemma 3;
      scale [K]), True each token's queries (keys) over all heads at once, H·K (G·K) wide
      (OLMo 2; scale [H·K], [G·K]). Only the modules' normalize_qk takes it.
  """
  kind: str = "layer"
  epsilon: float = 1e-6
  use_bias: bool | None = None
  across_heads: bool = False

  def __post_init__(self):
    if self.kind not in NORM_KINDS:
      raise ValueError(f"Norm.kind must be one of {NORM_KINDS}, got {self.kind!r}")
    checks.check_positive_real("Norm.epsilon", self.epsilon)
    if self.use_bias is None:
      object.__setattr__(self, "use_bias", self.kind == "layer")
    if not isinstance(self.use_bias, bool):
      raise TypeError(f"Norm.use_bias must be a bool, got {type(self.use_bias).__name__}")
    if self.use_bias and self.kind != "layer":
      raise ValueError(f"Norm.use_bias is a LayerNorm's: kind {self.kind!r} has no bias")
    if not isinstance(self.across_heads, bool):
      raise TypeError(f"Norm.across_heads must be a bool, got {type(self.across_heads).__name__}")

  def width(self, heads: int, head_dim: int) -> int:
    """The width a qk-norm of `heads` heads of `head_dim` normalises over (its scale's size)."""
    return heads * head_dim if self.across_heads else head_dim

  def apply(self, layer, x_THK):
    """`layer` (this norm's module) on queries or keys [..., T, H, K]: over K, or over H·K at
    once with across_heads."""
    if not self.across_heads:
      return layer(x_THK)
    return layer(x_THK.reshape(*x_THK.shape[:-2], -1)).reshape(x_THK.shape)

  @property
  def scale_init(self):
    """The scale's initialiser: zeros for Gemma's one-plus kind (a scale of 1), else ones."""
    init = jax.nn.initializers
    return init.zeros if self.kind == "rms_one_plus" else init.ones


# flax's normalize_qk=True: LayerNorm over K with a scale only, epsilon 1e-6.
FLAX_QK_NORM = Norm("layer", 1e-6, use_bias=False)


def qk_norm(normalize_qk) -> Norm | None:
  """The Norm of the modules' `normalize_qk` (False: None; True: flax's LayerNorm; a Norm)."""
  if isinstance(normalize_qk, Norm):
    return normalize_qk
  if not isinstance(normalize_qk, bool):
    raise TypeError(f"normalize_qk must be a bool or a flax_mha.Norm, got "
                    f"{type(normalize_qk).__name__}")
  return FLAX_QK_NORM if normalize_qk else None
