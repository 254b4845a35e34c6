"""Argument checks at every public boundary, in one place: each message names the argument, what
was expected and what came ("{name} must be {expected}, got {value}"); a wrong type is a
TypeError, a value out of range a ValueError.

Shapes use the dimension key written in `flax_mha/__init__.py`: B batch, T query length, S key
length, H query heads, G key/value heads, K qk head dim, V value head dim. Checks read static
shapes, dtypes and Python values only, so they cost nothing under `jit` and never touch traced
values (except `check_token_ids`, which runs on the host).
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np


def check_array(name: str, x, min_rank: int, layout: str, *, floating: bool = True) -> None:
  """Raise unless `x` is an array (floating, unless told otherwise) of rank >= `min_rank`."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be an array with layout {layout}, got {type(x).__name__}")
  if x.ndim < min_rank:
    raise ValueError(
        f"{name} must have rank >= {min_rank} with layout {layout}, got shape {tuple(x.shape)}")
  if floating and not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")


def check_qkv(query, key, value) -> None:
  """Check query [..., T, H, K], key [..., S, G, K], value [..., S, G, V] against each other."""
  check_array("query", query, 3, "[..., T, H, K]")
  check_array("key", key, 3, "[..., S, G, K]")
  check_array("value", value, 3, "[..., S, G, V]")
  if not query.dtype == key.dtype == value.dtype:
    raise TypeError(
        "query, key and value must share one dtype, got "
        f"{query.dtype}, {key.dtype} and {value.dtype}")
  if not query.ndim == key.ndim == value.ndim:
    raise ValueError(
        "query, key and value must have the same rank, got shapes "
        f"{tuple(query.shape)}, {tuple(key.shape)} and {tuple(value.shape)}")
  check_agree("query, key and value", (query, key, value), slice(None, -3),
              "have equal batch dims [...]")
  check_agree("key [..., S, G, K] and value [..., S, G, V]", (key, value), slice(-3, -1),
              "agree on S and G")
  check_agree("query [..., T, H, K] and key [..., S, G, K]", (query, key), slice(-1, None),
              "share the head dim K")
  check_heads(query.shape[-2], key.shape[-2], names=("query heads H", "key/value heads G"))


def check_agree(names: str, arrays, dims: slice, what: str) -> None:
  """Raise unless every array has the same shape[dims]: '{names} must {what}, got shapes ...'."""
  shapes = [tuple(x.shape) for x in arrays]
  if len({shape[dims] for shape in shapes}) > 1:
    listed = ", ".join(map(str, shapes[:-1])) + f" and {shapes[-1]}"
    raise ValueError(f"{names} must {what}, got shapes {listed}")


def check_heads(num_heads, num_kv_heads, *, names=("num_heads", "num_kv_heads")) -> None:
  """Both positive ints and num_heads a multiple of num_kv_heads (GQA/MQA)."""
  for name, n in zip(names, (num_heads, num_kv_heads)):
    check_int(name, n)
  if num_heads % num_kv_heads:
    raise ValueError(
        f"{names[0]}={num_heads} must be a multiple of {names[1]}={num_kv_heads}")


