"""How the benchmarks measure: peers timed round-robin, processes in turn, compiled memory.

Timing every peer once per round, in turn, makes load on a shared machine hit all alike, so
ratios between peers mean something even when absolute times move. Systems of different
frameworks never share a process (JAX and torch side by side slow each other): each runs in a
worker process of its own, the workers taking turns.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import jax


def round_robin(fns: dict[Any, Callable[[], Any]], rounds: int, *, warmups: int = 2,
                rotate: bool = False) -> dict[Any, list[float]]:
  """name -> the seconds of each timed call of fns[name]().

  Each fn is first called `warmups` times untimed (compilation, caches); then each round calls
  every fn once, in dict order, or with `rotate` starting one fn later each round (so no fn
  always runs right after the same other one).
  """
  for fn in fns.values():
    for _ in range(warmups):
      fn()
  names = list(fns)
  times = {name: [] for name in names}
  for round_index in range(rounds):
    shift = round_index % len(names) if rotate else 0
    for name in names[shift:] + names[:shift]:
      start = time.perf_counter()
      fns[name]()
      times[name].append(time.perf_counter() - start)
  return times


def median_seconds(fns: dict[Any, Callable[[], Any]], rounds: int) -> dict[Any, float]:
  """name -> median seconds of fns[name](), timed round-robin after two warm-ups each."""
  return {name: statistics.median(t) for name, t in round_robin(fns, rounds).items()}


def blocking(fn: Callable, *args) -> Callable[[], Any]:
  """`fn` jitted and applied to `args`, as a call of no arguments that waits for the result."""
  jitted = jax.jit(fn)
  return lambda: jax.block_until_ready(jitted(*args))


def qkv_grad(loss: Callable) -> Callable:
  """The gradient of a scalar `loss(q, k, v, ...)` with respect to q, k and v."""
  return jax.grad(loss, argnums=(0, 1, 2))


def grad_memory(loss: Callable, *args):
  """XLA's memory analysis of jit(qkv_grad(loss)) compiled for `args` (arrays or
  jax.ShapeDtypeStruct), never run."""
  return jax.jit(qkv_grad(loss)).lower(*args).compile().memory_analysis()


def import_tokamax():
  """The tokamax module, or None where it does not import. tokamax reads absl flags, parsing
  sys.argv on first use: a benchmark's own arguments would be unknown flags there, so the
  flags are parsed here from the program name alone."""
  try:
    import tokamax  # pylint: disable=import-outside-toplevel
    from absl import flags  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  if not flags.FLAGS.is_parsed():
    flags.FLAGS([sys.argv[0]])
  return tokamax


def run_worker(command: list[str], timeout: float = 1800) -> list[str]:
  """The stdout lines of `command`, a process of its own (a benchmark's worker), or an error
  with the end of its stderr."""
  result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
  if result.returncode:
    raise RuntimeError(f"benchmark worker {command} failed:\n{result.stderr[-3000:]}")
  return result.stdout.splitlines()


def in_subprocess(code: str, timeout: float = 900) -> list[float]:
  """Seconds printed by `code` (python, one number a line) run in a process of its own: how a
  system of another framework is timed alone (torch and JAX in one process slow each other)."""
  lines = run_worker([sys.executable, "-c", code], timeout)
  return [float(line) for line in lines if line.strip()]


TORCH_SDPA = """
import time, torch
torch.manual_seed(0)
q = torch.randn({b}, {h}, {t}, {k}); k = torch.randn({b}, {g}, {s}, {k}); v = torch.randn({b}, {g}, {s}, {v})
f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal={causal}, enable_gqa=True)
for _ in range(2): f()
for _ in range({rounds}):
  start = time.perf_counter(); f(); print(time.perf_counter() - start)
"""


def torch_sdpa_seconds(*, b, t, s, h, g, k, v, causal=False, rounds=5) -> list[float]:
  """torch SDPA's forward on [B, H, T, K] x [B, G, S, K] (float32, CPU), timed alone."""
  return in_subprocess(TORCH_SDPA.format(b=b, t=t, s=s, h=h, g=g, k=k, v=v, causal=causal,
                                         rounds=rounds))


def write_report(title: str, command: str, parts, sections: dict, out: str, smoke: bool) -> None:
  """Each part's section (sections[part]() -> lines) under its heading, printed, and written
  as markdown to `out` unless this is a smoke run."""
  lines = [f"# {title}", "", f"`{command}` (see its docstring).", ""]
  for part in parts:
    lines += [f"## {part}", "", *sections[part](), ""]
  print("\n".join(lines))
  if not smoke:
    with open(out, "w") as f:
      f.write("\n".join(lines))
