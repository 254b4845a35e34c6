"""Rematerialisation: what a training step recomputes in its backward pass instead of storing.

  POLICIES     the models' `remat` values: "none" (store everything), "layer" (each block runs
               under `nn.remat`: only its input is kept, the block is recomputed in the
               backward), "attention" (only the attention call, through the implementation
               below: its [T, S] logits, or the chunked kernel's residuals, are recomputed,
               the projections and the FFN are stored).
  remat_implementation(implementation)
               an implementation callable for `dot_product_attention(implementation=...)` that
               runs `implementation` under `jax.checkpoint`; the pure API's remat.
  attention_implementation(policy, implementation), layer_class(policy, cls, static_argnums)
               a policy applied, the one reading of `remat` that every model uses: the
               implementation its attention layers take, and the class of its blocks.

Every policy computes the same values and gradients (tests/models/test_remat_integration.py; the
pure API's remat_implementation: test_remat.py); they trade memory for one more forward of what
they recompute.
"""

from __future__ import annotations

from typing import Callable

import jax

from flax_mha import attention as attention_lib

POLICIES = ("none", "layer", "attention")


def check_policy(name: str, value) -> str:
  """`value` if it is one of POLICIES, else a ValueError (TypeError for a non-string) naming
  `name`."""
  if not isinstance(value, str):
    raise TypeError(f"{name} must be a string, one of {list(POLICIES)}, got "
                    f"{type(value).__name__}")
  if value not in POLICIES:
    raise ValueError(f"{name} must be one of {list(POLICIES)}, got {value!r}")
  return value


def remat_implementation(implementation: str | Callable | None = None) -> Callable:
  """`implementation` (None, a name in IMPLEMENTATIONS, or a callable such as
  `flax_mha.ring_implementation`) as a callable that `jax.checkpoint`s the attention call.

  None resolves at trace time exactly as in `dot_product_attention`. Masks, segment ids and
  dropout keys are closed over (no gradient flows to them; sinks and arrays a score_mod closes
  over still get theirs through the closure).
  """
  attention_lib.check_implementation(implementation)

  def attention(q, k, v, bias, mask, *, is_causal, scale, dropout_rate, dropout_rng, **extra):
    fn = implementation
    if not callable(fn):
      fn = attention_lib.IMPLEMENTATIONS[implementation or attention_lib.default_implementation(
          q, k, v, bias, mask, is_causal=is_causal, dropout_rate=dropout_rate,
          mods=extra.get("mods"))]
    return jax.checkpoint(lambda q, k, v, bias: fn(
        q, k, v, bias, mask, is_causal=is_causal, scale=scale, dropout_rate=dropout_rate,
        dropout_rng=dropout_rng, **extra))(q, k, v, bias)

  attention.__name__ = f"remat_{getattr(implementation, '__name__', implementation)}"
  return attention


def attention_implementation(policy: str, implementation: str | Callable | None = None):
  """The implementation a model's attention layers take under `policy`: `implementation`
  under `jax.checkpoint` (`remat_implementation`) for "attention", else as it is."""
  if policy == "attention":
    return remat_implementation(implementation)
  return implementation


def layer_class(policy: str, cls, static_argnums: tuple):
  """A model's block class under `policy`: `flax.linen.remat(cls, static_argnums=...)` for
  "layer" (only the block's input is kept for the backward), else `cls` itself. Decoding with a
  cache runs no backward: models then pass policy "none"."""
  if policy != "layer":
    return cls
  import flax.linen as nn  # here, not at the top: `import flax_mha` loads no flax
  return nn.remat(cls, static_argnums=static_argnums)
