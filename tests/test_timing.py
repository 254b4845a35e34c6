"""experiments.bench.timing.isolated: a process per case, the order reversed every other turn."""

from __future__ import annotations

import os

from experiments.bench import timing

WORKER = """
import json, os, sys
case = sys.argv[sys.argv.index("--time-case") + 1]
with open(os.environ["TIMING_TEST_LOG"], "a") as log:
  log.write(case + "\\n")
print("what a worker prints before its report")
print(json.dumps(dict(seconds=[len(case)], pid=os.getpid(), extra=sys.argv[3:])))
"""


def test_isolated_runs_each_case_in_its_own_process_in_alternating_order(tmp_path, monkeypatch):
  (tmp_path / "fake_worker.py").write_text(WORKER)
  log = tmp_path / "order.log"
  monkeypatch.setenv("TIMING_TEST_LOG", str(log))
  path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
  monkeypatch.setenv("PYTHONPATH", path)  # the worker module's folder, for python -m
  cases = ["a", "bb", "ccc"]
  reports = timing.isolated("fake_worker", cases, turns=3, extra_args=["--n", "7"])
  assert log.read_text().split() == cases + cases[::-1] + cases
  assert list(reports) == cases and all(len(mine) == 3 for mine in reports.values())
  pids = [report["pid"] for mine in reports.values() for report in mine]
  assert len(set(pids)) == len(pids) == 9  # no two workers, of one case or two, share a process
  assert all(report["extra"] == ["--n", "7"] for mine in reports.values() for report in mine)
  assert timing.pooled_seconds(reports) == {"a": [1] * 3, "bb": [2] * 3, "ccc": [3] * 3}
