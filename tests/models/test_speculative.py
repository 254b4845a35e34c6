"""Speculative decoding (flax_mha.models.speculative): a rollback leaves what a cache that never
saw the rejected tokens holds (full, int8, rolling); greedy tokens equal plain decoding's with
prompt lookup and a draft model, rows accepting unevenly; the rejection rule keeps the target's
distribution (a chi-square bound, and a wrong rule it catches); refusals named. Every HF
family's tiny checkpoint is in tests/models/test_hf_integration.py; a draft model, the model
drafting for itself, an int8 cache and jit in tests/models/test_speculative_integration.py."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_mha import cache as cache_lib
from flax_mha.models import decoding, sampling, speculative
from flax_mha.models.lm import DecoderLM, LMConfig
from flax_mha.models.transformer import Transformer, TransformerConfig

from helpers import random_params

VOCAB = 17


def lm(local_window=5, seed=3, **kwargs):
  model = DecoderLM(LMConfig(vocab_size=VOCAB, d_model=32, num_heads=4, num_kv_heads=2,
                             num_layers=2, d_ff=48, local_window=local_window,
                             logit_soft_cap=5.0, **kwargs))
  x = jnp.zeros((1, 8), jnp.int32)
  return model, random_params(model, x, x, x, seed=seed)


def prompts():
  """A repetitive row (drafts by lookup are right), a random one (mostly wrong), and a short
  one, right-padded."""
  rng = np.random.default_rng(0)
  rows = np.zeros((3, 24), np.int32)
  rows[0] = np.tile(rng.integers(1, VOCAB, 6), 4)
  rows[1, :19] = rng.integers(1, VOCAB, 19)
  rows[2, :5] = rng.integers(1, VOCAB, 5)
  return rows, np.array([24, 19, 5], np.int32)


ROLLBACK_CASES = {"full": (jnp.float32, None, False), "int8": (jnp.int8, None, False),
                  "rolling": (jnp.float32, 6, False), "paged": (jnp.float32, None, True),
                  "paged-int8": (jnp.int8, None, True)}


@pytest.mark.parametrize("case", ["full"])  # the other kinds: the integration part
def test_a_rollback_leaves_what_a_cache_that_never_saw_them_holds(case):
  check_a_rollback_leaves_what_a_cache_that_never_saw_them_holds(case)


def check_a_rollback_leaves_what_a_cache_that_never_saw_them_holds(case):
  """Write 10 tokens, then 5 more, roll back to 12 per row: the next step's attention and
  every visible slot equal those of a cache that saw only the 12. A paged cache's pages keep
  what the rejected tokens wrote, past the rows' lengths: never read."""
  dtype, window, paged = ROLLBACK_CASES[case]
  rng = np.random.default_rng(1)
  b, g, k, h = 2, 2, 8, 4
  kv = lambda n: jnp.asarray(rng.normal(size=(b, n, g, k)), jnp.float32)
  if paged:  # row 1's pages in another order: a rollback reads each row's own table
    make = lambda: cache_lib.PagedKVCache.create(8, 8, jnp.array([[0, 1, 2, 3], [6, 4, 7, 5]]),
                                                 g, k, dtype=dtype)
  else:
    make = lambda: cache_lib.KVCache.create(b, 32, g, k, dtype=dtype, window=window,
                                            rollback=5)
  write = cache_lib.update_pages if paged else cache_lib.update
  keys, values = kv(15), kv(15)
  at = lambda lo, hi: jnp.broadcast_to(jnp.arange(lo, hi), (b, hi - lo))
  seen = write(make(), keys[:, :10], values[:, :10], at(0, 10))
  later = write(seen, keys[:, 10:15], values[:, 10:15], at(10, 15))
  back = later.rollback(jnp.array([12, 12]))
  never = write(seen, keys[:, 10:12], values[:, 10:12], at(10, 12))
  np.testing.assert_array_equal(back.length, never.length)
  if not paged:
    lowest = 0 if window is None else 12 - window  # what the next token's window reaches
    held = lambda c: [sorted(set(row.tolist()) - {-1} - set(range(lowest))) for row in
                      np.asarray(c.positions)]
    assert held(back) == held(never)
  query, nk, nv = (jnp.asarray(rng.normal(size=(b, 1, n, k)), jnp.float32) for n in (h, g, g))
  out = lambda c: cache_lib.attend(query, nk, nv, c)[0]
  np.testing.assert_allclose(out(back), out(never), rtol=1e-6, atol=1e-6)
  assert not np.allclose(out(later), out(never), atol=1e-3)  # what the rollback undid


