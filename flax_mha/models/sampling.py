"""The samplers of generation and serving (`flax_mha.models.decoding`, `flax_mha.serving`): a
sampler maps logits [B, C] and a key to token ids [B], the same key giving the same tokens.
Shapes: B batch, C vocabulary."""

from __future__ import annotations

import dataclasses
from typing import Any

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
    rows = lambda value, dtype: jnp.full((logits_BC.shape[0],), value, dtype)
    temperature, top_k, top_p = self.row_params
    return restrict_rows(logits_BC, rows(temperature, jnp.float32), rows(top_k, jnp.int32),
                         rows(top_p, jnp.float32))

  @property
  def row_params(self) -> tuple[float, int, float]:
    """(temperature, top_k, top_p) as `draw_rows` takes them (0: no top-k; 1: no top-p)."""
    return (self.temperature, self.top_k or 0, 1.0 if self.top_p is None else self.top_p)


def row_params(sampler) -> tuple[float, int, float]:
  """A `Greedy` or `Sampling` as the per-row (temperature, top_k, top_p) of `draw_rows`
  (temperature 0: greedy). Raises TypeError for anything else."""
  if isinstance(sampler, Greedy):
    return (0.0, 0, 1.0)
  if isinstance(sampler, Sampling):
    return sampler.row_params
  raise TypeError(f"sampler must be a Greedy() or a Sampling(...), got {type(sampler).__name__}")


def restrict_rows(logits_BC, temperature_B, top_k_B, top_p_B):
  """Each row's logits scaled by its temperature (> 0), -inf below its top_k-th largest (0:
  none; ties at the k-th kept) and outside the smallest set whose probability, renormalised
  after top-k, reaches its top_p (1: none; the most likely token always stays)."""
  logits_BC = logits_BC / temperature_B[:, None]
  c = logits_BC.shape[-1]
  order = jnp.argsort(-logits_BC, axis=-1)
  sorted_BC = jnp.take_along_axis(logits_BC, order, axis=-1)
  kth = jnp.take_along_axis(sorted_BC, jnp.clip(top_k_B - 1, 0, c - 1)[:, None], axis=-1)
  kth = jnp.where(top_k_B[:, None] > 0, kth, -jnp.inf)
  logits_BC = jnp.where(logits_BC < kth, -jnp.inf, logits_BC)
  sorted_BC = jnp.where(sorted_BC < kth, -jnp.inf, sorted_BC)
  probs = jax.nn.softmax(sorted_BC, axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
  cut_sorted = (before >= top_p_B[:, None]) & (top_p_B[:, None] < 1)
  cut = jnp.zeros_like(cut_sorted).at[jnp.arange(order.shape[0])[:, None], order].set(cut_sorted)
  return jnp.where(cut, -jnp.inf, logits_BC)


def draw_rows(logits_BC, keys_B, temperature_B, top_k_B, top_p_B):
  """A token per row [B]: the most likely where temperature_B is 0, else drawn with that row's
  key from `restrict_rows`' logits (computed only when some row samples)."""
  greedy = jnp.argmax(logits_BC, axis=-1).astype(jnp.int32)
  sampling = temperature_B > 0

  def draw():
    restricted = restrict_rows(logits_BC, jnp.where(sampling, temperature_B, 1.0), top_k_B,
                               top_p_B)
    return jax.vmap(jax.random.categorical)(keys_B, restricted).astype(jnp.int32)

  drawn = jax.lax.cond(sampling.any(), draw, lambda: greedy)
  return jnp.where(sampling, drawn, greedy)


@dataclasses.dataclass(frozen=True)
class Rows:
  """Each row its own sampling parameters, arrays [B] as `draw_rows` takes them (temperature
  0: greedy): the serving loop's sampler, and what speculative decoding reads any sampler as
  (`as_rows`). Draws take one key per row."""
  temperature: Any
  top_k: Any
  top_p: Any

  def draw(self, logits_BC, keys_B):
    """A token per row [B] (`draw_rows`)."""
    return draw_rows(logits_BC, keys_B, self.temperature, self.top_k, self.top_p)

  def probs(self, logits_BTC):
    """[B, T, C]: the distribution each row's draw takes at each of its T positions, float32
    (a greedy row's: one-hot at the most likely token)."""
    logits_BTC = logits_BTC.astype(jnp.float32)
    sampling = self.temperature > 0
    restrict = jax.vmap(restrict_rows, in_axes=(1, None, None, None), out_axes=1)
    soft = jax.nn.softmax(restrict(logits_BTC, jnp.where(sampling, self.temperature, 1.0),
                                   self.top_k, self.top_p), axis=-1)
    greedy = jax.nn.one_hot(jnp.argmax(logits_BTC, -1), logits_BTC.shape[-1])
    return jnp.where(sampling[:, None, None], soft, greedy)


def as_rows(sampler, batch_size: int) -> Rows:
  """`sampler` (`Greedy`, `Sampling` or already `Rows`) as `Rows` of batch_size rows."""
  if isinstance(sampler, Rows):
    return sampler
  temperature, top_k, top_p = row_params(sampler)
  full = lambda value, dtype: jnp.full((batch_size,), value, dtype)
  return Rows(full(temperature, jnp.float32), full(top_k, jnp.int32), full(top_p, jnp.float32))
