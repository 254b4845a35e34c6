"""Serving many requests: continuous batching over a paged KV cache with shared prefixes, and
requests submitted, streamed and cancelled while it runs. Layered bottom to top:

  page_pool  the host's book of the pool's pages: free pages, reservations, prefix entries
  loop       the device side: a compiled loop of chunked prefill and decode steps
  server     `Server` (submit / stream / cancel, from any thread) and `serve` (a batch)

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
