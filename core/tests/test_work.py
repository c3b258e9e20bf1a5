"""``Work``'s public ways to look at completion without raising: ``done`` (never drives),
``wait_until_done`` (bounded, returns whether it completed) and ``driven``."""

from __future__ import annotations

import gc
import queue
import threading
import time
import weakref
from typing import Any

import pytest
from pg_core.errors import CollectiveTimeout
from pg_core.work import Work, stop_worker


def test_done_never_drives_but_is_completed_does() -> None:
    calls: list[float] = []

    def drive(work: Work, timeout: float) -> None:
        calls.append(timeout)
        work.set_result(7)

    work = Work("op", driver=drive)
    assert work.driven
    assert not work.done
    assert calls == []  # reading done drove nothing
    assert work.is_completed()
    assert calls == [0.0]
    assert work.done and work.result() == 7


class _Held:
    """What a driver holds: a backend's own operation, and the connections behind it."""


@pytest.mark.parametrize("how", ["result", "exception"])
def test_a_done_work_lets_go_of_its_driver_and_what_the_driver_holds(how: str) -> None:
    held = _Held()
    gone = weakref.ref(held)

    def drive(work: Work, timeout: float, held: _Held = held) -> None:
        if how == "result":
            work.set_result(None)
        else:
            work.set_exception(RuntimeError("the peer aborted"))

    work = Work("op", driver=drive)
    del held, drive
    assert work.driven and gone() is not None  # pending: the driver is needed
    work.wait_until_done(5.0)
    gc.collect()
    assert gone() is None  # a failed work kept after an abort holds no connection
    assert not work.driven
    if how == "exception":
        with pytest.raises(RuntimeError, match="the peer aborted"):
            work.wait()
    else:
        assert work.wait() is True


def test_wait_until_done_is_bounded_and_never_raises() -> None:
    work = Work("op")
    assert not work.driven
    started = time.monotonic()
    assert work.wait_until_done(0.05) is False  # no raise on expiry, unlike wait()
    assert time.monotonic() - started >= 0.05
    with pytest.raises(CollectiveTimeout):
        work.wait(0.01)
    error = RuntimeError("the operation failed")
    threading.Timer(0.01, work.set_exception, (error,)).start()
    assert work.wait_until_done(10.0) is True  # completed with an error: reported, not raised
    assert work.exception(0) is error
    assert work.done


def test_wait_until_done_drives_a_driven_work() -> None:
    slices: list[float] = []

    def drive(work: Work, timeout: float) -> None:
        slices.append(timeout)
        if len(slices) == 3:
            work.set_result(None)

    work = Work("op", driver=drive)
    assert work.wait_until_done() is True
    assert len(slices) == 3 and all(0 < s <= 1.0 for s in slices)


def test_completed_work_is_done() -> None:
    work = Work.completed("op", 3)
    assert work.done and work.wait_until_done(0) and work.result() == 3


def _worker(items: queue.SimpleQueue[Any], ran: list[str]) -> threading.Thread:
    def run() -> None:
        while (item := items.get()) is not None:
            work, fn = item
            work.set_result(fn())
            ran.append(work.op)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_stop_worker_stops_the_thread_and_fails_what_is_queued_behind_a_stuck_call() -> None:
    items: queue.SimpleQueue[Any] = queue.SimpleQueue()
    ran: list[str] = []
    thread = _worker(items, ran)
    release, inside = threading.Event(), threading.Event()
    stuck, behind = Work("stuck"), Work("behind")
    items.put((stuck, lambda: (inside.set(), release.wait(30))))
    items.put((behind, lambda: "never"))
    assert inside.wait(30)
    stop_worker(items, thread, lambda w: RuntimeError(f"{w.op}: stopped"), join_s=0.05)
    assert behind.done and str(behind.exception(0)) == "behind: stopped"  # failed, not left pending
    assert thread.is_alive() and not stuck.done
    release.set()  # the stuck call returns: its work completes, and the thread takes its stop mark again
    thread.join(30)
    assert not thread.is_alive() and stuck.done and ran == ["stuck"]


def test_stop_worker_of_an_idle_thread_joins_it() -> None:
    items: queue.SimpleQueue[Any] = queue.SimpleQueue()
    ran: list[str] = []
    thread = _worker(items, ran)
    stop_worker(items, thread, lambda w: RuntimeError("stopped"), join_s=30)
    assert not thread.is_alive() and items.empty()
    stop_worker(items, None, lambda w: RuntimeError("stopped"), join_s=30)  # no thread: nothing to stop


def test_error_is_read_without_waiting_or_driving() -> None:
    calls: list[float] = []
    work = Work("op", driver=lambda w, timeout: calls.append(timeout))
    assert work.error is None  # pending: no error yet, and nothing waited or drove
    assert calls == []
    failure = RuntimeError("the peer went away")
    work.set_exception(failure)
    assert work.error is failure
    ok = Work("op")
    ok.set_result(3)
    assert ok.error is None


def test_wait_undriven_returns_at_completion_or_timeout_and_never_drives() -> None:
    calls: list[float] = []
    work = Work("op", driver=lambda w, timeout: calls.append(timeout))
    started = time.monotonic()
    work.wait_undriven(0.05)
    assert time.monotonic() - started >= 0.05 and not work.done
    finisher = threading.Thread(target=work.set_result, args=(1,))
    started = time.monotonic()
    finisher.start()
    work.wait_undriven(30.0)
    finisher.join()
    assert time.monotonic() - started < 20.0  # it returned at completion, not at the timeout
    assert work.done and calls == []
