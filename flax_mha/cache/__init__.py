"""The KV cache: a cache that is data, its quantization, paged attention and the steps that read
it (an int8 cache's quantization, which the kernels read too, is `flax_mha.quant`), layered
bottom to top (each module imports only those before it):

  kv       the caches (`KVCache`, contiguous or rolling; `PagedKVCache`, pages of a shared
           pool) and their writers
  steps    a few queries over a cache or pages, with the kernel `flax_mha.dispatch` chooses
  paged    `paged_attention`: a step, or the pages gathered and a prefill
  entry    `attend` (write a chunk, read what it sees), `explain` (which kernel a step runs) and
           `write_then_read` (write a chunk, read everything back, for a caller's own attention)

This package's names are the public API: `flax_mha.cache.KVCache`, `attend`, `explain`, ...
"""

from flax_mha.cache.kv import KVCache
from flax_mha.cache.kv import PagedKVCache
from flax_mha.cache.kv import ROOM_MADE_BY_CALLER
from flax_mha.cache.kv import caller_makes_room
from flax_mha.cache.kv import is_cache
from flax_mha.cache.kv import next_positions
from flax_mha.cache.kv import room_made_by_caller
from flax_mha.cache.kv import update
from flax_mha.cache.kv import update_pages
from flax_mha.cache import steps
from flax_mha.cache import paged
from flax_mha.cache.entry import attend
from flax_mha.cache.entry import explain
from flax_mha.cache.entry import nan_past_capacity
from flax_mha.cache.entry import write_then_read

__all__ = ["KVCache", "PagedKVCache", "ROOM_MADE_BY_CALLER", "attend", "caller_makes_room",
           "explain", "is_cache", "nan_past_capacity", "next_positions", "paged",
           "room_made_by_caller", "steps", "update", "update_pages", "write_then_read"]
