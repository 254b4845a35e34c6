"""What every implementation shares, the package's internal API for its kernels.

Numerics: the dtype the softmax runs in (`softmax_dtype`), a row's log-sum-exp from its
statistics (`row_lse`) and the sinks' gradient from it (`sink_grad`). What a query row sees:
the dense visibility of a mask and causality (`visible_mask`), segment ids merged with
sequence lengths for kernels that take ids (`segment_ids_with_lengths`). Argument handling: an
accelerator kernel's refusal as an error (`check_options`), padding to tiles (`round_up`), and a
custom-VJP kernel under forward-mode differentiation (`without_forward_mode`).
"""

from __future__ import annotations

import jax.numpy as jnp

from flax_mha import masks as masks_lib
from flax_mha import mods as mods_lib
from flax_mha import platforms
from flax_mha.kernels import registry


def softmax_dtype(dtype) -> jnp.dtype:
  """float32 for 16-bit inputs, the input dtype otherwise (float64 stays float64)."""
  return jnp.promote_types(dtype, jnp.float32)


def row_lse(row_max, total):
  """log Σ exp of a row from its max and its normaliser Σ exp(score - max); a row that saw no key
  (total 0) gets the finite stand-in finfo.min (exp(finfo.min - x) = 0, logaddexp with it is a
  no-op), so statistics stay finite for `jax.debug_infs` and merging needs no special case."""
  seen = total > 0
  return jnp.where(seen, row_max + jnp.log(jnp.where(seen, total, 1.0)),
                   jnp.finfo(total.dtype).min)


def sink_grad(sinks_H, lse_BTH, out_BTHV, dout_BTHV):
  """d loss / d sinks [H]: a sink's weight in row (b, t, h) is exp(sink - lse), and raising it
  scales that row's output by (1 - weight), so the gradient is -Σ_{b,t} weight · (dout · out)."""
  acc = lse_BTH.dtype
  delta_BTH = jnp.sum(dout_BTHV.astype(acc) * out_BTHV.astype(acc), axis=-1)
  weight_BTH = jnp.exp(sinks_H.astype(acc) - lse_BTH)
  return -jnp.sum(weight_BTH * delta_BTH, axis=(0, 1)).astype(sinks_H.dtype)


def round_up(n: int, multiple: int) -> int:
  """n rounded up to a multiple of `multiple` (a length padded to whole tiles)."""
  return -(-n // multiple) * multiple


def segment_ids_with_lengths(mods, b: int, t: int, s: int, t_pad: int, s_pad: int):
  """One pair of int32 ids ([B, T_pad], [B, S_pad]) that says what the segment ids and lengths
  of `mods` say together (None without either): a row sees a key when their ids are equal.
  The segment ids (zeros without) are shifted to >= 0; rows beyond a query length or T get -1,
  keys beyond a key length or S get -2, which match nothing. For kernels that take one id pair
  (splash, triton)."""
  segments = [m for m in mods.masks if isinstance(m, mods_lib.Segments)]
  lengths = [m for m in mods.masks if isinstance(m, mods_lib.SeqLengths)]
  if not segments and not lengths:
    return None
  q_ids, kv_ids = jnp.zeros((b, t), jnp.int32), jnp.zeros((b, s), jnp.int32)
  if segments:
    q_ids, kv_ids = segments[0].q_ids.astype(jnp.int32), segments[0].kv_ids.astype(jnp.int32)
    low = jnp.minimum(q_ids.min(), kv_ids.min())
    q_ids, kv_ids = q_ids - low, kv_ids - low
  beyond = lambda ids, lengths_B, fill: ids if lengths_B is None else jnp.where(
      jnp.arange(ids.shape[1])[None] < lengths_B[:, None], ids, fill)
  for term in lengths:
    q_ids, kv_ids = beyond(q_ids, term.q_lengths, -1), beyond(kv_ids, term.kv_lengths, -2)
  return (jnp.pad(q_ids, ((0, 0), (0, t_pad - t)), constant_values=-1),
          jnp.pad(kv_ids, ((0, 0), (0, s_pad - s)), constant_values=-2))


def check_options(name: str, options_reason, platform: str, query, key, value, bias, mask, *,
                  is_causal, dropout_rate, mods) -> None:
  """Raise the ValueError naming why kernel `name` cannot take the call (`options_reason` of
  its `registry.Call` on `platform`), if it cannot."""
  reason = options_reason(registry.Call.of(query, key, value, bias, mask, is_causal=is_causal,
                                           dropout_rate=dropout_rate, mods=mods,
                                           platform=platform))
  if reason is not None:
    raise ValueError(f"implementation={name!r} cannot run: {reason}")


def visible_mask(mask, is_causal: bool, num_q: int, num_kv: int):
  """The boolean [.., T, S] mask that `mask` and `is_causal` make together (None: all visible)."""
  causal = masks_lib.causal_mask(num_q, num_kv) if is_causal else None
  return masks_lib.combine_masks(mask, causal)


def without_forward_mode(name: str, fn, *args):
  """fn(*args) for an implementation whose backward is a custom VJP, JAX's forward-mode error
  (raised while jax.jvp traces the call outside of jit) replaced by one naming `name`."""
  try:
    return fn(*args)
  except TypeError as e:
    if "forward-mode" not in str(e):
      raise
    raise TypeError(
        f"implementation={name!r} has no forward-mode autodiff (jax.jvp, jax.jacfwd, "
        "jax.linearize of a custom_vjp function): its backward is a custom VJP. Use "
        "implementation='xla' or 'reference' for forward mode, or reverse mode (jax.grad, "
        f"jax.vjp, jax.jacrev) with {name!r}.") from e


def accelerator_refusal(call: registry.Call, platform: str, elsewhere: str, options_reason,
                        not_staged: str) -> str | None:
  """The registry's question for a kernel of one accelerator `platform`: `elsewhere` (naming
  the kernel and its platform) on any other platform; there, `options_reason(call)`, or
  `not_staged` in a process that neither has the platform nor stages it (so that None does
  not stage it for every call; named explicitly it still exports from any process)."""
  if call.platform != platform:
    return f"{elsewhere}, not {call.platform!r}"
  reason = options_reason(call)
  if reason is None and not platforms.stages_for(platform):
    reason = not_staged
  return reason
