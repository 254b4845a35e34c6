"""The implementations of `dot_product_attention`: one registered `Kernel` each, and the one
`Call` record of a call that they judge.

A kernel is a name, its function and `refuses(call)`: the reason it cannot run a call, or None.
Everything that lists implementations reads this registry: the names `implementation=` takes
(`flax_mha.IMPLEMENTATIONS`), `flax_mha.explain`'s alternatives, the parity and export tests.
What `implementation=None` prefers among the kernels that take a call is not here: it is the one
rule in `flax_mha.dispatch`, which asks the kernels' `refuses` rather than repeat their limits.

Adding an implementation is one module of `flax_mha/kernels/` that ends with

    KERNEL = registry.register(registry.Kernel("name", attention, refuses, "what it is"))

and its line in `flax_mha/kernels/__init__.py`'s import list (the registration order is the
order of `names()`), plus its place in `flax_mha.dispatch`'s preference if None should pick it.
A kernel for a KV cache's step or paged attention declares those `layouts` (and its entry in
`flax_mha.cache.steps`); an accelerator kernel its `platform` and `staged=True`.

The kernels' function signature: (query [B, T, H, K], key [B, S, G, K], value [B, S, G, V],
bias, mask (None or rank 4 over the flattened batch), *, is_causal, scale, dropout_rate,
dropout_rng, mods=None, return_residual=False) -> [B, T, H, V] (and the lse [B, T, H] with
`return_residual`), already checked by `flax_mha.attention`.
"""

from __future__ import annotations

import collections.abc
import dataclasses
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp


def _spec(x):
  return None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype)


# Where the keys of a call lie, and so which entrance it came through: "dense" (keys and values
# [B, S, G, K] of `dot_product_attention`), "cache" (a few queries over a contiguous KV cache's
# slots, head-major [B, G, S, K]: `flax_mha.cache.attend`'s step), "paged" (a few queries over
# pages [P, page, G, K] through a page table: `flax_mha.paged_attention`), "ring_block" (one
# step of ring attention: this device's queries over the visiting key shard, forward with its
# lse and backward from the global one: `flax_mha.parallel.ring`).
LAYOUTS = ("dense", "cache", "paged", "ring_block")


@dataclasses.dataclass(frozen=True, eq=False)
class Call:
  """One attention call as the kernels judge it: static facts only (shapes and dtypes, never
  values), built once per call. `mods` is the call's `flax_mha.mods.Mods` (None: no mask or
  score terms); `platform` the one the program is lowered for ('cpu', 'cuda', 'rocm', 'tpu');
  `layout` where the keys lie (LAYOUTS; key and value are described as [B, S, G, K] whatever
  the layout, S the slots a row can hold; of dtype int8 for an int8 cache's step, see
  `quantized`), `page` the page size of a paged call."""
  query: jax.ShapeDtypeStruct  # [B, T, H, K]
  key: jax.ShapeDtypeStruct  # [B, S, G, K]
  value: jax.ShapeDtypeStruct  # [B, S, G, V]
  bias: jax.ShapeDtypeStruct | None
  mask: jax.ShapeDtypeStruct | None
  is_causal: bool
  dropout_rate: float
  mods: Any
  platform: str
  layout: str = "dense"
  page: int | None = None

  @classmethod
  def of(cls, query, key, value, bias=None, mask=None, *, is_causal: bool = False,
         dropout_rate: float = 0.0, mods=None, platform: str, layout: str = "dense",
         page: int | None = None) -> "Call":
    """The record of flattened arguments (arrays or anything with .shape and .dtype)."""
    if layout not in LAYOUTS:
      raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return cls(_spec(query), _spec(key), _spec(value), _spec(bias), _spec(mask),
               bool(is_causal), float(dropout_rate), mods, platform, layout, page)

  @property
  def quantized(self) -> bool:
    """Whether the keys are an int8 cache's (`flax_mha.quant`: a step's kernel dequantizes the
    blocks it reads; the int8 dtype of `key` and `value` is the record)."""
    return self.key.dtype == jnp.int8

  @property
  def dims(self) -> dict[str, int]:
    """B, T, H, K, S, G, V by name."""
    (b, t, h, k), (s, g, v) = self.query.shape, self.value.shape[1:]
    return dict(B=b, T=t, H=h, K=k, S=s, G=g, V=v)


