"""Ring attention (Liu et al., 2023): the "ring" strategy of sequence parallelism.

One device's part, run inside `shard_map` by `flax_mha.parallel.seq_parallel`: it keeps its query
shard and passes its key/value shard around the ring (`lax.ppermute` to the next device); at
each of n steps it runs a step kernel (its `registry.Block`, the kernel's own entry for the
layout "ring_block") on the (query shard, visiting key shard) pair
and merges the partial result into its running output by log-sum-exp. The step kernel is the
platform's, staged with `lax.platform_dependent`: on 'cuda' flax_mha's Triton kernel
(`flax_mha.kernels.triton.make_block`) where it takes the step and may be staged (a process with
a GPU, or `flax_mha.stage_accelerator_kernels()`), chunked's tiles (`flax_mha.kernels.chunked`)
everywhere else. On 'tpu' too: splash's public API has no backward from a global lse, which
the ring's backward needs. An accelerator step that the mask terms hide entirely is skipped
(`_unless_hidden`), as chunked skips hidden tiles.
A loop of n - 1 steps each sends the visiting shard on before computing on it (the transfer
reads the shard alone, not the step's compute, so XLA may overlap the two); the last shard is
computed after the loop and sent nowhere: n - 1 hops, no conditional. No device ever holds more
than two key/value shards (the visiting one and the one arriving) or one [T/n, S/n] tile set,
so per-device memory falls as 1/n. The backward (a `jax.custom_vjp`) sends K/V around the ring
again together with their gradient accumulators dK/dV (each step adds to them and sends them
on), each device adding its query shard's contribution from the GLOBAL lse saved by the
forward; after n hops the accumulators are home. Its loop sends K/V n times, the last hop
unused, rather than peel a step off (see `_ring_bwd`).

The arrays of the key side of the mask terms (segment ids, positions) travel with their shard.
Visibility compares the tokens' true positions (`flax_mha.parallel.seqmods.localize`), whatever
the layout: a visiting shard entirely in a query shard's future costs no tile (the kernel skips
tiles that its masks hide), so a balanced layout (zigzag, striped) balances the work per step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from flax_mha import dispatch
from flax_mha import mods as mods_lib
from flax_mha.kernels import common
from flax_mha.kernels import registry
from flax_mha.kernels import triton
from flax_mha.parallel import seqmods
from flax_mha.parallel.seqmods import HEADS, KV


def explain_step(query, key, value, mask=None, *, mods=None, platform: str = "cpu"):
  """What one ring step of these shards' shapes (query [B, T, H, K], the visiting key and
  value shards [B, S, G, K|V], `mods` at the step's positions) runs on `platform`, and why:
  `flax_mha.dispatch`'s choice for the layout "ring_block"."""
  return dispatch.explanation(registry.Call.of(query, key, value, None, mask, mods=mods,
                                               platform=platform, layout="ring_block"))


def _shift(xs, axis_name: str, n: int):
  """Send every array in `xs` to the next device on the ring."""
  perm = [(i, (i + 1) % n) for i in range(n)]
  return tuple(lax.ppermute(x, axis_name, perm) for x in xs)


def _mask_block(mask, src, s: int):
  """The columns of this device's mask [b, h, t or 1, S or 1] for device `src`'s key shard."""
  if mask is None or mask.shape[3] == 1:
    return mask
  return lax.dynamic_slice_in_dim(mask, src * s, s, axis=3)


def _step_terms(plan: seqmods.Plan, i, q, k_i, mask, leaves, kv_leaves):
  """(mask, mods) of ring step i, the visiting shard's key-side arrays being `kv_leaves`: its
  mask columns and its terms at true positions (no sinks)."""
  me = lax.axis_index(plan.axis_name)
  src = (me - i) % plan.n  # whose key/value shard this device holds at step i
  mods = plan.mods(plan.replace_side(leaves, KV, kv_leaves))
  mods = seqmods.localize(mods, plan.is_causal, plan.positions(plan.t, me),
                           plan.positions(plan.s, src), batch=q.shape[0], heads=q.shape[2])
  return _mask_block(mask, src, k_i.shape[1]), dataclasses.replace(mods, sinks=None)


