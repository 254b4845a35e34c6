"""One decoding module for every model: greedy, sampling and beam search over a cache that is data.

A model is decodable when it has two methods:

  init_cache(*context, max_length) -> cache      the decoding state (a pytree whose leaves all
                                                 lead with the batch dim B); with `dtype=` too
                                                 when a loop is given a `cache_dtype`
  logits(tokens [B, T], cache, positions) -> (logits [B, T, C], cache)

A linen module comes with its variables as `params` (the methods run through `model.apply`); an
NNX module comes alone (`params` None): `decodable` splits it into its structure and its state,
which the loops carry as `params` and merge inside `jit`, so the module is called directly and
its cache is data, as a linen one's. `flax_mha.models.DecoderLM` (context: its prompts),
`flax_mha.models.lm_nnx.DecoderLM` and `flax_mha.models.Transformer` (context: the source it
encodes once) are decodable.

Token ids (the prompts, and integer arrays of the context such as the source) must lie in
[0, C), C the size of the logits: when they are concrete, a ValueError names the first one
outside; inside `jit` they are traced and not checked (the models of `flax_mha.models` embed
an id outside [0, C), negative or >= C, as NaN; flax's `Embed` alone reads a negative one as
row C + id). Generation prefills the prompts in one call, each row at its own positions (rows
of different lengths, right-padded, waste nothing: padding has position -1), then feeds one
token a step. Everything is jitted with the model, sizes and sampler static;
the loop stops once every row has emitted a stop token (later tokens are `pad_id`).
`cache_dtype` (None: the model's own) is the dtype of the KV caches, `jnp.int8` for an int8
cache quantized per token and head (`flax_mha.quant`, `flax_mha.cache`): a quarter of a float32
cache's memory, at the cost of small changes in the logits that can change a greedy token.
A loop of one-row steps (batch 1, or one beam) on the CPU carries float32 copies of a bfloat16
or float16 model's parameters, made once per call before the loop (`step_params`): XLA:CPU has
no fast one-row low-precision product (`flax_mha.precision.explain` says what a call gets).

Shapes: B batch, L prompt length, N new tokens (max_new_tokens), W beam width, C vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_mha import cache as cache_lib
from flax_mha import checks
from flax_mha import platforms
from flax_mha import precision
from flax_mha import quant
from flax_mha.models.sampling import Greedy, Sampling


@dataclasses.dataclass(frozen=True)
class NNXModel:
  """An NNX module's structure (`nnx.split`'s graphdef) with linen's calling convention,
  `apply(state, *args, method=name)`: the module is merged from the state and its method called
  (inside the decoding loops' `jit`, so the state is traced and nothing is mutated)."""
  graphdef: Any
  position_limit: int | None = None  # the module's (see `position_limit`)

  def apply(self, state, *args, method: str = "__call__", **kwargs):
    return getattr(nnx.merge(self.graphdef, state), method)(*args, **kwargs)


def decodable(model, params=None):
  """(model, params) as the decoding loops take them: a linen module and its variables as they
  are; an NNX module (params None: it holds its own) as `NNXModel` and its state."""
  if isinstance(model, nnx.Module):
    if params is not None:
      raise ValueError(f"an NNX model holds its parameters: params must be None, got "
                       f"{type(params).__name__}")
    graphdef, state = nnx.split(model)
    return NNXModel(graphdef, position_limit(model)), state
  if not callable(getattr(model, "apply", None)):
    raise TypeError(f"model must be a linen module or an NNX module, got {type(model).__name__}")
  return model, params


def position_limit(model) -> int | None:
  """How many positions `model` embeds (its `position_limit` attribute: a learned table's size,
  as GPT-2's), or None when it takes any (rotary, or a model that does not say)."""
  return getattr(model, "position_limit", None)


def check_positions(model, prompt_length: int, max_new_tokens: int) -> None:
  """A prompt of `prompt_length` tokens and `max_new_tokens` within the model's positions: the
  tokens fed are at positions 0 .. prompt_length + max_new_tokens - 2 (the last new token is
  never fed back). A ValueError names both lengths and the limit; transformers raises an
  IndexError there, and inside `jit` such a position embeds as NaN."""
  limit = position_limit(model)
  if limit is not None and prompt_length + max_new_tokens - 1 > limit:
    raise ValueError(f"a prompt of {prompt_length} tokens and max_new_tokens={max_new_tokens} "
                     f"reach position {prompt_length + max_new_tokens - 2}, past the model's "
                     f"learned positions [0, {limit}): the prompt and max_new_tokens may hold "
                     f"{limit + 1} tokens in all")


def vocabulary(model, params, method: str, context=(), static=(), batch: int = 1) -> int:
  """C, the size of the logits `model` gives for one token after its cache method `method`
  (`*context, *static`; `static` ints): shapes only, nothing runs."""
  return _one_token.eval_shape(model, params, method, tuple(context), tuple(static),
                               batch).shape[-1]


@functools.partial(jax.jit, static_argnums=(0, 2, 4, 5))
def _one_token(model, params, method, context, static, batch):
  cache = model.apply(params, *context, *static, method=method)
  tokens = jnp.zeros((batch, 1), jnp.int32)
  return model.apply(params, tokens, cache, tokens, method="logits")[0]


def check_ids(name: str, ids, vocab_size: int, lengths=None) -> None:
  """Every id of `ids` [B, L] (the first `lengths` [B] of each row, when given) in
  [0, vocab_size), when concrete; traced ids (inside `jit`) are the caller's to check."""
  if isinstance(ids, jax.core.Tracer) or isinstance(lengths, jax.core.Tracer):
    return
  ids = np.asarray(ids)
  if lengths is not None:  # padding past a row's length is never read
    ids = np.where(np.arange(ids.shape[1]) < np.asarray(lengths)[:, None], ids, 0)
  checks.check_token_ids(name, ids, vocab_size)


def _check_ids(model, params, context, prompts, lengths, max_new_tokens) -> None:
  """The prompts' lengths and max_new_tokens against the model's positions; the prompts' ids
  and those of the context's integer arrays against the logits' size."""
  longest = prompts.shape[1] if isinstance(lengths, jax.core.Tracer) else int(np.max(lengths))
  check_positions(model, longest, max_new_tokens)
  if isinstance(prompts, jax.core.Tracer):
    return
  vocab = vocabulary(model, params, "init_cache", context, (1,), prompts.shape[0])
  check_ids("prompts", prompts, vocab, lengths)
  for i, x in enumerate(context):
    if x is not prompts and jnp.issubdtype(getattr(x, "dtype", float), jnp.integer):
      check_ids(f"context[{i}]", x, vocab)


def as_token_arrays(context, prompts, prompt_lengths=None):
  """(context, prompts, prompt_lengths) with Python lists taken as `serve` takes them: a list
  of prompts, ragged or not, right-padded with 0 (and, without prompt_lengths, each row's
  length as its own); a list in the context as an array. Arrays pass as they are."""
  if not isinstance(prompts, (list, tuple)):
    return _list_arrays(context), prompts, prompt_lengths
  rows = prompt_rows(prompts)
  padded = np.zeros((len(rows), max((len(r) for r in rows), default=0)), np.int32)
  for i, row in enumerate(rows):
    padded[i, :len(row)] = row
  if prompt_lengths is None and len({len(r) for r in rows}) > 1:
    prompt_lengths = np.array([len(r) for r in rows], np.int32)
  context = tuple(padded if x is prompts else x for x in context)  # an LM's context
  return _list_arrays(context), padded, prompt_lengths


def prompt_rows(prompts) -> list[np.ndarray]:
  """Each prompt of a sequence of prompts as int32 ids [L], refused by index when empty or not
  1-D integers (the ids' range is the caller's to check: `check_ids`)."""
  rows = []
  for i, prompt in enumerate(prompts):
    row = np.asarray(prompt)
    if row.size == 0:  # not its dtype: NumPy reads [] as float64
      raise ValueError(f"prompts[{i}] must be a non-empty sequence of integer token ids, got "
                       f"shape {row.shape}: it is empty")
    if row.ndim != 1 or not np.issubdtype(row.dtype, np.integer):
      raise ValueError(f"prompts[{i}] must be a sequence of integer token ids, got shape "
                       f"{row.shape} and dtype {row.dtype}")
    rows.append(row.astype(np.int32))
  return rows


def _list_arrays(context):
  return tuple(np.asarray(x, np.int32) if isinstance(x, (list, tuple)) else x for x in context)


def generate(model, params, context, prompts, prompt_lengths=None, *, max_new_tokens: int,
             sampler=Greedy(), stop_tokens=(), pad_id: int = 0, rng=None, cache_dtype=None):
  """Continue each prompt: tokens [B, max_new_tokens] int32 (pad_id after a stop token).

  Args:
    model: a decodable linen module (params: its variables) or NNX module (params: None); see
      the module docstring.
    context: tuple of `init_cache`'s positional arguments: what the model needs beside the
      prompts to start. For a DecoderLM, `(prompts,)`: its cache reads only the batch size B
      from it, so the prompts go twice (`generate(lm, params, (prompts,), prompts, ...)`); for
      the Transformer, `(src,)`, the source it encodes once, while the prompts are the target's
      first tokens (its bos). A Python list is taken as an array.
    prompts: [B, L] int, right-padded; prompt_lengths [B] (default: all L). A Python list of
      prompts (ragged or not) is right-padded here, its rows' lengths as prompt_lengths. A
      prompt and max_new_tokens past the model's positions (GPT-2's learned table) raise a
      ValueError (`check_positions`; inside `jit`, with lengths traced, for the padded L). Ids outside the
      vocabulary raise a ValueError when concrete (not inside `jit`); padding, past a row's
      length, is never read, whatever its ids.
    max_new_tokens: static; sampler: `Greedy()` or `Sampling(temperature, top_k, top_p)`.
    stop_tokens: ids that end a row (emitted, then pad_id); rng: a key, for sampling (the
      same key gives the same tokens).
    cache_dtype: the KV caches' dtype, passed to `init_cache(..., dtype=)`: None (the model's
      dtype), a floating dtype, or jnp.int8 (an int8 cache: see the module docstring).
  """
  model, params = decodable(model, params)
  context, prompts, prompt_lengths = as_token_arrays(context, prompts, prompt_lengths)
  prompts, prompt_lengths = check_generation(model, params, context, prompts, prompt_lengths,
                                             max_new_tokens)
  if isinstance(sampler, Sampling) and rng is None:
    raise ValueError("sampling needs rng (a jax.random.key): the same key gives the same tokens")
  rng = jax.random.key(0) if rng is None else rng
  return _generate(model, params, tuple(context), prompts, prompt_lengths, rng,
                   max_new_tokens, sampler, tuple(stop_tokens), pad_id,
                   check_cache_dtype(cache_dtype))


def check_generation(model, params, context, prompts, prompt_lengths, max_new_tokens):
  """(prompts, prompt_lengths) as int32 arrays, after `generate`'s checks of their shapes,
  lengths, ids and positions (see `generate`)."""
  prompts, prompt_lengths = _check(prompts, prompt_lengths, max_new_tokens)
  _check_ids(model, params, context, prompts, prompt_lengths, max_new_tokens)
  return prompts, prompt_lengths


def _check(prompts, prompt_lengths, max_new_tokens):
  checks.check_tokens("prompts", prompts)
  checks.check_int("max_new_tokens", max_new_tokens)
  if not isinstance(prompts, jax.core.Tracer):
    checks.check_int("prompt length L", prompts.shape[1])
  if prompt_lengths is None:
    prompt_lengths = jnp.full((prompts.shape[0],), prompts.shape[1], jnp.int32)
  lengths = jnp.asarray(prompt_lengths)
  if lengths.shape != (prompts.shape[0],) or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"prompt_lengths must be integer [B] = ({prompts.shape[0]},), got "
                     f"{lengths.dtype} {tuple(lengths.shape)}")
  if not isinstance(lengths, jax.core.Tracer) and not (
      np.all(np.asarray(lengths) >= 1) and np.all(np.asarray(lengths) <= prompts.shape[1])):
    raise ValueError(f"prompt_lengths must be in [1, L={prompts.shape[1]}], got {lengths}")
  return jnp.asarray(prompts, jnp.int32), lengths.astype(jnp.int32)


