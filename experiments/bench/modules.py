"""Module speed (CPU): flax_mha's attention modules against torch.nn.MultiheadAttention.

  python -m experiments.bench.modules            # N 128, 512, 2048 -> docs/benchmark_modules_cpu.md
  python -m experiments.bench.modules --quick    # N 128, 512; 2 turns of 3 rounds
  python -m experiments.bench.modules --ns 512 --turns 1 --entries self --masks causal
  python -m experiments.bench.modules --part pieces   # projections vs attention, JAX and torch
  python -m experiments.bench.modules --part hlo      # transposes and copies XLA compiles in

D = 512, H = 8 heads (K = V = 64), float32, B·N = 4096 (B = 4096 // N), plain and causal; the
forward, and the forward+backward: the output's sum (the loss) and its gradient with respect to
the inputs and every parameter (JAX: `jax.value_and_grad`, so that XLA computes the output as
torch does; torch: `.sum().backward()`). Two entries, each against torch.nn.MultiheadAttention(D, H,
batch_first=True):
  self   flax_mha.SelfAttention (linen) and flax_mha.nn.nnx.SelfAttention on x [B, N, D];
         torch called as (x, x, x), the one tensor thrice, as its fast path asks
  cross  flax_mha.MultiHeadAttention (linen) and flax_mha.nn.nnx.MultiHeadAttention on queries
         x [B, N, D] and keys/values y [B, N, D] (S = T = N); torch called as (x, y, y)
All systems hold the same weights (NumPy-seeded, in flax's layout; `to_torch_state` packs them
into torch's), so they compute the same function: each worker reports a probe of its output
and input gradient and the script refuses to print figures where they differ.

JAX: the module's apply (linen) or split/merge around it (NNX) under `jax.jit`, the
implementation `None` picks (named in the table, from `flax_mha.explain`). torch: eager (no
torch.compile), `need_weights=False`; a causal call passes `attn_mask` (torch's docs require it
beside `is_causal=True`) and `is_causal=True`. torch 2.13 has two forward paths, both timed and
the faster one reported (the table names it):
  native  eval mode under `torch.no_grad()`, self-attention only: the fast path,
          `torch._native_multi_head_attention`, which on CPU multiplies out the [B, H, T, S]
          scores (bmm, softmax or masked softmax, bmm) and takes the boolean causal mask, not the
          `is_causal` hint
  SDPA    the fast path off (`torch.backends.mha.set_fastpath_enabled(False)`) under
          `torch.no_grad()`: `F.multi_head_attention_forward`, which with need_weights=False
          drops the mask for `is_causal=True` and calls scaled_dot_product_attention (its CPU
          flash kernel); a float mask is passed, so the module converts none per call
The forward+backward can only take the second path (grad enabled), as in training.

Protocol (experiments.bench.timing): for each (entry, N, mask) the three systems run in a process
each, the processes taking turns --turns times (the order reversed every other turn); in its
process a system is called twice untimed, then its calls (forward, forward+backward, and for
torch both forward paths) are timed in turn for --rounds rounds. Cells are medians over all
rounds of all turns; the ratio is torch's median over ours (above 1: ours is faster). JAX and
torch never share a process (torch is imported only in torch's workers).

`--part pieces` times the linen SelfAttention's pieces beside the whole module, in JAX and in
torch, each system's pieces round-robin in its own processes (`experiments.bench.module_pieces`):
where a module's time goes, and the most the projections leave to win. `--part hlo` compiles
the linen SelfAttention's forward and forward+backward for this CPU (never running them), and
the same written out head-major, and counts the products, transposes, copies and slices in the
programs, with the bytes they write (`experiments.bench.hlo_bytes.hlo_counts`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads its OpenMP runtime

import jax
import numpy as np

from experiments.bench import module_pieces
from experiments.bench import timing
from experiments.bench.module_cases import (ENTRIES, MASKS, NAMES, SYSTEMS, inputs,
                                            jax_callables, median_ms, picks, run_cases,
                                            torch_callables)

def time_case(case: str, *, d: int, h: int, tokens: int, rounds: int) -> dict:
  """Worker: {'seconds': {call: [seconds...]}, 'probe': ...} of one system at one shape;
  case = 'entry,system,N,causal' (entry 'pieces': module_pieces' `jax_pieces` or
  `torch_pieces`, no probe)."""
  entry, system, n, causal = case.split(",")
  n, causal = int(n), bool(int(causal))
  xs = inputs(entry, max(1, tokens // n), n, d)
  if entry == "pieces":  # system 'jax' or 'torch'
    calls = (module_pieces.torch_pieces if system == "torch" else module_pieces.jax_pieces)(
        d, h, causal, xs[0])
    return dict(seconds=timing.round_robin(calls, rounds, rotate=True))
  if system == "torch":
    calls, probe = torch_callables(entry, d, h, causal, xs)
  else:
    calls, probe = jax_callables(entry, system, d, h, causal, xs)
  return dict(seconds=timing.round_robin(calls, rounds, rotate=True), probe=probe)


def agree(probes: dict[str, dict], tol: float = 1e-3) -> None:
  """Raises where a system's probe (output, input gradient) differs from torch's by more than
  tol relative to torch's largest value."""
  want = probes["torch"]
  for system, probe in probes.items():
    for key in ("out", "grad"):
      a, b = np.asarray(probe[key]), np.asarray(want[key])
      if np.max(np.abs(a - b)) > tol * max(1.0, np.max(np.abs(b))):
        raise RuntimeError(f"{system} and torch compute different functions ({key}): "
                           f"{a.tolist()} vs {b.tolist()}")


