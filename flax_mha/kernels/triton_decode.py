"""The KV cache's decode step on NVIDIA GPUs: a split-key ("flash decoding") Pallas kernel on the
Triton backend that reads the cache where it lies, what `flax_mha.cache` and
`flax_mha.cache.paged` stage for 'cuda'.

One kernel instance takes one (row b, key/value head g, partition p): the T new queries of the
H/G query heads that read head g form one tile of T·H/G rows (GQA: the cache is read once per
key/value head, never repeated), and the row's key blocks up to its last filled slot are
split into SPLITS contiguous partitions, each walked with an online softmax; the partitions
(and the sinks, a partition of their own) are merged by log-sum-exp outside the kernel. The
keys are read in place in either layout:
  - a contiguous cache, head-major [B, G, S, K]: blocks of BLOCK slots of the row's head;
  - pages [P, page, G, K] with a page table [B, n]: one page per block, found in the table.
An int8 cache (`flax_mha.quant`) is read as int8 blocks and their scales, dequantized in the
kernel by `quant.dequantize` (the one rule, a non-finite entry's code included). Visibility
compares positions (one `mods.Positions` term: causality, a window, sink tokens; an empty slot
holds -1 and is hidden, its value read as 0); the logit soft cap and the
sinks are applied too. Anything else (a dense mask, `mask_mod`/`score_mod`, segment ids, dropout)
is refused by `reason`, and the caller keeps its XLA step.

The backward (a custom VJP, `decode.cache`'s and `decode.paged`'s) is the chunked kernel's
from the output and its lse, over the keys in the API layout (dequantized when int8); decoding
rarely needs it, so it is simple rather than fast. The
settings (BLOCK, SPLITS) are not tuned: no GPU has run this code. `make_attention(interpret=True)`
is the kernel in Pallas interpret mode on any platform, for `implementation=` of a cache step
or `paged_attention` (the tests' CPU check); "triton_decode" names it compiled.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flax_mha import mods as mods_lib
from flax_mha import platforms
from flax_mha import quant
from flax_mha.kernels import triton_tiles as tiles
from flax_mha.kernels import common
from flax_mha.kernels import decode
from flax_mha.kernels import registry
from flax_mha.kernels import triton

BLOCK = 64  # slots per key block of a contiguous cache (a setting, not tuned)
SPLITS = 8  # partitions of each row's keys, run in parallel (a setting, not tuned)
MAX_ROWS = 256  # T · H/G query rows of one key/value head: one tile


@dataclasses.dataclass(frozen=True)
class Spec:
  """The static facts of one call (hashable)."""
  rows: int  # query rows per key/value head, T · H/G padded to a power of two >= 16
  bk: int  # keys per block (a page when paged)
  scale: float
  positions: tuple  # (causal, window, sink_tokens) of the Positions term
  scores: tuple  # mods.SoftCap terms
  paged: bool
  quantized: bool  # int8 keys and values, with their scales
  splits: int
  interpret: bool


def reason(query_BTHK, g: int, k_dim: int, v_dim: int, mods, *, mask=None, dropout_rate=0.0,
           block: int | None = None) -> str | None:
  """Why the decode kernel cannot take this step of queries [B, T, H, K] over G key/value heads
  (None: it can). `block`: the page size of a paged cache, None for a contiguous one."""
  if query_BTHK.dtype not in triton.DTYPES:
    return ("the Triton decode kernel takes float32, bfloat16 or float16, got "
            f"{query_BTHK.dtype}")
  if max(k_dim, v_dim) > triton.MAX_HEAD_DIM:
    return f"the Triton decode kernel takes head dims up to {triton.MAX_HEAD_DIM}"
  if mask is not None or dropout_rate:
    return "the Triton decode kernel takes no dense mask and no dropout"
  t, h = query_BTHK.shape[1:3]
  if t * (h // g) > MAX_ROWS:
    return f"the Triton decode kernel takes T·H/G <= {MAX_ROWS} query rows, got {t * (h // g)}"
  if block is not None and (block < triton.MIN_BLOCK or block & (block - 1)):
    return f"the Triton decode kernel takes pages of a power of two >= 16 tokens, got {block}"
  positions = [m for m in mods.masks if isinstance(m, mods_lib.Positions)]
  others = [m for m in (*mods.masks, *mods.scores)
            if not isinstance(m, (mods_lib.Positions, mods_lib.SoftCap))]
  if len(positions) != 1 or others:
    return ("the Triton decode kernel takes one set of positions, a soft cap and sinks, not "
            + ", ".join(type(m).__name__ for m in others or positions))
  return None


def _kernel(*refs, spec: Spec):
  """One (b, g, partition): an online softmax over the partition's share of the row's blocks.
  refs: q, k, v, q_pos, kv_pos, count, [table when paged], [k and v scales when quantized],
  then the outputs out and lse."""
  q_ref, k_ref, v_ref, q_pos_ref, kv_pos_ref, count_ref, *rest, o_ref, lse_ref = refs
  table_ref = rest.pop(0) if spec.paged else None
  scale_refs = rest if spec.quantized else None
  bk, part = spec.bk, pl.program_id(2)
  count = count_ref[0]
  per = tiles.ceil_div(count, spec.splits)
  lo = part * per
  hi = jnp.minimum(lo + per, count)
  q, q_pos = q_ref[...], q_pos_ref[...]
  term = mods_lib.Positions(None, None, *spec.positions)
  terms = mods_lib.Mods(scores=spec.scores)

  def block(ref, j):  # [bk, ...] of a [slots, ...] ref (contiguous) or a [P, page, ...] pool
    if spec.paged:
      return ref[table_ref[pl.ds(j, 1)]].reshape(bk, *ref.shape[2:])
    return ref[pl.ds(j * bk, bk)]

  def load(j):
    k, v = block(k_ref, j), block(v_ref, j)
    if scale_refs is None:
      return k, v
    return (quant.dequantize(k, block(scale_refs[0], j), q.dtype),
            quant.dequantize(v, block(scale_refs[1], j), q.dtype))

  def step(j, carry):
    acc, m, l = carry
    k, v = load(j)
    kv_pos = kv_pos_ref[pl.ds(j * bk, bk)]
    v = jnp.where((kv_pos >= 0)[:, None], v, 0)  # an empty slot's stale value never reaches a row
    logits = plgpu.dot(q, k, trans_b=True).astype(jnp.float32) * spec.scale
    scores = terms.score(logits, None, None, None, None)
    visible = term.visible_at(q_pos[:, None], kv_pos[None, :]) & (scores > -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(jnp.where(visible, scores, tiles.LOWEST), axis=1))
    p = tiles.tile_weights(scores, visible, m_new)
    correction = jnp.exp(m - m_new)
    acc = acc * correction[:, None] + plgpu.dot(p.astype(v.dtype), v).astype(jnp.float32)
    return acc, m_new, l * correction + jnp.sum(p, axis=1)

  init = (jnp.zeros(o_ref.shape, jnp.float32), jnp.full((spec.rows,), tiles.LOWEST, jnp.float32),
          jnp.zeros((spec.rows,), jnp.float32))
  acc, m, l = lax.fori_loop(lo, hi, step, init)
  seen = l > 0
  o_ref[...] = acc / jnp.where(seen, l, 1.0)[:, None]
  lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), tiles.LOWEST)


def _partitions(spec: Spec, q_BGRK, k, v, q_pos_BR, kv_pos_BS, count_B, table=None,
                kv_scales=None):
  """(out [B, G, splits, R, V] float32, lse [B, G, splits, R]) of every partition."""
  b, g, r, kp = q_BGRK.shape
  vp, s = v.shape[-1], kv_pos_BS.shape[1]
  row = lambda n: pl.BlockSpec((None, n), lambda b, g, p: (b, 0))
  if spec.paged:  # the whole pool of head g: the kernel picks its pages from the table
    pool = lambda *dim: pl.BlockSpec((k.shape[0], spec.bk, None, *dim),
                                     lambda b, g, p: (0, 0, g) + (0,) * len(dim))
    kv_specs, scale_spec = [pool(kp), pool(vp)], pool()
  else:  # the row's head g, every slot: the kernel reads only the blocks it visits
    cache = lambda *dim: pl.BlockSpec((None, None, s, *dim),
                                      lambda b, g, p: (b, g, 0) + (0,) * len(dim))
    kv_specs, scale_spec = [cache(kp), cache(vp)], cache()
  in_specs = [pl.BlockSpec((None, None, r, kp), lambda b, g, p: (b, g, 0, 0)), *kv_specs,
              row(r), row(s), row(1)]
  operands = [q_BGRK, k, v, q_pos_BR, kv_pos_BS, count_B[:, None]]
  if spec.paged:
    in_specs.append(row(table.shape[1]))
    operands.append(table)
  if spec.quantized:
    in_specs += [scale_spec, scale_spec]
    operands += list(kv_scales)
  return pl.pallas_call(
      functools.partial(_kernel, spec=spec), grid=(b, g, spec.splits), in_specs=in_specs,
      out_specs=[pl.BlockSpec((None, None, None, r, vp), lambda b, g, p: (b, g, p, 0, 0)),
                 pl.BlockSpec((None, None, None, r), lambda b, g, p: (b, g, p, 0))],
      out_shape=[jax.ShapeDtypeStruct((b, g, spec.splits, r, vp), jnp.float32),
                 jax.ShapeDtypeStruct((b, g, spec.splits, r), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=spec.interpret, name="flax_mha_flash_decode")(*operands)


def _merge(out_p, lse_p, sinks, t: int, h: int):
  """The partitions (and the sinks) merged: (out [B, T, H, V] float32, lse [B, H, T])."""
  b, g, _, r, vp = out_p.shape
  rep = h // g
  if sinks is not None:  # one more partition: one entry, value 0 (row t·rep + i: head g·rep + i)
    sink_rows = jnp.tile(sinks.astype(jnp.float32).reshape(g, 1, rep), (1, r // rep, 1))
    sink_rows = jnp.pad(sink_rows.reshape(g, -1), ((0, 0), (0, r - r // rep * rep)),
                        constant_values=tiles.LOWEST)
    lse_p = jnp.concatenate([lse_p, jnp.broadcast_to(sink_rows[None, :, None], (b, g, 1, r))], 2)
    out_p = jnp.concatenate([out_p, jnp.zeros_like(out_p[:, :, :1])], 2)
  top = jnp.max(lse_p, axis=2)
  lse = top + jnp.log(jnp.sum(jnp.exp(lse_p - top[:, :, None]), axis=2))
  lse = jnp.where(top == tiles.LOWEST, tiles.LOWEST, lse)  # a row that saw nothing
  out = jnp.sum(jnp.exp(lse_p - lse[:, :, None])[..., None] * out_p, axis=2)  # [B, G, R, V]
  out = out[:, :, :t * rep].reshape(b, g, t, rep, vp).transpose(0, 2, 1, 3, 4)
  lse = lse[:, :, :t * rep].reshape(b, g, t, rep).transpose(0, 1, 3, 2).reshape(b, h, t)
  return out.reshape(b, t, h, vp), lse


def _rows(query_BTHK, q_pos_BT, g: int):
  """The queries as [B, G, R, Kp] tiles (row t·rep + i: head g·rep + i at step t) and their
  positions [B, R] (-1 on the padding rows)."""
  b, t, h, k = query_BTHK.shape
  rep = h // g
  r = triton.pow2(t * rep)
  q = query_BTHK.reshape(b, t, g, rep, k).transpose(0, 2, 1, 3, 4).reshape(b, g, t * rep, k)
  q = triton.pad_axis(triton.pad_axis(q, 2, r), 3, triton.pow2(k))
  q_pos = jnp.repeat(jnp.broadcast_to(q_pos_BT, (b, t)).astype(jnp.int32), rep, axis=1)
  return q, triton.pad_axis(q_pos, 1, r, -1)


def _spec(mods, scale, rows: int, bk: int, paged: bool, quantized: bool,
          interpret: bool) -> Spec:
  (term,) = [m for m in mods.masks if isinstance(m, mods_lib.Positions)]
  return Spec(rows, bk, float(scale), (term.causal, term.window, term.sink_tokens),
              tuple(mods.scores), paged, quantized, SPLITS, interpret)


def _visited_blocks(kv_pos_BS, bk: int):
  """Key blocks per row up to its last filled slot [B] (empty slots: -1)."""
  s = kv_pos_BS.shape[1]
  filled = jnp.max(jnp.where(kv_pos_BS >= 0, jnp.arange(s, dtype=jnp.int32) + 1, 0), axis=1)
  return ((filled + bk - 1) // bk).astype(jnp.int32)


def _cache_forward(query, key_BGSK, value_BGSV, mods, cfg, splits, kv_scales=None,
                   interpret=False):
  """`decode.cache_forward`'s contract by the kernel: (out [B, T, H, V], lse [B, H, T])."""
  del splits
  b, t, h, _ = query.shape
  (term,) = [m for m in mods.masks if isinstance(m, mods_lib.Positions)]
  g, s = key_BGSK.shape[1], key_BGSK.shape[2]
  bk = min(BLOCK, triton.pow2(s))
  sp = -(-s // bk) * bk
  dims = lambda x: triton.pad_axis(triton.pad_axis(x, 2, sp), 3, triton.pow2(x.shape[-1]))
  kv_pos = triton.pad_axis(jnp.broadcast_to(term.kv_pos, (b, s)).astype(jnp.int32), 1, sp, -1)
  q, q_pos = _rows(query, term.q_pos, g)
  spec = _spec(mods, cfg.scale, q.shape[2], bk, False, kv_scales is not None, interpret)
  scales = None if kv_scales is None else [triton.pad_axis(x, 2, sp) for x in kv_scales]
  out_p, lse_p = _partitions(spec, q, dims(key_BGSK), dims(value_BGSV), q_pos, kv_pos,
                             _visited_blocks(kv_pos, bk), kv_scales=scales)
  out, lse = _merge(out_p, lse_p, mods.sinks, t, h)
  return out[..., :value_BGSV.shape[-1]], lse


def cache_attention(query_BTHK, key_BGSK, value_BGSV, mods, scale: float, kv_scales=None, *,
                    interpret: bool = False):
  """A few queries [B, T, H, K] over a contiguous head-major cache ([B, G, S, K], [B, G, S, V];
  int8 with `kv_scales`, their scales [B, G, S] each) whose positions are `mods`' Positions
  term (see the module docstring): [B, T, H, V]. The cache is read in place when S is a
  multiple of the block and K, V are powers of two >= 16, otherwise padded (a copy)."""
  t, s, k_dim = query_BTHK.shape[1], key_BGSK.shape[2], query_BTHK.shape[-1]
  cfg, cfg_bwd = decode.configs(scale, 0.0, t, s, k_dim, BLOCK)
  forward = functools.partial(_cache_forward, interpret=interpret)
  out, _ = decode.cache(query_BTHK, key_BGSK, value_BGSV, mods, cfg, cfg_bwd, SPLITS, forward,
                        kv_scales)
  return out


def _paged_forward(query, k_pages, v_pages, page_indices, lengths, mods, cfg, splits,
                   kv_scales=None, interpret=False):
  """`decode.forward`'s paged contract by the kernel: (out [B, T, H, V], lse [B, H, T])."""
  del splits
  b, t, h, _ = query.shape
  g, page = k_pages.shape[2], k_pages.shape[1]
  s = page_indices.shape[1] * page
  kv_pos = jnp.where(jnp.arange(s) < lengths[:, None], jnp.arange(s), -1).astype(jnp.int32)
  (term,) = [m for m in mods.masks if isinstance(m, mods_lib.Positions)]
  q, q_pos = _rows(query, term.q_pos, g)
  spec = _spec(mods, cfg.scale, q.shape[2], page, True, kv_scales is not None, interpret)
  dims = lambda x: triton.pad_axis(x, 3, triton.pow2(x.shape[-1]))
  out_p, lse_p = _partitions(spec, q, dims(k_pages), dims(v_pages), q_pos, kv_pos,
                             _visited_blocks(kv_pos, page), page_indices.astype(jnp.int32),
                             kv_scales)
  out, lse = _merge(out_p, lse_p, mods.sinks, t, h)
  return out[..., :v_pages.shape[-1]], lse


def paged_attention(query_BTHK, k_pages, v_pages, page_indices, lengths, mods, cfg, cfg_bwd,
                    kv_scales=None, *, interpret: bool = False):
  """`decode.paged` (same arguments, results and backward) with the kernel's forward: each
  row's pages read in place through its page table (int8 pools with `kv_scales`)."""
  forward = functools.partial(_paged_forward, interpret=interpret)
  return decode.paged(query_BTHK, k_pages, v_pages, page_indices, lengths, mods, cfg, cfg_bwd,
                      SPLITS, forward, kv_scales)


@dataclasses.dataclass(frozen=True)
class DecodeKernel:
  """The kernel as the `implementation=` of a cache step (`flax_mha.cache.attend`) or of
  `flax_mha.paged_attention`: what `make_attention` returns. Compiled, it runs on 'cuda' only
  and is refused by name elsewhere (see `flax_mha.platforms`); interpreted, anywhere."""
  interpret: bool = False
  name: str = "triton_decode"

  def cache_attention(self, query_BTHK, key_BGSK, value_BGSV, mods, scale: float,
                      kv_scales=None):
    """`cache_attention` in this kernel's mode."""
    run = functools.partial(cache_attention, interpret=self.interpret)
    return platforms.kernel_for("cuda", self.name, self.interpret, run)(
        query_BTHK, key_BGSK, value_BGSV, mods, scale, kv_scales)

  def paged_attention(self, query_BTHK, k_pages, v_pages, page_indices, lengths, mods, cfg,
                      cfg_bwd, kv_scales=None):
    """`paged_attention` in this kernel's mode."""
    run = functools.partial(paged_attention, cfg=cfg, cfg_bwd=cfg_bwd, interpret=self.interpret)
    return platforms.kernel_for("cuda", self.name, self.interpret, run)(
        query_BTHK, k_pages, v_pages, page_indices, lengths, mods, kv_scales=kv_scales)


def make_attention(*, interpret: bool = False) -> DecodeKernel:
  """The decode kernel for `implementation=` of a cache step or `paged_attention`;
  `interpret=True` runs it in Pallas interpret mode on any platform (a CPU check of what a
  CUDA process runs), as `triton.make_attention(interpret=True)` does for the flash kernel."""
  if not isinstance(interpret, bool):
    raise TypeError(f"interpret must be a bool, got {type(interpret).__name__}")
  return DecodeKernel(interpret)


KERNEL = make_attention()


def named(implementation) -> DecodeKernel | None:
  """The decode kernel that `implementation` asks for ("triton_decode" or a DecodeKernel), or
  None when it asks for something else."""
  if isinstance(implementation, DecodeKernel):
    return implementation
  return KERNEL if implementation == KERNEL.name else None


def require(kernel: DecodeKernel, refused: str | None) -> None:
  """Refuse by name a call that the decode kernel asked for by name cannot take."""
  if refused is not None:
    raise ValueError(f"implementation={kernel.name!r} cannot run: {refused}")


NOT_STAGED = ("this process has no CUDA GPU: None stages the Triton decode kernel here only "
              "inside flax_mha.stage_accelerator_kernels()")


NOT_DENSE = ("the Triton decode kernel is a KV cache's step: it takes a cache's or a paged "
             "call (flax_mha.cache.attend, flax_mha.paged_attention), not "
             "dot_product_attention")


def options_reason(call: registry.Call) -> str | None:
  """Why the decode kernel cannot take `call`'s options on any platform (None: it can)."""
  if call.layout == "dense":
    return NOT_DENSE
  k_dim, g, v_dim = call.query.shape[-1], call.key.shape[2], call.value.shape[-1]
  return reason(call.query, g, k_dim, v_dim, call.mods, mask=call.mask,
                dropout_rate=call.dropout_rate, block=call.page)


def refuses(call: registry.Call) -> str | None:
  """The registry's question: why the kernel cannot run `call` on its platform ('cuda'; there
  only where None stages it: `flax_mha.platforms.stages_for`)."""
  return common.accelerator_refusal(call, "cuda", "the Triton decode kernel is for NVIDIA GPUs "
                                    "(platform 'cuda')", options_reason, NOT_STAGED)


def _dense(*args, **kwargs):
  del args, kwargs
  raise ValueError(f"implementation='triton_decode' cannot run: {NOT_DENSE}")


def cache_entry(query_BTHK, keys, values, kv_pos, *, mods, scale, kernel, kv_scales,
                  **unused):
  """A KV cache's step (layout "cache") with `kernel`, a `DecodeKernel` (compiled or
  interpreted)."""
  del kv_pos, unused  # the positions are the mods' Positions term
  return kernel.cache_attention(query_BTHK, keys, values, mods, scale, kv_scales)


def paged_entry(query, k_pages, v_pages, page_indices, lengths, *, mods, cfg, cfg_bwd,
                  kernel, kv_scales, **unused):
  """A step over each row's pages (layout "paged") with `kernel`, a `DecodeKernel`."""
  del unused
  return kernel.paged_attention(query, k_pages, v_pages, page_indices, lengths, mods, cfg,
                                cfg_bwd, kv_scales)


REGISTERED = registry.register(registry.Kernel(
    "triton_decode", _dense, refuses, "a KV cache's step on NVIDIA GPUs (Pallas Triton): "
    "each row's filled blocks or pages read in place, keys split and merged by lse",
    layouts=("cache", "paged"), platform="cuda", staged=True,
    hints=dict(not_staged=NOT_STAGED), entries={"cache": cache_entry, "paged": paged_entry}))
