"""Per-device memory of training: the state with and without FSDP, the step under each remat.

    python -m experiments.bench.fsdp [--part state|remat|all] [--length 128] [--rows 32]

state: parameters + Adam moments of configs/dates.py and configs/lm.py laid out by
  experiments.train on 8 devices (config.mesh.*), bytes summed per device from the arrays'
  addressable shards; the largest device's share, and that over 1/8 of the one-device total.
remat: the LM's training step (configs/lm.py, --rows rows of --length tokens) compiled (never
  run) on one device for each config.train.remat: the optimization barriers jax.checkpoint puts
  in the lowered program, and XLA's `memory_analysis()` temp bytes (what the step keeps alive
  beyond its arguments). XLA's CPU pipeline drops those barriers and merges the recomputation
  back into the forward, so on CPU the temp bytes do not move (GPU and TPU keep the barriers;
  not measured here).
On a CPU host the devices are emulated (XLA_FLAGS=--xla_force_host_platform_device_count, set
here): this measures placement and compiled memory, not speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402  (after XLA_FLAGS: the device count is read once, at import)

from configs import dates, lm  # noqa: E402
from experiments import train  # noqa: E402
from flax_mha.parallel import sharding  # noqa: E402

CONFIGS = {"dates": dates.get_config, "lm": lm.get_config}
LAYOUTS = {  # name -> config.mesh
    "1 device": {}, "data=8": dict(data=8), "fsdp=8": dict(fsdp=8),
    "data=2 x fsdp=4": dict(data=2, fsdp=4), "model=2 x fsdp=4": dict(model=2, fsdp=4),
}
MIB = 2**20


def state_mib(name: str, tiny: bool) -> dict[str, float]:
  """layout -> MiB of params + optimizer state on the device that holds the most."""
  config = CONFIGS[name]("tiny" if tiny else None)
  config.train.batch_size = 32  # every layout's data x fsdp divides it (no step runs)
  runner = train.make_runner(config)
  tx = train.make_optimizer(config.train)
  state = train.init_state(runner, tx)
  out = {}
  for layout, mesh in LAYOUTS.items():
    config.mesh.update(**{"data": 1, "fsdp": 1, "model": 1, **mesh})
    placed, _ = train.shard_and_compile(runner, state, tx)
    held = sharding.bytes_per_device((placed.params, placed.opt_state))
    out[layout] = max(held.values()) / MIB
  return out


def remat_mib(length: int, rows: int, tiny: bool) -> dict[str, tuple[int, float]]:
  """remat -> (optimization barriers in the lowered step: jax.checkpoint's, temp MiB of the
  compiled step) of the LM on one device."""
  out = {}
  for remat in ("none", "layer", "attention"):
    config = lm.get_config("tiny" if tiny else None)
    config.train.update(length=length, batch_size=rows, remat=remat)
    runner = train.make_runner(config)
    tx = train.make_optimizer(config.train)
    state = train.init_state(runner, tx)
    model = type(runner.model)(dataclasses.replace(runner.model.config, remat=remat))
    step = jax.jit(functools.partial(train.train_step, runner=runner, model=model, tx=tx,
                                     label_smoothing=0.0))
    lowered = step.lower(state, runner.train_batch(0))
    stats = lowered.compile().memory_analysis()
    out[remat] = (lowered.as_text().count("optimization_barrier"), stats.temp_size_in_bytes / MIB)
  return out


def print_state(tiny: bool) -> None:
  print("Parameters + Adam moments, MiB on the device holding the most (8 emulated devices)\n")
  print("| config | " + " | ".join(LAYOUTS) + " | fsdp=8 / (1 device / 8) |")
  print("|---|" + "---:|" * (len(LAYOUTS) + 1))
  for name in CONFIGS:
    mib = state_mib(name, tiny)
    ratio = mib["fsdp=8"] / (mib["1 device"] / 8)
    print(f"| {name} | " + " | ".join(f"{v:.3f}" for v in mib.values()) + f" | {ratio:.3f} |",
          flush=True)


def print_remat(length: int, rows: int, tiny: bool) -> None:
  print(f"\nconfigs/lm.py training step, {rows} rows x {length} tokens, one device: XLA temp "
        "MiB\n")
  print(f"| remat | barriers in the lowered step | temp MiB ({jax.default_backend()}) |")
  print("|---|---:|---:|")
  for remat, (barriers, mib) in remat_mib(length, rows, tiny).items():
    print(f"| {remat} | {barriers} | {mib:,.1f} |", flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", choices=("state", "remat", "all"), default="all")
  parser.add_argument("--length", type=int, default=128, help="LM tokens per row (remat)")
  parser.add_argument("--rows", type=int, default=32, help="LM rows per batch (remat)")
  parser.add_argument("--smoke", action="store_true",
                      help="tiny configs, 64 tokens: that the command runs, no figures")
  args = parser.parse_args()
  if args.part in ("state", "all"):
    print_state(args.smoke)
  if args.part in ("remat", "all"):
    print_remat(64 if args.smoke else args.length, 2 if args.smoke else args.rows, args.smoke)


if __name__ == "__main__":
  main()
