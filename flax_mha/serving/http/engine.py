"""The one device loop behind the HTTP front: a `flax_mha.serving.Server` running in its own
thread, and the requests of an asyncio event loop on it. The HTTP layer only translates: no
second scheduler, no second queue. Each request submits to the Server, then waits on an
asyncio event that the Server's listener sets after every run of the loop; it reads its new
tokens, turns them into text (`text.Detokenizer`), cuts at stop strings (`text.StopStrings`,
and cancels the request there), and cancels the request whenever its reader goes away (a
client that disconnects), so its pages go back to the pool.

Admission: a request is refused (429) while `max_waiting` requests already wait, and (503)
once draining has begun (shutdown).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, AsyncIterator

from flax_mha.serving import server as server_lib
from flax_mha.serving.http import protocol
from flax_mha.serving.http import text as text_lib
from flax_mha.serving.http.protocol import APIError


@dataclasses.dataclass(frozen=True)
class Served:
  """A model as the server serves it: its name, the model and its variables (or an NNX module
  and None), a tokenizer (`encode(text)`, `encode_chat(text)`, `decode(ids)`, `vocab_size`),
  its chat template (`chat.ChatTemplate`, or None: no chat endpoint) and end-of-sequence ids."""
  name: str
  model: Any
  params: Any
  tokenizer: Any
  chat_template: Any
  stop_tokens: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Output:
  """A piece of a request's answer: new text, the tokens generated so far, and the finish
  reason on the last piece ("stop" or "length"; None before)."""
  text: str
  tokens: int
  finish: str | None = None


class Engine:
  """`served` on `server` (already built; started by `start`), refusing past `max_waiting`."""

  def __init__(self, served: Served, server: server_lib.Server, *, max_waiting: int):
    self.served, self.server, self.max_waiting = served, server, max_waiting
    self.draining = False
    self.active = 0  # requests between admission and their last piece
    self.aborted = 0  # requests whose reader went away before their end (cancelled)
    self._events: set[asyncio.Event] = set()
    self._loop = None
    # called with (request, Output, seconds since submission, the (seconds, tokens) of the
    # request's first piece, None for the first piece itself)
    self.observers = []

  def start(self, loop: asyncio.AbstractEventLoop) -> None:
    """Run the server's thread; wake this loop's readers after each run of the loop."""
    self._loop = loop
    self.server.add_listener(lambda: loop.call_soon_threadsafe(self._wake))
    self.server.start()

  def stop(self) -> None:
    self.server.stop()

  def _wake(self) -> None:
    for event in self._events:
      event.set()

  def admit(self, job: protocol.Job):
    """Submit `job`; returns the Server's request. Raises APIError: 503 while draining, 429
    with the waiting queue full, 400 for what the Server refuses (too long, ids outside the
    vocabulary)."""
    if self.draining:
      raise APIError(503, "the server is shutting down", "service_unavailable",
                     code="shutting_down")
    if self.server.snapshot()["waiting"] >= self.max_waiting:
      raise APIError(429, f"{self.max_waiting} requests are already waiting: retry later",
                     "rate_limit_error", code="queue_full")
    n, limit = len(job.prompt), self.server.max_length
    if n + job.max_tokens > limit:
      asked = (f"the prompt has {n} tokens" if n >= limit else
               f"the prompt's {n} tokens and max_tokens={job.max_tokens} make "
               f"{n + job.max_tokens}")
      raise APIError(400, f"This model's maximum context length is {limit} tokens; {asked}",
                     param=job.source if n >= limit else "max_tokens",
                     code="context_length_exceeded")
    try:
      return self.server.submit(job.prompt, job.max_tokens, sampler=job.sampler, seed=job.seed,
                                ignore_stop_tokens=job.ignore_eos)
    except (ValueError, TypeError) as e:
      raise APIError(400, str(e).replace("prompts[0]", job.source), param=job.source,
                     code="invalid_prompt") from None

  async def pieces(self, job: protocol.Job, request) -> AsyncIterator[Output]:
    """The answer to admitted `request` as it is made; cancelled if the caller stops
    reading."""
    event = asyncio.Event()
    self._events.add(event)
    self.active += 1
    detokenizer = text_lib.Detokenizer(self.served.tokenizer.decode)
    stops = text_lib.StopStrings(job.stops)
    sent, first = 0, None

    def seen(output: Output) -> Output:
      nonlocal first
      seconds = time.perf_counter() - request.submitted_at
      for observe in self.observers:
        observe(request, output, seconds, first)
      first = first or (seconds, output.tokens)
      return output

    try:
      while True:
        event.clear()
        new, finished = self.server.progress(request, sent)
        sent += len(new)
        piece = stops.add(detokenizer.add(new)) if new else ""
        if stops.stopped:
          self.server.cancel(request)
          yield seen(Output(piece, sent, "stop"))
          return
        if finished:
          piece += stops.add(detokenizer.flush())
          piece += stops.flush()
          yield seen(Output(piece, sent, self._finish(job, request, stops)))
          return
        if piece:
          yield seen(Output(piece, sent))
        if not new:
          await event.wait()
    finally:
      self._events.discard(event)
      self.active -= 1
      if not request.finished:
        self.aborted += 1
        self.server.cancel(request)

  def _finish(self, job, request, stops) -> str:
    ended_by_token = (not job.ignore_eos and request.tokens
                      and request.tokens[-1] in self.served.stop_tokens)
    return "stop" if stops.stopped or ended_by_token else "length"
