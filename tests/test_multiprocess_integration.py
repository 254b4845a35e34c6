"""The experiment as several processes on JAX's distributed runtime, over loopback
(`python -m experiments.launch`, `experiments.distributed`): 2 processes x 2 CPU devices equal
one process on one device, the sequence axis and FSDP spanning processes, a process killed
after a checkpoint ends the run with a named error and a restart resumes it exactly, and wrong
settings are refused by name at the command line. The settings' and the launcher's own checks
are the unit part, tests/test_multiprocess.py."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from configs import dates, lm
from experiments import checkpoints, distributed, metrics, train

pytestmark = pytest.mark.integration  # every case starts training processes

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATES = ("--config", "configs/dates.py:tiny")
LM = ("--config", "configs/lm.py:tiny")
TIMING = ("train_seconds", "steps_per_second", "train/tokens_per_second")
HEARTBEAT = 5


def shared_env():
  return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
              XLA_FLAGS="--xla_force_host_platform_device_count=1")


def train_once(workdir, *args, timeout=600):
  """One process on one device: the reference run."""
  result = subprocess.run([sys.executable, "-m", "experiments.train", *args, "--workdir",
                           str(workdir)], cwd=ROOT, env=shared_env(), capture_output=True, text=True,
                          timeout=timeout)
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def launch_command(workdir, *args, processes=2, devices=2):
  return [sys.executable, "-m", "experiments.launch", "--processes", str(processes),
          "--devices-per-process", str(devices), "--heartbeat-seconds", str(HEARTBEAT), "--",
          *args, "--workdir", str(workdir)]


def launch(workdir, *args, check=True, timeout=900, processes=2, devices=2):
  result = subprocess.run(launch_command(workdir, *args, processes=processes, devices=devices),
                          cwd=ROOT, env=shared_env(), capture_output=True, text=True, timeout=timeout)
  if check:
    assert result.returncode == 0, result.stderr[-3000:]
  return result


def rows(workdir):
  return [{k: v for k, v in r.items() if k not in TIMING} for r in metrics.read_rows(workdir)]


def assert_same_rows(got_dir, want_dir, rtol=1e-5):
  got, want = rows(got_dir), rows(want_dir)
  assert [r["step"] for r in got] == [r["step"] for r in want]
  for g, w in zip(got, want):
    assert g.keys() == w.keys()
    for key in w:
      np.testing.assert_allclose(g[key], w[key], rtol=rtol, atol=1e-6, err_msg=f"{key} {w}")


def final_params(workdir, config):
  """The parameters of `workdir`'s newest checkpoint, read onto this process's one device."""
  runner = train.make_runner(config)
  tx = train.make_optimizer(config.train)
  with checkpoints.open_manager(str(workdir)) as manager:
    state, _ = checkpoints.restore_newest_readable(
        manager, train.init_state(runner, tx), str(workdir / "aside"), None)
  return jax.device_get(state.params)


def assert_same_params(got_dir, want_dir, config, rtol=1e-5):
  """Every parameter to `rtol`, but the attention's key biases: their gradient is zero in exact
  arithmetic (the softmax ignores a constant added to every logit of a row), so Adam turns
  rounding noise into steps of full size, different on any other mesh; what they compute is
  not (the losses compare equal)."""
  got, want = final_params(got_dir, config), final_params(want_dir, config)
  flat = jax.tree_util.tree_flatten_with_path(want)[0]
  for (path, w), g in zip(flat, jax.tree.leaves(got)):
    name = jax.tree_util.keystr(path)
    if "['key']['bias']" not in name:
      np.testing.assert_allclose(g, w, rtol=rtol, atol=1e-6, err_msg=name)


@pytest.fixture(scope="module")
def dates_reference(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("dates_one_device")
  train_once(workdir, *DATES)
  return workdir


@pytest.fixture(scope="module")
def lm_reference(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("lm_one_device")
  train_once(workdir, *LM)
  return workdir


def test_encoder_decoder_on_two_processes_equals_one_device(dates_reference, tmp_path):
  """dates:tiny on a data x model = 2 x 2 mesh of 2 processes x 2 devices: the losses and
  evaluation of every logged step and the final parameters of one process on one device;
  process 0 alone writes the files and prints the summary."""
  result = launch(tmp_path, *DATES, "--config.mesh.data=2", "--config.mesh.model=2")
  assert_same_rows(tmp_path, dates_reference)
  assert_same_params(tmp_path, dates_reference, dates.get_config("tiny"))
  assert result.stdout.count('"task": "dates"') == 1
  assert (tmp_path / "summary.json").exists() and (tmp_path / "learning_curves.png").exists()


@pytest.mark.parametrize("processes, mesh", [
    pytest.param(4, ("--config.mesh.data=2", "--config.mesh.seq=2",
                     "--config.mesh.seq_strategy=ring"),
                 marks=pytest.mark.slow),  # 4 processes, 100 s: the ring on 8 devices in CI

    pytest.param(2, ("--config.mesh.seq=4", "--config.mesh.seq_strategy=all_gather"),
                 marks=pytest.mark.slow),  # all-gather on 8 devices: tests/parallel
    (2, ("--config.mesh.data=2", "--config.mesh.fsdp=2")),
], ids=["data_x_seq_ring", "seq_all_gather", "data_x_fsdp"])
def test_lm_with_the_sequence_or_fsdp_across_processes(processes, mesh, lm_reference, tmp_path):
  """lm:tiny on 4 devices: data x seq = 2 x 2 over 4 processes of 1 device with the ring (its
  ppermute crosses a process boundary every step, and so does the data axis), the sequence
  over 2 processes x 2 devices with all-gather, and FSDP over data x fsdp: one device's losses
  and parameters."""
  launch(tmp_path, *LM, *mesh, processes=processes, devices=4 // processes)
  assert_same_rows(tmp_path, lm_reference)
  assert_same_params(tmp_path, lm_reference, lm.get_config("tiny"))


def shared_children(pid: int) -> list[int]:
  with open(f"/proc/{pid}/task/{pid}/children") as f:
    return [int(x) for x in f.read().split()]


@pytest.mark.slow  # 150 s, most of it the heartbeat's timeout; one process's kill-and-resume:
# tests/test_train_integration.py
def test_a_killed_process_ends_the_run_and_a_restart_resumes_it(dates_reference, tmp_path):
  """Process 1 killed after the step-10 checkpoint: process 0 stops within the heartbeat (the
  runtime names the silent peer), the launcher names both ends; the same command then resumes
  from the checkpoint and ends equal to the uninterrupted one-device run."""
  args = (*DATES, "--config.mesh.data=2", "--config.mesh.model=2")
  launcher = subprocess.Popen(launch_command(tmp_path, *args), cwd=ROOT, env=shared_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  checkpoint = tmp_path / checkpoints.CHECKPOINT_DIR / "10"
  deadline = time.monotonic() + 400
  while not checkpoint.exists() and launcher.poll() is None and time.monotonic() < deadline:
    time.sleep(0.2)
  assert checkpoint.exists(), launcher.communicate(timeout=60)
  os.kill(shared_children(launcher.pid)[1], signal.SIGKILL)
  killed = time.monotonic()
  _, stderr = launcher.communicate(timeout=HEARTBEAT + 120)
  assert launcher.returncode == 1
  assert time.monotonic() - killed < HEARTBEAT + 60  # the heartbeat, not the grace period
  assert "process 1 failed first" in stderr and "process 1 killed by SIGKILL" in stderr
  assert "stopped sending heartbeats" in stderr  # process 0's runtime named its silent peer
  assert "process 0 still running" not in stderr
  launch(tmp_path, *args)  # the same command: resumes from the last complete checkpoint
  assert_same_rows(tmp_path, dates_reference)
  assert_same_params(tmp_path, dates_reference, dates.get_config("tiny"))


def test_a_wrong_process_id_or_a_port_in_use_is_named(tmp_path):
  """From the command line: the training entry point says which variable is wrong, and the
  launcher and process 0 which address is taken, each in one line, before any training."""
  env = shared_env() | {distributed.COORDINATOR: "127.0.0.1:1234", distributed.NUM_PROCESSES: "2",
                  distributed.PROCESS_ID: "2"}
  run = lambda cmd, env: subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                        timeout=120)
  train_cmd = [sys.executable, "-m", "experiments.train", *DATES, "--workdir", str(tmp_path)]
  result = run(train_cmd, env)
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1] == (
      "error: FLAX_MHA_PROCESS_ID must be in [0, 2) for FLAX_MHA_NUM_PROCESSES=2, got 2")
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    result = run(train_cmd, env | {distributed.PROCESS_ID: "0",
                                   distributed.COORDINATOR: f"127.0.0.1:{port}"})
    assert result.returncode == 1
    assert f"error: the coordinator address 127.0.0.1:{port} cannot be used" in result.stderr
    launcher = [sys.executable, "-m", "experiments.launch", "--port", str(port), "--", *DATES,
                "--workdir", str(tmp_path)]
    result = run(launcher, shared_env())
    assert result.returncode == 2 and f"127.0.0.1:{port} cannot be used" in result.stderr
  assert not any(tmp_path.iterdir())  # nothing written
