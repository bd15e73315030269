"""A format-neutral report: sections of labelled figures, tables, text charts and plot slots.

The terminal, Markdown and HTML renderers all print the same document, so a figure has one value
and one definition whatever the format.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixcache.report.definitions import DEFINITIONS, Definition


@dataclass(frozen=True)
class Field:
    label: str
    value: str
    key: str | None = None  # definition key
    note: str = ""  # short qualifier printed after the value, e.g. "estimate"


@dataclass(frozen=True)
class Table:
    columns: list[str]
    rows: list[list[str]]
    caption: str = ""
    key: str | None = None  # definition of the whole table
    row_keys: list[str | None] = field(default_factory=list)  # definition of each row


@dataclass(frozen=True)
class TextChart:
    """Lines of a chart for plain-text formats; HTML shows the matching plot instead."""

    title: str
    lines: list[str]


@dataclass
class Section:
    id: str
    title: str
    fields: list[Field] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    charts: list[TextChart] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)  # plot names, drawn by the HTML renderer
    notes: list[str] = field(default_factory=list)


@dataclass
class Document:
    title: str
    subtitle: str
    sections: list[Section]
    warnings: list[str] = field(default_factory=list)  # shown above everything else

    def definitions(self) -> list[Definition]:
        """Definitions of the figures the document shows, in order of first use."""
        keys: dict[str, None] = {}
        for s in self.sections:
            table_keys = [k for t in s.tables for k in (t.key, *t.row_keys)]
            for k in [*(f.key for f in s.fields), *table_keys]:
                if k is not None:
                    keys.setdefault(k)
        return [DEFINITIONS[k] for k in keys]
