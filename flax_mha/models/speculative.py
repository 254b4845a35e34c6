"""Speculative decoding: several tokens per step of the model, the same greedy tokens, and the
model's own distribution when sampling.

  tokens = speculative.generate(lm, params, (prompts,), prompts, lengths, max_new_tokens=64,
                                drafter=speculative.PromptLookup(), num_speculative_tokens=4)

Each round a drafter proposes k tokens per row; the target model scores the row's pending
token and the k drafts in one call through its KV cache (a step of k + 1 queries, chosen by
dispatch like every other step); the longest prefix the target agrees with is kept, plus one
token of the target's own. Rows advance unevenly: each keeps its own count. Rejected positions
roll back as data: each cache's rows are cut back to their kept length (`KVCache.rollback`), so
what attention reads is what a cache that never saw them holds. A rolling (sliding-window)
cache is made with k extra slots (`init_cache(..., rollback=k)`), so the tokens a rollback
needs are never overwritten.

Greedy: a draft is kept while it equals the target's argmax; the tokens are plain greedy
decoding's. Sampling: the rejection rule of Leviathan et al. (2023) and Chen et al. (2023),
draft d at step i kept with probability min(1, p_i(d) / q_i(d)), the first rejected one replaced
by a draw from max(0, p_i - q_i) normalised, a bonus draw from p_k when all are kept: the
tokens' distribution is exactly the target's p (its sampler's temperature / top-k / top-p),
whatever the drafter proposes. q is the drafter's: one-hot for prompt lookup, the draft
model's own sampler distribution for a draft model.

Drafters, behind one interface (`Drafter`: `split`, `init`, `serving_state`, `read`,
`offered`: the drafts each row has or None for all k, `propose`, `commit`):
- `PromptLookup(ngram)`: the last n tokens (n = ngram, then shorter) matched against the
  prompt and what has been generated, the latest match's continuation proposed (read as an
  overlapping copy: a repeating phrase is drafted past its last occurrence). No model. A row
  without a match drafts nothing: its drafts are -1, and a round where no row drafts is a step
  of one query, as plain decoding's.
- `DraftModel(model, params)`: any decodable decoder with the target's vocabulary, with its own
  cache, rolled back as the target's is.
An EAGLE/MTP-style head would be a third `Drafter` subclass.

The model must be a decoder-only one whose `init_cache` takes `rollback=` (both DecoderLMs);
the encoder-decoder Transformer is refused by name (its cache holds the source's keys beside
the decoder's, which a rollback must not touch). Shapes: B batch, L prompt length, N new tokens,
k drafts per round (`num_speculative_tokens`), M = L + N + k history, C vocabulary.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from flax_mha import cache as cache_lib
from flax_mha import checks
from flax_mha.models import decoding
from flax_mha.models import sampling


def rollback(caches, length_B):
  """Every cache (KVCache or PagedKVCache) in the pytree `caches` cut back to length_B [B]
  tokens per row."""
  return jax.tree.map(lambda c: c.rollback(length_B) if cache_lib.is_cache(c) else c, caches,
                      is_leaf=cache_lib.is_cache)


def fold_rows(keys_B, data):
  """Each row's key [B] folded with `data`."""
  return jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys_B, data)


class Drafter(abc.ABC):
  """What proposes drafts: `PromptLookup` and `DraftModel`; an EAGLE/MTP-style head would be a
  third subclass. Its methods are pure and traced inside the decoding loops; `state` is the
  drafter's own (a draft model's cache), `arrays` what `split` took out to be traced."""

  @abc.abstractmethod
  def split(self):
    """(the drafter as a static, hashable argument, its arrays to trace)."""

  @abc.abstractmethod
  def init(self, arrays, model_context, prompts, lengths, capacity, rollback_slots):
    """Its state for `generate`, having read the prompts [B, L] (lengths [B])."""

  def serving_state(self, arrays, make_cache):
    """Its state in a serving loop, made with the loop's pool: `make_cache(model, params)`
    gives a decoder's paged caches on the target's page table. None needed: ()."""
    del arrays, make_cache
    return ()

  @abc.abstractmethod
  def read(self, arrays, state, tokens, positions):
    """Its state after prompt tokens [B, T] at positions [B, T] (-1: none) are read."""

  @abc.abstractmethod
  def offered(self, arrays, state, history_BM, length_B, k):
    """[B] the drafts each row has for a round of k, or None: all rows k."""

  @abc.abstractmethod
  def propose(self, arrays, state, history_BM, length_B, live_B, k, keys_B, sampler):
    """(state, drafts [B, k] int32 (-1: none), q [B, k, C] their distributions or None:
    one-hot, the drafts certain)."""

  @abc.abstractmethod
  def commit(self, state, history_BM, kept_B):
    """Its state once the target kept `kept_B` [B] tokens of its cache."""


