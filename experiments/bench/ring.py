"""Sequence parallelism on 8 emulated devices: memory, causal balance, bytes moved.

    python -m experiments.bench.ring [--part memory|balance|bytes|time|lm_memory] [--devices 8]
                                     [--window W]

--part memory (default) compiles (never runs) `grad(sum(attention))` for B=1, H=8, K=V=64,
float32, causal, and reads XLA's `compile().memory_analysis()`: temp + argument bytes of ONE
device, ring attention against one device holding the whole sequence, plain (`reference`, the
[T, T] logits) and chunked; with --window W, under a causal window of W keys back as well.

--part balance counts the causal work of every device: the key tiles the chunked kernel visits
(its tile maps over the tokens' true positions, as `flax_mha.parallel.ring` builds them), per
ring step and in all, for each layout. Every ring step waits for its slowest device, so the
ring's critical path is the sum over steps of the slowest device's tiles; all-gather's is the
slowest device's total.

--part time times the ring's forward + backward in each layout on the emulated devices, which
share the host's cores: what it shows is the total work (a layout's tile sizes and masked
tiles), not the balance across devices.

--part bytes compiles forward + backward of each strategy and adds up the bytes of the
collectives in the optimised program (all-gather, all-to-all, collective-permute, reduce-scatter,
all-reduce), each counted once per trip of the loop it sits in and by the devices of its
replica group (`experiments.bench.hlo_bytes`): what one device receives.

--part lm_memory compiles (never runs) the LM's training step (configs/lm.py's model, one row of
T packed documents with segment ids and positions, Adam) as experiments.train builds it on a
data=1 x seq=n mesh, for each train.remat and strategy (zig-zag layout), and reads XLA's
`memory_analysis()`: argument + temp bytes of one device. XLA's CPU pipeline drops the
optimization barriers of jax.checkpoint (`python -m experiments.bench.fsdp --part remat`), so
on CPU remat may not lower the figure.

On a CPU host the devices are emulated (XLA_FLAGS=--xla_force_host_platform_device_count, set
here): this measures memory, work and traffic, not speed.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402  (after XLA_FLAGS: the device count is read once, at import)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from configs import lm  # noqa: E402
from experiments import train  # noqa: E402
from experiments.bench import hlo_bytes, timing  # noqa: E402
from flax_mha import mods as mods_lib  # noqa: E402
from flax_mha.parallel import sharding  # noqa: E402
from flax_mha.kernels import chunked, reference  # noqa: E402
from flax_mha.parallel import layouts, seqmods  # noqa: E402
from flax_mha.parallel.seq_parallel import ring_attention, sequence_parallel_attention  # noqa: E402

B, H, K = 1, 8, 64
MIB = 2**20


def peak_mib(fn, *args) -> float:
  """temp + argument MiB of one device for the compiled gradient of sum(fn(q, k, v))."""
  stats = timing.grad_memory(lambda q, k, v: jnp.sum(fn(q, k, v)), *args)
  return (stats.temp_size_in_bytes + stats.argument_size_in_bytes) / MIB


def measure(t: int, devices: int, window: int | None) -> dict[str, float]:
  mesh = sharding.make_mesh(seq=devices)
  mods = mods_lib.Mods((mods_lib.LocalWindow(window, 0),)) if window else None
  split = NamedSharding(mesh, P(None, "seq"))
  sharded = jax.ShapeDtypeStruct((B, t, H, K), jnp.float32, sharding=split)
  single = jax.ShapeDtypeStruct((B, t, H, K), jnp.float32)
  plain = lambda q, k, v: reference.attention(q, k, v, None, None, is_causal=True, mods=mods,
                                              scale=K**-0.5, dropout_rate=0.0, dropout_rng=None)
  flash = lambda q, k, v: chunked.attention(q, k, v, None, None, is_causal=True, scale=K**-0.5,
                                            dropout_rate=0.0, dropout_rng=None, mods=mods)
  ring = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, is_causal=True, mods=mods)
  parallel = lambda strategy: lambda q, k, v: sequence_parallel_attention(
      q, k, v, mesh=mesh, strategy=strategy, layout="zigzag", is_causal=True, mods=mods)
  return {"ring": peak_mib(ring, *(sharded,) * 3),
          **{f"{s} zigzag": peak_mib(parallel(s), *(sharded,) * 3)
             for s in ("ring", "all_gather", "ulysses")},
          "chunked": peak_mib(flash, *(single,) * 3), "plain": peak_mib(plain, *(single,) * 3)}


def memory(lengths: str, devices: int, window: int | None):
  print(f"B={B}, H={H}, K=V={K}, float32, causal"
        f"{f', a window of {window} keys back' if window else ''}, forward+backward; MiB per "
        "device (XLA memory_analysis: temp + arguments)\n")
  print(f"| T | ring, {devices} devices | ring, zigzag | all_gather, zigzag | ulysses, zigzag | "
        "chunked, 1 device | plain, 1 device |")
  print("|---:|---:|---:|---:|---:|---:|---:|")
  for t in map(int, lengths.split(",")):
    mib = measure(t, devices, window)
    print(f"| {t} | " + " | ".join(f"{x:,.1f}" for x in mib.values()) + " |", flush=True)


def visited_tiles(layout: str, t: int, n: int, me: int, src: int) -> int:
  """Key tiles the chunked kernel visits for device `me`'s queries over device `src`'s keys,
  causal (the kernel's own tile map over true positions, the ring's tile size)."""
  table = layouts.order(layout, t, n)
  block = seqmods.block(layout, t // n)
  term = mods_lib.Positions(table[me][None], table[src][None], causal=True)
  maybe, _ = term.tile_map(mods_lib.make_tiles(t // n, t // n, block, block))
  return int(np.asarray(maybe).sum())


def balance(t: int, n: int):
  print(f"Causal, T={t} tokens on {n} devices, the ring's tiles "
        f"({', '.join(f'{layout} {seqmods.block(layout, t // n)}' for layout in layouts.LAYOUTS)}"
        " tokens a side); visited key tiles per device (the kernel's tile maps).\n")
  print("| layout | ring: worst step, slowest / mean | ring: critical path / mean work | "
        "all-gather: slowest device / mean |")
  print("|---|---:|---:|---:|")
  for layout in layouts.LAYOUTS:
    tiles = np.array([[visited_tiles(layout, t, n, me, (me - step) % n) for me in range(n)]
                      for step in range(n)])  # [step, device]
    per_step = tiles.max(axis=1) / tiles.mean(axis=1)
    critical = tiles.max(axis=1).sum() / tiles.mean(axis=1).sum()
    totals = tiles.sum(axis=0)
    print(f"| {layout} | {per_step.max():.2f} | {critical:.2f} | "
          f"{totals.max() / totals.mean():.2f} |", flush=True)


def traffic(t: int, n: int, heads: tuple[int, int], layout: str, tokens: str):
  h, g = heads
  mesh = sharding.make_mesh(seq=n)
  split = NamedSharding(mesh, P(None, "seq"))
  shapes = [jax.ShapeDtypeStruct((B, t, heads_, K), jnp.float32, sharding=split)
            for heads_ in (h, g, g)]
  print(f"| {t} | H={h}, G={g} | {layout}{', in layout' if tokens == 'in_layout' else ''} |",
        end="")
  for strategy in ("ring", "all_gather", "ulysses"):
    if strategy == "ulysses" and (h % n or g % n):
      print(" - |", end="")
      continue
    fn = lambda q, k, v: jnp.sum(sequence_parallel_attention(
        q, k, v, mesh=mesh, strategy=strategy, layout=layout, tokens=tokens, is_causal=True))
    compiled = jax.jit(timing.qkv_grad(fn)).lower(*shapes).compile()
    print(f" {hlo_bytes.collective_bytes(compiled.as_text(), n) / MIB:,.1f} |", end="",
          flush=True)
  print()


def bytes_moved(lengths: str, n: int, smoke: bool):
  print(f"B={B}, K=V={K}, float32, causal, forward+backward on {n} devices; MiB each device "
        "receives (the compiled program's collectives, times their loop trips)\n")
  print("| T | heads | layout | ring | all_gather | ulysses |")
  print("|---:|---|---|---:|---:|---:|")
  for t in map(int, lengths.split(",")):
    for heads in ((H, H),) if smoke else ((H, H), (H, 1)):
      for layout, tokens in ((("zigzag", "natural"),) if smoke else (
          ("contiguous", "natural"), ("zigzag", "natural"), ("zigzag", "in_layout"))):
        traffic(t, n, heads, layout, tokens)


def seconds(t: int, n: int, rounds: int):
  """Median seconds of the ring's forward + backward in each layout, round-robin."""
  mesh = sharding.make_mesh(seq=n)
  x = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal((B, t, H, K)),
                                 jnp.float32), NamedSharding(mesh, P(None, "seq")))
  loss = lambda layout: lambda q, k, v: jnp.sum(sequence_parallel_attention(
      q, k, v, mesh=mesh, strategy="ring", layout=layout, is_causal=True))
  fns = {layout: timing.blocking(timing.qkv_grad(loss(layout)), x, x, x)
         for layout in layouts.LAYOUTS}
  median = timing.median_seconds(fns, rounds)
  print(f"| {t} | " + " | ".join(f"{median[layout]:.2f}" for layout in layouts.LAYOUTS) + " |",
        flush=True)