def check_cache_dtype(cache_dtype):
  """None, or the dtype of a KV cache (floating or int8: `flax_mha.quant`), hashable."""
  if cache_dtype is None:
    return None
  try:
    return quant.check_cache_dtype(cache_dtype)
  except TypeError as e:
    raise TypeError(f"cache_dtype: {e}") from None


@cache_lib.caller_makes_room  # sized below for every token written
def _prefill(model, params, context, prompts, lengths, max_new_tokens, cache_dtype=None):
  """(cache, last logits [B, C]): `prefill` into a cache of L + N - 1 tokens (the last new
  token is never fed back)."""
  return prefill(model, params, context, prompts, lengths,
                 prompts.shape[1] + max_new_tokens - 1, cache_dtype)


def prefill(model, params, context, prompts, lengths, max_length: int, cache_dtype=None,
            **cache_options):
  """(cache, last logits [B, C]): a cache of `max_length` tokens (`init_cache(*context,
  max_length=, dtype=cache_dtype, **cache_options)`) and the prompts [B, L] run in one call,
  each row at its own positions (the padding past lengths [B]: position -1, never written)."""
  dtype = {} if cache_dtype is None else {"dtype": cache_dtype}
  cache = model.apply(params, *context, max_length=max_length, method="init_cache", **dtype,
                      **cache_options)
  ar = jnp.arange(prompts.shape[1], dtype=jnp.int32)
  real = ar < lengths[:, None]
  positions = jnp.where(real, ar, -1)
  # Padding is never read, whatever its ids (`check_ids` skips it too): fed as id 0, so that
  # an id outside the vocabulary there does not embed as NaN and spread through attention.
  tokens = jnp.where(real, prompts, 0)
  logits, cache = model.apply(params, tokens, cache, positions, method="logits")
  return cache, jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]


