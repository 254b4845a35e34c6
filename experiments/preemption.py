"""SIGTERM or SIGINT as a preemption: training stops after a step every process agrees on, saves
that step's checkpoint, and the entry point exits with 128 + the signal's number (143, 130); the
same command then resumes from it.

Schedulers send SIGTERM before they kill a job (SLURM at the time limit or on preemption,
Kubernetes when it evicts a pod, a cloud VM before it is reclaimed), then SIGKILL after a grace
period; Ctrl-C at a terminal sends SIGINT. While the training loop runs, either only sets a flag
(the first one received names the stop; another, or the same again, changes nothing), and after
every step the loop asks `StopSignal.agreed()` whether to stop. With several processes that is a
collective, an all-gather of every process's flag (`distributed.any_process`) that each process
calls after the same steps: all stop after the same step, whichever process got the signal and
whenever (all of them, one alone, or each a step apart), so they save that checkpoint together as
orbax requires, and none waits in a collective that another never reaches. A process that stops
on another's signal reports SIGTERM. Outside the loop both keep their default action (SIGINT a
KeyboardInterrupt; JAX's own preemption notifier, which would swallow SIGTERM, is off:
experiments.distributed): before the loop nothing was trained since the last checkpoint, after
it the last step is saved. A SIGINT this process ignores (a background job of a shell without
job control, which Ctrl-C at that shell must not reach) stays ignored.
"""

from __future__ import annotations

import signal
import threading

from experiments import distributed

SIGNALS = (signal.SIGTERM, signal.SIGINT)  # a scheduler's preemption; Ctrl-C


def exit_code(signum: int) -> int:
  """128 + the signal's number: how shells and schedulers report an end by it (143, 130)."""
  return 128 + signum


EXIT_CODE = exit_code(signal.SIGTERM)  # 143


class Preempted(Exception):
  """Training stopped by signal `signum` after `step`, whose checkpoint is saved."""

  def __init__(self, signum: int, step: int):
    super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}, saved as "
                     f"checkpoint {step}; the same command resumes from it")
    self.signum, self.step = signum, step
    self.exit_code = exit_code(signum)


class StopSignal:
  """Within `with StopSignal() as stop:`, SIGTERM or SIGINT asks training to stop instead of
  ending the process; `stop.agreed()`, called after each step, says whether to stop there, and
  `stop.signum` names the first signal received (SIGTERM until one is).

  The answer is the same on every process, so each must call `agreed` after the same steps.
  Python runs signal handlers on the main thread only: entered from another thread, nothing is
  installed and nothing asks to stop.
  """
  signum = signal.SIGTERM

  def __init__(self):
    self.received = False
    self._previous = {}  # signal -> the handler before, for those installed

  def __enter__(self) -> StopSignal:
    if threading.current_thread() is threading.main_thread():
      for signum in SIGNALS:
        if not (signum == signal.SIGINT and signal.getsignal(signum) == signal.SIG_IGN):
          self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc_info) -> None:
    for signum, previous in self._previous.items():  # None: set outside Python, not put back
      signal.signal(signum, signal.SIG_DFL if previous is None else previous)
    self._previous = {}

  def _handle(self, signum, frame) -> None:
    del frame
    if not self.received:
      self.received, self.signum = True, signum

  def agreed(self) -> bool:
    """Whether any process has received a signal (a collective with several processes)."""
    return distributed.any_process(self.received)
