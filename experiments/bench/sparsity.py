"""Work proportional to what is visible: windows, packed documents and mask/score functions.

  python -m experiments.bench.sparsity [--n 16384] [--quick]   # -> docs/sparsity_cpu.{md,png}

Forward+backward of `implementation=None` (whichever implementation it picks for the row, named
in the table), float32, H=8, D=64, B=1, on this machine's CPU. Each mask is timed in a process
of its own (2 warm-ups, then --runs timed runs), the processes taking turns --turns times (the
order reversed every other turn, see experiments.bench.timing); medians over all runs of all
turns. Reports each mask's time as a fraction of the full (causal or non-causal) attention at
the same N beside its visible fraction, the cost of spelling causality as a `mask_mod` and
soft-capping as a `score_mod` against the built-ins, and the XLA temp memory of fwd+bwd with
segment ids at N=131072, H=1. Then, at --peer-n tokens, the rows that tokamax also takes (full,
causal, a window, key lengths, soft cap) against its `xla` and `xla_chunked` implementations,
each (mask, system) in a process of its own in the same way, where tokamax imports.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import jax
import jax.numpy as jnp

import flax_mha
from experiments.bench import timing

GIB = 2**30


def _segments(n: int, docs: int):
  return jnp.repeat(jnp.arange(docs, dtype=jnp.int32), n // docs)[None]


def variants(n: int):
  """name -> (dot_product_attention kwargs, visible fraction of the [N, N] matrix)."""
  windows = [w for w in (128, 512, 2048) if w < n]
  doc_counts = [d for d in (4, 16, 64) if n % d == 0]
  causal_frac = (n + 1) / (2 * n)
  out = {"full": ({}, 1.0), "causal": (dict(is_causal=True), causal_frac)}
  for w in windows:
    frac = sum(min(i, w) + 1 for i in range(n)) / n**2
    out[f"causal window {w}"] = (dict(is_causal=True, local_window_size=(w, 0)), frac)
  for d in doc_counts:
    out[f"{d} documents"] = (dict(q_segment_ids=_segments(n, d)), 1.0 / d)
  out["causal as mask_mod"] = (dict(mask_mod=lambda b, h, q, kv: q >= kv), causal_frac)
  out["soft cap 30"] = (dict(logit_soft_cap=30.0), 1.0)
  out["soft cap 30 as score_mod"] = (
      dict(score_mod=lambda s, b, h, q, kv: 30.0 * jnp.tanh(s / 30.0)), 1.0)
  return out


def _qkv(n, h=8, d=64):
  return [jax.random.normal(key, (1, n, h, d)) for key in jax.random.split(jax.random.key(0), 3)]


def _fwd_bwd(n, kwargs, attention=flax_mha.dot_product_attention):
  q, k, v = _qkv(n)
  loss = lambda q, k, v: jnp.sum(attention(q, k, v, **kwargs))
  return timing.blocking(timing.qkv_grad(loss), q, k, v)


def picks(n, cases) -> dict[str, str]:
  """name -> the implementation `None` runs for the case."""
  q = jax.ShapeDtypeStruct((1, n, 8, 64), jnp.float32)
  return {name: flax_mha.explain(q, q, q, **kwargs).implementation
          for name, (kwargs, _) in cases.items()}


MODULE = "experiments.bench.sparsity"  # its workers: python -m MODULE --time-case <case>
PEER_SYSTEMS = ("None", "xla", "xla_chunked")  # ours, then tokamax's implementations


def peer_cases(n):
  """mask -> (our kwargs, tokamax's where it names them otherwise: `key_value_seq_lengths` is
  the same, the soft cap is `logits_soft_cap`)."""
  lengths = jnp.array([n // 2])
  return {"full": ({}, {}), "causal": (dict(is_causal=True), {}),
          "causal window 512": (dict(is_causal=True, local_window_size=(512, 0)), {}),
          "key lengths N/2": (dict(key_value_seq_lengths=lengths), {}),
          "soft cap 30": (dict(logit_soft_cap=30.0), dict(logits_soft_cap=30.0))}


def time_case(case: str, n: int, runs: int) -> dict:
  """Worker: {"seconds": [...]} of one case: a mask of `variants`, or "<mask> | <system>" of
  the tokamax table."""
  mask, _, system = case.partition(" | ")
  if system in ("", "None"):
    kwargs = (variants(n) if not system else peer_cases(n))[mask][0]
    fn = _fwd_bwd(n, kwargs)
  else:
    ours, renamed = peer_cases(n)[mask]
    theirs = {**{k: v for k, v in ours.items() if k != "logit_soft_cap"}, **renamed}
    fn = _fwd_bwd(n, dict(theirs, implementation=system),
                  timing.import_tokamax().dot_product_attention)
  return dict(seconds=timing.round_robin({case: fn}, runs)[case])


def isolated_ms(cases, n, runs, turns) -> dict[str, float]:
  """case -> median fwd+bwd ms, each case timed in its own process (time_case), `turns` turns."""
  reports = timing.isolated(MODULE, list(cases), turns=turns,
                            extra_args=["--n", str(n), "--runs", str(runs)])
  return {case: 1e3 * statistics.median(t) for case, t in timing.pooled_seconds(reports).items()}


def peers(n, runs, turns) -> list[str]:
  """Markdown: fwd+bwd ms of None and tokamax's XLA implementations on the options both take."""
  if timing.import_tokamax() is None:
    return []
  cases = peer_cases(n)
  ms = isolated_ms([f"{mask} | {system}" for mask in cases for system in PEER_SYSTEMS],
                   n, runs, turns)
  chosen = picks(n, {name: (ours, None) for name, (ours, _) in cases.items()})
  lines = [f"## Against tokamax (N={n}, fwd+bwd ms, medians of {turns} turns x {runs} runs, "
           "each (mask, system) in its own process)", "",
           "| mask | `None` (runs) | tokamax xla | tokamax xla_chunked | xla / None | "
           "xla_chunked / None |", "|---|---|---|---|---|---|"]
  for name in cases:
    ours, xla, chunked = (ms[f"{name} | {system}"] for system in PEER_SYSTEMS)
    lines.append(f"| {name} | {ours:.0f} ({chosen[name]}) | {xla:.0f} | {chunked:.0f} | "
                 f"{xla / ours:.2f} | {chunked / ours:.2f} |")
  return lines