def step_params(params, rows: int):
  """The parameters a loop of `rows`-row decode steps carries: on the CPU, one-row steps
  read float32 copies of low-precision ones, made here once (`flax_mha.precision.loop_params`
  and `explain` say why)."""
  return precision.loop_params(params, rows, platforms.backend_platform())


@cache_lib.caller_makes_room  # the loops stop at the _prefill's max_new_tokens
def _step(model, params, tokens_B, cache, logits, more):
  """Logits [B, C] of the next token after `tokens_B`, and the cache; unchanged (`logits`,
  `cache`) unless `more` tokens are to come."""
  def run():
    new_logits, new_cache = model.apply(params, tokens_B[:, None], cache,
                                        method="logits")
    return new_logits[:, 0].astype(logits.dtype), new_cache
  return jax.lax.cond(more, run, lambda: (logits, cache))


@functools.partial(jax.jit, static_argnums=(0, 6, 7, 8, 9, 10))
def _generate(model, params, context, prompts, lengths, rng, max_new_tokens, sampler,
              stop_tokens, pad_id, cache_dtype):
  cache, logits = _prefill(model, params, context, prompts, lengths, max_new_tokens,
                           cache_dtype)
  batch = prompts.shape[0]
  tokens_BN = jnp.full((batch, max_new_tokens), pad_id, jnp.int32)
  done_B = jnp.zeros((batch,), bool)
  stop = jnp.asarray(stop_tokens, jnp.int32)
  params = step_params(params, batch)

  def body(state):
    n, tokens_BN, done_B, logits, cache = state
    next_B = jnp.where(done_B, pad_id, sampler(logits, jax.random.fold_in(rng, n)))
    tokens_BN = tokens_BN.at[:, n].set(next_B)
    done_B = done_B | jnp.isin(next_B, stop)
    logits, cache = _step(model, params, next_B, cache, logits, n + 1 < max_new_tokens)
    return n + 1, tokens_BN, done_B, logits, cache

  cond = lambda state: (state[0] < max_new_tokens) & ~jnp.all(state[2])
  return jax.lax.while_loop(cond, body, (0, tokens_BN, done_B, logits, cache))[1]


