"""What XLA:CPU makes of bfloat16: a weight product in the forms a model can hand it, by rows,
and a KV cache's write.

  python -m experiments.bench.bf16_cpu              # -> docs/benchmark_bf16_cpu.md
  python -m experiments.bench.bf16_cpu --smoke      # seconds: small shapes, nothing written

Products: x [M, 2048] times weights [2048, 8192] (an MLP's shape), M rows (a decode step's
batch; a prefill's batch times length). Forms:
- float32: float32 operands (a float32 model; or a bfloat16 one's float32 copy of the weights,
  `flax_mha.precision.loop_params`);
- bf16->f32: bfloat16 operands, float32 result (`preferred_element_type`), cast to bfloat16
  after: `flax_mha.precision.dot_general`'s form;
- bf16->bf16: bfloat16 operands and result (flax's `Dense(dtype=bfloat16)` without it);
- one row only, two more ways to reach YNNPACK: padded to 8 rows (bf16->f32), and the product
  written as a multiply and a sum over the 2048 (bfloat16 read, float32 arithmetic).
Cache writes: one token per row written into keys [8, 4, 1024, 64] at each row's slot, as
`flax_mha.cache.kv.update` writes a decode step's keys: a float32 scatter, a bfloat16 one, and
the bfloat16 one written as its bits (`flax_mha.precision.set_at`).

Each case runs `STEPS` times in a loop, behind a `lax.cond` as a decoding loop's step is
(`flax_mha.models.decoding`): the loop reuses its buffers, and XLA cannot hoist a conversion
of the weights out of it. Each case in a process of its own, the processes taking turns
(experiments.bench.timing); ms per operation, the median over all rounds of all turns. The hlo
section counts, in each case's compiled loop, the converts (and of them those of the weights'
or the cache's shape), the YNNPACK fusions and the dots XLA runs itself
(`experiments.bench.hlo_bytes.converts`).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics

import numpy as np

from experiments.bench import timing

IN, OUT = 2048, 8192
SMOKE_IN, SMOKE_OUT = 64, 96
ROWS = (1, 8, 32, 128)
FORMS = ("float32", "bf16->f32", "bf16->bf16", "pad8", "multiply-sum")
ONE_ROW = ("pad8", "multiply-sum")  # forms for M = 1 only
WRITES = ("float32 scatter", "bfloat16 scatter", "bfloat16 bits")
CACHE, SMOKE_CACHE = (8, 4, 1024, 64), (2, 2, 16, 8)  # [B, G, C, K]
STEPS = 16


def product(form: str):
  """The product x [M, I] · w [I, O] -> [M, O] of `form`, in the operands' dtype."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax import lax  # pylint: disable=import-outside-toplevel
  f32 = jnp.float32
  if form in ("float32", "bf16->bf16"):
    return lambda x, w: x @ w
  if form == "bf16->f32":
    return lambda x, w: lax.dot(x, w, preferred_element_type=f32).astype(x.dtype)
  if form == "pad8":
    return lambda x, w: lax.dot(jnp.pad(x, ((0, 7), (0, 0))), w,
                                preferred_element_type=f32)[:1].astype(x.dtype)
  return lambda x, w: (x[0].astype(f32)[:, None] * w.astype(f32)).sum(0)[None].astype(x.dtype)


def cache_write(form: str):
  """The write of keys [B, 1, G, K] into a cache [B, G, C, K] at slots [B] of `form`."""
  from flax_mha import precision  # pylint: disable=import-outside-toplevel

  def write(cache, new, slots):
    index = (np.arange(cache.shape[0])[:, None], slice(None), slots[:, None])
    if form == "bfloat16 bits":
      return precision.set_at(cache, index, new)
    return cache.at[index].set(new, mode="drop")
  return write


def looped(step):
  """`STEPS` calls of `step(carry, operand, i)` in a loop, each behind a `lax.cond` (as
  decoding's step)."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax import lax  # pylint: disable=import-outside-toplevel

  def run(carry, operand):
    body = lambda i, c: lax.cond(i >= 0, lambda: step(c, operand, i), lambda: c)
    return lax.fori_loop(0, STEPS, body, carry)
  return jax.jit(run)


def case_program(case: str, smoke: bool):
  """(the looped program of `case`, its operands, the shape of its weights or cache)."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  form, size = case.rsplit(":", 1)
  dtype = jnp.float32 if form.startswith("float32") else jnp.bfloat16
  if form in WRITES:
    b, g, c, k = SMOKE_CACHE if smoke else CACHE
    write = cache_write(form)
    step = lambda cache, new, i: write(cache, new + i, (np.arange(b) * 7 + i) % c)
    operands = (jnp.zeros((b, g, c, k), dtype), jnp.ones((b, 1, g, k), dtype))
    return looped(step), operands, (b, g, c, k)
  n_in, n_out = (SMOKE_IN, SMOKE_OUT) if smoke else (IN, OUT)
  mul = product(form)
  x = jnp.asarray(rng.standard_normal((int(size), n_in), np.float32) / n_in ** 0.5, dtype)
  w = jnp.asarray(rng.standard_normal((n_in, n_out), np.float32), dtype)
  return looped(lambda x, w, i: mul(x, w)[:, :n_in]), (x, w), (n_in, n_out)


