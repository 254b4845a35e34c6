"""Static batching, the serving benchmarks' baseline (`python -m experiments.bench.generation`):
groups of `batch_size` prompts, right-padded to the group's longest, each generating until the
group's largest limit with `flax_mha.models.decoding.generate`; what continuous batching
(`flax_mha.serving.serve`) is measured against, with the same tokens."""

from __future__ import annotations

import time

import numpy as np

from flax_mha import serving
from flax_mha.models import decoding


def serve_static(model, params, prompts, max_new_tokens, *, batch_size: int, stop_tokens=(),
                 sampler=decoding.Greedy(), rng=None):
  """The baseline: groups of `batch_size` prompts, right-padded to the group's longest, each
  generating until the group's largest limit; (new tokens per prompt, ServeStats without
  pages)."""
  model, params = decoding.decodable(model, params)
  prompts = serving.check_prompts(prompts, decoding.vocabulary(
      model, params, "init_cache", (np.zeros((1, 1), np.int32),), (1,)))
  limits = serving.check_limits(max_new_tokens, len(prompts))
  outputs, start = [], time.perf_counter()
  for first in range(0, len(prompts), batch_size):
    group = list(range(first, min(first + batch_size, len(prompts))))
    group += [group[-1]] * (batch_size - len(group))  # one shape for every group
    length = max(len(prompts[i]) for i in group)
    padded = np.zeros((batch_size, length), np.int32)
    for row, i in enumerate(group):
      padded[row, :len(prompts[i])] = prompts[i]
    lengths = np.array([len(prompts[i]) for i in group], np.int32)
    new = np.asarray(decoding.generate(
        model, params, (padded,), padded, lengths, max_new_tokens=max(limits[i] for i in group),
        sampler=sampler, stop_tokens=tuple(stop_tokens), rng=rng))
    done = {}
    for row, i in enumerate(group):
      done.setdefault(i, serving.until_stop(new[row, :limits[i]], stop_tokens))
    outputs += [done[i] for i in sorted(done)]
  seconds = time.perf_counter() - start
  return outputs, serving.ServeStats(sum(map(len, outputs)), seconds, 0, 0)
