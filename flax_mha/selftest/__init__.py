"""A self-test to run first on a new device: `python -m flax_mha.selftest`.

On the backend where it runs (`jax.default_backend()`: cpu, a CUDA or ROCm GPU, a TPU) it runs
every implementation registered for that platform (`flax_mha.kernels.registry`: each kernel
whose `platform` is None or this one, read from the registry, so a kernel registered later
appears; a superset of what `implementation=None` picks) and `implementation=None` itself,
compiled, on the matrix of `flax_mha.selftest.cases`: options of `dot_product_attention` at a
small and a medium shape, in float32 and bfloat16; a KV cache's step (`flax_mha.cache.attend`)
and `flax_mha.paged_attention`, by None and by each kernel of those layouts. Each row is
checked against the oracle (`implementation="reference"` in float32 on the same rounded
inputs): the output, and the gradients of the query, key and value (or pages) for a fixed
random cotangent, each as max |error| / max |oracle| (so one tolerance serves every scale),
and timed: forward+backward, median of a few runs after compilation.

Every kernel runs through the public API by name (`implementation=name`: of
`dot_product_attention`, of `cache.attend`, where a dense implementation's name runs it over
the cache's keys and a step kernel's runs the step, and of `paged_attention`). A kernel that
refuses even the plain call (ring without a 'seq' mesh, cuDNN in float32) gets one row per
dtype. "None (xla)" names what None runs; where it runs one kernel on every platform (no
`lax.platform_dependent` branches: the same program as the named row) it reports that row.

A row reads "pass", "fail" (a mismatch, a NaN, or an error while compiling or running: a bug
to report), "refused" (the kernel declines the call, by its registry `refuses`, and says why:
no failure) or "skipped" (a kernel for another platform; `--interpret` runs the Pallas ones in
interpret mode, slowly, which checks their semantics on a CPU but not their compilation). The
exit status is 1 when any row fails, and 1 too when no row passes: a run that tested nothing
(every row refused or skipped, as `--implementations triton` on a CPU) says "nothing tested",
never "ok". 0 otherwise.

The table fits a terminal of WIDTH (100) columns: a cell longer than its column wraps within it
and a row's note (a refusal's reason, an error) goes on indented lines below the row; the JSON
table (`--json`) holds every row's cells whole.

  python -m flax_mha.selftest                 # everything, on this machine's default backend
  python -m flax_mha.selftest --quick         # the small shape, a few options (CI, on a CPU)
  python -m flax_mha.selftest --interpret --implementations triton,splash,triton_decode
  python -m flax_mha.selftest --dtypes bfloat16 --json selftest.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import inspect
import json
import statistics
import sys
import textwrap
import time
from typing import Any, Callable, Sequence

import jax

from flax_mha import attention
from flax_mha import cache as cache_lib
from flax_mha import dispatch
from flax_mha import platforms
from flax_mha.selftest import cases
from flax_mha.kernels import registry

DTYPES = ("float32", "bfloat16")
REPEATS = 5  # timed runs per row, after the one that compiles
TIME_BUDGET_S = 2.0  # past this many seconds of timed runs, a row stops at two (a CPU's medium)
EVERY_OPTION = "(every option)"


@dataclasses.dataclass
class Row:
  """One line of the table. `values`, `grads`: max |error| / max |oracle| of the output and of
  the gradients (None where not run); `ms` the median forward+backward time; `result` "pass",
  "fail", "refused" or "skipped", `note` why (a refusal's reason, an error)."""
  implementation: str
  options: str
  shape: str
  dtype: str
  result: str
  values: float | None = None
  grads: float | None = None
  ms: float | None = None
  note: str = ""


@dataclasses.dataclass(frozen=True)
class Candidate:
  """What one row group runs: `label` in the table, `implementation` as passed to the API
  (None, a registered name, or an interpret-mode kernel), `name` the registry's (None for
  `implementation=None`), `platform` the one its refusals are asked for, `skipped` why it
  cannot run here."""
  label: str
  implementation: Any
  name: str | None
  platform: str
  skipped: str | None = None


def _interpreted(kernel: registry.Kernel):
  """The kernel's `make_attention(interpret=True)` where its module has one, else None."""
  module = sys.modules.get(getattr(kernel.attention, "__module__", None) or "")
  factory = getattr(module, "make_attention", None)
  if factory is None or "interpret" not in inspect.signature(factory).parameters:
    return None
  return factory(interpret=True)


def candidates(layout: str, platform: str, interpret: bool) -> list[Candidate]:
  """Every kernel registered for `layout` but the oracle, then None: compiled where its
  platform is this one (or any), interpreted with `interpret` where it can be, skipped
  otherwise."""
  found = []
  for name in registry.names(layout):
    kernel = registry.get(name)
    if name == "reference":
      continue
    if kernel.platform in (None, platform):
      found.append(Candidate(name, name, name, platform))
      continue
    interpreted = _interpreted(kernel) if interpret else None
    if interpreted is not None:
      found.append(Candidate(f"{name} (interpret)", interpreted, name, kernel.platform))
    else:
      hint = "; --interpret runs it in Pallas interpret mode" if (
          not interpret and _interpreted(kernel) is not None) else ""
      found.append(Candidate(name, None, name, kernel.platform,
                             skipped=f"needs {kernel.platform}{hint}"))
  return found + [Candidate("None", None, None, platform)]


def program(call: Callable, static: dict) -> Callable:
  """jit of (args, cot, arrays, extra) -> (output, gradients of `args` for `cot`), `call`
  taking (*args, arrays, static, *extra); one per (call, static), so that jit's own cache
  serves a second case of the same shapes (the oracle's float32 program, for each dtype)."""
  return _program(call, tuple(sorted(static.items())))


@functools.cache
def _program(call: Callable, static_items: tuple) -> Callable:
  static = dict(static_items)

  def run(args, cot, arrays, extra):
    out, vjp = jax.vjp(lambda *a: call(*a, arrays, static, *extra), *args)
    return out, vjp(cot)
  return jax.jit(run)


def timed(fn: Callable, inputs: cases.Inputs, repeats: int):
  """(result, median milliseconds of up to `repeats` runs after the first, which compiles;
  fewer, but at least two, once they have taken TIME_BUDGET_S)."""
  operands = (inputs.args, inputs.cot, inputs.arrays, inputs.extra)
  result = jax.block_until_ready(fn(*operands))
  times = []
  while len(times) < repeats and (len(times) < 2 or sum(times) < TIME_BUDGET_S):
    start = time.perf_counter()
    jax.block_until_ready(fn(*operands))
    times.append(time.perf_counter() - start)
  return result, 1e3 * statistics.median(times) if times else None


def _error_note(error: Exception) -> str:
  lines = str(error).strip().splitlines() or [""]
  return f"{type(error).__name__}: {lines[0][:300]}"


def check(call: Callable, inputs: cases.Inputs, oracle, tolerance: float,
          repeats: int) -> tuple[str, float | None, float | None, float | None, str]:
  """(result, values error, grads error, ms, note) of `call` on `inputs` against `oracle`
  ((output, gradients) in float32); a kernel's refusal at trace time ("cannot run: ...")
  reads "refused"."""
  try:
    (out, grads), ms = timed(program(call, inputs.static), inputs, repeats)
  except ValueError as error:
    if "cannot run:" in str(error):
      return "refused", None, None, None, str(error).split("cannot run:", 1)[1].strip()
    return "fail", None, None, None, _error_note(error)
  except Exception as error:  # pylint: disable=broad-except  (a compile error is a finding)
    return "fail", None, None, None, _error_note(error)
  values, grad_error = cases.scaled_error(out, oracle[0]), cases.scaled_error(grads, oracle[1])
  passed = values <= tolerance and grad_error <= tolerance
  note = "" if passed else f"over the tolerance {tolerance:g}"
  return ("pass" if passed else "fail"), values, grad_error, ms, note


def oracle_of(call: Callable, inputs: cases.Inputs):
  """(output, gradients) of `call` on `inputs` in float32, at the highest matmul precision."""
  f32 = cases.Inputs(*(cases.as_float32(x) for x in (inputs.args, inputs.cot)), inputs.static,
                     cases.as_float32(inputs.arrays), cases.as_float32(inputs.extra))
  with jax.default_matmul_precision("highest"):
    return timed(program(call, inputs.static), f32, 0)[0]


@dataclasses.dataclass(frozen=True)
class Settings:
  """What `run` covers: the shapes and options of the dense calls, the cases of the cache's
  step and of paged attention, dtypes, the kernels to run (None: all), interpret mode, timed
  runs per row."""
  shapes: Sequence[cases.Shape] = cases.SHAPES
  options: Sequence[cases.Option] = cases.OPTIONS
  step_shapes: Sequence[cases.StepShape] = cases.STEP_SHAPES
  cache_cases: Sequence[cases.StepCase] = cases.CACHE_CASES
  paged_cases: Sequence[cases.StepCase] = cases.PAGED_CASES
  dtypes: Sequence[str] = DTYPES
  implementations: Sequence[str] | None = None
  interpret: bool = False
  repeats: int = REPEATS


def _selected(found: list[Candidate], settings: Settings) -> list[Candidate]:
  if settings.implementations is None:
    return found
  return [c for c in found if (c.name or "None") in settings.implementations]


def _dense_refusal(candidate: Candidate, inputs: cases.Inputs) -> str | None:
  """The registry's refusal of the dense call by `candidate`'s kernel on its platform (for an
  interpreted kernel, its options only: its hardware is not asked for)."""
  if candidate.name is None:
    return None
  interpreted = candidate.platform != platforms.backend_platform()
  with dispatch.stage_accelerator_kernels() if interpreted else contextlib.nullcontext():
    verdict = attention.explain(*inputs.args, platform=candidate.platform, **inputs.static,
                                **inputs.arrays)
  if verdict.implementation == candidate.name:
    return None
  said = verdict.alternatives.get(candidate.name, "runs")
  return None if said == "runs" else said.removeprefix("refuses: ")


def _none_label(explain: Callable[[], Any]) -> str:
  """"None (<what it runs here>)" from `explain()`, or "None" where that cannot say."""
  try:
    return f"None ({explain().implementation})"
  except Exception:  # pylint: disable=broad-except  (a label only: the row itself reports)
    return "None"


def _dense_rows(settings: Settings, platform: str, report) -> None:
  """Each option at each shape and dtype: every runnable candidate, None last. A kernel that
  refuses even the plain call at the first shape (ring without a mesh; cuDNN in float32) gets
  one row per dtype."""
  found = _selected(candidates("dense", platform, settings.interpret), settings)
  for c in found:
    if c.skipped:
      report(Row(c.label, EVERY_OPTION, "-", "-", "skipped", note=c.skipped))
  named = [c for c in found if not c.skipped and c.name is not None]
  auto = [c for c in found if c.name is None]
  for dtype in settings.dtypes if settings.shapes else ():
    plain = cases.dense_inputs(settings.shapes[0], cases.PLAIN, dtype)
    todo = []
    for c in named:
      refused = _dense_refusal(c, plain)
      if refused is None:
        todo.append(c)
      else:
        report(Row(c.label, EVERY_OPTION, "-", dtype, "refused", note=refused))
    for shape in settings.shapes:
      for option in settings.options:
        _dense_case(todo, auto, cases.dense_inputs(shape, option, dtype), option.name,
                    option.dims(shape).label, dtype, platform, settings, report)


def _dense_case(named, auto, inputs, option, label, dtype, platform, settings, report):
  """The rows of one call: each of `named` (or its refusal), then `auto` (None): a row of its
  own where None stages per platform, else the row of the kernel it runs (the same program)."""
  oracle = _oracle_or_rows(cases.dense_call("reference"), inputs, named + auto, option, label,
                           dtype, report)
  if oracle is None:
    return
  done = {}
  for c in named:
    refused = _dense_refusal(c, inputs)
    row = (Row(c.label, option, label, dtype, "refused", note=refused) if refused else
           Row(c.label, option, label, dtype, *check(
               cases.dense_call(c.implementation), inputs, oracle,
               cases.tolerance(dtype, platform), settings.repeats)))
    done[c.name] = row
    report(row)
  for c in auto:
    explain = lambda **p: attention.explain(*inputs.args, **p, **inputs.static, **inputs.arrays)
    try:  # one pick on every platform: None runs that kernel's function, no platform branches
      pick = explain().implementation
      same = done.get(pick) if len({explain(platform=p).implementation
                                    for p in dispatch.PLATFORMS}) == 1 else None
    except Exception as error:  # pylint: disable=broad-except  (explain failing is a finding)
      report(Row("None", option, label, dtype, "fail", note=f"explain: {_error_note(error)}"))
      continue
    if same is not None and same.result != "refused":
      report(dataclasses.replace(same, implementation=f"None ({pick})",
                                 note=(same.note + "; " if same.note else "") +
                                 f"the program of {pick!r}"))
      continue
    report(Row(f"None ({pick})", option, label, dtype, *check(
        cases.dense_call(None), inputs, oracle, cases.tolerance(dtype, platform), settings.repeats)))


def _oracle_or_rows(call, inputs, todo, option, label, dtype, report):
  """The oracle's (output, gradients), or None after a failing row for each of `todo`."""
  if not todo:
    return None
  try:
    return oracle_of(call, inputs)
  except Exception as error:  # pylint: disable=broad-except
    for c in todo:
      report(Row(c.label, option, label, dtype, "fail", note=f"the oracle: {_error_note(error)}"))
    return None


def _step_rows(settings: Settings, platform: str, layout: str, report) -> None:
  """The cache's step ("cache") or paged attention ("paged"): None and each kernel by name."""
  step_cases = settings.cache_cases if layout == "cache" else settings.paged_cases
  make = cases.cache_inputs if layout == "cache" else cases.paged_inputs
  call = cases.cache_call if layout == "cache" else cases.paged_call
  oracle_call = call("reference") if layout == "cache" else cases.paged_oracle
  found = _selected(candidates(layout, platform, settings.interpret), settings)
  for c in found:
    if c.skipped:
      report(Row(f"{layout}: {c.label}", EVERY_OPTION, "-", "-", "skipped", note=c.skipped))
  runnable = [c for c in found if not c.skipped]
  for dtype in settings.dtypes:
    for shape in settings.step_shapes:
      for case in step_cases:
        inputs = make(shape, case, dtype)
        oracle = _oracle_or_rows(oracle_call, inputs, runnable, case.name, shape.label, dtype,
                                 report)
        for c in runnable if oracle is not None else ():
          name = f"{layout}: " + (c.label if c.name else _none_label(
              lambda: _step_explain(layout, inputs)))
          report(Row(name, case.name, shape.label, dtype, *check(
              call(c.implementation), inputs, oracle, cases.tolerance(dtype, platform),
              settings.repeats)))


def _step_explain(layout: str, inputs: cases.Inputs):
  """What None runs for the step (`flax_mha.cache.explain`)."""
  query = inputs.args[0]
  if layout == "cache":
    return cache_lib.explain(query, inputs.extra[0], **inputs.static, **inputs.arrays)
  lengths, table = inputs.extra
  before = cache_lib.PagedKVCache(inputs.args[1], inputs.args[2], table,
                                  lengths - query.shape[1])
  return cache_lib.explain(query, before, **inputs.static, **inputs.arrays)


def run(settings: Settings = Settings(), report: Callable[[Row], None] | None = None
        ) -> list[Row]:
  """Every row of the self-test on this process's default backend, each handed to `report`
  as it is made (a printer, say)."""
  rows: list[Row] = []

  def add(row: Row) -> None:
    rows.append(row)
    if report is not None:
      report(row)

  platform = platforms.backend_platform()
  _dense_rows(settings, platform, add)
  _step_rows(settings, platform, "cache", add)
  _step_rows(settings, platform, "paged", add)
  return rows


# ---- the table ----

WIDTH = 100  # columns of the terminal the table fits
# (name, width): a longer cell wraps within its column. The widths fit the dense rows' cells on
# one line (a step's longer options and shape wrap) and every result word by column WIDTH.
COLUMNS = (("implementation", 18), ("options", 14), ("shape", 26), ("dtype", 8),
           ("values", 7), ("grads", 7), ("ms", 6), ("result", 7))
INDENT = "    "  # of a row's note, on lines of its own below the row


def _number(x: float | None, form: str) -> str:
  return "-" if x is None else format(x, form)


def _milliseconds(ms: float | None) -> str:
  """Two decimals below 100 ms, fewer above: at most 6 characters up to 10^6 ms."""
  return _number(ms, ".2f" if ms is None or ms < 100 else ".1f" if ms < 1000 else ".0f")


def _fit(text: str, indent: str = "", first: str = "") -> list[str]:
  """`text` wrapped to WIDTH columns, its first line after `first`, the others after `indent`."""
  return textwrap.wrap(text, WIDTH, initial_indent=first, subsequent_indent=indent,
                       break_on_hyphens=False) or [first.rstrip()]


def format_row(row: Row) -> str:
  """The lines of one row of the table ("\n"-joined): each cell in its column, wrapped within it
  when longer (its further lines indented by two); then, with a note, `result: note` on lines of
  their own below, indented by INDENT. Only a row's first line starts in the first column."""
  cells = (row.implementation, row.options, row.shape, row.dtype, _number(row.values, ".1e"),
           _number(row.grads, ".1e"), _milliseconds(row.ms), row.result)
  wrapped = [textwrap.wrap(cell, width, subsequent_indent="  ", break_on_hyphens=False) or [""]
             for cell, (_, width) in zip(cells, COLUMNS)]
  lines = [" ".join(cell[i].ljust(width) if i < len(cell) else " " * width
                    for cell, (_, width) in zip(wrapped, COLUMNS)).rstrip()
           for i in range(max(map(len, wrapped)))]
  if row.note:  # the result column ends at WIDTH: no room beside it
    lines += _fit(f"{row.result}: {row.note}", INDENT, INDENT)
  return "\n".join(lines)


def header() -> str:
  return " ".join(name.ljust(width) for name, width in COLUMNS).rstrip()


def counts(rows: Sequence[Row]) -> dict[str, int]:
  """result -> rows, for the four results."""
  return {result: sum(row.result == result for row in rows)
          for result in ("pass", "fail", "refused", "skipped")}


def summary(rows: Sequence[Row], seconds: float) -> str:
  """The last line: "FAILED" when a row fails, "nothing tested" when none passes, else "ok"."""
  c = counts(rows)
  verdict = "FAILED" if c["fail"] else "nothing tested" if not c["pass"] else "ok"
  return (f"{verdict}: {c['pass']} pass, {c['fail']} fail, {c['refused']} refused, "
          f"{c['skipped']} skipped ({len(rows)} rows, {seconds:.0f} s)")


def exit_status(rows: Sequence[Row]) -> int:
  """1 when a row fails or none passes (nothing was tested), else 0."""
  c = counts(rows)
  return 1 if c["fail"] or not c["pass"] else 0


def _device() -> str:
  device = jax.devices()[0]
  return f"{platforms.backend_platform()} ({device.device_kind}, {jax.device_count()} devices)"


def parse_args(argv) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="python -m flax_mha.selftest",
      description="Check that every attention kernel that runs on this device compiles and "
                  "matches the oracle (values and gradients), and time it.")
  parser.add_argument("--quick", action="store_true",
                      help="the small shapes and a few options only (what CI runs on a CPU)")
  parser.add_argument("--interpret", action="store_true",
                      help="run the Pallas kernels of other platforms (triton, splash, "
                           "triton_decode) in interpret mode: semantics on a CPU, slowly")
  parser.add_argument("--dtypes", default=",".join(DTYPES),
                      help=f"comma-separated, from {', '.join(DTYPES)} (default: both)")
  parser.add_argument("--implementations", default=None,
                      help="comma-separated registry names (and None) to run; default: all")
  parser.add_argument("--repeats", type=int, default=REPEATS,
                      help=f"timed runs per row after compiling (default {REPEATS})")
  parser.add_argument("--json", metavar="PATH", help="also write the table as JSON to PATH")
  args = parser.parse_args(argv)
  args.dtypes = tuple(d for d in args.dtypes.split(",") if d)
  unknown = sorted(set(args.dtypes) - set(DTYPES))
  if unknown or not args.dtypes:
    parser.error(f"--dtypes takes {', '.join(DTYPES)}, got {unknown or 'none'}")
  if args.implementations is not None:
    args.implementations = tuple(n for n in args.implementations.split(",") if n)
    known = {"None", *registry.names(), *registry.names("cache"), *registry.names("paged")}
    if set(args.implementations) - known:
      parser.error(f"--implementations takes names from {sorted(known)}, got "
                   f"{sorted(set(args.implementations) - known)}")
  if args.repeats < 0:
    parser.error(f"--repeats must be >= 0, got {args.repeats}")
  return args


