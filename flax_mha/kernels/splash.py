"""JAX's splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`, a Pallas TPU
kernel) behind `reference.attention`'s signature and semantics.

What it takes, and how each option becomes a splash argument:
  is_causal, windows (one- or two-sided, with `sink_tokens`), index-only `mask_mod`s
      one static splash mask per head, built once per static shape and cached (`_kernel`):
      causality and windows as a mask function computed inside the kernel; a `mask_mod` as a
      NumPy mask evaluated on the host. Splash reads its block sparsity from the mask, so tiles
      the mask hides are skipped.
  segment ids, query/key lengths
      one pair of splash `SegmentIds` (lengths mark the rows and keys beyond them with ids that
      match nothing).
  GQA           native: query head h reads key/value head h // (H // G), never repeated.
  K != V, T != S
      native; T and S are padded to multiples of the blocks, the padded keys hidden by the
      static mask, the padded rows dropped.
  logit_soft_cap  splash's `attn_logits_soft_cap` (the query is scaled first: splash has no
      scale argument, so the cap applies to scale·Q·Kᵀ as everywhere else).
  sinks         splash's `sinks` [H].
  return_residual
      splash's natural-log lse (its residual kernel), gradients from its plain kernel.

A row that sees nothing gives 0 here as in every other implementation (splash alone would give
it the mean of V): without the caller's sinks, every head gets the stand-in sink NO_KEY_SINK, a
logit below any real score and far above splash's mask value, so a row that sees no key puts all
its weight on the sink (output 0, gradients 0) and a row that sees one is unchanged; its lse,
NO_KEY_SINK, becomes finfo.min (`common.row_lse`'s convention).

It refuses by name what splash cannot take: a bias, a dense `mask`, dropout, `score_mod`,
positions, a `mask_mod` that reads the batch index or closes over arrays, dtypes other than
float32 and bfloat16; and any platform but 'tpu' (`refuses`). `make_attention(interpret=True)`
runs the same kernel in Pallas interpret mode on any platform: how the tests check it on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import splash_attention as splash_lib

from flax_mha import platforms
from flax_mha import mods as mods_lib
from flax_mha.kernels import common
from flax_mha.kernels import registry

DTYPES = (jnp.float32, jnp.bfloat16)
# Far below any real logit, far above splash's mask value (-0.7·finfo(float32).max).
NO_KEY_SINK = -1e30
LANES = 128  # splash's key blocks (and its query blocks with segment ids) are multiples of it
MAX_BLOCK = 512  # the largest block: settings, not tuned (no TPU here)


def options_reason(call: registry.Call) -> str | None:
  """Why splash cannot take `call`'s options on any platform (None: it can)."""
  if call.query.dtype not in DTYPES:
    return f"splash takes float32 or bfloat16, got {call.query.dtype}"
  if jax.config.jax_enable_x64:
    return ("splash does not trace under jax_enable_x64 (its GQA index maps divide int32 block "
            "indices by Python ints, which x64 makes int64)")
  if call.bias is not None:
    return "splash takes no bias"
  if call.mask is not None:
    return ("splash takes no dense mask (a traced array): use segment ids, lengths or an "
            "index-only mask_mod")
  if call.dropout_rate:
    return "splash has no dropout"
  return _terms_reason(call.mods)


def _terms_reason(mods) -> str | None:
  if mods is None:
    return None
  if any(not isinstance(term, mods_lib.SoftCap) for term in mods.scores):
    return "splash takes no score_mod (a soft cap only)"
  for term in mods.masks:
    if isinstance(term, mods_lib.MaskMod) and term.consts:
      return "splash takes a mask_mod that reads only its indices, not one over arrays"
    if isinstance(term, mods_lib.MaskMod) and term.sizes[0] > 1:
      return "splash takes a mask_mod that reads only (h, q_idx, kv_idx), not the batch index b"
    if isinstance(term, mods_lib.Positions):
      return "splash takes no positions (a KV cache's layout): use 'chunked' or 'decode'"
    if not isinstance(term, (mods_lib.Causal, mods_lib.LocalWindow, mods_lib.MaskMod,
                             mods_lib.SeqLengths, mods_lib.Segments)):
      return f"splash takes no {type(term).__name__} mask term"
  if sum(isinstance(term, mods_lib.Segments) for term in mods.masks) > 1:
    return "splash takes one set of segment ids"
  return None


def refuses(call: registry.Call) -> str | None:
  """The registry's question: why the TPU kernel cannot run `call` on its platform. On 'tpu'
  in a process without a TPU it refuses too unless `flax_mha.stage_accelerator_kernels()` is on
  (see `flax_mha.dispatch`), so that None does not stage it for every CPU call;
  `implementation="splash"` exports it for 'tpu' from any process."""
  return common.accelerator_refusal(call, "tpu", "splash attention is a TPU kernel (platform "
                                    "'tpu')", options_reason, NOT_STAGED)


