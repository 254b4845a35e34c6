"""Run under XLA_FLAGS=--xla_force_host_platform_device_count=8
(tests/test_train_mesh_integration.py does).

The experiment runner on a data x model x seq = 2 x 2 x 2 mesh (batch split, heads and FFN split,
sequence-parallel attention by the config's default strategy and layout) must log the
single-device run's losses and evaluation metrics (same seed), with the train state really split;
the LM's training step on data x seq = 2 x 4 must give the single-device losses for 20 steps.
Prints one 'OK ...' per check.
"""

import sys
import tempfile

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from configs import algorithmic, lm
from experiments import metrics, train

TIMING_KEYS = ("train_seconds", "steps_per_second", "train/tokens_per_second")


def tiny_config(data: int, model: int, seq: int):
  config = algorithmic.get_config("copy,tiny")
  config.task.kwargs.max_len = 8
  config.train.steps = 10
  config.eval.every = 10
  config.mesh.update(data=data, model=model, seq=seq)
  return config


def run(data: int, model: int, seq: int) -> tuple[list[dict], dict]:
  with tempfile.TemporaryDirectory() as workdir:
    summary = train.train_and_evaluate(tiny_config(data, model, seq), workdir)
    rows = [{k: v for k, v in r.items() if k not in TIMING_KEYS}
            for r in metrics.read_rows(workdir)]
  return rows, {k: v for k, v in summary.items() if k not in TIMING_KEYS}


def check_layout():
  config = tiny_config(2, 2, 2)
  runner = train.make_runner(config)
  tx = train.make_optimizer(config.train)
  state, _ = train.shard_and_compile(runner, train.init_state(runner, tx), tx)
  kernel = state.params["encoder"]["layer_0"]["self_attention"]["query"]["kernel"]
  assert kernel.sharding.spec == P(None, "model", None), kernel.sharding.spec
  assert kernel.addressable_shards[0].data.shape[1] == kernel.shape[1] // 2
  ffn = state.opt_state[1][0].mu["encoder"]["layer_0"]["ffn"]["Dense_1"]["kernel"]
  assert ffn.sharding.spec == P("model", None), ffn.sharding.spec
  print("OK runner layout")


def step_losses(config, steps: int) -> list[float]:
  """Training losses of `steps` steps of the runner's jitted step on the config's mesh (no
  evaluation, no checkpoints: the step alone)."""
  runner = train.make_runner(config)
  tx = train.make_optimizer(config.train)
  state, step_fn = train.shard_and_compile(runner, train.init_state(runner, tx), tx)
  losses = []
  for step in range(steps):
    state, step_metrics = step_fn(state, runner.train_batch(step))
    losses.append(float(step_metrics["loss"]))
  return losses


def check_lm_on_a_sequence_mesh():
  """The LM (packed documents: segment ids, rotary positions, local and global layers) on
  data x seq = 2 x 4, all-gather over zig-zag shards and the ring over striped ones, takes the
  single-device steps."""
  config = lm.get_config("tiny")
  want = step_losses(config, 20)
  for strategy, layout in (("all_gather", "zigzag"), ("ring", "striped")):
    config.mesh.update(data=2, seq=4, seq_strategy=strategy, seq_layout=layout)
    got = step_losses(config, 20)
    np.testing.assert_allclose(got, want, rtol=2e-4)
    print(f"OK lm data_x_seq {strategy} {layout} losses={[round(x, 5) for x in got[::5]]}")


def main():
  assert jax.device_count() == 8, jax.device_count()
  check_layout()
  check_lm_on_a_sequence_mesh()
  want_rows, want_summary = run(1, 1, 1)
  got_rows, got_summary = run(2, 2, 2)
  assert [r["step"] for r in got_rows] == [r["step"] for r in want_rows]
  for got, want in zip(got_rows, want_rows):
    for key, value in want.items():
      np.testing.assert_allclose(got[key], value, rtol=2e-4, atol=1e-5, err_msg=key)
  assert got_summary.keys() == want_summary.keys()
  np.testing.assert_allclose(got_summary["eval_loss"], want_summary["eval_loss"], rtol=2e-4)
  losses = [round(r["train/loss"], 5) for r in got_rows if "train/loss" in r]
  print(f"OK runner data_x_model_x_seq losses={losses}")


if __name__ == "__main__":
  sys.exit(main())