def _step_kernel(plan: seqmods.Plan, which: str, q, k, v, mask, leaves):
  """fn(*arrays, mask, mods) -> the step's `which` ("forward" or "backward") of the platform's
  Block, staged per platform with `lax.platform_dependent` where the platforms' Blocks differ."""
  mask_0, mods_0 = _step_terms(plan, 0, q, k, mask, leaves, plan.of_side(leaves, KV))
  call = registry.Call.of(q, k, v, None, mask_0, mods=mods_0, platform="cpu",
                          layout="ring_block")
  picks = dispatch.per_platform(call)
  static = dict(scale=plan.scale, is_causal=False, block_q=plan.block(q.shape[1]),
                block_k=plan.block(k.shape[1]))
  def run(name):
    block = registry.entry(name, "ring_block")  # the kernel's `registry.Block`
    fn = lambda *arrays, mask, mods: getattr(block, which)(*arrays, mask=mask, mods=mods,
                                                          **static)
    return fn if block.skips_hidden_tiles else _unless_hidden(fn, which)
  if len(set(picks.values())) == 1:
    return run(picks["cpu"])

  def staged(*arrays, mask, mods):
    branch = lambda name: lambda *a: run(name)(*a[:-2], mask=a[-2], mods=a[-1])
    return dispatch.staged(picks, branch, *arrays, mask, mods)
  return staged


def _unless_hidden(fn, which: str):
  """A Block's `fn` run only where the step's mask terms leave some key of the visiting shard
  visible to some query (`lax.cond` on one tile over the whole shard pair: a causal ring's
  steps over future shards cost nothing); a hidden step gives what `fn` would: out 0 and lse
  finfo.min forward, zero gradients backward."""
  def run(*arrays, mask, mods):
    t, s = arrays[0].shape[1], arrays[1].shape[1]
    maybe, _ = mods.tile_map(mods_lib.make_tiles(t, s, t, s))
    step = lambda *a: fn(*a, mask=mask, mods=mods)
    shapes = jax.eval_shape(step, *arrays)
    fill = lambda i, x: jnp.full(x.shape, triton.tiles.LOWEST if which == "forward" and i == 1
                                 else 0, x.dtype)
    hidden = lambda *a: tuple(fill(i, x) for i, x in enumerate(shapes))
    return lax.cond(jnp.asarray(maybe).reshape(()), step, hidden, *arrays)
  return run