@dataclasses.dataclass(frozen=True)
class PromptLookup(Drafter):
  """Drafts the continuation of the latest earlier occurrence of the row's last `ngram`
  tokens (then of shorter suffixes) in its prompt and generated tokens, read as an overlapping
  copy (as LZ77's): a match d tokens back continues with period d, so the phrase it found is
  drafted again past its end. With no match, no drafts (-1): a draft that is a guess costs a
  larger step of the target and is most likely rejected."""
  ngram: int = 3

  def __post_init__(self):
    checks.check_int("ngram", self.ngram)

  def split(self):
    """(the drafter as a static argument, its arrays): nothing to trace."""
    return self, None

  def init(self, arrays, model_context, prompts, lengths, capacity, rollback_slots):
    del arrays, model_context, prompts, lengths, capacity, rollback_slots
    return ()

  def read(self, arrays, state, tokens, positions):
    """Prompt tokens read (a serving loop's prefill piece): nothing to keep."""
    del arrays, tokens, positions
    return state

  def match(self, history_BM, length_B):
    """[B]: where the latest earlier occurrence of each row's last n tokens ends (n = ngram,
    then shorter), -1 where there is none."""
    b, m = history_BM.shape
    at = jnp.arange(m)
    best = jnp.full((b,), -1, jnp.int32)
    for n in range(self.ngram, 0, -1):
      suffix = jnp.take_along_axis(history_BM, length_B[:, None] - n + jnp.arange(n), axis=1)
      match = (at >= n - 1) & (at < length_B[:, None] - 1)
      for j in range(n):  # history[i - j] == suffix[n - 1 - j]
        shifted = jnp.roll(history_BM, j, axis=1)
        match &= shifted == suffix[:, n - 1 - j, None]
      found = jnp.max(jnp.where(match, at, -1), axis=1)
      best = jnp.where((best < 0) & (length_B >= n + 1), found, best)
    return best

  def offered(self, arrays, state, history_BM, length_B, k):
    """[B]: the drafts each row has, k where its n-gram matched, 0 where none did."""
    del arrays, state
    return jnp.where(self.match(history_BM, length_B) >= 0, k, 0)

  def propose(self, arrays, state, history_BM, length_B, live_B, k, keys_B, sampler):
    """(state, drafts [B, k] (-1: the row has none), q None: one-hot, the drafts are
    certain)."""
    del arrays, live_B, keys_B, sampler
    best = self.match(history_BM, length_B)
    period = jnp.maximum(length_B - 1 - best, 1)  # the match's distance back
    source = best[:, None] + 1 + jnp.arange(k) % period[:, None]
    drafts = jnp.take_along_axis(history_BM, jnp.clip(source, 0, history_BM.shape[1] - 1), 1)
    return state, jnp.where(best[:, None] >= 0, drafts, -1), None

  def commit(self, state, history_BM, kept_B):
    del history_BM, kept_B
    return state