def check_broadcast(name: str, x, target: tuple[int, ...], *, boolean: bool) -> None:
  """Raise unless `x` broadcasts to `target` ([..., H, T, S]) without growing it."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be an array, got {type(x).__name__}")
  if boolean and x.dtype != jnp.bool_:
    raise TypeError(
        f"{name} must be boolean (True = attend), got dtype {x.dtype}: for flax's 1/0 masks "
        f"pass {name}.astype(bool); an additive mask (0 / -inf) belongs in `bias`")
  if not boolean and not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
  check_broadcasts_to(name, x.shape, target, "[..., H, T, S]")


def check_broadcasts_to(name: str, shape, target, layout: str) -> None:
  """Raise unless `shape` broadcasts to `target` without growing it."""
  try:
    ok = np.broadcast_shapes(tuple(shape), tuple(target)) == tuple(target)
  except ValueError:
    ok = False
  if not ok:
    raise ValueError(
        f"{name} must broadcast to {layout} = {tuple(target)}, got shape {tuple(shape)}")


def _is_int(value) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_int(name: str, value, lowest: int = 1, highest: int | None = None) -> int:
  """A Python int (not a bool) in [lowest, highest]; returns it as an int."""
  if highest is not None:
    expected = f"an int in [{lowest}, {highest}]"
  else:
    expected = "a positive int" if lowest == 1 else f"an int >= {lowest}"
  if not _is_int(value):
    raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")
  if value < lowest or (highest is not None and value > highest):
    raise ValueError(f"{name} must be {expected}, got {value}")
  return int(value)


def check_real(name: str, value, *, above=None, lowest=None, below=None, highest=None) -> float:
  """A finite Python real number (not a bool) > above, >= lowest, < below and <= highest (each
  optional); returns it as a float. Static: a jax array is refused."""
  low = f"({above}" if above is not None else f"[{lowest}" if lowest is not None else None
  high = f"{below})" if below is not None else f"{highest}]" if highest is not None else None
  if low and high:
    expected = f"a finite number in {low}, {high}"
  else:
    bounds = [f"> {above}" if above is not None else None,
              f">= {lowest}" if lowest is not None else None,
              f"< {below}" if below is not None else None,
              f"<= {highest}" if highest is not None else None]
    expected = "a finite number" + "".join(f" {b}" for b in bounds if b)
  if not _is_real(value):
    raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")
  ok = (math.isfinite(value) and (above is None or value > above) and
        (lowest is None or value >= lowest) and (below is None or value < below) and
        (highest is None or value <= highest))
  if not ok:
    raise ValueError(f"{name} must be {expected}, got {value}")
  return float(value)


def check_positive_real(name: str, value, *, optional: bool = False) -> float | None:
  """A static finite number > 0 (a soft cap, a wavelength, a learning rate); None passes when
  `optional`."""
  if optional and value is None:
    return None
  return check_real(name, value, above=0)


def check_rate(name: str, value) -> float:
  """A static rate in [0, 1) (dropout, label smoothing)."""
  return check_real(name, value, lowest=0, below=1)


def check_window(name: str, size) -> tuple[int, int] | None:
  """A local window: None, an int w >= 0 (meaning (w, w)) or a (left, right) pair of them;
  returns the pair (or None)."""
  if size is None:
    return None
  pair = (size, size) if _is_int(size) else size
  if not (isinstance(pair, tuple) and len(pair) == 2 and
          all(_is_int(x) and x >= 0 for x in pair)):
    raise ValueError(f"{name} must be an int >= 0 or a (left, right) pair of them, got {size!r}")
  return int(pair[0]), int(pair[1])


def check_scale(scale) -> None:
  """scale is static: a finite Python real number (or None for 1/sqrt(K))."""
  if scale is not None:
    check_real("scale", scale)


def checked_scale(scale, head_dim: int) -> float:
  """`scale` checked (`check_scale`) as a float; None gives 1/sqrt(head_dim) (1.0 when
  head_dim is 0: every logit is 0 whatever the scale)."""
  check_scale(scale)
  if scale is None:
    return 1.0 / math.sqrt(head_dim) if head_dim else 1.0
  return float(scale)


def check_is_causal(is_causal) -> None:
  """is_causal is static: a Python bool."""
  if not isinstance(is_causal, (bool, np.bool_)):
    raise TypeError(f"is_causal must be a Python bool, got {type(is_causal).__name__}")


def check_dropout(dropout_rate, dropout_rng, *, needs_rng: bool = True) -> None:
  """dropout_rate in [0, 1); a nonzero rate needs an rng, which must be ONE key."""
  check_rate("dropout_rate", dropout_rate)
  if needs_rng and dropout_rate > 0.0 and dropout_rng is None:
    raise ValueError(f"dropout_rate={dropout_rate} needs a dropout_rng, got None")
  if dropout_rng is not None:
    if not hasattr(dropout_rng, "dtype"):
      raise TypeError(f"dropout_rng must be a jax.random.key, got {type(dropout_rng).__name__}")
    if jnp.issubdtype(dropout_rng.dtype, jax.dtypes.prng_key):
      if dropout_rng.ndim:
        raise ValueError(
            f"dropout_rng must be a single key (shape ()), got shape {tuple(dropout_rng.shape)}")
    elif dropout_rng.dtype != jnp.uint32 or dropout_rng.ndim != 1:
      raise TypeError(
          "dropout_rng must be a jax.random.key or a single raw uint32 key "
          f"(jax.random.PRNGKey), got dtype {dropout_rng.dtype} and shape "
          f"{tuple(dropout_rng.shape)}")


def check_token_ids(name: str, tokens, vocab_size: int) -> None:
  """Host-side check that every id of `tokens` (NumPy or a concrete jax array) is in
  [0, vocab_size): inside `jit` an out-of-range id is not an error but an embedding of NaN
  in the models (flax_mha.models), while flax's nn.Embed alone reads a negative one as another
  row. Names the first bad id and where it is."""
  ids = np.asarray(tokens)
  bad = (ids < 0) | (ids >= vocab_size)
  if bad.any():
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(f"{name} holds token id {int(ids[where])} at position {where}, outside "
                     f"the vocabulary [0, {vocab_size})")


def check_concrete_token_ids(name: str, tokens, vocab_size: int) -> None:
  """`check_token_ids` where `tokens` is concrete (eager calls); traced ids (inside `jit`) are
  the caller's to check on the host."""
  if not isinstance(tokens, jax.core.Tracer):
    check_token_ids(name, tokens, vocab_size)


def check_tokens(name: str, tokens, rank: int = 2) -> None:
  """Integer token ids of the given rank ([B, L] by default)."""
  if not hasattr(tokens, "dtype") or not hasattr(tokens, "ndim"):
    raise TypeError(f"{name} must be an integer array [B, L], got {type(tokens).__name__}")
  if tokens.ndim != rank or not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"{name} must be integer tokens of rank {rank} ([B, L]), got dtype "
                     f"{tokens.dtype} and shape {tuple(tokens.shape)}")
