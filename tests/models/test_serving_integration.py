"""Continuous batching (flax_mha.models.serving.serve) end to end: chunked prefill, stop tokens,
pages handed out and back on the device, and the same tokens as `decoding.generate` and static
batching. The loop as one program and the argument checks are the unit part,
tests/models/test_serving.py."""

from __future__ import annotations

import numpy as np
import pytest

from flax_mha.models import decoding, serving
from test_serving import _lm, _requests

pytestmark = pytest.mark.integration  # a model compiled several times: ~20 s a case


def _generated(model, params, prompt, limit, **kwargs):
  """`decoding.generate`'s tokens for one prompt alone, cut after a stop token."""
  tokens = np.asarray(decoding.generate(model, params, (prompt[None],), prompt[None],
                                        max_new_tokens=limit, **kwargs))[0]
  stop = kwargs.get("stop_tokens", ())
  hits = [i for i, t in enumerate(tokens) if t in stop]
  return tokens[:hits[0] + 1 if hits else limit].tolist()


def test_chunked_prefill_serves_what_generate_gives():
  """Prompts up to 50 tokens fed in pieces of at most 16 (and 4-token pages) between decode
  steps, 5 requests through 2 rows: each request's tokens equal generating it alone."""
  model, params = _lm()
  prompts, limits = _requests()
  served, stats = serving.serve(model, params, prompts, limits, batch_size=2, page_size=4,
                                num_pages=2 * 15, prefill_chunk=16)
  want = [_generated(model, params, p, n) for p, n in zip(prompts, limits)]
  assert served == want
  assert len({t for row in want for t in row}) > 3  # the tokens vary: the check means something
  assert stats.new_tokens == sum(limits) and 0 < stats.peak_pages <= 30
  assert stats.peak_tokens <= stats.peak_tokens_in_pages <= 4 * stats.peak_pages


def test_stop_tokens_and_pages_given_back_for_the_next_requests():
  """A stop token ends a request early; 7 requests through 2 rows in a pool of exactly 2 rows'
  pages can only all finish right if every finished row puts its pages back."""
  model, params = _lm()
  prompts, limits = _requests(1, (5, 30, 12, 30, 7, 26, 3), (8, 8, 8, 8, 8, 8, 8))
  first = _generated(model, params, prompts[0], 8)
  stop = (first[2],)
  served, _ = serving.serve(model, params, prompts, limits, batch_size=2, page_size=4,
                            num_pages=2 * 10, prefill_chunk=16, stop_tokens=stop)
  want = [_generated(model, params, p, n, stop_tokens=stop) for p, n in zip(prompts, limits)]
  assert served == want and served[0][-1] == stop[0] and len(served[0]) <= 3
  static, _ = serving.serve_static(model, params, prompts, limits, batch_size=2,
                                   stop_tokens=stop)
  assert served == static