def lm_step_mib(length: int, n: int, strategy: str, remat: str, tiny: bool) -> tuple[float, float]:
  """(argument, temp) MiB of one device for the LM's training step on data=1 x seq=n (n=1: one
  device, the model's own attention dispatch)."""
  config = lm.get_config("tiny" if tiny else None)
  config.train.update(batch_size=1, remat=remat)
  runner = train.make_runner(config)  # at the config's length: init runs the model once
  tx = train.make_optimizer(config.train)
  state, batch = train.init_state(runner, tx), runner.init_batch()
  config.train.length = length
  if n > 1:
    config.mesh.update(seq=n, seq_strategy=strategy, seq_layout="zigzag")
  state, step_fn = train.shard_and_compile(train.make_runner(config), state, tx)
  shapes = {name: jax.ShapeDtypeStruct((1, length), x.dtype) for name, x in batch.items()}
  stats = step_fn.lower(state, shapes).compile().memory_analysis()
  return stats.argument_size_in_bytes / MIB, stats.temp_size_in_bytes / MIB


def lm_memory(length: int, n: int, smoke: bool):
  print(f"configs/lm.py{':tiny' if smoke else ''} training step, 1 row of {length} packed "
        f"tokens (segment ids, positions), data=1 x seq={n}, zig-zag, and one device; MiB per "
        "device (XLA memory_analysis)\n")
  print("| strategy | remat | arguments | temp | arguments + temp |")
  print("|---|---|---:|---:|---:|")
  runs = [(strategy, n) for strategy in ("ring", "all_gather")] + [("1 device", 1)]
  for strategy, devices in runs[:1] if smoke else runs:
    for remat in ("none", "layer", "attention"):
      args, temp = lm_step_mib(length, devices, strategy, remat, smoke)
      print(f"| {strategy} | {remat} | {args:,.1f} | {temp:,.1f} | {args + temp:,.1f} |",
            flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", choices=("memory", "balance", "bytes", "time", "lm_memory"), default="memory")
  parser.add_argument("--lengths", default=None, help="T values, comma-separated")
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--window", type=int, default=None,
                      help="memory: a causal local window of this many keys back")
  parser.add_argument("--smoke", action="store_true",
                      help="small T only: that the command runs, no figures")
  args = parser.parse_args()
  defaults = {"memory": "4096,8192,16384,32768,65536", "balance": "65536", "bytes": "4096,16384",
              "time": "4096", "lm_memory": "65536"}
  lengths = "256" if args.smoke else (args.lengths or defaults[args.part])
  if args.part == "memory":
    memory(lengths, args.devices, args.window)
  elif args.part == "balance":
    for t in map(int, lengths.split(",")):
      balance(t, args.devices)
  elif args.part == "lm_memory":
    for t in map(int, lengths.split(",")):
      lm_memory(t, args.devices, args.smoke)
  elif args.part == "bytes":
    bytes_moved(lengths, args.devices, args.smoke)
  else:
    print(f"B={B}, H={H}, K=V={K}, float32, causal ring, forward+backward on {args.devices} "
          "emulated devices sharing the host's cores: seconds, median of 5 round-robin\n")
    print("| T | " + " | ".join(layouts.LAYOUTS) + " |")
    print("|---:|" + "---:|" * len(layouts.LAYOUTS))
    for t in map(int, lengths.split(",")):
      seconds(t, args.devices, 1 if args.smoke else 5)


if __name__ == "__main__":
  main()
