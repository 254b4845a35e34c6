"""What confining non-finite inputs costs (`flax_mha.confine_nonfinite`), on the CPU, float32.

  python -m experiments.bench.confine --ds 64 --ns 128,2048   # -> docs/benchmark_cpu_confine.md
  python -m experiments.bench.confine --smoke                 # seconds: a tiny shape, no file

At each shape (H=8, B·N = 4096, causal and not), `dot_product_attention` with
`implementation=None` (the default: no isfinite passes, no extra value column, no NaN marking)
and with `implementation=flax_mha.confine_nonfinite()` (the same kernel on confined inputs) are
timed round-robin in one process, forward and forward+backward, so that the machine's drift
reaches both alike; `--alternations` such processes in turn
(`experiments.bench.timing.isolated`); medians over every round.
"""

from __future__ import annotations

import argparse
import json
import statistics

import jax
import jax.numpy as jnp

import flax_mha
from experiments.bench import timing
from flax_mha import attention as attention_lib

SYSTEMS = ("None", "confine_nonfinite()")


def _callables(q, k, v, causal):
  """(the kernel None picks, {(system, 0 forward / 1 forward+backward): call of no arguments})."""
  name = attention_lib.default_implementation(q, k, v, None, None, is_causal=causal,
                                              dropout_rate=0.0)
  implementations = {"None": None, "confine_nonfinite()": flax_mha.confine_nonfinite()}
  calls = {}
  for system, implementation in implementations.items():
    fn = lambda q, k, v, i=implementation: flax_mha.dot_product_attention(
        q, k, v, is_causal=causal, implementation=i)
    loss = lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v))
    calls[system, 0] = timing.blocking(fn, q, k, v)
    calls[system, 1] = timing.blocking(timing.qkv_grad(loss), q, k, v)
  return name, calls


def time_case(d, n, causal, rounds, tokens):
  """Worker: {"kernel": name, system: [[fwd seconds], [fwd+bwd seconds]]} at one shape."""
  q, k, v = (jax.random.normal(key, (max(1, tokens // n), n, 8, d), jnp.float32)
             for key in jax.random.split(jax.random.key(0), 3))
  name, calls = _callables(q, k, v, causal)
  times = timing.round_robin(calls, rounds, rotate=True)
  return {"kernel": name, **{s: [times[s, 0], times[s, 1]] for s in SYSTEMS}}


def table(grid, args) -> list[str]:
  lines = [f"{args.alternations} processes of {args.rounds} rounds each, medians; ms forward / "
           "forward+backward.", "",
           "| D | N | causal | kernel | `None` | `confine_nonfinite()` | confined / `None` |",
           "|---|---|---|---|---|---|---|"]
  for d, n, causal in grid:
    extra = ["--shape", f"{d},{n},{int(causal)}", "--rounds", str(args.rounds),
             "--tokens", str(args.tokens)]
    reports = timing.isolated("experiments.bench.confine", ["both"], turns=args.alternations,
                              extra_args=extra)["both"]
    ms = {s: [1e3 * statistics.median([t for r in reports for t in r[s][i]]) for i in (0, 1)]
          for s in SYSTEMS}
    (a_fwd, a_all), (b_fwd, b_all) = ms["None"], ms["confine_nonfinite()"]
    lines.append(f"| {d} | {n} | {causal} | {reports[0]['kernel']} | {a_fwd:.1f} / {a_all:.1f} "
                 f"| {b_fwd:.1f} / {b_all:.1f} | {b_fwd / a_fwd:.3f} / {b_all / a_all:.3f} |")
    print(lines[-1], flush=True)
  return lines


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="a tiny shape, one round, no file")
  parser.add_argument("--ds", default="64", help="head dims D, e.g. 64,128")
  parser.add_argument("--ns", default="128,2048", help="lengths N, e.g. 128,2048")
  parser.add_argument("--rounds", type=int, default=3, help="timed rounds per process")
  parser.add_argument("--alternations", type=int, default=3, help="processes per shape")
  parser.add_argument("--tokens", type=int, default=4096, help="B·N")
  parser.add_argument("--out", default="docs/benchmark_cpu_confine.md")
  parser.add_argument("--time-case", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--shape", default=None, help=argparse.SUPPRESS)  # "D,N,causal"
  args = parser.parse_args()
  if args.time_case:
    d, n, causal = map(int, args.shape.split(","))
    print(json.dumps(time_case(d, n, bool(causal), args.rounds, args.tokens)))
    return
  if args.smoke:
    args.ds, args.ns, args.rounds, args.alternations, args.tokens = "16", "32", 1, 1, 64
  grid = [(int(d), int(n), c) for d in args.ds.split(",") for n in args.ns.split(",")
          for c in (False, True)]
  command = "python -m experiments.bench.confine --ds {} --ns {}".format(args.ds, args.ns)
  text = "\n".join(["# What confining non-finite inputs costs", "",
                    f"`{command}` (see its docstring).", "", *table(grid, args), ""])
  if not args.smoke:  # a smoke run writes no report of the repository's
    with open(args.out, "w") as f:
      f.write(text)


if __name__ == "__main__":
  main()