NOT_STAGED = ("this process has no TPU: None stages splash here only inside "
              "flax_mha.stage_accelerator_kernels() (for jax.export), since its masks' block "
              "tables are built in NumPy while tracing (O(T·S) work per static shape) and every "
              "CPU call traces the 'tpu' branch too")


def block_sizes(t: int, s: int, segmented: bool, block_q: int | None = None,
                block_kv: int | None = None) -> splash_lib.BlockSizes:
  """Splash's blocks for T queries over S keys: the given sizes, else at most MAX_BLOCK and no
  larger than the padded sequence; key blocks (and query blocks with segment ids) are
  multiples of LANES."""
  bq = block_q or min(MAX_BLOCK, common.round_up(t, LANES))
  bq = common.round_up(bq, LANES) if segmented else bq
  bkv = common.round_up(block_kv or min(MAX_BLOCK, s), LANES)
  return splash_lib.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq,
                               block_kv_dkv=bkv, block_kv_dkv_compute=bkv, block_q_dq=bq,
                               block_kv_dq=bkv)


class _IndexMask(splash_lib.splash_attention_mask._ComputableMask):  # pylint: disable=protected-access
  """Causality, windows and the padded keys (kv >= S) as one mask function of (q, kv), which
  splash evaluates inside the kernel (and on NumPy blocks for its block sparsity)."""

  def __init__(self, shape, key):
    self.key = key  # (S, causal, windows): all it reads, and its identity
    super().__init__(shape, functools.partial(_index_visible, *key))

  def __eq__(self, other):
    return isinstance(other, _IndexMask) and (self.shape, self.key) == (other.shape, other.key)

  def __hash__(self):
    return hash((self.shape, self.key))


def _index_visible(s: int, causal: bool, windows: tuple, q, kv):
  """Visibility from indices alone (NumPy or jnp int arrays)."""
  ok = kv < s
  if causal:
    ok = ok & (q >= kv)
  for left, right, sink_tokens in windows:
    ok = ok & mods_lib.in_window(q, kv, (left, right), sink_tokens)
  return ok


def _mask_mod_key(term: mods_lib.MaskMod):
  """A hashable identity of an index-only mask_mod: its traced jaxpr's text (a new function
  object per call traces to the same text), or the function itself."""
  fn = term.fn
  if isinstance(fn, functools.partial):
    return str(fn.args[0]), fn.args[1:], term.sizes
  return fn, term.sizes


def _head_masks(h, t_pad, s_pad, index_key, mask_mods):
  """One splash mask per head: the index mask alone, or with the mask_mods as NumPy arrays."""
  if not mask_mods:
    return [_IndexMask((t_pad, s_pad), index_key)] * h
  q, kv = np.arange(t_pad)[:, None], np.arange(s_pad)[None, :]
  base = _index_visible(*index_key, q, kv)
  per_head = any(term.sizes[1] > 1 for term in mask_mods)
  masks = []
  for head in range(h if per_head else 1):
    visible = base
    with jax.ensure_compile_time_eval():
      for term in mask_mods:
        visible = visible & np.asarray(term.visible(0, head, q, kv))
    masks.append(splash_lib.NumpyMask(np.asarray(visible, bool)))
  return masks if per_head else masks * h


_KERNELS: dict = {}


def _kernel(h, t_pad, s_pad, index_key, mask_mods, blocks, soft_cap, interpret,
            save_residuals):
  """The splash kernel of one static configuration, built (its masks processed into block
  sparsity) once per process and reused."""
  key = (h, t_pad, s_pad, index_key, tuple(_mask_mod_key(m) for m in mask_mods), blocks,
         soft_cap, interpret, save_residuals)
  if key not in _KERNELS:
    masks = _head_masks(h, t_pad, s_pad, index_key, mask_mods)
    with jax.ensure_compile_time_eval():  # its block tables: constants, not tracers
      _KERNELS[key] = splash_lib.make_splash_mha(
          splash_lib.MultiHeadMask(masks), head_shards=1, q_seq_shards=1, block_sizes=blocks,
          attn_logits_soft_cap=soft_cap, save_residuals=save_residuals, interpret=interpret)
  return _KERNELS[key]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _with_lse(plain, residual, q, k, v, segment_ids, sinks):
  """(out, lse) from splash's residual kernel, with the plain kernel's gradients (splash's
  residual kernel has no backward of its own)."""
  return residual(q, k, v, segment_ids, sinks)


