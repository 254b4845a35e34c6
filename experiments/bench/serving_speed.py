"""Continuous batching (`flax_mha.serving.serve`) against one static batch
(`flax_mha.models.decoding.generate`) on work both can do, on the CPU, float32.

  python -m experiments.bench.serving_speed                 # prints the tables
  python -m experiments.bench.serving_speed --part trips    # what the loop's pieces cost
  python -m experiments.bench.serving_speed --smoke         # seconds: a tiny model

The model is `experiments.bench.hf`'s: a 124M Llama-shaped checkpoint with random weights, made
by transformers once in a scratch directory, loaded with `flax_mha.models.hf.load` (float32).
The work: 16 prompts of 120 random tokens, all given at the start, 64 new greedy tokens each.

Parts:
  compare  `decoding.generate` with the 16 prompts in one batch, and `serving.serve` with
           batch_size 16 and 8 (pages of 16 tokens, a pool of the rows' pages, `serve`'s
           defaults otherwise), each in a process of its own, the processes taking turns
           (`experiments.bench.timing.isolated`); a worker runs once untimed (compilation),
           then `rounds` timed runs. Tokens/s over the median of all turns; every serve's
           greedy tokens must equal generate's.
  trips    where the loop's time goes, in one process, round-robin: a prefill piece of one row
           at 128 and at 512 tokens (a 120-token prompt padded to each), four such rows in one
           [4, 128] call, the model's decode step of 16 rows holding 152 tokens (the prompt and
           half the new ones) over the paged pool and over a contiguous cache, and paged
           attention alone (one layer's shapes) with the decode kernel's pages walked in 1 and
           in 2 partitions (`decode.PAGED_SPLITS`); then the runs of the loop (the host's
           looks) and trips that `serve` makes at batch 16 and 8.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import statistics
import sys
import tempfile

import numpy as np

from experiments.bench import timing

PROMPTS, PROMPT, NEW, PAGE = 16, 120, 64, 16


def _sizes(smoke: bool) -> tuple[int, int, int]:
  """(prompts, prompt tokens, new tokens)."""
  return (4, 12, 4) if smoke else (PROMPTS, PROMPT, NEW)


def _cases(count: int) -> list[str]:
  """generate with every prompt in one batch; serve with as many rows, and half as many."""
  return [f"generate:{count}", f"serve:{count}", f"serve:{count // 2}"]


def _prompts(count: int, length: int, vocab: int) -> np.ndarray:
  return np.random.default_rng(0).integers(3, vocab, (count, length)).astype(np.int32)


def _serve(model, params, prompts, new: int, batch: int):
  """`serving.serve` of the prompts with `batch` rows and a pool of their pages."""
  from flax_mha import serving  # pylint: disable=import-outside-toplevel
  pages = batch * -(-(prompts.shape[1] + new) // PAGE)
  return serving.serve(model, params, list(prompts), new, batch_size=batch, page_size=PAGE,
                       num_pages=pages)[0]


def _time_case(directory, case: str, rounds: int, smoke: bool) -> dict:
  """A worker's report: the case once untimed, then `rounds` timed; its tokens."""
  from flax_mha.models import decoding, hf  # pylint: disable=import-outside-toplevel
  model, params = hf.load(directory)
  count, length, new = _sizes(smoke)
  prompts = _prompts(count, length, model.config.vocab_size)
  system, batch = case.split(":")
  if system == "generate":
    run = lambda: np.asarray(decoding.generate(model, params, (prompts,), prompts,
                                               max_new_tokens=new)).tolist()
  else:
    run = lambda: _serve(model, params, prompts, new, int(batch))
  tokens, seconds = timing.once_then_timed(run, rounds)
  return dict(seconds=seconds, tokens=tokens)


def machine() -> str:
  """The CPU's model name, its cores and whether it has AVX-512 (the docs' two machine types)."""
  with open("/proc/cpuinfo") as f:
    info = f.read()
  name = next((line.split(":", 1)[1].strip() for line in info.splitlines()
               if line.startswith("model name")), "unknown CPU")
  avx512 = "avx512f" in info
  return (f"{name}, {os.cpu_count()} cores, "
          f"{'with' if avx512 else 'without'} AVX-512 (the {'faster' if avx512 else 'slower'} "
          "machine type)")