def measure(entry: str, n: int, causal: bool, args) -> dict:
  """call -> ms medians per system at one shape (each system in its own processes, see the
  docstring), after checking that the systems agree; 'torch fwd' is its faster forward path,
  named under 'torch path'."""
  reports = run_cases({system: f"{entry},{system},{n},{int(causal)}" for system in SYSTEMS},
                      args)
  agree({system: report[0]["probe"] for system, report in reports.items()})
  ms = {system: median_ms(report) for system, report in reports.items()}
  paths = {call.split()[1]: t for call, t in ms["torch"].items() if call.startswith("fwd ")}
  fastest = min(paths, key=paths.get)
  ms["torch"].update({"fwd": paths[fastest], "path": fastest, "paths": paths})
  return ms


def speed(args) -> dict:
  """(entry, N, mask) -> measure's ms, printing each shape's line as it is measured."""
  results = {}
  for entry in args.entries:
    for n in args.ns:
      for mask in args.masks:
        ms = measure(entry, n, MASKS[mask], args)
        results[entry, n, mask] = ms
        print(f"{entry} N={n} {mask}: " + ", ".join(
            f"{system} {ms[system]['fwd']:.1f}/{ms[system]['fwd_bwd']:.1f} ms"
            for system in SYSTEMS) + f" (torch forward: {ms['torch']['path']})", flush=True)
  return results


