"""Run under XLA_FLAGS=--xla_force_host_platform_device_count=8
(tests/test_train_mesh_integration.py does), with one check's name as the argument:

  ulysses   the tiny LM with H = G = 4 heads (configs/lm.py's tiny has 2 and 1, which 4 sequence
            devices cannot split) on data=2 x seq=4 with mesh.seq_strategy=ulysses;
  fsdp_seq [STRATEGY]  the tiny LM with remat=layer on data=1 x fsdp=2 x seq=4, the state split
            over fsdp, attention by STRATEGY (all_gather unless given) in the zig-zag layout;

each gives the single-device losses of the same config for 5 steps. Prints 'OK ...'.
"""

import sys

import jax
import numpy as np

from configs import lm
from tests.multidevice.check_train import step_losses

STEPS = 5


def check(name: str, config, **mesh):
  """`config` on one device, then on `mesh` (config.mesh keys): the same losses."""
  want = step_losses(config, STEPS)
  config.mesh.update(**mesh)
  got = step_losses(config, STEPS)
  np.testing.assert_allclose(got, want, rtol=2e-4, err_msg=name)
  print(f"OK lm {name} {config.mesh.seq_strategy} losses={[round(x, 5) for x in got]}")


def main(name: str, strategy: str = "all_gather"):
  assert jax.device_count() == 8, jax.device_count()
  config = lm.get_config("tiny")
  if name == "ulysses":
    config.model.update(num_heads=4, num_kv_heads=4)  # per sequence device: 1 of each
    check(name, config, data=2, seq=4, seq_strategy="ulysses")
  elif name == "fsdp_seq":
    config.train.remat = "layer"
    check(name, config, fsdp=2, seq=4, seq_strategy=strategy)
  else:
    raise SystemExit(f"unknown check {name!r}: ulysses or fsdp_seq")


if __name__ == "__main__":
  sys.exit(main(*sys.argv[1:]))
