"""An mkdocs hook: the tables a page asks for, generated from the installed plugins at build time.

A page writes ``<!-- generated: NAME -->`` on a line of its own; the build puts the table
NAME there, made from what the plugins installed in the building environment declare
(``pg_core.default_registry()``), never copied by hand. An unknown NAME fails the build.

* ``backends``: every installed backend, its distribution, backend API version, device
  types, priority, launcher and description;
* ``capabilities``: what each declares (``pg-core backends --capabilities``), one column per
  backend and device type.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from pg_core.cli import capabilities_table
from pg_core.registry import PluginEntry, default_registry

_MARKER = re.compile(r"^<!-- generated: (?P<name>[a-z-]+) -->$", flags=re.MULTILINE)


def _entries() -> list[PluginEntry]:
    """The backends that loaded, cpu ones first, each device type's by falling priority."""
    loaded = [e for e in default_registry().entries() if e.spec is not None]
    return sorted(loaded, key=lambda e: ("cpu" not in e.devices, -(e.priority or 0), e.name))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def backends_table(entries: Sequence[PluginEntry]) -> str:
    """The installed backends as a Markdown table (what ``pg-core backends`` lists, less the
    machine-dependent status)."""
    rows = [
        "| name | distribution | API | devices | priority | launcher | what |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for e in entries:
        assert e.spec is not None
        dist = f"{e.distribution} {e.version}" if e.version else str(e.distribution)
        rows.append(
            f"| `{e.name}` | {dist} | {e.api_version} | {', '.join(e.devices)} | {e.priority} | "
            f"{e.spec.launcher or '-'} | {_cell(e.spec.description or '')} |"
        )
    return "\n".join(rows)


_TABLES: dict[str, Callable[[Sequence[PluginEntry]], str]] = {
    "backends": backends_table,
    "capabilities": capabilities_table,
}


def on_page_markdown(markdown: str, *, page: Any, config: Any, files: Any) -> str:
    """mkdocs' hook: each marker of ``markdown`` replaced by its table."""

    def table(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in _TABLES:
            raise ValueError(
                f"{page.file.src_path}: unknown generated table {name!r}; the hook makes {', '.join(sorted(_TABLES))}"
            )
        return _TABLES[name](_entries())

    return _MARKER.sub(table, markdown)
