"""pg-gloo's point to point on both sides of its eager limit, across real processes.

At most ``EAGER_LIMIT_BYTES`` a send is a copy and returns before its receiver posts; above it
Gloo sends from the caller's tensor and the send waits for the receive (API 1.10), and the
receiver receives straight into its tensor. ``isend``/``irecv`` are pg-gloo's own: posted in
the caller's thread, in stream order, completed by the threads that wait in Gloo.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from pg_core import ProcessGroup
from pg_core.errors import CollectiveMismatchError, PeerFailureError
from pg_core.store import wait_for
from pg_core.testing.pool import RankContext, RankPool
from pg_gloo.plugin import CAPABILITIES, CUDA_CAPABILITIES, EAGER_LIMIT_BYTES

pytestmark = pytest.mark.requires_backend("gloo")

Pools = Callable[[int], RankPool]

LIMIT = EAGER_LIMIT_BYTES


def _group(ctx: RankContext, timeout: float = 30) -> ProcessGroup:
    """The group, its gloo backend formed on both ranks (it forms on the first operation)."""
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="gloo", timeout=timeout)
    group.barrier()
    return group


def _until(predicate: Callable[[], bool], within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def test_the_eager_limit_is_declared_on_every_device() -> None:
    assert CAPABILITIES.eager_limit_bytes == CUDA_CAPABILITIES.eager_limit_bytes == LIMIT == 2 << 20


def at_and_above_the_limit(ctx: RankContext) -> dict[str, Any]:
    """Rank 0 sends ``LIMIT`` bytes, then ``LIMIT + 1``, before rank 1 posts any receive: the
    first returns (a copy: changing the tensor after it changes nothing received), the second
    is still sending 0.5 s later and returns once rank 1 receives."""
    with _group(ctx) as group:
        at = torch.full((LIMIT,), 1, dtype=torch.uint8)
        above = torch.full((LIMIT + 1,), 2, dtype=torch.uint8)
        if ctx.rank == 0:
            group.send(at, 1)
            at.fill_(9)  # the message was copied when send returned
            sender = threading.Thread(target=group.send, args=(above, 1))
            sender.start()
            sender.join(0.5)
            waited = sender.is_alive()
            ctx.store.set("receive", "1")
            sender.join(30)
            group.barrier()
            return {"waited_for_the_receiver": waited, "returned": not sender.is_alive()}
        wait_for(ctx.store, ["receive"], 30)
        got_at, got_above = torch.empty_like(at), torch.empty_like(above)
        group.recv(got_at, 0)
        group.recv(got_above, 0)
        group.barrier()
        return {"at": bool((got_at == 1).all()), "above": bool((got_above == 2).all())}


def test_a_send_at_the_limit_returns_before_its_receiver_and_one_above_waits_for_it(rank_pools: Pools) -> None:
    sender, receiver = rank_pools(2).run(at_and_above_the_limit, timeout=120)
    assert sender == {"waited_for_the_receiver": True, "returned": True}
    assert receiver == {"at": True, "above": True}


def isend_without_a_copy(ctx: RankContext) -> dict[str, Any]:
    """Rank 0 isends twice the limit and changes the tensor before rank 1 posts its receive: Gloo
    sends from the tensor itself (rank 1 gets the change), and the work completes only once rank
    1 has received. An isend at the limit is a copy, done at once."""
    n = 2 * LIMIT // 4
    with _group(ctx) as group:
        if ctx.rank == 0:
            small = torch.full((LIMIT // 4,), 3.0)
            done_small = group.isend(small, 1, tag=1).is_completed()
            small.fill_(-1.0)
            t = torch.full((n,), 1.0)
            work = group.isend(t, 1, tag=2)
            t.fill_(2.0)  # allowed before rank 1 receives only because it shows what Gloo reads
            pending = not work.is_completed()
            ctx.store.set("changed", "1")
            work.wait()
            group.barrier()
            return {"small_done_at_once": done_small, "pending_before_the_receive": pending}
        wait_for(ctx.store, ["changed"], 30)
        small = torch.empty(LIMIT // 4)
        got = torch.empty(n)
        group.recv(small, 0, tag=1)
        group.recv(got, 0, tag=2)
        group.barrier()
        return {"small": float(small.min()), "got": [float(got.min()), float(got.max())]}


def test_isend_leaves_the_tensor_to_gloo_until_its_work_completes(rank_pools: Pools) -> None:
    sender, receiver = rank_pools(2).run(isend_without_a_copy, timeout=120)
    assert sender == {"small_done_at_once": True, "pending_before_the_receive": True}
    assert receiver == {"small": 3.0, "got": [2.0, 2.0]}


_SIZES = [2 * LIMIT, 16, LIMIT + 4, LIMIT // 2, 8]  # bytes: two-part and one-part messages, mixed


def irecvs_in_stream_order(ctx: RankContext) -> dict[str, Any]:
    """Rank 1 posts five irecvs on one tag (large and small mixed) before rank 0 sends; rank 0
    then sends them (isend: the large ones wait for their receives); rank 1's works complete
    without anyone waiting (polled), in any order of waits, each with its own message. No
    helper thread of the core runs them."""
    with _group(ctx) as group:
        if ctx.rank == 0:
            wait_for(ctx.store, ["posted"], 30)
            works = [group.isend(torch.full((n // 4,), float(i)), 1, tag=3) for i, n in enumerate(_SIZES)]
            for work in works:
                work.wait()
            group.barrier()
            return {}
        before = {t.name for t in threading.enumerate()}
        into = [torch.full((n // 4,), -1.0) for n in _SIZES]
        works = [group.irecv(t, 0, tag=3) for t in into]
        helpers = sorted({t.name for t in threading.enumerate()} - before)
        ctx.store.set("posted", "1")
        polled = _until(lambda: all(w.is_completed() for w in works), 30)
        for work in reversed(works):
            work.wait()
        group.barrier()
        return {
            "polled": polled,
            "got": [[float(t.min()), float(t.max())] for t in into],
            "core_helpers": [name for name in helpers if name.startswith("pg-core-")],
        }


def test_irecvs_are_posted_in_stream_order_and_complete_without_a_wait(rank_pools: Pools) -> None:
    _, receiver = rank_pools(2).run(irecvs_in_stream_order, timeout=120)
    assert receiver == {"polled": True, "got": [[float(i)] * 2 for i in range(len(_SIZES))], "core_helpers": []}


def mismatched_large_then_whole(ctx: RankContext) -> dict[str, Any]:
    """Rank 0 sends twice the limit of float32 twice, then one element more (isend: each waits
    for its receive); rank 1 receives the first into a tensor one element too small (refused,
    the tensor untouched), the second as int32 (refused), then the third whole."""
    n = 2 * LIMIT // 4
    with _group(ctx) as group:
        if ctx.rank == 0:
            works = [group.isend(torch.full((n,), 5.0), 1), group.isend(torch.full((n,), 6.0), 1)]
            works.append(group.isend(torch.full((n + 1,), 7.0), 1))
            for work in works:
                work.wait()
            group.barrier()
            return {}
        small = torch.full((n - 1,), -1.0)
        with pytest.raises(CollectiveMismatchError, match=rf"{n} x float32.*{n - 1} x float32") as err:
            group.recv(small, 0)
        wrong = torch.full((n,), -1, dtype=torch.int32)
        with pytest.raises(CollectiveMismatchError, match="int32"):
            group.irecv(wrong, 0).wait()
        got = torch.empty(n + 1)
        group.recv(got, 0)
        group.barrier()
        return {
            "peers": list(err.value.peers),
            "untouched": bool((small == -1.0).all()) and bool((wrong == -1).all()),
            "next": [float(got.min()), float(got.max())],
        }


def test_a_mismatched_large_receive_is_refused_untouched_and_the_next_message_arrives_whole(
    rank_pools: Pools,
) -> None:
    _, receiver = rank_pools(2).run(mismatched_large_then_whole, timeout=120)
    assert receiver == {"peers": [0], "untouched": True, "next": [7.0, 7.0]}


def peer_dies_during(ctx: RankContext, what: str) -> dict[str, Any] | None:
    """Rank 1 dies (its process ends without a word) while rank 0 waits in a large ``send`` or
    an ``irecv``'s wait, neither of which rank 1 will ever match: rank 0 gets PeerFailureError
    naming rank 1, within seconds, not at the group's 60 s timeout."""
    group = _group(ctx, timeout=60)
    if ctx.rank == 1:
        wait_for(ctx.store, [f"waiting-{what}"], 30)
        time.sleep(0.3)  # (not synchronisation: let rank 0 be inside its wait when this rank dies)
        os._exit(0)
    ctx.store.set(f"waiting-{what}", "1")
    started = time.monotonic()
    try:
        if what == "send":
            group.send(torch.ones(2 * LIMIT // 4), 1)
        else:
            group.irecv(torch.empty(4), 1).wait()
    except PeerFailureError as exc:
        return {"raised": "PeerFailureError", "peers": list(exc.peers), "fast": time.monotonic() - started < 10}
    except BaseException as exc:
        return {"raised": type(exc).__name__}
    finally:
        group.abort()
    return {"raised": None}


@pytest.mark.parametrize("what", ["send", "irecv"])
def test_a_peer_that_dies_during_a_large_send_or_an_irecv_is_a_peer_failure(rank_pools: Pools, what: str) -> None:
    got = rank_pools(2).run(peer_dies_during, what, timeout=120, may_exit=[1])
    assert got[0] == {"raised": "PeerFailureError", "peers": [1], "fast": True}


def shutdown_with_an_isend_in_flight(ctx: RankContext) -> dict[str, Any]:
    """Rank 0 isends twice the limit and shuts down before rank 1 receives it: shutdown waits for
    the send (rank 1 receives it whole), the work is then complete, and nothing is left behind
    (the pool checks threads and sockets)."""
    n = 2 * LIMIT // 4
    group = _group(ctx)
    if ctx.rank == 0:
        t = torch.full((n,), 4.0)
        work = group.isend(t, 1)
        ctx.store.set("isent", "1")
        group.shutdown()
        return {"completed": work.is_completed(), "error": repr(work.exception(0))}
    wait_for(ctx.store, ["isent"], 30)
    got = torch.empty(n)
    group.recv(got, 0)
    group.shutdown()
    return {"got": [float(got.min()), float(got.max())]}


def test_shutdown_with_an_isend_in_flight_drains_it(rank_pools: Pools) -> None:
    sender, receiver = rank_pools(2).run(shutdown_with_an_isend_in_flight, timeout=120)
    assert sender == {"completed": True, "error": "None"}
    assert receiver == {"got": [4.0, 4.0]}


def _received(group: ProcessGroup, tag: int = 0) -> float:
    got = torch.empty(1)
    group.recv(got, 0, tag=tag)
    return float(got[0])


def _waiter_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("pg-gloo-") and "-wait-" in t.name)


_STREAMS = 24


def many_streams_then(ctx: RankContext, how: str) -> dict[str, Any]:
    """Rank 0 sends two 4-byte messages on each of ``_STREAMS`` tags, then on tag 0 a message of
    8 bytes and one of 4; rank 1 receives them in that order, the 8-byte one into a 4-byte
    tensor (refused, untouched: a receive posted ahead of its caller took it, and must not pass
    it on), then blocks in a receive on tag 0 in a thread of its own, with nothing sent, while
    its main thread ends the group (``abort``: the receive raises GroupClosedError promptly;
    ``shutdown``: after rank 0's last message was received). The waiter threads stay bounded
    whatever the number of streams, and after a shutdown none is left while rank 0's group is
    still open (the pool checks threads and sockets too). (After an abort, the thread that
    waited in Gloo for the blocked receive stays there until Gloo's own timeout, or until rank 0
    closes its connections: ``ProcessGroupGloo.abort()`` does not wake it; see the README.)"""
    group = _group(ctx)
    if ctx.rank == 0:
        for _ in range(2):
            for tag in range(_STREAMS):
                group.send(torch.full((1,), float(tag)), 1, tag=tag)
        group.send(torch.full((2,), 8.0), 1)
        group.send(torch.full((1,), 9.0), 1)
        wait_for(ctx.store, ["ended"], 60)
        if how == "abort":
            group.abort()
        else:
            group.shutdown()
        return {}
    got = [[_received(group, tag) for tag in range(_STREAMS)] for _ in range(2)]
    most = _waiter_threads()
    small = torch.full((1,), -1.0)
    try:
        group.recv(small, 0)
        refused = False
    except CollectiveMismatchError:
        refused = True
    after = _received(group)
    most = max(most, _waiter_threads())
    blocked: dict[str, Any] = {}

    def receive() -> None:
        started = time.monotonic()
        try:
            group.recv(torch.empty(1), 0)
        except BaseException as exc:
            blocked["raised"] = type(exc).__name__
        blocked["after"] = time.monotonic() - started

    thread = threading.Thread(target=receive)
    if how == "abort":
        thread.start()
        time.sleep(0.3)  # (not synchronisation: let the receive be blocked when the group aborts)
        started = time.monotonic()
        group.abort()
    else:
        started = time.monotonic()
        group.shutdown()
    ended = time.monotonic() - started
    if how == "abort":
        thread.join(10)
    released = _until(lambda: _waiter_threads() == 0, 5.0)  # rank 0's group still open
    ctx.store.set("ended", "1")
    return {
        "got": got == [[float(t) for t in range(_STREAMS)]] * 2,
        "bounded": most <= 16,
        "refused": refused,
        "untouched": float(small[0]) == -1.0,
        "after": after,
        "blocked": {"raised": blocked.get("raised"), "fast": blocked.get("after", 99.0) < 5.0}
        if how == "abort"
        else None,
        "ended_fast": ended < 5.0,
        "no_waiters": released if how == "shutdown" else None,
    }


@pytest.mark.parametrize("how", ["abort", "shutdown"])
def test_receives_on_many_streams_stay_bounded_refuse_a_mismatch_and_leave_nothing_when_the_group_ends(
    rank_pools: Pools, how: str
) -> None:
    _, receiver = rank_pools(2).run(many_streams_then, how, timeout=120, check_leaks=how == "shutdown")
    assert receiver == {
        "got": True,
        "bounded": True,
        "refused": True,
        "untouched": True,
        "after": 9.0,
        "blocked": {"raised": "GroupClosedError", "fast": True} if how == "abort" else None,
        "ended_fast": True,
        "no_waiters": True if how == "shutdown" else None,
    }
