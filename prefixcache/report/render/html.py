"""One self-contained HTML page: figures, tables and inline PNG plots; no scripts, no network.

Also writes a run directory's report files (report.md and report.html). The stylesheet gives one
column on narrow screens and figures beside plots on laptops.
"""

from __future__ import annotations

from collections.abc import Callable
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING

from prefixcache.atomic_files import write_text_atomic
from prefixcache.errors import MissingDependencyError
from prefixcache.report.definitions import DEFINITIONS
from prefixcache.report.document import Document, Field, Section, Table
from prefixcache.report.render.text_formats import render_markdown
from prefixcache.report.run_dir import Run, load_run
from prefixcache.report.sections import build_document

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# (definition key, label) of the figures repeated as tiles at the top of the page
TILES = (
    ("token_hit_rate", "Token hit rate"),
    ("upper_bound", "Upper bound"),
    ("achieved", "Achieved / upper bound"),
    ("block_hit_rate", "Block hit rate"),
    ("zero_hit_requests", "Requests with zero hits"),
    ("prefill_tokens_saved", "Prefill tokens saved"),
)
WIDE_INCHES = 10.0  # plots at least this wide span the whole section
SIDE_TABLE_COLUMNS = 5  # wider tables take the full width, with the plots below them
SPLIT_FIELDS = 6  # more full-width figures than this are shown in two columns
Plotter = Callable[[Run], tuple[str, bool]]  # a run -> (base64 PNG, whether the plot is wide)


def _plotters() -> dict[str, Plotter]:
    """Each plot, by name, as a function from the run to a base64 PNG and whether it is wide;
    MissingDependencyError when matplotlib is not installed."""
    try:
        from prefixcache.report.render.plots import RUN_PLOTS, png_base64
        from prefixcache.report.render.sweep_plots import SWEEP_PLOTS
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] == "matplotlib":
            raise MissingDependencyError(
                "the HTML report draws its plots with matplotlib, which is not installed; "
                "install it with: pip install 'prefixcache[report]'"
            ) from exc
        raise

    def plotter(draw: Callable[[Run], Figure]) -> Plotter:
        def run_plot(run: Run) -> tuple[str, bool]:
            fig = draw(run)
            return png_base64(fig), fig.get_figwidth() >= WIDE_INCHES

        return run_plot

    return {name: plotter(draw) for name, draw in {**RUN_PLOTS, **SWEEP_PLOTS}.items()}


def _term(label: str, key: str | None) -> str:
    """``label`` as HTML, with its definition as a tooltip when ``key`` names one."""
    if key is None:
        return escape(label)
    return f'<span class="term" title="{escape(DEFINITIONS[key].text)}">{escape(label)}</span>'


def _fields(fields: list[Field], narrow: bool = False) -> str:
    """A section's figures as a two-column table."""
    rows = []
    for f in fields:
        note = f' <span class="note">({escape(f.note)})</span>' if f.note else ""
        cls = ' class="digest"' if f.key in ("trace_sha256", "config_sha256") else ""
        rows.append(
            f"<tr><td>{_term(f.label, f.key)}</td><td{cls}>{escape(f.value)}{note}</td></tr>"
        )
    cls = "fields narrow" if narrow else "fields"
    return f'<table class="{cls}"><tbody>{"".join(rows)}</tbody></table>'


def _table(t: Table, failed: bool = False) -> str:
    """A table in a sideways-scrolling box, then its caption; ``failed`` colours its rows."""
    head = "".join(f"<th>{escape(c)}</th>" for c in t.columns)
    keys = t.row_keys or [None] * len(t.rows)
    body = "".join(
        "<tr>"
        + f"<td>{_term(row[0], key)}</td>"
        + "".join(f"<td>{escape(c)}</td>" for c in row[1:])
        + "</tr>"
        for row, key in zip(t.rows, keys, strict=True)
    )
    caption = f'<p class="caption">{escape(t.caption)}</p>' if t.caption else ""
    title = f' title="{escape(DEFINITIONS[t.key].text)}"' if t.key else ""
    cls = ' class="failed"' if failed else ""
    # in a box of its own that scrolls sideways: a wide table (a sweep's) stays within the page
    return (
        f'<div class="scroll"><table{title}{cls}><thead><tr>{head}</tr></thead>'
        f"<tbody>{body}</tbody></table></div>" + caption
    )


