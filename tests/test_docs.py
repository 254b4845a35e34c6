"""The documentation cannot rot: every ```python block of README.md and docs/*.md runs, and the
site builds with `mkdocs build --strict` (both in tests/test_docs_integration.py; here, the
hooks that run them and the API reference's coverage).

Each page's blocks run in order, in one namespace, in a fresh Python process in a scratch
directory (docs/hooks/examples.py, the mkdocs hook that also runs them at every build). The site
build runs the docs pages' blocks itself, so one build checks them, the figures they draw, every
link and every API reference; README.md, outside the site, runs on its own.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import pkgutil
import re
import subprocess
import sys

import pytest
import yaml

REPO = pathlib.Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]


def _hook(name: str):
  spec = importlib.util.spec_from_file_location(f"docs_{name}", REPO / f"docs/hooks/{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


examples = _hook("examples")
docstrings = _hook("docstrings")


def test_blocks_found_in_order_and_not_run_ones_skipped():
  text = "\n".join([
      "# page", "```python", "a = 1", "```", "```bash", "make test", "```",
      '```python title="not run: needs a GPU"', "gpu()", "```",
      "- item", "    ```python", "    b = a + 1", "    ```", "```", "plain", "```"])
  assert examples.python_blocks(text) == [(3, "a = 1\n"), (13, "b = a + 1\n")]
  assert examples.not_run_blocks(text) == 1


def test_a_failing_block_names_its_page_and_line(tmp_path):
  text = "intro\n\n```python\nx = 1\n```\n\n```python\nassert x == 2, 'x is 1'\n```\n"
  with pytest.raises(RuntimeError, match=r'(?s)docs/page\.md", line 8.*x is 1'):
    examples.run_page("docs/page.md", text, str(tmp_path))


def test_docstrings_indented_blocks_become_code_and_lists_stand_apart():
  text = "\n".join([
      "Summary.", "", "  out = f(x)   # [B, T]", "  y = g(out)", "More text.", "Kinds:",
      "- one", "  continued", "- two", "", "Rules:", "  1. first", "     wrapped", "  2. second",
      "After.", "", "Args:", "  x: the input.", "", "    more on x.", "", "Returns:", "  y."])
  assert docstrings.markdown(text).split("\n") == [
      "Summary.", "", "```text", "out = f(x)   # [B, T]", "y = g(out)", "```", "",
      "More text.", "Kinds:", "", "- one", "  continued", "- two", "", "Rules:", "",
      "1. first", "   wrapped", "2. second", "", "After.", "", "Args:", "  x: the input.", "",
      "    more on x.", "", "Returns:", "  y."]


def test_blocks_that_do_not_run_are_rare():
  skipped = {page: examples.not_run_blocks((REPO / page).read_text()) for page in PAGES}
  assert sum(skipped.values()) <= 1, skipped


def _documented() -> set[str]:
  """Every `::: identifier` of the API reference pages."""
  found = set()
  for page in (REPO / "docs").glob("*.md"):
    found |= set(re.findall(r"^::: ([\w.]+)", page.read_text(), flags=re.M))
  return found


def test_api_reference_covers_every_public_name():
  import flax_mha  # pylint: disable=import-outside-toplevel
  documented = _documented()
  missing = []
  for name in dir(flax_mha):
    if name.startswith("_") or name in ("importlib",):
      continue
    value = getattr(flax_mha, name)
    paths = {f"flax_mha.{name}"}
    if hasattr(value, "__name__") and type(value).__name__ == "module":
      paths.add(value.__name__)
    elif hasattr(value, "__qualname__"):
      paths.add(f"{value.__module__}.{value.__qualname__}")
    else:  # an instance (ring_implementation): its class's entry documents it
      paths.add(f"{type(value).__module__}.{type(value).__qualname__}")
    # A module documented whole covers its members.
    if not paths & documented and not any(p.rsplit(".", 1)[0] in documented for p in paths):
      missing.append(name)
  assert not missing, f"public names without an API reference entry (docs/api_*.md): {missing}"


def test_api_reference_covers_every_public_module():
  """Each module of the package (not a private `_name`) has its own `::: module` entry, so a
  new one (say flax_mha/explain.py) gets a place in the reference when it lands."""
  import flax_mha  # pylint: disable=import-outside-toplevel
  modules = [m.name for m in pkgutil.walk_packages(flax_mha.__path__, "flax_mha.")
             if not any(part.startswith("_") for part in m.name.split("."))]
  missing = sorted(set(modules) - _documented())
  assert not missing, f"modules without an API reference entry (docs/api_*.md): {missing}"


def build_site(config: pathlib.Path, site: pathlib.Path) -> tuple[bool, str]:
  """(passed, log) of `mkdocs build --strict` of `config` into `site`: passed when it exits 0
  and logs no WARNING or ERROR line.

  Never `-q`: quiet mode drops the warnings that --strict counts, and the build then passes
  with a broken link. The log is read too, for warnings that --strict does not count.
  """
  env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
  result = subprocess.run(
      [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
      cwd=config.parent, env=env, capture_output=True, text=True, check=False)
  log = result.stdout + result.stderr
  warned = re.search(r"^(WARNING|ERROR)\b", log, flags=re.M) is not None
  return result.returncode == 0 and not warned, log


def test_the_site_check_fails_on_a_broken_anchor(tmp_path):
  """`build_site`, which the site test relies on, over a two-page site with the project's
  validation settings: a link to an anchor the other page lacks fails it (with `-q` the build
  passed, hiding a renamed section), the same link to a present anchor passes."""
  validation = yaml.safe_load((REPO / "mkdocs.yml").read_text())["validation"]
  (tmp_path / "docs").mkdir()
  (tmp_path / "docs/other.md").write_text("# Other\n\n## Present section\n\nText.\n")
  config = tmp_path / "mkdocs.yml"
  config.write_text(yaml.safe_dump({"site_name": "tiny", "validation": validation}))
  page = tmp_path / "docs/index.md"
  page.write_text("# Tiny\n\nSee [there](other.md#renamed-section).\n")
  passed, log = build_site(config, tmp_path / "site")
  assert not passed, log
  assert "does not contain an anchor '#renamed-section'" in log, log
  page.write_text("# Tiny\n\nSee [there](other.md#present-section).\n")
  passed, log = build_site(config, tmp_path / "site")
  assert passed, log
