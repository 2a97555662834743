"""The report LMCache's batch phases return (`lmcache.cli.metrics.Metrics`'s shape).

LMCache code reads it with `emit()` (print through its handlers: a terminal table of
`width` columns, or JSON) and `to_dict()` (`{"title", "metrics": {section: {key: value}}}`),
or `report["results"]`. The values come from kvedit's Metrics of the same phase, kept in
`report.kvedit` (duration, tokens, bytes, chunk counters, TTFT/TPOT percentiles).
"""
from __future__ import annotations

import json
import sys
from typing import IO, Any

FORMATS = ("terminal", "json")


class Section:
    """A named group of (key, label, value) entries."""

    def __init__(self, key: str | None, label: str | None):
        self.key, self.label = key, label
        self.entries: list[tuple[str, str, Any]] = []

    def add(self, key: str, label: str, value: Any) -> None:
        self.entries.append((key, label, value))

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, _, v in self.entries}


def _shown(value: Any) -> str:
    if value is None:
        return "N/A"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


class TerminalFormatter:
    """A plain table `width` characters wide: title, sections, one `label: value` a line."""

    def __init__(self, width: int = 48):
        self.width = width

    def format(self, title: str, sections: list[Section]) -> str:
        w = self.width
        lines = [f" {title} ".center(w, "=")]
        for s in sections:
            if s.label is not None:
                lines.append(f" {s.label} ".center(w, "-"))
            for _, label, value in s.entries:
                text = _shown(value)
                lines.append(f"{label}:" + " " * max(1, w - len(label) - 1 - len(text)) + text)
        lines.append("=" * w)
        return "\n".join(lines)


class JsonFormatter:
    def __init__(self, indent: int = 2):
        self.indent = indent

    def format(self, title: str, sections: list[Section]) -> str:
        return json.dumps(as_dict(title, sections), indent=self.indent)


def get_formatter(fmt: str, width: int = 80):
    """`fmt` is "terminal" (honours width) or "json" (one JSON document; width unused)."""
    if fmt == "terminal":
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"width must be a positive number of characters, got {width!r}")
        return TerminalFormatter(width)
    if fmt == "json":
        return JsonFormatter()
    raise ValueError(f"Unknown format {fmt!r}. Available: {', '.join(FORMATS)}")


class StreamHandler:
    """Writes the formatted report to `stream` (stdout when None, looked up at emit time)."""

    def __init__(self, formatter=None, stream: IO[str] | None = None):
        self.formatter = formatter or TerminalFormatter()
        self.stream = stream

    def emit(self, title: str, sections: list[Section]) -> None:
        out = self.stream or sys.stdout
        out.write(self.formatter.format(title, sections) + "\n")


def as_dict(title: str, sections: list[Section]) -> dict[str, Any]:
    metrics: dict[str, Any] = {}
    for s in sections:
        if s.key is None:
            metrics.update(s.to_dict())
        else:
            metrics[s.key] = s.to_dict()
    return {"title": title, "metrics": metrics}


class Metrics:
    """A titled report of sections, emitted through its handlers."""

    def __init__(self, title: str):
        self._title = title
        self._sections: list[Section] = []
        self._by_key: dict[str | None, Section] = {}
        self._handlers: list = []
        self.kvedit: list = []   # kvedit Metrics of the phase(s) behind this report

    def title(self, title: str) -> None:
        self._title = title

    def add_handler(self, handler) -> None:
        self._handlers.append(handler)

    def add_section(self, key: str, label: str) -> Section:
        if key in self._by_key:
            raise ValueError(f"Section {key!r} already exists")
        section = self._by_key[key] = Section(key, label)
        self._sections.append(section)
        return section

    def __getitem__(self, key: str) -> Section:
        return self._by_key[key]

    def add(self, key: str, label: str, value: Any) -> None:
        """A top-level entry (an unnamed section shown first)."""
        if None not in self._by_key:
            self._by_key[None] = Section(None, None)
            self._sections.insert(0, self._by_key[None])
        self._by_key[None].add(key, label, value)

    def emit(self) -> None:
        for handler in self._handlers:
            handler.emit(self._title, self._sections)

    def to_dict(self) -> dict[str, Any]:
        return as_dict(self._title, self._sections)

    def __repr__(self) -> str:
        return f"<Metrics {self.to_dict()}>"