def compare(directory, rounds: int, turns: int, smoke: bool) -> list[str]:
  extra = ["--checkpoint", str(directory), "--rounds", str(rounds)] + (
      ["--smoke"] if smoke else [])
  count, length, new = _sizes(smoke)
  cases = _cases(count)
  reports = timing.isolated("experiments.bench.serving_speed", cases, turns=turns,
                            extra_args=extra)
  seconds = timing.pooled_seconds(reports)
  want = reports[cases[0]][0]["tokens"]
  rate = lambda case: count * new / statistics.median(seconds[case])
  rows = ["| system | rows | seconds (median) | tokens/s | vs generate | same tokens |",
          "|---|---|---|---|---|---|"]
  for case in cases:
    system, batch = case.split(":")
    same = all(r["tokens"] == want for r in reports[case])
    assert same, f"{case} answered differently from generate"
    rows.append(f"| `{'decoding.generate' if system == 'generate' else 'serving.serve'}` | "
                f"{batch} | {statistics.median(seconds[case]):.2f} | {rate(case):.1f} | "
                f"**{rate(case) / rate(cases[0]):.2f}x** | yes |")
  return [f"{count} prompts of {length} random tokens, {new} new greedy tokens each, all given "
          f"at the start; timed runs: {turns} turn(s) of {rounds} a process. Machine: "
          f"{machine()}.",
          "", *rows]