def _figure(name: str, run: Run, plotters: dict[str, Plotter]) -> tuple[str, bool]:
    """Plot ``name`` drawn as an inline PNG ``<figure>``, and whether it is wide."""
    data, wide = plotters[name](run)
    alt = escape(name.replace("_", " "))
    cls = ' class="wide"' if wide else ""
    return f'<figure{cls}><img alt="{alt}" src="data:image/png;base64,{data}"></figure>', wide


def _section(s: Section, run: Run, plotters: dict[str, Plotter]) -> str:
    """Figures beside the plots when both fit; otherwise text on top and plots below, paired."""
    figures = [_figure(name, run, plotters) for name in s.plots]
    narrow = [html for html, wide in figures if not wide]
    wide = "".join(html for html, is_wide in figures if is_wide)
    side = bool(narrow) and all(len(t.columns) <= SIDE_TABLE_COLUMNS for t in s.tables)
    fields = ""
    if s.fields and not side and len(s.fields) > SPLIT_FIELDS:
        half = -(-len(s.fields) // 2)
        fields = f'<div class="pair">{_fields(s.fields[:half])}{_fields(s.fields[half:])}</div>'
    elif s.fields:
        fields = _fields(s.fields, narrow=not side)
    tables = "".join(_table(t, failed=s.id == "consistency") for t in s.tables)
    notes = "".join(f'<p class="note">{escape(n)}</p>' for n in s.notes)
    if side:
        text = f"<div>{fields}{tables}{notes}</div>"
        body = f'<div class="cols">{text}<div>{"".join(narrow)}</div></div>{wide}'
    else:  # plots before long tables, so a sweep's curve is seen before its rows
        pair = f'<div class="pair">{"".join(narrow)}</div>' if narrow else ""
        body = f"{fields}{wide}{pair}{tables}{notes}"
    return f'<section id="{s.id}"><h2>{escape(s.title)}</h2>{body}</section>'


def _tiles(doc: Document) -> str:
    """The ``TILES`` figures the document has, each from the first field with its key."""
    first: dict[str, Field] = {}
    for f in (f for s in doc.sections for f in s.fields):
        if f.key is not None:
            first.setdefault(f.key, f)
    tiles = [
        f'<div class="tile"><div class="v">{escape(first[k].value)}</div>'
        f'<div class="k">{_term(label, k)}</div></div>'
        for k, label in TILES
        if k in first
    ]
    return f'<div class="tiles">{"".join(tiles)}</div>'


def render_html(doc: Document, run: Run) -> str:
    """The self-contained HTML page of ``doc`` (as ``build_document`` builds it from ``run``),
    with the plots its sections name drawn from ``run``'s data. Raises MissingDependencyError when
    matplotlib is not installed."""
    plotters = _plotters()
    nav = "".join(f'<a href="#{s.id}">{escape(s.title.split(":")[0])}</a>' for s in doc.sections)
    body = "".join(_section(s, run, plotters) for s in doc.sections)
    warnings = "".join(
        f'<p class="warning" role="alert"><strong>Warning:</strong> {escape(w)}</p>'
        for w in doc.warnings
    )
    glossary = "".join(
        f"<dt>{escape(d.term)}</dt><dd>{escape(d.text)}</dd>" for d in doc.definitions()
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(doc.title)}: {escape(doc.subtitle)}</title><style>{CSS}</style></head>"
        f'<body><main><h1>{escape(doc.title)}</h1><p class="sub">{escape(doc.subtitle)}</p>'
        f'<nav>{nav}<a href="#definitions">Definitions</a></nav>{warnings}{_tiles(doc)}{body}'
        f'<section id="definitions"><h2>Definitions</h2><dl>{glossary}</dl></section>'
        "</main></body></html>\n"
    )


def html_report(run: Run | str | Path) -> str:
    """The self-contained HTML page of a run: a loaded ``Run`` or a run directory's path.
    Raises RunDirError or ReportSchemaError when the directory cannot be loaded (``load_run``),
    MissingDependencyError when matplotlib is not installed
    (``pip install 'prefixcache[report]'``)."""
    loaded = run if isinstance(run, Run) else load_run(run)
    return render_html(build_document(loaded), loaded)


