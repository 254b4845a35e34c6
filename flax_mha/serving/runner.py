"""The device runner of serving: the pool's caches on the device, the rows' state between runs
(NumPy), and the inputs of the next run. It executes what the scheduler
(`flax_mha.serving.scheduler`) decided (a request written into a row, a row emptied) and runs
the compiled loop (`flax_mha.serving.loop.segment`) with the free stack the page pool lends."""

from __future__ import annotations

import jax
import numpy as np

from flax_mha.serving import loop
from flax_mha.serving import page_pool
from flax_mha.serving.scheduler import Start


class Runner:
  """The device side of `plan` (a `loop.Plan`) with `params` (the model's, and its drafter's
  arrays: None without one); `rng` keys the sampler."""

  def __init__(self, plan: loop.Plan, params, rng, segment_steps: int):
    self.plan, self.params, self.rng, self.segment_steps = plan, params, rng, segment_steps
    self.cache = loop.empty_cache(plan, params)
    self.state = loop.rows_state(plan)
    self._inputs = self._no_inputs()

  def held_tokens(self) -> dict[int, int]:
    """row -> the tokens it holds now."""
    return {b: int(n) for b, n in enumerate(self.state["length"])}

  @property
  def tables(self):
    """[B, n]: each row's page table."""
    return self.state["table"]

  def start(self, start: Start) -> None:
    """Row `start.row` takes `start.request`: its prompt, limit and admitted pages written, its
    caches emptied at the next run, a copy-on-write page copied first."""
    s, (reset, src, dst) = self.state, self._inputs
    b, request, admission = start.row, start.request, start.admission
    n = len(request.prompt)
    s["req"][b], s["plen"][b], s["limit"][b] = request.id, n, request.max_new_tokens
    for name, value in zip(loop.SAMPLING, request.sampling):
      s[name][b] = value
    s["seed"][b] = -1 if request.seed is None else request.seed
    s["stops"][b] = request.stops
    s["own_k"][b] = self.plan.speculative_tokens
    s["prompt"][b] = 0
    s["prompt"][b, :n] = request.prompt
    s["keep"][b], s["fed"][b], s["length"][b], s["gen"][b] = (admission.keep, admission.start,
                                                             admission.start, 0)
    s["table"][b, :admission.keep] = admission.pages
    reset[b] = True
    if admission.copy is not None:
      src[b], dst[b] = admission.copy
      s["table"][b, admission.keep] = admission.copy[1]

  def end(self, row: int) -> None:
    """Row `row` emptied (its request cancelled): no more tokens from it."""
    self.state["req"][row] = -1

  def run(self, pool: page_pool.PagePool, waiting: bool, first_tokens: bool = False) -> dict:
    """One run of the loop over the free stack `pool` lends, which it takes back; returns the
    rows' state as the run left it (NumPy), also kept as this runner's. first_tokens: the run
    ends as soon as a request's first token is made (`loop.segment`)."""
    free, n_free = pool.lend()
    inputs, self._inputs = self._inputs, self._no_inputs()
    self.cache, rows = loop.segment(self.plan, self.params, self.cache,
                                    dict(self.state, free=free, n_free=n_free), self.rng,
                                    *inputs, self.segment_steps, waiting, first_tokens)
    rows = {k: np.array(v) for k, v in jax.device_get(rows).items()}
    pool.take_back(rows.pop("free"), rows.pop("n_free"))
    self.state = rows
    return rows

  def _no_inputs(self):
    b = self.plan.batch_size
    return (np.zeros((b,), bool), np.zeros((b,), np.int32),
            np.full((b,), self.plan.num_pages, np.int32))
