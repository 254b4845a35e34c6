"""SIGTERM as a preemption (experiments.preemption), in-process: the signal handler sets a flag
and ends nothing, and the launcher's exit code says how its processes ended. The trainings
stopped and resumed are in tests/test_preemption_integration.py."""

from __future__ import annotations

import os
import signal
import time

import pytest

from experiments import launch, preemption


def test_sigterm_only_sets_the_flag_while_the_signal_is_caught():
  """Inside StopSignal, SIGTERM to this very process sets the flag and ends nothing; one
  process agrees with itself; on exit the handler before it is back."""
  before = signal.getsignal(signal.SIGTERM)
  with preemption.StopSignal() as stop:
    if signal.getsignal(signal.SIGTERM) != stop._handle:  # pylint: disable=protected-access
      pytest.skip("not on the main thread: SIGTERM would end this test process")
    assert not stop.agreed()
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 10
    while not stop.received and time.monotonic() < deadline:  # Python runs the handler soon
      time.sleep(0.01)
    assert stop.agreed()
  assert signal.getsignal(signal.SIGTERM) is before


def test_the_launcher_exit_code_says_how_its_processes_ended(capsys):
  """128 + the launcher's signal; 143 when every process stopped on a SIGTERM of its own; 1
  naming the first failure, found from the codes when all ended between two polls."""
  assert launch.conclude([0, 0], None, None) == 0
  assert launch.conclude([143, None], None, signal.SIGTERM) == 143
  assert capsys.readouterr().err == ("launch: stopped by SIGTERM; process 0 exited with 143; "
                                     "process 1 still running (killed)\n")
  assert launch.conclude([143, 143], None, None) == 143
  assert launch.conclude([-2, 1], None, signal.SIGINT) == 130
  assert launch.conclude([0, -9], None, None) == 1
  assert capsys.readouterr().err.splitlines()[-1] == (
      "launch: process 1 failed first; process 0 exited with 0; process 1 killed by SIGKILL")