def test_a_rolling_cache_without_the_extra_slots_loses_what_the_window_needs():
  """Why `rollback=` exists: a window's slots alone are overwritten by the rejected tokens."""
  rng = np.random.default_rng(2)
  b, g, k = 1, 1, 4
  keys = jnp.asarray(rng.normal(size=(b, 12, g, k)), jnp.float32)
  at = lambda lo, hi: jnp.arange(lo, hi)[None]
  for extra, same in ((0, False), (4, True)):
    cache = cache_lib.KVCache.create(b, 64, g, k, window=6, rollback=extra)
    cache = cache_lib.update(cache, keys[:, :8], keys[:, :8], at(0, 8))
    wrote = cache_lib.update(cache, keys[:, 8:12], keys[:, 8:12], at(8, 12)).rollback(
        jnp.array([8]))
    held = lambda c: set(np.asarray(c.positions[0]).tolist()) - {-1, 0, 1}  # 2..7: the window
    assert (held(wrote) == held(cache)) == same, (extra, held(wrote), held(cache))


@pytest.mark.parametrize("drafter", ["lookup"])
def check_greedy_tokens_are_plain_decodings(drafter):
  """Rows that accept often, rarely and in between; every layer local (rolling caches of a
  window of 3: a rollback that lost a slot the window needs changes the tokens); a stop
  token; the same tokens as `decoding.generate`, and drafts were kept (it speculated)."""
  model, params = lm(local_window=3, global_every=3)
  rows, lengths = prompts()
  draft = {"lookup": speculative.PromptLookup(),
           # the same weights with every layer global: it agrees until the window matters
           "draft": speculative.DraftModel(*lm(local_window=None)),
           "self": speculative.DraftModel(model, params)}[drafter]
  for stop in ((), (5,)):
    want = decoding.generate(model, params, (rows,), rows, lengths, max_new_tokens=20,
                             stop_tokens=stop)
    got, stats = speculative.generate_with_stats(
        model, params, (rows,), rows, lengths, max_new_tokens=20, drafter=draft,
        num_speculative_tokens=3, stop_tokens=stop)
    np.testing.assert_array_equal(got, want)
    if not stop:  # (a row's last round may cut its drafts at a stop token or max_new_tokens)
      assert stats.rounds < 20
      assert stats.acceptance > 0.8 if drafter == "self" else 0 < stats.acceptance < 0.8, stats


