"""Run the experiment as N processes on JAX's distributed runtime, on this machine.

  python -m experiments.launch --processes 2 --devices-per-process 2 -- \\
      --config configs/dates.py:tiny --workdir runs/dates_2x2 \\
      --config.mesh.data=2 --config.mesh.model=2

starts N processes of `python -m experiments.train <the arguments after -->`, each with
`--devices-per-process` emulated CPU devices, joined over loopback (127.0.0.1) into one runtime
of N x devices-per-process devices with gloo collectives (`experiments.distributed`). The
config's mesh must use every device. Process 0 prints the progress and the summary and writes
the workdir's files; all of them save and restore checkpoints together, so a run restarted with
the same command resumes from its last complete checkpoint.

If a process dies, the others stop when the runtime's heartbeat misses it (after
--heartbeat-seconds) and the launcher exits with 1, naming each process's end; any still
running after a grace period are killed. SIGTERM or SIGINT (Ctrl-C) sent to the launcher goes on
to every process: they stop together after one step and save it (a preemption,
experiments.preemption); the launcher waits for them, kills any left after the grace period, and
exits with 128 + the signal's number (143, 130). On a cluster this launcher is not needed: run
`python -m experiments.train --distributed ...` on every host and JAX finds its coordinator
(SLURM, Cloud TPU).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

from experiments import distributed, preemption

GRACE_SECONDS = 30  # how long processes may take to stop by themselves (after a failure,
# beyond the heartbeat; after a signal, to save their checkpoint) before they are killed


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def child_env(process_id: int, args) -> dict[str, str]:
  """The environment of process `process_id`: its place in the runtime, its CPU devices."""
  env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
  flags = env.get("XLA_FLAGS", "").split()
  flags = [f for f in flags if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join(
      [*flags, f"--xla_force_host_platform_device_count={args.devices_per_process}"])
  env.update({distributed.COORDINATOR: f"127.0.0.1:{args.port}",
              distributed.NUM_PROCESSES: str(args.processes),
              distributed.PROCESS_ID: str(process_id),
              distributed.HEARTBEAT_SECONDS: str(args.heartbeat_seconds)})
  return env


def describe(code: int | None) -> str:
  if code is None:
    return "still running (killed)"
  if code < 0:
    return f"killed by {signal.Signals(-code).name}"
  return f"exited with {code}"


class Forward:
  """The signal handler of the launcher: passes each SIGTERM or SIGINT on to every process in
  `procs` still running, and records the signal and when it came first."""

  def __init__(self):
    self.procs: list[subprocess.Popen] = []
    self.signum, self.since = None, None

  def __call__(self, signum, frame=None) -> None:
    del frame
    if self.signum is None:
      self.signum, self.since = signum, time.monotonic()
    for p in self.procs:
      if p.poll() is None:
        p.send_signal(signum)


def supervise(procs: list[subprocess.Popen], heartbeat: int, forward: Forward) -> int:
  """Wait for every process; once one fails, give the others the heartbeat and a grace period
  to stop by themselves, and once the launcher is signalled, the grace period; then kill them.
  Returns `conclude`'s exit code."""
  first_failure, failed_at = None, None
  while any(p.poll() is None for p in procs):
    failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
    if failed and first_failure is None:
      first_failure, failed_at = failed[0], time.monotonic()
    deadlines = [t + wait for t, wait in ((failed_at, heartbeat + GRACE_SECONDS),
                                          (forward.since, GRACE_SECONDS)) if t is not None]
    if deadlines and time.monotonic() > min(deadlines):
      break
    time.sleep(0.2)
  codes = [p.poll() for p in procs]
  for p in procs:
    if p.poll() is None:
      p.kill()
      p.wait()
  return conclude(codes, first_failure, forward.signum)


def conclude(codes: list[int | None], first_failure: int | None, signum: int | None) -> int:
  """The launcher's exit code from its processes' `codes` (None: killed while running) and the
  signal it got, printing how each process ended unless all succeeded: 128 + the signal's
  number if signalled, or 143 (130) if every process stopped on a SIGTERM (SIGINT) of its own (a
  scheduler may signal them, not the launcher); 0 if all succeeded; else 1, naming the first
  that failed."""
  for own in preemption.SIGNALS:
    if signum is None and all(code == preemption.exit_code(own) for code in codes):
      signum = own
  if signum is None and all(code == 0 for code in codes):
    return 0
  if first_failure is None:  # all ended between two polls
    first_failure = next((i for i, code in enumerate(codes) if code != 0), None)
  ends = "; ".join(f"process {i} {describe(code)}" for i, code in enumerate(codes))
  cause = (f"stopped by {signal.Signals(signum).name}" if signum is not None
           else f"process {first_failure} failed first")
  print(f"launch: {cause}; {ends}", file=sys.stderr, flush=True)
  return 1 if signum is None else 128 + signum


def parse(argv):
  parser = argparse.ArgumentParser(
      prog="python -m experiments.launch", description=__doc__.split("\n\n")[0],
      usage="%(prog)s [options] -- <experiments.train arguments>")
  parser.add_argument("--processes", type=int, default=2, help="processes to start (2)")
  parser.add_argument("--devices-per-process", type=int, default=2,
                      help="emulated CPU devices of each (2)")
  parser.add_argument("--port", type=int, default=0,
                      help="the coordinator's port on 127.0.0.1 (0: a free one)")
  parser.add_argument("--heartbeat-seconds", type=int,
                      default=distributed.DEFAULT_HEARTBEAT_SECONDS,
                      help="a process silent this long ends the others "
                           f"({distributed.DEFAULT_HEARTBEAT_SECONDS})")
  split = argv.index("--") if "--" in argv else len(argv)
  args = parser.parse_args(argv[:split])  # --help too
  if split == len(argv):
    parser.error("put the training arguments after --")
  for name in ("processes", "devices_per_process", "heartbeat_seconds"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  if args.port == 0:
    args.port = free_port()
  else:
    try:
      distributed.check_port_free(f"127.0.0.1:{args.port}")
    except distributed.SetupError as e:
      parser.error(str(e))
  return args, argv[split + 1:]


def main(argv=None) -> int:
  args, train_args = parse(sys.argv[1:] if argv is None else argv)
  forward = Forward()  # installed before any process starts, so that none is left behind
  previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    for i in range(args.processes):
      if forward.signum is not None:
        break  # signalled while starting: start no more
      forward.procs.append(subprocess.Popen(
          [sys.executable, "-m", "experiments.train", *train_args], env=child_env(i, args),
          stdout=None if i == 0 else subprocess.DEVNULL))
    if forward.signum is not None:  # one may have started between the signal and its list entry
      forward(forward.signum)
    return supervise(forward.procs, args.heartbeat_seconds, forward)
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)


if __name__ == "__main__":
  sys.exit(main())