def _ring_forward(q, k, v, mask, leaves, plan: seqmods.Plan):
  """Local shards -> (out [B, T/n, H, V], global lse [B, T/n, H]) in the softmax dtype."""
  b, t, h, _ = q.shape
  acc = common.softmax_dtype(q.dtype)

  block = _step_kernel(plan, "forward", q, k, v, mask, leaves)

  def merge(i, out, lse, k_i, v_i, kv_leaves):
    step_mask, step_mods = _step_terms(plan, i, q, k_i, mask, leaves, kv_leaves)
    out_i, lse_i = block(q, k_i, v_i, mask=step_mask, mods=step_mods)
    out_i, lse_i = out_i.astype(acc), lse_i.transpose(0, 2, 1).astype(acc)  # lse [B, T, H]
    lse_new = jnp.logaddexp(lse, lse_i)
    weight = lambda l: jnp.exp(l - lse_new)[..., None]  # [B, T, H, 1]; finite lse throughout
    return weight(lse) * out + weight(lse_i) * out_i, lse_new

  def step(i, carry):
    out, lse, k_i, v_i, kv_leaves = carry
    # The next shard's transfer is issued first and reads this shard alone, not this step's
    # compute: XLA is free to overlap the two.
    k_next, v_next, *kv_next = _shift((k_i, v_i, *kv_leaves), plan.axis_name, plan.n)
    return (*merge(i, out, lse, k_i, v_i, kv_leaves), k_next, v_next, kv_next)

  sinks = plan.of_side(leaves, HEADS)
  if not sinks:  # the lse of a row that has seen no key (see common.row_lse)
    lse0 = jnp.full((b, t, h), jnp.finfo(acc).min, acc)
  else:  # every row starts having seen its head's sink (which has no value)
    lse0 = jnp.broadcast_to(sinks[0].astype(acc), (b, t, h))
  init = (jnp.zeros((b, t, h, v.shape[-1]), acc), lse0, k, v, plan.of_side(leaves, KV))
  # n - 1 steps that each pass a shard on, then the last shard, which no device needs after.
  out, lse, k_i, v_i, kv_leaves = lax.fori_loop(0, plan.n - 1, step, init)
  return merge(plan.n - 1, out, lse, k_i, v_i, kv_leaves)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def ring(q, k, v, mask, leaves, plan: seqmods.Plan):
  """One device's ring attention: (out [B, T/n, H, V], lse [B, T/n, H]) of its query shard.

  q [B, T/n, H, K], k [B, S/n, G, K], v [B, S/n, G, V] and the mask [b, h, T/n or 1, S or 1]
  in the layout's order; `leaves` the leaves of the Mods (`plan.treedef`), the key-side ones
  this device's. Differentiable in q, k, v and the sinks (not in score terms' arrays)."""
  out, lse = _ring_forward(q, k, v, mask, leaves, plan)
  return out.astype(q.dtype), lse


def _ring_fwd(q, k, v, mask, leaves, plan):
  out, lse = _ring_forward(q, k, v, mask, leaves, plan)
  out = out.astype(q.dtype)
  return (out, lse), (q, k, v, mask, leaves, out, lse)


def _ring_bwd(plan, residuals, cotangents):
  q, k, v, mask, leaves, out, lse = residuals
  dout = cotangents[0]  # the lse is returned without gradient
  lse_BHT = lse.transpose(0, 2, 1)
  block = _step_kernel(plan, "backward", q, k, v, mask, leaves)
  acc = common.softmax_dtype(q.dtype)

  def step(i, carry):
    dq, k_i, v_i, dk_i, dv_i, kv_leaves = carry
    # As in the forward, the next shard's transfer reads this one alone. All n trips send it
    # (the last hop brings the shards home, unused): peeling the last trip off, as the forward
    # does, raised the compiled memory of forward + backward by about a third
    # (`python -m experiments.bench.ring`): XLA does not share the loop's buffers with it.
    k_next, v_next, *kv_next = _shift((k_i, v_i, *kv_leaves), plan.axis_name, plan.n)
    step_mask, step_mods = _step_terms(plan, i, q, k_i, mask, leaves, kv_leaves)
    dq_i, dk_c, dv_c = (x.astype(acc) for x in block(q, k_i, v_i, out, lse_BHT, dout,
                                                     mask=step_mask, mods=step_mods))
    # The accumulators travel with their key/value shard; after n hops they are back home.
    dk_i, dv_i = _shift((dk_i + dk_c, dv_i + dv_c), plan.axis_name, plan.n)
    return dq + dq_i, k_next, v_next, dk_i, dv_i, kv_next

  zeros = lambda x: jnp.zeros(x.shape, acc)
  dq, _, _, dk, dv, _ = lax.fori_loop(  # K/V and dK/dV hop n times
      0, plan.n, step, (zeros(q), k, v, zeros(k), zeros(v), plan.of_side(leaves, KV)))
  # A sink's gradient: this shard's part; shard_map's transpose sums the devices sharing it.
  dleaves = [common.sink_grad(x, lse, out, dout) if side == HEADS else None
             for x, side in zip(leaves, plan.sides)]
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, dleaves


ring.defvjp(_ring_fwd, _ring_bwd)
