"""The serving parts of `python -m experiments.bench.generation` (its docstring lists them):
shared prefixes, online arrivals, the int8 pool. Each compares two ways of serving the same
requests in one process, in turns after an untimed first run each; the greedy tokens must
agree (int8: counted, not required, as quantization may move a near tie)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench import timing
from flax_mha import cache as cache_lib
from flax_mha import serving
from flax_mha.models.lm import DecoderLM, LMConfig


def global_model(vocab: int, fields: dict):
  """configs/lm.py's architecture with every layer global (paged: prefixes can be shared)."""
  model = DecoderLM(LMConfig(vocab_size=vocab, **dict(fields, local_window=None)))
  x = jnp.zeros((1, 8), jnp.int32)
  return model, model.init(jax.random.key(0), x, x, x)


def prefix_part(vocab: int, fields: dict, smoke: bool, runs: int) -> list[str]:
  """12 requests of one 1024-token prefix and tails of 16 to 64 tokens, 64 new tokens each."""
  model, params = global_model(vocab, fields)
  rng = np.random.default_rng(0)
  count, prefix_len, new = (4, 64, 4) if smoke else (12, 1024, 64)
  prefix = rng.integers(3, vocab, prefix_len)
  prompts = [np.concatenate([prefix, rng.integers(3, vocab, n)]).astype(np.int32)
             for n in rng.integers(16, 65, count)]
  rows, page = 4, 16
  pages = rows * -(-(max(map(len, prompts)) + new) // page) + prefix_len // page
  run = lambda sharing: lambda: serving.serve(model, params, prompts, new, batch_size=rows,
                                              page_size=page, num_pages=pages,
                                              prefix_caching=sharing)
  out = timing.in_turns({"shared": run(True), "alone": run(False)}, runs)
  (t_shared, (got_shared, stats)), (t_alone, (got_alone, _)) = out.values()
  assert got_shared == got_alone, "serving with and without shared prefixes answered differently"
  tokens = sum(map(len, got_shared))
  return [f"{count} requests of one {prefix_len}-token prefix and their own tails of 16 to 64 "
          f"tokens, {new} new tokens each, {rows} rows, pages of {page} "
          "(every layer global: configs/lm.py's model with local_window=None):", "",
          "| prefixes | seconds (median) | tokens/s | prompt tokens not prefilled |",
          "|---|---|---|---|",
          f"| shared | {t_shared:.2f} | {tokens / t_shared:.1f} | {stats.shared_tokens} |",
          f"| each prefilled | {t_alone:.2f} | {tokens / t_alone:.1f} | 0 |", "",
          f"Shared / each prefilled tokens/s: {t_alone / t_shared:.2f}x; same tokens."]


def _arrivals(server, prompts, limits, gaps) -> list:
  """Submit request i after gaps[i] seconds (the server's thread running); all of them done."""
  requests = []
  for prompt, limit, gap in zip(prompts, limits, gaps):
    time.sleep(gap)
    requests.append(server.submit(prompt, limit))
  for request in requests:
    for _ in server.stream(request):
      pass
  return requests


def _latencies(requests) -> tuple[list, list]:
  """(time to the first token, time per output token after it) of each request, seconds."""
  first = [r.token_times[0] - r.submitted_at for r in requests]
  per = [(r.token_times[-1] - r.token_times[0]) / (len(r.tokens) - 1) for r in requests
         if len(r.tokens) > 1]
  return first, per


def _quantiles(values) -> str:
  ms = 1e3 * np.asarray(values)
  return f"{np.median(ms):.0f} | {np.percentile(ms, 99):.0f}"


def online_part(vocab: int, fields: dict, smoke: bool, runs: int) -> list[str]:
  """Poisson arrivals at 80% of the rows' measured capacity, against the same requests given up
  front; the time to the first token and per output token, median and p99."""
  del runs  # one arrival sequence each: the latencies of all its requests are the sample
  model, params = global_model(vocab, fields)
  rng = np.random.default_rng(1)
  count, rows, page = (6, 2, 16) if smoke else (48, 4, 16)
  lengths = rng.integers(16, 65 if smoke else 513, count)
  limits = [int(n) for n in rng.integers(8 if smoke else 32, 17 if smoke else 129, count)]
  prompts = [rng.integers(3, vocab, n).astype(np.int32) for n in lengths]
  longest = max(len(p) + n for p, n in zip(prompts, limits))
  kwargs = dict(batch_size=rows, page_size=page, num_pages=rows * -(-longest // page),
                max_length=longest)
  up_front = serving.Server(model, params, **kwargs, segment_steps=64)  # as `serve` runs
  for prompt, limit in zip(prompts, limits):  # compiled, and the capacity measured
    up_front.submit(prompt, limit)
  up_front.run()
  start = time.perf_counter()
  batch = [up_front.submit(p, n) for p, n in zip(prompts, limits)]
  up_front.run()
  capacity = count / (time.perf_counter() - start)  # requests per second, rows full
  rate = 0.8 * capacity
  gaps = rng.exponential(1 / rate, count)
  with serving.Server(model, params, **kwargs) as online:
    _arrivals(online, prompts[:2], limits[:2], [0, 0])  # compiled
    arrived = _arrivals(online, prompts, limits, gaps)
  assert [r.tokens for r in arrived] == [r.tokens for r in batch], "online answered differently"
  (first_online, per_online), (first_batch, per_batch) = _latencies(arrived), _latencies(batch)
  return [f"{count} requests of {min(lengths)} to {max(lengths)} prompt tokens and {min(limits)} "
          f"to {max(limits)} new tokens, {rows} rows, pages of {page}; arrivals a Poisson "
          f"process at {rate:.2f} requests/s, 80% of the {capacity:.2f}/s the rows serve with "
          f"every request given up front (`serving.SEGMENT_STEPS` = {serving.SEGMENT_STEPS} "
          "trips between the host's looks):", "",
          "| requests | first token, ms: median | p99 | per output token, ms: median | p99 |",
          "|---|---|---|---|---|",
          f"| arriving (online `Server`) | {_quantiles(first_online)} | "
          f"{_quantiles(per_online)} |",
          f"| all up front (`serve`) | {_quantiles(first_batch)} | {_quantiles(per_batch)} |", "",
          "Up front, a request's first token waits for those before it (its wait counts from "
          "the start); arriving, from its own arrival. Same tokens."]



def _pool_bytes(cache) -> int:
  """Bytes of the page pools (keys, values and their scales) of a model's paged caches."""
  pools = [c for c in cache if isinstance(c, cache_lib.PagedKVCache)]
  return sum(leaf.nbytes for c in pools for leaf in jax.tree.leaves(c)
             if leaf.shape[:1] == c.k_pages.shape[:1])


def int8_part(vocab: int, fields: dict, prompts, limits, smoke: bool, runs: int) -> list[str]:
  """The serving mix with the pool in int8 (scales per token and head) against float32."""
  del smoke
  model, params = global_model(vocab, fields)
  rows, page = 4, 16
  per_row = -(-max(len(p) + n for p, n in zip(prompts, limits)) // page)
  kwargs = dict(batch_size=rows, page_size=page, num_pages=rows * per_row)
  run = lambda dtype: lambda: serving.serve(model, params, prompts, limits, **kwargs,
                                            cache_dtype=dtype)
  out = timing.in_turns({"float32": run(jnp.float32), "int8": run(jnp.int8)}, runs)
  (t_float, (got_float, _)), (t_int8, (got_int8, _)) = out.values()
  tokens = sum(map(len, got_float))
  same = sum(a == b for a, b in zip(got_float, got_int8))
  agree = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
              for a, b in zip(got_float, got_int8))
  size = lambda dtype: _pool_bytes(serving.Server(
      model, params, **kwargs, max_length=per_row * page, cache_dtype=dtype).cache)
  f32, bf16, i8 = size(jnp.float32), size(jnp.bfloat16), size(jnp.int8)
  return [f"{len(prompts)} prompts of {min(map(len, prompts))} to {max(map(len, prompts))} "
          f"tokens, {min(limits)} to {max(limits)} new tokens each, {rows} rows, pages of {page}, "
          "every layer global (configs/lm.py's model with local_window=None, random weights):",
          "", "| pool | bytes | vs float32 | vs bfloat16 | seconds (median) | tokens/s |",
          "|---|---|---|---|---|---|",
          f"| float32 | {f32:,} | 1.000x | {f32 / bf16:.3f}x | {t_float:.2f} | "
          f"{tokens / t_float:.1f} |",
          f"| int8 + float32 scales | {i8:,} | {i8 / f32:.3f}x | {i8 / bf16:.3f}x | {t_int8:.2f} | "
          f"{sum(map(len, got_int8)) / t_int8:.1f} |", "",
          f"int8 / float32 tokens/s: {t_float / t_int8:.2f}x. Greedy tokens: {same} of "
          f"{len(prompts)} requests identical; {agree} of {tokens} tokens before a request's "
          "first difference (random weights make near ties common: see the docs for the trained "
          "LM's and the ported models' agreement)."]
