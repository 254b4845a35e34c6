"""Each request's own sampling in serving, end to end (the loop compiles per server shape):
a seeded request's draws against the model's own logits and keys, wherever it runs; greedy
requests beside it; ignore_stop_tokens."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from flax_mha import serving
from flax_mha.models import decoding

from test_serving import lm, shared_requests

pytestmark = pytest.mark.integration


def test_a_seeded_request_draws_from_its_own_keys_wherever_it_runs():
  """Token t of a request with seed s is categorical(fold_in(key(s), t), logits / T), the
  logits of the whole sequence so far (recomputed here without a cache); the same in any row,
  beside any other request; a greedy request beside it gets greedy serving's tokens."""
  model, params = lm()
  prompts, limits = shared_requests()
  own = decoding.Sampling(temperature=1.5)
  # serve's own sizes (its max_length, 64 trips a run): the three servers run one program
  kw = dict(batch_size=2, page_size=4, num_pages=64, segment_steps=64,
            max_length=max(len(p) + n for p, n in zip(prompts, limits)))
  server = serving.Server(model, params, **kw)
  greedy = [server.submit(p, n) for p, n in zip(prompts, limits)]
  seeded = server.submit(prompts[1], 8, sampler=own, seed=11)
  server.run()
  want_greedy, _ = serving.serve(model, params, prompts, limits, batch_size=2, page_size=4,
                                 num_pages=64)
  assert [r.tokens for r in greedy] == want_greedy
  alone = serving.Server(model, params, **kw, sampler=own, rng=jax.random.key(5))
  again = alone.submit(prompts[1], 8, seed=11)
  alone.run()
  assert again.tokens == seeded.tokens
  sequence = np.zeros((1, len(prompts[1]) + 8), np.int32)  # one shape: causal, so the zeros
  sequence[0, :len(prompts[1])] = prompts[1]                 # after the end change nothing
  forward = jax.jit(lambda x: model.apply(params, x))
  for t, token in enumerate(seeded.tokens):
    logits = forward(sequence)[0, len(prompts[1]) + t - 1]
    drawn = jax.random.categorical(jax.random.fold_in(jax.random.key(11), t), logits / 1.5)
    assert int(drawn) == token, t
    sequence[0, len(prompts[1]) + t] = token


def test_ignore_stop_tokens_runs_to_max_new_tokens():
  model, params = lm()
  prompts, _ = shared_requests()
  # The greedy tokens without a stop token, from generate: a serving plan's compile costs more.
  row = np.asarray(prompts[0])[None]
  first = decoding.generate(model, params, (row,), row, max_new_tokens=6).tolist()
  stop = first[0][1]
  server = serving.Server(model, params, batch_size=2, page_size=4, num_pages=32, max_length=32,
                          stop_tokens=(stop,))
  stopped = server.submit(prompts[0], 6)
  running = server.submit(prompts[0], 6, ignore_stop_tokens=True)
  server.run()
  assert stopped.tokens == serving.until_stop(first[0], (stop,))
  assert running.tokens == first[0]
