"""pg-shm's launched collectives (API 1.2): ``async_op=True`` starts the collective in the
caller's thread and returns a work without the group's progress thread; the work completes
when it is waited for, polled, overtaken by a later collective, or, with nobody doing any of
that, by the member's drainer; timeouts, dead peers, ``abort()`` and the group's order hold.
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
from pg_core.errors import CollectiveTimeout, GroupClosedError, PeerFailureError
from pg_core.ops import ReduceOp
from pg_core.store import wait_for
from pg_core.testing.pool import RankContext, RankPool

pytestmark = pytest.mark.requires_backend("shm")

Pools = Callable[[int], RankPool]

#: A slot this small makes a 64 KiB all_reduce many pieces of two phases each.
SMALL_SLOTS = {"shm": {"slot_bytes": 4096}}


def _core_threads() -> set[str]:
    """The core's threads alive now: the group's progress thread and its helpers are named so."""
    return {t.name for t in threading.enumerate() if t.name.startswith("pg-core-")}


def launched_before_the_peer(ctx: RankContext) -> dict[str, Any]:
    """Rank 0 launches every shared-slot collective while rank 1 is not there yet (it waits
    for rank 0's word): each call returns at once, and the results are right once waited for.
    No progress thread is started for any of it."""
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="shm", timeout=60, options=SMALL_SLOTS)
    size, r = ctx.size, ctx.rank
    group.barrier()
    before = _core_threads()
    small = torch.full((3,), float(r + 1))
    big = torch.full((16_384,), float(r + 1))  # 64 KiB over 4 KiB slots: 32 pieces
    mean = torch.full((5,), float(2 * r))
    cast = torch.full((1000,), float(r + 7)) if r == 0 else torch.zeros(1000)
    gathered = torch.zeros(size * 1000)
    scattered = torch.zeros(1000)
    if r == 1:
        wait_for(ctx.store, ["launched"], 30)
    started = time.monotonic()
    works = [
        group.all_reduce(small, async_op=True),
        group.all_reduce(big, async_op=True),
        group.all_reduce(mean, ReduceOp.AVG, async_op=True),
        group.broadcast(cast, 0, async_op=True),
        group.barrier(async_op=True),
        group.all_gather_into_tensor(gathered, torch.full((1000,), float(r)), async_op=True),
        group.reduce_scatter_tensor(scattered, torch.arange(size * 1000, dtype=torch.float32), async_op=True),
    ]
    launching = time.monotonic() - started
    pending = [w.is_completed() for w in works]
    if r == 0:
        ctx.store.set("launched", "1")
    for w in works:
        w.wait()
    expected_sum = float(sum(range(1, size + 1)))
    right = {
        "small": torch.equal(small, torch.full((3,), expected_sum)),
        "big": torch.equal(big, torch.full((16_384,), expected_sum)),
        "mean": torch.equal(mean, torch.full((5,), float(size - 1))),
        "broadcast": torch.equal(cast, torch.full((1000,), 7.0)),
        "all_gather": torch.equal(gathered, torch.arange(size, dtype=torch.float32).repeat_interleave(1000)),
        "reduce_scatter": torch.equal(scattered, torch.arange(r * 1000, (r + 1) * 1000, dtype=torch.float32) * size),
    }
    threads = sorted(_core_threads() - before)
    group.shutdown()
    return {"launching": launching, "pending": pending, "right": right, "threads": threads}


def test_launched_collectives_return_before_the_peer_comes_and_use_no_progress_thread(rank_pools: Pools) -> None:
    got = rank_pools(2).run(launched_before_the_peer, timeout=120)
    first = got[0]
    assert all(first["right"].values()) and all(got[1]["right"].values()), got
    assert first["launching"] < 5, first  # (rank 1 comes only after rank 0 launched all seven)
    assert not any(first["pending"]), first  # none could finish before rank 1 came
    assert first["threads"] == [] and got[1]["threads"] == [], got


def unwaited_launch(ctx: RankContext) -> dict[str, Any]:
    """Rank 0 launches a many-phase all_reduce and, without waiting for it, blocks in a recv
    that rank 1 answers only after its own blocking all_reduce: that one needs rank 0's
    phases, which nobody on rank 0 drives but its drainer. Then the same with a callback
    and nothing else: the work completes by itself."""
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="shm", timeout=60, options=SMALL_SLOTS)
    group.barrier()
    big = torch.full((16_384,), float(ctx.rank + 1))
    got = torch.zeros(1)
    if ctx.rank == 0:
        work = group.all_reduce(big, async_op=True)
        group.recv(got, 1)
        work.wait()
    else:
        group.all_reduce(big)
        group.send(torch.full((1,), 5.0), 0)
    done = threading.Event()
    second = torch.full((16_384,), float(ctx.rank + 1))
    if ctx.rank == 0:
        assert group.all_reduce(second, async_op=True) is not None
        group.all_reduce(second, async_op=True).add_done_callback(lambda _w: done.set())  # type: ignore[union-attr]
        called = done.wait(30)
    else:
        group.all_reduce(second)
        group.all_reduce(second)
        called = True
    group.barrier()
    result = {"big": float(big[0]), "got": float(got[0]), "second": float(second[0]), "called": called}
    group.shutdown()
    return result


def test_a_launched_collective_nobody_waits_for_still_completes(rank_pools: Pools) -> None:
    got = rank_pools(2).run(unwaited_launch, timeout=120)
    assert got[0]["big"] == got[1]["big"] == 3.0, got
    assert got[0]["got"] == 5.0 and got[0]["called"], got
    assert got[0]["second"] == got[1]["second"] == 6.0, got  # (1 + 2, twice summed: 3, then 6)


def launched_failures(ctx: RankContext, case: str) -> dict[str, Any]:
    """A launched all_reduce whose peer never comes (``timeout``), dies (``killed``), or whose
    own member aborts while it is pending (``abort``)."""
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="shm", timeout=60)
    group.barrier()
    if ctx.rank == 1:
        if case == "killed":
            wait_for(ctx.store, ["launched"], 30)
            os.kill(os.getpid(), signal.SIGKILL)
        wait_for(ctx.store, ["done"], 60)
        group.abort()
        return {}
    started = time.monotonic()
    work = group.all_reduce(torch.ones(4), async_op=True, timeout=2.0 if case == "timeout" else None)
    launching = time.monotonic() - started
    assert work is not None
    ctx.store.set("launched", "1")
    if case == "abort":
        threading.Timer(0.3, group.abort).start()
    try:
        work.wait()
    except (CollectiveTimeout, PeerFailureError, GroupClosedError) as exc:
        raised = type(exc).__name__
    else:
        raised = "nothing"
    seconds = time.monotonic() - started
    try:
        group.barrier()
    except Exception as exc:  # the group latched the failure, or is closed
        after = type(exc).__name__
    else:
        after = "nothing"
    ctx.store.set("done", "1")
    group.abort()
    return {"raised": raised, "seconds": seconds, "launching": launching, "after": after}


@pytest.mark.parametrize(
    ("case", "error"),
    [("timeout", "CollectiveTimeout"), ("killed", "PeerFailureError"), ("abort", "GroupClosedError")],
)
def test_a_launched_collective_fails_as_the_blocking_one_would(rank_pools: Pools, case: str, error: str) -> None:
    pool = RankPool(2)
    try:
        got = pool.run(launched_failures, case, timeout=60, may_exit=[1], check_leaks=case != "killed")[0]
    finally:
        pool.close()
    assert got["raised"] == error, got
    assert got["launching"] < 1.0, got
    assert got["seconds"] < 5, got
    assert got["after"] != "nothing", got  # latched (or closed): no later collective runs out of step
