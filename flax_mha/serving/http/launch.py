"""A server as a subprocess, for tests, benchmarks and notebooks: started on a free port of
127.0.0.1, handed over once it listens, stopped (SIGTERM: it drains) when done.

  with launch.Launched(["--checkpoint", "path/to/model"]) as server:
    openai.OpenAI(base_url=server.url + "/v1", api_key="none").completions.create(...)
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

LISTENING = re.compile(r"listening on (http://\S+)")


class Launched:
  """`python -m module *args --port 0` (the module: flax_mha.serving.http, or
  experiments.serve); `url` once it listens, `output` what it printed so far, `stop()` sends
  `sig` and returns the exit status."""

  def __init__(self, args, *, module: str = "flax_mha.serving.http", timeout: float = 600.0,
               env: dict | None = None, cwd=None):
    self.args, self.module, self.timeout = list(args), module, timeout
    self.env = dict(os.environ, **(env or {}))
    self.cwd, self.url, self.output, self.process = cwd, None, [], None
    self._listening = threading.Event()

  def start(self) -> "Launched":
    port = [] if "--port" in self.args else ["--port", "0"]
    self.process = subprocess.Popen([sys.executable, "-u", "-m", self.module, *self.args, *port],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env=self.env, cwd=self.cwd)
    threading.Thread(target=self._read, daemon=True).start()
    deadline = time.monotonic() + self.timeout
    while not self._listening.wait(0.1):
      if self.process.poll() is not None or time.monotonic() > deadline:
        self.stop(signal.SIGKILL)
        raise RuntimeError(f"the server did not start: {''.join(self.output)[-3000:]}")
    return self

  def _read(self) -> None:
    for line in self.process.stdout:
      self.output.append(line)
      found = LISTENING.search(line)
      if found and self.url is None:
        self.url = found.group(1)
        self._listening.set()

  def stop(self, sig=signal.SIGTERM, timeout: float = 120.0) -> int:
    """Send `sig`, wait for the exit (killed after `timeout` seconds); the exit status."""
    if self.process.poll() is None:
      self.process.send_signal(sig)
      try:
        self.process.wait(timeout)
      except subprocess.TimeoutExpired:
        self.process.kill()
        self.process.wait()
    return self.process.returncode

  def __enter__(self) -> "Launched":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()
