"""Non-finite inputs confined to the rows they reach: `flax_mha.confine_nonfinite`'s mechanism.

A NaN or inf in the query of row t, or in the key or value of key s, must reach exactly the
outputs that read it: row t's, and those of the rows that give key s weight. The formula alone
does not keep it there: a hidden key has weight 0, and 0 · NaN = NaN in `weights · V` (and in
the backward's `dP = dO · Vᵀ`, `dQ = dS · K`, `dK = dSᵀ · Q`), so one bad value of one packed
document turns every document's outputs and gradients into NaN. Confinement is opt-in
(`flax_mha.confine_nonfinite`): the default path pays nothing for it.

`confined(fn)` wraps an implementation (`flax_mha.kernels`' signature): every kernel runs on
inputs whose non-finite entries are replaced by 0 (so nothing it computes, forward or
backward, meets one), and one more value column carries each key's badness (1.0 for a key whose
key or value vector holds a non-finite entry, else 0), whose output is the weight each row
gives bad keys. A row's output (and lse) is then NaN where that weight is > 0 or its own query
is bad, and the kernel's finite result elsewhere; no gradient flows through the marking, and
the bad entries themselves get gradient 0.

cuDNN takes no extra value column (it needs K == V, a multiple of 8): for it, a row is marked
when a key that its mask, bias and causality leave visible is bad (cuDNN takes no other mask
terms), computed from the dense mask it is given.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from flax_mha.kernels import common


def _bad(x):
  """Whether each vector along the last axis holds a non-finite entry: x.shape[:-1]."""
  return jnp.any(~jnp.isfinite(x), axis=-1)


def _clean(x):
  return jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))


def confined(fn, *, by_visibility: bool = False):
  """`fn` (query [B, T, H, K], key [B, S, G, K], value [B, S, G, V], bias, mask, **options)
  with non-finite inputs confined to the rows they reach (see the module docstring);
  `by_visibility`: mark the rows from the dense mask, bias and causality (cuDNN's way)."""
  @functools.wraps(fn)
  def run(query, key, value, bias, mask, *, return_residual=False, **options):
    extra = dict(return_residual=True) if return_residual else {}
    q_bad_BTH = _bad(query)
    kv_bad_BSG = _bad(key) | _bad(value)
    q, k, v = _clean(query), _clean(key), _clean(value)
    if by_visibility:
      result = fn(q, k, v, bias, mask, **options, **extra)
      out, lse = result if return_residual else (result, None)
      sees_bad_BTH = _sees_bad(kv_bad_BSG, bias, mask, options["is_causal"], q.shape)
    else:
      flag = lax.stop_gradient(kv_bad_BSG[..., None].astype(v.dtype))
      result = fn(q, k, jnp.concatenate([v, flag], axis=-1), bias, mask, **options, **extra)
      out, lse = result if return_residual else (result, None)
      out, sees_bad_BTH = out[..., :-1], lax.stop_gradient(out[..., -1]) > 0
    nan_BTH = q_bad_BTH | sees_bad_BTH
    out = jnp.where(nan_BTH[..., None], jnp.array(jnp.nan, out.dtype), out)
    if not return_residual:
      return out
    return out, jnp.where(nan_BTH, jnp.array(jnp.nan, lse.dtype), lse)
  return run


def _sees_bad(kv_bad_BSG, bias, mask, is_causal, query_shape):
  """[B, T, H]: whether a bad key is visible to the row through mask, bias and causality."""
  b, t, h, _ = query_shape
  s, g = kv_bad_BSG.shape[1:]
  bad_BHS = jnp.repeat(kv_bad_BSG.transpose(0, 2, 1), h // g, axis=1)
  visible = common.visible_mask(mask, is_causal, t, s)
  if bias is not None:
    finite = bias > -jnp.inf
    visible = finite if visible is None else visible & finite
  if visible is None:
    sees_BHT = jnp.broadcast_to(jnp.any(bad_BHS, axis=-1)[..., None], (b, h, t))
  else:
    sees_BHT = jnp.any(visible & bad_BHS[:, :, None, :], axis=-1)
    sees_BHT = jnp.broadcast_to(sees_BHT, (b, h, t))
  return sees_BHT.transpose(0, 2, 1)


def for_kernel(name: str | None, fn):
  """`confined(fn)` for the implementation `name` (None: a callable): cuDNN's marked by
  visibility, every other by its extra value column."""
  return confined(fn, by_visibility=name == "cudnn")
