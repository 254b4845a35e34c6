"""Tile sizes of the chunked and rows kernels, and the crossover to the plain graph: the sweeps
behind `flax_mha.kernels.chunked.default_blocks`, `flax_mha.kernels.rows`' TILE_* budgets and
`flax_mha.attention.SMALL_LOGITS*`.

  python -m experiments.bench.blocks [--quick]          # chunked blocks (dropout, mods)
  python -m experiments.bench.blocks --rows [--quick]   # rows tile budgets (plain calls)
  python -m experiments.bench.blocks --masked [--quick] # rows vs chunked vs xla, masked

Float32, H=8, B·N = 4096, on this machine's CPU: for each (D, N, causal) the chunked kernel with
square blocks of 128, 256 and 512 rows (forward+backward), or "rows" with forward tile budgets
of 2^18..2^21 logits (forward) and backward budgets of 2^18 and 2^20 (forward+backward), and
the plain graph ("xla") up to N = 2048, timed round-robin in one process (median of 5 after 2
warm-ups). Prints one row per shape with the fastest and what the default runs. --masked times
rows, chunked and xla with a key-padding mask [B, 1, 1, S] (each example keeps at least half
of its keys) and a bias [1, H, T, S], forward+backward: the crossovers of masked calls.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from experiments.bench import timing
from flax_mha import attention as attention_lib
from flax_mha.kernels import chunked
from flax_mha.kernels import rows
from flax_mha.kernels import xla

BLOCKS = (128, 256, 512)


def _timed(fn, q, k, v, causal, backward=True, bias=None, mask=None):
  call = lambda q, k, v: fn(q, k, v, bias, mask, is_causal=causal, scale=q.shape[-1]**-0.5,
                            dropout_rate=0.0, dropout_rng=None)
  loss = lambda q, k, v: jnp.sum(call(q, k, v))
  return timing.blocking(timing.qkv_grad(loss) if backward else call, q, k, v)


def _chunked_peers(n, causal, d, q, k, v):
  fns = {f"chunked {blk}": _timed(chunked.make_attention(blk, blk), q, k, v, causal)
         for blk in BLOCKS if blk <= n}
  # What the sweep stands for: calls that rows refuses (dropout, mods), here with dropout.
  picked = attention_lib.default_implementation(q, k, v, None, None, is_causal=causal,
                                                dropout_rate=0.1)
  block = chunked.default_blocks(n, n, d, causal)[0]
  return fns, "xla" if picked == "xla" else f"chunked {block}"


def _rows_peers(n, causal, d, q, k, v):
  del d
  fns = {f"rows fwd 2^{e}": _timed(rows.make_attention(tile_forward=2**e), q, k, v, causal,
                                   backward=False) for e in (18, 19, 20, 21)}
  fns.update({f"rows fwd+bwd 2^{e}": _timed(rows.make_attention(tile_backward=2**e), q, k, v,
                                            causal) for e in (18, 20)})
  picked = attention_lib.default_implementation(q, k, v, None, None, is_causal=causal,
                                                dropout_rate=0.0)
  return fns, picked


def _masked_peers(n, causal, d, q, k, v):
  del d
  b, _, h, _ = q.shape
  lengths = jax.random.randint(jax.random.key(1), (b, 1, 1, 1), n // 2, n + 1)
  mask = jnp.arange(n)[None, None, None, :] < lengths
  bias = jax.random.normal(jax.random.key(2), (1, h, n, n))
  fns = {name: _timed(fn, q, k, v, causal, bias=bias, mask=mask)
         for name, fn in (("rows", rows.attention), ("chunked", chunked.attention))}
  if n <= 2048:
    fns["xla"] = _timed(xla.attention, q, k, v, causal, bias=bias, mask=mask)
  return fns, attention_lib.default_implementation(q, k, v, bias, mask, is_causal=causal,
                                                   dropout_rate=0.0)


def sweep(grid, peers, runs=5, tokens=4096):
  for d, n, causal in grid:
    b = max(1, tokens // n)
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (b, n, 8, d)) for key in keys)
    fns, default = peers(n, causal, d, q, k, v)
    if n <= 2048 and "xla" not in fns:
      fns["xla"] = _timed(xla.attention, q, k, v, causal)
    ms = {name: 1e3 * t for name, t in timing.median_seconds(fns, runs).items()}
    cells = ", ".join(f"{name} {t:.1f}" for name, t in ms.items())
    fwd_bwd = {name: t for name, t in ms.items() if "rows fwd " not in name}
    best = min(fwd_bwd, key=fwd_bwd.get)
    print(f"D={d} N={n} causal={causal}: {cells} ms | fastest fwd+bwd {best}; default {default}",
          flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  size = parser.add_mutually_exclusive_group()
  size.add_argument("--quick", action="store_true", help="D=64, N in (256, 512, 1024)")
  size.add_argument("--smoke", action="store_true",
                    help="D=16, N=128 causal, one round: that the command runs, no figures")
  group = parser.add_mutually_exclusive_group()
  group.add_argument("--rows", action="store_true", help="sweep rows' tiles, not chunked's")
  group.add_argument("--masked", action="store_true", help="rows/chunked/xla with mask and bias")
  args = parser.parse_args()
  ds, ns = ((64,), (256, 512, 1024)) if args.quick else ((64, 128), (256, 512, 1024, 2048, 4096))
  grid = [(d, n, c) for d in ds for n in ns for c in (False, True)]
  sweep([(16, 128, True)] if args.smoke else grid,
        _rows_peers if args.rows else _masked_peers if args.masked else _chunked_peers,
        runs=1 if args.smoke else 5)


if __name__ == "__main__":
  main()
