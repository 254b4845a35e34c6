"""Input checks at the public boundary: every message names the argument, what was expected and what came.

Shapes use the dimension key of STYLE.md: B batch, T query length, S key length, H query heads,
G key/value heads, K qk head dim, V value head dim. Checks read static shapes and dtypes only, so
they cost nothing under `jit` and never touch traced values.
"""

from __future__ import annotations

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
  if query.shape[:-3] != key.shape[:-3] or key.shape[:-3] != value.shape[:-3]:
    raise ValueError(
        "query, key and value must have equal batch dims [...], got shapes "
        f"{tuple(query.shape)}, {tuple(key.shape)} and {tuple(value.shape)}")
  if key.shape[-3:-1] != value.shape[-3:-1]:
    raise ValueError(
        "key [..., S, G, K] and value [..., S, G, V] must agree on S and G, got "
        f"{tuple(key.shape)} and {tuple(value.shape)}")
  if query.shape[-1] != key.shape[-1]:
    raise ValueError(
        "query [..., T, H, K] and key [..., S, G, K] must share the head dim K, got "
        f"{query.shape[-1]} and {key.shape[-1]}")
  num_heads, num_kv_heads = query.shape[-2], key.shape[-2]
  if num_kv_heads == 0 or num_heads % num_kv_heads:
    raise ValueError(
        f"query heads H={num_heads} must be a multiple of key/value heads G={num_kv_heads}")


def check_broadcast(name: str, x, target: tuple[int, ...], *, boolean: bool) -> None:
  """Raise unless `x` broadcasts to `target` ([..., H, T, S]) without growing it."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be an array, got {type(x).__name__}")
  if boolean and x.dtype != jnp.bool_:
    raise TypeError(f"{name} must be boolean (True = attend), got dtype {x.dtype}")
  if not boolean and not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
  try:
    ok = np.broadcast_shapes(tuple(x.shape), target) == tuple(target)
  except ValueError:
    ok = False
  if not ok:
    raise ValueError(
        f"{name} must broadcast to [..., H, T, S] = {tuple(target)}, got shape {tuple(x.shape)}")


def check_scale(scale) -> None:
  """scale is static: a Python real number (or None for 1/sqrt(K))."""
  if scale is None:
    return
  if not isinstance(scale, numbers.Real) or isinstance(scale, bool):
    raise TypeError(f"scale must be a Python float or None, got {type(scale).__name__}")


def check_dropout(dropout_rate, dropout_rng, *, needs_rng: bool = True) -> None:
  """dropout_rate is a static Python number in [0, 1); a nonzero rate needs an rng."""
  if not isinstance(dropout_rate, numbers.Real) or isinstance(dropout_rate, bool):
    raise TypeError(
        f"dropout_rate must be a Python float in [0, 1), got {type(dropout_rate).__name__}")
  if not 0.0 <= float(dropout_rate) < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
  if needs_rng and dropout_rate > 0.0 and dropout_rng is None:
    raise ValueError(f"dropout_rate={dropout_rate} needs a dropout_rng, got None")
  if dropout_rng is not None:
    if not hasattr(dropout_rng, "dtype"):
      raise TypeError(f"dropout_rng must be a jax.random.key, got {type(dropout_rng).__name__}")
    is_typed = jnp.issubdtype(dropout_rng.dtype, jax.dtypes.prng_key)
    if not is_typed and (dropout_rng.dtype != jnp.uint32 or dropout_rng.ndim != 1):
      raise TypeError(
          "dropout_rng must be a jax.random.key or a raw uint32 key (jax.random.PRNGKey), got "
          f"dtype {dropout_rng.dtype} and shape {tuple(dropout_rng.shape)}")
