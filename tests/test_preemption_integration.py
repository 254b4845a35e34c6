"""SIGTERM and SIGINT as a preemption (experiments.preemption), end to end: a training process
stops after the step it is at, saves it and exits with 143 (130 on SIGINT); the launcher passes
SIGTERM on to every process and leaves none running; the same command then resumes and ends
with the uninterrupted run's metrics. The signal handler and the launcher's exit codes,
in-process, are the unit part (tests/test_preemption.py).

The runs train the tiny copy task (strings of length <= 8: one shape, one compilation) in
subprocesses sharing a persistent compilation cache, so that reruns start in seconds.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from experiments import checkpoints, launch, preemption
from test_multiprocess_integration import (ROOT, TIMING, shared_children, shared_env, assert_same_rows,
                                           launch_command, rows)

pytestmark = pytest.mark.integration  # training subprocesses, signalled


COPY = ("--config", "configs/algorithmic.py:copy,tiny", "--config.task.kwargs.max_len=8",
        "--config.eval.every=1000", "--config.eval.num_examples=16")  # one evaluation: the last
# One process steps fast: many steps keep it training well after the first checkpoint is seen.
ONE = (*COPY, "--config.train.steps=300", "--config.train.checkpoint_every=20",
       "--config.train.log_every=20")
# Two processes of one device each (data = 2) step several times slower (gloo between them).
TWO = (*COPY, "--config.train.steps=40", "--config.train.checkpoint_every=5",
       "--config.train.log_every=5")
STOP_SECONDS = 30  # a signalled process saves and exits within this (the launcher's grace)
STOPPED = (r"stopped by {} after step (\d+), saved as checkpoint \1; "
           r"the same command resumes from it")  # .format(the signal's name)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  """The subprocesses' environment: one CPU device, a compilation cache shared by every run."""
  return shared_env() | {"JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax_cache")),
                   "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def train_command(workdir, *args):
  return [sys.executable, "-m", "experiments.train", *args, "--workdir", str(workdir)]


def run(command, env):
  result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def one_reference(tmp_path_factory, env):
  workdir = tmp_path_factory.mktemp("one_uninterrupted")
  run(train_command(workdir, *ONE), env)
  return workdir


@pytest.fixture(scope="module")
def two_reference(tmp_path_factory, env):
  """TWO's run in one process on one device: two processes reach its losses to 1e-5."""
  workdir = tmp_path_factory.mktemp("two_uninterrupted")
  run(train_command(workdir, *TWO), env)
  return workdir


def kill_left(pids) -> None:
  """SIGKILL those of `pids` (launchers and trainers this test started) still running: a failed
  test leaves none behind."""
  for pid in pids:
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        if b"experiments." in f.read():
          os.kill(pid, signal.SIGKILL)
    except (FileNotFoundError, ProcessLookupError):
      pass


def signal_once_training(command, workdir, env, checkpoint: int, signum=signal.SIGTERM):
  """Start `command`, send it `signum` once checkpoint `checkpoint` is on disk (the loop runs);
  return (the process, the pids of its children then, the monotonic time of the signal)."""
  err = open(workdir / "stderr.txt", "w")
  proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
  err.close()
  saved, deadline = workdir / checkpoints.CHECKPOINT_DIR / str(checkpoint), time.monotonic() + 300
  while not saved.exists() and proc.poll() is None and time.monotonic() < deadline:
    time.sleep(0.02)
  children = shared_children(proc.pid) if proc.poll() is None else []
  if not saved.exists():
    kill_left([*children, proc.pid])
    pytest.fail(f"no checkpoint {checkpoint}: {(workdir / 'stderr.txt').read_text()[-3000:]}")
  proc.send_signal(signum)
  return proc, children, time.monotonic()


def stopped_step(workdir, signum=signal.SIGTERM) -> int:
  """The step of the one stop line (by `signum`), checked: it names a saved checkpoint."""
  lines = (workdir / "stderr.txt").read_text().splitlines()
  stops = [m for m in (re.fullmatch(STOPPED.format(signum.name), line) for line in lines) if m]
  assert len(stops) == 1, lines[-20:]  # process 0 alone prints it
  step = int(stops[0][1])
  assert str(step) in os.listdir(workdir / checkpoints.CHECKPOINT_DIR)
  return step


def summary(workdir) -> dict:
  with open(workdir / "summary.json") as f:
    return {k: v for k, v in json.load(f).items() if k not in TIMING}


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)],
                         ids=["SIGTERM", "SIGINT"])
def test_a_signal_saves_the_step_exits_128_plus_it_and_a_rerun_resumes(tmp_path, env, request,
                                                                       signum, code):
  """SIGTERM (a scheduler) or SIGINT (Ctrl-C) mid-run: the process finishes its step, saves it,
  says so in one line, no traceback, and exits with 143 or 130 in seconds; after SIGTERM the
  same command resumes and writes the uninterrupted run's rows and summary (the rerun, the
  longest part, once: how a run stopped does not change how it resumes)."""
  if signum == signal.SIGINT and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    pytest.skip("SIGINT is ignored here: the training process would inherit that")
  command = train_command(tmp_path, *ONE)
  proc, _, sent = signal_once_training(command, tmp_path, env, checkpoint=20, signum=signum)
  assert proc.wait(timeout=STOP_SECONDS + 60) == preemption.exit_code(signum) == code
  assert time.monotonic() - sent < STOP_SECONDS
  step = stopped_step(tmp_path, signum)
  assert 20 <= step < 300
  assert "Traceback" not in (tmp_path / "stderr.txt").read_text()
  assert max(r["step"] for r in rows(tmp_path)) <= step
  if signum == signal.SIGTERM:
    one_reference = request.getfixturevalue("one_reference")
    run(command, env)
    assert rows(tmp_path) == rows(one_reference)  # same process, same device: exactly
    assert summary(tmp_path) == summary(one_reference)


@pytest.mark.slow  # 100 s; one process's signal and resume, and the launcher's runs, in CI
def test_sigterm_to_the_launcher_stops_every_process_and_a_rerun_resumes(tmp_path, env,
                                                                        two_reference):
  """SIGTERM to `experiments.launch` of 2 processes: both stop after the same step and save it,
  no process is left, the launcher exits with 143 before its grace period would kill them; the
  same command resumes to the uninterrupted run."""
  command = launch_command(tmp_path, *TWO, "--config.mesh.data=2", devices=1)
  proc, children, sent = signal_once_training(command, tmp_path, env, checkpoint=5)
  try:
    assert len(children) == 2
    code = proc.wait(timeout=launch.GRACE_SECONDS + 60)
    assert not [pid for pid in children if os.path.exists(f"/proc/{pid}")]
  finally:
    kill_left(children)
  assert code == 143
  assert time.monotonic() - sent < launch.GRACE_SECONDS  # they stopped by themselves
  assert ("launch: stopped by SIGTERM; process 0 exited with 143; process 1 exited with 143"
          in (tmp_path / "stderr.txt").read_text())
  assert 5 <= stopped_step(tmp_path) < 40
  run(command, env)
  assert_same_rows(tmp_path, two_reference)
