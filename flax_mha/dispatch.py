"""What `implementation=None` runs, and why: the one rule behind `dot_product_attention`'s
dispatch and `flax_mha.explain`, written here and nowhere else (docstrings and the design page
point here; `flax_mha.explain(...)` prints the choice and every alternative for a call).

The choice reads one `flax_mha.kernels.registry.Call` record: static facts only (shapes,
dtype, `is_causal`, the dropout rate, which mask and score terms a call has, the tiles its
static masks hide) and the platform the program is lowered for: `dot_product_attention` asks
for every platform in PLATFORMS and, where the answers differ, stages them with
`lax.platform_dependent`, so a program exported for 'cuda' from a CPU runs the GPU choice, and
each lowering keeps only its own branch. One exception: cuDNN is
traced by reading the installed cuDNN, so only a process with a CUDA GPU can lower it; from a
CPU-only process a call that cuDNN would take on a GPU gets the next 'cuda' choice ("xla", or
"chunked" past ACCELERATOR_MAX_LOGITS), and `explain(..., platform="cuda")` there says so.

On CPU (each threshold a crossover measured on a 2-core CPU, float32, forward+backward):
  1. A few queries over many keys (generation): "decode", for up to DECODE_MAX_QUERIES = 32
     queries over at least DECODE_MIN_KEYS = 1024 keys with positions or key lengths (a
     cache), DECODE_MIN_KEYS_DENSE = 8192 keys without: settings, not measured crossovers
     (see DECODE_* below).
  2. A window alone (with bias, mask, is_causal, sinks; no sink tokens): "rows" over each query
     block's band of keys from ROWS_WINDOW_MIN_LOGITS logits where the band is at most S/2;
     otherwise as 4.
  3. No dropout and no mask/score terms (bias, mask, is_causal and sinks are fine): "xla" up to
     SMALL_LOGITS_ROWS logits per (batch, head) (SMALL_LOGITS_ROWS_CAUSAL when causal,
     SMALL_LOGITS_ROWS_CAUSAL_WIDE when causal with K > 64), "rows" beyond, "chunked" past
     ROWS_MAX_KEYS keys.
  4. Otherwise "xla" up to SMALL_LOGITS logits per (batch, head), "chunked" beyond: chunked
     skips the tiles its masks hide, so it wins earlier where they hide many. The limit falls
     to SMALL_LOGITS_CAUSAL_NARROW when causal with K <= 64; without dropout (how they were
     timed) to SMALL_LOGITS_BANDED_32 when causal or windowed with K <= 32, and to
     SMALL_LOGITS_SPARSE where the static masks (causality, windows, a `mask_mod` that reads
     only indices) leave chunked at most SPARSE_VISITED of its tiles. Segment ids, lengths
     and positions are data: how much they hide is unknown at trace time, so they move
     nothing.
On GPU and TPU (none measured here): "cudnn" on 'cuda' where it applies, then "triton"
(flax_mha's Pallas Triton flash kernel) wherever it takes the call (no dropout, no mask/score
function over arrays; float32, bfloat16 or float16); "splash" (JAX's Pallas splash attention) on
'tpu' wherever it takes the call (no bias, dense mask, dropout, score_mod, positions or mask_mod
over the batch or arrays; float32 or bfloat16); otherwise, like jax.nn's own default, the plain
XLA graph while the B·H·T·S logits fit ACCELERATOR_MAX_LOGITS, and "chunked" beyond (memory
linear in S). "rows" sizes its tiles for a CPU cache and "decode" its loop for CPU cores:
neither is picked there.
Staging for hardware this process lacks: `lax.platform_dependent` traces every platform's branch
on every call, so a CPU call would pay for tracing kernels it never runs (splash also builds its
masks' block tables in NumPy while tracing, O(T·S) per static shape). So None stages splash and
the Triton kernel in a process with that accelerator, or inside `stage_accelerator_kernels()`
(an export for 'tpu' or 'cuda' from a CPU); elsewhere those branches get the next choice and
`explain` says why.
Every choice computes the same function (`flax_mha.kernels.reference`).

The same rule serves every entrance. A `Call`'s layout says which: "dense" above
(`dot_product_attention`); "cache" (a contiguous KV cache's step, `flax_mha.cache.attend`) and
"paged" (`flax_mha.paged_attention`) are steps up to FEW_QUERIES queries (the one threshold of
"a few queries", which also bounds "decode" above), run by the first kernel of
`STEP_PREFERENCE[layout][platform]` that takes the call, and "dense" beyond (the keys go to
`dot_product_attention`). "ring_block" (one step of ring attention) runs the first kernel of
`STEP_PREFERENCE["ring_block"]` that takes it, whatever T. `flax_mha.cache.steps` and
`flax_mha.parallel.ring` stage those choices per platform; `flax_mha.cache.explain` and
`flax_mha.parallel.ring.explain_step` report them. The rule reads the kernels through the
registry only: their `refuses`, their declared platform and staging, and the measures their
`hints` offer.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import jax

from flax_mha import mods as mods_lib
from flax_mha import platforms
from flax_mha.kernels import registry

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")  # what lax.platform_dependent calls them

# CPU crossovers, forward+backward, float32:
#   `python -m experiments.bench.attention` (plain calls),
#   `python -m experiments.bench.blocks --masked` (mask and bias),
#   `python -m experiments.bench.blocks` (dropout: chunked's causal tile skipping moves its
#   crossover down for causal K <= 64),
#   `python -m experiments.bench.blocks --sparse` (windows: chunked took 0.39-0.69x xla's time
#   at N=384-512 where it visits <= 0.625 of its tiles, 1.1x where it visits 0.78 (K=64); with
#   K=32, causal or windowed, 0.72-0.90x from N=256 on, level or slower at N=128).
SMALL_LOGITS_ROWS = 256 * 256
# A window alone: rows' bands (`python -m experiments.bench.blocks --windows`) took 0.76-0.91x
# chunked's time forward+backward for causal windows of 128-512 keys at N=1024-4096, and 0.78x
# for a (256, 256) window at N=4096, but 1.32x at N=1024, where the band covers 5/8 of S.
ROWS_WINDOW_MIN_LOGITS = 1024 * 1024
SMALL_LOGITS_ROWS_CAUSAL = 128 * 128
# Causal with K > 64: at D=128, N=256 xla took 150 ms forward+backward, rows 177 (rows is
# faster forward, slower backward there; each timed in its own process).
SMALL_LOGITS_ROWS_CAUSAL_WIDE = 256 * 256
SMALL_LOGITS = 512 * 512
SMALL_LOGITS_CAUSAL_NARROW = 256 * 256  # causal, K <= 64
SMALL_LOGITS_BANDED_32 = 128 * 128  # causal or a window, K <= 32
SMALL_LOGITS_SPARSE = 256 * 256  # chunked visits at most SPARSE_VISITED of its tiles
SPARSE_VISITED = 0.625
# A "rows" tile holds >= 128 query rows x S keys: past 8192 keys it outgrows the cache, and
# chunked's tiles do not (`python -m experiments.bench.attention --ds 64 --ns 8192,16384`, each
# in its own process: rows took 0.89-0.94x chunked's forward+backward time at N=8192, 1.10x
# non-causal and 1.12x causal at N=16384).
ROWS_MAX_KEYS = 8192
# Up to DECODE_MAX_QUERIES queries over at least DECODE_MIN_KEYS keys of a cache (positions or
# key lengths: the decode kernel skips the blocks that hold nothing visible), or over at least
# DECODE_MIN_KEYS_DENSE keys otherwise, "decode" (keys split, merged by lse). The three are
# settings, not measured crossovers: `python -m experiments.bench.decode` times one shape,
# T=1 over S=32768 (B=1, H=8, G=2, K=128), where decode took 1/3.09 of xla's time
# (docs/decode_cpu.md); no command sweeps S or T for where decode starts to win.
# An int8 cache's step over more slots than this skips "xla" (which dequantizes the prefix it
# reads) for the kernels that dequantize block by block: at T=1, B=8, H=8, G=2, K=64 (CPU,
# one process, medians of 30) xla took 5.7 ms to decode's 8.6 over 2048 slots holding 2000
# tokens, but 16.3 to 9.2 over 4096 slots holding 2000, and 34.8 to 23.6 over 8192 holding
# 4000 (the float cache's xla step stays the faster there).
XLA_INT8_MAX_SLOTS = 2048
FEW_QUERIES = 32  # up to this many queries a call is a step: a cache's, a paged one, or "decode"
DECODE_MAX_QUERIES = FEW_QUERIES
DECODE_MIN_KEYS = 1024
DECODE_MIN_KEYS_DENSE = 8192
# GPU/TPU: the most B·H·T·S logits "xla" materialises (1 GiB of float32 per [B, H, T, S] array;
# its backward holds a few), chosen for memory, not timed: no accelerator is lent here.
ACCELERATOR_MAX_LOGITS = 2**28


@dataclasses.dataclass(frozen=True)
class Choice:
  """An implementation's name and why the dispatch picked it."""
  name: str
  reason: str


