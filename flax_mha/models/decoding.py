"""Autoregressive decoding with the KV cache: greedy and beam search.

The source is encoded once; the decoder then runs one token a step on a `decode=True` clone of the
model whose self-attention reads cached keys/values. Both functions are jitted (config and sizes
static) and stop early once every sequence has emitted eos. Output: [B, max_len] int32, without the
leading bos, pad after eos.

Shapes: B batch, S source length, L output length (max_len), W beam width, C vocabulary size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from flax_mha import checks
from flax_mha.models.transformer import Transformer, TransformerConfig


def greedy_decode(config: TransformerConfig | Transformer, params, src, *, max_len: int):
  """Greedy decoding: src [B, S] int -> tokens [B, max_len] int32. `config` may be the model."""
  config = _check(config, src, max_len)
  return _greedy(config, params, src, max_len)


def beam_search(config: TransformerConfig | Transformer, params, src, *, max_len: int,
                beam_size: int = 4, alpha: float = 0.6):
  """Beam search with the GNMT length penalty ((5 + len) / 6)^alpha; returns the best beam.

  src [B, S] int -> tokens [B, max_len] int32. `beam_size=1` is greedy decoding.
  """
  config = _check(config, src, max_len)
  checks.check_int("beam_size", beam_size)
  tokens, _ = _beam(config, params, src, max_len, beam_size, float(alpha))
  return tokens


def length_penalty(length, alpha: float):
  """GNMT's ((5 + length) / 6)^alpha, by which a sequence's log-prob is divided."""
  return ((5.0 + length) / 6.0) ** alpha


def _check(config, src, max_len) -> TransformerConfig:
  """The config (from a model too), after checking the arguments."""
  config = config.config if isinstance(config, Transformer) else config
  if not isinstance(config, TransformerConfig):
    raise TypeError(
        f"config must be a TransformerConfig or Transformer, got {type(config).__name__}")
  checks.check_tokens("src", src)
  if not isinstance(src, jax.core.Tracer):  # under jit the ids are traced: the caller's job
    checks.check_token_ids("src", src, config.vocab_size)
  checks.check_int("max_len", max_len, highest=config.max_len)
  return config


def _start(config, params, src, max_len, copies: int):
  """Encode src, repeat it `copies` times per example, and make an empty decoder cache."""
  config = config.replace(dropout_rate=0.0, attention_dropout_rate=0.0)
  memory, src_valid = Transformer(config).apply({"params": params}, src,
                                                method=Transformer.encode)
  memory = jnp.repeat(memory, copies, axis=0)
  src_valid = jnp.repeat(src_valid, copies, axis=0)
  decoder = Transformer(config.replace(decode=True))
  dummy = jnp.zeros((memory.shape[0], max_len), jnp.int32)
  shapes = jax.eval_shape(
      lambda: decoder.init(jax.random.key(0), dummy, memory, src_valid, method=Transformer.decode))
  cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])
  return decoder, memory, src_valid, cache


def _step(decoder, params, cache, tokens_B1, memory, src_valid):
  """One decoder step: log-probs [B, C] of the next token and the updated cache."""
  logits_B1C, mutated = decoder.apply(
      {"params": params, "cache": cache}, tokens_B1, memory, src_valid,
      method=Transformer.decode, mutable=["cache"])
  return jax.nn.log_softmax(logits_B1C[:, -1]), mutated["cache"]


@functools.partial(jax.jit, static_argnums=(0, 3))
def _greedy(config, params, src, max_len):
  decoder, memory, src_valid, cache = _start(config, params, src, max_len, 1)
  batch = src.shape[0]
  tokens_BL = jnp.full((batch, max_len), config.pad_id, jnp.int32)
  last_B = jnp.full((batch,), config.bos_id, jnp.int32)
  done_B = jnp.zeros((batch,), bool)

  def body(state):
    t, tokens_BL, last_B, done_B, cache = state
    logprobs_BC, cache = _step(decoder, params, cache, last_B[:, None], memory, src_valid)
    # A finished sequence emits pad from the step after its eos on.
    next_B = jnp.where(done_B, config.pad_id, jnp.argmax(logprobs_BC, -1).astype(jnp.int32))
    tokens_BL = tokens_BL.at[:, t].set(next_B)
    return t + 1, tokens_BL, next_B, done_B | (next_B == config.eos_id), cache

  cond = lambda state: (state[0] < max_len) & ~jnp.all(state[3])
  return jax.lax.while_loop(cond, body, (0, tokens_BL, last_B, done_B, cache))[1]


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5))
def _beam(config, params, src, max_len, beam_size, alpha):
  """Returns (best tokens [B, L], their penalised scores [B])."""
  batch, w = src.shape[0], beam_size
  decoder, memory, src_valid, cache = _start(config, params, src, max_len, w)
  tokens_BWL = jnp.full((batch, w, max_len), config.pad_id, jnp.int32)
  # Only beam 0 is live at the start, so the W beams don't begin as W copies of one.
  logprob_BW = jnp.tile(jnp.array([0.0] + [-1e9] * (w - 1)), (batch, 1))
  done_BW = jnp.zeros((batch, w), bool)
  score_BW = jnp.zeros((batch, w))  # penalised score, final once a beam is done

  def body(state):
    t, tokens_BWL, logprob_BW, done_BW, score_BW, cache = state
    last_BW = jnp.where(t == 0, config.bos_id, tokens_BWL[:, :, jnp.maximum(t - 1, 0)])
    step_lp, cache = _step(decoder, params, cache, last_BW.reshape(-1, 1), memory, src_valid)
    vocab = step_lp.shape[-1]
    step_lp_BWC = step_lp.reshape(batch, w, vocab)
    # A finished beam has one continuation, pad, at no cost, and keeps its score.
    only_pad_C = jnp.full((vocab,), -jnp.inf).at[config.pad_id].set(0.0)
    step_lp_BWC = jnp.where(done_BW[..., None], only_pad_C, step_lp_BWC)
    cand_lp = (logprob_BW[..., None] + step_lp_BWC).reshape(batch, w * vocab)  # [B, W·C]
    is_pad = (jnp.arange(w * vocab) % vocab == config.pad_id)[None, :]
    done_score = jnp.where(is_pad, jnp.repeat(score_BW, vocab, axis=1), -jnp.inf)
    cand_score = jnp.where(jnp.repeat(done_BW, vocab, axis=1), done_score,
                           cand_lp / length_penalty(t + 1.0, alpha))
    score_BW, flat_BW = jax.lax.top_k(cand_score, w)
    beam_BW, token_BW = flat_BW // vocab, (flat_BW % vocab).astype(jnp.int32)
    logprob_BW = jnp.take_along_axis(cand_lp, flat_BW, axis=1)
    was_done_BW = jnp.take_along_axis(done_BW, beam_BW, axis=1)
    tokens_BWL = jnp.take_along_axis(tokens_BWL, beam_BW[..., None], axis=1)
    tokens_BWL = tokens_BWL.at[:, :, t].set(token_BW)
    done_BW = was_done_BW | (token_BW == config.eos_id)
    cache = jax.tree.map(functools.partial(_gather_beams, beam_BW), cache)
    return t + 1, tokens_BWL, logprob_BW, done_BW, score_BW, cache

  cond = lambda state: (state[0] < max_len) & ~jnp.all(state[3])
  _, tokens_BWL, _, _, score_BW, _ = jax.lax.while_loop(
      cond, body, (0, tokens_BWL, logprob_BW, done_BW, score_BW, cache))
  best_B = jnp.argmax(score_BW, axis=1)
  return (jnp.take_along_axis(tokens_BWL, best_B[:, None, None], axis=1)[:, 0],
          jnp.take_along_axis(score_BW, best_B[:, None], axis=1)[:, 0])


def _gather_beams(beam_BW, x):
  """Reorder a cache leaf [B·W, ...] by the chosen parent beams; scalars (indices) pass through."""
  if x.ndim == 0:
    return x
  batch, w = beam_BW.shape
  x = x.reshape(batch, w, *x.shape[1:])
  idx = beam_BW.reshape(batch, w, *([1] * (x.ndim - 2)))
  return jnp.take_along_axis(x, idx, axis=1).reshape(batch * w, *x.shape[2:])
