"""Sequence (context) parallelism: exact attention with the sequence split over a mesh axis.

Query, key and value are split along the sequence over n devices of one mesh axis, in one of
the token layouts of `flax_mha.parallel.layouts` (contiguous, zigzag, striped: the permutation
is applied to every sequence-shaped input once here and undone at the output), and each device
computes its query shard's rows by one of three strategies:

  ring        key/value shards travel around the ring, one per step (`flax_mha.parallel.ring`):
              memory per device falls as 1/n; takes no bias and no differentiable score_mod.
  all_gather  each device gathers all keys/values, then attends locally
              (`flax_mha.parallel.gather`): one collective, every option of the single-device API.
  ulysses     all-to-all from sequence shards to head shards and back (`flax_mha.parallel.gather`):
              moves 1/n of what the others move; needs H and G divisible by n.
  auto        one of them, by `choose_strategy`'s rule.

Each device hands its local problem to the chunked kernel (the ring: to its platform's step
kernel, `flax_mha.parallel.ring.Block`) with the mask terms at the tokens' true positions
(`flax_mha.parallel.seqmods`), so every strategy x layout computes the function of
`flax_mha.dot_product_attention` on one device (tests/multidevice/check_ring.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec as P

from flax_mha import call_options
from flax_mha import checks
from flax_mha import mods as mods_lib
from flax_mha.parallel import layouts
from flax_mha.parallel import seqmods
from flax_mha.kernels import chunked
from flax_mha.parallel import gather
from flax_mha.parallel import ring
from flax_mha.parallel.sharding import DATA_AXIS, MODEL_AXIS, SEQ_AXIS
from flax_mha.kernels import registry


def _ring(q, k, v, bias, mask, leaves, plan):
  del bias  # refused before
  return ring.ring(q, k, v, mask, leaves, plan)


# name -> fn(q, k, v, bias, mask, mods leaves, plan) -> (out [B, T/n, H, V], lse [B, T/n, H]),
# one device's part inside shard_map.
STRATEGIES = {"ring": _ring, "all_gather": gather.all_gather, "ulysses": gather.ulysses}
# Where the caller's tokens are: in their natural order (moved to the layout and back inside),
# or already in the layout's order (`to_layout_order`: a batch permuted once for a whole model).
TOKENS = ("natural", "in_layout")
# `auto` gathers keys/values when one device's copy of all of them is at most this big,
AUTO_GATHER_MAX_BYTES = 256 * 2**20
# unless the static masks leave at most this many shards' worth of keys visible to a query shard.
AUTO_RING_VISIBLE_SHARDS = 1.0


def sequence_parallel_attention(query, key, value, mask=None, *, mesh: Mesh | AbstractMesh,
                                strategy: str = "ring", layout: str = "contiguous",
                                axis_name: str = SEQ_AXIS, is_causal: bool = False,
                                scale: float | None = None, batch_axis: str | None = None,
                                head_axis: str | None = None, bias=None, mods=None,
                                tokens: str = "natural", return_residual: bool = False,
                                **options):
  """Exact attention with the sequence split over `mesh`'s `axis_name`.

  Args:
    query: [B, T, H, K] global array (sharded or not; it is laid out as T over `axis_name`).
    key: [B, S, G, K], H a multiple of G (GQA).
    value: [B, S, G, V].
    mask: optional boolean (True = attend) broadcasting to [B, H, T, S]. It is split like the
      query along T (a key-padding mask [B, 1, 1, S] is not split at all), so a full [B, 1, T, S]
      mask costs T·S/n booleans per device.
    mesh: the device mesh, its axes Auto or Explicit (`jax.make_mesh` makes Explicit ones), or
      the abstract mesh of `jax.set_mesh`.
    strategy: static, "ring", "all_gather", "ulysses" or "auto" (see the module docstring).
    layout: static, "contiguous", "zigzag" or "striped": which tokens each device holds
      (`flax_mha.parallel.layouts`). T and S must be multiples of n (2n for zigzag).
    axis_name: the mesh axis the sequence is split over.
    is_causal: static; query t sees keys s <= t (global positions, top-left aligned).
    scale: static logits multiplier, default 1/sqrt(K).
    batch_axis: optional mesh axis to split B over as well (data parallelism); it must divide B.
    head_axis: optional mesh axis to split H and G over as well (tensor parallelism); it must
      divide both.
    bias: optional floating bias broadcasting to [B, H, T, S], split like the mask (not with
      strategy "ring").
    mods: optional `flax_mha.mods.Mods` (what `dot_product_attention`'s options build: windows,
      lengths, segment ids, positions, soft-capping, mask_mod / score_mod, sinks), seen at
      global positions. A mask_mod reading b or h, or a score_mod, needs batch_axis and
      head_axis None (they would see local indices).
    **options: instead of `mods`, `dot_product_attention`'s keyword options themselves
      (local_window_size, query_seq_lengths, key_value_seq_lengths, q_segment_ids,
      kv_segment_ids, q_positions, kv_positions, logit_soft_cap, mask_mod, score_mod, sinks,
      sink_tokens), checked and built into mods as there (`flax_mha.call_options.build`).
    tokens: static, "natural" (the tokens in their order: moved to the layout inside and back)
      or "in_layout": the sequence dims of query, key, value, mask, bias and the arrays of
      segment ids and positions are in the layout's order already (`to_layout_order`), and so
      is the output. A model that reads token order only through attention (positions come
      with the batch, the loss sums over tokens) permutes its batch once rather than moving
      q, k, v and the output at every call.
    return_residual: also return the log-sum-exp [B, T, H] (float32; no gradient).

  Returns:
    [B, T, H, V] in the query dtype, differentiable in q, k, v, the bias, the sinks and a
    score_mod's arrays. On Auto axes it is laid out as P(batch_axis, axis_name, head_axis) and
    `jit` propagates that. Explicit axes are part of the array's type, so the inputs are
    resharded to that layout on the way in and the output back to the query's type on the way
    out: a query already laid out so (contiguous layout) moves nothing.
  """
  checks.check_qkv(query, key, value)
  if query.ndim != 4:
    raise ValueError(f"query must be [B, T, H, K], got shape {tuple(query.shape)}")
  checks.check_is_causal(is_causal)
  checks.check_scale(scale)
  if mods is not None and not isinstance(mods, mods_lib.Mods):
    raise TypeError(f"mods must be None or a flax_mha.mods.Mods, got {type(mods).__name__}")
  if not isinstance(return_residual, bool):
    raise TypeError(f"return_residual must be a Python bool, got {type(return_residual).__name__}")
  (b, t, h, _), (s, g) = query.shape, key.shape[1:3]
  if options:
    call_options.check_names(options)
    if mods is not None:
      raise ValueError(f"pass mods or the keyword options {sorted(options)}, not both: the "
                       "options build the mods")
    mods, is_causal = call_options.build((b,), t, s, h, query.dtype, is_causal, **options)
  mask, bias = _rank4("mask", mask, (b, h, t, s), True), _rank4("bias", bias, (b, h, t, s), False)
  _check_axes(mesh, axis_name, batch_axis, head_axis)
  layout = layouts.check_layout(layout)
  if not isinstance(tokens, str) or tokens not in TOKENS:
    raise ValueError(f"tokens must be one of {TOKENS}, got {tokens!r}")
  n = mesh.shape[axis_name]
  _check_divides(mesh, "batch_axis", batch_axis, ("the batch B", b), fix="pass batch_axis=None")
  _check_divides(mesh, "head_axis", head_axis, ("query heads H", h), ("key/value heads G", g),
                 fix="pass head_axis=None")
  multiple = layouts.multiple(layout, n)
  if t % multiple or s % multiple:
    raise ValueError(
        f"axis_name={axis_name!r} of size {n} must divide the query length T={t} and the key "
        f"length S={s}{' twice (layout zigzag)' if multiple > n else ''}: pad the sequences "
        "to a multiple of it, or use a mesh whose axis size divides them")
  _check_mods(mods, batch_axis, head_axis)
  heads = (h // _size(mesh, head_axis), g // _size(mesh, head_axis))  # per device
  if strategy == "auto":
    strategy, _ = choose_strategy(query, key, value, n=n, heads=heads, is_causal=is_causal,
                                  bias=bias, mods=mods)
  _check_strategy(strategy, n, heads, bias, mods)
  scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
  mods = mods_lib.Mods() if mods is None else mods
  leaves, treedef = jax.tree.flatten(mods)
  plan = seqmods.Plan(axis_name, n, layout, t, s, is_causal, scale, treedef,
                       tuple(seqmods.sides(mods)))
  out, lse = _run(STRATEGIES[strategy], plan, tokens == "natural", mesh, batch_axis, head_axis,
                  query, key, value, bias, mask, leaves)
  out = _to_explicit(out, P(*jax.typeof(query).sharding.spec[:3]), mesh)
  return (out, jax.lax.stop_gradient(lse)) if return_residual else out


def _run(local, plan, move: bool, mesh, batch_axis, head_axis, query, key, value, bias, mask,
         leaves):
  """`local` on every device, the sequence-shaped inputs in the layout's order and, if `move`,
  the outputs back: (out [B, T, H, V], lse [B, T, H]). Rows move between devices inside
  shard_map (`layouts.to_layout`); the key columns of a mask or bias, whole on every device,
  are permuted in place."""
  perm_s = layouts.permutation(plan.layout, plan.s, plan.n) if move else None
  bias, mask = (x if x is None or perm_s is None or x.shape[3] == 1
                else jnp.take(x, perm_s, axis=3) for x in (bias, mask))
  spec = P(batch_axis, plan.axis_name, head_axis)
  specs = {seqmods.Q: P(batch_axis, plan.axis_name), seqmods.KV: P(batch_axis, plan.axis_name),
           seqmods.BATCH: P(batch_axis), seqmods.HEADS: P(head_axis),
           seqmods.REPLICATED: P()}
  leaf_specs = [specs[side] for side in plan.sides]
  dense = lambda x: None if x is None else P(*(
      axis if size > 1 else None
      for axis, size in zip((batch_axis, head_axis, plan.axis_name), x.shape[:3])), None)
  in_specs = (spec, spec, spec, dense(bias), dense(mask), leaf_specs)
  fn = jax.shard_map(functools.partial(_in_layout, local, plan, move), mesh=mesh,
                     in_specs=in_specs,
                     out_specs=(spec, spec), check_vma=False)
  args = [_to_explicit(x, x_spec, mesh) for x, x_spec in zip(
      (query, key, value, bias, mask), in_specs)]
  args.append([_to_explicit(x, x_spec, mesh) for x, x_spec in zip(leaves, leaf_specs)])
  return fn(*args)


def _in_layout(local, plan, move: bool, q, k, v, bias, mask, leaves):
  """One device: its contiguous shards to the layout's tokens, `local`, and back (or, not
  `move`, `local` on shards that hold the layout's tokens already)."""
  if not move:
    return local(q, k, v, bias, mask, leaves, plan)
  to = lambda x, axis: None if x is None else layouts.to_layout(
      x, plan.layout, plan.axis_name, plan.n, axis)
  q, k, v, bias, mask = to(q, 1), to(k, 1), to(v, 1), to(bias, 2), to(mask, 2)
  leaves = [to(x, 1) if side in (seqmods.Q, seqmods.KV) else x
            for x, side in zip(leaves, plan.sides)]
  out, lse = local(q, k, v, bias, mask, leaves, plan)
  return tuple(layouts.from_layout(x, plan.layout, plan.axis_name, plan.n, 1)
               for x in (out, lse))


