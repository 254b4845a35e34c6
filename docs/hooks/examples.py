"""Run every page's Python examples when the site is built, and publish the figures they draw.

An mkdocs hook (mkdocs.yml `hooks:`), also imported by tests/test_docs.py. Each page's
```python blocks run in order, in one namespace, in a fresh Python process whose working directory
is an empty scratch folder: what a reader gets who pastes them one after another into a new
session. A block that raises fails the build, with the page and the line in the traceback. What
the code writes under `figures/` (a matplotlib `savefig`) becomes part of the site at
`figures/<name>`, where the page's `![...](figures/<name>)` finds it: a figure is drawn by the
code beside it at every build, never committed, so it cannot disagree with that code. What a
block prints is shown below it on the page, likewise.

A block that must not run (rare: say why) carries a title starting with "not run", e.g.
```python title="not run: needs 8 devices"; the reader sees the title too.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
from typing import NamedTuple

FIGURES = "figures"
# A fence opening: ``` then the language and the rest of the info string (titles, options).
_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)(?P<info>[^\n`]*)$")
_NOT_RUN = re.compile(r'title="not run')

# The program each page runs in: blocks compiled with the page's name and padded to their line
# numbers, so a traceback points at the markdown line; what each block prints is kept for the
# page (argv[1], JSON), and shown on the terminal too when a block fails.
_RUNNER = """
import contextlib, io, json, sys
blocks = json.loads(sys.stdin.read())
namespace, outputs = {"__name__": "__main__"}, []
for path, line, code in blocks:
  printed = io.StringIO()
  try:
    with contextlib.redirect_stdout(printed):
      exec(compile("\\n" * (line - 1) + code, path, "exec"), namespace)
  except BaseException:
    sys.stderr.write(printed.getvalue())
    raise
  outputs.append(printed.getvalue())
with open(sys.argv[1], "w") as f:
  json.dump(outputs, f)
"""


class Block(NamedTuple):
  first: int  # the first code line (1-based)
  last: int  # the closing fence's line (1-based)
  indent: str  # the fence's indentation
  code: str
  runs: bool  # a python block not marked "not run"


def blocks(text: str) -> list[Block]:
  """Every fenced block of a page, in order."""
  found, lines, i = [], text.splitlines(), 0
  while i < len(lines):
    opening = _FENCE.match(lines[i])
    if not opening:
      i += 1
      continue
    indent, body, j = opening["indent"], [], i + 1
    while j < len(lines) and lines[j].strip() != "```":
      body.append(lines[j][len(indent):])
      j += 1
    runs = opening["lang"] == "python" and not _NOT_RUN.search(opening["info"])
    found.append(Block(i + 2, j + 1, indent, "\n".join(body) + "\n", runs))
    i = j + 1
  return found


def python_blocks(text: str) -> list[tuple[int, str]]:
  """(first code line, code) of each ```python block that runs, in page order."""
  return [(b.first, b.code) for b in blocks(text) if b.runs]


def not_run_blocks(text: str) -> int:
  """How many ```python blocks the page marks as not run."""
  return sum(1 for line in text.splitlines()
             if (m := _FENCE.match(line)) and m["lang"] == "python" and _NOT_RUN.search(m["info"]))


def run_page(path: str, text: str, workdir: str, timeout: float = 900) -> list[str]:
  """Run `text`'s python blocks in a fresh interpreter with cwd `workdir`: what each printed.
  Raises RuntimeError with the output (traceback included) if one fails. `timeout` bounds a
  hang, not a slow page: the slowest page takes ~125 s alone and over 300 s on 2 shared cores."""
  code = [(path, line, code) for line, code in python_blocks(text)]
  if not code:
    return []
  env = dict(os.environ, MPLBACKEND="Agg", PYTHONPATH=_pythonpath())
  with tempfile.TemporaryDirectory() as scratch:
    printed = os.path.join(scratch, "printed.json")
    result = subprocess.run([sys.executable, "-c", _RUNNER, printed], input=json.dumps(code),
                            cwd=workdir, env=env, capture_output=True, text=True,
                            timeout=timeout, check=False)
    if result.returncode:
      raise RuntimeError(f"an example on {path} failed:\n{result.stdout}{result.stderr}")
    with open(printed, encoding="utf-8") as f:
      return json.load(f)


def with_outputs(text: str, outputs: list[str]) -> str:
  """The page with what each block printed shown below it."""
  lines = text.splitlines()
  runs = [b for b in blocks(text) if b.runs]
  for block, printed in reversed(list(zip(runs, outputs))):
    if printed.strip():
      shown = [f'{block.indent}```text title="output"',
               *(block.indent + line for line in printed.rstrip("\n").splitlines()),
               f"{block.indent}```"]
      lines[block.last:block.last] = shown
  return "\n".join(lines) + "\n"


def _pythonpath() -> str:
  """The repository first (flax_mha, experiments, configs), then what the caller had."""
  repo = str(pathlib.Path(__file__).resolve().parents[2])
  return os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)


class Ran(NamedTuple):
  figures: dict[str, bytes]  # name under figures/ -> content
  outputs: list[str]  # what each block printed


def run_pages(pages: dict[str, str], workers: int | None = None) -> dict[str, Ran]:
  """Run every page (path -> markdown) side by side, the longest first."""
  def one(item):
    path, text = item
    with tempfile.TemporaryDirectory(prefix="flax_mha_docs_") as workdir:
      outputs = run_page(path, text, workdir)
      folder = pathlib.Path(workdir, FIGURES)
      figures = {f.name: f.read_bytes() for f in sorted(folder.glob("*")) if f.is_file()}
      return path, Ran(figures, outputs)

  workers = workers or min(4, os.cpu_count() or 1)
  order = sorted(pages.items(), key=lambda item: -len(item[1]))
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    return dict(pool.map(one, order))


# --- the mkdocs side -------------------------------------------------------------------------

_cache: dict[str, Ran] = {}  # hash of a page's text -> its run (`mkdocs serve` rebuilds often)
_pages: dict[str, Ran] = {}  # this build's pages: src_uri -> run


def _key(text: str) -> str:
  return hashlib.sha256(text.encode()).hexdigest()


def on_files(files, config):
  """Run the pages whose text changed since the last build; add their figures to the site."""
  from mkdocs.exceptions import PluginError  # pylint: disable=import-outside-toplevel
  from mkdocs.structure.files import File  # pylint: disable=import-outside-toplevel
  pages = {}
  for file in files.documentation_pages():
    text = pathlib.Path(file.abs_src_path).read_text(encoding="utf-8-sig")
    if python_blocks(text):
      pages[file.src_uri] = text
  todo = {f"docs/{path}": text for path, text in pages.items() if _key(text) not in _cache}
  try:
    for path, ran in run_pages(todo).items():
      _cache[_key(todo[path])] = ran
  except RuntimeError as e:
    raise PluginError(str(e)) from e
  drawn = {}
  _pages.clear()
  for path, text in pages.items():
    _pages[path] = _cache[_key(text)]
    for name, content in _pages[path].figures.items():
      uri = f"{FIGURES}/{name}"
      if uri in drawn:
        raise PluginError(f"{path} and {drawn[uri]} both draw {uri}: name figures after "
                          "their page")
      drawn[uri] = path
      files.append(File.generated(config, uri, content=content))
  return files


def on_page_markdown(markdown, page, config, files):
  """What each block printed, below it."""
  del config, files
  ran = _pages.get(page.file.src_uri)
  return markdown if ran is None else with_outputs(markdown, ran.outputs)