@dataclasses.dataclass(frozen=True)
class Explanation:
  """What `implementation=None` runs for one call on one platform, and what every other
  implementation says about the call: "runs", or the option or shape it refuses."""
  implementation: str
  reason: str
  platform: str
  alternatives: Mapping[str, str]
  # With a 'seq' mesh axis in context: what sequence_parallel_implementation("auto") runs, why.
  sequence_parallel: str | None = None

  def __str__(self):
    lines = [f"implementation=None runs {self.implementation!r} on {self.platform!r}: "
             f"{self.reason}", "other implementations:"]
    lines += [f"  {name}: {verdict}" for name, verdict in self.alternatives.items()]
    if self.sequence_parallel is not None:
      lines.append(f"sequence_parallel_implementation('auto') {self.sequence_parallel}")
    return "\n".join(lines)


def stage_accelerator_kernels(enabled: bool = True):
  """A context manager: inside it, `implementation=None` stages the accelerator kernels that it
  otherwise stages only in a process with that accelerator (splash for 'tpu', the Triton
  kernel for 'cuda'), so that a program exported from a CPU runs them there:

      with flax_mha.stage_accelerator_kernels():
        exported = jax.export.export(jax.jit(step), platforms=("tpu",))(*shapes)

  (For 'cuda', pass `disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(
  flax_mha.kernels.triton.CUSTOM_CALL)]`: jax.export accepts Triton's custom call only when
  told to, since its compatibility is not guaranteed across jax versions.)

  The setting is part of jit's trace cache key: a function traced outside it is traced anew
  inside. It costs every call traced inside it the accelerator branch's tracing (for splash,
  its masks' block tables per static shape). Also settable for a whole process with
  FLAX_MHA_STAGE_ACCELERATOR_KERNELS=1 or
  `jax.config.update("flax_mha_stage_accelerator_kernels", True)`. cuDNN is not affected: jax
  traces it by reading the installed cuDNN, which a process without a CUDA GPU lacks.
  """
  if not isinstance(enabled, bool):
    raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
  return platforms.STAGE_ACCELERATOR_KERNELS(enabled)