def choose_strategy(query, key, value, *, n: int, heads: tuple[int, int],
                    is_causal: bool = False, bias=None, mods=None) -> tuple[str, str]:
  """What strategy="auto" runs, and why, from static shapes and masks (`heads`: H and G per
  device):

  1. "ulysses" when n divides both head counts and its all-to-alls move fewer bytes than
     gathering the keys and values: (T·H·(K + V) + S·G·(K + V)) / n < S·G·(K + V), i.e. when
     the query heads are not much more numerous than the key/value heads (MHA, mild GQA).
  2. "all_gather" when the call has a bias or a differentiable score_mod (the ring takes
     neither).
  3. "ring" when the masks known from static shapes (causality, windows, index-only mask_mods:
     `chunked.visited_fraction`, what the dispatch reads) leave at most
     AUTO_RING_VISIBLE_SHARDS / n of the tiles visible: a query shard sees about one shard's
     worth of keys (a narrow window), so all_gather would hold all n shards of keys and values
     (and their gradients) to use about one; the ring holds two and skips the tiles its masks
     hide at every step. It pays in bytes: as many forward (n - 1 shards), more backward (K/V
     again, and dK/dV), where all_gather keeps what it gathered.
  4. "all_gather" when one device's copy of all keys and values is at most
     AUTO_GATHER_MAX_BYTES: one collective and no loop.
  5. "ring" otherwise: the only strategy whose memory falls as 1/n in S.
  """
  (_, t, _, k_dim), s, v_dim = query.shape, key.shape[1], value.shape[-1]
  h, g = heads
  kv_bytes = s * g * (k_dim + v_dim) * jnp.dtype(key.dtype).itemsize
  q_bytes = t * h * (k_dim + v_dim) * jnp.dtype(query.dtype).itemsize
  if h % n == 0 and g % n == 0 and (q_bytes + kv_bytes) / n < kv_bytes:
    return "ulysses", (f"n={n} divides the heads per device (H={h}, G={g}) and its all-to-alls "
                       f"move (T·H + S·G)·(K + V)/n = {(q_bytes + kv_bytes) // n} bytes < "
                       f"S·G·(K + V) = {kv_bytes} that gathering K/V moves")
  if bias is not None or seqmods.has_float_score_consts(mods):
    return "all_gather", ("a bias or a score_mod over floating arrays, which the ring does not "
                          "take")
  visible = chunked.visited_fraction(t, s, k_dim, is_causal, mods)
  if visible * n <= AUTO_RING_VISIBLE_SHARDS:
    return "ring", (f"the static masks leave {visible:.3f} of the tiles visible <= "
                    f"AUTO_RING_VISIBLE_SHARDS / n = {AUTO_RING_VISIBLE_SHARDS / n:.3f}: a query "
                    "shard sees about one shard of keys: the ring holds two where all_gather "
                    "would hold all n, for the same tiles visited (and more bytes moved in the "
                    "backward)")
  if kv_bytes <= AUTO_GATHER_MAX_BYTES:
    return "all_gather", (f"all keys and values, {kv_bytes} bytes, fit one device "
                          f"(<= AUTO_GATHER_MAX_BYTES = {AUTO_GATHER_MAX_BYTES}): one "
                          "collective, no loop")
  return "ring", (f"all keys and values, {kv_bytes} bytes, exceed AUTO_GATHER_MAX_BYTES = "
                  f"{AUTO_GATHER_MAX_BYTES}: the ring's memory falls as 1/n in S")


