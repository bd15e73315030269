"""Hit-rate and savings reports of replay runs: terminal, Markdown, JSON and HTML; run comparison.

A run directory holds report.json (validated against ``schema.json``), requests.csv and
timeline.csv; a report reads nothing else. Every format renders the same document, with each
figure's definition from :mod:`prefixcache.report.definitions`.
"""

from prefixcache.report.checks import Check, consistency_checks
from prefixcache.report.compare import compare_document
from prefixcache.report.definitions import DEFINITIONS, Definition
from prefixcache.report.render.html import (
    MissingDependencyError,
    html_report,
    render_all,
    render_html,
)
from prefixcache.report.render.text_formats import format_summary, render_markdown, render_terminal
from prefixcache.report.run_dir import (
    ReportSchemaError,
    Run,
    RunDirError,
    load_run,
    load_schema,
    validate_report,
)
from prefixcache.report.sections import build_document
from prefixcache.run_format import SCHEMA_VERSION

__all__ = [
    "DEFINITIONS",
    "SCHEMA_VERSION",
    "Check",
    "Definition",
    "MissingDependencyError",
    "ReportSchemaError",
    "Run",
    "RunDirError",
    "build_document",
    "compare_document",
    "consistency_checks",
    "format_summary",
    "html_report",
    "load_run",
    "load_schema",
    "render_all",
    "render_html",
    "render_markdown",
    "render_terminal",
    "validate_report",
]