def check_platform(platform) -> str:
  """`platform`, or the default backend's for None; a name in PLATFORMS."""
  if platform is None:
    return platforms.backend_platform()
  if not isinstance(platform, str):
    raise TypeError(f"platform must be None or a str, got {type(platform).__name__}")
  if platform not in PLATFORMS:
    raise ValueError(f"platform must be None or one of {PLATFORMS}, got {platform!r}")
  return platform


# A step (layout "cache" or "paged", up to FEW_QUERIES queries): per platform, the kernels in
# order of preference, the first that takes the call running it ("default": any other
# platform). Data: a new step kernel is its registration and its place here.
STEP_PREFERENCE = {
    "cache": {"cuda": ("triton_decode", "xla", "decode"), "default": ("xla", "decode")},
    "paged": {"cuda": ("triton_decode", "decode"), "default": ("decode",)},
    "ring_block": {"cuda": ("triton", "chunked"), "default": ("chunked",)},
}
STEP_WHY = {
    "xla": "dense over the smallest power-of-two prefix of slots holding every filled one",
    "decode": "the decode kernel walks each row's key blocks (slots or pages) in place, "
              "dequantizing an int8 cache's block by block, keys split and merged by lse",
    "triton_decode": "the Triton decode kernel reads each row's filled blocks or pages in place",
    "triton": "the Triton flash kernel steps with its lse, hidden steps skipped",
    "chunked": "chunked's tiles, the tiles the step's masks hide skipped",
}


