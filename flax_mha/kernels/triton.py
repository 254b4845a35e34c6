"""flax_mha's flash attention for NVIDIA GPUs: Pallas kernels on its Triton backend
(`flax_mha.kernels.triton_tiles`), forward and backward, behind `reference.attention`'s
signature and semantics. What `implementation=None` runs on 'cuda' where cuDNN cannot.

What it takes, and how (all in the kernel, memory linear in S except where a bias is given):
  is_causal, windows (one- or two-sided, `sink_tokens`)
      on indices; they also bound each block's loop, so hidden tiles are never visited.
  segment ids, lengths
      one pair of int32 id arrays (lengths give the rows and keys beyond them ids that match
      nothing).
  positions (a KV cache's slots, rolling or paged layouts)
      one pair of int32 position arrays and the term's causality and window.
  bias, dense mask
      one additive [B|1, H|1, T, S] array (the mask as -inf where hidden), read tile by tile;
      the bias gets its gradient (the mask adds none).
  mask_mod, score_mod, logit_soft_cap
      functions of the indices (b, h, q, kv) alone run inside the kernel; the backward takes a
      score term's derivative with `jax.jvp`.
  sinks           merged outside the kernel through its lse (which has a gradient).
  GQA             query head h reads key/value head h // (H // G), never repeated in the
      forward; dK and dV are accumulated per query head and summed over each group.
  K != V, T != S, any lengths: T and S are padded to the blocks, K and V to powers of two.
  return_residual the natural-log lse, finfo.min for a row that sees nothing (output 0).

It refuses by name: dropout, `mask_mod`/`score_mod` functions over arrays, more than one set
of segment ids, head dims above MAX_HEAD_DIM, dtypes other than float32, bfloat16
and float16, and any platform but 'cuda' (`refuses`). `make_attention(interpret=True)` runs the
same kernels in Pallas interpret mode on any platform: how the tests check it on CPU. The
blocks are settings, not tuned (no GPU has run this code): `make_attention(block_q=...,
block_kv=...)` changes them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from flax_mha import platforms
from flax_mha import mods as mods_lib
from flax_mha.kernels import common
from flax_mha.kernels import triton_tiles as tiles
from flax_mha.kernels import registry

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MAX_HEAD_DIM = 256  # Q, K and V tiles of this width stay within a GPU's shared memory
BLOCK = 64  # rows and keys per block: a setting, not tuned (no GPU here)
MIN_BLOCK = 16  # Triton's dot takes tiles of at least 16 in each dimension
CUSTOM_CALL = "__gpu$xla.gpu.triton"  # what a lowering for 'cuda' holds: Triton's custom call

NOT_STAGED = ("this process has no CUDA GPU: None stages the Triton kernel here only inside "
              "flax_mha.stage_accelerator_kernels() (for jax.export), since every CPU call "
              "traces the 'cuda' branch too")


def options_reason(call: registry.Call) -> str | None:
  """Why the Triton kernel cannot take `call`'s options on any platform (None: it can)."""
  if call.query.dtype not in DTYPES:
    return f"the Triton kernel takes float32, bfloat16 or float16, got {call.query.dtype}"
  k, v = call.dims["K"], call.dims["V"]
  if max(k, v) > MAX_HEAD_DIM:
    return f"the Triton kernel takes head dims up to {MAX_HEAD_DIM}, got K={k}, V={v}"
  if call.dropout_rate:
    return "the Triton kernel has no dropout"
  return _terms_reason(call.mods)


def _terms_reason(mods) -> str | None:
  if mods is None:
    return None
  for term in (*mods.masks, *mods.scores):
    if isinstance(term, (mods_lib.MaskMod, mods_lib.ScoreMod)) and term.consts:
      return ("the Triton kernel takes mask_mod/score_mod functions of the indices (b, h, q, kv) "
              "only, not ones over arrays")
    if not isinstance(term, (mods_lib.Causal, mods_lib.LocalWindow, mods_lib.SeqLengths,
                             mods_lib.Segments, mods_lib.Positions, mods_lib.MaskMod,
                             mods_lib.SoftCap, mods_lib.ScoreMod)):
      return f"the Triton kernel takes no {type(term).__name__} term"
  if sum(isinstance(term, mods_lib.Segments) for term in mods.masks) > 1:
    return "the Triton kernel takes one set of segment ids"
  return None


def refuses(call: registry.Call) -> str | None:
  """The registry's question: why the Triton kernel cannot run `call` on its platform. On
  'cuda' in a process without a GPU it refuses too unless `flax_mha.stage_accelerator_kernels()`
  is on (see `flax_mha.dispatch`); `implementation="triton"` exports it for 'cuda' from any
  process."""
  return common.accelerator_refusal(call, "cuda", "the Triton kernel is for NVIDIA GPUs "
                                    "(platform 'cuda')", options_reason, NOT_STAGED)


def pow2(n: int) -> int:
  """The smallest power of two >= n, at least MIN_BLOCK: a Triton block or head dim."""
  return max(MIN_BLOCK, 1 << (n - 1).bit_length())


