"""Speculative decoding in serving (flax_mha.serving.loop's rounds): greedy tokens equal plain
serving's with prompt lookup and a draft model, for a model with rolling (local) caches, with
prefix sharing on and off, an int8 pool, and the NNX twin through `serving.serve`; every page
comes back; online requests with a cancellation leave nothing behind; a seeded sampled request
gets the same tokens alone or among others. The rule itself is tested in tests/models/test_speculative.py."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
from flax import nnx
import numpy as np
import pytest

from flax_mha import serving
from flax_mha.models import decoding, lm_nnx, speculative

from test_serving import global_lm, lm, shared_prefix_requests, shared_requests

pytestmark = pytest.mark.integration


def near_draft(model, params, scale=0.05):
  """The model with its weights perturbed: a draft that agrees with it often, not always."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(5), len(leaves))
  return model, jax.tree.unflatten(tree, [x + scale * jnp.std(x) * jax.random.normal(k, x.shape)
                                          for x, k in zip(leaves, keys)])


def repetitive(prompts):
  """The prompts with their first tokens repeated after them: prompt lookup finds matches."""
  return [np.concatenate([p, p[:8], p[:8]]) for p in prompts]


def served(model, params, prompts, limits, via_serve=False, **kw):
  """(tokens per request, stats, server) of every request through one Server run to the end;
  via_serve: through `serving.serve` instead (server None)."""
  kw = dict(dict(batch_size=2, page_size=4, num_pages=48, prefill_chunk=16), **kw)
  if via_serve:
    tokens, stats = serving.serve(model, params, prompts, limits, **kw)
    return tokens, stats, None
  server = serving.Server(model, params, max_length=max(len(p) + n for p, n in
                                                         zip(prompts, limits)), **kw)
  requests = [server.submit(p, n) for p, n in zip(prompts, limits)]
  server.run()
  return [r.tokens for r in requests], server.stats(), server


def assert_pages_back(server):
  pool = server.pool
  assert all(e.refs == 0 and e.written for e in pool.entries.values())
  assert pool.n_free + pool.cached_pages == pool.num_pages


def nnx_twin(model, params):
  return lm_nnx.load_linen_params(lm_nnx.DecoderLM(model.config, rngs=nnx.Rngs(1)), params), None


CASES = {
    # local layers (rolling caches kept for a rollback of k), prompt lookup
    "local-lookup": (lm, shared_requests, lambda m, p: speculative.PromptLookup(), {}),
    # a draft model on the same page table, prefixes shared and copied on write
    "shared-draft": (global_lm, shared_prefix_requests, lambda m, p: speculative.DraftModel(
        *near_draft(m, p)), {}),
    # an int8 pool, no sharing
    "int8-lookup": (global_lm, shared_prefix_requests, lambda m, p: speculative.PromptLookup(2),
                    dict(cache_dtype=jnp.int8, prefix_caching=False)),
    # the NNX twin drafting for itself (every draft kept), through serving.serve
    "nnx-self": (lambda: nnx_twin(*lm()), shared_requests,
                 lambda m, p: speculative.DraftModel(m, p), dict(via_serve=True)),
}


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_are_plain_servings_and_pages_come_back(case):
  make, requests, drafter, kw = CASES[case]
  model, params = make()
  prompts, limits = requests()
  prompts = repetitive(prompts)
  limits = [n + 6 for n in limits]
  want, _, _ = served(model, params, prompts, limits, **kw)
  got, stats, server = served(model, params, prompts, limits, drafter=drafter(model, params),
                              num_speculative_tokens=3, **kw)
  assert [list(t) for t in got] == [list(t) for t in want]
  if server is not None:
    assert_pages_back(server)
  assert stats.drafted > 0 and stats.new_tokens == sum(limits)
  if case == "nnx-self":
    assert stats.accepted == stats.drafted, stats
  else:
    assert 0 < stats.accepted < stats.drafted, stats
  if case == "shared-draft":
    assert stats.shared_tokens > 0


def test_online_requests_a_cancel_and_a_seeded_draw_alone_or_among_others():
  """With the server's thread: requests submitted while it runs, one cancelled mid-way, stop
  tokens; every other request ends, each page comes back; a seeded sampled request's tokens
  are the same served alone and among others (its draws do not depend on its batch)."""
  model, params = lm()
  prompts, _ = shared_requests(seed=4)
  prompts = repetitive(prompts)
  kw = dict(batch_size=3, page_size=4, num_pages=64, max_length=96, segment_steps=3,
            drafter=speculative.PromptLookup(), num_speculative_tokens=4, stop_tokens=(2,))
  sampler = decoding.Sampling(temperature=0.9, top_k=8)
  alone = serving.Server(model, params, **kw)
  seeded = alone.submit(prompts[0], 20, sampler=sampler, seed=123, ignore_stop_tokens=True)
  alone.run()
  server = serving.Server(model, params, **kw)
  with server:
    others = [server.submit(p, 30) for p in prompts[1:]]
    long = server.submit(prompts[0], 40, ignore_stop_tokens=True)
    again = server.submit(prompts[0], 20, sampler=sampler, seed=123, ignore_stop_tokens=True)
    stream = server.stream(long)
    first = [next(stream) for _ in range(3)]
    server.cancel(long)
    done = threading.Event()
    threading.Thread(target=lambda: (server.run(), done.set()), daemon=True).start()
    assert done.wait(300)
  assert again.tokens == seeded.tokens and len(seeded.tokens) == 20
  assert long.state == "cancelled" and len(first) == 3 and len(long.tokens) < 40
  assert all(r.state == "done" and 0 < len(r.tokens) <= 30 for r in others)
  assert all(r.tokens[-1] == 2 or len(r.tokens) == 30 for r in others)
  assert_pages_back(server)
  assert server.snapshot()["drafted"] > 0