def stream(model, params, context, prompt, *, max_new_tokens: int, sampler=Greedy(),
           stop_tokens=(), rng=None, cache_dtype=None):
  """`generate` for one prompt (prompt [1, L]), yielding each new token id as it is produced
  (a jitted prefill, then one jitted step per token: for a terminal, not for throughput).
  Arguments as `generate`'s; the ids are checked before the first token."""
  model, params = decodable(model, params)
  context, prompt, _ = as_token_arrays(context, prompt)
  prompt, lengths = _check(prompt, None, max_new_tokens)
  _check_ids(model, params, context, prompt, lengths, max_new_tokens)
  rng = jax.random.key(0) if rng is None else rng
  cache, logits = _jitted_prefill(model, params, tuple(context), prompt, lengths, max_new_tokens,
                                  check_cache_dtype(cache_dtype))
  params = step_params(params, prompt.shape[0])  # once, outside the steps' jit
  for n in range(max_new_tokens):
    token = int(sampler(logits, jax.random.fold_in(rng, n))[0])
    yield token
    if token in stop_tokens or n + 1 == max_new_tokens:
      return
    logits, cache = _jitted_step(model, params, jnp.array([token], jnp.int32), cache)


_jitted_prefill = jax.jit(_prefill, static_argnums=(0, 5, 6))