def pad_axis(x, axis: int, size: int, value=0):
  """x padded with `value` at the end of `axis` to `size`."""
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


def _additive_bias(bias, mask):
  """The bias and the dense mask as one additive array [B|1, H|1, T, S] (-inf where the mask
  hides), or None without either; and whether it carries the caller's bias."""
  if bias is None and mask is None:
    return None, False
  if bias is None:
    return jnp.where(mask, 0.0, -jnp.inf).astype(jnp.float32), False
  if mask is not None:
    bias = jnp.where(mask, bias, -jnp.inf)
  return bias, True


@dataclasses.dataclass(frozen=True)
class _Padded:
  """One call laid out for the kernels: its Spec, Q, K, V padded to the blocks and powers of
  two, and its extra arrays (the additive bias, the id pair, the position pairs) padded too."""
  spec: tiles.Spec
  q: jax.Array
  k: jax.Array
  v: jax.Array
  extras: list

  def unpad_rows(self, x_BTHD, dim: int):
    return x_BTHD[:, :self.spec.t, :, :dim]


def _layout(query, key, value, bias, mask, *, is_causal, scale, mods, interpret, block_q,
            block_kv) -> _Padded:
  mods = mods_lib.Mods() if mods is None else mods
  (b, t, h, kd), (s, g, vd) = query.shape, value.shape[1:]
  bq, bk = block_q or min(BLOCK, pow2(t)), block_kv or min(BLOCK, pow2(s))
  tp, sp = common.round_up(t, bq), common.round_up(s, bk)
  additive, bias_grad = _additive_bias(bias, mask)
  ids = common.segment_ids_with_lengths(mods, b, t, s, tp, sp)
  extras = []
  if additive is not None:
    additive = jnp.broadcast_to(additive, (*additive.shape[:2], t, s))
    extras.append(pad_axis(pad_axis(additive, 2, tp), 3, sp))
  extras += [] if ids is None else list(ids)
  positions = [m for m in mods.masks if isinstance(m, mods_lib.Positions)]
  for term in positions:  # padding: position -1, which sees and is seen by nothing
    extras += [pad_axis(term.q_pos.astype(jnp.int32), 1, tp, -1),
               pad_axis(term.kv_pos.astype(jnp.int32), 1, sp, -1)]
  spec = tiles.Spec(
      t=t, s=s, bq=bq, bk=bk, rep=h // g, scale=float(scale),
      causal=is_causal or any(isinstance(m, mods_lib.Causal) for m in mods.masks),
      windows=tuple((m.left, m.right, m.sink_tokens) for m in mods.masks
                    if isinstance(m, mods_lib.LocalWindow)),
      positions=tuple((m.causal, m.window, m.sink_tokens) for m in positions),
      segmented=ids is not None,
      bias=None if additive is None else (additive.shape[0] > 1, additive.shape[1] > 1),
      bias_grad=bias_grad, mask_mods=tuple(m for m in mods.masks
                                           if isinstance(m, mods_lib.MaskMod)),
      scores=tuple(mods.scores), interpret=interpret)
  pad_heads = lambda x, length, dim: pad_axis(pad_axis(x, 1, length), 3, pow2(dim))
  return _Padded(spec, pad_heads(query, tp, kd), pad_heads(key, sp, kd),
                 pad_heads(value, sp, vd), extras)