def unsupported_reason(bias, dropout_rate, mods=None, strategy: str = "ring") -> str | None:
  """Why `strategy` cannot run this call (None when it can), the mesh and head counts aside."""
  if dropout_rate:
    return f"has no dropout, got dropout_rate={dropout_rate}"
  if strategy == "ring" and bias is not None:
    return "takes a mask, not a bias: use strategy='all_gather'"
  if strategy == "ring" and seqmods.has_float_score_consts(mods):
    return ("takes no score_mod closing over floating arrays (their gradient): use "
            "strategy='all_gather'")
  return None


def _check_strategy(strategy, n: int, heads: tuple[int, int], bias, mods):
  if not isinstance(strategy, str) or strategy not in STRATEGIES:
    raise ValueError(f"strategy must be one of {(*STRATEGIES, 'auto')}, got {strategy!r}")
  if strategy == "ulysses" and (heads[0] % n or heads[1] % n):
    raise ValueError(
        f"strategy='ulysses' splits the heads over the {n} sequence devices: it needs the "
        f"query heads ({heads[0]}) and key/value heads ({heads[1]}) per device to be multiples "
        f"of {n}; use strategy='all_gather' or 'ring'")
  reason = unsupported_reason(bias, 0.0, mods, strategy)
  if reason is not None:
    raise ValueError(f"strategy={strategy!r} {reason}")