@functools.partial(jax.jit, static_argnums=(0,))
@cache_lib.caller_makes_room  # stream stops at the _prefill's max_new_tokens
def _jitted_step(model, params, tokens_B, cache):
  logits, cache = model.apply(params, tokens_B[:, None], cache, method="logits")
  return logits[:, 0], cache


def length_penalty(length, alpha: float):
  """GNMT's ((5 + length) / 6)^alpha, by which a sequence's log-prob is divided."""
  return ((5.0 + length) / 6.0) ** alpha


def generate_beam(model, params, context, prompts, prompt_lengths=None, *,
                  max_new_tokens: int, beam_size: int = 4, alpha: float = 0.6, stop_tokens=(),
                  pad_id: int = 0, cache_dtype=None):
  """Beam search with the GNMT length penalty; the best beam's tokens [B, max_new_tokens].

  Same arguments as `generate` (cache_dtype too); a beam ends at a stop token (emitted) and
  then scores only pad.
  `beam_size=1` is greedy decoding."""
  model, params = decodable(model, params)
  context, prompts, prompt_lengths = as_token_arrays(context, prompts, prompt_lengths)
  prompts, prompt_lengths = _check(prompts, prompt_lengths, max_new_tokens)
  _check_ids(model, params, context, prompts, prompt_lengths, max_new_tokens)
  checks.check_int("beam_size", beam_size)
  return _beam(model, params, tuple(context), prompts, prompt_lengths, max_new_tokens,
               beam_size, float(alpha), tuple(stop_tokens), pad_id,
               check_cache_dtype(cache_dtype))[0]


