"""`python -m flax_mha.selftest` (flax_mha/selftest.py) on a tiny matrix: a kernel registered
for the test that gives wrong numbers fails the run (exit 1), one that refuses reads
"refused", one that cannot compile fails with its error; which kernels it runs, skips or
interprets, read from the registry; the table and its counts. The real matrix runs in
tests/selftest/test_selftest_integration.py."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from flax_mha import platforms
from flax_mha import selftest
from flax_mha.selftest import cases
from flax_mha.kernels import reference
from flax_mha.kernels import registry

TINY = cases.Shape("tiny", 2, 7, 7, 6, 3, 5, 11)  # prime-ish dims: a swapped axis fails


def _tiny(*names, dtypes=("float32",)) -> selftest.Settings:
  return selftest.Settings(shapes=(TINY,), options=(cases.PLAIN,), step_shapes=(),
                           cache_cases=(), paged_cases=(), dtypes=dtypes,
                           implementations=names, repeats=1)


@pytest.fixture
def register():
  """register(name, attention, **kernel_fields): a throwaway kernel, unregistered after."""
  names = []

  def add(name, attention, **fields):
    registry.register(registry.Kernel(name, attention, **fields))
    names.append(name)
    return name

  yield add
  for name in names:
    registry.unregister(name)


def _scaled(factor):
  def attention(query, key, value, bias, mask, **options):
    return reference.attention(query, key, value, bias, mask, **options) * factor
  return attention


def test_a_wrong_kernel_fails_and_the_command_exits_1(register, monkeypatch, tmp_path, capsys):
  right, wrong = register("selftest_right", _scaled(1.0)), register("selftest_wrong", _scaled(1.1))
  rows = selftest.run(_tiny(right, wrong))
  assert [(r.implementation, r.result) for r in rows] == [(right, "pass"), (wrong, "fail")]
  assert rows[0].values < 1e-6 and rows[0].grads < 1e-6 and rows[0].ms is not None
  assert rows[1].values == pytest.approx(0.1, rel=1e-3) and rows[1].grads > 0.05
  monkeypatch.setattr(selftest, "settings_for", lambda args: _tiny(wrong))
  assert selftest.main(["--json", str(tmp_path / "table.json")]) == 1
  out = capsys.readouterr().out.splitlines()
  assert out[1] == selftest.header() and out[-1].startswith("FAILED: 0 pass, 1 fail")
  written = json.loads((tmp_path / "table.json").read_text())
  assert written["counts"]["fail"] == 1 and written["rows"][0]["implementation"] == wrong


def test_a_refusing_kernel_reads_refused_with_its_reason(register, monkeypatch):
  name = register("selftest_refuses", _scaled(1.1), refuses=lambda call: "it refuses (a test)")
  rows = selftest.run(_tiny(name))
  assert [(r.options, r.result, r.note) for r in rows] == [
      (selftest.EVERY_OPTION, "refused", "it refuses (a test)")]
  right = register("selftest_right", _scaled(1.0))  # a refusal beside a pass fails nothing
  monkeypatch.setattr(selftest, "settings_for", lambda args: _tiny(name, right))
  assert selftest.main([]) == 0


def test_a_run_that_tests_nothing_says_so_and_exits_1(register, monkeypatch, capsys):
  """Every row refused or skipped (as `--implementations triton,cudnn` on a CPU): no row
  passed, so the run reads "nothing tested", never "ok", and exits 1."""
  refuses = register("selftest_refuses", _scaled(1.0), refuses=lambda call: "it refuses (a test)")
  elsewhere = register("selftest_elsewhere", _scaled(1.0),
                       platform="tpu" if platforms.backend_platform() != "tpu" else "cuda")
  monkeypatch.setattr(selftest, "settings_for", lambda args: _tiny(refuses, elsewhere))
  assert selftest.main([]) == 1
  assert capsys.readouterr().out.splitlines()[-1].startswith(
      "nothing tested: 0 pass, 0 fail, 1 refused, 1 skipped (2 rows, ")
  assert selftest.exit_status([selftest.Row("xla", "plain", "-", "float32", "pass")]) == 0


def test_an_error_while_compiling_is_a_failure_that_names_it(register):
  def broken(query, *args, **options):
    raise RuntimeError("no lowering for this op (a test)")
  rows = selftest.run(_tiny(register("selftest_broken", broken)))
  assert rows[0].result == "fail"
  assert rows[0].note == "RuntimeError: no lowering for this op (a test)"


def test_candidates_come_from_the_registry(register):
  """On a CPU: the kernels for any platform run compiled, those for another are skipped, or
  interpreted when asked where their module can; None comes last; a kernel registered later
  appears."""
  name = register("selftest_any", _scaled(1.0))
  register("selftest_tpu_only", _scaled(1.0), platform="tpu")
  found = {c.label: c for c in selftest.candidates("dense", "cpu", interpret=False)}
  assert list(found)[-1] == "None" and "reference" not in found
  assert found[name].implementation == name and found["xla"].skipped is None
  assert found["cudnn"].skipped == "needs cuda"
  assert found["triton"].skipped.startswith("needs cuda; --interpret")
  assert found["selftest_tpu_only"].skipped == "needs tpu"
  interpreted = {c.label: c for c in selftest.candidates("dense", "cpu", interpret=True)}
  assert callable(interpreted["triton (interpret)"].implementation)
  assert interpreted["splash (interpret)"].platform == "tpu"
  assert interpreted["cudnn"].skipped == "needs cuda"
  steps = [c.label for c in selftest.candidates("paged", "cpu", interpret=True)]
  assert "triton_decode (interpret)" in steps and steps[-1] == "None"


def test_scaled_error_is_relative_to_the_oracle_and_a_nan_is_infinite():
  want = (np.array([1.0, -4.0]), np.array([[0.0, 2.0]]))
  assert cases.scaled_error(want, want) == 0.0
  assert cases.scaled_error((np.array([1.0, -3.0]), want[1]), want) == pytest.approx(0.25)
  assert cases.scaled_error((want[0], 1e3 * want[1]), (want[0], 1e3 * want[1])) == 0.0
  assert cases.scaled_error((np.array([np.nan, -4.0]), want[1]), want) == float("inf")


def test_the_table_and_its_summary():
  rows = [selftest.Row("xla", "causal", TINY.label, "float32", "pass", 1e-7, 2e-7, 1.5),
          selftest.Row("rows", "kv lengths", TINY.label, "bfloat16", "refused",
                       note="it takes no lengths"),
          selftest.Row("cudnn", selftest.EVERY_OPTION, "-", "-", "skipped", note="needs cuda")]
  lines = [selftest.format_row(row) for row in rows]
  assert lines[0].split() == ["xla", "causal", *TINY.label.split(), "float32", "1.0e-07",
                              "2.0e-07", "1.50", "pass"]
  assert lines[1].endswith("refused: it takes no lengths") and "-" in lines[1].split()
  header = selftest.header()
  assert all(line.index(cell) == header.index(name) for line, cell, name in (
      (lines[0], "float32", "dtype"), (lines[0], "pass", "result"),
      (lines[2], "skipped", "result")))
  assert selftest.counts(rows) == {"pass": 1, "fail": 0, "refused": 1, "skipped": 1}
  assert selftest.summary(rows, 12.3) == "ok: 1 pass, 0 fail, 1 refused, 1 skipped (3 rows, 12 s)"


LONG_NOTE = ("it needs a mesh with a 'seq' axis in context (`with jax.set_mesh("
             "flax_mha.sharding.make_mesh(seq=n))`), and there is none")


def test_every_printed_line_fits_100_columns_and_keeps_every_cell(register, monkeypatch,
                                                                  capsys):
  """The longest cells of the real matrix (an interpreted step kernel, a step's options and
  medium shape, a long refusal, a slow row) wrap within their columns: no line is wider than
  100, no word of a cell or a note is lost, only a row's first line starts in the first column;
  a run's title, legend and long refusal fit too."""
  step, dense = cases.STEP_SHAPES[-1].label, cases.SHAPES[-1].label
  cases_ = (  # (row, every cell as printed, the note after its result)
      (selftest.Row("paged: triton_decode (interpret)", "3 tokens, window, soft cap", step,
                    "bfloat16", "pass", 1.23e-3, 4.56e-3, 123456.7),
       ["1.2e-03", "4.6e-03", "123457", "pass"]),
      (selftest.Row("ring", selftest.EVERY_OPTION, "-", "float32", "refused", note=LONG_NOTE),
       ["-", "-", "-", "refused", "refused: " + LONG_NOTE]),
      (selftest.Row("None (xla)", "gqa causal", dense, "float32", "fail", 1e-7, 2e-7, 1234.5,
                    note="over the tolerance 0.0001"),
       ["1.0e-07", "2.0e-07", "1234", "fail", "fail: over the tolerance 0.0001"]))
  for row, rest in cases_:
    lines = selftest.format_row(row).splitlines()
    assert max(map(len, lines)) <= selftest.WIDTH == 100, lines
    assert [line[0] != " " for line in lines] == [True] + [False] * (len(lines) - 1), lines
    cells = [row.implementation, row.options, row.shape, row.dtype, *rest]
    assert sorted(" ".join(lines).split()) == sorted(" ".join(cells).split())
    assert lines[0].split()[-1] == row.result
  name = register("selftest_refuses_long", _scaled(1.0), refuses=lambda call: LONG_NOTE)
  monkeypatch.setattr(selftest, "settings_for", lambda args: _tiny(name))
  selftest.main([])
  out = capsys.readouterr().out
  assert max(map(len, out.splitlines())) <= 100, out
  assert ("refused: " + LONG_NOTE) in " ".join(out.split())
  assert "max |error| / max |oracle|" in out and "tolerance float32 " in out


def test_the_command_line_is_checked():
  with pytest.raises(SystemExit):
    selftest.main(["--dtypes", "float16"])
  with pytest.raises(SystemExit):
    selftest.main(["--implementations", "nope"])
  args = selftest.parse_args(["--quick", "--dtypes", "bfloat16", "--implementations", "xla,None"])
  settings = selftest.settings_for(args)
  assert settings.shapes == cases.SHAPES[:1] and settings.dtypes == ("bfloat16",)
  assert all(option.quick for option in settings.options) and len(settings.options) >= 2
  assert settings.implementations == ("xla", "None")


def test_the_inputs_of_a_case_are_the_same_numbers_in_every_dtype():
  option = next(o for o in cases.OPTIONS if o.name == "gqa causal")
  f32, bf16 = (cases.dense_inputs(cases.SHAPES[0], option, d) for d in ("float32", "bfloat16"))
  assert f32.args[1].shape[2] == 1 and bf16.args[0].dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(bf16.args[0], np.float32), f32.args[0], rtol=1e-2)
