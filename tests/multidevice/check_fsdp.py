"""Run under XLA_FLAGS=--xla_force_host_platform_device_count=8
(tests/test_train_mesh_integration.py does).

FSDP with remat: the training step of the tiny dates (Transformer) and LM configs on data=2 x
fsdp=4 with train.remat=layer must give the single-device losses for 20 steps, with parameters
and Adam moments split as flax_mha.parallel.sharding declares (each moment placed like its parameter) and
1/fsdp of their bytes on each device; on fsdp=8, 1/8. Prints one 'OK ...' per check.
"""

import sys

import jax
import numpy as np

from configs import dates, lm
from experiments import train
from flax_mha.parallel import sharding

CONFIGS = {"dates": lambda: dates.get_config("tiny"), "lm": lambda: lm.get_config("tiny")}


def config_for(name: str, data: int = 1, fsdp: int = 1, remat: str = "none"):
  config = CONFIGS[name]()
  config.train.batch_size = 8  # data x fsdp divides it (the LM's tiny batch is 4)
  config.train.remat = remat
  config.mesh.update(data=data, fsdp=fsdp)
  return config


def placed_state(config):
  """(runner, sharded state, step_fn) as experiments.train builds them."""
  runner = train.make_runner(config)
  tx = train.make_optimizer(config.train)
  state, step_fn = train.shard_and_compile(runner, train.init_state(runner, tx), tx)
  return runner, state, step_fn


def losses(config) -> tuple[list[float], train.TrainState]:
  runner, state, step_fn = placed_state(config)
  out = []
  for step in range(config.train.steps):
    state, metrics = step_fn(state, runner.train_batch(step))
    out.append(float(metrics["loss"]))
  return out, state


def check_moments_follow_params(state):
  """Adam's mu and nu (optax's chain: clip, then adamw's scale_by_adam) carry the sharding of
  the parameter at the same path, after steps of the compiled program."""
  adam = state.opt_state[1][0]
  for moments in (adam.mu, adam.nu):
    jax.tree.map(lambda m, p: np.testing.assert_equal(m.sharding.spec, p.sharding.spec),
                 moments, state.params)
  specs = {s.sharding.spec for s in jax.tree.leaves(state.params)}
  split = lambda spec: any("fsdp" in (a if isinstance(a, tuple) else (a,)) for a in spec)
  assert all(map(split, specs)), specs  # the tiny models' dims: each has one that 4 divides


def check_bytes(name, state, fsdp: int):
  """The largest per-device share of params + optimizer state within 1.2x of 1/fsdp."""
  tree = (state.params, state.opt_state)
  total = sum(x.nbytes for x in jax.tree.leaves(tree))
  worst = max(sharding.bytes_per_device(tree).values())
  assert worst <= 1.2 * total / fsdp, (name, worst, total, fsdp)
  print(f"OK {name} bytes fsdp={fsdp}: {worst} per device of {total} "
        f"({worst * fsdp / total:.3f} x 1/{fsdp})")


def main():
  assert jax.device_count() == 8, jax.device_count()
  for name in CONFIGS:
    want, _ = losses(config_for(name))
    got, state = losses(config_for(name, data=2, fsdp=4, remat="layer"))
    np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=name)
    check_moments_follow_params(state)
    check_bytes(f"{name} data=2", state, fsdp=4)
    print(f"OK {name} data=2 x fsdp=4 remat=layer losses={[round(x, 5) for x in got[::5]]}")
    _, state, _ = placed_state(config_for(name, fsdp=8))
    check_bytes(name, state, fsdp=8)


if __name__ == "__main__":
  sys.exit(main())