def _with_lse_fwd(plain, residual, q, k, v, segment_ids, sinks):
  return residual(q, k, v, segment_ids, sinks), (q, k, v, segment_ids, sinks)


def _with_lse_bwd(plain, residual, saved, cotangents):
  del residual
  q, k, v, segment_ids, sinks = saved
  _, vjp = jax.vjp(lambda q, k, v, sinks: plain(q, k, v, segment_ids, sinks), q, k, v, sinks)
  dq, dk, dv, dsinks = vjp(cotangents[0])
  return dq, dk, dv, None, dsinks


_with_lse.defvjp(_with_lse_fwd, _with_lse_bwd)


def _batched(kernel):
  """The one-example splash kernel over the batch: (q [B, H, T, K], k, v, SegmentIds or None,
  sinks [H]) -> its output (and residuals)."""
  def run(q, k, v, segment_ids, sinks):
    one = lambda q, k, v, ids: kernel(q, k, v, segment_ids=ids, sinks=sinks)
    return jax.vmap(one)(q, k, v, segment_ids)
  return run


def make_attention(*, interpret: bool = False, block_q: int | None = None,
                   block_kv: int | None = None):
  """Splash attention with `reference.attention`'s signature; `interpret=True` runs it in
  Pallas interpret mode (any platform: the tests' CPU check), `block_q`/`block_kv` fix its
  blocks (None: `block_sizes`' choice)."""

  def attention(query, key, value, bias, mask, *, is_causal, scale, dropout_rate,
                dropout_rng, mods=None, return_residual=False):
    """Splash attention: [B, T, H, V] (and with `return_residual` the lse [B, T, H], float32)."""
    del dropout_rng
    common.check_options("splash", options_reason, "tpu", query, key, value, bias, mask,
                          is_causal=is_causal, dropout_rate=dropout_rate, mods=mods)
    mods = mods_lib.Mods() if mods is None else mods
    (b, t, h, _), s = query.shape, value.shape[1]
    segmented = any(isinstance(m, (mods_lib.Segments, mods_lib.SeqLengths)) for m in mods.masks)
    blocks = block_sizes(t, s, segmented, block_q, block_kv)
    t_pad, s_pad = common.round_up(t, blocks.block_q), common.round_up(s, blocks.block_kv)
    causal = is_causal or any(isinstance(m, mods_lib.Causal) for m in mods.masks)
    windows = tuple((m.left, m.right, m.sink_tokens) for m in mods.masks
                    if isinstance(m, mods_lib.LocalWindow))
    mask_mods = [m for m in mods.masks if isinstance(m, mods_lib.MaskMod)]
    soft_cap = next((m.cap for m in mods.scores), None)
    build = functools.partial(_kernel, h, t_pad, s_pad, (s, causal, windows), mask_mods, blocks,
                              soft_cap, interpret)
    pad = lambda x, n: jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, 0)))
    heads_first = lambda x: x.transpose(0, 2, 1, 3)  # [B, L, heads, D] -> [B, heads, L, D]
    q = heads_first(pad((query * jnp.asarray(scale, query.dtype)), t_pad))
    k, v = heads_first(pad(key, s_pad)), heads_first(pad(value, s_pad))
    ids = common.segment_ids_with_lengths(mods, b, t, s, t_pad, s_pad)
    ids = None if ids is None else splash_lib.SegmentIds(*ids)
    sinks = (jnp.full((h,), NO_KEY_SINK, jnp.float32) if mods.sinks is None
             else mods.sinks.astype(jnp.float32))
    plain = _batched(build(False))
    if not return_residual:
      out_BHTV = plain(q, k, v, ids, sinks)
    else:
      residual = _batched(build(True))
      out_BHTV, (lse_BHT,) = _with_lse(plain, residual, q, k, v, ids, sinks)
    out_BTHV = out_BHTV[:, :, :t].transpose(0, 2, 1, 3).astype(value.dtype)
    if not return_residual:
      return out_BTHV
    lse_BTH = lse_BHT[:, :, :t].transpose(0, 2, 1).astype(jnp.float32)
    if mods.sinks is None:  # a row on the stand-in sink alone saw no key
      lse_BTH = jnp.where(lse_BTH > NO_KEY_SINK / 2, lse_BTH, jnp.finfo(jnp.float32).min)
    return out_BTHV, lse_BTH

  return platforms.kernel_for("tpu", "splash", interpret, attention)


attention = make_attention()

KERNEL = registry.register(registry.Kernel(
    "splash", attention, refuses,
    "JAX's splash attention on TPU (Pallas): masks as block sparsity, segment ids, sinks",
    platform="tpu", staged=True, hints=dict(not_staged=NOT_STAGED)))
