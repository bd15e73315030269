"""Renderers of a report document: terminal text and Markdown, the self-contained HTML page, and
its matplotlib plots of a run and of its sweep."""
