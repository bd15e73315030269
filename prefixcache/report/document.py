"""The full report of one run, as a format-neutral document."""

from __future__ import annotations

from pathlib import Path

from prefixcache.report import sections, sections_sweep, sections_time
from prefixcache.report.model import Document
from prefixcache.report.run import Run


def build_document(run: Run) -> Document:
    r = run.report
    subtitle = (
        f"{Path(r['source']['path']).name}: {r['requests']:,} requests, block size "
        f"{r['config']['block_size']}, {r['config']['capacity_blocks']:,} blocks, "
        f"{r['config']['policy']}, {r['config']['mode']}"
    )
    return Document(
        title="prefixcache report",
        subtitle=subtitle,
        sections=[
            sections.header(run),
            sections.headline(run),
            sections.requests(run),
            sections.misses(run),
            sections.savings(run),
            sections_time.over_time(run),
            sections_time.serving(run),
            sections.top_prefixes(run),
            sections_sweep.sweep(run),
            sections_sweep.consistency(run),
        ],
    )
