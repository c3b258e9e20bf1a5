"""Rows and reports: one measured (op, size, backend) as a :class:`Row`, the ratios of a
backend to its baseline and of an op to its reference op, and the table, JSON and CSV the
command prints."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import re
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from .catalog import (
    BASELINE,
    BASELINE_OF,
    BLOCKING_OF,
    CONTROL,
    ECHO_OPS,
    MPI4PY,
    OBJECT_OPS,
    REDUCING_OPS,
    REFERENCE_OPS,
    ROOT,
    ROOTED_OPS,
)

if TYPE_CHECKING:
    from ..registry import PluginEntry

__all__ = [
    "Row",
    "add_ratios",
    "compared_with",
    "describe_backends",
    "format_csv",
    "format_json",
    "format_table",
    "quartiles",
]


@dataclasses.dataclass
class Row:
    """One measured (op, size, backend). Times in microseconds, bandwidths in GB/s.

    ``status``: ``"ok"``, ``"WRONG"`` (``detail`` says what) or ``"skipped"``
    (``detail`` says why). ``ratio`` is this row's median over the baseline's
    median at the same op and size (pg-core backends only, when the baseline ran).
    ``ref_ratio`` is this row's median over that of ``ref_op`` (:data:`~pg_core.bench.catalog.REFERENCE_OPS`)
    on the same backend at the same size, when that row was measured in the run, and
    ``ref_diff_us`` their difference (this row's median minus that one's, microseconds):
    for an asynchronous form (:data:`~pg_core.bench.catalog.ASYNC_OPS`), what ``async_op=True`` plus ``wait()``
    costs over the blocking call.
    For object ops ``dtype`` is ``"object"``, ``count`` the payload's bytes and
    ``size`` the pickled object's bytes.
    """

    op: str
    backend: str
    baseline: bool
    size: int
    requested_size: int
    count: int
    dtype: str
    world_size: int
    warmup: int
    iters: int
    min_us: float | None
    median_us: float | None
    max_us: float | None
    algbw_gbps: float | None
    busbw_gbps: float | None
    status: str
    detail: str | None = None
    ratio: float | None = None
    ratio_to: str | None = None
    ref_ratio: float | None = None
    ref_op: str | None = None
    ref_diff_us: float | None = None
    rounds: int = 1  # --rounds: blocks the timed iterations came in, interleaved with the other rows'
    #: with ``--rounds R`` (R > 1): the median of each round's iterations, in round order
    round_median_us: list[float] | None = None
    #: with ``--rounds R``: this row's round median over its baseline's in the same round, round by round
    round_ratios: list[float] | None = None
    #: with ``--rounds R``: this row's round median minus its ``ref_op``'s in the same round (microseconds)
    ref_round_diffs_us: list[float] | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Row:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def compared_with(label: str, baselines: Sequence[str]) -> str | None:
    """The baseline that backend ``label``'s rows are compared with, of ``baselines`` (those
    measured, in order): the one whose library it wraps (:data:`~pg_core.bench.catalog.BASELINE_OF`; ``gloo`` with
    ``torch-gloo``, ``mpi`` with ``mpi4py``), else the first; ``None`` if none was measured."""
    if label in baselines:  # a --control row: the same baseline, timed again
        return label
    own = [b for b in baselines if BASELINE_OF.get(b) == label]
    return own[0] if own else next(iter(baselines), None)


def add_ratios(rows: list[Row]) -> None:
    """Fill in each row's ``ratio`` to its baseline (:func:`compared_with`) at the same op and
    size, round by round too (``round_ratios``), and ``ref_ratio``/``ref_diff_us`` to its
    reference op on the same backend and size (round by round too: ``ref_round_diffs_us``),
    where those rows were measured."""
    baselines = list(dict.fromkeys(r.backend for r in rows if r.baseline))
    base = {(r.op, r.size, r.backend): r for r in rows if r.baseline and r.median_us}
    same = {(r.op, r.size, r.backend): r for r in rows if r.median_us}
    for row in rows:
        if row.median_us is None:
            continue
        against = None if row.baseline else compared_with(row.backend.split(".")[0], baselines)
        ref = None if against is None else base.get((row.op, row.size, against))
        if ref is not None and ref.median_us:
            row.ratio = row.median_us / ref.median_us
            row.ratio_to = ref.backend
            mine, theirs = row.round_median_us, ref.round_median_us
            if mine and theirs and len(mine) == len(theirs) and all(theirs):
                row.round_ratios = [a / b for a, b in zip(mine, theirs, strict=True)]
        ref_op = REFERENCE_OPS.get(row.op)
        other = None if ref_op is None else same.get((ref_op, row.size, row.backend))
        if other is not None and other.median_us:
            row.ref_ratio = row.median_us / other.median_us
            row.ref_diff_us = row.median_us - other.median_us
            row.ref_op = ref_op
            mine, theirs = row.round_median_us, other.round_median_us
            if mine and theirs and len(mine) == len(theirs):
                row.ref_round_diffs_us = [a - b for a, b in zip(mine, theirs, strict=True)]


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """The first and third quartiles of ``values`` (at least one): the middle half's ends."""
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