def check_the_final_cache_is_what_the_kept_tokens_alone_make():
  """After a run of rejections and acceptances (every layer local, windows of 3), the target's
  cache holds what one prefill of the prompt and the kept tokens makes: the positions the next
  token's window reads, and their keys and values (without the rollback, the rejected
  positions stay visible and it fails; the rolling caches' extra slots are the cache-level
  test above)."""
  model, params = lm(local_window=3, global_every=3)
  rows, lengths = prompts()
  rows, lengths = rows[:2], lengths[:2]
  k, new = 3, 12
  args = (model, params, (rows,), jnp.asarray(rows), jnp.asarray(lengths), jax.random.key(0),
          None, new)
  tokens, _, _, accepted, cache = speculative._generate(  # pylint: disable=protected-access
      *args, speculative.PromptLookup(), k, sampling.Greedy(), (), 0, None)
  assert int(accepted) > 0
  full = np.zeros((2, 24 + new - 1), np.int32)
  for b in range(2):
    full[b, :lengths[b] + new - 1] = np.concatenate([rows[b, :lengths[b]],
                                                     np.asarray(tokens[b, :new - 1])])
  want = model.apply(params, full, max_length=24 + new + k, rollback=k,
                     method=DecoderLM.init_cache)
  positions = np.where(np.arange(full.shape[1]) < (lengths + new - 1)[:, None],
                       np.arange(full.shape[1]), -1)
  _, want = model.apply(params, full, want, positions, method=DecoderLM.logits)
  for got_layer, want_layer in zip(cache, want):
    np.testing.assert_array_equal(got_layer.length, want_layer.length)
    for b in range(2):
      last = int(want_layer.length[b])
      seen = lambda c: {int(p): i for i, p in enumerate(np.asarray(c.positions[b]))
                        if p >= last - 3}
      got_at, want_at = seen(got_layer), seen(want_layer)
      assert got_at.keys() == want_at.keys(), (b, got_at, want_at)
      for p in want_at:
        np.testing.assert_allclose(got_layer.key[b, :, got_at[p]],
                                   want_layer.key[b, :, want_at[p]], rtol=1e-4, atol=1e-5)


def lookup_reference(row: list, ngram: int, k: int):
  """Prompt lookup's k drafts for the history `row`, by the rule as written: the latest earlier
  occurrence of its last n tokens (n = ngram, then shorter), whose continuation is copied a
  token at a time, each copied token appended before the next is read (an overlapping copy);
  None without a match."""
  for n in range(ngram, 0, -1):
    ends = [i for i in range(n - 1, len(row) - 1) if row[i - n + 1:i + 1] == row[-n:]]
    if len(row) > n and ends:
      out, source = list(row), ends[-1] + 1
      for _ in range(k):
        out.append(out[source])
        source += 1
      return out[len(row):]
  return None


@pytest.mark.parametrize("ngram", [3, 2])
def test_prompt_lookup_copies_the_latest_match_on_past_its_end(ngram):
  """Histories of 3 symbols (matches at every distance: continuations that run into the
  present) and of 40 (rows without a match), of every length, padded with noise: the drafts
  are the reference's, -1 where it has none, and `offered` says which rows have them."""
  rng = np.random.default_rng(ngram)
  b, m, k = 96, 23, 5
  history = np.where(np.arange(b)[:, None] < b // 2, rng.integers(0, 3, (b, m)),
                     rng.integers(0, 40, (b, m))).astype(np.int32)
  lengths = rng.integers(1, m + 1, b).astype(np.int32)
  lookup = speculative.PromptLookup(ngram)
  _, drafts, q = lookup.propose(None, (), history, lengths, np.ones(b, bool), k, None,
                                sampling.Greedy())
  offered = np.asarray(lookup.offered(None, (), history, lengths, k))
  assert q is None
  wants = [lookup_reference(history[i, :lengths[i]].tolist(), ngram, k) for i in range(b)]
  for i, want in enumerate(wants):
    assert np.asarray(drafts[i]).tolist() == ([-1] * k if want is None else want), (i, want)
    assert offered[i] == (0 if want is None else k)
  assert 10 < sum(w is None for w in wants) < b - 10  # both kinds of row were there

def accept_rule(p_C, q_C, k, n, seed, rule=speculative.accept, sampler=sampling.Sampling(),
                one_hot=False):
  """n runs of the rule on fixed one-step distributions (the same p at every position, drafts
  drawn from q; with one_hot, q passed as None: prompt lookup's, one-hot at the drafts):
  (first new tokens [n], second new tokens [n], counts [n])."""
  c = p_C.shape[0]
  logits = jnp.broadcast_to(jnp.log(p_C), (1, k + 1, c))

  def one(key):
    drafts = jax.random.categorical(jax.random.fold_in(key, 7), jnp.log(q_C), shape=(1, k))
    q = None if one_hot else jnp.broadcast_to(q_C, (1, k, c))
    count, new = rule(sampler, logits, drafts.astype(jnp.int32), q, key[None])
    return new[0, 0], new[0, 1], count[0]

  return jax.vmap(one)(jax.random.split(jax.random.key(seed), n))


