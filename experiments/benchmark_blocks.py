"""Block sizes of the chunked kernel, and the crossover to the plain graph: the sweep behind
`flax_mha.chunked.default_blocks` and `flax_mha.attention.SMALL_LOGITS`.

  python -m experiments.benchmark_blocks [--quick]

Forward+backward, float32, H=8, B·N = 4096, on this machine's CPU: for each (D, N, causal) the
chunked kernel with square blocks of 128, 256 and 512 rows, the plain graph ("xla") up to
N = 2048, timed round-robin in one process (median of 5 after 2 warm-ups). Prints one row per
shape with the fastest block and whether the default picks it.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from experiments.benchmark_attention import _median_seconds
from flax_mha import attention as attention_lib
from flax_mha import chunked
from flax_mha import xla

BLOCKS = (128, 256, 512)


def _fwd_bwd(fn, q, k, v, causal):
  loss = lambda q, k, v: jnp.sum(fn(q, k, v, None, None, is_causal=causal,
                                    scale=q.shape[-1]**-0.5, dropout_rate=0.0, dropout_rng=None))
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  return lambda: jax.block_until_ready(grad(q, k, v))


def sweep(grid, runs=5, tokens=4096):
  for d, n, causal in grid:
    b = max(1, tokens // n)
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (b, n, 8, d)) for key in keys)
    fns = {f"chunked {blk}": _fwd_bwd(chunked.make_attention(blk, blk), q, k, v, causal)
           for blk in BLOCKS if blk <= n}
    if n <= 2048:
      fns["xla"] = _fwd_bwd(xla.attention, q, k, v, causal)
    ms = {name: 1e3 * t for name, t in _median_seconds(fns, runs).items()}
    best = min(ms, key=ms.get)
    default_block = chunked.default_blocks(n, n, d, causal)[0]
    picked = attention_lib.default_implementation(q, k, v, None, None, is_causal=causal,
                                                  dropout_rate=0.0)
    default = "xla" if picked == "xla" else f"chunked {default_block}"
    cells = ", ".join(f"{name} {t:.1f}" for name, t in ms.items())
    print(f"D={d} N={n} causal={causal}: {cells} ms | fastest {best}; default {default} "
          f"({ms.get(default, float('nan')) / ms[best]:.2f}x the fastest)", flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="D=64, N in (256, 512, 1024)")
  args = parser.parse_args()
  ns = (256, 512, 1024) if args.quick else (256, 512, 1024, 2048, 4096)
  ds = (64,) if args.quick else (64, 128)
  sweep([(d, n, c) for d in ds for n in ns for c in (False, True)])


if __name__ == "__main__":
  main()