def _grads(spec, q, k, v, extras, out, lse, d_out, d_lse=None):
  """(dq [B, Tp, H, Kp] float32, dk, dv [B, Sp, G, *] float32, dbias or None) from the
  output's and the lse's cotangents, with the (global) out and lse."""
  delta = jnp.einsum("BTHV,BTHV->BHT", d_out.astype(jnp.float32), out.astype(jnp.float32))
  if d_lse is not None:
    delta = delta - d_lse.astype(jnp.float32)
  dq, dk, dv, dbias = tiles.backward(spec, q, k, v, extras, d_out.astype(q.dtype), lse, delta)
  (b, s, h, _), g = dk.shape, k.shape[2]
  group = lambda d: d.reshape(b, s, g, h // g, -1).sum(3)
  return dq, group(dk), group(dv), dbias


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(spec, q, k, v, extras):
  """(out, lse) of padded inputs; `extras` = [bias][, ids pair][, position pairs]."""
  return tiles.forward(spec, q, k, v, extras)


def _flash_fwd(spec, q, k, v, extras):
  """Inputs arrive as CustomVJPPrimal (symbolic zeros): a bias nothing differentiates (not
  perturbed: a constant, say) gets no gradient computed, since dBias is [B, H, T, S]."""
  q, k, v = (x.value for x in (q, k, v))
  wants_dbias = spec.bias_grad and extras[0].perturbed
  extras = [x.value for x in extras]
  out, lse = tiles.forward(spec, q, k, v, extras)
  return (out, lse), (q, k, v, extras, out, lse, () if wants_dbias else None)


def _flash_bwd(spec, saved, cotangents):
  q, k, v, extras, out, lse, dbias_wanted = saved
  spec = dataclasses.replace(spec, bias_grad=dbias_wanted is not None)
  d_out, d_lse = (None if isinstance(c, jax.custom_derivatives.SymbolicZero) else c
                  for c in cotangents)
  d_out = jnp.zeros(out.shape, out.dtype) if d_out is None else d_out
  dq, dk, dv, dbias = _grads(spec, q, k, v, extras, out, lse, d_out, d_lse)
  d_extras = [None] * len(extras)
  if dbias is not None:
    bias = extras[0]
    d_extras[0] = dbias.sum(axis=tuple(a for a in (0, 1) if bias.shape[a] == 1),
                            keepdims=True).astype(bias.dtype)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_extras


_flash.defvjp(_flash_fwd, _flash_bwd, symbolic_zeros=True)


def make_attention(*, interpret: bool = False, block_q: int | None = None,
                   block_kv: int | None = None):
  """The Triton kernel with `reference.attention`'s signature; `interpret=True` runs it in
  Pallas interpret mode (any platform: the tests' CPU check), `block_q`/`block_kv` (powers of
  two, at least 16) fix its blocks (None: BLOCK, or the padded length when shorter)."""

  def attention(query, key, value, bias, mask, *, is_causal, scale, dropout_rate,
                dropout_rng, mods=None, return_residual=False):
    """Flash attention: [B, T, H, V] (and with `return_residual` the lse [B, T, H], float32)."""
    del dropout_rng
    common.check_options("triton", options_reason, "cuda", query, key, value, bias, mask,
                          is_causal=is_causal, dropout_rate=dropout_rate, mods=mods)
    padded = _layout(query, key, value, bias, mask, is_causal=is_causal, scale=scale,
                     mods=mods, interpret=interpret, block_q=block_q, block_kv=block_kv)
    out, lse_BHT = _flash(padded.spec, padded.q, padded.k, padded.v, padded.extras)
    out = padded.unpad_rows(out, value.shape[-1])
    lse_BTH = lse_BHT[:, :, :padded.spec.t].transpose(0, 2, 1)
    if mods is not None and mods.sinks is not None:  # one more softmax entry, through the lse
      total_BTH = jnp.logaddexp(lse_BTH, mods.sinks.astype(jnp.float32)[None, None, :])
      out = out * jnp.exp(lse_BTH - total_BTH)[..., None].astype(out.dtype)
      lse_BTH = total_BTH
    out = out.astype(value.dtype)
    return (out, lse_BTH) if return_residual else out

  return platforms.kernel_for("cuda", "triton", interpret, attention)


def make_block(*, interpret: bool = False):
  """The kernel as one step of a blockwise algorithm (the ring), in the signatures of
  `chunked.chunked_forward` and `chunked.chunked_backward` (bias, dropout and offsets
  excluded): `forward(query, key, value, *, scale, is_causal, mask, mods, **unused) -> (out
  [B, T, H, V], lse [B, H, T])`, float32, and `backward(query, key, value, out, lse, dout, ...)
  -> (dq, dk, dv)`, float32, this key block's share of the gradient given the GLOBAL out and
  lse. A row this block hides from gets out 0 and lse finfo.min."""

  def layout(query, key, value, is_causal, scale, mask, mods):
    return _layout(query, key, value, None, mask, is_causal=is_causal, scale=scale, mods=mods,
                   interpret=interpret, block_q=None, block_kv=None)

  def forward(query, key, value, *, scale, is_causal=False, mask=None, mods=None, **unused):
    del unused  # block sizes: the kernel's own
    padded = layout(query, key, value, is_causal, scale, mask, mods)
    out, lse = tiles.forward(padded.spec, padded.q, padded.k, padded.v, padded.extras,
                             out_dtype=jnp.float32)
    return padded.unpad_rows(out, value.shape[-1]), lse[:, :, :padded.spec.t]

  def backward(query, key, value, out, lse, dout, *, scale, is_causal=False, mask=None,
               mods=None, **unused):
    del unused
    padded = layout(query, key, value, is_causal, scale, mask, mods)
    tp, vp = padded.q.shape[1], padded.v.shape[-1]
    pad_rows = lambda x: pad_axis(pad_axis(x, 1, tp), 3, vp)
    dq, dk, dv, _ = _grads(padded.spec, padded.q, padded.k, padded.v, padded.extras,
                           pad_rows(out), pad_axis(lse.astype(jnp.float32), 2, tp, tiles.LOWEST),
                           pad_rows(dout))
    s = key.shape[1]
    return (padded.unpad_rows(dq, query.shape[-1]).astype(jnp.float32),
            dk[:, :s, :, :key.shape[-1]], dv[:, :s, :, :value.shape[-1]])

  return forward, backward


attention = make_attention()

KERNEL = registry.register(registry.Kernel(
    "triton", attention, refuses,
    "flax_mha's flash attention on NVIDIA GPUs (Pallas Triton): masks, windows, lengths, "
    "positions, bias with its gradient, mask/score functions, GQA, K != V",
    layouts=("dense", "ring_block"), platform="cuda", staged=True,
    hints=dict(not_staged=NOT_STAGED),
    entries={"ring_block": registry.Block(*make_block(), options_reason)}))
