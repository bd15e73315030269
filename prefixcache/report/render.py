"""Rendering a run directory into its report files and into terminal text."""

from __future__ import annotations

from pathlib import Path

from prefixcache.report.document import build_document
from prefixcache.report.html import render_html
from prefixcache.report.markdown import render_markdown
from prefixcache.report.run import Run, load_run
from prefixcache.report.terminal import render_terminal


def _load(run: Run | str | Path) -> Run:
    return run if isinstance(run, Run) else load_run(run)


def terminal_report(run: Run | str | Path, definitions: bool = True) -> str:
    return render_terminal(build_document(_load(run)), definitions=definitions)


def markdown_report(run: Run | str | Path) -> str:
    return render_markdown(build_document(_load(run)))


def html_report(run: Run | str | Path) -> str:
    """The self-contained HTML page; needs matplotlib (``pip install 'prefixcache[report]'``)."""
    loaded = _load(run)
    return render_html(build_document(loaded), loaded)


def render_all(run_dir: str | Path, html: bool = True) -> dict[str, Path]:
    """Write report.md and report.html into the run directory; return their paths by format.

    report.md is written first, so it exists even when the HTML page cannot be drawn because
    matplotlib is missing (:class:`MissingDependencyError`).
    """
    run = load_run(run_dir)
    doc = build_document(run)
    paths = {"md": run.path / "report.md"}
    paths["md"].write_text(render_markdown(doc), encoding="utf-8")
    if html:
        paths["html"] = run.path / "report.html"
        paths["html"].write_text(render_html(doc, run), encoding="utf-8")
    return paths
