"""The README's layout names every package folder of the tree, and only folders that exist.

A package folder is a folder of ``prefixcache/`` (linked ``kernels/`` included) that holds
Python modules or data. The layout is the list under ``## Layout``; a folder counts as named
when its own name appears there as `` `name/` `` (or its path, `` `prefixcache/fleet/` ``),
so a nested folder may be named inside its parent's line.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
HEADING = "## Layout"
NAMED = re.compile(r"`([A-Za-z0-9_./-]+)/`")


def package_folders() -> set[str]:
    """Every folder below ``prefixcache/`` as a path from it (``fleet/index/redis``), caches
    left out; the linked ``kernels/`` counts as ``kernels``."""
    found = set()
    base = ROOT / "prefixcache"
    for here, dirs, _ in os.walk(base, followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__" and not d.startswith(".")]
        for d in dirs:
            found.add((Path(here) / d).relative_to(base).as_posix())
    return found


def layout_names() -> set[str]:
    """The folder names the layout section gives, each as its last path part."""
    text = README.read_text(encoding="utf-8")
    assert HEADING in text, f"README.md has no {HEADING!r} section"
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    return {m.group(1).rstrip("/").split("/")[-1] for m in NAMED.finditer(section)}


def test_every_package_folder_is_in_the_readme_layout() -> None:
    names = layout_names()
    missing = sorted(f for f in package_folders() if f.split("/")[-1] not in names)
    assert not missing, f"README.md's layout does not name: {missing}"


def test_the_layout_names_no_folder_that_is_gone() -> None:
    tops = {"scenarios", "examples", "bench", "tests", "docs", "prefixcache", "kernels"}
    known = {f.split("/")[-1] for f in package_folders()} | tops
    stale = sorted(names for names in layout_names() if names not in known)
    assert not stale, f"README.md's layout names folders that do not exist: {stale}"
