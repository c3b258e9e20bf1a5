"""Torch's own distributed test suite over pg-core, through torch's plugin route.

Torch ships the tests it runs against its backends as
``torch.testing._internal.distributed.distributed_test`` (``DistributedTest._DistTestBase``);
torch's ``test/distributed/test_distributed_spawn.py``, which runs them, is not shipped. This
program is that harness: each test is a ``MultiProcessTestCase`` whose rank processes (forked
here from a process that has imported torch and the suite, so a test starts in a fraction of a
second) call ``init_process_group`` with the backend under test, run the test's body, and
destroy the group. The backends, by label:

* ``gloo``: torch's own Gloo, the baseline;
* ``pg-gloo``: ``backend="pg_core_gloo"``, pg-core's plugin route over pg-gloo;
* ``pg-tcp``: ``backend="pg_core_tcp"``, the same over pg-tcp (torch calls go through pg-core's
  Python adapter).

The suite decides what to run and what to expect from its ``BACKEND`` variable. Here it is
``gloo`` for every label: pg-core is held to what torch's Gloo is held to, the same tests are
selected (the suite's own skips are Gloo's), and a test that asks torch by name for Gloo (a
subgroup made with ``backend="gloo"``, ``get_backend() == "gloo"``) meets pg-core under another
name: such a test is a known failure whose reason says so (``known_failures.txt``).

Usage::

    python tests/torch_suite/run_torch_tests.py                    # the CI subset, every label
    python tests/torch_suite/run_torch_tests.py --all --jobs 2     # every test of the suite
    python tests/torch_suite/run_torch_tests.py --check            # exit 1 unless the targets hold
    python tests/torch_suite/run_torch_tests.py -k allreduce --labels pg-tcp --show-errors

Targets (``--check``): every test of the subset that passes over torch's Gloo passes over
pg-gloo, and over pg-tcp, except those listed in ``known_failures.txt`` with their reason; a
listed test that passes is reported too, so the list stays true.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

HERE: Final = Path(__file__).resolve().parent
#: The tests CI runs (one name a line, ``#`` comments), chosen from the suite's collective,
#: point-to-point, subgroup and DDP tests that torch's Gloo runs on CPU at 2 ranks.
SUBSET: Final = HERE / "subset.txt"
#: ``LABEL TEST: reason`` lines: the failures expected over pg-core, each with why.
KNOWN: Final = HERE / "known_failures.txt"

#: label -> the backend name given to torch's ``init_process_group``
LABELS: Final = {"gloo": "gloo", "pg-gloo": "pg_core_gloo", "pg-tcp": "pg_core_tcp"}
WORLD_SIZE: Final = 2
#: Per test, torch's harness waits this long for its ranks (seconds), and their groups' timeout.
TEST_TIMEOUT_S: Final = 60


@dataclass(frozen=True)
class Outcome:
    """One test over one backend: ``passed``, ``failed``, ``skipped`` or ``not run``."""

    label: str
    test: str
    status: str
    seconds: float
    message: str = ""


# -- the worker: runs tests over one backend, in this process's children ------------------------


def _suite_environment(temp_dir: str) -> None:
    os.environ["BACKEND"] = "gloo"  # the suite selects and expects as for torch's Gloo (module docstring)
    os.environ["WORLD_SIZE"] = str(WORLD_SIZE)
    os.environ["TEMP_DIR"] = temp_dir
    os.environ["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"] = str(TEST_TIMEOUT_S)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")


def _test_case(torch_backend: str) -> type:
    """The suite's test base joined to a harness whose ranks are forked and whose default group is
    ``torch_backend``'s."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed import distributed_test as suite

    harness: Any = suite.TestDistBackend  # torch's testing modules are untyped
    tests: Any = suite.DistributedTest._DistTestBase

    class TorchSuite(harness, tests):  # type: ignore[misc]
        def setUp(self) -> None:
            super().setUp()
            self._start_processes(torch.multiprocessing.get_context("fork").Process)

        @classmethod
        def _run(cls, rank: int, test_name: str, file_name: str, pipe: Any, **kwargs: Any) -> None:
            test = cls(test_name)
            test.rank = rank
            test.file_name = file_name
            seconds = min(suite.CUSTOM_PG_TIMEOUT.get(test_name, TEST_TIMEOUT_S), TEST_TIMEOUT_S)
            dist.init_process_group(
                torch_backend,
                init_method=test.init_method,
                world_size=WORLD_SIZE,
                rank=rank,
                timeout=timedelta(seconds=seconds),
            )
            test._barrier()  # every rank formed before a test that skips at once exits
            test.run_test(test_name, pipe)
            test._barrier()
            dist.destroy_process_group()
            sys.exit(0)

    TorchSuite.__qualname__ = TorchSuite.__name__ = f"TorchSuite_{torch_backend}"
    return TorchSuite