@dataclasses.dataclass(frozen=True)
class DraftModel(Drafter):
  """A smaller decoder with the target's vocabulary drafts with its own cache (rolled back as
  the target's): `model` linen with `params`, or NNX with params None. It draws its drafts
  with the target's sampler (greedy: its argmax). Its caches may be paged (a serving loop's,
  on the target's page table)."""
  model: Any
  params: Any = None

  def split(self):
    """(the drafter as a static argument: its model in `decoding.decodable`'s form, its
    parameters or NNX state, traced)."""
    model, params = decoding.decodable(self.model, self.params)
    return DraftModel(model), params

  def init(self, params, model_context, prompts, lengths, capacity, rollback_slots):
    """Its cache, prefilled with the prompts."""
    return decoding.prefill(self.model, params, model_context, prompts, lengths, capacity,
                            rollback=rollback_slots)[0]

  def serving_state(self, arrays, make_cache):
    """Its paged caches on the target's page table."""
    return make_cache(self.model, arrays)

  def read(self, params, cache, tokens, positions):
    """Its cache after reading prompt tokens [B, T] at positions [B, T] (-1: none)."""
    return self.model.apply(params, tokens, cache, positions, method="logits")[1]

  def offered(self, arrays, state, history_BM, length_B, k):
    """None: every row drafts its k (what the model proposes is never known beforehand)."""
    del arrays, state, history_BM, length_B, k

  def propose(self, params, cache, history_BM, length_B, live_B, k, keys_B, sampler):
    """k drafts per row: the tokens its cache lacks (1 or 2: the last kept ones) fed first;
    their distributions q [B, k, C] when sampling (greedy needs none: None). Rows not live_B
    [B] write nothing."""
    model = self.model
    held = cache_length(cache)
    feed = held[:, None] + jnp.arange(2)
    positions = jnp.where((feed < length_B[:, None]) & live_B[:, None], feed, -1)
    tokens = jnp.take_along_axis(history_BM, jnp.clip(feed, 0, history_BM.shape[1] - 1), 1)
    logits, cache = model.apply(params, jnp.where(positions >= 0, tokens, 0), cache, positions,
                                method="logits")
    logits = jnp.take_along_axis(logits, jnp.clip(length_B - held - 1, 0, 1)[:, None, None],
                                 axis=1)[:, 0]
    greedy = isinstance(sampler, sampling.Greedy)
    rows = sampling.as_rows(sampler, history_BM.shape[0])
    drafts, qs = [], []
    for i in range(k):
      if not greedy:
        qs.append(rows.probs(logits[:, None])[:, 0])
      token = rows.draw(logits, fold_rows(keys_B, i))
      drafts.append(token)
      if i + 1 < k:
        logits, cache = model.apply(params, token[:, None], cache,
                                    jnp.where(live_B, length_B + i, -1)[:, None],
                                    method="logits")
        logits = logits[:, 0]
    return cache, jnp.stack(drafts, 1), None if greedy else jnp.stack(qs, 1)

  def commit(self, cache, history_BM, kept_B):
    """Its cache cut back to what the target kept (`kept_B` tokens in the target's cache)."""
    del history_BM
    return rollback(cache, jnp.minimum(cache_length(cache), kept_B))


def check_drafter(drafter, vocab_size: int | None = None, method: str = "init_cache",
                  static=(8,)):
  """`drafter` as it is, refused when it is not a `Drafter` (a `PromptLookup()`, a
  `DraftModel(...)`: TypeError), or, given vocab_size, when a draft model's logits are not over
  vocab_size tokens (ValueError); method and static: the draft model's cache method and its int
  arguments, for its shapes."""
  if not isinstance(drafter, Drafter):
    raise TypeError("drafter must be a PromptLookup() or a DraftModel(...) (a Drafter), got "
                    f"{type(drafter).__name__}")
  if isinstance(drafter, DraftModel) and vocab_size is not None:
    model, params = decoding.decodable(drafter.model, drafter.params)
    context = (jnp.zeros((1, 1), jnp.int32),) if method == "init_cache" else ()
    size = decoding.vocabulary(model, params, method, context, static)
    if size != vocab_size:
      raise ValueError(f"the draft model's vocabulary must be the model's ({vocab_size} "
                       f"tokens), got {size}")
  return drafter


def cache_length(caches):
  """[B]: the tokens the first cache of the pytree `caches` holds per row."""
  leaves = jax.tree.leaves(caches, is_leaf=cache_lib.is_cache)
  return next(c for c in leaves if cache_lib.is_cache(c)).length