def _check_mods(mods, batch_axis, head_axis):
  """A user's function reading b or h sees device-local indices when those are split."""
  reads_b, reads_h = seqmods.reads_batch_or_heads(mods)
  if (reads_b and batch_axis) or (reads_h and head_axis):
    raise ValueError(
        "a mask_mod reading b or h, or a score_mod, sees device-local batch and head indices "
        f"when batch_axis={batch_axis!r} or head_axis={head_axis!r} split them: pass None")


def _rank4(name, x, target, boolean: bool):
  if x is None:
    return None
  checks.check_broadcast(name, x, target, boolean=boolean)
  return jnp.asarray(x).reshape((1,) * (4 - x.ndim) + x.shape)


def _size(mesh, axis) -> int:
  return 1 if axis is None else mesh.shape[axis]


def _check_axes(mesh, axis_name, batch_axis, head_axis):
  """Every named axis is one of the mesh's, and no two dims share one."""
  names = tuple(mesh.axis_names)
  if axis_name not in names:
    raise ValueError(f"axis_name={axis_name!r} must be an axis of the mesh {names}: pass one of "
                     "them, or build the mesh with flax_mha.parallel.sharding.make_mesh(seq=n)")
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


def ring_attention(query, key, value, mask=None, *, mesh: Mesh | AbstractMesh,
                   axis_name: str = SEQ_AXIS, is_causal: bool = False, scale: float | None = None,
                   batch_axis: str | None = None, head_axis: str | None = None, mods=None,
                   layout: str = "contiguous", return_residual: bool = False, **options):
  """`sequence_parallel_attention` with strategy="ring" (the arguments are its)."""
  return sequence_parallel_attention(
      query, key, value, mask, mesh=mesh, strategy="ring", layout=layout, axis_name=axis_name,
      is_causal=is_causal, scale=scale, batch_axis=batch_axis, head_axis=head_axis, mods=mods,
      return_residual=return_residual, **options)


