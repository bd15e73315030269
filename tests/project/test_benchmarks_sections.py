"""BENCHMARKS.md has a current section for every runnable bench script, and its links into the
dated history (docs/benchmark-history.md) and to its own sections land on headings that exist.

A bench script is runnable when it has a ``__main__`` block; helper modules that other scripts
import (the shared workload, the baseline manager) have none and need no section. A section
names its script when its ``## `` heading holds ``bench/<name>.py``. Anchors are computed as
GitHub computes them: the heading's text without its markup, lower-cased, every character but
letters, digits, ``_``, ``-`` and spaces dropped, spaces turned into hyphens, and ``-1``,
``-2``, ... added to repeats.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "BENCHMARKS.md"
HISTORY = ROOT / "docs" / "benchmark-history.md"
HISTORY_LINK = re.compile(r"\]\((?:\./)?docs/benchmark-history\.md#([^)\s]+)\)")
PAGE_LINK = re.compile(r"\]\(#([^)\s]+)\)")
MAIN_BLOCK = re.compile(r"^if __name__ == ['\"]__main__['\"]:", re.MULTILINE)


def headings(text: str) -> list[str]:
    """The text of every Markdown heading, code fences skipped."""
    found, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m and not fenced:
            found.append(m.group(1))
    return found


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor the headings of a Markdown text give, repeats numbered as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    for heading in headings(text):
        a = anchor(heading)
        n = seen.get(a, 0)
        seen[a] = n + 1
        out.add(a if n == 0 else f"{a}-{n}")
    return out


def runnable_benches() -> list[str]:
    """``bench/<name>.py`` of every bench script with a ``__main__`` block."""
    return sorted(
        f"bench/{p.name}"
        for p in (ROOT / "bench").glob("*.py")
        if MAIN_BLOCK.search(p.read_text(encoding="utf-8"))
    )


def sections(text: str) -> dict[str, str]:
    """Each ``## `` section of a Markdown text by its heading, its body up to the next one."""
    parts = re.split(r"^## ", text, flags=re.MULTILINE)[1:]
    return {p.split("\n", 1)[0]: p.split("\n", 1)[1] if "\n" in p else "" for p in parts}


def test_the_helper_modules_are_not_counted_as_benches() -> None:
    benches = runnable_benches()
    assert "bench/manager_loop.py" in benches
    assert "bench/workload.py" not in benches
    assert "bench/baseline_block_manager.py" not in benches


def test_every_runnable_bench_has_a_current_section() -> None:
    named = list(sections(BENCHMARKS.read_text(encoding="utf-8")))
    missing = [
        b for b in runnable_benches() if not any(re.search(re.escape(b) + r"\b", h) for h in named)
    ]
    assert not missing, f"BENCHMARKS.md has no section whose heading names: {missing}"


def test_each_bench_section_links_its_history_or_says_not_recorded() -> None:
    problems = []
    for heading, body in sections(BENCHMARKS.read_text(encoding="utf-8")).items():
        if "bench/" in heading and not (HISTORY_LINK.search(body) or "not recorded yet" in body):
            problems.append(heading)
    assert not problems, f"sections with neither a history link nor 'not recorded yet': {problems}"


def test_links_into_the_history_land_on_its_headings() -> None:
    text = BENCHMARKS.read_text(encoding="utf-8")
    targets = anchors(HISTORY.read_text(encoding="utf-8"))
    links = HISTORY_LINK.findall(text)
    assert links, "BENCHMARKS.md links nowhere into docs/benchmark-history.md"
    broken = sorted({a for a in links if a not in targets})
    assert not broken, f"links to docs/benchmark-history.md with no such heading: {broken}"


def test_links_within_benchmarks_land_on_its_headings() -> None:
    text = BENCHMARKS.read_text(encoding="utf-8")
    broken = sorted({a for a in PAGE_LINK.findall(text) if a not in anchors(text)})
    assert not broken, f"links within BENCHMARKS.md with no such heading: {broken}"


def test_anchors_follow_githubs_rules() -> None:
    assert anchor("Route latency (`python bench/route_latency.py`, 2026-11-30)") == (
        "route-latency-python-benchroute_latencypy-2026-11-30"
    )
    assert anchor("Mooncake FAST'25, Figures 9 and 10, replayed") == (
        "mooncake-fast25-figures-9-and-10-replayed"
    )
    assert anchors("## A\n```\n## not a heading\n```\n## A\n") == {"a", "a-1"}
