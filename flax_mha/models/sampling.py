"""The samplers of generation and serving (`flax_mha.models.decoding`, `flax_mha.serving`): a
sampler maps logits [B, C] and a key to token ids [B], the same key giving the same tokens.
Shapes: B batch, C vocabulary."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from flax_mha import checks


@dataclasses.dataclass(frozen=True)
class Greedy:
  """The most likely token."""

  def __call__(self, logits_BC, rng):
    del rng
    return jnp.argmax(logits_BC, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Sampling:
  """A token drawn from softmax(logits / temperature), restricted to the `top_k` most likely
  tokens and to the smallest set whose probability reaches `top_p` (nucleus), when given."""
  temperature: float = 1.0
  top_k: int | None = None
  top_p: float | None = None

  def __post_init__(self):
    checks.check_positive_real("temperature", self.temperature)
    if self.top_k is not None:
      checks.check_int("top_k", self.top_k)
    if self.top_p is not None:
      checks.check_real("top_p", self.top_p, above=0, highest=1)

  def __call__(self, logits_BC, rng):
    return jax.random.categorical(rng, self.restrict(logits_BC), axis=-1).astype(jnp.int32)

  def restrict(self, logits_BC):
    """The logits the draw sees: scaled, and -inf outside the top-k / top-p set."""
    logits_BC = logits_BC / self.temperature
    if self.top_k is not None:
      kth = jax.lax.top_k(logits_BC, min(self.top_k, logits_BC.shape[-1]))[0][:, -1:]
      logits_BC = jnp.where(logits_BC < kth, -jnp.inf, logits_BC)
    if self.top_p is not None:
      order = jnp.argsort(-logits_BC, axis=-1)
      probs = jax.nn.softmax(jnp.take_along_axis(logits_BC, order, axis=-1), axis=-1)
      before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
      cut_sorted = before >= self.top_p  # the most likely token always stays
      cut = jnp.zeros_like(cut_sorted).at[jnp.arange(order.shape[0])[:, None], order].set(
          cut_sorted)
      logits_BC = jnp.where(cut, -jnp.inf, logits_BC)
    return logits_BC