def choose(call: registry.Call) -> Choice:
  """What `implementation=None` runs for `call` (see the module docstring)."""
  if call.layout != "dense":
    return _step_choice(call)
  if registry.get("cudnn").refuses(call) is None:
    return Choice("cudnn", "cuDNN flash attention applies (16-bit, no dropout, K == V <= 128, "
                           "no mask/score terms)")
  if call.platform != "cpu":
    return _accelerator_choice(call)
  b, t, h, k, s = (call.dims[d] for d in "BTHKS")
  mods, is_causal, dropout_rate = call.mods, call.is_causal, call.dropout_rate
  decode = _decode_choice(t, s, mods)
  if decode is not None:
    return decode
  logits = t * s
  refused = registry.get("rows").refuses(call)
  rows = registry.get("rows").hints
  window = rows["window_of"](mods)
  if refused is None and window is not None:
    band = rows["band_keys"](window, is_causal)
    if logits >= ROWS_WINDOW_MIN_LOGITS and 2 * band <= s:
      return Choice("rows", f"a window alone, T·S = {logits} >= ROWS_WINDOW_MIN_LOGITS = "
                            f"{ROWS_WINDOW_MIN_LOGITS} and each block's band of {band} keys "
                            f"<= S/2: query-row blocks over their band of keys")
    refused = (f"a window whose band of {band} keys is over S/2 or T·S = {logits} < "
               f"ROWS_WINDOW_MIN_LOGITS = {ROWS_WINDOW_MIN_LOGITS}")
  if refused is None:
    limit, name = SMALL_LOGITS_ROWS, "SMALL_LOGITS_ROWS"
    if is_causal:
      limit, name = ((SMALL_LOGITS_ROWS_CAUSAL_WIDE, "SMALL_LOGITS_ROWS_CAUSAL_WIDE (K > 64)")
                     if k > 64 else (SMALL_LOGITS_ROWS_CAUSAL, "SMALL_LOGITS_ROWS_CAUSAL"))
    if logits <= limit:
      return Choice("xla", f"no dropout or mask/score terms and T·S = {logits} logits per "
                           f"(batch, head) <= {name} = {limit}: one fused XLA graph has the "
                           "least overhead (CPU crossover)")
    if s <= ROWS_MAX_KEYS:
      return Choice("rows", f"no dropout or mask/score terms, T·S = {logits} > {name} = "
                            f"{limit} and S = {s} <= ROWS_MAX_KEYS = {ROWS_MAX_KEYS}: query-row "
                            "blocks with an exact softmax, the fastest on CPU")
    return Choice("chunked", f"S = {s} > ROWS_MAX_KEYS = {ROWS_MAX_KEYS}: rows' tiles of >= 128 "
                             "rows x S keys outgrow the cache; chunked's tiles do not")
  return _cpu_with_terms(t, s, k, is_causal, dropout_rate, mods, refused)


