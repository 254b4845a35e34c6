"""Serving many prompts of different lengths: continuous batching over a paged KV cache, with
shared prefixes computed once, and requests that arrive while the loop runs.

  server = Server(model, params, batch_size=8, page_size=16, num_pages=512, max_length=2048)
  request = server.submit(prompt_ids, max_new_tokens=64)     # any time, from any thread
  for token in server.stream(request): ...                   # tokens as they are made
  server.cancel(request)                                     # its pages come back

`Server` keeps `batch_size` rows busy. The device runs the compiled loop of
`flax_mha.serving.loop` (chunked prefill between decode steps, pages popped and pushed
on the device) in runs of up to `segment_steps` trips; between runs the host takes out the
tokens made, ends cancelled requests, and admits waiting ones into free rows. Either the caller
drives it (`step()`, or `stream`, which steps while it waits), or a thread of its own does
(`start()`/`stop()`, or `with server:`), so that `submit` and `stream` run beside it. Every
method may be called from any number of threads, with or without the server's own: one run of
the loop at a time (the device's pool is donated from run to run), and a thread that finds the
loop running waits for that run's tokens instead of starting one of its own.

Prefix caching (`prefix_caching=True`, the default): a prompt's whole pages are entered in the
host's book (`flax_mha.serving.page_pool`), named by a chain of digests of their tokens; a later
request whose prompt begins with pages there takes them by reference and prefills only the
rest; a prompt that matches to its last token recomputes that token into a copy of the last
page (copy-on-write: a shared page is never written). Pages nobody holds stay until the pool
needs them (least recently used first). The tokens are those of serving without sharing. A
model with sliding-window (local) layers shares nothing: their rolling caches hold each row's
last window of keys, which a shared page of the global layers does not give, so its prompts are
prefilled whole.

The pool: a request is admitted when the free pages cover its whole length (prompt and new
tokens) beside what every live row may still take, after evicting unused prefix pages; until
then it waits. A request longer than `max_length`, or than the pool, is refused by `submit`.

The parts: this module is the request front (submit, stream, cancel, the thread); the scheduler
(`flax_mha.serving.scheduler`) decides which request takes which row and asks the page pool
(`flax_mha.serving.page_pool`), the one owner of the pages (the free stack, the rows' leases,
the prefix entries); the runner (`flax_mha.serving.runner`) executes those decisions on the
device state and runs the compiled loop (`flax_mha.serving.loop`).

`serve` is the batch API on top: every request submitted up front, run until all are done.
Static batching, the benchmarks' baseline, is `experiments.bench.static_batching.serve_static`.

The model must provide `init_paged_cache` and `logits` (as `flax_mha.models.DecoderLM` and its
NNX twin `flax_mha.models.lm_nnx.DecoderLM` do): a linen module with its variables as `params`,
or an NNX module with `params` None (see `flax_mha.models.decoding.decodable`). Prompts must be
non-empty, with ids in [0, C), C the size of the logits.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import threading
import time

import jax
import numpy as np

from flax_mha import cache as cache_lib
from flax_mha import checks
from flax_mha.models import decoding
from flax_mha.models import sampling as sampling_lib
from flax_mha.models import speculative
from flax_mha.serving import loop as serving_loop
from flax_mha.serving import page_pool
from flax_mha.serving import runner as runner_lib
from flax_mha.serving import scheduler as scheduler_lib
from flax_mha.serving.scheduler import Request

# The most prompt tokens one trip of the loop feeds: the faster of 256, 512 and 1024 on
# `python -m experiments.bench.generation --part serving` (512 and 1024 level; 256 slower).
PREFILL_CHUNK = 512
# Trips of the loop between two looks of the host while requests stream: the longest a new
# request waits for a free row's turn, and the granularity of the tokens handed out.
SEGMENT_STEPS = 16


@dataclasses.dataclass
class ServeStats:
  """What a serving run did: new tokens, wall seconds (compilation included on a first call with
  new shapes), the most pages in use at once (prefix pages kept for later included) and the
  tokens the rows held then, and the prompt tokens taken from shared pages, not prefilled."""
  new_tokens: int
  seconds: float
  peak_pages: int
  page_size: int
  peak_tokens: int = 0
  peak_tokens_in_pages: int = 0  # the same, each row's rounded up to whole pages
  shared_tokens: int = 0
  drafted: int = 0  # speculative decoding's drafts proposed
  accepted: int = 0  # and kept

  @property
  def tokens_per_second(self) -> float:
    return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


class Server:
  """Continuous batching with prefix caching and online admission (see the module docstring).

  batch_size rows; a pool of num_pages pages of page_size tokens; requests of up to max_length
  tokens (prompt and new), rounded up to whole pages (`self.max_length` is the rounded value,
  what `submit` takes); prefill_chunk: the most prompt tokens one trip feeds;
  segment_steps: trips between two looks of the host. Greedy tokens equal
  `decoding.generate`'s. sampler: `Greedy()` or `Sampling(...)`, the requests' default (each may
  bring its own); token t of request r is drawn with fold_in(fold_in(rng, r), t), or
  fold_in(key(seed), t) for a request with its own seed. cache_dtype: the pool's dtype (None:
  the model's; jnp.int8 where the model's caches take it). eager_first_tokens: a run of the
  loop ends as soon as a request's first token is made, so that it reaches its reader without
  waiting for the run's other trips (the time to first token of a request that arrives alone:
  its prefill and one trip, not `segment_steps` trips); `serve`, which hands every token out
  at the end, turns it off. drafter: speculative decoding (`flax_mha.models.speculative`'s
  `PromptLookup()` or `DraftModel(...)` of the model's vocabulary; None: none), up to
  num_speculative_tokens drafts a row a round, k adapting to each row's acceptance (see
  `flax_mha.serving.loop`): greedy tokens stay plain decoding's, sampled ones keep each
  request's distribution; each request takes k more tokens' pages while it runs.
  """

  def __init__(self, model, params, *, batch_size: int, page_size: int, num_pages: int,
               max_length: int, prefill_chunk: int = PREFILL_CHUNK, stop_tokens=(),
               sampler=decoding.Greedy(), rng=None, prefix_caching: bool = True,
               segment_steps: int = SEGMENT_STEPS, cache_dtype=None,
               eager_first_tokens: bool = True, drafter=None, num_speculative_tokens: int = 4):
    for name, value in (("batch_size", batch_size), ("page_size", page_size),
                        ("num_pages", num_pages), ("max_length", max_length),
                        ("prefill_chunk", prefill_chunk), ("segment_steps", segment_steps)):
      checks.check_int(name, value)
    for name, value in (("prefix_caching", prefix_caching),
                        ("eager_first_tokens", eager_first_tokens)):
      if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    self.eager_first_tokens = eager_first_tokens
    self.sampling = sampling_lib.row_params(sampler)
    self._longrope_context = getattr(getattr(model, "config", None), "longrope_context", None)
    self.model, self.params = decoding.decodable(model, params)
    self.vocab_size = decoding.vocabulary(self.model, self.params, "init_paged_cache",
                                          static=(1, 1, 1, 1))
    k, draft_arrays = 0, None
    if drafter is not None:
      speculative.check_drafter(drafter, self.vocab_size, "init_paged_cache", (1, 1, 1, 1))
      k = checks.check_int("num_speculative_tokens", num_speculative_tokens)
      drafter, draft_arrays = drafter.split()
    self._max_length = math.ceil(max_length / page_size) * page_size
    self.plan = serving_loop.Plan(self.model, tuple(int(t) for t in stop_tokens),
                                  prefill_chunk, page_size, batch_size, num_pages,
                                  math.ceil((max_length + k) / page_size),
                                  (k + 2) * segment_steps + 2, cache_dtype, drafter, k)
    self.runner = runner_lib.Runner(self.plan, (self.params, draft_arrays),
                                    jax.random.key(0) if rng is None else rng, segment_steps)
    paged_only = all(isinstance(c, cache_lib.PagedKVCache)
                     for c in jax.tree.leaves(self.runner.cache, is_leaf=cache_lib.is_cache))
    self.pool = page_pool.PagePool(num_pages, page_size, prefix_caching and paged_only)
    self.scheduler = scheduler_lib.Scheduler(self.pool, batch_size, k)
    self._next_id = 0
    self._cond = threading.Condition()
    self._thread, self._stopping, self._error = None, False, None
    self._stepper = threading.Lock()  # one run of the loop at a time: it donates the pool
    self._steps, self._loop_seconds = 0, 0.0  # runs finished; seconds spent in them
    self._listeners = []

  @property
  def max_length(self) -> int:
    """The longest request (prompt and new tokens): the constructor's max_length rounded up to
    whole pages."""
    return self._max_length

  # The caller's side.

  def submit(self, prompt, max_new_tokens: int, *, sampler=None, seed: int | None = None,
             ignore_stop_tokens: bool = False) -> Request:
    """Queue a request (any time, from any thread); returns its handle. sampler: its own
    `Greedy()` or `Sampling(...)` (None: the server's); seed: its draws' own seed, an int in
    [0, 2**31) (None: the server's rng); ignore_stop_tokens: run to max_new_tokens."""
    prompt = check_prompts([prompt], self.vocab_size)[0]
    max_new_tokens = checks.check_int("max_new_tokens", max_new_tokens)
    row_sampling = self.sampling if sampler is None else sampling_lib.row_params(sampler)
    if seed is not None and not (isinstance(seed, numbers.Integral) and 0 <= seed < 2**31):
      raise ValueError(f"seed must be None or an int in [0, 2**31), got {seed!r}")
    if not isinstance(ignore_stop_tokens, bool):
      raise TypeError("ignore_stop_tokens must be a bool, got "
                      f"{type(ignore_stop_tokens).__name__}")
    decoding.check_positions(self.model, len(prompt), max_new_tokens)
    self._check_longrope(len(prompt))
    total = len(prompt) + max_new_tokens
    if total > self.max_length:
      raise ValueError(f"a prompt of {len(prompt)} tokens and max_new_tokens={max_new_tokens} "
                       f"need {total} tokens, more than max_length "
                       f"({self.max_length} in pages)")
    k = self.plan.speculative_tokens
    pages = self.pool.pages_for(total + k)
    if pages > self.pool.num_pages:
      rounds = f" (and {k} a speculative round writes past them)" if k else ""
      raise ValueError(f"a request of {total} tokens{rounds} needs {pages} pages; the pool has "
                       f"num_pages={self.pool.num_pages}")
    with self._cond:
      request = Request(self._next_id, prompt, max_new_tokens, row_sampling,
                        None if seed is None else int(seed), not ignore_stop_tokens,
                        submitted_at=time.perf_counter())
      self._next_id += 1
      self.scheduler.queue(request)
      self._cond.notify_all()
    return request

  def _check_longrope(self, prompt_length: int) -> None:
    """A LongRoPE model's prompt within its original context: the loop prefills a prompt in
    pieces (and shares prefix pages), each piece picking the rotary factors by its own
    positions, where generate's one prefill picks the long ones for a whole longer prompt."""
    context = self._longrope_context
    if context is not None and prompt_length > context:
      raise ValueError(f"a prompt of {prompt_length} tokens passes this model's LongRoPE "
                       f"original context ({context:g} tokens): the serving loop prefills it in "
                       "pieces, each picking its rotary factors, which would not give "
                       "generate's tokens; generate it with flax_mha.models.decoding.generate")

  def cancel(self, request: Request) -> None:
    """End `request` now: no more tokens; its pages come back at the host's next look."""
    with self._cond:
      self.scheduler.cancel(request)
      self._cond.notify_all()
    self._tell()

  def progress(self, request: Request, sent: int) -> tuple[list[int], bool]:
    """(the tokens of `request` past its first `sent`, whether it has finished), read under the
    lock: for a reader that waits by its own means (an event loop told by `add_listener`)."""
    with self._cond:
      self._raise()
      return request.tokens[sent:], request.finished

  def snapshot(self) -> dict:
    """The server's state now, read under the lock: requests waiting and running, pages free
    (on the free stack), pages held by prefix entries, tokens made, prompt tokens taken from
    shared pages, and speculation's drafts proposed and accepted."""
    with self._cond:
      return dict(waiting=len(self.scheduler.waiting),
                  running=sum(r is not None for r in self.scheduler.rows),
                  free_pages=int(self.pool.n_free), cached_pages=self.pool.cached_pages,
                  new_tokens=self.scheduler.new_tokens,
                  shared_tokens=self.scheduler.shared_tokens,
                  drafted=int(self.runner.state["drafted"]),
                  accepted=int(self.runner.state["accepted"]))

  def add_listener(self, listener) -> None:
    """Call listener() after each run of the loop and each cancel (on the thread that did it,
    outside the lock; it must not block): a reader elsewhere looks at its requests then."""
    self._listeners.append(listener)

  def _tell(self) -> None:
    for listener in self._listeners:
      listener()

  def stream(self, request: Request):
    """The tokens of `request` as they are made (a generator; without the server's own thread
    it runs the loop itself, or waits for the run another caller has started)."""
    sent = 0
    while True:
      with self._cond:
        if self._thread is not None:
          self._cond.wait_for(lambda: len(request.tokens) > sent or request.finished
                              or self._error is not None or self._thread is None)
        self._raise()
        new, finished, seen = request.tokens[sent:], request.finished, self._steps
      yield from new
      sent += len(new)
      if finished and sent == len(request.tokens):
        return
      if self._thread is None and not new:
        self._step_or_wait(seen)

  @property
  def busy(self) -> bool:
    """Whether any request waits or runs."""
    return bool(self.scheduler.waiting) or self.scheduler.live

  def run(self) -> None:
    """Until every request submitted is done: stepping, or waiting for the server's thread."""
    while self.busy:
      with self._cond:
        seen = self._steps
        if self._thread is not None:
          self._cond.wait_for(lambda: not self.busy or self._error is not None
                              or self._thread is None)
        self._raise()
      if self._thread is None:
        self._step_or_wait(seen)

  def stats(self, seconds: float | None = None) -> ServeStats:
    """What the server did so far; `seconds` (default: the seconds spent in the loop's runs,
    compilation included) is what tokens_per_second divides by."""
    peak = self.runner.state["peak"]
    seconds = self._loop_seconds if seconds is None else seconds
    state = self.runner.state
    return ServeStats(self.scheduler.new_tokens, seconds, int(peak[0]), self.plan.page_size,
                      int(peak[1]), int(peak[2]), self.scheduler.shared_tokens,
                      int(state["drafted"]), int(state["accepted"]))

  # A thread of its own.

  def start(self) -> "Server":
    """Run the loop in a thread of the server's, so that submit and stream run beside it."""
    if self._thread is None:
      self._stopping = False
      self._thread = threading.Thread(target=self._loop, name="flax_mha-server", daemon=True)
      self._thread.start()
    return self

  def stop(self) -> None:
    """Stop the thread (after its current run); requests stay where they are."""
    thread = self._thread
    if thread is not None:
      with self._cond:
        self._stopping = True
        self._cond.notify_all()
      thread.join()
      with self._cond:
        self._thread = None
        self._cond.notify_all()  # run() and stream() callers step for themselves now
    self._raise()

  def __enter__(self) -> "Server":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()

  def _loop(self) -> None:
    try:
      while True:
        with self._cond:
          self._cond.wait_for(lambda: self._stopping or self.busy)
          if self._stopping:
            return
        self.step()
    except Exception as error:  # pylint: disable=broad-except  (handed to the caller)
      with self._cond:
        self._error = error
        self._cond.notify_all()
      self._tell()

  def _raise(self) -> None:
    if self._error is not None:
      raise RuntimeError("the serving loop failed") from self._error

  # The host's look between two runs.

  def step(self) -> None:
    """One look of the host and one run of the loop: cancelled rows freed, waiting requests
    admitted, the loop run, its tokens handed out. A call while another thread steps waits for
    that run to end, then makes its own."""
    with self._stepper:
      self._step()

  def _step_or_wait(self, seen: int) -> None:
    """A run of the loop, or, while another thread makes one, a wait until a run after the
    `seen`-th has ended."""
    if self._stepper.acquire(blocking=False):
      try:
        self._step()
      finally:
        self._stepper.release()
    else:
      with self._cond:
        self._cond.wait_for(lambda: self._steps != seen or self._thread is not None)

  def _step(self) -> None:
    """`step` under `_stepper`: the scheduler decides (under the lock, beside submit and
    cancel), the runner executes and runs the loop (outside it), the scheduler hands out."""
    started = time.perf_counter()
    try:
      with self._cond:
        ended, starts = self.scheduler.decide(self.runner.held_tokens(), self.runner.tables)
        for row in ended:
          self.runner.end(row)
        for start in starts:
          self.runner.start(start)
        if not self.scheduler.live:
          return
        waiting = bool(self.scheduler.waiting)
      rows = self.runner.run(self.pool, waiting, self.eager_first_tokens)
      with self._cond:
        self.scheduler.take_out(rows, time.perf_counter())
        self._loop_seconds += time.perf_counter() - started
    finally:
      with self._cond:
        self._steps += 1
        self._cond.notify_all()
      self._tell()


def serve(model, params, prompts, max_new_tokens, *, batch_size: int, page_size: int,
          num_pages: int, prefill_chunk: int = PREFILL_CHUNK, stop_tokens=(),
          sampler=decoding.Greedy(), rng=None, prefix_caching: bool = True, cache_dtype=None,
          drafter=None, num_speculative_tokens: int = 4):
  """Every request up front through a `Server`, run until all are done: (new tokens per prompt,
  ServeStats).

  prompts: sequences of token ids; max_new_tokens: an int (NumPy's too) or one per prompt. A request waits
  while the pool cannot hold it beside the running ones; one longer than the pool is refused.
  The other arguments are `Server`'s. No prompts: ([], ServeStats of 0 tokens and 0 pages),
  after the same checks and nothing run.
  """
  model, params = decoding.decodable(model, params)
  for name, value in (("batch_size", batch_size), ("page_size", page_size),
                      ("num_pages", num_pages), ("prefill_chunk", prefill_chunk)):
    checks.check_int(name, value)
  started = time.perf_counter()
  prompts = check_prompts(prompts, decoding.vocabulary(model, params, "init_paged_cache",
                                                  static=(1, 1, 1, 1)))
  limits = check_limits(max_new_tokens, len(prompts))
  for prompt, limit in zip(prompts, limits):
    decoding.check_positions(model, len(prompt), limit)
  if not prompts:
    return [], ServeStats(0, time.perf_counter() - started, 0, page_size)
  server = Server(model, params, batch_size=batch_size, page_size=page_size,
                  num_pages=num_pages, max_length=max(len(p) + n for p, n in zip(prompts, limits)),
                  prefill_chunk=prefill_chunk, stop_tokens=stop_tokens, sampler=sampler, rng=rng,
                  prefix_caching=prefix_caching, segment_steps=64, cache_dtype=cache_dtype,
                  eager_first_tokens=False, drafter=drafter,
                  num_speculative_tokens=num_speculative_tokens)
  requests = [server.submit(p, n) for p, n in zip(prompts, limits)]
  server.run()
  return [r.tokens for r in requests], server.stats(time.perf_counter() - started)


def check_prompts(prompts, vocab_size: int) -> list[np.ndarray]:
  """Each prompt as int32 ids [L], refused when empty, not 1-D integers or outside
  [0, vocab_size)."""
  rows = decoding.prompt_rows(prompts)
  for i, row in enumerate(rows):
    checks.check_token_ids(f"prompts[{i}]", row, vocab_size)
  return rows


def check_limits(max_new_tokens, n: int) -> list[int]:
  """max_new_tokens (any integer, NumPy's included, or one per prompt) as n Python ints."""
  one = isinstance(max_new_tokens, numbers.Integral) or np.ndim(max_new_tokens) == 0
  limits = [max_new_tokens] * n if one else list(max_new_tokens)
  if len(limits) != n:
    raise ValueError(f"max_new_tokens must be an int or one per prompt ({n}), got {len(limits)}")
  return [checks.check_int("max_new_tokens", m) for m in limits]


def until_stop(tokens, stop_tokens) -> list[int]:
  """The ids of `tokens` up to and including the first stop token (all of them without one)."""
  out = []
  for token in tokens:
    out.append(int(token))
    if int(token) in stop_tokens:
      break
  return out