def segment_memory(n=131072, docs=16):
  x = jax.ShapeDtypeStruct((1, n, 1, 64), jnp.float32)
  ids = jax.ShapeDtypeStruct((1, n), jnp.int32)
  loss = lambda q, k, v, ids: jnp.sum(flax_mha.dot_product_attention(
      q, k, v, q_segment_ids=ids))
  return timing.grad_memory(loss, x, x, x, ids).temp_size_in_bytes / GIB


def report(n, ms, fracs, chosen):
  base = lambda name: ms["causal"] if "causal" in name else ms["full"]
  lines = [f"# Visible fraction vs time (CPU, float32, fwd+bwd, None, H=8, D=64, N={n})", "",
           "Generated by `python -m experiments.bench.sparsity`. Time fraction: the row's "
           "time over full attention's (non-causal rows) or full causal's (causal rows), "
           "each mask timed in a process of its own, the processes taking turns, medians; "
           "`implementation=None` throughout, the implementation it runs in brackets.", "",
           "| mask | visible fraction | ms (None runs) | time fraction | time / visible "
           "(relative) |", "|---|---|---|---|---|"]
  for name, t in ms.items():
    base_frac = fracs["causal"] if "causal" in name else 1.0
    rel_vis = fracs[name] / base_frac
    tf = t / base(name)
    lines.append(f"| {name} | {fracs[name]:.4f} | {t:.0f} ({chosen[name]}) | {tf:.3f} | "
                 f"{tf / rel_vis:.2f} |")
  lines += ["", f"`mask_mod` causal / `is_causal`: {ms['causal as mask_mod'] / ms['causal']:.3f}; "
            f"`score_mod` soft cap / `logit_soft_cap`: "
            f"{ms['soft cap 30 as score_mod'] / ms['soft cap 30']:.3f}.", ""]
  return lines


def plot(ms, fracs, path):
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(figsize=(5.5, 4))
  for kind in ("window", "documents"):
    pts = sorted((fracs[k], ms[k] / ms["full"]) for k in ms if kind in k)
    ax.plot(*zip(*pts), marker="o", label="causal + window" if kind == "window" else "documents")
  ax.plot([fracs["causal"]], [ms["causal"] / ms["full"]], "ks", label="causal")
  ax.plot([1e-3, 1], [1e-3, 1], "k:", lw=1, label="time = visible fraction")
  ax.set(xscale="log", yscale="log", xlabel="visible fraction of the N x N matrix",
         ylabel="time / full attention", title="implementation=None, fwd+bwd, CPU f32")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--n", type=int, default=16384)
  parser.add_argument("--runs", type=int, default=3, help="timed runs per process")
  parser.add_argument("--turns", type=int, default=2, help="processes per case, in turn")
  size = parser.add_mutually_exclusive_group()
  size.add_argument("--quick", action="store_true", help="N=2048, 1 run, no memory check")
  size.add_argument("--smoke", action="store_true",
                    help="N=256, 1 run, no memory check: that the command runs")
  parser.add_argument("--peer-n", type=int, default=4096, help="N of the tokamax comparison")
  parser.add_argument("--out", default="docs/sparsity_cpu.md")
  parser.add_argument("--time-case", default=None, help=argparse.SUPPRESS)  # a worker's case
  args = parser.parse_args()
  if args.time_case:
    print(json.dumps(time_case(args.time_case, args.n, args.runs)))
    return
  n = 256 if args.smoke else 2048 if args.quick else args.n
  runs, turns = (1, 1) if args.quick or args.smoke else (args.runs, args.turns)
  cases = variants(n)
  ms = isolated_ms(cases, n, runs, turns)
  fracs = {name: frac for name, (_, frac) in cases.items()}
  lines = report(n, ms, fracs, picks(n, cases))
  if not (args.quick or args.smoke):
    lines += [f"XLA temp memory of fwd+bwd with 16 documents (segment ids) at N=131072, H=1, "
              f"D=64: {segment_memory():.3f} GiB.", ""]
  lines += [*peers(min(n, args.peer_n), runs, turns), ""]
  print("\n".join(lines))
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out, "w") as f:
    f.write("\n".join(lines))
  plot(ms, fracs, args.out[:-3] + ".png")


if __name__ == "__main__":
  main()
