"""Public attention functions: one interface, several implementations.

Layout follows `jax.nn` and flax: query [..., T, H, K], key [..., S, G, K], value [..., S, G, V],
output [..., T, H, V], with any number of leading batch dims (none included). Masks and biases
broadcast to [..., H, T, S]. Everything here is a pure function (no flax import); shapes, dtypes,
`is_causal`, `scale`, `dropout_rate` and `implementation` are static under `jit`.
"""

from __future__ import annotations

import math
from typing import Callable

import jax.numpy as jnp

from flax_mha import _checks
from flax_mha import chunked
from flax_mha import cudnn
from flax_mha import reference
from flax_mha import ring_attention

# name -> fn(query[B,T,H,K], key[B,S,G,K], value[B,S,G,V], bias, mask, *, is_causal, scale,
#            dropout_rate, dropout_rng) -> [B,T,H,V].
IMPLEMENTATIONS: dict[str, Callable] = {
    "reference": reference.attention,  # plain and readable: the one every other is tested against
    "chunked": chunked.attention,      # online softmax, linear memory, its own backward
    "cudnn": cudnn.attention,          # cuDNN flash attention (GPU, 16-bit inputs)
    "ring": ring_attention.attention,  # sequence-parallel over the 'seq' axis of jax.set_mesh
}

# Up to this many logits per (batch, head), one fused XLA graph beats the chunked loops on CPU
# (experiments/benchmark_attention.py, 2 cores, float32, forward+backward): at 512² the plain
# graph is 10-40% faster, except causal with K <= 64, where chunked tiles skip half the work and
# win by ~20% already at 512².
SMALL_LOGITS = 512 * 512
SMALL_LOGITS_CAUSAL_NARROW = 256 * 256  # causal, K <= 64


def register_implementation(name: str, fn: Callable) -> None:
  """Add an implementation with `reference.attention`'s signature under `name`."""
  IMPLEMENTATIONS[name] = fn


def default_implementation(query, key, value, bias, mask, *, is_causal: bool,
                           dropout_rate: float) -> str:
  """What `implementation=None` runs, decided at trace time from static shapes and the backend.

  1. On a GPU, "cudnn" where its constraints hold (16-bit, no dropout, K == V <= 128).
  2. Otherwise "reference" for small problems (T·S up to SMALL_LOGITS, or
     SMALL_LOGITS_CAUSAL_NARROW when causal with K <= 64), where one fused XLA graph has the
     least overhead, and "chunked" beyond, which is faster and needs memory linear in S.
  """
  del bias, mask
  if cudnn.unsupported_reason(query, key, value, dropout_rate) is None:
    return "cudnn"
  narrow_causal = is_causal and query.shape[-1] <= 64
  limit = SMALL_LOGITS_CAUSAL_NARROW if narrow_causal else SMALL_LOGITS
  return "reference" if query.shape[1] * key.shape[1] <= limit else "chunked"


def dot_product_attention(query, key, value, bias=None, mask=None, *, is_causal: bool = False,
                          scale: float | None = None, dropout_rate: float = 0.0,
                          dropout_rng=None, implementation: str | None = None):
  """Scaled dot-product attention `softmax(Q·Kᵀ·scale + bias, masked)·V`.

  Args:
    query: [..., T, H, K] floating.
    key: [..., S, G, K], same dtype; H must be a multiple of G (GQA/MQA: query head h reads
      key/value head h // (H // G); K/V are never materialised H times).
    value: [..., S, G, V]; V may differ from K.
    bias: optional additive bias, floating, broadcastable to [..., H, T, S].
    mask: optional boolean mask, True = attend, broadcastable to [..., H, T, S].
    is_causal: static; query i sees keys j <= i (top-left aligned when T != S).
    scale: static multiplier of the logits; default 1/sqrt(K).
    dropout_rate: static rate of dropout on the attention weights, in [0, 1).
    dropout_rng: a `jax.random.key`, required when dropout_rate > 0. The keep-mask is a pure
      function of (rng, batch·head, t, s), so every implementation drops the same weights.
    implementation: None (the best available, chosen at trace time by
      `default_implementation`), or a name in `IMPLEMENTATIONS`, e.g. "reference".

  Returns:
    [..., T, H, V] in the input dtype. Softmax runs in float32 for 16-bit inputs. A query row whose
    every key is masked gets output 0 and finite gradients, never NaN.
  """
  args = _prepare(query, key, value, bias, mask, is_causal, scale, dropout_rate, dropout_rng)
  q, k, v, bias4, mask4, scale = args
  name = implementation
  if name is None:
    name = default_implementation(q, k, v, bias4, mask4, is_causal=is_causal,
                                  dropout_rate=dropout_rate)
  if name not in IMPLEMENTATIONS:
    raise ValueError(
        f"implementation must be None or one of {sorted(IMPLEMENTATIONS)}, got {implementation!r}")
  out_BTHV = IMPLEMENTATIONS[name](
      q, k, v, bias4, mask4, is_causal=is_causal, scale=scale,
      dropout_rate=float(dropout_rate), dropout_rng=dropout_rng)
  return out_BTHV.reshape(*query.shape[:-1], value.shape[-1])