def render_all(run_dir: str | Path, html: bool = True) -> dict[str, Path]:
    """Write report.md and, when ``html``, report.html into the run directory (each
    atomically); return their paths by format (``"md"``, ``"html"``).

    report.md is written first, so it exists even when the HTML page cannot be drawn because
    matplotlib is missing (:class:`MissingDependencyError`). A directory that cannot be loaded
    raises RunDirError or ReportSchemaError and writes nothing.
    """
    run = load_run(run_dir)
    doc = build_document(run)
    paths = {"md": run.path / "report.md"}
    write_text_atomic(paths["md"], render_markdown(doc))
    if html:
        paths["html"] = run.path / "report.html"
        write_text_atomic(paths["html"], render_html(doc, run))
    return paths


# ---- the stylesheet ---------------------------------------------------------------------------


# the page's whole stylesheet, inlined in its <style>
CSS = """
:root { --ink: #1d2430; --muted: #5b6575; --rule: #dfe3ea; --accent: #1f77b4; --bad: #b42318; }
* { box-sizing: border-box; }
body { margin: 0; background: #f6f7f9; color: var(--ink);
  font: 15px/1.45 -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
main { max-width: 1180px; margin: 0 auto; padding: 24px 28px 48px; }
h1 { margin: 0; font-size: 26px; }
h2 { margin: 0 0 12px; font-size: 19px; }
.sub { margin: 4px 0 16px; color: var(--muted); }
nav { display: flex; flex-wrap: wrap; gap: 6px 14px; margin-bottom: 18px; font-size: 13px; }
nav a { color: var(--accent); text-decoration: none; }
.tiles { display: grid; grid-template-columns: repeat(auto-fit, minmax(160px, 1fr)); gap: 12px;
  margin-bottom: 18px; }
.tile { background: #fff; border: 1px solid var(--rule); border-radius: 8px; padding: 12px 14px; }
.tile .v { font-size: 24px; font-weight: 600; }
.tile .k { color: var(--muted); font-size: 13px; }
section { background: #fff; border: 1px solid var(--rule); border-radius: 8px;
  padding: 18px 20px; margin-bottom: 18px; }
.cols { display: grid; grid-template-columns: minmax(0, 1fr) minmax(0, 1.15fr); gap: 20px;
  align-items: start; }
.pair { display: grid; grid-template-columns: minmax(0, 1fr) minmax(0, 1fr); gap: 12px 28px;
  align-items: start; }
@media (max-width: 900px) { .cols, .pair { grid-template-columns: minmax(0, 1fr); } }
table.narrow { max-width: 560px; }
.scroll { overflow-x: auto; max-width: 100%; margin-bottom: 12px; }
.scroll table { margin-bottom: 0; }
table { border-collapse: collapse; width: 100%; font-size: 14px; margin-bottom: 12px; }
th, td { padding: 4px 8px; border-bottom: 1px solid var(--rule); text-align: right;
  vertical-align: top; white-space: nowrap; }
td.digest, table.fields td:last-child { white-space: normal; }
th:first-child, td:first-child { text-align: left; }
th { color: var(--muted); font-weight: 600; white-space: normal; }
td.text { text-align: left; }
table.fields td:last-child { font-variant-numeric: tabular-nums; overflow-wrap: anywhere; }
td { font-variant-numeric: tabular-nums; }
.term { text-decoration: underline dotted #9aa3b2; cursor: help; }
.note { color: var(--muted); font-size: 12px; }
.caption { color: var(--muted); font-size: 13px; margin: -6px 0 10px; }
figure { margin: 0; }
figure img { display: block; width: 100%; height: auto; }
figure.wide { margin-top: 8px; }
.failed td { color: var(--bad); }
.warning { background: #fef3f2; border: 2px solid var(--bad); border-radius: 8px; color: var(--bad);
  padding: 10px 14px; margin: 0 0 14px; font-size: 15px; }
.digest { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12.5px; }
dl { margin: 0; display: grid; grid-template-columns: minmax(140px, 220px) 1fr; gap: 6px 16px;
  font-size: 14px; }
dt { font-weight: 600; }
dd { margin: 0; color: #333b48; }
"""
