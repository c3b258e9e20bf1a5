"""``pg_core.launch``'s pieces that need no process: which part of a failed rank's stderr
pgrun prints last, and what of mpiexec's output it holds back. (pgrun itself, across
processes: tests/integration/test_pgrun.py.)"""

from __future__ import annotations

from pg_core.launch import _MpiexecBanner, _passed, _traceback


def lines(text: str) -> list[bytes]:
    return [line.encode() + b"\n" for line in text.splitlines()]


def test_the_last_traceback_is_printed_with_the_exceptions_chained_to_it() -> None:
    stderr = lines(
        "a warning\n"
        "Traceback (most recent call last):\n"
        '  File "old.py", line 1\n'
        "KeyError: 'handled long ago'\n"
        "more output\n"
        "Traceback (most recent call last):\n"
        '  File "job.py", line 3\n'
        "KeyError: 'x'\n"
        "\n"
        "The above exception was the direct cause of the following exception:\n"
        "\n"
        "Traceback (most recent call last):\n"
        '  File "job.py", line 5\n'
        "ValueError: no x\n"
        "\n"
    )
    assert _traceback(stderr) == stderr[5:14]


def test_without_a_traceback_the_last_20_lines_are_printed() -> None:
    stderr = lines("\n".join(f"line {i}" for i in range(30)) + "\n\n")
    assert _traceback(stderr) == stderr[10:30]
    assert _traceback([]) == []


#: what MPICH's mpiexec 5 printed (on stdout) after `pgrun -n 2 --mpi` of a script whose rank 1 raised
BANNER = (
    "\n"
    "===================================================================================\n"
    "=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n"
    "=   PID 5238 RUNNING AT vm\n"
    "=   EXIT CODE: 15\n"
    "=   CLEANING UP REMAINING PROCESSES\n"
    "=   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES\n"
    "===================================================================================\n"
    "YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Terminated (signal 15)\n"
    "This typically refers to a problem with your application.\n"
    "Please see the FAQ page for debugging suggestions\n"
)


def test_mpiexecs_bad_termination_banner_is_held_back_and_every_other_line_passes_in_order() -> None:
    ranks = "[rank 0] step 1\n\n[rank 0] ====================\n==========================\n\n\nplain\n"
    banner = _MpiexecBanner()
    out = list(_passed(lines(ranks + BANNER + "[rank 0] after\n\n"), banner))
    assert b"".join(out).decode() == ranks + "[rank 0] after\n\n"
    assert b"".join(banner.held).decode() == BANNER

    banner = _MpiexecBanner()  # a stream that ends on what could have started a banner
    assert b"".join(_passed(lines("a\n\n" + "=" * 30), banner)) == b"a\n\n" + b"=" * 30 + b"\n"
    assert banner.held == []
