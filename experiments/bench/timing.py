"""How the benchmarks measure: each system in its own process, processes in turn; memory.

Systems side by side in one process slow each other (JAX beside JAX as well as beside torch:
`python -m experiments.bench.attention --part protocol` measures it), so the benchmarks that
compare systems (attention, decode, nnx, sparsity, training) time each system, or each case, in
a worker process of its own (`isolated`): every turn runs one worker per case, one after the
other, the order reversed every other turn, so load on a shared machine hits all alike and no
case always follows the same other one. Within a worker, `round_robin` times its calls in
turn; medians are taken over all rounds of all turns. The benchmarks that sweep one kernel's
own settings (blocks, ring, decode's sweep) time them round-robin in one process, as their
docstrings say.
"""

from __future__ import annotations

import json
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


def in_turns(fns: dict[Any, Callable[[], Any]], runs: int) -> dict[Any, tuple[float, Any]]:
  """name -> (median seconds, last result) of fns[name](): each called once untimed, then
  `runs` times in turn (the systems of one process, e.g. two settings of one loop)."""
  results = {name: fn() for name, fn in fns.items()}
  seconds = {name: [] for name in fns}
  for _ in range(runs):
    for name, fn in fns.items():
      start = time.perf_counter()
      results[name] = fn()
      seconds[name].append(time.perf_counter() - start)
  return {name: (statistics.median(s), results[name]) for name, s in seconds.items()}


def once_then_timed(run: Callable[[], Any], rounds: int) -> tuple[Any, list[float]]:
  """(the result of `run()` called once untimed (compilation, warm-up), the seconds of each of
  `rounds` timed calls after it): a worker's timing (see `isolated`)."""
  result = run()
  seconds = []
  for _ in range(rounds):
    start = time.perf_counter()
    run()
    seconds.append(time.perf_counter() - start)
  return result, seconds


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


def isolated(module: str, cases: list[str], *, turns: int, extra_args=()) -> dict[str, list]:
  """case -> what its worker printed last (one JSON value) in each turn, in turn order.

  Each turn runs `python -m <module> --time-case <case> <extra_args>` once per case, a process
  of its own each, one after the other: in the order of `cases` on even turns, reversed on odd
  ones (see the module docstring).
  """
  reports = {case: [] for case in cases}
  for turn in range(turns):
    for case in cases if turn % 2 == 0 else cases[::-1]:
      lines = run_worker([sys.executable, "-m", module, "--time-case", case, *extra_args])
      reports[case].append(json.loads(lines[-1]))
  return reports


def pooled_seconds(reports: dict[str, list]) -> dict[str, list[float]]:
  """case -> the seconds of all its workers, from `isolated`'s reports of workers that print
  {"seconds": [...], ...}."""
  return {case: [t for report in mine for t in report["seconds"]]
          for case, mine in reports.items()}


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