def _pieces(model, params, batch: int, length: int, new: int) -> dict:
  """name -> a call of no arguments running one of the loop's pieces (see `trips`)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from flax_mha import cache as cache_lib  # pylint: disable=import-outside-toplevel
  from flax_mha import serving  # pylint: disable=import-outside-toplevel
  from flax_mha.cache import paged  # pylint: disable=import-outside-toplevel
  from flax_mha.kernels import decode  # pylint: disable=import-outside-toplevel
  per_row = -(-(length + new) // PAGE)
  server = serving.Server(model, params, batch_size=batch, page_size=PAGE,
                          num_pages=batch * per_row, max_length=length + new)
  table = jnp.arange(batch * per_row, dtype=jnp.int32).reshape(batch, per_row)
  held = length + new // 2  # the decode steps' tokens held per row
  pool = tuple(c.with_table(table) for c in server.runner.cache)
  rolled = tuple(dataclasses.replace(c, length=jnp.full((batch,), held, jnp.int32))
                 for c in pool)
  contiguous = tuple(
      dataclasses.replace(c, length=jnp.full((batch,), held, jnp.int32),
                          positions=jnp.where(jnp.arange(c.capacity) < held,
                                              jnp.arange(c.capacity), -1)[None].repeat(batch, 0))
      for c in model.apply(params, jnp.zeros((batch, 1), jnp.int32), length + new,
                           method="init_cache"))

  @functools.partial(jax.jit, static_argnums=(0, 1))
  @cache_lib.caller_makes_room
  def run(rows, size, caches, positions):
    if rows == 1:  # as the loop feeds a piece: row 0's view, the pool whole
      caches = tuple(c.take_row(0) for c in caches)
    tokens = jnp.ones((rows, size), jnp.int32)
    return model.apply(params, tokens, caches, positions, method="logits")[0]

  piece = lambda rows, size: jnp.broadcast_to(
      jnp.where(jnp.arange(size) < length, jnp.arange(size), -1), (rows, size))
  step = jnp.full((batch, 1), held, jnp.int32)
  fns = {f"prefill piece [1, {size}]": (lambda size: lambda: run(1, size, pool, piece(1, size)))(
             size) for size in (128, 512)}
  fns["prefill pieces of 4 rows in one call [4, 128]"] = lambda: run(
      4, 128, tuple(_rows(c, 4) for c in pool), piece(4, 128))
  fns[f"decode step [{batch}, 1], paged pool"] = lambda: run(batch, 1, rolled, step)
  fns[f"decode step [{batch}, 1], contiguous cache"] = lambda: run(batch, 1, contiguous, step)
  layer = rolled[0]
  query = jnp.ones((batch, 1, model.config.num_heads, layer.k_pages.shape[-1]))
  for splits in (1, 2):
    decode.PAGED_SPLITS = splits  # read when traced: a jit of its own per setting
    attend = jax.jit(lambda q, c: paged.positioned_paged_attention(
        q, c.k_pages, c.v_pages, c.page_indices, c.length[:, None] - 1, c.length))
    jax.block_until_ready(attend(query, layer))
    fns[f"paged attention alone, one layer, {splits} partition(s)"] = functools.partial(
        attend, query, layer)
  decode.PAGED_SPLITS = 1
  return {name: (lambda fn: lambda: jax.block_until_ready(fn()))(fn) for name, fn in fns.items()}


def _rows(cache, rows: int):
  """The first `rows` rows of a paged cache (the whole pool)."""
  return dataclasses.replace(cache, page_indices=cache.page_indices[:rows],
                             length=cache.length[:rows])


def _looks(model, params, prompts, new: int, batch: int) -> list[tuple[int, int]]:
  """(trips, decode steps so far) of each run of the loop that `serve` makes (a `Server` as
  `serve` builds it: every request up front, 64 trips a run at most)."""
  from flax_mha import serving  # pylint: disable=import-outside-toplevel
  server = serving.Server(model, params, batch_size=batch, page_size=PAGE,
                          num_pages=batch * -(-(prompts.shape[1] + new) // PAGE),
                          max_length=prompts.shape[1] + new, segment_steps=64)
  looks, run = [], server.runner.run

  def counted(pool, waiting):
    rows = run(pool, waiting)
    looks.append((int(rows["trips"]), int(rows["step"])))
    return rows
  server.runner.run = counted
  for prompt in prompts:
    server.submit(prompt, new)
  server.run()
  return looks


def trips(directory, rounds: int, smoke: bool) -> list[str]:
  """The per-trip costs (see the module docstring), timed round-robin in this process."""
  from flax_mha.models import hf  # pylint: disable=import-outside-toplevel
  model, params = hf.load(directory)
  count, length, new = _sizes(smoke)
  times = timing.round_robin(_pieces(model, params, count, length, new), rounds, warmups=1,
                             rotate=True)
  rows = ["| piece | ms (median) |", "|---|---|"]
  rows += [f"| {name} | {1e3 * statistics.median(t):.1f} |" for name, t in times.items()]
  prompts = _prompts(count, length, model.config.vocab_size)
  runs = ["| `serve` rows | runs of the loop | trips | decode steps |", "|---|---|---|---|"]
  for batch in (count, count // 2):
    looks = _looks(model, params, prompts, new, batch)
    runs.append(f"| {batch} | {len(looks)} | {sum(t for t, _ in looks)} | {looks[-1][1]} |")
  return [f"Machine: {machine()}; {rounds} rounds.", "", *rows, "",
          f"{count} prompts of {length} tokens, {new} new tokens each, given at the start:", "",
          *runs]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", action="append", choices=("compare", "trips"))
  parser.add_argument("--smoke", action="store_true", help="a tiny model, nothing written")
  parser.add_argument("--out", default=None, help="a markdown file for the report (default: "
                      "printed only; docs/serving_cpu.md quotes it)")
  parser.add_argument("--checkpoint", default=None, help="the model's directory (default: a "
                      "scratch one, made by transformers)")
  parser.add_argument("--rounds", type=int, default=None, help=argparse.SUPPRESS)
  parser.add_argument("--time-case", default=None, help=argparse.SUPPRESS)  # a worker's case
  args = parser.parse_args()
  rounds, turns = (1, 1) if args.smoke else (2, 2)
  if args.time_case:
    print(json.dumps(_time_case(args.checkpoint, args.time_case, args.rounds, args.smoke)))
    return
  from experiments.bench import hf  # pylint: disable=import-outside-toplevel
  scratch = (tempfile.mkdtemp(prefix="flax_mha_bench_") if args.smoke else
             os.path.join(tempfile.gettempdir(), "flax_mha_bench_llama"))  # hf's, kept
  directory = pathlib.Path(args.checkpoint or scratch)
  hf.make_checkpoint(directory, args.smoke)
  sections = {"compare": lambda: compare(directory, rounds, turns, args.smoke),
              "trips": lambda: trips(directory, 3 if args.smoke else 5, args.smoke)}
  timing.write_report("Continuous batching against one static batch (CPU, float32)",
                      "python -m experiments.bench.serving_speed", args.part or ["compare"],
                      sections, args.out, args.smoke or args.out is None)


if __name__ == "__main__":
  main()