@dataclasses.dataclass(frozen=True)
class SequenceParallel:
  """Sequence-parallel attention over the context mesh, as an `implementation` of
  `flax_mha.dot_product_attention` (build it with `flax_mha.sequence_parallel_implementation`;
  `flax_mha.ring_implementation` is the ring over contiguous shards):

    with jax.set_mesh(flax_mha.parallel.sharding.make_mesh(seq=4)):
      out = flax_mha.dot_product_attention(
          q, k, v, is_causal=True, q_segment_ids=ids,
          implementation=flax_mha.sequence_parallel_implementation("all_gather", "zigzag"))

  The mesh needs a SEQ_AXIS ('seq') axis; B is split over DATA_AXIS and H, G over MODEL_AXIS
  where those axes divide them (not when a mask_mod reads b or h or a score_mod is given: those
  would see local indices). Takes every option of `dot_product_attention` but dropout (and,
  with strategy "ring", a bias or a score_mod closing over floating arrays).
  """
  strategy: str = "ring"
  layout: str = "contiguous"
  tokens: str = "natural"  # or "in_layout" (see sequence_parallel_attention)

  def __call__(self, query, key, value, bias, mask, *, is_causal, scale, dropout_rate,
               dropout_rng, mods=None, return_residual=False):
    del dropout_rng
    if dropout_rate:
      raise ValueError(f"sequence-parallel attention has no dropout, got dropout_rate="
                       f"{dropout_rate}")
    if bias is not None and self.strategy == "ring":
      raise ValueError("ring attention supports mask and is_causal, not a bias: use "
                       "sequence_parallel_implementation('all_gather')")
    mesh = jax.sharding.get_abstract_mesh()
    if SEQ_AXIS not in mesh.axis_names:
      raise ValueError(f"sequence-parallel attention needs a mesh with a {SEQ_AXIS!r} axis in "
                       "context: call it under `with jax.set_mesh(flax_mha.parallel.sharding.make_mesh("
                       f"seq=n))`, got {mesh}")
    batch_axis, head_axis = _context_axes(mesh, query, key, mods)
    return sequence_parallel_attention(
        query, key, value, mask, mesh=mesh, strategy=self.strategy, layout=self.layout,
        tokens=self.tokens, is_causal=is_causal, scale=scale, bias=bias, mods=mods,
        return_residual=return_residual, batch_axis=batch_axis, head_axis=head_axis)


