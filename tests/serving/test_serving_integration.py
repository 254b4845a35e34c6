"""Continuous batching (flax_mha.serving.serve) end to end: chunked prefill, stop tokens,
pages handed out and back on the device, and the same tokens as `decoding.generate` and static
batching. The loop as one program and the argument checks are the unit part,
tests/serving/test_serving.py."""

from __future__ import annotations

import threading

import jax.numpy as jnp
import numpy as np
import pytest

from experiments.bench import static_batching
from flax_mha import serving
from flax_mha.models import decoding
from test_serving import global_lm, lm, shared_requests, shared_prefix_requests

import test_serving as unit_cases

pytestmark = pytest.mark.integration  # a model compiled several times: ~20 s a case

# Cases of tests/serving/test_serving.py that compile for seconds: the unit part skips them
# (`check_` there), the integration part runs them here.
test_the_loop_is_one_program_without_host_callbacks = (
    unit_cases.check_the_loop_is_one_program_without_host_callbacks)
test_a_trip_reads_several_rows_prompts_beside_decoding_rows = (
    unit_cases.check_a_trip_reads_several_rows_prompts_beside_decoding_rows)


def _generated(model, params, prompts, limits, **kwargs):
  """`decoding.generate`'s tokens for each prompt (one right-padded batch: one compilation),
  cut at its limit and after a stop token."""
  padded = np.zeros((len(prompts), max(map(len, prompts))), np.int32)
  for row, prompt in enumerate(prompts):
    padded[row, :len(prompt)] = prompt
  lengths = np.array([len(p) for p in prompts], np.int32)
  tokens = np.asarray(decoding.generate(model, params, (padded,), padded, lengths,
                                        max_new_tokens=max(limits), **kwargs))
  return [serving.until_stop(row[:n], kwargs.get("stop_tokens", ()))
          for row, n in zip(tokens, limits)]


# prefill_chunk=16: one row's piece a trip; 64: several rows' pieces a trip (up to 64 tokens).
# 64 (a prompt in one piece) is slow (`make test-slow`); 16 splits prompts across trips in CI
CHUNKS = pytest.mark.parametrize("chunk", [16, pytest.param(64, marks=pytest.mark.slow)])


@CHUNKS
def test_chunked_prefill_serves_what_generate_gives(chunk):
  """Prompts up to 50 tokens fed in pieces of at most `chunk` (and 4-token pages) between
  decode steps, 5 requests through 2 rows: each request's tokens equal generating it alone."""
  model, params = lm()
  prompts, limits = shared_requests()
  served, stats = serving.serve(model, params, prompts, limits, batch_size=2, page_size=4,
                                num_pages=2 * 15, prefill_chunk=chunk)
  want = _generated(model, params, prompts, limits)
  assert served == want
  assert len({t for row in want for t in row}) > 3  # the tokens vary: the check means something
  assert stats.new_tokens == sum(limits) and 0 < stats.peak_pages <= 30
  assert stats.peak_tokens <= stats.peak_tokens_in_pages <= 4 * stats.peak_pages


def test_stop_tokens_and_pages_given_back_for_the_next_requests():
  """A stop token ends a request early; 7 requests through 2 rows in a pool of exactly 2 rows'
  pages can only all finish right if every finished row puts its pages back."""
  model, params = lm()
  prompts, limits = shared_requests(1, (5, 30, 12, 30, 7, 26, 3), (8, 8, 8, 8, 8, 8, 8))
  first = _generated(model, params, prompts[:1], [8])[0]
  stop = (first[2],)
  served, _ = serving.serve(model, params, prompts, limits, batch_size=2, page_size=4,
                            num_pages=2 * 10, prefill_chunk=16, stop_tokens=stop)
  want = _generated(model, params, prompts, limits, stop_tokens=stop)
  assert served == want and served[0][-1] == stop[0] and len(served[0]) <= 3
  static, _ = static_batching.serve_static(model, params, prompts, limits, batch_size=2,
                                   stop_tokens=stop)
  assert served == static


