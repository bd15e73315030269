"""Markdown rendering: tables of figures, text charts in code blocks, definitions at the end."""

from __future__ import annotations

from prefixcache.report.model import Document, Section, Table


def _escape(cell: str) -> str:
    return cell.replace("|", "\\|").replace("\n", " ")


def table_markdown(table: Table) -> list[str]:
    lines = [
        "| " + " | ".join(_escape(c) for c in table.columns) + " |",
        "|" + "|".join("---" if i == 0 else "--:" for i in range(len(table.columns))) + "|",
    ]
    lines += ["| " + " | ".join(_escape(c) for c in row) + " |" for row in table.rows]
    if table.caption:
        lines += ["", f"*{table.caption}*"]
    return lines


def section_markdown(section: Section) -> list[str]:
    lines = [f"## {section.title}", ""]
    if section.fields:
        lines += ["| Figure | Value |", "|---|--:|"]
        for f in section.fields:
            note = f" *({f.note})*" if f.note else ""
            lines.append(f"| {_escape(f.label)} | {_escape(f.value)}{note} |")
        lines.append("")
    for table in section.tables:
        lines += [*table_markdown(table), ""]
    for chart in section.charts:
        lines += [f"**{chart.title}**", "", "```text", *chart.lines, "```", ""]
    lines += [*(f"{note}\n" for note in section.notes)]
    return lines


def render_markdown(doc: Document) -> str:
    lines = [f"# {doc.title}", "", doc.subtitle, ""]
    for section in doc.sections:
        lines += section_markdown(section)
    lines += ["## Definitions", ""]
    lines += [f"- **{d.term}**: {d.text}" for d in doc.definitions()]
    return "\n".join(lines) + "\n"
