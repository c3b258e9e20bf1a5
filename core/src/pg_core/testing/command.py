"""``pg-core conformance NAME``: certify a backend with the conformance suite.

A thin front end to ``pytest --pg-backend NAME --pyargs pg_core.testing`` that
isolates the run from the current directory's pytest configuration and prints
how long it took. The exit status is pytest's: 0 when every test passed (or was
not applicable, or was an expected failure listed with ``--xfail``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import textwrap
import time
from typing import Any

__all__ = ["add_parser", "main"]

_DESCRIPTION = (
    "Run pg-core's conformance suite against one backend: a registered name (see `pg-core backends`) "
    "or module:attr / path/to/file.py:attr naming a BackendSpec that is not installed yet. "
    "Hypothesis draws examples from the backend's declared capabilities (world size, op, dtype, shape, "
    "layout, reduce op, roots, tags, async waits, sequences, concurrent groups, objects, tensors of unknown "
    "shape, tensor dicts, subgroups); persistent rank processes "
    "run them; every rank's output is checked against a float64 reference computed here. Undeclared "
    "combinations must raise NotSupportedError; abort() must wake operations blocked in other threads, and "
    "nothing may outlive shutdown(). A failure prints the shrunk example and a one-line "
    "command that replays exactly it; the summary says what each test exercised. "
    "Same as `pytest --pg-backend NAME --pyargs pg_core.testing`."
)


def add_parser(subparsers: Any) -> None:
    """Add ``conformance`` to ``pg-core``'s subcommands."""
    parser = subparsers.add_parser(
        "conformance",
        help="certify a backend with the property-based conformance suite",
        description=textwrap.fill(_DESCRIPTION, 88),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "backend", metavar="NAME", help="backend name, or module:attr / path/file.py:attr of a BackendSpec"
    )
    parser.add_argument("--world-sizes", default="1,2,3,4", metavar="LIST", help="comma-separated (default 1,2,3,4)")
    parser.add_argument("--max-examples", type=int, default=None, metavar="N", help="examples per test")
    parser.add_argument("--profile", choices=("ci", "thorough"), default="ci", help="ci (default): derandomized")
    parser.add_argument("--xfail", metavar="FILE", default=None, help="known gaps, one test name per line (strict)")
    parser.add_argument("--device", action="append", default=None, metavar="TYPE", help="only this device type")
    parser.add_argument("-k", dest="select", default=None, metavar="EXPR", help="only tests matching EXPR (pytest -k)")
    parser.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failing test")
    parser.add_argument(
        "--replay", nargs=2, metavar=("TEST", "EXAMPLE"), default=None, help="run one example, as a failure printed it"
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more pytest output")
    parser.set_defaults(handler=main)


def pytest_args(args: argparse.Namespace, config_dir: str) -> list[str]:
    """The pytest command line that ``args`` stand for."""
    ini = os.path.join(config_dir, "pytest.ini")
    with open(ini, "w", encoding="utf-8") as f:
        f.write("[pytest]\naddopts =\n")  # the current project's pytest settings do not apply
    import pg_core

    argv = [
        "-c",
        ini,
        "--rootdir",
        os.path.dirname(os.path.dirname(os.path.abspath(pg_core.__file__))),
        "-W",
        "ignore::pytest.PytestAssertRewriteWarning",
        "-p",
        "no:cacheprovider",
        "-p",
        "pytest_pg_core",
        "-rfEsxX",
        "--pg-backend",
        args.backend,
        "--pg-world-sizes",
        args.world_sizes,
        "--pg-profile",
        args.profile,
    ]
    if args.max_examples is not None:
        argv += ["--pg-max-examples", str(args.max_examples)]
    if args.xfail:
        argv += ["--pg-xfail", os.path.abspath(args.xfail)]
    for device in args.device or []:
        argv += ["--pg-device", device]
    if args.select:
        argv += ["-k", args.select]
    if args.exitfirst:
        argv.append("-x")
    if args.replay:
        argv += ["--pg-replay", *args.replay]
    argv += ["-v"] * (args.verbose + 1)
    argv += ["--pyargs", "pg_core.testing"]
    return argv


def main(args: argparse.Namespace) -> int:
    try:
        import hypothesis  # noqa: F401
        import pytest
    except ImportError:
        print("pg-core conformance needs pytest and hypothesis: pip install 'pg-core[testing]'", file=sys.stderr)
        return 2
    from ..backend_refs import resolve_backend_ref

    try:  # the suite's ranks take a BackendSpec (or a name), not a bare Backend class
        resolve_backend_ref(args.backend, factories=False, here=False)  # where its ranks run
    except Exception as exc:  # unknown, broken or unavailable: say so before pytest starts
        print(f"pg-core conformance: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pg-core-conformance-") as config_dir:
        code = int(pytest.main(pytest_args(args, config_dir)))
    print(f"pg-core conformance {args.backend}: exit {code} after {time.monotonic() - start:.1f} s", flush=True)
    return code
