"""The runner on a device mesh: data, model, FSDP and sequence parallelism give the
single-device losses, each check in a subprocess on 8 emulated devices (tests/multidevice/).
The mesh settings refused before anything runs are the unit part, tests/test_train_mesh.py."""

import pytest

from tests.multidevice.run import run_check

import test_train_mesh as unit_cases

pytestmark = pytest.mark.integration  # a process of 8 emulated devices per check


@pytest.mark.multidevice
def test_sharded_run_matches_single_device():
  """--config.mesh.{data,model,seq}=2 on 8 emulated devices logs the 1-device losses."""
  lines = run_check("check_train.py")
  assert any(line.startswith("OK runner layout") for line in lines), lines
  assert any(line.startswith("OK runner data_x_model_x_seq") for line in lines), lines
  assert any(line.startswith("OK lm data_x_seq") for line in lines), lines


@pytest.mark.multidevice
@pytest.mark.slow  # 80 s; FSDP trains as one device in CI with the sequence mesh (below)
def test_fsdp_with_remat_matches_single_device():
  """--config.mesh.data=2 --config.mesh.fsdp=4 --config.train.remat=layer on 8 emulated devices:
  the 1-device losses of the tiny dates and LM configs, 1/fsdp of the state on each device."""
  lines = run_check("check_fsdp.py")
  for name in ("dates", "lm"):
    assert any(line.startswith(f"OK {name} data=2 x fsdp=4 remat=layer") for line in lines), lines
    for layout in ("data=2 bytes fsdp=4", "bytes fsdp=8"):
      assert any(line.startswith(f"OK {name} {layout}") for line in lines), lines


@pytest.mark.multidevice
def test_ulysses_trains_the_lm_as_one_device():
  """--config.mesh.seq_strategy=ulysses on data=2 x seq=4 with heads that 4 divides (H = G = 4):
  the 1-device losses of the tiny LM."""
  assert run_check("check_seq_train.py", "ulysses")[0].startswith("OK lm ulysses ulysses")


@pytest.mark.multidevice
@pytest.mark.parametrize("strategy", [
    pytest.param("all_gather", marks=pytest.mark.slow),  # all-gather: tests/parallel in CI
    "ring"])
def test_fsdp_with_a_sequence_mesh_trains_the_lm_as_one_device(strategy):
  """--config.mesh.fsdp=2 --config.mesh.seq=4 --config.train.remat=layer: the 1-device losses
  of the tiny LM."""
  lines = run_check("check_seq_train.py", "fsdp_seq", strategy)
  assert lines[0].startswith(f"OK lm fsdp_seq {strategy}"), lines


# Moved from the unit part for its time (5 s: the runner is built before the refusal).
test_mesh_must_divide_batch = unit_cases.check_mesh_must_divide_batch
