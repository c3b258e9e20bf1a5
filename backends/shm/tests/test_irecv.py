"""pg-shm's native ``irecv``: posted in the caller's thread (no helper thread of the core),
completed by its waiter, by a later receive on any stream of the peer, or by the drainer
where nobody drives; in stream order with blocking receives; a size mismatch, a timeout, a
dead peer and ``abort()`` fail it as they fail a blocking ``recv``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from pg_core import ProcessGroup
from pg_core.errors import CollectiveMismatchError, CollectiveTimeout, GroupClosedError, PeerFailureError
from pg_core.store import wait_for
from pg_core.testing.pool import RankContext, RankPool

pytestmark = pytest.mark.requires_backend("shm")

Pools = Callable[[int], RankPool]
#: Above the 1 MiB eager limit and the ring: its sender waits for the receive and streams.
BIG = (3 << 20) // 4


def _core_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("pg-core-")}


def ordered(ctx: RankContext) -> dict[str, Any]:
    """Rank 1 posts two irecvs on tag 0 and one on tag 1, then a blocking recv on tag 0, and
    waits last: each gets its own message in the order sent; no core thread is started."""
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="shm", timeout=60)
    group.barrier()
    before = _core_threads()
    got: dict[str, Any] = {}
    if ctx.rank == 0:
        wait_for(ctx.store, ["posted"], 30)
        group.send(torch.full((1,), 7.0), 1, tag=1)
        for value in (1.0, 2.0, 3.0):
            group.send(torch.full((4,), value), 1)
        group.send(torch.full((BIG,), 4.0), 1)  # waits for rank 1's posted receive
    else:
        first, second, third, other = torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.zeros(1)
        big = torch.zeros(BIG)
        works = [group.irecv(first, 0), group.irecv(second, 0), group.irecv(other, 0, tag=1)]
        ctx.store.set("posted", "1")
        group.recv(third, 0)  # behind the two posted on tag 0
        got["third"] = float(third[0])
        big_work = group.irecv(big, 0)
        for w in works:
            w.wait()
        big_work.wait()
        got.update(first=float(first[0]), second=float(second[0]), other=float(other[0]), big=bool((big == 4.0).all()))
    got["threads"] = sorted(_core_threads() - before)
    group.barrier()
    group.shutdown()
    return got


def test_irecvs_and_recvs_of_one_stream_take_the_messages_in_order(rank_pools: Pools) -> None:
    got = rank_pools(2).run(ordered, timeout=120)
    assert got[1] == {"third": 3.0, "first": 1.0, "second": 2.0, "other": 7.0, "big": True, "threads": []}, got
    assert got[0]["threads"] == [], got


def unattended(ctx: RankContext) -> dict[str, Any]:
    """Each rank posts an irecv of a message above the eager limit, then sends one to the other
    (a blocking send that waits for its receiver, who is itself in such a send): only the
    drainer can complete the posted receives. Then a small irecv completes with nobody waiting
    (its callback fires)."""
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="shm", timeout=60)
    group.barrier()
    peer = 1 - ctx.rank
    big = torch.zeros(BIG)
    work = group.irecv(big, peer)
    group.send(torch.full((BIG,), float(ctx.rank + 1)), peer)
    work.wait()
    done = threading.Event()
    small = torch.zeros(2)
    if ctx.rank == 1:
        group.irecv(small, 0).add_done_callback(lambda _w: done.set())
        ctx.store.set("posted", "1")
        called = done.wait(30)
    else:
        wait_for(ctx.store, ["posted"], 30)
        group.send(torch.full((2,), 9.0), 1)
        called = True
    group.barrier()
    result = {"big": bool((big == float(peer + 1)).all()), "called": called, "small": float(small[0])}
    group.shutdown()
    return result


def test_a_posted_irecv_completes_while_its_rank_blocks_in_a_send_and_with_nobody_waiting(rank_pools: Pools) -> None:
    got = rank_pools(2).run(unattended, timeout=120)
    assert got[0]["big"] and got[1]["big"], got
    assert got[1]["called"] and got[1]["small"] == 9.0, got


def mismatched(ctx: RankContext) -> dict[str, Any]:
    """An irecv whose tensor is smaller than the message fails naming the sender, its tensor
    untouched; the next message on the stream is received."""
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="shm", timeout=60)
    group.barrier()
    result: dict[str, Any] = {}
    if ctx.rank == 0:
        group.send(torch.full((4,), 1.0), 1)
        group.send(torch.full((4,), 2.0), 1)
    else:
        small, right = torch.zeros(3), torch.zeros(4)
        work, after = group.irecv(small, 0), group.irecv(right, 0)
        try:
            work.wait()
        except CollectiveMismatchError as exc:
            result.update(raised="CollectiveMismatchError", peers=list(exc.peers or []), text=str(exc))
        else:
            result["raised"] = "nothing"
        after.wait()
        result.update(untouched=bool((small == 0).all()), next=float(right[0]))
    group.shutdown()
    return result


def test_an_irecv_of_the_wrong_size_fails_naming_the_peer(rank_pools: Pools) -> None:
    got = rank_pools(2).run(mismatched, timeout=120)[1]
    assert got["raised"] == "CollectiveMismatchError" and got["peers"] == [0], got
    assert "rank 0" in got["text"] and got["untouched"] and got["next"] == 2.0, got


def sole(ctx: RankContext) -> dict[str, Any]:
    """Rank 1 posts one irecv at a time, each before its message exists, then waits (the wait
    of the only receive posted takes its message as a blocking recv would, where it is that
    receive's): a message of another tag ahead of it is kept for its own receive, a message of
    the wrong size fails the irecv naming the sender and the stream goes on."""
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="shm", timeout=60)
    group.barrier()
    result: dict[str, Any] = {}
    if ctx.rank == 0:
        wait_for(ctx.store, ["posted/1"], 30)
        group.send(torch.full((4,), 5.0), 1, tag=5)  # another tag, ahead of the posted one's message
        group.send(torch.full((4,), 2.0), 1, tag=2)
        wait_for(ctx.store, ["posted/2"], 30)
        group.send(torch.full((3,), 3.0), 1, tag=2)  # the wrong size
        group.send(torch.full((4,), 4.0), 1, tag=2)
    else:
        first = torch.zeros(4)
        work = group.irecv(first, 0, tag=2)
        ctx.store.set("posted/1", "1")
        work.wait()
        other = torch.zeros(4)
        group.recv(other, 0, tag=5)
        result.update(first=first.tolist(), other=other.tolist())
        wrong = torch.zeros(4)
        work = group.irecv(wrong, 0, tag=2)
        ctx.store.set("posted/2", "1")
        try:
            work.wait()
        except CollectiveMismatchError as exc:
            result.update(raised="CollectiveMismatchError", peers=list(exc.peers or []))
        else:
            result["raised"] = "nothing"
        after = torch.zeros(4)
        group.irecv(after, 0, tag=2).wait()
        result.update(untouched=bool((wrong == 0).all()), after=after.tolist())
    group.shutdown()
    return result


def test_the_wait_of_the_only_posted_irecv_takes_its_own_message_and_no_other(rank_pools: Pools) -> None:
    got = rank_pools(2).run(sole, timeout=120)[1]
    assert got["first"] == [2.0] * 4 and got["other"] == [5.0] * 4, got
    assert got["raised"] == "CollectiveMismatchError" and got["peers"] == [0] and got["untouched"], got
    assert got["after"] == [4.0] * 4, got


def failing(ctx: RankContext, case: str) -> dict[str, Any]:
    """Rank 1 posts an irecv that rank 0 never answers: it times out, rank 0 dies, or rank 1
    aborts while it is pending."""
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="shm", timeout=60)
    group.barrier()
    if ctx.rank == 0:
        if case == "killed":
            wait_for(ctx.store, ["posted"], 30)
            os.kill(os.getpid(), signal.SIGKILL)
        wait_for(ctx.store, ["done"], 60)
        group.abort()
        return {}
    started = time.monotonic()
    work = group.irecv(torch.zeros(4), 0, timeout=2.0 if case == "timeout" else None)
    posting = time.monotonic() - started
    ctx.store.set("posted", "1")
    if case == "abort":
        threading.Timer(0.3, group.abort).start()
    try:
        work.wait()
    except (CollectiveTimeout, PeerFailureError, GroupClosedError) as exc:
        raised = type(exc).__name__
    else:
        raised = "nothing"
    seconds = time.monotonic() - started
    ctx.store.set("done", "1")
    group.abort()
    return {"raised": raised, "seconds": seconds, "posting": posting}


@pytest.mark.parametrize(
    ("case", "error"),
    [("timeout", "CollectiveTimeout"), ("killed", "PeerFailureError"), ("abort", "GroupClosedError")],
)
def test_a_posted_irecv_fails_as_a_blocking_recv_would(case: str, error: str) -> None:
    pool = RankPool(2)
    try:
        got = pool.run(failing, case, timeout=60, may_exit=[0], check_leaks=case != "killed")[1]
    finally:
        pool.close()
    assert got["raised"] == error, got
    assert got["posting"] < 1.0, got
    assert got["seconds"] < 5, got


def arrives_while_looking(ctx: RankContext) -> dict[str, Any] | None:
    """Rank 1 waits for an irecv; its look at the ring (``_advance_posted``) is held, in rank 1's
    process, until rank 0's message has landed in the ring just after the look found nothing.
    The wait must see the message without sleeping: a wait that read the ring's head only after
    looking took the new head for the old one and slept on it until its futex slice (30 ms)
    ran out, about one irecv in ten in a ping-pong (its mean one way was 521 us for 17 us)."""
    from pg_shm import waiting

    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="shm", timeout=60)
    group.barrier()
    if ctx.rank == 0:
        wait_for(ctx.store, ["looked"], 30)
        group.send(torch.full((1,), 5.0), 1)
        group.barrier()
        group.shutdown()
        return None
    inbox = group.form_backend("cpu").inboxes[0]  # type: ignore[attr-defined]
    looks = inbox._advance_posted
    held, calls = [False], [0]
    head = inbox.ring.head

    def look_then_let_it_land() -> None:
        before = head.value
        looks()
        calls[0] += 1
        if calls[0] == 2:  # the wait's first look (the first is the irecv's own, as it posts)
            held[0] = True
            ctx.store.set("looked", "1")
            deadline = time.monotonic() + 30
            while head.value == before and time.monotonic() < deadline:
                os.sched_yield()  # (a bounded spin under the inbox's lock: rank 0's send needs none of it)

    sleeps: list[str] = []
    real_wait = waiting.futex_wait

    def counted_wait(address: int, expected: int, seconds: float) -> None:
        if threading.current_thread() is threading.main_thread():
            sleeps.append(f"{seconds:.3f} s")
        real_wait(address, expected, seconds)

    inbox._advance_posted = look_then_let_it_land
    waiting.futex_wait = counted_wait  # type: ignore[assignment]
    try:
        got = torch.zeros(1)
        group.irecv(got, 0).wait()
    finally:
        waiting.futex_wait = real_wait  # type: ignore[assignment]
        del inbox._advance_posted
    group.barrier()
    group.shutdown()
    return {"got": got.tolist(), "held": held[0], "sleeps": sleeps}


def test_a_message_landing_while_an_irecv_looks_is_seen_without_sleeping(rank_pools: Pools) -> None:
    got = rank_pools(2).run(arrives_while_looking, timeout=120)
    assert got[1] == {"got": [5.0], "held": True, "sleeps": []}, got