def _context_axes(mesh, query, key, mods) -> tuple[str | None, str | None]:
  """(batch_axis, head_axis) of `SequenceParallel` on the context mesh: DATA_AXIS and
  MODEL_AXIS where they divide B and H, G (not when a mask_mod reads b or h, or a score_mod)."""
  def axis(name, *sizes):
    divides = name in mesh.axis_names and all(x % mesh.shape[name] == 0 for x in sizes)
    return name if divides and mesh.shape[name] > 1 else None

  reads_b, reads_h = seqmods.reads_batch_or_heads(mods)
  return (None if reads_b else axis(DATA_AXIS, query.shape[0]),
          None if reads_h else axis(MODEL_AXIS, query.shape[2], key.shape[2]))


def explain_auto(query, key, value, bias, *, is_causal: bool, mods=None) -> str | None:
  """What sequence_parallel_implementation("auto") runs for this call on the context mesh,
  and why (`choose_strategy`); None without a SEQ_AXIS axis in context."""
  mesh = jax.sharding.get_abstract_mesh()
  if SEQ_AXIS not in mesh.axis_names:
    return None
  _, head_axis = _context_axes(mesh, query, key, mods)
  heads = (query.shape[2] // _size(mesh, head_axis), key.shape[2] // _size(mesh, head_axis))
  name, why = choose_strategy(query, key, value, n=mesh.shape[SEQ_AXIS], heads=heads,
                              is_causal=is_causal, bias=bias, mods=mods)
  return f"runs {name!r} on {SEQ_AXIS}={mesh.shape[SEQ_AXIS]}: {why}"


def sequence_parallel_implementation(strategy: str = "ring", layout: str = "contiguous",
                                     tokens: str = "natural") -> SequenceParallel:
  """The `implementation` callable of `dot_product_attention` for `strategy` ("ring",
  "all_gather", "ulysses", "auto") over `layout` ("contiguous", "zigzag", "striped") on the
  'seq' axis of the context mesh, the tokens in their natural order or already in the layout's
  (see `SequenceParallel`, `sequence_parallel_attention`)."""
  if not isinstance(strategy, str) or strategy not in (*STRATEGIES, "auto"):
    raise ValueError(f"strategy must be one of {(*STRATEGIES, 'auto')}, got {strategy!r}")
  if not isinstance(tokens, str) or tokens not in TOKENS:
    raise ValueError(f"tokens must be one of {TOKENS}, got {tokens!r}")
  return SequenceParallel(strategy, layouts.check_layout(layout), tokens)


def to_layout_order(x, layout: str, n: int, axis: int = 1):
  """x (a NumPy or jax array) with its `axis` (a sequence of L tokens) in the order of `layout`
  on n devices: split in n equal parts, part d holds device d's tokens. What
  tokens="in_layout" takes; `from_layout_order` undoes it."""
  perm = layouts.permutation(layouts.check_layout(layout), x.shape[axis], n)
  return x if perm is None else x.take(perm, axis=axis)


def from_layout_order(x, layout: str, n: int, axis: int = 1):
  """The inverse of `to_layout_order`."""
  perm = layouts.permutation(layouts.check_layout(layout), x.shape[axis], n)
  return x if perm is None else x.take(layouts.inverse(perm), axis=axis)


def length_multiple(layout: str, n: int) -> int:
  """What T and S must be multiples of under `layout` on n sequence devices (zigzag cuts a
  sequence into 2n chunks)."""
  return layouts.multiple(layouts.check_layout(layout), n)


# What `flax_mha.ring_implementation` is: the ring over contiguous shards.
attention = SequenceParallel("ring", "contiguous")


def refuses(call: registry.Call) -> str | None:
  """The registry's question for "ring" (`attention` on the context mesh): why it cannot run
  `call`, the context mesh included."""
  reason = unsupported_reason(call.bias, call.dropout_rate, call.mods)
  if reason is None and SEQ_AXIS not in jax.sharding.get_abstract_mesh().axis_names:
    reason = (f"it needs a mesh with a {SEQ_AXIS!r} axis in context (`with "
              "jax.set_mesh(flax_mha.parallel.sharding.make_mesh(seq=n))`), and there is none")
  return reason


KERNEL = registry.register(registry.Kernel(
    "ring", attention, refuses, "ring attention over the 'seq' axis of the context mesh "
    "(other strategies: flax_mha.sequence_parallel_implementation)",
    hints=dict(explain_auto=explain_auto)))
