"""docs/architecture.md's module table lists exactly the modules in the tree.

A module is every ``.py`` file of the package, ``__init__.py`` and ``__main__.py`` included (a
package's ``__init__`` is where its public names live, so it gets a row too). The table is the one
under the ``## Modules`` heading; each row's first cell is the file's path from the repository
root in backticks, e.g. `` `prefixcache/blocks/radix.py` ``.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
HEADING = "## Modules"
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|(.*)\|\s*$")


def tree_modules() -> set[str]:
    """Every ``.py`` file of the package as a path from the repository root; a linked folder is
    walked and its files named where they are (``prefixcache/kernels`` links to ``kernels/``,
    whose modules are listed as ``kernels/...``)."""
    found = set()
    for here, dirs, files in os.walk(ROOT / "prefixcache", followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        rel = Path(here).resolve().relative_to(ROOT).as_posix()
        found.update(f"{rel}/{name}" for name in files if name.endswith(".py"))
    return found


def table_rows(text: str) -> list[tuple[str, str]]:
    """(path, job) of every row of the table under HEADING (up to the next ``## ``)."""
    assert HEADING in text, f"docs/architecture.md has no {HEADING!r} section"
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        match = ROW.match(line.strip())
        if match:
            rows.append((match.group(1), match.group(2).strip()))
    return rows


def test_module_table_matches_the_tree() -> None:
    rows = table_rows(DOC.read_text(encoding="utf-8"))
    listed = [path for path, _ in rows]
    twice = sorted(path for path, n in Counter(listed).items() if n > 1)
    tree = tree_modules()
    missing = sorted(tree - set(listed))
    extra = sorted(set(listed) - tree)
    problems = []
    if missing:
        problems.append("modules in the tree but not in the table:\n  " + "\n  ".join(missing))
    if extra:
        problems.append("rows naming no module in the tree:\n  " + "\n  ".join(extra))
    if twice:
        problems.append("rows listed more than once:\n  " + "\n  ".join(twice))
    assert not problems, "docs/architecture.md, " + HEADING + ":\n" + "\n".join(problems)


def test_every_row_says_what_the_module_does() -> None:
    empty = [path for path, job in table_rows(DOC.read_text(encoding="utf-8")) if not job]
    assert not empty, f"rows without a description: {empty}"