def generate(model, params, context, prompts, prompt_lengths=None, *, max_new_tokens: int,
             drafter, num_speculative_tokens: int = 4, sampler=sampling.Greedy(),
             stop_tokens=(), pad_id: int = 0, rng=None, cache_dtype=None):
  """`decoding.generate` with a drafter: tokens [B, max_new_tokens] int32 (pad_id after a stop
  token), greedy ones equal to `decoding.generate`'s, sampled ones from the same distribution.

  Arguments as `decoding.generate`'s, plus drafter (`PromptLookup()` or `DraftModel(...)`) and
  num_speculative_tokens k (static: drafts per round; the target scores k + 1 tokens a round).
  Raises ValueError naming a model whose cache cannot roll back (the Transformer).
  """
  return generate_with_stats(model, params, context, prompts, prompt_lengths,
                             max_new_tokens=max_new_tokens, drafter=drafter,
                             num_speculative_tokens=num_speculative_tokens, sampler=sampler,
                             stop_tokens=stop_tokens, pad_id=pad_id, rng=rng,
                             cache_dtype=cache_dtype)[0]


@dataclasses.dataclass(frozen=True)
class Stats:
  """What a speculative run did: rounds of the target, drafts proposed and kept (rows still
  generating only)."""
  rounds: int
  drafted: int
  accepted: int

  @property
  def acceptance(self) -> float:
    return self.accepted / self.drafted if self.drafted else 0.0


def generate_with_stats(model, params, context, prompts, prompt_lengths=None, *,
                        max_new_tokens: int, drafter, num_speculative_tokens: int = 4,
                        sampler=sampling.Greedy(), stop_tokens=(), pad_id: int = 0, rng=None,
                        cache_dtype=None):
  """`generate`'s tokens and the run's `Stats`."""
  model, params = decoding.decodable(model, params)
  k = checks.check_int("num_speculative_tokens", num_speculative_tokens)
  context, prompts, prompt_lengths = decoding.as_token_arrays(context, prompts, prompt_lengths)
  check_drafter(drafter)
  prompts, prompt_lengths = decoding.check_generation(model, params, context, prompts,
                                                      prompt_lengths, max_new_tokens)
  if isinstance(drafter, DraftModel):  # (its vocabulary against the model's)
    check_drafter(drafter, decoding.vocabulary(model, params, "init_cache", context, (1,),
                                               prompts.shape[0]))
  if isinstance(sampler, sampling.Sampling) and rng is None:
    raise ValueError("sampling needs rng (a jax.random.key): the same key gives the same tokens")
  try:  # traced once per model and shapes (jit's cache), not at every call
    _rollback_cache.eval_shape(model, params, tuple(context), k)
  except TypeError:
    raise ValueError(f"speculative decoding needs a decoder whose caches roll back "
                     f"(init_cache(..., rollback=)): {type(model).__name__} has none (the "
                     "Transformer's cache holds its source's keys beside the decoder's)") from None
  rng = jax.random.key(0) if rng is None else rng
  drafter, draft_arrays = drafter.split()
  tokens, rounds, drafted, accepted, _ = _generate(
      model, params, tuple(context), prompts, prompt_lengths, rng, draft_arrays, max_new_tokens,
      drafter, k, sampler, tuple(stop_tokens), pad_id, decoding.check_cache_dtype(cache_dtype))
  if isinstance(tokens, jax.core.Tracer):
    return tokens, None
  return tokens, Stats(int(rounds), int(drafted), int(accepted))


@functools.partial(jax.jit, static_argnums=(0, 3))
def _rollback_cache(model, params, context, k):
  """A small cache of `model` with k rollback slots (a TypeError where it has none)."""
  return model.apply(params, *context, max_length=8, rollback=k, method="init_cache")


def ks(k: int) -> tuple[int, ...]:
  """The round sizes a run compiles: 1, 2, 4, ... below k, and k (`generate` adds 0 for a
  drafter whose rows may have none to draft: prompt lookup). A round drafts the smallest that
  covers every live row's own k (which grows by 2 while all its drafts are kept and shrinks by
  1 otherwise), so rows whose drafts fail cost rounds of 1 draft."""
  sizes, size = [], 1
  while size < k:
    sizes.append(size)
    size *= 2
  return (*sizes, k)


