"""The command line: ``pg-core bench``'s options (:func:`add_parser`, :func:`add_arguments`),
:func:`main`, which runs the sweep or ``--overhead`` and prints the report, and :func:`run`,
the entry point of ``python -m pg_core.bench`` and of the rank processes."""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..progress import ProgressBar
from .catalog import ASYNC_OPS, BASELINE, CONTROL, DTYPES, MPI4PY, OPS, BenchError
from .config import config_from_args
from .parent import run_ranks
from .plot import require_matplotlib, write_plot
from .rank import WORKER_FLAG, worker_main
from .report import add_ratios, describe_backends, format_csv, format_json, format_table
from .sizing import DEFAULT_SIZES, DEFAULT_SWEEP, csv_list

__all__ = ["add_arguments", "add_parser", "main", "run"]


def add_parser(subparsers: Any) -> None:
    """Add the ``bench`` subcommand to ``pg-core``'s subparsers (``argparse``'s
    ``add_subparsers()`` result); it sets ``handler=main``."""
    parser = subparsers.add_parser(
        "bench",
        help="nccl-tests-style sweep of collectives, side by side with torch's Gloo and mpi4py",
        description=_description(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(handler=main)


def _description() -> str:
    paragraphs = (
        "Time collectives over a range of sizes (--sizes, or nccl-tests' -b/-e/-f) on every pg-core backend named, "
        "in one run and one table, side by side with the raw libraries (torch's ProcessGroupGloo; mpi4py where "
        "mpiexec starts the ranks), check every result, and print min/median/max time, algbw and busbw per op and "
        "size, and each backend's median time relative to its baseline's. --plot draws latency and bus bandwidth "
        "against size.",
        "send_object and broadcast_object time pickled Python objects against torch's send_object_list and "
        "broadcast_object_list; send_tensor times a tensor whose shape the receiver does not know against torch's "
        "three send/recv steps, and against send_recv (a known shape) on the same backend.",
        "Times are per iteration, the slowest rank's. Compare the ratios measured side by side in one run, "
        "not absolute times across runs or machines. Exit status: 0 all correct, 1 a WRONG result or a failed "
        "rank, 2 bad arguments. The method in full: `python -m pydoc pg_core.bench`.",
        "--overhead measures something else: the core's own cost per call (ProcessGroup against the backend "
        "method it dispatches to), at world size 1 on a backend that does nothing; see its options below and "
        "`python -m pydoc pg_core.bench.overhead`.",
    )
    return "\n\n".join(textwrap.fill(p, 88) for p in paragraphs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``pg-core bench``'s options (the sweep's and ``--overhead``'s) to ``parser``."""
    parser.add_argument(
        "--world-size", "-n", type=int, default=2, metavar="N", help="rank processes to start (default 2)"
    )
    parser.add_argument(
        "--backends",
        default=None,
        metavar="LIST",
        help="comma-separated pg-core backends: names from `pg-core backends`, or module:attr / path/file.py:attr "
        "of a BackendSpec (or of a Backend subclass) not installed yet; '' for the baseline alone (default: every "
        "backend available for cpu)",
    )
    parser.add_argument("--no-baseline", action="store_true", help="do not measure a baseline")
    parser.add_argument(
        "--baseline",
        default="auto",
        metavar="LIST",
        help=f"comma-separated baselines, measured in the same run: {BASELINE} (torch's ProcessGroupGloo) and "
        f"{MPI4PY} (raw mpi4py on numpy arrays; the ranks are then started by mpiexec). Each backend is compared "
        f"with the baseline of its own library (gloo with {BASELINE}, mpi with {MPI4PY}), others with the first. "
        f"Default 'auto': {BASELINE}, plus {MPI4PY} when mpiexec starts the ranks anyway (a backend such as mpi "
        "needs it) and mpi4py is installed",
    )
    parser.add_argument(
        "--ops",
        default="all",
        metavar="LIST",
        help=f"comma-separated, or 'all' (default): {', '.join(OPS)}; also the asynchronous forms "
        f"{', '.join(ASYNC_OPS.values())}, which 'all' leaves out (--async adds them)",
    )
    parser.add_argument(
        "--async",
        dest="async_forms",
        action="store_true",
        help="also measure each selected op that has one in its asynchronous form, beside it at each size (with "
        "--rounds, in the same rounds) "
        f"({', '.join(f'{a} after {b}' for b, a in ASYNC_OPS.items())}: async_op=True, or isend/irecv, then "
        "wait()); the 'vs' column gives the cost over the blocking call, as a ratio and in microseconds",
    )
    parser.add_argument(
        "--sizes",
        default=None,
        metavar="LIST",
        help=f"comma-separated bytes per rank, K/M/G suffixes (default {DEFAULT_SIZES}); or sweep with -b/-e/-f",
    )
    lo, hi, f = DEFAULT_SWEEP
    parser.add_argument(
        "-b",
        "--minbytes",
        "--min-bytes",
        dest="min_bytes",
        default=None,
        metavar="SIZE",
        help=f"sweep from this size, as nccl-tests' -b (default {lo} when -e or -f is given)",
    )
    parser.add_argument(
        "-e",
        "--maxbytes",
        "--max-bytes",
        dest="max_bytes",
        default=None,
        metavar="SIZE",
        help=f"sweep up to this size, K/M/G suffixes, as nccl-tests' -e (default {hi})",
    )
    parser.add_argument(
        "-f",
        "--stepfactor",
        "--factor",
        dest="factor",
        default=None,
        metavar="F",
        help=f"multiply the size by F (> 1) from one step to the next, as nccl-tests' -f (default {f})",
    )
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="element type (default float32)")
    parser.add_argument(
        "--iters", type=int, default=200, metavar="N", help="most timed iterations per row (default 200)"
    )
    parser.add_argument(
        "--warmup", type=int, default=5, metavar="W", help="untimed iterations per row, at least 1 (default 5)"
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=2.0,
        metavar="S",
        help="seconds per (backend, op, size); at least 5 timed iterations run regardless (default 2)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="R",
        help="time each (op, size) in R rounds: every backend and baseline runs its share of the timed iterations "
        "in turn, R times over, so that a machine that slows down or speeds up during the run weighs on every "
        "row alike (default 1: one row after the other)",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help=f"time each baseline a second time, as a row of its own (BASELINE{CONTROL}) compared with the first: "
        "the ratio of two rows doing the very same work, which is how far from 1.00x this run's noise alone puts "
        "a ratio (best with --rounds)",
    )
    parser.add_argument(
        "--timeout", type=float, default=60.0, metavar="S", help="seconds any one operation may take (default 60)"
    )
    parser.add_argument(
        "--pin-ranks",
        action="store_true",
        help="pin rank r to the r-th CPU this process may run on (modulo their number), as MPI's --bind-to core "
        "does: steadier times, where the scheduler's placement of the ranks would otherwise decide them (Linux)",
    )
    parser.add_argument(
        "--to-torch",
        action="store_true",
        help="also time each pg-core backend through its group's to_torch(), with torch's ProcessGroup API "
        "(rows labelled BACKEND.to_torch): pg-gloo's is Gloo itself, registered natively",
    )
    fmt = parser.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print the rows as JSON instead of tables")
    fmt.add_argument("--csv", action="store_true", help="print the rows as CSV instead of tables")
    parser.add_argument(
        "--plot",
        metavar="PNG",
        default=None,
        help="also write a plot of median time and bus bandwidth against size, log-log, a line per backend and "
        "op, baselines dashed in their backend's colour (needs matplotlib)",
    )
    parser.add_argument(
        "--quiet",
        "-q",
        action="store_true",
        help="no progress on stderr (otherwise a line per row, and a progress bar below them when stderr is a "
        "terminal)",
    )
    over = parser.add_argument_group(
        "core overhead (--overhead)",
        "Instead of the sweep: what the core adds per call, at world size 1 in this process, on a backend "
        "whose ops return at once. Per op (all_reduce, broadcast, reduce, all_gather_into_tensor, "
        "reduce_scatter_tensor, barrier; narrow with --ops): the backend method called directly, the same op "
        "through ProcessGroup blocking, and with async_op=True plus wait(); overhead = blocking - direct, the "
        "figure the target of at most 3 us per blocking collective is judged by. --dtype, --ops, --json and "
        "--csv apply; the sweep's other options do not.",
    )
    over.add_argument(
        "--overhead", action="store_true", help="measure the core's overhead per call instead of sweeping"
    )
    over.add_argument(
        "--overhead-iters",
        type=int,
        default=20_000,
        metavar="N",
        help="calls per timed batch (default 20000)",
    )
    over.add_argument(
        "--repeats",
        type=int,
        default=5,
        metavar="R",
        help="timed batches per op and mode; medians reported (default 5)",
    )


def main(args: argparse.Namespace) -> int:
    """Run the benchmark as ``args`` (from :func:`add_parser`'s parser) say; return the exit status."""
    if args.overhead:
        return _overhead_main(args)
    try:
        cfg = config_from_args(args)
        if args.plot:
            require_matplotlib()
            folder = Path(args.plot).resolve().parent
            if not folder.is_dir():
                raise BenchError(f"--plot {args.plot}: the folder {folder} does not exist; create it or name another")
    except BenchError as exc:
        print(f"pg-core bench: {exc}", file=sys.stderr)
        return 2
    progress = None if args.quiet else sys.stderr
    try:
        outcome = run_ranks(cfg, progress, bar=ProgressBar.wanted(sys.stderr, args.quiet))
    except KeyboardInterrupt:  # the ranks are stopped already
        print("pg-core bench: interrupted", file=sys.stderr)
        return 130
    rows = outcome.rows
    add_ratios(rows)
    if args.json:
        print(format_json(rows))
    elif args.csv:
        print(format_csv(rows), end="")
    elif rows:
        from ..registry import default_registry

        print(format_table(rows, describe_backends([r.backend for r in rows], default_registry().entries())))
    status = 0
    if args.plot and rows:
        try:
            write_plot(rows, args.plot)
        except BenchError as exc:
            print(f"pg-core bench: {exc}", file=sys.stderr)
            status = 2
        except OSError as exc:
            print(f"pg-core bench: --plot {args.plot}: cannot write it: {exc}", file=sys.stderr)
            status = 2
    wrong = [r for r in rows if r.status == "WRONG"]
    if wrong:
        print(f"pg-core bench: {len(wrong)} row(s) gave WRONG results:", file=sys.stderr)
        for r in wrong:
            print(f"  {r.backend} {r.op} {r.size} B: {r.detail}", file=sys.stderr)
        status = 1
    if outcome.failure is not None:
        print(f"pg-core bench: the run failed: {outcome.failure}", file=sys.stderr)
        status = 1
    return status


def _overhead_main(args: argparse.Namespace) -> int:
    """``--overhead``: :mod:`pg_core.bench.overhead`, in this process."""
    from . import overhead

    ops = list(overhead.OPS) if args.ops.strip() == "all" else list(dict.fromkeys(csv_list(args.ops)))
    unknown = [op for op in ops if op not in overhead.OPS]
    problem = None
    if unknown or not ops:
        problem = f"--ops: {', '.join(unknown) or 'nothing named'} not measured by --overhead; it measures {', '.join(overhead.OPS)}"
    elif args.overhead_iters < 1 or args.repeats < 1:
        problem = f"--overhead-iters and --repeats must be >= 1, got {args.overhead_iters} and {args.repeats}"
    elif args.backends is not None or args.plot:
        problem = "--overhead measures the core on a backend that does nothing; --backends and --plot do not apply"
    if problem is not None:
        print(f"pg-core bench: {problem}", file=sys.stderr)
        return 2
    progress = None if args.quiet else lambda line: print(line, file=sys.stderr, flush=True)
    rows = overhead.measure(
        ops, iters=args.overhead_iters, repeats=args.repeats, dtype=DTYPES[args.dtype], progress=progress
    )
    if args.json:
        print(format_json(rows))
    elif args.csv:
        print(format_csv(rows, overhead.OverheadRow), end="")
    else:
        print(overhead.format_table(rows))
    return 0


def run(argv: Sequence[str] | None = None) -> int:
    """``python -m pg_core.bench [OPTIONS]`` (``argv``: default ``sys.argv[1:]``); with
    :data:`~pg_core.bench.rank.WORKER_FLAG` first, a rank process. Returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [WORKER_FLAG]:
        return worker_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m pg_core.bench",
        description=_description(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return main(parser.parse_args(argv))