def _takes_everything(call: Call) -> None:
  del call


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One implementation: its `name` (what `implementation=` takes), its `attention` function
  (the signature in this module's docstring), `refuses(call)` -> why it cannot run the call
  (None: it can), a one-line `summary`, and how it describes itself to the dispatch:
  `layouts` the entrances it serves (LAYOUTS: "dense" makes it an implementation of
  `dot_product_attention`), `platform` the one platform it runs on compiled (None: any), and
  `staged` whether `implementation=None` stages it only where `flax_mha.platforms.stages_for`
  its platform (a Pallas kernel for hardware this process may lack)."""
  name: str
  attention: Callable
  refuses: Callable[[Call], str | None] = _takes_everything
  summary: str = ""
  layouts: tuple[str, ...] = ("dense",)
  platform: str | None = None
  staged: bool = False
  # What the dispatch's rule asks of this kernel beyond `refuses`, by name (functions or
  # values: "not_staged" the refusal of a staged kernel where it is not staged, and the CPU
  # rule's measures, e.g. rows' "band_keys"), so that the rule never imports a kernel.
  hints: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  # layout -> the kernel's own entry for each layout but "dense" (whose entry is `attention`):
  # "cache" and "paged" a step's function (`flax_mha.cache.steps` calls it), "ring_block" a
  # `Block` (`flax_mha.parallel.ring`).
  entries: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Block:
  """A kernel's entry for one step of ring attention (layout "ring_block"): `forward` and
  `backward` in the signatures of `chunked.chunked_forward` and `chunked.chunked_backward`,
  `options_reason(call)` why it cannot take a step (None: it can), and whether it skips the
  tiles the step's masks hide by itself (else the ring skips a hidden step whole)."""
  forward: Callable
  backward: Callable
  options_reason: Callable = lambda call: None
  skips_hidden_tiles: bool = False


_KERNELS: dict[str, Kernel] = {}


def register(kernel: Kernel) -> Kernel:
  """Add `kernel` under its name (a name is registered once); returns it."""
  if not isinstance(kernel, Kernel):
    raise TypeError(f"kernel must be a registry.Kernel, got {type(kernel).__name__}")
  if kernel.name in _KERNELS:
    raise ValueError(f"an implementation named {kernel.name!r} is already registered")
  _KERNELS[kernel.name] = kernel
  return kernel


def unregister(name: str) -> Kernel:
  """Remove and return the kernel registered as `name` (a plug-in's own, say)."""
  kernel = get(name)
  del _KERNELS[name]
  return kernel


def names(layout: str = "dense") -> tuple[str, ...]:
  """The names of the kernels that serve `layout` (by default the implementations of
  `dot_product_attention`), in registration order."""
  return tuple(name for name, kernel in _KERNELS.items() if layout in kernel.layouts)


def get(name: str) -> Kernel:
  """The kernel registered as `name` (a KeyError naming the registered ones otherwise)."""
  try:
    return _KERNELS[name]
  except KeyError:
    raise KeyError(f"no implementation named {name!r}; registered: {names()}") from None


def entry(name: str, layout: str):
  """The entry of the kernel registered as `name` for `layout` ("dense": its `attention`)."""
  kernel = get(name)
  if layout == "dense":
    return kernel.attention
  try:
    return kernel.entries[layout]
  except KeyError:
    raise KeyError(f"kernel {name!r} has no entry for the layout {layout!r}; it has "
                   f"{sorted(kernel.entries)}") from None


def refusals(call: Call) -> dict[str, str | None]:
  """name -> why that kernel cannot run `call` (None: it runs), for every kernel that serves
  the call's layout."""
  return {name: get(name).refuses(call) for name in names(call.layout)}


class _Functions(collections.abc.Mapping):
  """name -> the registered kernel's function, for the implementations of
  `dot_product_attention` (layout "dense"): a live, read-only view of the registry."""

  def __getitem__(self, name):
    if name not in names():
      raise KeyError(name)
    return get(name).attention

  def __iter__(self):
    return iter(names())

  def __len__(self):
    return len(names())

  def __repr__(self):
    return f"IMPLEMENTATIONS{names()}"


FUNCTIONS = _Functions()
