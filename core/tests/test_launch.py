"""``pg_core.launch``'s pieces that need no process: which part of a failed rank's stderr
pgrun prints last. (pgrun itself, across processes: tests/integration/test_pgrun.py.)"""

from __future__ import annotations

from pg_core.launch import _traceback


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