#: What each baseline is, for the report's list of what it shows.
_BASELINE_IS: Final[dict[str, str]] = {
    BASELINE: "baseline: torch's own ProcessGroupGloo, called through torch's API (not pg-core)",
    MPI4PY: "baseline: raw mpi4py on MPI_COMM_WORLD (not pg-core)",
}


def describe_backends(labels: Sequence[str], entries: Sequence[PluginEntry]) -> list[str]:
    """What each backend of ``labels`` (the rows' ``backend``, in order) is, one line each,
    from the plugin registry's ``entries``: its distribution and version, and the summary
    that distribution's metadata gives (``importlib.metadata``): a plugin published as an
    example says so there. A baseline says what it calls; ``.again`` / ``.to_torch`` rows are
    their backend's; a backend no installed plugin provides (a ``module:attr`` reference) says that."""
    from importlib import metadata

    def canonical(distribution: str) -> str:
        return re.sub(r"[-_.]+", "-", distribution).lower()

    lines = []
    for label in dict.fromkeys(labels):
        if label.endswith((CONTROL, ".to_torch")):
            continue  # a variant row of a backend described on its own line
        name, _, pin = label.partition("@")  # "tcp@pg-tcp": a pinned distribution
        entry = next(
            (e for e in entries if e.name == name and (not pin or canonical(e.distribution or "") == canonical(pin))),
            None,
        )
        if name in _BASELINE_IS:
            what = _BASELINE_IS[name]
        elif entry is None or entry.distribution is None:
            what = "not an installed plugin (a spec given by reference, or registered in-process)"
        else:
            what = f"{entry.distribution} {entry.version or ''}".rstrip()
            with contextlib.suppress(metadata.PackageNotFoundError):
                summary = metadata.metadata(entry.distribution).json.get("summary")
                if summary:
                    what += f": {summary}"
        lines.append(f"{label}: {what}")
    return lines


