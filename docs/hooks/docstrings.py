"""Docstrings as the API reference shows them: a griffe extension (mkdocs.yml, mkdocstrings'
`extensions:`), also imported by tests/test_docs.py.

The package's docstrings are written for `help()` and the source: a formula, a table of names
or a usage line is indented by two spaces under its paragraph, and a list may follow its
introducing line directly, or be indented under it. Markdown would run both into the paragraph. This turns an indented
block that follows a blank line (outside the Args/Returns/Raises sections, whose items are
indented too) into a code block, kept as written, and sets a list that follows a line of text
apart (at the margin, if it was indented). The source stays as it is.
"""

from __future__ import annotations

import re
import textwrap

import griffe

# Google-style section headers: their items are indented, and stay as mkdocstrings parses them.
_SECTION = re.compile(r"^(Args|Arguments|Returns|Yields|Raises|Attributes|Examples?|Notes?|"
                      r"Warns|Warnings?|Parameters|Keyword Args|Other Parameters|Methods):\s*$")
_ITEM = re.compile(r"^[-*] ")
_INDENTED_ITEM = re.compile(r"^ +([-*]|\d+\.) ")
_FENCE = "```"


def markdown(text: str) -> str:
  """`text` (a cleaned docstring) with its indented blocks fenced and its lists set apart."""
  lines, out, in_section, i = text.split("\n"), [], False, 0
  while i < len(lines):
    line = lines[i]
    previous = out[-1] if out else ""
    indented = line.startswith(" ") and bool(line.strip())
    if _SECTION.match(line):
      in_section = True
    elif line.strip() and not indented:
      in_section = False
    after_text = previous.strip() and not previous.startswith(" ") and not _ITEM.match(previous)
    if indented and not in_section and after_text and _INDENTED_ITEM.match(line):
      # A list indented under its introducing line: set apart, brought to the margin.
      block = []
      while i < len(lines) and lines[i].startswith(" ") and lines[i].strip():
        block.append(lines[i])
        i += 1
      out += ["", *textwrap.dedent("\n".join(block)).split("\n")]
      if i < len(lines) and lines[i].strip():
        out.append("")
      continue
    if indented and not in_section and previous == "":
      block = []
      while i < len(lines) and lines[i].startswith(" ") and lines[i].strip():
        block.append(lines[i])
        i += 1
      out += [f"{_FENCE}text", *textwrap.dedent("\n".join(block)).split("\n"), _FENCE]
      if i < len(lines) and lines[i].strip():
        out.append("")
      continue
    if (_ITEM.match(line) and previous.strip() and not _ITEM.match(previous)
        and not previous.startswith(" ")):
      out.append("")
    out.append(line)
    i += 1
  return "\n".join(out)


class Docstrings(griffe.Extension):
  """Rewrites each object's docstring with `markdown` once griffe has loaded the package."""

  def on_object(self, *, obj, **kwargs) -> None:  # pylint: disable=arguments-differ
    del kwargs
    if obj.docstring is not None:
      obj.docstring.value = markdown(obj.docstring.value)
