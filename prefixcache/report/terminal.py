"""Plain-text rendering with ruled sections, for the terminal."""

from __future__ import annotations

import textwrap

from prefixcache.report.model import Document, Field, Section, Table

WIDTH = 88


def _rule(title: str, char: str = "─") -> str:
    head = f"{char * 2} {title} "
    return head + char * max(0, WIDTH - len(head))


def _field(f: Field, pad: int) -> str:
    note = f"  ({f.note})" if f.note else ""
    return f"  {f.label:<{pad}}  {f.value}{note}"


def table_lines(table: Table, indent: str = "  ") -> list[str]:
    """Columns padded to their widest cell; numbers right-aligned, text left-aligned."""
    cells = [table.columns, *table.rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(table.columns))]

    def line(row: list[str]) -> str:
        parts = [
            c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(row, widths, strict=True)
        ]
        return (indent + "  ".join(parts)).rstrip()

    lines = [line(table.columns), indent + "  ".join("─" * w for w in widths)]
    lines += [line(r) for r in table.rows]
    if table.caption:
        lines.append(f"{indent}{table.caption}")
    return lines


def _numeric(cell: str) -> bool:
    return bool(cell) and (cell[0].isdigit() or cell[0] in "+-") and cell[-1] not in ")"


def section_lines(section: Section) -> list[str]:
    lines = [_rule(section.title)]
    pad = max((len(f.label) for f in section.fields), default=0)
    lines += [_field(f, pad) for f in section.fields]
    for table in section.tables:
        lines += ["", *table_lines(table)] if section.fields else table_lines(table)
    for chart in section.charts:
        lines += ["", f"  {chart.title}", *(f"  {line}" for line in chart.lines)]
    for note in section.notes:
        lines += textwrap.wrap(note, WIDTH, initial_indent="  ", subsequent_indent="  ")
    return lines


def render_terminal(doc: Document, definitions: bool = True) -> str:
    lines = [_rule(doc.title, "═"), f"  {doc.subtitle}", ""]
    for section in doc.sections:
        lines += [*section_lines(section), ""]
    if definitions:
        lines.append(_rule("Definitions"))
        for d in doc.definitions():
            lines += textwrap.wrap(
                f"{d.term}: {d.text}", WIDTH, initial_indent="  ", subsequent_indent="    "
            )
        lines.append("")
    return "\n".join(lines)