@functools.partial(jax.jit, static_argnums=(0, 5, 6, 7, 8, 9, 10))
def _beam(model, params, context, prompts, lengths, max_new_tokens, beam_size, alpha,
          stop_tokens, pad_id, cache_dtype):
  """(best tokens [B, N], their penalised scores [B])."""
  batch, w = prompts.shape[0], beam_size
  cache, logits_BC = _prefill(model, params, context, prompts, lengths, max_new_tokens,
                              cache_dtype)
  cache = jax.tree.map(lambda x: jnp.repeat(x, w, axis=0), cache)  # each row's W beams
  params = step_params(params, batch * w)
  step_lp = jnp.repeat(jax.nn.log_softmax(logits_BC), w, axis=0)  # [B·W, C]
  tokens_BWN = jnp.full((batch, w, max_new_tokens), pad_id, jnp.int32)
  # Only beam 0 is live at the start, so the W beams don't begin as W copies of one.
  logprob_BW = jnp.tile(jnp.array([0.0] + [-1e9] * (w - 1)), (batch, 1))
  done_BW = jnp.zeros((batch, w), bool)
  score_BW = jnp.zeros((batch, w))  # penalised score, final once a beam is done
  stop = jnp.asarray(stop_tokens, jnp.int32)

  def body(state):
    n, tokens_BWN, logprob_BW, done_BW, score_BW, step_lp, cache = state
    vocab = step_lp.shape[-1]
    step_lp_BWC = step_lp.reshape(batch, w, vocab)
    # A finished beam has one continuation, pad, at no cost, and keeps its score.
    only_pad_C = jnp.full((vocab,), -jnp.inf).at[pad_id].set(0.0)
    step_lp_BWC = jnp.where(done_BW[..., None], only_pad_C, step_lp_BWC)
    cand_lp = (logprob_BW[..., None] + step_lp_BWC).reshape(batch, w * vocab)  # [B, W·C]
    is_pad = (jnp.arange(w * vocab) % vocab == pad_id)[None, :]
    done_score = jnp.where(is_pad, jnp.repeat(score_BW, vocab, axis=1), -jnp.inf)
    cand_score = jnp.where(jnp.repeat(done_BW, vocab, axis=1), done_score,
                           cand_lp / length_penalty(n + 1.0, alpha))
    score_BW, flat_BW = jax.lax.top_k(cand_score, w)
    beam_BW, token_BW = flat_BW // vocab, (flat_BW % vocab).astype(jnp.int32)
    logprob_BW = jnp.take_along_axis(cand_lp, flat_BW, axis=1)
    was_done_BW = jnp.take_along_axis(done_BW, beam_BW, axis=1)
    tokens_BWN = jnp.take_along_axis(tokens_BWN, beam_BW[..., None], axis=1)
    tokens_BWN = tokens_BWN.at[:, :, n].set(token_BW)
    done_BW = was_done_BW | jnp.isin(token_BW, stop)
    cache = jax.tree.map(functools.partial(_gather_beams, beam_BW), cache)
    logits, cache = _step(model, params, token_BW.reshape(-1), cache, step_lp,
                          n + 1 < max_new_tokens)
    return (n + 1, tokens_BWN, logprob_BW, done_BW, score_BW, jax.nn.log_softmax(logits),
            cache)

  cond = lambda state: (state[0] < max_new_tokens) & ~jnp.all(state[3])
  _, tokens_BWN, _, _, score_BW, _, _ = jax.lax.while_loop(
      cond, body, (0, tokens_BWN, logprob_BW, done_BW, score_BW, step_lp, cache))
  best_B = jnp.argmax(score_BW, axis=1)
  return (jnp.take_along_axis(tokens_BWN, best_B[:, None, None], axis=1)[:, 0],
          jnp.take_along_axis(score_BW, best_B[:, None], axis=1)[:, 0])


def _gather_beams(beam_BW, x):
  """Reorder a cache leaf [B·W, ...] by the chosen parent beams."""
  batch, w = beam_BW.shape
  x = x.reshape(batch, w, *x.shape[1:])
  idx = beam_BW.reshape(batch, w, *([1] * (x.ndim - 2)))
  return jnp.take_along_axis(x, idx, axis=1).reshape(batch * w, *x.shape[2:])