def accept(sampler, logits_BTC, drafts_BK, q_BKC, keys_B, proposed_BK=None):
  """(count [B] of new tokens, new tokens [B, k + 1]): the drafts kept, then the target's own,
  by the rule of the module docstring over the target's logits [B, k + 1, C] at the pending
  token and the k drafts. sampler: `Greedy()`, `Sampling(...)` or `sampling.Rows` (a greedy
  row's p is one-hot: the rule keeps a draft exactly while it is the argmax); keys_B: a key per
  row. A draft not `proposed_BK` (past its row's own k) is never kept; the token in its place
  is drawn from p, as from a draft distribution q of 0."""
  k = drafts_BK.shape[1]
  proposed_BK = jnp.ones(drafts_BK.shape, bool) if proposed_BK is None else proposed_BK
  if isinstance(sampler, sampling.Greedy):
    own = jnp.argmax(logits_BTC, -1).astype(jnp.int32)  # [B, k + 1]
    agree = (own[:, :k] == drafts_BK) & proposed_BK
    kept = jnp.sum(jnp.cumprod(agree, axis=1), axis=1)
    return kept + 1, jnp.where(jnp.arange(k + 1) < kept[:, None],
                               jnp.pad(drafts_BK, ((0, 0), (0, 1))), own)
  b, _, c = logits_BTC.shape
  p = sampling.as_rows(sampler, b).probs(logits_BTC)
  q = jax.nn.one_hot(drafts_BK, c, dtype=jnp.float32) if q_BKC is None else q_BKC
  q = jnp.where(proposed_BK[..., None], q, 0.0)
  take = lambda x: jnp.take_along_axis(x, drafts_BK[..., None], -1)[..., 0]
  # u [B, k]: a draw per row and position (not per round: a row's draws do not depend on how
  # many drafts its batch's round proposes)
  u = jax.vmap(lambda key: jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(key, i)))(
      jnp.arange(k)))(fold_rows(keys_B, 0))
  agree = (u * take(q) < take(p[:, :k])) & proposed_BK  # u < p(d) / q(d)
  kept = jnp.sum(jnp.cumprod(agree, axis=1), axis=1)
  residual = jnp.maximum(p[:, :k] - q, 0.0)
  residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p[:, :k])
  last = jnp.concatenate([residual, p[:, k:]], axis=1)  # [B, k + 1, C]: where the row stops
  at = jnp.take_along_axis(last, kept[:, None, None], axis=1)[:, 0]
  own = jax.vmap(jax.random.categorical)(fold_rows(keys_B, 1), jnp.log(at)).astype(jnp.int32)
  new = jnp.where(jnp.arange(k + 1) < kept[:, None], jnp.pad(drafts_BK, ((0, 0), (0, 1))),
                  own[:, None])
  return kept + 1, new


