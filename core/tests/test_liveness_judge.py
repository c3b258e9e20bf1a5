"""The ``liveness`` conformance test's verdict (``pg_core.testing.liveness.judge``) on what the
ranks report: an operation blocked when ``abort()`` came must raise ``GroupClosedError`` within
the bound, and a send the backend took in whole was blocked on nothing. These are the cases the
verdict decides without a backend; the real runs are the certifications."""

from __future__ import annotations

from typing import Any

import pytest
from pg_core.testing.liveness import ABORT_BOUND_S, describe, judge

_CLOSED = ["GroupClosedError", "PGCoreError", "RuntimeError", "Exception", "BaseException", "object"]


def _op(*, blocked: bool, seconds: float, raised: bool) -> dict[str, Any]:
    return {
        "blocked": blocked,
        "entered": True,
        "ended": True,
        "seconds": seconds,
        "type": "GroupClosedError" if raised else None,
        "mro": _CLOSED if raised else [],
        "message": "aborted" if raised else None,
    }


def _results(send: dict[str, Any], *, sends_wait: bool) -> list[dict[str, Any]]:
    clean = {"release": {"seconds": 0.1, "leak": None}}
    zero = {
        "timeout": 10.0,
        "abort_s": 0.01,
        "sends_wait": sends_wait,
        "peer_stopped": True,
        "release": {"seconds": 0.1, "leak": None},
        "ops": {"recv": _op(blocked=True, seconds=0.02, raised=True), "send": send},
    }
    return [
        {"abort": zero, "shutdown": clean, "shm_left": {"abort": [], "shutdown": []}},
        {"abort": clean, "shutdown": clean, "shm_left": {"abort": [], "shutdown": []}},
    ]


def test_a_send_still_copying_in_when_abort_came_on_a_backend_whose_sends_never_wait_was_not_blocked() -> None:
    results = _results(_op(blocked=True, seconds=0.01, raised=False), sends_wait=False)
    assert judge(results) is None
    assert "send 32 MiB to a stopped peer: completed 0.01 s after abort (the backend took it all in)" in describe(
        results
    )


@pytest.mark.parametrize(
    ("send", "sends_wait"),
    [
        (_op(blocked=True, seconds=0.01, raised=False), True),  # its sends may wait: it was blocked on the peer
        (_op(blocked=True, seconds=ABORT_BOUND_S + 1, raised=False), False),  # returned, but past the bound
    ],
    ids=["sends-may-wait", "past-the-bound"],
)
def test_a_blocked_send_that_returns_normally_after_abort_fails_the_test(
    send: dict[str, Any], sends_wait: bool
) -> None:
    problem = judge(_results(send, sends_wait=sends_wait))
    assert problem is not None and problem[0] == "liveness", problem
    assert "was blocked on another thread when group.abort() was called" in problem[1], problem


def test_a_send_completed_before_abort_and_one_woken_by_it_pass() -> None:
    for sends_wait in (True, False):
        assert judge(_results(_op(blocked=False, seconds=-0.5, raised=False), sends_wait=sends_wait)) is None
        assert judge(_results(_op(blocked=True, seconds=0.05, raised=True), sends_wait=sends_wait)) is None


def _with_pending(work: dict[str, Any]) -> list[dict[str, Any]]:
    results = _results(_op(blocked=True, seconds=0.05, raised=True), sends_wait=True)
    results[0]["pending"] = {"timeout": 10.0, "release": {"seconds": 0.1, "leak": None}, "works": {"irecv": work}}
    results[0]["shm_left"]["pending"] = []
    return results


def test_a_pending_work_must_raise_group_closed_from_its_wait_after_abort() -> None:
    woken = _with_pending(_op(blocked=True, seconds=0.02, raised=True))
    assert judge(woken) is None
    assert "pending irecv woke in 0.02 s" in describe(woken)
    for work, says in [
        (_op(blocked=True, seconds=0.02, raised=False), "the wait() of the irecv work (posted, not waited for)"),
        (_op(blocked=True, seconds=ABORT_BOUND_S + 1, raised=True), "its GroupClosedError came"),
        (_op(blocked=False, seconds=-0.1, raised=False), "completed before abort() was called"),
    ]:
        problem = judge(_with_pending(work))
        assert problem is not None and problem[0] == "liveness" and says in problem[1], problem


def test_a_leak_after_the_abort_with_works_pending_is_a_leak() -> None:
    results = _with_pending(_op(blocked=True, seconds=0.02, raised=True))
    results[0]["pending"]["release"]["leak"] = "leaked file descriptors ['7->anon_inode:[eventpoll]']"
    problem = judge(results)
    assert problem is not None and problem[0] == "leak" and "with works pending" in problem[1], problem
