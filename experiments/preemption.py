"""SIGTERM as a preemption: training stops after a step every process agrees on, saves that step's
checkpoint, and the entry point exits with EXIT_CODE; the same command then resumes from it.

Schedulers send SIGTERM before they kill a job (SLURM at the time limit or on preemption,
Kubernetes when it evicts a pod, a cloud VM before it is reclaimed), then SIGKILL after a grace
period. While the training loop runs, SIGTERM only sets a flag, and after every step the loop asks
`StopSignal.agreed()` whether to stop. With several processes that is a collective, an all-gather
of every process's flag (`distributed.any_process`) that each process calls after the same steps:
all stop after the same step, whichever process got the signal and whenever (all of them, one
alone, or each a step apart), so they save that checkpoint together as orbax requires, and none
waits in a collective that another never reaches. Outside the loop SIGTERM keeps its default
action (JAX's own preemption notifier, which would swallow it, is off: experiments.distributed):
before the loop nothing was trained since the last checkpoint, after it the last step is saved.
"""

from __future__ import annotations

import signal
import threading

from experiments import distributed

EXIT_CODE = 128 + signal.SIGTERM  # 143: how shells and schedulers report an end by SIGTERM


class Preempted(Exception):
  """Training stopped by signal `signum` after `step`, whose checkpoint is saved."""

  def __init__(self, signum: int, step: int):
    super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}, saved as "
                     f"checkpoint {step}; the same command resumes from it")
    self.signum, self.step = signum, step


class StopSignal:
  """Within `with StopSignal() as stop:`, SIGTERM asks training to stop instead of ending the
  process; `stop.agreed()`, called after each step, says whether to stop there.

  The answer is the same on every process, so each must call `agreed` after the same steps.
  Python runs signal handlers on the main thread only: entered from another thread, nothing is
  installed and nothing asks to stop.
  """
  signum = signal.SIGTERM

  def __init__(self):
    self.received = False
    self._installed, self._previous = False, None

  def __enter__(self) -> StopSignal:
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(self.signum, self._handle)
      self._installed = True
    return self

  def __exit__(self, *exc_info) -> None:
    if self._installed:  # None: a handler set outside Python, which cannot be put back
      signal.signal(self.signum, signal.SIG_DFL if self._previous is None else self._previous)
      self._installed = False

  def _handle(self, signum, frame) -> None:
    del signum, frame
    self.received = True

  def agreed(self) -> bool:
    """Whether any process has received the signal (a collective with several processes)."""
    return distributed.any_process(self.received)
