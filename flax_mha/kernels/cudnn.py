"""cuDNN flash attention on NVIDIA GPUs, through `jax.nn.dot_product_attention(implementation="cudnn")`.

Same signature as `reference.attention`. cuDNN's constraints are checked up front and raise a
`ValueError` that names the one that fails, instead of an opaque lowering error.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flax_mha import masks
from flax_mha import platforms
from flax_mha.kernels import registry

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)
MAX_HEAD_DIM = 128


# Why a program lowered for 'cuda' in a process without a CUDA GPU cannot hold cuDNN.
NO_GPU_HERE = ("jax.nn's cuDNN path reads the installed cuDNN while it traces, and this process "
               "has no CUDA GPU: a program lowered for 'cuda' here cannot use it")


def unsupported_reason(query, key, value, dropout_rate, mods=None,
                       platform: str | None = None) -> str | None:
  """Why cuDNN can't run this call lowered for `platform` (None: the default backend's), or
  None when it can. Reads static facts only."""
  if _terms_reason(mods) is not None:
    return _terms_reason(mods)
  platform = platforms.backend_platform() if platform is None else platform
  if platform != "cuda":
    return f"cuDNN needs an NVIDIA GPU (platform 'cuda'), not {platform!r}"
  if not platforms.has_platform("cuda"):
    return NO_GPU_HERE
  return _inputs_reason(query, key, value, dropout_rate)


def gpu_reason(query, key, value, dropout_rate, mods=None) -> str | None:
  """Why cuDNN could not run this call even traced in a process with a CUDA GPU (None: it
  could)."""
  return _terms_reason(mods) or _inputs_reason(query, key, value, dropout_rate)


def _terms_reason(mods) -> str | None:
  if mods is not None and (mods.masks or mods.scores or mods.sinks is not None):
    return ("flax_mha's cuDNN path takes mask, bias and is_causal only, not windows, lengths, "
            "segment ids, positions, soft-capping, mask/score functions or sinks: use "
            "implementation='chunked'")
  return None


def _inputs_reason(query, key, value, dropout_rate) -> str | None:
  if query.dtype not in SUPPORTED_DTYPES:
    return f"cuDNN needs bfloat16 or float16 inputs, got {query.dtype}"
  if dropout_rate > 0.0:
    return "cuDNN's dropout differs from flax_mha's hashed keep-mask: use dropout_rate=0"
  k, v = query.shape[-1], value.shape[-1]
  if k != v or k > MAX_HEAD_DIM or k % 8:
    return f"cuDNN needs K == V, a multiple of 8 and <= {MAX_HEAD_DIM}, got K={k}, V={v}"
  return None


def attention(query, key, value, bias, mask, *, is_causal, scale, dropout_rate, dropout_rng,
              mods=None, return_residual=False):
  """cuDNN flash attention: [B, T, H, V] (and with `return_residual` the lse [B, T, H] in
  float32); rows with no visible key give 0 (lse finfo.min), as everywhere else."""
  del dropout_rng
  reason = unsupported_reason(query, key, value, dropout_rate, mods)
  if reason is not None:
    raise ValueError(f"implementation='cudnn' cannot run: {reason}")
  if mask is not None and is_causal:  # jax.nn's cuDNN path takes one mask kind: fold causality in
    mask = mask & masks.causal_mask(query.shape[1], key.shape[1])
    is_causal = False
  result = jax.nn.dot_product_attention(
      query, key, value, bias=None if bias is None else bias.astype(query.dtype), mask=mask,
      scale=scale, is_causal=is_causal, implementation="cudnn", return_residual=return_residual)
  out, lse = result if return_residual else (result, None)
  # Rows that see no key (masked, or every logit -inf through the bias) are 0 by flax_mha's
  # semantics, whatever cuDNN returns for them. Top-left causal alone always sees key 0.
  visible = mask
  if bias is not None:
    finite = bias > -jnp.inf
    visible = finite if visible is None else visible & finite
  if visible is not None:
    any_visible_BTH = jnp.any(visible, axis=-1).transpose(0, 2, 1)
    out = jnp.where(any_visible_BTH[..., None], out, 0.0).astype(out.dtype)
    if lse is not None:
      lse = jnp.where(any_visible_BTH, lse.astype(jnp.float32), jnp.finfo(jnp.float32).min)
  return (out, lse.astype(jnp.float32)) if return_residual else out


def refuses(call: registry.Call) -> str | None:
  """The registry's question: why cuDNN cannot run `call` on its platform."""
  return unsupported_reason(call.query, call.key, call.value, call.dropout_rate, call.mods,
                            call.platform)


KERNEL = registry.register(registry.Kernel(
    "cudnn", attention, refuses, "cuDNN flash attention on NVIDIA GPUs (16-bit)",
    platform="cuda", hints=dict(gpu_reason=gpu_reason)))
