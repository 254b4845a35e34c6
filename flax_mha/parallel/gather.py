"""The "all_gather" and "ulysses" strategies of sequence parallelism: one device's part, run
inside `shard_map` by `flax_mha.parallel.seq_parallel`.

- all_gather (maxtext's default; kvax): every device gathers the whole key and value sequence
  (`lax.all_gather` over the axis) and attends with its own query shard. One collective, no
  loop; per-device memory holds all S keys (linear in S, times G·(K + V): small under GQA).
  Its gradient scatters dK, dV back (`psum_scatter`, all_gather's transpose).
- ulysses (DeepSpeed-Ulysses): an all-to-all turns sequence shards of all heads into head
  shards of the whole sequence, each device attends over the full sequence with H/n query and
  G/n key/value heads, and an all-to-all turns the output back. Needs H and G divisible by n.

Both hand the local problem to the chunked kernel's `attention` (its own backward, linear
memory), with the mask terms at the tokens' true positions (`seqmods.localize`), so they take
everything the single-device API does: segment ids, lengths, positions, windows, mask_mod and
score_mod closing over arrays (differentiable), sinks, a bias.
"""

from __future__ import annotations

from jax import lax

from flax_mha.parallel import seqmods
from flax_mha.kernels import chunked
from flax_mha.parallel.seqmods import HEADS, KV, Q


def _gather(x, plan: seqmods.Plan, axis: int):
  """x gathered along `axis` over the sequence devices (device-major order)."""
  if x is None or x.shape[axis] == 1:
    return x
  return lax.all_gather(x, plan.axis_name, axis=axis, tiled=True)


def _local(q, k, v, bias, mask, mods, plan: seqmods.Plan, q_pos, kv_pos, h_offset=0):
  """chunked attention of local q over k, v with the terms at true positions: (out, lse)."""
  mods = seqmods.localize(mods, plan.is_causal, q_pos, kv_pos, batch=q.shape[0],
                           heads=q.shape[2], h_offset=h_offset)
  return chunked.attention(q, k, v, bias, mask, is_causal=False, scale=plan.scale,
                           dropout_rate=0.0, dropout_rng=None, mods=mods, return_residual=True)


def all_gather(q, k, v, bias, mask, leaves, plan: seqmods.Plan):
  """One device's all-gather attention: (out [B, T/n, H, V], lse [B, T/n, H]).

  q [B, T/n, H, K], k [B, S/n, G, K], v [B, S/n, G, V], bias and mask [b, h, T/n or 1, S or 1]
  (rows this device's, all columns) in the layout's order; `leaves` the leaves of the Mods (`plan.treedef`), this device's."""
  k, v = _gather(k, plan, 1), _gather(v, plan, 1)  # the mask and bias hold every key already
  leaves = plan.replace_side(leaves, KV, [_gather(x, plan, 1) for x in plan.of_side(leaves, KV)])
  me = lax.axis_index(plan.axis_name)
  return _local(q, k, v, bias, mask, plan.mods(leaves), plan, plan.positions(plan.t, me),
                plan.all_positions(plan.s))


def _heads_of(x, axis: int, plan: seqmods.Plan):
  """This device's 1/n of the heads of x along `axis` (broadcast dims of size 1 kept)."""
  if x is None or x.shape[axis] == 1:
    return x
  size = x.shape[axis] // plan.n
  return lax.dynamic_slice_in_dim(x, lax.axis_index(plan.axis_name) * size, size, axis=axis)


def ulysses(q, k, v, bias, mask, leaves, plan: seqmods.Plan):
  """One device's Ulysses attention, same arguments and results as `all_gather`; the local H
  and G must be multiples of n."""
  to_heads = lambda x: lax.all_to_all(x, plan.axis_name, 2, 1, tiled=True)  # [B, T, H/n, .]
  to_tokens = lambda x: lax.all_to_all(x, plan.axis_name, 1, 2, tiled=True)  # [B, T/n, H, .]
  h_local = q.shape[2] // plan.n
  bias, mask = (_heads_of(_gather(x, plan, 2), 1, plan) for x in (bias, mask))
  leaves = plan.replace_side(leaves, Q, [_gather(x, plan, 1) for x in plan.of_side(leaves, Q)])
  leaves = plan.replace_side(leaves, KV, [_gather(x, plan, 1) for x in plan.of_side(leaves, KV)])
  leaves = plan.replace_side(leaves, HEADS, [_heads_of(x, 0, plan)
                                             for x in plan.of_side(leaves, HEADS)])
  out, lse = _local(to_heads(q), to_heads(k), to_heads(v), bias, mask, plan.mods(leaves), plan,
                    plan.all_positions(plan.t), plan.all_positions(plan.s),
                    h_offset=lax.axis_index(plan.axis_name) * h_local)
  return to_tokens(out), to_tokens(lse)
