"""The load of `python -m experiments.bench.http_serving`: Poisson arrivals, an OpenAI-compatible
server in a process of its own, the requests sent over HTTP (streaming) or submitted in-process,
and what each request saw.

A request's record: `ok`, `tokens` (its output tokens: the usage the server reports, else the
chunks counted), `ttft` (seconds from sending it to its first token's chunk), `tpot` (seconds per
output token after the first: from the first token's chunk to the last one's, over tokens - 1),
`end` (seconds from the run's start to its last chunk) and `error`.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import socket
import subprocess
import time

import numpy as np


def arrivals(count: int, rate: float, seed: int) -> list[float]:
  """Seconds from the run's start at which each of `count` requests is sent: a Poisson process
  of `rate` requests/s starting at 0 (rate inf: all at 0)."""
  if np.isinf(rate):
    return [0.0] * count
  gaps = np.random.default_rng(seed).exponential(1 / rate, count)
  return [0.0, *np.cumsum(gaps[:-1]).tolist()]


def free_port() -> int:
  """A TCP port of 127.0.0.1 free now (the kernel's pick)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class ServerProcess:
  """`command` (which must take `port`) run in a session of its own, its output in `log`; ready
  when GET /health answers 200. A context manager: the process group is ended on exit."""

  def __init__(self, command: list[str], port: int, log: pathlib.Path, ready_timeout: float):
    self.url = f"http://127.0.0.1:{port}"
    self.command, self.log, self.ready_timeout = command, log, ready_timeout
    self.process = None

  def __enter__(self) -> "ServerProcess":
    import httpx  # pylint: disable=import-outside-toplevel
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with open(self.log, "w") as out:
      self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True)
    deadline = time.monotonic() + self.ready_timeout
    while time.monotonic() < deadline:
      if self.process.poll() is not None:
        self._fail(f"exited with {self.process.returncode} before it was ready")
      try:
        if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
          return self
      except httpx.HTTPError:
        pass
      time.sleep(0.5)
    self._fail(f"not ready after {self.ready_timeout:.0f} s")

  def model(self) -> str:
    """The first model GET /v1/models lists (the name requests give)."""
    import httpx  # pylint: disable=import-outside-toplevel
    return httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"][0]["id"]

  def _fail(self, why: str):
    self.__exit__()
    raise RuntimeError(f"server {self.command} {why}:\n{self.log.read_text()[-3000:]}")

  def __exit__(self, *exc) -> None:
    if self.process is None or self.process.poll() is not None:
      return
    os.killpg(self.process.pid, signal.SIGTERM)  # the group: workers the server started too
    try:
      self.process.wait(timeout=15)
    except subprocess.TimeoutExpired:
      os.killpg(self.process.pid, signal.SIGKILL)
      self.process.wait()


def _token_chunk(chunk: dict) -> bool:
  """Whether an SSE chunk carries output (text, or a chunk before the finish), not only the
  finish reason or the usage."""
  choices = chunk.get("choices") or []
  if not choices:
    return False
  choice = choices[0]
  text = choice.get("text", (choice.get("delta") or {}).get("content"))
  return bool(text) or (text is not None and choice.get("finish_reason") is None)


def record(sent: float, times: list[float], tokens: int, start: float, error=None) -> dict:
  """A request's record (module docstring) from when it was sent, its token chunks' times and
  its output tokens (perf_counter seconds; `start` the run's)."""
  if error is not None or not times:
    return dict(ok=False, tokens=tokens, error=error or "no output")
  tpot = (times[-1] - times[0]) / (tokens - 1) if tokens > 1 else None
  return dict(ok=True, tokens=tokens, ttft=times[0] - sent, tpot=tpot, end=times[-1] - start,
              error=None)


async def _send(client, url: str, body: dict, at: float, start: float) -> dict:
  """One streaming request sent `at` seconds after `start`; its record."""
  await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
  sent, times, usage = time.perf_counter(), [], None
  try:
    async with client.stream("POST", url, json=body) as response:
      if response.status_code != 200:
        text = (await response.aread()).decode(errors="replace")
        return record(sent, [], 0, start, f"HTTP {response.status_code}: {text[:200]}")
      async for line in response.aiter_lines():
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
          continue
        chunk = json.loads(line[5:])
        if "error" in chunk:
          return record(sent, [], 0, start, str(chunk["error"])[:200])
        if _token_chunk(chunk):
          times.append(time.perf_counter())
        usage = chunk.get("usage") or usage
  except Exception as error:  # pylint: disable=broad-except  (a failed request, counted)
    return record(sent, [], 0, start, f"{type(error).__name__}: {error}"[:200])
  return record(sent, times, usage["completion_tokens"] if usage else len(times), start)


async def _load(url: str, bodies: list[dict], schedule: list[float], timeout: float):
  import httpx  # pylint: disable=import-outside-toplevel
  limits = httpx.Limits(max_connections=len(bodies) + 1, max_keepalive_connections=0)
  async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
    start = time.perf_counter()
    tasks = [asyncio.ensure_future(_send(client, url, body, at, start))
             for body, at in zip(bodies, schedule)]
    done, pending = await asyncio.wait(tasks, timeout=timeout + max(schedule, default=0))
    for task in pending:
      task.cancel()
    return [t.result() if t in done else dict(ok=False, tokens=0, error="timeout")
            for t in tasks]


def http_load(url: str, bodies: list[dict], schedule: list[float], timeout: float) -> list[dict]:
  """Each body POSTed (streaming, a connection each) to `url` at its time of `schedule`; each
  request's record. A request unfinished `timeout` seconds after the last is sent fails."""
  return asyncio.run(_load(url, bodies, schedule, timeout))


def inprocess_load(server, prompts, new: int, schedule: list[float], timeout: float,
                   **submit) -> list[dict]:
  """Each prompt (token ids) submitted (with the keywords `submit`) to a running
  `flax_mha.serving.Server` by a thread of its own at its time of `schedule`, its tokens read
  with `server.stream`; each request's record."""
  import threading  # pylint: disable=import-outside-toplevel
  records = [dict(ok=False, tokens=0, error="timeout")] * len(prompts)
  start = time.perf_counter()

  def one(i):
    time.sleep(max(0.0, start + schedule[i] - time.perf_counter()))
    sent, times = time.perf_counter(), []
    try:
      for _ in server.stream(server.submit(prompts[i], new, **submit)):
        times.append(time.perf_counter())
      records[i] = record(sent, times, len(times), start)
    except Exception as error:  # pylint: disable=broad-except  (a failed request, counted)
      records[i] = record(sent, [], 0, start, f"{type(error).__name__}: {error}"[:200])

  threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
  for thread in threads:
    thread.start()
  deadline = time.perf_counter() + timeout + max(schedule, default=0)
  for thread in threads:
    thread.join(max(0.0, deadline - time.perf_counter()))
  return list(records)


def summary(records: list[dict], new: int) -> dict:
  """Completed (ok, exactly `new` tokens) and failed requests; output tokens/s of the completed
  over the run's wall time (its start to the last token); TTFT and TPOT median and p99 (ms)."""
  done = [r for r in records if r["ok"] and r["tokens"] == new]
  out = dict(completed=len(done), failed=len(records) - len(done),
             errors=sorted({r["error"] or f"{r['tokens']} tokens" for r in records
                            if r not in done}))
  if done:
    out["throughput"] = sum(r["tokens"] for r in done) / max(r["end"] for r in done)
    for key in ("ttft", "tpot"):
      ms = 1e3 * np.array([r[key] for r in done if r[key] is not None])
      out[key] = (float(np.median(ms)), float(np.percentile(ms, 99)))
  return out