def chi_square(counts, p) -> float:
  seen = p > 0
  assert counts[~seen].sum() == 0, counts  # nothing outside the sampler's set
  expected = p[seen] * counts.sum()
  return float(((counts[seen] - expected) ** 2 / expected).sum())


def sampler_probs(p_C, temperature=1.0, top_k=None, top_p=None):
  """numpy: the distribution `Sampling(temperature, top_k, top_p)` draws from over logits
  log(p_C) (top-p over the top-k set renormalised; the token crossing top_p kept)."""
  probs = np.exp(np.log(np.asarray(p_C, np.float64)) / temperature)
  order = np.argsort(-probs, kind="stable")
  keep = np.zeros(len(probs), bool)
  keep[order[:top_k or len(probs)]] = True
  probs = np.where(keep, probs, 0) / np.where(keep, probs, 0).sum()
  before = np.cumsum(probs[order]) - probs[order]
  keep[order[before >= (top_p or 2)]] = False
  probs = np.where(keep, probs, 0)
  return probs / probs.sum()


P = jnp.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
Q = jnp.array([0.05, 0.1, 0.15, 0.2, 0.2, 0.3])  # far from P: many rejections
CRITICAL = {5: 20.5, 4: 18.5, 3: 16.3, 2: 13.8}  # chi-square, p = 0.001, by degrees of freedom
SAMPLERS = {"plain": {}, "temperature": dict(temperature=0.6), "top_k": dict(top_k=4),
            "top_p": dict(temperature=1.5, top_p=0.7)}


@pytest.mark.parametrize("drafts", ["draft-model", "lookup"])
@pytest.mark.parametrize("options", SAMPLERS)
def check_the_rejection_rule_keeps_the_targets_distribution(options, drafts):
  """The first new token, and the second where the first draft was kept, are distributed as
  the sampler's p (computed here in numpy): chi-square below the 0.001 bound over 40k runs,
  for a draft model's q and for prompt lookup's one-hot q."""
  want = sampler_probs(P, **SAMPLERS[options])
  bound = CRITICAL[int((want > 0).sum()) - 1]
  first, second, count = (np.asarray(x) for x in accept_rule(
      P, Q, 2, 40_000, 0, sampler=sampling.Sampling(**SAMPLERS[options]),
      one_hot=drafts == "lookup"))
  assert chi_square(np.bincount(first, minlength=6), want) < bound
  kept = count >= 2
  assert kept.sum() > 2000
  assert chi_square(np.bincount(second[kept], minlength=6), want) < bound


def test_the_chi_square_bound_catches_a_wrong_rule():
  """The same check on a rule that accepts every draft whose p >= q, with no residual
  correction: far past the bound."""
  def wrong(sampler, logits, drafts, q, key):
    del sampler, key
    p = jax.nn.softmax(logits, -1)
    take = lambda x: jnp.take_along_axis(x, drafts[..., None], -1)[..., 0]
    agree = take(p[:, :-1]) >= take(q)
    kept = jnp.sum(jnp.cumprod(agree, 1), 1)
    own = jnp.argmax(p[:, 0], -1)
    new = jnp.where(jnp.arange(drafts.shape[1] + 1) < kept[:, None],
                    jnp.pad(drafts, ((0, 0), (0, 1))), own[:, None])
    return kept + 1, new.astype(jnp.int32)

  first, _, _ = (np.asarray(x) for x in accept_rule(P, Q, 2, 40_000, 0, rule=wrong))
  assert chi_square(np.bincount(first, minlength=6), np.asarray(P)) > 10 * CRITICAL[5]


