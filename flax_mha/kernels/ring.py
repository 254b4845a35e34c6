"""Ring attention (Liu et al., 2023): sequence parallelism for exact attention.

Query, key and value are split along the sequence over a mesh axis of n devices. Each device keeps
its query shard and passes its key/value shard around the ring (`lax.ppermute` to the next
device), n steps in all; at every step it runs the chunked kernel (`flax_mha.kernels.chunked`) on the
(query shard, visiting key shard) pair and merges the partial result into its running output by
log-sum-exp. No device ever holds more than one key/value shard or one [T/n, S/n] tile set, so
per-device memory falls as 1/n. The backward (a `jax.custom_vjp`) sends K/V around the ring again
together with their gradient accumulators dK/dV, each device adding its query shard's
contribution from the GLOBAL lse saved by the forward; after n hops the accumulators are home.

Causal attention compares global positions (query shard i starts at i·T/n, key shard j at j·S/n,
top-left aligned like `dot_product_attention`); a key shard entirely in a query shard's future
contributes nothing (the kernel's causal loop bounds skip all of its tiles).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec as P

from flax_mha import checks
from flax_mha.kernels import _shared
from flax_mha import mods as mods_lib
from flax_mha.kernels.chunked import chunked_backward, chunked_forward
from flax_mha.sharding import DATA_AXIS, MODEL_AXIS, SEQ_AXIS


def ring_attention(query, key, value, mask=None, *, mesh: Mesh | AbstractMesh,
                   axis_name: str = SEQ_AXIS, is_causal: bool = False, scale: float | None = None,
                   batch_axis: str | None = None, head_axis: str | None = None, mods=None,
                   return_residual: bool = False):
  """Exact attention with the sequence split over `mesh`'s `axis_name`.

  Args:
    query: [B, T, H, K] global array (sharded or not; it is laid out as T over `axis_name`).
    key: [B, S, G, K], H a multiple of G (GQA).
    value: [B, S, G, V].
    mask: optional boolean (True = attend) broadcasting to [B, H, T, S]. It is split like the
      query along T (a key-padding mask [B, 1, 1, S] is not split at all), so a full [B, 1, T, S]
      mask costs T·S/n booleans per device.
    mesh: the device mesh, its axes Auto or Explicit (`jax.make_mesh` makes Explicit ones), or
      the abstract mesh of `jax.set_mesh`; T and S must be multiples of its `axis_name` size n.
    axis_name: the mesh axis the sequence is split over.
    is_causal: static; query t sees keys s <= t (global positions).
    scale: static logits multiplier, default 1/sqrt(K).
    batch_axis: optional mesh axis to split B over as well (data parallelism); it must divide B.
    head_axis: optional mesh axis to split H and G over as well (tensor parallelism); it must
      divide both.
    mods: optional `flax_mha.mods.Mods` of index-only terms (windows, soft-capping, mask_mod /
      score_mod functions that close over no arrays), seen at global positions, and sinks [H]
      (learned: differentiable).
    return_residual: also return the log-sum-exp [B, T, H] (float32; no gradient).

  Returns:
    [B, T, H, V] in the query dtype, differentiable in q, k, v (and the sinks). On Auto axes it is laid out as
    P(batch_axis, axis_name, head_axis) and `jit` propagates that. Explicit axes are part of the
    array's type, so the inputs are resharded to that layout on the way in and the output back
    to the query's type on the way out: a query already laid out so moves nothing.
  """
  checks.check_qkv(query, key, value)
  if query.ndim != 4:
    raise ValueError(f"query must be [B, T, H, K], got shape {tuple(query.shape)}")
  if not isinstance(is_causal, bool):
    raise TypeError(f"is_causal must be a Python bool, got {type(is_causal).__name__}")
  checks.check_scale(scale)
  (b, t, h, _), (s, g) = query.shape, key.shape[1:3]
  if mask is not None:
    checks.check_broadcast("mask", mask, (b, h, t, s), boolean=True)
    mask = jnp.asarray(mask).reshape((1,) * (4 - mask.ndim) + mask.shape)
  _check_axes(mesh, axis_name, batch_axis, head_axis)
  _check_divides(mesh, "axis_name", axis_name, ("query length T", t), ("key length S", s),
                 fix="pad the sequences to a multiple of it")
  _check_divides(mesh, "batch_axis", batch_axis, ("the batch B", b), fix="pass batch_axis=None")
  _check_divides(mesh, "head_axis", head_axis, ("query heads H", h), ("key/value heads G", g),
                 fix="pass head_axis=None")
  scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
  spec = P(batch_axis, axis_name, head_axis)
  mask_spec = None if mask is None else P(
      *(axis if size > 1 else None
        for axis, size in zip((batch_axis, head_axis, axis_name), mask.shape[:3])), None)
  _check_mods(mods, batch_axis, head_axis)
  sinks = None if mods is None else mods.sinks
  sinks_spec = None if sinks is None else P(head_axis)
  mods = None if mods is None else dataclasses.replace(mods, sinks=None)  # static from here
  # A sink's gradient sums over the devices that share it (the sequence and batch shards):
  # shard_map's transpose of a replicated input does that sum.
  local = functools.partial(_ring, axis_name=axis_name, n=mesh.shape[axis_name],
                            is_causal=is_causal, scale=scale, mods=mods)
  ring = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, mask_spec, sinks_spec),
                       out_specs=(spec, P(batch_axis, axis_name, head_axis)), check_vma=False)
  args = (_to_explicit(x, x_spec, mesh) for x, x_spec in zip(
      (query, key, value, mask, sinks), (spec, spec, spec, mask_spec, sinks_spec)))
  out, lse = ring(*args)
  out = _to_explicit(out, P(*jax.typeof(query).sharding.spec[:3]), mesh)
  return (out, lax.stop_gradient(lse)) if return_residual else out


def unsupported_reason(bias, dropout_rate, mods=None) -> str | None:
  """Why ring attention can't run this call (None when it can), the mesh aside: what follows
  "ring attention" in its error."""
  if bias is not None or dropout_rate:
    return (f"supports mask and is_causal, not bias or dropout; got bias="
            f"{'None' if bias is None else 'an array'}, dropout_rate={dropout_rate}")
  return None if mods is None else _array_terms(mods)


def _array_terms(mods) -> str | None:
  if not jax.tree.leaves((mods.masks, mods.scores)):
    return None
  kinds = sorted({type(t).__name__ for t in (*mods.masks, *mods.scores) if jax.tree.leaves(t)})
  return ("takes windows, soft-capping and mask_mod/score_mod functions of the indices only, "
          f"got terms holding arrays: {kinds} (segment ids, sequence lengths or closed-over "
          "arrays): use implementation='chunked' on one device, or a mask")


def _check_mods(mods, batch_axis, head_axis):
  """Ring attention takes index-only mask and score terms (positions are global on every device);
  arrays (segment ids, lengths, a score_mod's table) would need sharding of their own."""
  if mods is None:
    return
  reason = _array_terms(mods)
  if reason is not None:
    raise ValueError(f"ring attention {reason}")
  reads_bh = any(isinstance(t, mods_lib.MaskMod) and t.sizes != (1, 1) for t in mods.masks)
  reads_bh |= any(isinstance(t, mods_lib.ScoreMod) for t in mods.scores)
  if reads_bh and (batch_axis or head_axis):
    raise ValueError(
        "a mask_mod reading b or h, or a score_mod, sees device-local batch and head indices "
        f"when batch_axis={batch_axis!r} or head_axis={head_axis!r} split them: pass None")


def _check_axes(mesh, axis_name, batch_axis, head_axis):
  """Every named axis is one of the mesh's, and no two dims share one."""
  names = tuple(mesh.axis_names)
  if axis_name not in names:
    raise ValueError(f"axis_name={axis_name!r} must be an axis of the mesh {names}: pass one of "
                     "them, or build the mesh with flax_mha.sharding.make_mesh(seq=n)")
  for arg, axis in (("batch_axis", batch_axis), ("head_axis", head_axis)):
    if axis is not None and axis not in names:
      raise ValueError(f"{arg}={axis!r} must be None or an axis of the mesh {names}")
  used = [axis for axis in (axis_name, batch_axis, head_axis) if axis is not None]
  if len(set(used)) != len(used):
    raise ValueError(f"axis_name={axis_name!r}, batch_axis={batch_axis!r} and "
                     f"head_axis={head_axis!r} must be different mesh axes (or None)")


def _check_divides(mesh, arg, axis, *dims, fix: str):
  """The size of mesh `axis` divides every (name, size) in `dims`; `fix` says what to do if not."""
  if axis is None:
    return
  n = mesh.shape[axis]
  if any(size % n for _, size in dims):
    what = " and ".join(f"{name}={size}" for name, size in dims)
    raise ValueError(f"{arg}={axis!r} of size {n} must divide {what}: {fix}, or use a mesh "
                     "whose axis size divides them")


def _to_explicit(x, spec, mesh):
  """`x` resharded to `spec` on the Explicit axes of `mesh` (shard_map requires the types to
  match its specs there); Auto axes are left to shard_map, and without Explicit axes x is kept."""
  if x is None or spec is None:
    return x
  explicit = {axis for axis, kind in zip(mesh.axis_names, mesh.axis_types)
              if kind == AxisType.Explicit}
  if not explicit:
    return x
  spec = P(*(axis if axis in explicit else None for axis in spec))
  return jax.reshard(x, NamedSharding(mesh, spec))


def attention(query, key, value, bias, mask, *, is_causal, scale, dropout_rate, dropout_rng,
              mods=None, return_residual=False):
  """Ring attention over the context mesh, as an `implementation` of `dot_product_attention`.

  Exported as `flax_mha.ring_implementation`:

    with jax.set_mesh(flax_mha.sharding.make_mesh(seq=4)):
      out = flax_mha.dot_product_attention(q, k, v, implementation=flax_mha.ring_implementation)

  The mesh needs a SEQ_AXIS ('seq') axis; B is split over DATA_AXIS and H, G over MODEL_AXIS
  where those axes divide them (not when a mask_mod reads b or h or a score_mod is given: those
  see local indices). Supports masks, causality, index-only mods, sinks and the residual; bias,
  dropout, segment ids, positions and sequence lengths raise.
  """
  del dropout_rng
  reason = unsupported_reason(bias, dropout_rate, mods)
  if reason is not None:
    raise ValueError(f"ring attention {reason}")
  mesh = jax.sharding.get_abstract_mesh()
  if SEQ_AXIS not in mesh.axis_names:
    raise ValueError(f"ring attention needs a mesh with a {SEQ_AXIS!r} axis in context: call it "
                     "under `with jax.set_mesh(flax_mha.sharding.make_mesh(seq=n))`, got "
                     f"{mesh}")

  def axis(name, *sizes):
    divides = name in mesh.axis_names and all(x % mesh.shape[name] == 0 for x in sizes)
    return name if divides and mesh.shape[name] > 1 else None

  reads_bh = mods is not None and (
      any(isinstance(t, mods_lib.ScoreMod) for t in mods.scores) or
      any(isinstance(t, mods_lib.MaskMod) and t.sizes != (1, 1) for t in mods.masks))
  return ring_attention(query, key, value, mask, mesh=mesh, is_causal=is_causal, scale=scale,
                        batch_axis=None if reads_bh else axis(DATA_AXIS, query.shape[0]),
                        head_axis=None if reads_bh else axis(MODEL_AXIS, query.shape[2],
                                                             key.shape[2]),
                        mods=mods, return_residual=return_residual)


def _shift(xs, axis_name: str, n: int):
  """Send every array in `xs` to the next device on the ring."""
  perm = [(i, (i + 1) % n) for i in range(n)]
  return tuple(lax.ppermute(x, axis_name, perm) for x in xs)


def _offsets(step, t: int, s: int, axis_name: str, n: int):
  """Global start of this device's query shard and of the key shard it holds at ring `step`."""
  me = lax.axis_index(axis_name)
  return me * t, ((me - step) % n) * s


def _mask_block(mask, kv_offset, s: int):
  """The columns of this device's mask [b, h, t or 1, S or 1] for the key shard at kv_offset."""
  if mask is None or mask.shape[3] == 1:
    return mask
  return lax.dynamic_slice_in_dim(mask, kv_offset, s, axis=3)


def _ring_forward(q, k, v, mask, sinks, axis_name, n, is_causal, scale, mods):
  """Local shards -> (out [B, T/n, H, V], global lse [B, T/n, H]) in the softmax dtype."""
  b, t, h, _ = q.shape
  acc = _shared.softmax_dtype(q.dtype)
  kernel = functools.partial(chunked_forward, scale=scale, is_causal=is_causal, mods=mods)

  def step(i, carry):
    out, lse, k_i, v_i = carry
    q_offset, kv_offset = _offsets(i, t, k.shape[1], axis_name, n)
    out_i, lse_i = kernel(q, k_i, v_i, q_offset=q_offset, kv_offset=kv_offset,
                          mask=_mask_block(mask, kv_offset, k.shape[1]))
    lse_i = lse_i.transpose(0, 2, 1)  # [B, T, H]
    lse_new = jnp.logaddexp(lse, lse_i)
    weight = lambda l: jnp.exp(l - lse_new)[..., None]  # [B, T, H, 1]; finite lse throughout
    out = weight(lse) * out + weight(lse_i) * out_i
    return (out, lse_new, *_shift((k_i, v_i), axis_name, n))

  if sinks is None:  # the lse of a row that has seen no key (see _shared.row_lse)
    lse0 = jnp.full((b, t, h), jnp.finfo(acc).min, acc)
  else:  # every row starts having seen its head's sink (which has no value)
    lse0 = jnp.broadcast_to(sinks.astype(acc), (b, t, h))
  init = (jnp.zeros((b, t, h, v.shape[-1]), acc), lse0, k, v)
  out, lse, _, _ = lax.fori_loop(0, n, step, init)
  return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _ring(q, k, v, mask, sinks, axis_name, n, is_causal, scale, mods):
  out, lse = _ring_forward(q, k, v, mask, sinks, axis_name, n, is_causal, scale, mods)
  return out.astype(q.dtype), lse


def _ring_fwd(q, k, v, mask, sinks, axis_name, n, is_causal, scale, mods):
  out, lse = _ring_forward(q, k, v, mask, sinks, axis_name, n, is_causal, scale, mods)
  out = out.astype(q.dtype)
  return (out, lse), (q, k, v, mask, sinks, out, lse)


def _ring_bwd(axis_name, n, is_causal, scale, mods, residuals, cotangents):
  q, k, v, mask, sinks, out, lse = residuals
  dout = cotangents[0]  # the lse is returned without gradient
  lse_BHT = lse.transpose(0, 2, 1)
  kernel = functools.partial(chunked_backward, scale=scale, is_causal=is_causal, mods=mods)

  def step(i, carry):
    dq, k_i, v_i, dk_i, dv_i = carry
    q_offset, kv_offset = _offsets(i, q.shape[1], k.shape[1], axis_name, n)
    dq_i, dk_c, dv_c = kernel(q, k_i, v_i, out, lse_BHT, dout, q_offset=q_offset,
                              kv_offset=kv_offset, mask=_mask_block(mask, kv_offset, k.shape[1]))
    # The accumulators travel with their key/value shard; after n hops they are back home.
    return (dq + dq_i, *_shift((k_i, v_i, dk_i + dk_c, dv_i + dv_c), axis_name, n))

  zeros = lambda x: jnp.zeros(x.shape, _shared.softmax_dtype(q.dtype))
  dq, _, _, dk, dv = lax.fori_loop(0, n, step, (zeros(q), k, v, zeros(k), zeros(v)))
  dsinks = None
  if sinks is not None:
    dsinks = _shared.sink_grad(sinks, lse, out, dout)  # this shard's part (see ring_attention)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, dsinks


_ring.defvjp(_ring_fwd, _ring_bwd)
