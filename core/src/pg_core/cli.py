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
from typing import TYPE_CHECKING, Any

from . import launch

if TYPE_CHECKING:
    from .registry import PluginEntry

__all__ = ["capabilities_table", "main"]

_PIP_TCP = " `pip install pg-core[tcp]` gives the pure-Python default."
_NOTHING_INSTALLED = "No backend is installed: pg-core alone has no backend." + _PIP_TCP

_Subparsers = Any  # argparse's _SubParsersAction is private


def main(argv: list[str] | None = None) -> int:
    """Run ``pg-core`` with ``argv`` (default: ``sys.argv[1:]``); return the exit code.

    ``pg-core run`` is ``pgrun``: it goes straight to the launcher, without importing what
    the other subcommands need (torch), so its ranks start as soon as ``pgrun``'s do."""
    args_given = sys.argv[1:] if argv is None else argv
    if args_given[:1] == ["run"]:
        return launch.main(args_given[1:], prog="pg-core run")
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
    parser.add_argument(
        "--capabilities",
        action="store_true",
        help="print what each backend declares, per device: ops, tags, and per dtype its reduce ops (a Markdown "
        "table, generated from the declared Capabilities: the README's comes from here)",
    )
    parser.add_argument("names", nargs="*", help="with --capabilities: only these backends, in this order")
    parser.set_defaults(handler=_backends)


def _backends(args: argparse.Namespace) -> int:
    from .registry import default_registry

    out = sys.stdout
    entries = default_registry().entries()
    if args.capabilities:
        if args.names:
            by_name = {e.name: e for e in entries}
            missing = [n for n in args.names if n not in by_name]
            if missing:
                sys.stderr.write(f"pg-core backends: no backend named {', '.join(missing)}\n")
                return 2
            entries = [by_name[n] for n in args.names]
        out.write(capabilities_table(entries) + "\n")
        return 0
    if args.json:
        json.dump([entry.as_dict() for entry in entries], out, indent=2)
        out.write("\n")
        return 0
    if not entries:
        out.write(_NOTHING_INSTALLED + "\n")
        return 0
    out.write(_table(entries) + "\n")
    defaults = default_registry().describe_defaults()
    if defaults:
        out.write("\nDefault for backends=None: " + defaults.replace("\n", "; ") + "\n")
    if any(entry.status == "conflict" for entry in entries):
        out.write(
            "\nConflicts: pin one provider as 'name@distribution', or steer loading with "
            "PG_CORE_PLUGINS / PG_CORE_DISABLE_PLUGINS.\n"
        )
    if not any(entry.status == "available" for entry in entries):
        hint = "" if any(entry.distribution == "pg-tcp" for entry in entries) else _PIP_TCP
        out.write(f"\nNo backend is available here.{hint}\n")
    return 0


_SHORT = {"PRODUCT": "PROD", "PREMUL_SUM": "PREMUL"}


def capabilities_table(entries: Sequence[PluginEntry]) -> str:
    """What every backend with a spec declares, one column per (backend, device), as Markdown:
    the ops it lacks, whether it receives from any source (the optional ``recv_anysource``),
    its tag range, the size up to which a blocking send never waits for its receiver
    (``eager_limit_bytes``), and per dtype the reduce ops (``copies`` where the dtype moves but does
    not reduce, ``-`` where it is not declared)."""
    from .backend import DTYPES
    from .dtypes import dtype_name
    from .ops import OPS, RedOpType

    columns = [(e, d) for e in entries if e.spec is not None for d in e.spec.devices]
    if not columns:
        return _NOTHING_INSTALLED
    header = ["", *(f"{e.name} ({d})" for e, d in columns)]
    rows = [header, ["---"] * len(header)]
    caps = [e.spec.capabilities_for(d) for e, d in columns if e.spec is not None]
    rows.append(
        ["ops", *(("all" if c.ops >= set(OPS) else "no " + ", ".join(o for o in OPS if o not in c.ops)) for c in caps)]
    )
    rows.append(["recv from any source", *(("yes" if "recv_anysource" in c.ops else "no") for c in caps)])
    rows.append(["tags", *(_tags(c.max_tag) for c in caps)])
    rows.append(["a blocking send never waits up to", *(_eager(c.eager_limit_bytes) for c in caps)])
    for dtype in DTYPES:
        cells = []
        for c in caps:
            if dtype not in c.dtypes:
                cells.append("-")
                continue
            ops = [t for t in RedOpType if t in c.reduce_ops_for(dtype)]
            cells.append(" ".join(_SHORT.get(t.name, t.name) for t in ops) or "copies")
        rows.append([dtype_name(dtype), *cells])
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def _eager(limit: int | None) -> str:
    """``Capabilities.eager_limit_bytes`` as the capabilities table shows it."""
    if limit is None:
        return "any size"
    if limit == 0:
        return "0 B (any send may wait)"
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if limit >= 1 << shift and limit % (1 << shift) == 0:
            return f"{limit >> shift} {unit}"
    return f"{limit} B"


def _tags(max_tag: int | None) -> str:
    if max_tag is None:
        return "none (order per peer)"
    if (max_tag + 1) & max_tag == 0:  # 2**k - 1
        return f"0 .. 2**{(max_tag + 1).bit_length() - 1} - 1"
    return f"0 .. {max_tag}"


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


# -- pg-core trace ---------------------------------------------------------------------------------


def _add_trace(subparsers: _Subparsers) -> None:
    parser = subparsers.add_parser(
        "trace",
        help="merge a job's flight-recorder dumps (PG_CORE_TRACE_DIR) into one report",
        description=(
            "Read every rank's dump in DIR (written on a failure where PG_CORE_TRACE_DIR was set) and report, per "
            "group: which ranks dumped and which were not heard from, where each stands (the collective it is "
            "in, the last it completed), and the first sequence number at which the ranks' collectives differ. "
            "Dumps are read without loading any class. Exit status: 0 a report, 2 no dump in DIR."
        ),
    )
    parser.add_argument("dir", metavar="DIR", help="the folder PG_CORE_TRACE_DIR named")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(handler=_trace)


def _trace(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .traces import load_dump, merge, merged_text

    folder = Path(args.dir)
    if not folder.is_dir():
        sys.stderr.write(f"pg-core trace: {folder} is not a folder; give the one PG_CORE_TRACE_DIR named\n")
        return 2
    states, skipped = [], []
    for path in sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")):
        try:
            dump = load_dump(path)
        except (OSError, ValueError) as exc:
            skipped.append({"file": path.name, "why": str(exc)})
            continue
        state = dump.get("pg_core")
        if not isinstance(state, dict):
            skipped.append({"file": path.name, "why": "a dump of torch's own recorder, not pg-core's"})
            continue
        states.append(state)
    if not states:
        why = "".join(f"\n  {s['file']}: {s['why']}" for s in skipped)
        sys.stderr.write(f"pg-core trace: no pg-core dump in {folder}{why}\n")
        return 2
    groups = merge(states)
    if args.json:
        json.dump({"groups": groups, "skipped": skipped}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    sys.stdout.write(merged_text(groups, str(folder)))
    for s in skipped:
        sys.stdout.write(f"skipped {s['file']}: {s['why']}\n")
    return 0


def _add_bench(subparsers: _Subparsers) -> None:
    from . import bench

    bench.add_parser(subparsers)


def _add_conformance(subparsers: _Subparsers) -> None:
    from .testing import command as conformance

    conformance.add_parser(subparsers)


_SUBCOMMANDS: list[Callable[[_Subparsers], None]] = [
    _add_backends,
    launch.add_parser,
    _add_bench,
    _add_conformance,
    _add_trace,
]