def check_sampled_tokens_are_reproducible_and_bad_arguments_named():
  model, params = lm()
  rows, lengths = prompts()
  run = lambda seed: speculative.generate(
      model, params, (rows,), rows, lengths, max_new_tokens=8, sampler=decoding.Sampling(),
      rng=jax.random.key(seed), drafter=speculative.PromptLookup(), num_speculative_tokens=2)
  np.testing.assert_array_equal(run(1), run(1))
  assert not np.array_equal(run(1), run(2))
  call = lambda **kw: speculative.generate(model, params, (rows,), rows, lengths,
                                           max_new_tokens=4, **kw)
  with pytest.raises(TypeError, match="drafter must be a PromptLookup.. or a DraftModel"):
    call(drafter="ngram")
  with pytest.raises(ValueError, match="num_speculative_tokens must be a positive int"):
    call(drafter=speculative.PromptLookup(), num_speculative_tokens=0)
  with pytest.raises(ValueError, match="sampling needs rng"):
    call(drafter=speculative.PromptLookup(), sampler=decoding.Sampling())


def test_the_transformer_is_refused_by_name():
  """The encoder-decoder's cache holds the source's keys beside the decoder's: no rollback."""
  cfg = TransformerConfig(vocab_size=VOCAB, d_model=16, num_heads=2, d_ff=24, max_len=16)
  src, tgt = jnp.ones((2, 5), jnp.int32), jnp.ones((2, 1), jnp.int32)
  model = Transformer(cfg)
  variables = jax.eval_shape(lambda: model.init(jax.random.key(0), src, tgt))
  variables = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), variables)
  with pytest.raises(ValueError, match="needs a decoder whose caches roll back.*Transformer"):
    speculative.generate(model, variables, (src,), tgt, max_new_tokens=4,
                         drafter=speculative.PromptLookup())


def check_greedy_rows_of_a_per_row_sampler_keep_exactly_the_argmax_prefix():
  """The serving loop's sampler (`sampling.Rows`, temperature 0 on some rows) through the
  sampling rule: its greedy rows get the greedy rule's tokens and counts, drafts from a draft
  model's one-hot q or from lookup's alike, whatever the keys."""
  c, k = 7, 3
  logits = jax.random.normal(jax.random.key(0), (4, k + 1, c))
  own = np.asarray(jnp.argmax(logits, -1))
  drafts = own[:, :k].copy()
  drafts[0, 0] = (drafts[0, 0] + 1) % c  # row 0 rejects at once, row 1 at its second draft
  drafts[1, 1] = (drafts[1, 1] + 1) % c  # rows 2 and 3 keep all three
  drafts = jnp.asarray(drafts, jnp.int32)
  want = speculative.accept(sampling.Greedy(), logits, drafts, None, None)
  rows = sampling.Rows(jnp.array([0.0, 0.0, 0.0, 1.0]), jnp.zeros(4, jnp.int32), jnp.ones(4))
  for q in (None, jax.nn.one_hot(drafts, c)):
    for seed in range(3):
      count, new = speculative.accept(rows, logits, drafts, q,
                                      jax.random.split(jax.random.key(seed), 4))
      np.testing.assert_array_equal(count[:3], want[0][:3])
      made = np.arange(k + 1) < np.asarray(count)[:3, None]  # the tokens past count are not
      np.testing.assert_array_equal(np.where(made, new[:3], -1), np.where(made, want[1][:3], -1))
  np.testing.assert_array_equal(want[0], [1, 2, 4, 4])



def _computations(hlo: str) -> dict:
  """A compiled program's text as computation name -> its instructions' lines."""
  out, name = {}, None
  for line in hlo.splitlines():
    header = re.match(r"^(?:ENTRY )?%([\w.\-]+) \(.*\{$", line)
    if header:
      name = header.group(1)
      out[name] = []
    elif name is not None and line.startswith("  "):
      out[name].append(line)
  return out