def _accelerator_choice(call: registry.Call) -> Choice:
  """On 'cuda', 'rocm' or 'tpu', past cuDNN: splash on 'tpu', the Triton kernel on 'cuda',
  where they take the call; otherwise "xla" or "chunked" by memory."""
  splash_refuses = registry.get("splash").refuses(call)
  if splash_refuses is None:
    return Choice("splash", "on 'tpu' JAX's splash attention (Pallas) takes every call it "
                            "can: its static masks (causality, windows, index-only mask_mods) "
                            "skip the blocks they hide, segment ids and lengths mask in the "
                            "kernel, memory linear in S")
  b, t, h, s = (call.dims[d] for d in "BTHS")
  platform, logits, why = call.platform, b * h * t * s, ""
  gpu_reason = registry.get("cudnn").hints["gpu_reason"]
  if platform == "cuda" and gpu_reason(call.query, call.key, call.value, call.dropout_rate,
                                       call.mods) is None:
    why = ("cuDNN would run this call on a GPU, but this process has none to trace it with, "
           "so a program lowered here for 'cuda' runs the next choice: ")
  triton_refuses = registry.get("triton").refuses(call)
  if triton_refuses is None:
    return Choice("triton", f"{why}on 'cuda' where cuDNN cannot run the call, flax_mha's Triton "
                            "flash kernel (Pallas) takes every call it can: masks, windows, "
                            "lengths, positions and mask/score functions in the kernel, hidden "
                            "tiles skipped, memory linear in S")
  for refused, name, device in ((splash_refuses, "splash", "a TPU"),
                                (triton_refuses, "triton", "a CUDA GPU")):
    if refused == registry.get(name).hints["not_staged"] and not why:
      why = (f"{name} would run this call on {device}, but this process has none "
             "and flax_mha.stage_accelerator_kernels() is off, so None stages the next choice: ")
  if logits <= ACCELERATOR_MAX_LOGITS:
    return Choice("xla", f"{why}on {platform!r} the plain XLA graph, as jax.nn's default, "
                         f"while B·H·T·S = {logits} logits <= ACCELERATOR_MAX_LOGITS = "
                         f"{ACCELERATOR_MAX_LOGITS} (a memory bound, not a timing)")
  return Choice("chunked", f"{why}on {platform!r}: B·H·T·S = {logits} logits > "
                           f"ACCELERATOR_MAX_LOGITS = {ACCELERATOR_MAX_LOGITS}, too many to "
                           "materialise; chunked's memory is linear in S")


def _cpu_with_terms(t, s, k, is_causal, dropout_rate, mods, refused: str) -> Choice:
  """On CPU, a call that "rows" refuses (`refused` says why): "xla" or "chunked"."""
  logits = t * s
  limit, name, why = SMALL_LOGITS, "SMALL_LOGITS", ""
  if is_causal and k <= 64:
    limit, name = SMALL_LOGITS_CAUSAL_NARROW, "SMALL_LOGITS_CAUSAL_NARROW (causal, K <= 64)"
  window = mods_lib.narrowest_window(mods)
  banded = is_causal or (window is not None and window < s)
  if not dropout_rate and banded and k <= 32:  # timed without dropout only
    limit, name = SMALL_LOGITS_BANDED_32, "SMALL_LOGITS_BANDED_32 (causal or a window, K <= 32)"
  if not dropout_rate and SMALL_LOGITS_SPARSE < logits <= limit:
    visited = registry.get("chunked").hints["visited_fraction"](t, s, k, is_causal, mods)
    if visited <= SPARSE_VISITED:
      limit, name = SMALL_LOGITS_SPARSE, "SMALL_LOGITS_SPARSE"
      why = (f" (its static masks leave chunked {visited:.3f} of its tiles, <= SPARSE_VISITED "
             f"= {SPARSE_VISITED})")
  if logits <= limit:
    return Choice("xla", f"not 'rows' ({refused}); T·S = {logits} logits per (batch, head) <= "
                         f"{name} = {limit}: one fused XLA graph has the least overhead (CPU "
                         "crossover)")
  return Choice("chunked", f"not 'rows' ({refused}); T·S = {logits} logits per (batch, head) "
                           f"> {name} = {limit}{why}: chunked skips the tiles its masks hide "
                           "and needs memory linear in S")


def _decode_choice(t: int, s: int, mods) -> Choice | None:
  cache_like = mods is not None and any(
      isinstance(term, (mods_lib.Positions, mods_lib.SeqLengths)) for term in mods.masks)
  min_keys, name = ((DECODE_MIN_KEYS, "DECODE_MIN_KEYS (a cache: positions or lengths)")
                    if cache_like else (DECODE_MIN_KEYS_DENSE, "DECODE_MIN_KEYS_DENSE"))
  if t <= DECODE_MAX_QUERIES and s >= min_keys:
    return Choice("decode", f"T = {t} queries <= DECODE_MAX_QUERIES = {DECODE_MAX_QUERIES} over "
                            f"S = {s} keys >= {name} = {min_keys}: keys split into partitions "
                            "merged by log-sum-exp")
  return None


