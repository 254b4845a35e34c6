"""Tile sizes of the chunked and rows kernels, and the crossover to the plain graph: the sweeps
behind `flax_mha.kernels.chunked.default_blocks`, `flax_mha.kernels.rows`' TILE_* budgets and
`flax_mha.dispatch.SMALL_LOGITS*`.

  python -m experiments.bench.blocks [--quick]          # chunked blocks (dropout, mods)
  python -m experiments.bench.blocks --rows [--quick]   # rows tile budgets (plain calls)
  python -m experiments.bench.blocks --masked [--quick] # rows vs chunked vs xla, masked
  python -m experiments.bench.blocks --sparse [--quick] # chunked vs xla, windows and caps
  python -m experiments.bench.blocks --windows [--quick] # rows' bands vs chunked, windows
  python -m experiments.bench.blocks --products          # product speed by tile shape

Float32, H=8, B·N = 4096, on this machine's CPU: for each (D, N, causal) the chunked kernel with
square blocks of 128, 256 and 512 rows (forward+backward), or "rows" with forward tile budgets
of 2^18..2^21 logits (forward) and backward budgets of 2^18 and 2^20 (forward+backward), and
the plain graph ("xla") up to N = 2048, timed round-robin in one process (median of 5 after 2
warm-ups). Prints one row per shape with the fastest and what the default runs. --masked times
rows, chunked and xla with a key-padding mask [B, 1, 1, S] (each example keeps at least half
of its keys) and a bias [1, H, T, S], forward+backward: the crossovers of masked calls.
--sparse times chunked and xla through `dot_product_attention` with causality, windows
and a soft cap (D = 32, 64, 128; N = 256, 384, 512), beside the share of its tiles chunked
visits (`flax_mha.kernels.chunked.visited_fraction`) and what None runs: the evidence for
SMALL_LOGITS_SPARSE. --windows times, for causal and two-sided windows at N up to 16384 (B=1),
rows with bands of 64, 128 and 256 query rows against chunked, forward+backward: the evidence
for `rows.WINDOW_ROWS` and for where None runs rows under a window. --products times the
logits product alone (Q·Kᵀ of [8, Q, 64] by [8, E, 64], in a loop of the same total logits) for
the tiles rows' bands make (Q=128 rows over 128 + w keys) and for the square tiles chunked runs
full and causal attention in: the throughput a window's share is measured against.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import flax_mha
from experiments.bench import timing
from flax_mha import attention as attention_lib
from flax_mha import mods as mods_lib
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


# name -> (is_causal, local_window_size, logit_soft_cap): static masks that hide tiles, and a
# cap alone (a score term, which only makes rows refuse the call).
SPARSE_VARIANTS = {
    "causal": (True, None, None),
    "causal window 16": (True, (16, 0), None),
    "window 32": (False, (32, 32), None),
    "causal soft cap": (True, None, 30.0),
}


def sparse_sweep(ds, ns, variants, runs=5, tokens=4096):
  """chunked vs xla for each of `variants` (SPARSE_VARIANTS names), fwd+bwd, and what None
  runs."""
  for d in ds:
    for n in ns:
      keys = jax.random.split(jax.random.key(0), 3)
      q, k, v = (jax.random.normal(key, (max(1, tokens // n), n, 8, d)) for key in keys)
      for variant in variants:
        causal, window, cap = SPARSE_VARIANTS[variant]
        options = dict(is_causal=causal, local_window_size=window, logit_soft_cap=cap)
        fns = {}
        for name in ("xla", "chunked"):
          loss = lambda q, k, v, name=name: jnp.sum(flax_mha.dot_product_attention(
              q, k, v, implementation=name, **options))
          fns[name] = timing.blocking(timing.qkv_grad(loss), q, k, v)
        ms = {name: 1e3 * t for name, t in timing.median_seconds(fns, runs).items()}
        terms = () if window is None else (mods_lib.LocalWindow(*window),)
        visited = chunked.visited_fraction(n, n, d, causal, mods_lib.Mods(terms))
        picked = flax_mha.explain(q, k, v, platform="cpu", **options).implementation
        print(f"D={d} N={n} {variant}: xla {ms['xla']:.1f}, chunked {ms['chunked']:.1f} "
              f"ms | chunked/xla {ms['chunked'] / ms['xla']:.2f}, chunked "
              f"visits {visited:.3f} of its tiles; None runs {picked}", flush=True)


WINDOWS = {"causal window 128": (True, (128, 0)), "causal window 512": (True, (512, 0)),
           "causal window 2048": (True, (2048, 0)), "window 256 + 256": (False, (256, 256))}


def window_sweep(ns, variants, runs=5, tokens=4096):
  """rows (bands of 64/128/256 rows) vs chunked under windows, fwd+bwd, and what None runs."""
  for n in ns:
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (max(1, tokens // n), n, 8, 64)) for key in keys)
    for variant in variants:
      causal, window = WINDOWS[variant]
      options = dict(is_causal=causal, local_window_size=window)
      impls = {"chunked": "chunked", **{f"rows {r}": rows.make_attention(window_rows=r)
                                        for r in (64, 128, 256)}}
      fns = {}
      for name, impl in impls.items():
        loss = lambda q, k, v, impl=impl: jnp.sum(flax_mha.dot_product_attention(
            q, k, v, implementation=impl, **options))
        fns[name] = timing.blocking(timing.qkv_grad(loss), q, k, v)
      ms = {name: 1e3 * t for name, t in timing.median_seconds(fns, runs).items()}
      picked = flax_mha.explain(q, k, v, platform="cpu", **options).implementation
      cells = ", ".join(f"{name} {t:.1f}" for name, t in ms.items())
      print(f"N={n} {variant}: {cells} ms | rows 128 / chunked "
            f"{ms['rows 128'] / ms['chunked']:.2f}; None runs {picked}", flush=True)


# (rows, keys) of the products: rows' bands for windows 128, 512 and 2048, chunked's 512² tile.
PRODUCTS = ((128, 256), (128, 640), (128, 2176), (256, 512), (512, 512))


def product_sweep(shapes, runs=5, logits=2**27, units=8, d=64):
  """GFLOP/s of the logits product per tile shape, each in a scan over `logits` logits."""
  for q_rows, keys in shapes:
    trips = max(1, logits // (units * q_rows * keys))
    rng = jax.random.split(jax.random.key(0))
    q = jax.random.normal(rng[0], (trips, units, q_rows, d))
    k = jax.random.normal(rng[1], (trips, units, keys, d))

    def products(q, k):
      step = lambda c, x: (c + jnp.einsum("uqd,usd->uqs", *x)[0, 0, 0], None)
      return jax.lax.scan(step, jnp.zeros(()), (q, k))[0]

    seconds = timing.median_seconds({"p": timing.blocking(products, q, k)}, runs)["p"]
    flops = 2 * trips * units * q_rows * keys * d
    print(f"[{units}, {q_rows}, {d}] x [{units}, {keys}, {d}]: {flops / seconds / 1e9:.1f} "
          f"GFLOP/s ({trips} products)", flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  size = parser.add_mutually_exclusive_group()
  size.add_argument("--quick", action="store_true", help="D=64, N in (256, 512, 1024)")
  size.add_argument("--smoke", action="store_true",
                    help="D=16, N=128 causal, one round: that the command runs, no figures")
  group = parser.add_mutually_exclusive_group()
  group.add_argument("--rows", action="store_true", help="sweep rows' tiles, not chunked's")
  group.add_argument("--masked", action="store_true", help="rows/chunked/xla with mask and bias")
  group.add_argument("--sparse", action="store_true", help="chunked/xla with windows and caps")
  group.add_argument("--windows", action="store_true", help="rows' bands vs chunked, windows")
  group.add_argument("--products", action="store_true", help="product speed by tile shape")
  args = parser.parse_args()
  if args.products:
    product_sweep(PRODUCTS[:1] if args.smoke else PRODUCTS, runs=1 if args.smoke else 9,
                  logits=2**16 if args.smoke else 2**27)
    return
  if args.windows:
    window_sweep((512,) if args.smoke else (1024, 4096) if args.quick else (1024, 4096, 16384),
                 ["causal window 128"] if args.smoke else list(WINDOWS),
                 runs=1 if args.smoke else 3)
    return
  if args.sparse:
    sparse_sweep((16,) if args.smoke else (64,) if args.quick else (32, 64, 128),
                 (128,) if args.smoke else (256, 384, 512),
                 ["causal window 16"] if args.smoke else list(SPARSE_VARIANTS),
                 runs=1 if args.smoke else 5)
    return
  ds, ns = ((64,), (256, 512, 1024)) if args.quick else ((64, 128), (256, 512, 1024, 2048, 4096))
  grid = [(d, n, c) for d in ds for n in ns for c in (False, True)]
  sweep([(16, 128, True)] if args.smoke else grid,
        _rows_peers if args.rows else _masked_peers if args.masked else _chunked_peers,
        runs=1 if args.smoke else 5)


if __name__ == "__main__":
  main()