def table(results: dict, entry: str, system: str, args) -> list[str]:
  """Markdown: one row per (N, mask) of one module against torch."""
  lines = ["| N | B | mask | kernel | torch fwd path | torch fwd ms | ours fwd ms | torch / ours "
           "fwd | torch fwd+bwd ms | ours fwd+bwd ms | torch / ours fwd+bwd |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for (e, n, mask), ms in results.items():
    if e != entry:
      continue
    b = max(1, args.tokens // n)
    torch_ms, ours = ms["torch"], ms[system]
    lines.append(
        f"| {n} | {b} | {mask} | `{picks(n, b, args.heads, args.d // args.heads, MASKS[mask])}` "
        f"| {torch_ms['path']} | {torch_ms['fwd']:.1f} | {ours['fwd']:.1f} | "
        f"{torch_ms['fwd'] / ours['fwd']:.2f} | {torch_ms['fwd_bwd']:.1f} | "
        f"{ours['fwd_bwd']:.1f} | {torch_ms['fwd_bwd'] / ours['fwd_bwd']:.2f} |")
  return lines


def setup(results: dict, args) -> list[str]:
  """Markdown: what ran, the load on the machine, and both torch forward paths where there
  were two."""
  load = lambda when: "{:.1f}, {:.1f}, {:.1f}".format(*args.load[when])
  lines = [f"{jax.devices()[0].device_kind}, {os.cpu_count()} cores (load average over 1, 5, 15 "
           f"minutes: {load('start')} at the start, {load('end')} at the end); D={args.d}, "
           f"H={args.heads}, float32, B·N={args.tokens}; turns: {args.turns}, rounds per turn: "
           f"{args.rounds}; each system in its own process, medians. Ratios above 1: ours is "
           "faster. `kernel`: what `implementation=None` runs inside the module "
           "(`flax_mha.explain`).",
           "", "torch's two forward paths (ms; the faster one is in the tables):", "",
           "| entry | N | mask | native | SDPA |", "|---|---|---|---|---|"]
  for (entry, n, mask), ms in results.items():
    paths = ms["torch"]["paths"]
    cell = lambda path: f"{paths[path]:.1f}" if path in paths else "—"
    lines.append(f"| {entry} | {n} | {mask} | {cell('native')} | {cell('SDPA')} |")
  return lines


# Run size -> (D, H, tokens B·N, N, entries, masks, turns, rounds). The smoke run starts three
# workers (one entry, one mask) so that it stays well under a minute on 2 cores;
# tests/test_bench_modules.py runs every entry's workers in-process.
SIZES = {
    "full": (512, 8, 4096, (128, 512, 2048), ENTRIES, tuple(MASKS), 3, 4),
    "quick": (512, 8, 4096, (128, 512), ENTRIES, tuple(MASKS), 2, 3),
    "smoke": (32, 4, 64, (16,), ("self",), ("causal",), 1, 1),
}


def _choose(parser, flag: str, given: str | None, known, default) -> list[str]:
  """The comma-separated names of `given` (each one of `known`), or `default`."""
  if given is None:
    return list(default)
  names = given.split(",")
  unknown = [name for name in names if name not in known]
  if unknown:
    parser.error(f"{flag}: unknown {unknown}, choose from {list(known)}")
  return names


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  size = parser.add_mutually_exclusive_group()
  size.add_argument("--quick", action="store_true", help="N 128 and 512, 2 turns of 3 rounds")
  size.add_argument("--smoke", action="store_true",
                    help="tiny shapes, one round: that the command runs, no figures written")
  parser.add_argument("--ns", default=None, help="these N, e.g. 512 (ignored by --smoke)")
  parser.add_argument("--turns", type=int, default=None,
                      help="processes per system, in turn (ignored by --smoke)")
  parser.add_argument("--rounds", type=int, default=None,
                      help="timed rounds per process (ignored by --smoke)")
  parser.add_argument("--entries", default=None,
                      help="self, cross or both (default both; --smoke: self)")
  parser.add_argument("--masks", default=None,
                      help="plain, causal or both (default both; --smoke: causal)")
  parser.add_argument("--part", choices=("speed", "pieces", "hlo"), default="speed",
                      help="the modules against torch; the self-attention's pieces (module, "
                      "projections, attention, out projection) timed in JAX and torch; or what "
                      "XLA compiles the linen module to (compiled, never run)")
  parser.add_argument("--out", default=None, help="markdown path (default: speed "
                      "docs/benchmark_modules_cpu.md; pieces and hlo print only)")
  parser.add_argument("--d", type=int, default=None, help=argparse.SUPPRESS)  # a worker's D
  parser.add_argument("--heads", type=int, default=None, help=argparse.SUPPRESS)
  parser.add_argument("--tokens", type=int, default=None, help=argparse.SUPPRESS)
  parser.add_argument("--time-case", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  d, heads, tokens, ns, entries, masks, turns, rounds = SIZES[
      "smoke" if args.smoke else "quick" if args.quick else "full"]
  if args.smoke and not args.time_case:  # a smoke run keeps its tiny sizes
    args.ns = args.turns = args.rounds = None
  args.d, args.heads, args.tokens = args.d or d, args.heads or heads, args.tokens or tokens
  args.turns, args.rounds = args.turns or turns, args.rounds or rounds
  if args.time_case:
    print(json.dumps(time_case(args.time_case, d=args.d, h=args.heads, tokens=args.tokens,
                               rounds=args.rounds)))
    return
  args.ns = [int(n) for n in args.ns.split(",")] if args.ns else list(ns)
  args.entries = _choose(parser, "--entries", args.entries, ENTRIES, entries)
  args.masks = _choose(parser, "--masks", args.masks, MASKS, masks)
  if args.part != "speed":
    title = ("The self-attention in pieces" if args.part == "pieces" else
             "What XLA compiles the linen SelfAttention to")
    timing.write_report(f"{title} (CPU, float32)", _command(), [title],
                        {title: lambda: _part_table(args)}, args.out,
                        args.smoke or args.out is None)
    return
  args.load = {"start": os.getloadavg()}
  results = speed(args)
  args.load["end"] = os.getloadavg()
  parts = ["Setup"] + [NAMES[entry, system] for entry in args.entries
                       for system in SYSTEMS[1:]]
  sections = {"Setup": lambda: setup(results, args)}
  for entry in args.entries:
    for system in SYSTEMS[1:]:
      sections[NAMES[entry, system]] = lambda e=entry, s=system: table(results, e, s, args)
  timing.write_report("Attention modules against torch.nn.MultiheadAttention (CPU, float32)",
                      _command(), parts, sections, args.out or "docs/benchmark_modules_cpu.md",
                      args.smoke)


def _part_table(args) -> list[str]:
  """The markdown of --part pieces or --part hlo (`experiments.bench.module_pieces`)."""
  return (module_pieces.pieces_table if args.part == "pieces" else module_pieces.hlo_table)(args)


def _command() -> str:
  """This run's command line, as the report cites it."""
  return " ".join(["python -m experiments.bench.modules", *sys.argv[1:]])


if __name__ == "__main__":
  main()
