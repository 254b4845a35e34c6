"""Run a check script of this folder on 8 emulated CPU devices, in its own process.

XLA reads the device count once per process, so the checks cannot share the pytest workers
(which must keep one device for the rest of the suite).
"""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_check(script: str, *args: str, timeout: float = 300) -> list[str]:
  """Run tests/multidevice/`script` with `args`; return its 'OK ...' lines, failing with its
  output if not 0."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  result = subprocess.run([sys.executable, str(ROOT / "tests" / "multidevice" / script), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
  assert result.returncode == 0, f"{script} failed:\n{result.stdout}\n{result.stderr[-4000:]}"
  return [line for line in result.stdout.splitlines() if line.startswith("OK ")]