@functools.partial(jax.jit, static_argnums=(0, 7, 8, 9, 10, 11, 12, 13))
@cache_lib.caller_makes_room  # sized for every token a round may write
def _generate(model, params, context, prompts, lengths, rng, draft_arrays, max_new_tokens,
              drafter, k, sampler, stop_tokens, pad_id, cache_dtype):
  b, l = prompts.shape
  capacity = l + max_new_tokens + k
  cache, last = decoding.prefill(model, params, context, prompts, lengths, capacity,
                                 cache_dtype, rollback=k)
  first = sampler(last, jax.random.fold_in(rng, 0))
  stop = jnp.asarray(stop_tokens, jnp.int32)
  real = jnp.arange(l) < lengths[:, None]
  history = jnp.zeros((b, capacity), jnp.int32).at[:, :l].set(jnp.where(real, prompts, 0))
  history = history.at[jnp.arange(b), lengths].set(first)
  state = dict(round=jnp.int32(1), n=jnp.ones((b,), jnp.int32), length=lengths + 1,
               tokens=jnp.full((b, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first),
               done=jnp.isin(first, stop) | (max_new_tokens == 1), history=history, cache=cache,
               drafter=drafter.init(draft_arrays, context, prompts, lengths, capacity, k),
               own_k=jnp.full((b,), k, jnp.int32), drafted=jnp.int32(0),
               accepted=jnp.int32(0))

  def round_of(kk):
    """A round of kk drafts per row (a row's own k may be fewer: the rest are not kept)."""
    def run(s):
      keys = jax.random.split(jax.random.fold_in(rng, s["round"]), b)
      dstate, drafts, q = drafter.propose(draft_arrays, s["drafter"], s["history"],
                                          s["length"], ~s["done"], kk, fold_rows(keys, 0),
                                          sampler)
      proposed = (jnp.arange(kk) < s["own_k"][:, None]) & (drafts >= 0)
      drafts = jnp.maximum(drafts, 0)  # a row's -1 (none): fed as 0, never kept
      pending = jnp.take_along_axis(s["history"], s["length"][:, None] - 1, axis=1)
      held = s["length"] - 1
      positions = jnp.where(s["done"][:, None], -1, held[:, None] + jnp.arange(kk + 1))
      logits, cache = model.apply(params, jnp.concatenate([pending, drafts], 1), s["cache"],
                                  positions, method="logits")
      count, new = accept(sampler, logits, drafts, q, fold_rows(keys, 1), proposed)
      stops = jnp.isin(new, stop) & (jnp.arange(kk + 1) < count[:, None])
      count = jnp.where(stops.any(1), jnp.argmax(stops, axis=1) + 1, count)
      count = jnp.where(s["done"], 0, jnp.minimum(count, max_new_tokens - s["n"]))
      rows, j = jnp.arange(b)[:, None], jnp.arange(kk + 1)
      at = lambda offset: jnp.where(j < count[:, None], offset[:, None] + j, 10**9)
      kept = jnp.where(s["done"], held, held + count)  # the pending token and drafts kept
      live, made = ~s["done"], proposed.sum(1)
      return dict(
          s, round=s["round"] + 1, n=s["n"] + count, length=s["length"] + count,
          tokens=s["tokens"].at[rows, at(s["n"])].set(new, mode="drop"),
          history=s["history"].at[rows, at(s["length"])].set(new, mode="drop"),
          done=s["done"] | (s["n"] + count >= max_new_tokens) | stops.any(1),
          cache=rollback(cache, kept), drafter=drafter.commit(dstate, s["history"], kept),
          # a row whose drafts were all kept drafts 2 more next round; else 1 fewer (a row
          # that drafted none keeps its k)
          own_k=jnp.where(made == 0, s["own_k"], jnp.where(
              count - 1 >= made, jnp.minimum(s["own_k"] + 2, k), jnp.maximum(s["own_k"] - 1, 1))),
          drafted=s["drafted"] + jnp.where(live, made, 0).sum(),
          accepted=s["accepted"] + jnp.where(live, count - 1, 0).sum())
    return run

  offered = lambda s: drafter.offered(draft_arrays, s["drafter"], s["history"], s["length"], k)
  every_k = offered(state) is None  # a drafter whose rows all draft k: no round of none
  ladder = ks(k) if every_k else (0, *ks(k))

  def size_index(s):
    """Which size of the ladder the next round drafts: the smallest that covers every live
    row's own k, or the drafts it has when fewer."""
    wanted = jnp.where(s["done"], 0, s["own_k"])
    wanted = wanted if every_k else jnp.minimum(wanted, offered(s))
    return jnp.sum(jnp.asarray(ladder) < jnp.max(wanted))

  def rounds_of(index, kk):
    """Rounds of kk drafts while they are the size wanted. A loop per size inside the switch,
    not a switch per round: what a branch writes (the caches) is copied out of it, once a
    change of size here instead of every round (XLA:CPU)."""
    return lambda s: jax.lax.while_loop(
        lambda s: ~jnp.all(s["done"]) & (size_index(s) == index), round_of(kk), s)

  rounds = [rounds_of(index, kk) for index, kk in enumerate(ladder)]
  s = jax.lax.while_loop(lambda s: ~jnp.all(s["done"]),
                         lambda s: jax.lax.switch(size_index(s), rounds, s), state)
  return s["tokens"], s["round"] - 1, s["drafted"], s["accepted"], s["cache"]
