"""The settings of JAX's distributed runtime (`experiments.distributed`) and the launcher's
arguments (`experiments.launch`), refused by name. The processes themselves are in
tests/test_multiprocess_integration.py."""

from __future__ import annotations

import pytest

from experiments import distributed
from experiments import launch as launch_lib


def test_settings_are_checked_by_name():
  env = {distributed.COORDINATOR: "127.0.0.1:1234", distributed.NUM_PROCESSES: "2",
         distributed.PROCESS_ID: "1"}
  assert distributed.settings(env)["process_id"] == 1
  assert distributed.settings({}) is None
  bad = {distributed.PROCESS_ID: "2"}, {distributed.PROCESS_ID: "x"}, {
      distributed.COORDINATOR: "1234"}, {distributed.NUM_PROCESSES: "0"}
  matches = (r"FLAX_MHA_PROCESS_ID must be in \[0, 2\) for FLAX_MHA_NUM_PROCESSES=2, got 2",
             "FLAX_MHA_PROCESS_ID must be an int, got 'x'",
             "FLAX_MHA_COORDINATOR must be host:port, got '1234'",
             "FLAX_MHA_NUM_PROCESSES must be >= 1, got 0")
  for change, match in zip(bad, matches):
    with pytest.raises(distributed.SetupError, match=match):
      distributed.settings(env | change)
  with pytest.raises(distributed.SetupError, match="FLAX_MHA_COORDINATOR must be too"):
    distributed.settings({distributed.NUM_PROCESSES: "2", distributed.PROCESS_ID: "0"})


def test_launcher_arguments(capsys):
  args, rest = launch_lib.parse(["--processes", "3", "--", "--config", "c.py", "--workdir", "w"])
  assert (args.processes, args.devices_per_process, rest) == (3, 2, ["--config", "c.py",
                                                                     "--workdir", "w"])
  assert 0 < args.port < 65536  # a free one was picked
  env = launch_lib.child_env(2, args)
  assert env[distributed.PROCESS_ID] == "2" and env[distributed.NUM_PROCESSES] == "3"
  assert env["XLA_FLAGS"].endswith("--xla_force_host_platform_device_count=2")
  for argv, message in ((["--processes", "2"], "put the training arguments after --"),
                        (["--processes", "0", "--", "x"], "--processes must be >= 1, got 0")):
    with pytest.raises(SystemExit):
      launch_lib.parse(argv)
    assert message in capsys.readouterr().err
  assert launch_lib.describe(-9) == "killed by SIGKILL"
  assert launch_lib.describe(1) == "exited with 1"