def _runs(comps: dict, name: str, into_loops: bool) -> set:
  """The computations `name` runs (itself included; not a fusion's body, whose copies are not
  copies), through nested loops or not."""
  seen, todo = set(), [name]
  while todo:
    comp = todo.pop()
    if comp in seen:
      continue
    seen.add(comp)
    for line in comps[comp]:
      if " fusion(" in line or (" while(" in line and not into_loops):
        continue
      todo += re.findall(r"(?:to_apply|body|condition|true_computation|false_computation)="
                         r"%([\w.\-]+)", line)
      for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
        todo += re.findall(r"%([\w.\-]+)", group)
  return seen


def check_the_loop_of_rounds_copies_no_cache():
  """What XLA:CPU runs every round holds no copy of a cache buffer. A branch of a switch gets
  its own copy of what it writes: with the switch of the ladder's sizes around every round, the
  keys and values of every layer were copied twice a round; the switch runs a loop of rounds of
  one size instead, so they are copied only when the size changes. Checked on the compiled
  program: the innermost loops that run the model (each size's rounds), and what they run
  outside another loop, hold no `copy` of an array of a cache's shape."""
  model, params = lm(local_window=None)
  rows, lengths = prompts()
  args = (model, params, (rows,), jnp.asarray(rows), jnp.asarray(lengths), jax.random.key(0),
          None, 6, speculative.PromptLookup(), 3, sampling.Greedy(), (), 0, None)
  generate = speculative._generate  # pylint: disable=protected-access
  comps = _computations(generate.lower(*args).compile().as_text())
  cache = jax.eval_shape(lambda: model.apply(params, rows, max_length=24 + 6 + 3, rollback=3,
                                             method=DecoderLM.init_cache))
  shapes = {f"{x.dtype.name[0]}{x.dtype.itemsize * 8}[{','.join(map(str, x.shape))}]"
            for x in jax.tree.leaves(cache) if x.ndim >= 2}  # f32[3,2,33,8], s32[3,33]
  runs_model = lambda body: any(" dot(" in line or "__ynn_fusion" in line
                                for comp in _runs(comps, body, True) for line in comps[comp])
  bodies = {re.search(r"body=%([\w.\-]+)", line).group(1) for lines in comps.values()
            for line in lines if " while(" in line}
  rounds = [body for body in bodies if runs_model(body) and not any(
      runs_model(inner) for inner in _runs(comps, body, True) & bodies - {body})]
  assert rounds, "no loop of rounds found"
  for body in rounds:
    copies = [line.split(" = ")[0].strip() for comp in _runs(comps, body, False)
              for line in comps[comp] if " copy(" in line
              and any(f"= {shape}" in line for shape in shapes)]
    assert not copies, (body, copies)


class _TracedLM(DecoderLM):
  """A DecoderLM that notes every trace of its `init_cache` (a Python call: under jit, once a
  trace)."""
  traced = []

  def init_cache(self, *args, **kwargs):
    _TracedLM.traced.append(args)
    return super().init_cache(*args, **kwargs)


def check_a_second_call_traces_nothing():
  """A call with the shapes of an earlier one runs its compiled program and nothing more: no
  trace of the model (the check that its caches roll back once traced `init_cache` at every
  call, a cost of the order of the whole run at the benchmark's sizes)."""
  model, params = lm(local_window=None)
  model = _TracedLM(model.config)
  rows, lengths = prompts()
  run = lambda: speculative.generate(model, params, (rows,), rows, lengths, max_new_tokens=2,
                                     drafter=speculative.PromptLookup(), num_speculative_tokens=1)
  first = run()
  _TracedLM.traced.clear()
  np.testing.assert_array_equal(run(), first)
  assert not _TracedLM.traced