def settings_for(args: argparse.Namespace) -> Settings:
  """The Settings a command line asks for."""
  quick = args.quick
  pick = lambda items: tuple(x for x in items if x.quick or not quick)
  return Settings(shapes=cases.SHAPES[:1] if quick else cases.SHAPES,
                  options=pick(cases.OPTIONS),
                  step_shapes=cases.STEP_SHAPES[:1] if quick else cases.STEP_SHAPES,
                  cache_cases=pick(cases.CACHE_CASES), paged_cases=pick(cases.PAGED_CASES),
                  dtypes=args.dtypes, implementations=args.implementations,
                  interpret=args.interpret, repeats=args.repeats)


def main(argv: Sequence[str] | None = None) -> int:
  """The command line: print the table and a summary; 1 when any row fails or none passes."""
  args = parse_args(argv)
  start = time.perf_counter()
  tolerances = ", ".join(f"{d} {cases.tolerance(d, platforms.backend_platform()):g}"
                         for d in args.dtypes)
  print("\n".join(_fit(f"flax_mha self-test on {_device()}, jax {jax.__version__}", "  ")))
  print(header())
  rows = run(settings_for(args), report=lambda row: print(format_row(row), flush=True))
  seconds = time.perf_counter() - start
  print("\n".join(_fit(f"values, grads: max |error| / max |oracle| (float32 oracle); tolerance "
                       f"{tolerances}", "  ")))
  print(summary(rows, seconds))
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(dict(device=_device(), jax=jax.__version__, quick=args.quick,
                     interpret=args.interpret, seconds=seconds, counts=counts(rows),
                     rows=[dataclasses.asdict(row) for row in rows]), f, indent=1)
  return exit_status(rows)