def format_table(rows: Sequence[Row], about: Sequence[str] = ()) -> str:
    """One nccl-tests-style table per op, then a legend; ``about``: a line per backend shown,
    what it is (:func:`describe_backends`), listed first in the legend."""
    out: list[str] = []
    for op in dict.fromkeys(r.op for r in rows):
        mine = [r for r in rows if r.op == op]
        ref_op = REFERENCE_OPS.get(op)
        header = ["size", "count", "backend", "iters", "min", "median", "max", "algbw", "busbw", "ratio"]
        header += [] if ref_op is None else [f"vs {ref_op}"]
        lines = [[*header, "check"]]
        for r in mine:
            check = r.status if r.status != "skipped" else f"skipped: {r.detail}"
            ratio = "-" if r.ratio is None else f"{r.ratio:.2f}x {r.ratio_to}"
            if r.round_ratios:
                low, high = quartiles(r.round_ratios)
                ratio += f" [{low:.2f}-{high:.2f}]"
            line = [
                str(r.size),
                str(r.count),
                r.backend,
                str(r.iters) if r.median_us is not None else "-",
                _fmt(r.min_us, ".1f"),
                _fmt(r.median_us, ".1f"),
                _fmt(r.max_us, ".1f"),
                _fmt(r.algbw_gbps, ".3f"),
                _fmt(r.busbw_gbps, ".3f"),
                ratio,
            ]
            if ref_op is not None:
                diff = "" if r.ref_diff_us is None else f" {r.ref_diff_us:+.1f}us"
                if r.ref_round_diffs_us:
                    low, high = quartiles(r.ref_round_diffs_us)
                    diff += f" [{low:+.1f} {high:+.1f}]"
                line.append("-" if r.ref_ratio is None else f"{r.ref_ratio:.2f}x{diff}")
            lines.append([*line, check])
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        out.append(f"# {op} ({_what(op, mine[0])})")
        for line in lines:
            cells = [c.ljust(w) if i == 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=False))]
            out.append(("  ".join(cells) + "  " + line[-1]).rstrip())
        out.append("")
    if about:
        out.append("# backends:")
        out.extend(f"#   {line}" for line in about)
    out.append(
        "# size: bytes of the largest buffer per rank; count: its elements. min/median/max: microseconds per\n"
        "# iteration (slowest rank). algbw = size / median, busbw = algbw * nccl-tests factor, in GB/s.\n"
        "# ratio: median time / its baseline's median at the same op and size (below 1x is faster); a backend's\n"
        "# baseline is the raw library it wraps (gloo: torch-gloo, mpi: mpi4py) when measured, else the first.\n"
        "# Compare ratios measured side by side in one run, not absolute times across runs or machines."
    )
    if any(r.round_ratios for r in rows):
        out.append("# [a-b] (--rounds): the middle half of the ratios of each round's medians, round by round.")
    if any(r.ref_round_diffs_us for r in rows):
        out.append("# [+a +b] after a vs OP difference (--rounds): the middle half of the rounds' differences.")
    if any(r.op in OBJECT_OPS for r in rows):
        out.append("# Object ops: size is the pickled object's bytes (protocol 5), count its payload's bytes.")
    if any(r.op in REFERENCE_OPS for r in rows):
        out.append(
            "# vs OP: median time / OP's median on the same backend and size (needs OP in --ops too), and\n"
            "# median minus OP's median; send_tensor vs send_recv is the cost of a shape the receiver does not\n"
            "# know; an asynchronous form (--async) vs its op is the cost of async_op=True plus wait()."
        )
    return "\n".join(out)


def _what(op: str, first: Row) -> str:
    """What a table's rows measure, for its heading."""
    if op in OBJECT_OPS:
        what = f"world size {first.world_size}, request_object() with a payload of `count` bytes"
    else:
        what = f"world size {first.world_size}, {first.dtype}"
    if op in REDUCING_OPS:
        what += ", sum"
    if op in ROOTED_OPS:
        what += f", root {ROOT}"
    if op == "send_tensor":
        what += ", shape unknown to the receiver"
    if op in BLOCKING_OF:
        what += ", async_op=True then wait()" if op != "isend_irecv" else ", isend().wait() then irecv().wait()"
    if op in ECHO_OPS:
        what += ", ranks 0<->1, one-way time = round trip / 2"
    if first.rounds > 1:
        what += f", interleaved in {first.rounds} rounds"
    return what


def format_json(rows: Sequence[Any]) -> str:
    """Rows (dataclass instances: :class:`Row`, :class:`pg_core.bench.overhead.OverheadRow`) as a
    JSON list of objects (every field)."""
    return json.dumps([dataclasses.asdict(r) for r in rows], indent=2)


def format_csv(rows: Sequence[Any], row_type: type = Row) -> str:
    """Rows of ``row_type`` (a dataclass) as CSV with a header line (every field)."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=[f.name for f in dataclasses.fields(row_type)], lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow(dataclasses.asdict(r))
    return buf.getvalue()
