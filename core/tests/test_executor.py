"""The executor's launch path (:meth:`pg_core.executor.Executor.launch`), through a group on a
backend that launches (API 1.2) and whose works the test completes by hand: order, sequence
numbers, the flight recorder and the failure latch, without a progress thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
from pg_core import ProcessGroup
from pg_core.backend import BackendContext
from pg_core.bench.nullbackend import NullBackend
from pg_core.errors import PeerFailureError
from pg_core.ops import ReduceOp
from pg_core.store import TCPStore
from pg_core.work import Work


class HeldBackend(NullBackend):
    """Launches every all_reduce and broadcast with ``async_op=True`` as a work the test
    completes (``held``); notes every call, blocking or launched, with the thread it ran in."""

    launches = True

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self.calls: list[tuple[str, bool, int]] = []
        self.held: list[Work] = []

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, timeout: float, async_op: bool = False) -> Work | None:
        return self._call("all_reduce", async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, *, timeout: float, async_op: bool = False) -> Work | None:
        return self._call("broadcast", async_op)

    def _call(self, op: str, async_op: bool) -> Work | None:
        self.calls.append((op, async_op, threading.get_ident()))
        if not async_op:
            return None
        work = Work(op)
        self.held.append(work)
        return work


@pytest.fixture
def group() -> Iterator[ProcessGroup]:
    store = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    g = ProcessGroup(store, 0, 1, backends=HeldBackend, name="launch", timeout=timedelta(seconds=10))
    try:
        yield g
    finally:
        g.shutdown()


def _backend(g: ProcessGroup) -> HeldBackend:
    g.all_reduce(torch.ones(1))  # creates the backend (an async call before that goes to the thread)
    backend = g._dispatch.instance(torch.device("cpu")).backend
    assert isinstance(backend, HeldBackend)
    backend.calls.clear()
    return backend


def _collectives(g: ProcessGroup) -> list[dict[str, object]]:
    return [e for e in g.debug_state()["entries"] if e["seq"] is not None]


def test_a_launched_collective_runs_in_the_callers_thread_in_order(group: ProcessGroup) -> None:
    backend = _backend(group)
    work = group.all_reduce(torch.ones(1), async_op=True)
    assert isinstance(work, Work) and not work.is_completed()
    group.broadcast(torch.ones(1), 0)  # blocking, after the launch: the backend sees it second
    assert backend.calls == [
        ("all_reduce", True, threading.get_ident()),
        ("broadcast", False, threading.get_ident()),
    ]
    assert group._executor._worker is None  # no progress thread was started
    backend.held[0].set_result(None)
    assert work.wait() is True
    assert [(e["seq"], e["op"]) for e in _collectives(group)][-2:] == [(2, "all_reduce"), (3, "broadcast")]


def test_the_recorder_notes_a_launched_collective_when_it_ends(group: ProcessGroup) -> None:
    backend = _backend(group)
    work = group.all_reduce(torch.ones(1), async_op=True)
    assert work is not None
    entry = _collectives(group)[-1]
    assert (entry["op"], entry["state"], entry["end_ns"]) == ("all_reduce", "scheduled", None)
    backend.held[0].set_result(None)
    entry = _collectives(group)[-1]
    assert entry["state"] == "completed" and entry["end_ns"] is not None


def test_a_failed_launched_collective_latches_the_group(group: ProcessGroup) -> None:
    backend = _backend(group)
    work = group.all_reduce(torch.ones(1), async_op=True)
    assert work is not None
    group.broadcast(torch.ones(1), 0)  # launched one still running: the group is fine
    backend.held[0].set_exception(PeerFailureError("rank 1 died", peers=[1]))
    with pytest.raises(PeerFailureError, match="rank 1 died"):
        work.wait()
    entry = [e for e in _collectives(group) if e["op"] == "all_reduce"][-1]
    assert (entry["state"], entry["error"]) == ("failed", "PeerFailureError")
    with pytest.raises(PeerFailureError, match=r"stopped after all_reduce \(collective #2\) failed"):
        group.broadcast(torch.ones(1), 0)
    with pytest.raises(PeerFailureError, match="stopped after"):
        group.all_reduce(torch.ones(1), async_op=True)
    assert group._executor.lost == {1}


def test_a_launch_that_raises_latches_and_is_recorded(group: ProcessGroup) -> None:
    backend = _backend(group)

    def refuse(op: str, async_op: bool) -> Work | None:
        raise PeerFailureError("rank 1 is gone", peers=[1])

    backend._call = refuse  # type: ignore[method-assign]
    with pytest.raises(PeerFailureError, match="rank 1 is gone"):
        group.all_reduce(torch.ones(1), async_op=True)
    assert _collectives(group)[-1]["state"] == "failed"
    with pytest.raises(PeerFailureError, match="stopped after"):
        group.broadcast(torch.ones(1), 0)


def test_a_launch_behind_a_queued_collective_waits_its_turn() -> None:
    store = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    g = ProcessGroup(store, 0, 1, backends=HeldBackend, name="queued", timeout=timedelta(seconds=10))
    try:
        first = g.all_reduce(torch.ones(1), async_op=True)  # no backend yet: queued on the thread
        second = g.all_reduce(torch.ones(1), async_op=True)  # launched, but behind the first
        assert first is not None and second is not None
        first.wait(10)
        backend = g._dispatch.instance(torch.device("cpu")).backend
        assert isinstance(backend, HeldBackend)
        for w in backend.held:
            w.set_result(None)
        second.wait(10)
        assert [(e["seq"], e["op"]) for e in _collectives(g)] == [(1, "all_reduce"), (2, "all_reduce")]
    finally:
        g.shutdown()


def test_a_completed_work_costs_no_condition() -> None:
    work = Work.completed("x", 3)
    assert work.done and work.is_completed() and work.result() == 3 and work._cond is None
    pending = Work("y")
    seen: list[object] = []
    pending.add_done_callback(lambda w: seen.append(w.result(0)))
    timer = threading.Timer(0.05, pending.set_result, args=(7,))
    timer.start()
    assert pending.result(5) == 7 and seen == [7]  # a waiter that blocked was woken
    timer.join()


class OldStyleBroadcast(HeldBackend):
    """A subclass of a launching backend whose broadcast is written as a backend that does
    not launch writes it (no ``async_op``): that op is not launched, the others are."""

    def broadcast(self, tensor: torch.Tensor, src: int, *, timeout: float) -> None:  # type: ignore[override]
        self.calls.append(("broadcast", False, threading.get_ident()))


def test_a_collective_without_async_op_is_not_launched() -> None:
    store = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    g = ProcessGroup(store, 0, 1, backends=OldStyleBroadcast, name="old", timeout=timedelta(seconds=10))
    try:
        backend = _backend(g)
        work = g.broadcast(torch.ones(1), 0, async_op=True)  # on the group's thread, blocking there
        assert work is not None and work.wait(10) is True
        assert backend.calls == [("broadcast", False, g._executor._worker_ident)]
        launched = g.all_reduce(torch.ones(1), async_op=True)
        assert launched is not None and backend.calls[-1] == ("all_reduce", True, threading.get_ident())
        backend.held[-1].set_result(None)
        launched.wait(10)
    finally:
        g.shutdown()


def _lane_backend(g: ProcessGroup) -> HeldBackend:
    """The backend, once an asynchronous all_reduce of float32 SUM went the general way: its lane is made."""
    backend = _backend(g)
    first = g.all_reduce(torch.ones(1), async_op=True)
    assert first is not None
    backend.held.pop().set_result(None)
    first.wait()
    assert list(g._async_lanes) == [(torch.device("cpu"), torch.float32, ReduceOp.SUM.type)]
    backend.calls.clear()

    def general(*args: object, **kwargs: object) -> Work:
        raise AssertionError("a plain asynchronous all_reduce took the general path")

    g._launch = general  # type: ignore[method-assign]  # (the lane never calls it)
    return backend


def test_asynchronous_all_reduces_through_the_lane_keep_order_and_numbers_with_a_later_blocking_call(
    group: ProcessGroup,
) -> None:
    backend = _lane_backend(group)
    before = group._executor.seq
    works = [group.all_reduce(torch.ones(2), async_op=True) for _ in range(3)]
    group.broadcast(torch.ones(1), 0)  # blocking, after three launches through the lane: the backend sees it last
    me = threading.get_ident()
    assert backend.calls == [("all_reduce", True, me)] * 3 + [("broadcast", False, me)]
    assert group._executor._worker is None
    assert [w is not None and not w.is_completed() for w in works] == [True] * 3
    for held in backend.held:
        held.set_result(None)
    assert all(w is not None and w.wait() for w in works)
    numbered = [(e["seq"], e["op"]) for e in _collectives(group)][-4:]
    assert numbered == [(before + 1, "all_reduce"), (before + 2, "all_reduce"), (before + 3, "all_reduce"),
                        (before + 4, "broadcast")]  # fmt: skip


def test_the_lane_notes_each_all_reduce_in_the_recorder_as_the_general_path_does(group: ProcessGroup) -> None:
    backend = _lane_backend(group)
    work = group.all_reduce(torch.ones(3), async_op=True)
    assert work is not None and len(backend.held) == 1
    entry = _collectives(group)[-1]
    assert (entry["op"], entry["state"], entry["end_ns"]) == ("all_reduce", "scheduled", None)
    general = [e for e in _collectives(group) if e["op"] == "all_reduce"][-2]  # the first, the general way
    shown = ("input_sizes", "output_sizes", "input_dtypes", "output_dtypes", "root", "device")
    assert [entry[k] for k in shown] == [[[3]], [[3]], ["float32"], ["float32"], None, "cpu"]
    assert [general[k] for k in shown] == [[[1]], [[1]], ["float32"], ["float32"], None, "cpu"]
    backend.held[0].set_result(None)
    entry = _collectives(group)[-1]
    assert entry["state"] == "completed" and entry["end_ns"] is not None


def test_a_failure_through_the_lane_latches_the_group(group: ProcessGroup) -> None:
    backend = _lane_backend(group)
    work = group.all_reduce(torch.ones(1), async_op=True)
    assert work is not None
    backend.held[0].set_exception(PeerFailureError("rank 1 died", peers=[1]))
    with pytest.raises(PeerFailureError, match="rank 1 died"):
        work.wait()
    with pytest.raises(PeerFailureError, match="stopped after all_reduce"):
        group.all_reduce(torch.ones(1), async_op=True)  # the lane refuses as the general path does
    with pytest.raises(PeerFailureError, match="stopped after all_reduce"):
        group.broadcast(torch.ones(1), 0)
    assert group._executor.lost == {1}


def test_calls_that_are_not_plain_take_the_general_path_beside_the_lane(group: ProcessGroup) -> None:
    backend = _lane_backend(group)
    del group._launch  # the general path again, for the calls that are not plain
    strided = torch.ones(4)[::2]  # not dense: staged, its result copied back when the work completes
    work = group.all_reduce(strided, async_op=True)
    assert work is not None
    timed = group.all_reduce(torch.ones(1), async_op=True, timeout=5)  # its own timeout
    assert timed is not None
    assert len(backend.held) == 2 and len(group._async_lanes) == 1
    for held in backend.held:
        held.set_result(None)
    assert work.wait() and timed.wait()
    group.shutdown()
    with pytest.raises(Exception, match="shut down"):
        group.all_reduce(torch.ones(1), async_op=True)  # a closed group refuses through the lane too


def test_a_launch_through_the_lane_that_raises_latches_and_is_recorded(group: ProcessGroup) -> None:
    backend = _lane_backend(group)

    def refuse(op: str, async_op: bool) -> Work | None:
        raise PeerFailureError("rank 1 is gone", peers=[1])

    backend._call = refuse  # type: ignore[method-assign]
    before = group._executor.seq
    with pytest.raises(PeerFailureError, match="rank 1 is gone"):
        group.all_reduce(torch.ones(1), async_op=True)
    entry = _collectives(group)[-1]
    assert (entry["seq"], entry["op"], entry["state"], entry["error"]) == (
        before + 1,
        "all_reduce",
        "failed",
        "PeerFailureError",
    )
    with pytest.raises(PeerFailureError, match="stopped after all_reduce"):
        group.broadcast(torch.ones(1), 0)
    assert group._executor.lost == {1}


def test_a_launch_through_the_lane_behind_a_queued_collective_waits_its_turn(group: ProcessGroup) -> None:
    backend = _lane_backend(group)
    executor = group._executor
    gate = threading.Event()

    def held_barrier(*, timeout: float, async_op: bool = False) -> Work | None:
        backend.calls.append(("barrier", async_op, threading.get_ident()))
        gate.wait(10)  # the all_reduce is queued behind this one before it ends (see `opener`)
        return None

    def opener() -> None:  # opens the gate once the all_reduce waits behind the barrier (bounded)
        deadline = time.monotonic() + 10
        while executor._pending < 2 and time.monotonic() < deadline:
            gate.wait(0.001)
        gate.set()

    backend.barrier = held_barrier  # type: ignore[method-assign]
    blocked = group.barrier(async_op=True)  # the backend does not launch barrier: on the progress thread
    assert blocked is not None
    helper = threading.Thread(target=opener)
    helper.start()
    work = group.all_reduce(torch.ones(1), async_op=True)  # the lane sees it queued: behind it, via launch()
    helper.join(10)
    assert work is not None and blocked.wait(10)
    assert [c[0] for c in backend.calls] == ["barrier", "all_reduce"]
    assert backend.calls[1][2] != threading.get_ident()  # launched on the progress thread, in its turn
    for held in backend.held:
        held.set_result(None)
    assert work.wait(10)
    assert [(e["op"], e["state"]) for e in _collectives(group)][-2:] == [
        ("barrier", "completed"),
        ("all_reduce", "completed"),
    ]


def test_the_lane_without_a_recorder_keeps_order_and_latches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PG_CORE_TRACE_BUFFER", "0")
    store = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    g = ProcessGroup(store, 0, 1, backends=HeldBackend, name="unrecorded", timeout=timedelta(seconds=10))
    try:
        backend = _lane_backend(g)
        before = g._executor.seq
        work = g.all_reduce(torch.ones(1), async_op=True)
        assert work is not None and g._executor.seq == before + 1 and g.debug_state()["entries"] == []
        backend.held[0].set_exception(PeerFailureError("rank 1 died", peers=[1]))
        with pytest.raises(PeerFailureError, match="rank 1 died"):
            work.wait()
        with pytest.raises(PeerFailureError, match="stopped after all_reduce"):
            g.all_reduce(torch.ones(1), async_op=True)
    finally:
        g.shutdown()