@CHUNKS
def test_shared_prefixes_and_copy_on_write_keep_every_request_s_tokens(chunk):
  """A prompt that is the shared prefix alone (its last page copied on write) is admitted while
  the request that wrote the prefix still decodes: both, and the rest, get the tokens of
  generating alone; every page comes back."""
  model, params = global_lm()
  prompts, limits = shared_prefix_requests(1, tails=(6, 0, 0, 9), limits=(12, 5, 3, 6))
  server = serving.Server(model, params, batch_size=3, page_size=4, num_pages=30,
                          max_length=32, prefill_chunk=chunk, segment_steps=2)
  requests = [server.submit(p, n) for p, n in zip(prompts, limits)]
  server.run()
  want = _generated(model, params, prompts, limits)
  assert [r.tokens for r in requests] == want
  assert [r.shared_tokens for r in requests] == [0, 11, 11, 12]
  pool = server.pool
  assert all(e.refs == 0 for e in pool.entries.values())
  assert pool.n_free + pool.cached_pages == 30


@CHUNKS
def test_online_admission_streaming_and_cancellation(chunk):
  """With the server's own thread running: requests submitted while others stream get their
  tokens; a cancelled one stops and gives its pages back; nothing leaks."""
  model, params = global_lm()
  prompts, limits = shared_requests(3, (5, 30, 12, 21, 7), (9, 8, 30, 6, 8))
  want = _generated(model, params, prompts, limits)
  with serving.Server(model, params, batch_size=2, page_size=4, num_pages=24, max_length=48,
                      prefill_chunk=chunk, segment_steps=2) as server:
    first = server.submit(prompts[0], limits[0])
    streamed, late = [], []
    for token in server.stream(first):
      streamed.append(token)
      if len(streamed) == 2:  # arrive while the loop runs
        late = [server.submit(p, n) for p, n in zip(prompts[1:], limits[1:])]
    doomed = late[1]
    for i, token in enumerate(server.stream(doomed)):
      if i == 2:
        server.cancel(doomed)
        break
    outputs = [list(server.stream(r)) for r in late]
  assert streamed == want[0] and first.state == "done"
  assert doomed.state == "cancelled" and doomed.tokens == want[2][:len(doomed.tokens)]
  assert len(doomed.tokens) < limits[2] and outputs[1] == doomed.tokens
  assert [outputs[i] for i in (0, 2, 3)] == [want[i] for i in (1, 3, 4)]
  pool = server.pool
  assert not server.busy and all(e.refs == 0 for e in pool.entries.values())
  assert pool.n_free + pool.cached_pages == 24


def test_a_full_pool_makes_requests_wait_and_loses_nothing():
  """A pool that holds one long request at a time, 3 rows and 6 requests: the rows wait for
  pages, every request finishes with the tokens of generating alone, and the pages in use never
  pass the pool."""
  model, params = lm()
  prompts, limits = shared_requests(4, (30, 6, 28, 9, 25, 3), (8, 5, 9, 4, 7, 6))
  served, stats = serving.serve(model, params, prompts, limits, batch_size=3, page_size=4,
                                num_pages=10, prefill_chunk=16)
  assert served == _generated(model, params, prompts, limits)
  assert stats.peak_pages <= 10


@CHUNKS
def test_an_int8_pool_serves_what_generate_gives_over_an_int8_cache(chunk):
  """Pages in int8 (a scale per token and head) and shared prefixes: the tokens of generating
  alone over a contiguous int8 cache, which quantizes the same keys alike."""
  model, params = global_lm()
  prompts, limits = shared_prefix_requests(2, tails=(6, 0, 9), limits=(8, 5, 6))
  served, stats = serving.serve(model, params, prompts, limits, batch_size=2, page_size=4,
                                num_pages=24, prefill_chunk=chunk, cache_dtype=jnp.int8)
  assert served == _generated(model, params, prompts, limits, cache_dtype=jnp.int8)
  assert stats.shared_tokens > 0


