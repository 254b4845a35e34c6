"""Serving many requests: continuous batching over a paged KV cache with shared prefixes, and
requests submitted, streamed and cancelled while it runs. Layered bottom to top:

  page_pool  the host's book of the pool's pages, their one owner: the free stack, the rows'
             leases (reservations), the prefix entries
  loop       the device side: a compiled loop of chunked prefill and decode steps
  scheduler  which waiting request takes which free row, asking the pool; where tokens go
  runner     the device state between runs: executes the scheduler's decisions, runs the loop
  server     the request front: `Server` (submit / stream / cancel, from any thread), `serve`

The names below are the public API: `flax_mha.serving.Server`, `serve`, ...
"""

from flax_mha.serving.server import PREFILL_CHUNK
from flax_mha.serving.server import SEGMENT_STEPS
from flax_mha.serving.server import Request
from flax_mha.serving.server import ServeStats
from flax_mha.serving.server import Server
from flax_mha.serving.server import check_limits
from flax_mha.serving.server import check_prompts
from flax_mha.serving.server import serve
from flax_mha.serving.server import until_stop

__all__ = ["PREFILL_CHUNK", "SEGMENT_STEPS", "Request", "ServeStats", "Server", "check_limits",
           "check_prompts", "serve", "until_stop"]
