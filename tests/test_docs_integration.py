"""The documentation runs: README.md's ```python blocks in a fresh process, and the site built
with `mkdocs build --strict`, which runs every docs page's blocks and draws its figures (see
tests/test_docs.py, the unit part: the hooks themselves and the API reference's coverage)."""

from __future__ import annotations

import re

import pytest

from test_docs import PAGES, REPO, build_site, examples

pytestmark = pytest.mark.integration  # seconds of subprocesses, minutes for the site


def test_readme_examples_run(tmp_path):
  text = (REPO / "README.md").read_text()
  assert examples.python_blocks(text), "README.md has a usage example"
  examples.run_page("README.md", text, str(tmp_path))


def test_site_builds_strict_with_every_figure(tmp_path):
  site = tmp_path / "site"
  passed, log = build_site(REPO / "mkdocs.yml", site)
  assert passed, log
  for page in PAGES[1:]:
    text = (REPO / page).read_text()
    for figure in re.findall(r"!\[[^\]]*\]\((figures/[^)\s]+)\)", text):
      assert (site / figure).is_file(), f"{page} shows {figure}, which its code did not draw"
