"""`python -m flax_mha.selftest` as a user runs it, on this CPU: `--quick` (what CI runs) passes
with every registered kernel in its table, and `--quick --interpret` runs the Pallas kernels
of the other platforms (triton, splash, triton_decode) in interpret mode, each row passing or
refused by name. The table's logic, on a tiny matrix, is in tests/selftest/test_selftest.py."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from flax_mha import selftest
from flax_mha.selftest import cases
from flax_mha.kernels import registry

pytestmark = pytest.mark.integration  # subprocesses: a minute or two of compiles each

REPO = pathlib.Path(__file__).resolve().parents[2]


def _selftest(tmp_path, *flags) -> tuple[list[str], dict]:
  """(the printed lines, the JSON table) of a run that must exit 0."""
  path = tmp_path / "table.json"
  # At XLA's default optimization level, which the Makefile's test targets lower: the
  # self-test is where CI runs optimised code.
  # (XLA reads a blank XLA_FLAGS as a file name: the variable goes when nothing is left.)
  env = dict(os.environ)
  xla_flags = env.pop("XLA_FLAGS", "").replace("--xla_backend_optimization_level=0", "").strip()
  if xla_flags:
    env["XLA_FLAGS"] = xla_flags
  result = subprocess.run([sys.executable, "-m", "flax_mha.selftest", *flags, "--repeats", "2",
                           "--json", str(path)], cwd=REPO, capture_output=True, text=True,
                          timeout=600, check=False, env=env)
  assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
  return result.stdout.splitlines(), json.loads(path.read_text())


def _kernels(rows, prefix="") -> set[str]:
  """The registry names in the rows' implementation column (those of `prefix` rows)."""
  names = (row["implementation"] for row in rows if row["implementation"].startswith(prefix))
  return {name.removeprefix(prefix).split(" (")[0] for name in names}


def test_quick_passes_on_cpu_with_every_kernel_in_the_table(tmp_path):
  lines, table = _selftest(tmp_path, "--quick")
  rows = table["rows"]
  assert lines[1] == selftest.header() and lines[-1].startswith("ok: ")
  # the title, the header, a row's first line per row, the legend, the summary: all else (a
  # wrapped cell, a note) is indented below its row; every line fits 100 columns
  assert sum(not line.startswith(" ") for line in lines) == len(rows) + 4
  assert max(map(len, lines)) <= selftest.WIDTH
  assert table["counts"]["fail"] == 0 and table["counts"]["pass"] >= 20
  dense = [row for row in rows if ":" not in row["implementation"]]
  assert _kernels(dense) == (set(registry.names()) - {"reference"}) | {"None"}
  for layout in ("cache", "paged"):
    assert _kernels(rows, f"{layout}: ") == set(registry.names(layout)) | {"None"}
  elsewhere = {name for name in registry.names() if registry.get(name).platform
               not in (None, "cpu")}
  assert {row["implementation"] for row in rows if row["result"] == "skipped"} >= elsewhere
  for row in rows:
    if row["result"] == "pass":
      assert row["values"] <= cases.tolerance(row["dtype"], "cpu") and row["ms"] > 0


@pytest.mark.slow  # ~2-4 min of interpreted kernels; the kernels' own interpret tests run in CI
def test_quick_interpret_runs_the_pallas_kernels_on_cpu(tmp_path):
  pallas = ("triton", "splash", "triton_decode")
  _, table = _selftest(tmp_path, "--quick", "--interpret", "--implementations",
                       ",".join(pallas))
  rows = table["rows"]
  assert {row["result"] for row in rows} <= {"pass", "refused"}
  passed = {row["implementation"] for row in rows if row["result"] == "pass"}
  assert passed == {"triton (interpret)", "splash (interpret)",
                    "cache: triton_decode (interpret)", "paged: triton_decode (interpret)"}
  assert {row["dtype"] for row in rows if row["result"] == "pass"} == {"float32", "bfloat16"}
