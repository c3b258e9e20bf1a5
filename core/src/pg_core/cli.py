"""The ``pg-core`` command (also ``python -m pg_core``).

Each subcommand is a pair of functions: ``_add_<name>(subparsers)`` declares its
arguments and sets ``handler``; ``_<name>(args) -> int`` runs it. Adding one
(``run``, ``bench``, ``conformance``) is adding such a pair to ``_SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from . import bench
from .registry import PluginEntry, default_registry
from .testing import command as conformance

__all__ = ["main"]

_PIP_TCP = " `pip install pg-core[tcp]` gives the pure-Python default."
_NOTHING_INSTALLED = "No backend is installed: pg-core alone has no backend." + _PIP_TCP

_Subparsers = Any  # argparse's _SubParsersAction is private


def main(argv: list[str] | None = None) -> int:
    """Run ``pg-core`` with ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    return handler(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pg-core",
        description="pg-core: object-oriented process groups for PyTorch, with pluggable backends.",
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(subparsers)
    return parser


# -- pg-core backends ------------------------------------------------------------------


def _add_backends(subparsers: _Subparsers) -> None:
    parser = subparsers.add_parser(
        "backends",
        help="list installed backends and plugins, and whether they can run here",
        description=(
            "List every backend that plugin distributions provide (entry-point group 'pg_core.backends'), "
            "with its status: available, unavailable (why), broken (the error), disabled "
            "(PG_CORE_PLUGINS / PG_CORE_DISABLE_PLUGINS) or conflict (two distributions provide one name). "
            "Exits 0 whatever the status: the listing is informational."
        ),
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list of objects instead of a table")
    parser.set_defaults(handler=_backends)


def _backends(args: argparse.Namespace) -> int:
    out = sys.stdout
    entries = default_registry().entries()
    if args.json:
        json.dump([entry.as_dict() for entry in entries], out, indent=2)
        out.write("\n")
        return 0
    if not entries:
        out.write(_NOTHING_INSTALLED + "\n")
        return 0
    out.write(_table(entries) + "\n")
    if any(entry.status == "conflict" for entry in entries):
        out.write(
            "\nConflicts: pin one provider as 'name@distribution', or steer loading with "
            "PG_CORE_PLUGINS / PG_CORE_DISABLE_PLUGINS.\n"
        )
    if not any(entry.status == "available" for entry in entries):
        hint = "" if any(entry.distribution == "pg-tcp" for entry in entries) else _PIP_TCP
        out.write(f"\nNo backend is available here.{hint}\n")
    return 0


def _table(entries: Sequence[PluginEntry]) -> str:
    header = ("NAME", "DISTRIBUTION", "API", "DEVICES", "PRIORITY", "STATUS")
    rows = [header]
    for entry in entries:
        if entry.distribution is None:
            dist = "(in-process)" if entry.entry_point is None else "?"
        else:
            dist = f"{entry.distribution}=={entry.version}" if entry.version else entry.distribution
        status = entry.status if entry.reason is None else f"{entry.status}: {entry.reason}"
        rows.append(
            (
                entry.name,
                dist,
                entry.api_version or "-",
                ",".join(entry.devices) or "-",
                "-" if entry.priority is None else str(entry.priority),
                status.replace("\n", " "),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines = ["  ".join([*(cell.ljust(w) for cell, w in zip(row, widths, strict=False)), row[-1]]) for row in rows]
    return "\n".join(line.rstrip() for line in lines)


_SUBCOMMANDS: list[Callable[[_Subparsers], None]] = [_add_backends, bench.add_parser, conformance.add_parser]