def dot_product_attention_weights(query, key, bias=None, mask=None, *, is_causal: bool = False,
                                  scale: float | None = None, dropout_rate: float = 0.0,
                                  dropout_rng=None):
  """Attention weights [..., H, T, S] (softmax dtype), as used by `dot_product_attention`.

  Same arguments and conventions as `dot_product_attention`, without `value`. Fully masked rows
  are all zero. Materialises the [..., H, T, S] matrix: for plots and small inputs.
  """
  value = key[..., :0]  # shape-only stand-in so the shared checks apply
  q, k, _, bias4, mask4, scale = _prepare(
      query, key, value, bias, mask, is_causal, scale, dropout_rate, dropout_rng)
  weights_BHTS = reference.attention_weights(
      q, k, bias4, mask4, is_causal=is_causal, scale=scale,
      dropout_rate=float(dropout_rate), dropout_rng=dropout_rng)
  return weights_BHTS.reshape(*query.shape[:-3], *weights_BHTS.shape[1:])


def split_heads(x, num_heads: int):
  """[..., T, H·K] -> [..., T, H, K]."""
  _checks.check_array("x", x, 2, "[..., T, H*K]", floating=False)
  if not isinstance(num_heads, int) or num_heads <= 0:
    raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
  if x.shape[-1] % num_heads:
    raise ValueError(
        f"x's last dim ({x.shape[-1]}) must be divisible by num_heads={num_heads}")
  return x.reshape(*x.shape[:-1], num_heads, x.shape[-1] // num_heads)


def merge_heads(x):
  """[..., T, H, K] -> [..., T, H·K]."""
  _checks.check_array("x", x, 3, "[..., T, H, K]", floating=False)
  return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


def _prepare(query, key, value, bias, mask, is_causal, scale, dropout_rate, dropout_rng):
  """Check everything, then flatten the batch dims: ([B,T,H,K], [B,S,G,K], [B,S,G,V], bias, mask)."""
  _checks.check_qkv(query, key, value)
  if not isinstance(is_causal, bool):
    raise TypeError(f"is_causal must be a Python bool, got {type(is_causal).__name__}")
  _checks.check_scale(scale)
  _checks.check_dropout(dropout_rate, dropout_rng)
  *batch, t, h, k = query.shape
  s = key.shape[-3]
  target = (*batch, h, t, s)
  if bias is not None:
    _checks.check_broadcast("bias", bias, target, boolean=False)
  if mask is not None:
    _checks.check_broadcast("mask", mask, target, boolean=True)
  scale = 1.0 / math.sqrt(k) if scale is None else scale
  b = math.prod(batch)
  flat = lambda x: x.reshape(b, *x.shape[len(batch):])
  return (flat(query), flat(key), flat(value), _flatten_batch(bias, batch),
          _flatten_batch(mask, batch), scale)


def _flatten_batch(x, batch):
  """Rank-4 [B or 1, H or 1, T or 1, S or 1] view of a mask/bias broadcasting to [*batch, H, T, S]."""
  if x is None:
    return None
  x = jnp.asarray(x)
  x = x.reshape((1,) * (len(batch) + 3 - x.ndim) + x.shape)  # pad to rank len(batch) + 3
  lead, tail = x.shape[:len(batch)], x.shape[len(batch):]
  if all(d == 1 for d in lead):
    return x.reshape(1, *tail)
  return jnp.broadcast_to(x, (*batch, *tail)).reshape(math.prod(batch), *tail)