def _stream_from_threads(server, prompts, limits, cancel_every=5):
  """Each request submitted and streamed from a thread of its own (every `cancel_every`-th
  cancelled after its second token); (tokens streamed per request, requests, errors)."""
  streamed, requests, errors = [None] * len(prompts), [None] * len(prompts), []

  def client(i):
    try:
      requests[i] = server.submit(prompts[i], np.int64(limits[i]))
      streamed[i] = []
      for token in server.stream(requests[i]):
        streamed[i].append(token)
        if i % cancel_every == cancel_every - 1 and len(streamed[i]) == 2:
          server.cancel(requests[i])
    except Exception as error:  # pylint: disable=broad-except  (reported below)
      errors.append(repr(error))

  threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(timeout=120)
  assert not any(thread.is_alive() for thread in threads), "a client hung"
  return streamed, requests, errors


@pytest.mark.parametrize("own_thread", [False, True])
def test_sixteen_threads_streaming_with_cancels_get_offline_serve_s_tokens(own_thread):
  """16 clients, each submitting and streaming from its own thread, with the server's thread
  (`with server:`) or without (the clients step it; 7 of 8 once died of a donated buffer):
  every request gets `serve`'s greedy tokens (a cancelled one a prefix of them), `run()` and
  `stream()` inside `with server:` wait for its thread, and every page comes back."""
  model, params = global_lm()
  prompts, limits = shared_requests(5, tuple(range(3, 35, 2)), tuple(range(4, 20)))
  want, _ = serving.serve(model, params, prompts, limits, batch_size=3, page_size=4,
                          num_pages=40, prefill_chunk=16)
  server = serving.Server(model, params, batch_size=3, page_size=4, num_pages=40,
                          max_length=56, prefill_chunk=16, segment_steps=2)
  if own_thread:
    server.start()
  streamed, requests, errors = _stream_from_threads(server, prompts, limits)
  if own_thread:
    late = server.submit(prompts[0], limits[0])
    server.run()  # waits for the server's thread (it once killed it)
    assert late.tokens == want[0] and list(server.stream(late)) == want[0]
    server.stop()
  assert errors == []
  for i, (got, request) in enumerate(zip(streamed, requests)):
    if request.state == "cancelled":
      assert i % 5 == 4 and got == want[i][:len(got)] and 2 <= len(got) < limits[i]
    else:
      assert request.state == "done" and got == want[i], i
  assert sum(r.state == "cancelled" for r in requests) == 3
  pool = server.pool
  assert not server.busy and all(e.refs == 0 for e in pool.entries.values())
  assert pool.n_free + pool.cached_pages == 40


def test_a_run_goes_on_past_a_read_prompt_while_every_row_is_busy():
  """3 requests, 2 rows: while the third waits and both rows are busy, a run does not end when
  a row finishes its prompt (nothing could be admitted), only when a row ends; the tokens are
  those of generating alone."""
  model, params = lm()
  prompts, limits = shared_requests(6, (5, 6, 7), (6, 4, 5))
  server = serving.Server(model, params, batch_size=2, page_size=4, num_pages=2 * 4,
                          max_length=13, prefill_chunk=16, segment_steps=8,
                          eager_first_tokens=False)
  requests = [server.submit(p, n) for p, n in zip(prompts, limits)]
  server.step()
  # Trip 1 reads row 0's prompt, trip 2 row 1's; row 1 (4 tokens) ends at trip 4.
  assert int(server.runner.state["trips"]) == 4 and requests[1].state == "done"
  server.run()
  assert [r.tokens for r in requests] == _generated(model, params, prompts, limits)


def test_a_first_token_goes_out_without_waiting_for_the_run():
  """A request alone, 16 trips a run: with eager_first_tokens (the default) the first run ends
  at the trip that reads its prompt (its first token, and the token of that trip's decode
  step); without, the run goes on and hands out its 8 tokens at once. The same tokens either
  way."""
  model, params = lm()
  prompts, _ = shared_requests()
  got = {}
  for eager in (True, False):
    server = serving.Server(model, params, batch_size=2, page_size=4, num_pages=16,
                            max_length=32, segment_steps=16, eager_first_tokens=eager)
    request = server.submit(prompts[1][:9], 8)
    server.step()
    assert len(request.tokens) == (2 if eager else 8), (eager, request.tokens)
    server.run()
    got[eager] = request.tokens
  assert got[True] == got[False] == _generated(model, params, [prompts[1][:9]], [8])[0]
