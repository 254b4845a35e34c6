"""SIGTERM and SIGINT as a preemption (experiments.preemption), in-process: the signal handler
sets a flag and ends nothing, and the launcher's exit code says how its processes ended. The
trainings stopped and resumed are in tests/test_preemption_integration.py."""

from __future__ import annotations

import os
import signal
import time

import pytest

from experiments import launch, preemption


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_stop_signal_only_sets_the_flag_while_it_is_caught(signum):
  """Inside StopSignal, SIGTERM or SIGINT (Ctrl-C) to this very process sets the flag, names
  the signal and ends nothing (no KeyboardInterrupt); another signal after it changes nothing;
  one process agrees with itself; on exit the handlers before it are back."""
  before = {s: signal.getsignal(s) for s in preemption.SIGNALS}
  with preemption.StopSignal() as stop:
    if signal.getsignal(signum) != stop._handle:  # pylint: disable=protected-access
      pytest.skip(f"not on the main thread: {signum.name} would end this test process")
    assert not stop.agreed() and stop.signum == signal.SIGTERM
    for sent in (signum, *(s for s in preemption.SIGNALS if s != signum)):
      os.kill(os.getpid(), sent)
      deadline = time.monotonic() + 10
      while not stop.received and time.monotonic() < deadline:  # Python runs the handler soon
        time.sleep(0.01)
      time.sleep(0.05)  # the second signal's handler too
    assert stop.agreed() and stop.signum == signum
  assert {s: signal.getsignal(s) for s in preemption.SIGNALS} == before
  stopped = preemption.Preempted(stop.signum, 7)
  assert stopped.exit_code == {signal.SIGTERM: 143, signal.SIGINT: 130}[signum]
  assert str(stopped) == (f"stopped by {signum.name} after step 7, saved as checkpoint 7; "
                          "the same command resumes from it")


def test_an_ignored_sigint_stays_ignored():
  """A process started with SIGINT ignored (a background job of a shell without job control)
  is not stopped by a Ctrl-C meant for that shell; SIGTERM is caught still."""
  previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
  try:
    with preemption.StopSignal() as stop:
      if signal.getsignal(signal.SIGTERM) != stop._handle:  # pylint: disable=protected-access
        pytest.skip("not on the main thread: nothing is installed")
      assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
  finally:
    signal.signal(signal.SIGINT, previous)


def test_the_launcher_exit_code_says_how_its_processes_ended(capsys):
  """128 + the launcher's signal; 143 (130) when every process stopped on a SIGTERM (SIGINT)
  of its own; 1 naming the first failure, found from the codes when all ended between two
  polls."""
  assert launch.conclude([0, 0], None, None) == 0
  assert launch.conclude([143, None], None, signal.SIGTERM) == 143
  assert capsys.readouterr().err == ("launch: stopped by SIGTERM; process 0 exited with 143; "
                                     "process 1 still running (killed)\n")
  assert launch.conclude([143, 143], None, None) == 143
  assert launch.conclude([130, 130], None, None) == 130
  assert launch.conclude([-2, 1], None, signal.SIGINT) == 130
  assert launch.conclude([0, -9], None, None) == 1
  assert capsys.readouterr().err.splitlines()[-1] == (
      "launch: process 1 failed first; process 0 exited with 0; process 1 killed by SIGKILL")
