"""Per-device memory of ring attention (forward + backward) vs sequence length, on 8 devices.

    python -m experiments.bench.ring [--lengths 4096,8192,...] [--devices 8]

Compiles (never runs) `grad(sum(attention))` for B=1, H=8, K=V=64, float32, causal, and reads
XLA's `compile().memory_analysis()`: temp + argument bytes of ONE device. Compared with the same
attention on a single device, plain (`reference`, the [T, T] logits) and chunked. On a CPU host
the devices are emulated (XLA_FLAGS=--xla_force_host_platform_device_count, set here): this
measures memory and checks that the program compiles, not speed.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402  (after XLA_FLAGS: the device count is read once, at import)
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from experiments.bench import timing  # noqa: E402
from flax_mha import sharding  # noqa: E402
from flax_mha.kernels import chunked, reference  # noqa: E402
from flax_mha.kernels.ring import ring_attention  # noqa: E402

B, H, K = 1, 8, 64
MIB = 2**20


def peak_mib(fn, *args) -> float:
  """temp + argument MiB of one device for the compiled gradient of sum(fn(q, k, v))."""
  stats = timing.grad_memory(lambda q, k, v: jnp.sum(fn(q, k, v)), *args)
  return (stats.temp_size_in_bytes + stats.argument_size_in_bytes) / MIB


def measure(t: int, devices: int) -> dict[str, float]:
  mesh = sharding.make_mesh(seq=devices)
  split = NamedSharding(mesh, P(None, "seq"))
  sharded = jax.ShapeDtypeStruct((B, t, H, K), jnp.float32, sharding=split)
  single = jax.ShapeDtypeStruct((B, t, H, K), jnp.float32)
  plain = lambda q, k, v: reference.attention(q, k, v, None, None, is_causal=True,
                                              scale=K**-0.5, dropout_rate=0.0, dropout_rng=None)
  flash = lambda q, k, v: chunked.attention(q, k, v, None, None, is_causal=True, scale=K**-0.5,
                                            dropout_rate=0.0, dropout_rng=None)
  ring = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, is_causal=True)
  return {"ring": peak_mib(ring, *(sharded,) * 3), "chunked": peak_mib(flash, *(single,) * 3),
          "plain": peak_mib(plain, *(single,) * 3)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lengths", default="4096,8192,16384,32768,65536")
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--smoke", action="store_true",
                      help="T=256 only: that the command runs, no figures")
  args = parser.parse_args()
  lengths = "256" if args.smoke else args.lengths
  print(f"B={B}, H={H}, K=V={K}, float32, causal, forward+backward; MiB per device "
        f"(XLA memory_analysis: temp + arguments)\n")
  print(f"| T | ring, {args.devices} devices | chunked, 1 device | plain, 1 device |")
  print("|---:|---:|---:|---:|")
  for t in map(int, lengths.split(",")):
    mib = measure(t, args.devices)
    print(f"| {t} | {mib['ring']:,.1f} | {mib['chunked']:,.1f} | {mib['plain']:,.1f} |",
          flush=True)


if __name__ == "__main__":
  main()