def _worker(items: Sequence[str], out: Path) -> int:
    """Run each ``LABEL:TEST`` of ``items``, one after another, appending a JSON line per test to ``out``."""
    import unittest

    with tempfile.TemporaryDirectory(prefix="pg-core-torch-suite-") as temp_dir:
        _suite_environment(temp_dir)
        if any(not item.startswith("gloo:") for item in items):
            import pg_core.group  # noqa: F401 - imported once here, not in every forked rank
            from pg_core.torch_plugin import register

            register()
        cases: dict[str, type] = {}
        for item in items:
            label, test = item.split(":", 1)
            case = cases.get(label) or cases.setdefault(label, _test_case(LABELS[label]))
            result = unittest.TestResult()
            start = time.monotonic()
            case(test).run(result)
            seconds = time.monotonic() - start
            if result.errors or result.failures:
                status, message = "failed", "\n".join(text for _, text in result.errors + result.failures)
            elif result.skipped:
                status, message = "skipped", "; ".join(reason for _, reason in result.skipped)
            else:
                status, message = "passed", ""
            with out.open("a") as f:
                f.write(json.dumps([label, test, status, round(seconds, 2), message]) + "\n")
    return 0


# -- the controller: workers in parallel, then the table and the targets ------------------------


def every_test() -> list[str]:
    """Every test of the suite's ``_DistTestBase`` (imported in a child: its import reads the environment)."""
    code = (
        "from torch.testing._internal.distributed.distributed_test import DistributedTest as D;"
        "print('\\n'.join(n for n in dir(D._DistTestBase) if n.startswith('test_')))"
    )
    with tempfile.TemporaryDirectory() as temp_dir:
        env = {**os.environ, "BACKEND": "gloo", "WORLD_SIZE": str(WORLD_SIZE), "TEMP_DIR": temp_dir}
        found = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return found.stdout.split()


def read_subset(path: Path = SUBSET) -> list[str]:
    return [line.split("#", 1)[0].strip() for line in path.read_text().splitlines() if line.split("#", 1)[0].strip()]


@dataclass(frozen=True)
class Known:
    """A listed failure: ``kind`` ``"torch"`` (a torch limitation) or ``"pg-core"`` (a gap of ours)."""

    kind: str
    reason: str


def read_known(path: Path = KNOWN) -> dict[tuple[str, str], Known]:
    """``(label, test) -> Known`` from lines ``LABEL TEST: KIND reason`` (``#`` lines are comments)."""
    known: dict[tuple[str, str], Known] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = re.fullmatch(r"\s*(\S+)\s+(test_\w+)\s*:\s*(torch|pg-core)\s+(.+)", line)
        if match is None or match[1] not in LABELS or match[1] == "gloo":
            raise ValueError(
                f"{path}:{number}: expected 'LABEL TEST: KIND reason', LABEL pg-gloo or pg-tcp and KIND torch or "
                f"pg-core, got {line!r}"
            )
        known[(match[1], match[2])] = Known(match[3], match[4].strip())
    return known


def run(
    labels: Sequence[str], tests: Sequence[str], jobs: int, budget_s: float, keep: Path | None = None
) -> list[Outcome]:
    """Every test over every label, shared among ``jobs`` worker processes (each imports the suite
    once: 4 s); a worker still running when the budget is spent is stopped, and the tests it had
    not finished are ``not run``. ``keep``: a folder for the workers' output (their ranks' logs
    and stack dumps), else a temporary one."""
    items = [(label, test) for test in tests for label in labels]
    plan = [items[i::jobs] for i in range(jobs) if items[i::jobs]]
    with tempfile.TemporaryDirectory(prefix="pg-core-torch-suite-") as folder:
        logs = Path(folder) if keep is None else keep
        logs.mkdir(parents=True, exist_ok=True)
        procs = []
        for index, mine in enumerate(plan):
            command = [sys.executable, __file__, "--worker", "--out", str(logs / f"{index}.jsonl")]
            command += [f"{label}:{test}" for label, test in mine]
            with (logs / f"{index}.log").open("wb") as log:
                procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + budget_s
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        outcomes = []
        for index, mine in enumerate(plan):
            done = {}
            path = logs / f"{index}.jsonl"
            if path.exists():
                for line in path.read_text().splitlines():
                    label, test, status, seconds, message = json.loads(line)
                    done[(label, test)] = Outcome(label, test, status, seconds, message)
            for key in mine:
                outcomes.append(done.get(key) or Outcome(*key, "not run", 0.0, _tail(logs / f"{index}.log")))
    return outcomes


def _tail(path: Path, limit: int = 2000) -> str:
    with contextlib.suppress(OSError):
        return "worker ended or was stopped before this test finished; its output ends:\n" + path.read_text()[-limit:]
    return "worker ended before this test finished"


