"""The host's scheduling between two runs of the serving loop (`flax_mha.serving.loop`): which
waiting request takes which free row, what a cancelled row gives back, and where a run's tokens
go. It asks the page pool (`flax_mha.serving.page_pool`, the one owner of the pages) for pages
and sees the device only through the rows' lengths and page tables it is handed; the runner
(`flax_mha.serving.runner`) executes what it decides. Pure Python over NumPy: no JAX.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from flax_mha.serving import page_pool


@dataclasses.dataclass(eq=False)
class Request:
  """One request: its prompt and limit, the tokens made so far (`tokens`, growing), its `state`
  ("waiting", "running", "done", "cancelled"), and when it was submitted and when each token
  reached the host (time.perf_counter seconds). `sampling`: its (temperature, top_k, top_p) as
  `flax_mha.models.sampling.draw_rows` takes them; `seed`: its own draws' seed (None: the
  server's); `stops`: whether the server's stop tokens end it."""
  id: int
  prompt: np.ndarray
  max_new_tokens: int
  sampling: tuple = (0.0, 0, 1.0)
  seed: int | None = None
  stops: bool = True
  tokens: list = dataclasses.field(default_factory=list)
  state: str = "waiting"
  submitted_at: float = 0.0
  token_times: list = dataclasses.field(default_factory=list)
  shared_tokens: int = 0

  @property
  def finished(self) -> bool:
    return self.state in ("done", "cancelled")


@dataclasses.dataclass(frozen=True)
class Start:
  """A decision: `request` takes free row `row` with the pool's `admission`."""
  row: int
  request: Request
  admission: page_pool.Admission


class Scheduler:
  """The waiting queue and the busy rows' requests of `batch_size` rows over `pool`, each
  request taking `extra_tokens` more than its prompt and new tokens (what a speculative round
  writes past them before it rolls back)."""

  def __init__(self, pool: page_pool.PagePool, batch_size: int, extra_tokens: int = 0):
    self.pool, self.extra_tokens = pool, extra_tokens
    self.rows: list[Request | None] = [None] * batch_size
    self.waiting: list[Request] = []
    self.new_tokens = self.shared_tokens = 0

  @property
  def live(self) -> bool:
    """Whether any row is busy."""
    return any(request is not None for request in self.rows)

  def queue(self, request: Request) -> None:
    self.waiting.append(request)

  def cancel(self, request: Request) -> None:
    """No more tokens for `request`; its row (if any) is emptied at the next `decide`."""
    if request.state == "waiting":
      self.waiting.remove(request)
    if not request.finished:
      request.state = "cancelled"

  def decide(self, held_tokens: dict[int, int], tables) -> tuple[list[int], list[Start]]:
    """(rows to empty, starts): cancelled requests' rows emptied (their own pages pushed past
    their admission's, read from `tables` [B, n], their entries let go), then free rows take
    waiting requests, in order, skipping one whose pages are not there yet (the rows holding
    `held_tokens[row]` tokens now)."""
    ended = []
    for b, request in enumerate(self.rows):
      if request is not None and request.state == "cancelled":
        keep = self.pool.leases[b].admission.keep
        self.pool.end(b, tables[b, keep:self.pool.pages_for(held_tokens[b])])
        self.rows[b] = None
        ended.append(b)
    return ended, self._admit(held_tokens)

  def _admit(self, held_tokens: dict[int, int]) -> list[Start]:
    held_tokens, starts = dict(held_tokens), []
    for b in range(len(self.rows)):
      if self.rows[b] is not None:
        continue
      live = {row: held_tokens[row] for row, r in enumerate(self.rows) if r is not None}
      for request in self.waiting:
        total = len(request.prompt) + request.max_new_tokens + self.extra_tokens
        admission = self.pool.lease(b, request.prompt, total, live)
        if isinstance(admission, page_pool.Admission):
          self.waiting.remove(request)
          self.rows[b] = request
          request.state, request.shared_tokens = "running", admission.start
          self.shared_tokens += admission.start
          held_tokens[b] = admission.start  # what the row holds once the runner starts it
          starts.append(Start(b, request, admission))
          break
        if admission is None:  # the pool is full: the rest wait too, in order
          return starts
    return starts

  def take_out(self, rows: dict, now: float) -> None:
    """A run's tokens (`rows`: the loop's state as the run left it) to their requests; rows
    the device ended (their own pages pushed there) let go of their entries; prompts written
    far enough made shareable."""
    for b, request in enumerate(self.rows):
      if request is None:
        continue
      if request.state == "running":
        new = rows["out"][b, :rows["count"][b]].tolist()
        request.tokens += new
        request.token_times += [now] * len(new)
        self.new_tokens += len(new)
      self.pool.mark_written(self.pool.leases[b].admission, int(rows["fed"][b]))
      if rows["req"][b] < 0:  # ended on the device, its own pages pushed there
        self.pool.end(b)
        self.rows[b] = None
        if request.state == "running":
          request.state = "done"