def is_step(num_queries: int) -> bool:
  """Whether a cache's or paged call of `num_queries` queries is a step (its own kernels) or
  dense (the keys go to `dot_product_attention`, whose choice runs): decided once, from the
  static number of queries, before anything is built for either."""
  return num_queries <= FEW_QUERIES


def not_a_step(num_queries: int) -> Choice:
  """The choice for a cache's or paged call of more than FEW_QUERIES queries."""
  return Choice("dense", f"T = {num_queries} queries > FEW_QUERIES = {FEW_QUERIES}: not a "
                         "step; the keys go to dot_product_attention, whose own choice runs")


def _step_choice(call: registry.Call) -> Choice:
  """A cache's or a paged call: past FEW_QUERIES queries "dense" (the keys go to
  `dot_product_attention` and its own choice); otherwise the first kernel of
  STEP_PREFERENCE that takes the call ("xla" passed over for an int8 cache of more than
  XLA_INT8_MAX_SLOTS slots)."""
  t = call.dims["T"]
  if call.layout == "ring_block":
    return _first_taker(call, "a ring step")
  if not is_step(t):
    return not_a_step(t)
  passed_over = {}
  if call.quantized and call.dims["S"] > XLA_INT8_MAX_SLOTS:
    passed_over["xla"] = (f"an int8 cache of S = {call.dims['S']} > XLA_INT8_MAX_SLOTS = "
                          f"{XLA_INT8_MAX_SLOTS} slots reads faster block by block")
  return _first_taker(call, f"a step of T = {t} <= FEW_QUERIES = {FEW_QUERIES} queries",
                      passed_over)


def _first_taker(call: registry.Call, what: str, passed_over: dict | None = None) -> Choice:
  """The first kernel of STEP_PREFERENCE[call.layout] for the call's platform that takes it
  and is not in `passed_over` (name -> why; "dense" when none does)."""
  preference = STEP_PREFERENCE[call.layout]
  refused = []
  for name in preference.get(call.platform, preference["default"]):
    why = (passed_over or {}).get(name) or registry.get(name).refuses(call)
    if why is None:
      passed = "".join(f"{other} refuses ({reason}); " for other, reason in refused)
      return Choice(name, f"{passed}{what}: {STEP_WHY.get(name, name)}")
    refused.append((name, why))
  return Choice("dense", "no step kernel takes the call (" + "; ".join(
      f"{name}: {why}" for name, why in refused) + "): the keys go to dot_product_attention")


def per_platform(call: registry.Call) -> dict[str, str]:
  """platform -> the name `choose` picks for `call` lowered there, for every platform in
  PLATFORMS (what a caller stages with `lax.platform_dependent` where they differ; the
  'rocm' pick serves any other platform)."""
  return {platform: choose(dataclasses.replace(call, platform=platform)).name
          for platform in PLATFORMS}


def staged(picks: Mapping[str, str], branch: Callable[[str], Callable], *operands):
  """`branch(name)(*operands)` for the name `picks` (platform -> name, `per_platform`'s) holds
  for the platform the program is lowered for: the one staging of every entrance (a plain
  call, a cache's step, a ring step). Where the platforms agree, that branch alone; else
  `lax.platform_dependent`, one branch per name, the 'rocm' pick for any other platform."""
  if len(set(picks.values())) == 1:
    return branch(picks["cpu"])(*operands)
  branches = {name: branch(name) for name in set(picks.values())}
  return jax.lax.platform_dependent(*operands, default=branches[picks["rocm"]],
                                    **{platform: branches[name] for platform, name in picks.items()})


def explanation(call: registry.Call) -> Explanation:
  """`choose` and every registered kernel's `refuses`, for `flax_mha.explain`."""
  picked = choose(call)
  alternatives = {name: "runs" if why is None else f"refuses: {why}"
                  for name, why in registry.refusals(call).items() if name != picked.name}
  if call.layout != "dense":
    return Explanation(picked.name, picked.reason, call.platform, alternatives)
  auto = None if call.dropout_rate else registry.get("ring").hints["explain_auto"](
      call.query, call.key, call.value, call.bias, is_causal=call.is_causal, mods=call.mods)
  return Explanation(picked.name, picked.reason, call.platform, alternatives, auto)
