"""Hit-rate and savings reports of replay runs: terminal, Markdown, JSON and HTML; run comparison.

A run directory holds report.json (validated against ``schema.json``), requests.csv and
timeline.csv. Every format renders the same document, with each figure's definition from
:mod:`prefixcache.report.definitions`.
"""

from prefixcache.report.checks import Check, consistency_checks
from prefixcache.report.compare import compare_document
from prefixcache.report.definitions import DEFINITIONS, Definition
from prefixcache.report.document import build_document
from prefixcache.report.html import MissingDependencyError, render_html
from prefixcache.report.markdown import render_markdown
from prefixcache.report.render import html_report, markdown_report, render_all, terminal_report
from prefixcache.report.run import Run, RunDirError, load_run
from prefixcache.report.schema import (
    SCHEMA_VERSION,
    ReportSchemaError,
    load_schema,
    validate_report,
)
from prefixcache.report.terminal import render_terminal

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
    "html_report",
    "load_run",
    "load_schema",
    "markdown_report",
    "render_all",
    "render_html",
    "render_markdown",
    "render_terminal",
    "terminal_report",
    "validate_report",
]