def time_case(case: str, rounds: int, smoke: bool) -> dict:
  """A worker: ms per operation of `case` ('form:size'), and its loop's converts and fusions."""
  import jax  # pylint: disable=import-outside-toplevel
  from experiments.bench import hlo_bytes  # pylint: disable=import-outside-toplevel
  fn, args, shape = case_program(case, smoke)
  _, seconds = timing.once_then_timed(lambda: jax.block_until_ready(fn(*args)), rounds)
  text = fn.lower(*args).compile().as_text()
  return dict(ms=[s * 1e3 / STEPS for s in seconds], **hlo_bytes.converts(text, [shape]))


def cases() -> list[str]:
  products = [f"{form}:{rows}" for rows in ROWS for form in FORMS
              if rows == 1 or form not in ONE_ROW]
  return products + [f"{form}:{CACHE[2]}" for form in WRITES]


def _ms(reports: dict) -> dict:
  return {case: statistics.median([t for r in rs for t in r["ms"]])
          for case, rs in reports.items()}


def products(reports: dict) -> list[str]:
  ms = _ms(reports)
  rows = [f"| M | {' | '.join(FORMS)} |", "|---|" + "---|" * len(FORMS)]
  for m in ROWS:
    base = ms[f"float32:{m}"]
    cells = [f"{ms[f'{f}:{m}']:.2f} ({ms[f'{f}:{m}'] / base:.2f}x)" if f"{f}:{m}" in ms
             else "-" for f in FORMS]
    rows.append(f"| {m} | " + " | ".join(cells) + " |")
  return ["ms per product (ratio to float32's):", "", *rows]


def cache(reports: dict) -> list[str]:
  ms = _ms(reports)
  base = ms[f"{WRITES[0]}:{CACHE[2]}"]
  return ["ms per write of one token per row, keys [B, G, C, K] = "
          f"{list(CACHE)} (ratio to float32's):", "", "| write | ms | ratio |", "|---|---|---|",
          *(f"| {w} | {ms[f'{w}:{CACHE[2]}']:.3f} | {ms[f'{w}:{CACHE[2]}'] / base:.1f}x |"
            for w in WRITES)]


def hlo(reports: dict) -> list[str]:
  rows = ["| case | size | converts in the loop | of them of the weights' or cache's shape | "
          "YNNPACK fusions in the loop | dots XLA runs itself in the loop |",
          "|---|---|---|---|---|---|"]
  for case, rs in reports.items():
    form, size = case.rsplit(":", 1)
    r = rs[0]
    rows.append(f"| {form} | {size} | {r['loop_converts']} | {r['loop_shaped_converts']} | "
                f"{r['loop_ynn']} | {r['loop_dots']} |")
  return rows


def machine(load_before: tuple) -> list[str]:
  """A report's machine lines: the CPU (/proc/cpuinfo), whether it has AVX-512 and bfloat16
  dot instructions, and the load average before the run (`load_before`) and now."""
  cpuinfo = pathlib.Path("/proc/cpuinfo")
  info = cpuinfo.read_text() if cpuinfo.exists() else ""
  model = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                if line.startswith("model name")), "unknown")
  flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines()
                    if line.startswith("flags")), []))
  has = lambda *names: "yes" if flags & set(names) else "no"
  load = lambda avg: " / ".join(f"{x:.2f}" for x in avg)
  return [f"Machine: {model}, {os.cpu_count()} cores; AVX-512: {has('avx512f')}, bfloat16 "
          f"dot instructions (avx512_bf16, amx_bf16): {has('avx512_bf16', 'amx_bf16')}. Load "
          f"average (1 / 5 / 15 min) before the run: {load(load_before)}, after: "
          f"{load(os.getloadavg())}.", ""]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", action="append", choices=("products", "cache", "hlo"))
  parser.add_argument("--smoke", action="store_true", help="small shapes, nothing written")
  parser.add_argument("--out", default="docs/benchmark_bf16_cpu.md")
  parser.add_argument("--time-case", default=None, help=argparse.SUPPRESS)  # a worker's case
  args = parser.parse_args()
  rounds, turns = (1, 1) if args.smoke else (5, 2)
  if args.time_case:
    print(json.dumps(time_case(args.time_case, rounds, args.smoke)))
    return
  parts = args.part or ["products", "cache", "hlo"]
  load_before = os.getloadavg()
  wanted = [c for c in cases() if ("products" in parts or "hlo" in parts or
                                   c.rsplit(":", 1)[0] in WRITES)]
  reports = timing.isolated("experiments.bench.bf16_cpu", wanted, turns=turns,
                            extra_args=["--smoke"] if args.smoke else [])
  sections = {"products": lambda: machine(load_before) + products(reports),
              "cache": lambda: cache(reports), "hlo": lambda: hlo(reports)}
  timing.write_report("bfloat16 on XLA:CPU", "python -m experiments.bench.bf16_cpu", parts,
                      sections, args.out, args.smoke)


if __name__ == "__main__":
  main()