def summary(message: str) -> str:
    """The line of a failure's text that says what went wrong (its last exception line)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Timeout|Failed|failed)\b|^RuntimeError|^AssertionError", line):
            return line[:300]
    return (lines[-1] if lines else "")[:300]


def table(outcomes: Iterable[Outcome], labels: Sequence[str], wall_s: float) -> str:
    by = {(o.label, o.test): o for o in outcomes}
    tests = sorted({o.test for o in by.values()})
    width = max([len(t) for t in tests] + [4])
    rows = [f"{'test':<{width}}  " + "  ".join(f"{label:>8}" for label in labels)]
    mark = {"passed": "pass", "failed": "FAIL", "skipped": "skip", "not run": "-"}
    for test in tests:
        rows.append(f"{test:<{width}}  " + "  ".join(f"{mark[by[(label, test)].status]:>8}" for label in labels))
    rows.append("")
    for label in labels:
        mine = [o for o in by.values() if o.label == label]
        count = {s: sum(o.status == s for o in mine) for s in mark}
        rows.append(
            f"{label:>8}: {count['passed']} passed, {count['failed']} failed, {count['skipped']} skipped, "
            f"{count['not run']} not run; {sum(o.seconds for o in mine):.0f} s of test time"
        )
    rows.append(f"wall time {wall_s:.0f} s")
    return "\n".join(rows)


def check(outcomes: Iterable[Outcome], known: dict[tuple[str, str], Known]) -> list[str]:
    """What breaks the targets, one line each (empty: they hold). Every test that passes over
    torch's Gloo passes over pg-gloo, unless listed as a torch limitation, and over pg-tcp, unless
    listed at all; every test ran; no listed test passes (the list stays true)."""
    by = {(o.label, o.test): o for o in outcomes}
    problems = []
    for (label, test), outcome in sorted(by.items()):
        if label == "gloo":
            continue
        baseline = by.get(("gloo", test))
        listed = known.get((label, test))
        excused = listed is not None and (label == "pg-tcp" or listed.kind == "torch")
        if outcome.status == "not run":
            problems.append(f"{label} {test}: not run ({summary(outcome.message)})")
        elif listed is not None and outcome.status == "passed":
            problems.append(f"{label} {test}: passes, but {KNOWN.name} lists it ({listed.reason}): remove the line")
        elif baseline is not None and baseline.status == "passed" and outcome.status != "passed" and not excused:
            problems.append(f"{label} {test}: {outcome.status} where torch's Gloo passes: {summary(outcome.message)}")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("tests", nargs="*", help="test names (default: the CI subset, subset.txt)")
    parser.add_argument("--all", action="store_true", help="every test of the suite")
    parser.add_argument("-k", dest="pattern", help="only tests whose name matches this regular expression")
    parser.add_argument("--labels", default=",".join(LABELS), help=f"comma-separated, of {list(LABELS)}")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes at a time (each test uses 2 ranks)")
    parser.add_argument("--budget", type=float, default=900.0, help="seconds before unfinished workers are stopped")
    parser.add_argument("--check", action="store_true", help="exit 1 unless the targets hold")
    parser.add_argument("--json", type=Path, help="also write every outcome to this file")
    parser.add_argument("--logs", type=Path, help="keep the workers' output (ranks' logs, stack dumps) in this folder")
    parser.add_argument("--show-errors", action="store_true", help="print each failure's text, not only its last line")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args.tests, args.out)

    labels = [label.strip() for label in args.labels.split(",") if label.strip()]
    unknown = [label for label in labels if label not in LABELS]
    if unknown:
        parser.error(f"--labels: unknown {unknown}; the labels are {list(LABELS)}")
    tests = list(dict.fromkeys(args.tests or (every_test() if args.all else read_subset())))
    if args.pattern:
        tests = [t for t in tests if re.search(args.pattern, t)]
    if not tests:
        parser.error("no test selected")
    start = time.monotonic()
    outcomes = run(labels, tests, max(1, args.jobs), args.budget, args.logs)
    wall = time.monotonic() - start
    print(table(outcomes, labels, wall))
    known = read_known()
    failures = [o for o in outcomes if o.status in ("failed", "not run")]
    if failures:
        print("\nFailures:")
    for o in failures:
        listed = known.get((o.label, o.test))
        print(f"  {o.label} {o.test}: " + (f"[{listed.kind}] {listed.reason}" if listed else summary(o.message)))
        if args.show_errors:
            print("    " + o.message.replace("\n", "\n    "))
    if args.json:
        args.json.write_text(json.dumps([o.__dict__ for o in outcomes], indent=1))
    if args.check:
        problems = check(outcomes, known)
        if problems:
            print("\nTargets not met:\n  " + "\n  ".join(problems))
            return 1
        print("\nTargets met: pg-gloo passes what torch's Gloo passes; pg-tcp too, but for the listed failures.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
