"""pg-tcp's launched collectives (``async_op=True``, API 1.2), across real processes.

A launched collective returns its work at once and is advanced by the completion of its
messages, in whichever thread drives the transport (the waiter, or the progress thread),
with no thread of its own. These tests hold it to what the blocking form guarantees: the
same bits, the order of the group's collectives, a dead peer's error, and that abort and
shutdown with one in flight neither hang nor leak (the pool checks threads and sockets).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from pg_core import ProcessGroup
from pg_core.backend import BackendContext
from pg_core.errors import GroupClosedError, PeerFailureError, PGError
from pg_core.ops import ReduceOp
from pg_core.store import PrefixStore
from pg_core.testing.pool import RankContext, RankPool
from pg_core.work import Work
from pg_tcp.backend import TCPBackend

Pools = Callable[[int], RankPool]


def make_backend(ctx: RankContext, name: str = "g", *, timeout: float | None = None, **options: Any) -> TCPBackend:
    bctx = BackendContext(
        store=PrefixStore(f"{name}/cpu/tcp", ctx.store),
        rank=ctx.rank,
        size=ctx.size,
        device=torch.device("cpu"),
        timeout=timeout or ctx.timeout,
        group_name=name,
        group_uid=f"{name}-{ctx.job}",
        backend_name="tcp",
        options=options,
    )
    return TCPBackend(bctx)


def _input(rank: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * seed + rank)
    return torch.randn(n, generator=g)


def _each_op(b: TCPBackend, rank: int, size: int, n: int, launched: bool, seed: int) -> list[torch.Tensor]:
    """Every collective once on inputs of ``n`` elements per rank; their outputs."""
    t = 60.0
    outs: list[torch.Tensor] = []
    works: list[Work | None] = []

    def call(work: Work | None) -> None:
        assert (work is not None) is launched, work
        works.append(work)

    x = _input(rank, n, seed)
    call(b.all_reduce(x, ReduceOp.SUM, timeout=t, async_op=launched))
    outs.append(x)
    y = _input(rank, n, seed + 1)
    call(b.broadcast(y, 1 % size, timeout=t, async_op=launched))
    outs.append(y)
    z = _input(rank, n, seed + 2)
    call(b.reduce(z, 0, ReduceOp.MAX, timeout=t, async_op=launched))
    outs.append(z)
    gathered = torch.empty(size * n)
    call(b.all_gather_into_tensor(gathered, _input(rank, n, seed + 3), timeout=t, async_op=launched))
    outs.append(gathered)
    scattered = torch.empty(n)
    call(
        b.reduce_scatter_tensor(scattered, _input(rank, size * n, seed + 4), ReduceOp.SUM, timeout=t, async_op=launched)
    )
    outs.append(scattered)
    swapped = torch.empty(size * n)
    call(
        b.all_to_all_single(
            swapped, _input(rank, size * n, seed + 5), [n] * size, [n] * size, timeout=t, async_op=launched
        )
    )
    outs.append(swapped)
    call(b.barrier(timeout=t, async_op=launched))
    for work in works:
        if work is not None:
            assert work.wait() is True
    return outs


def launched_equals_blocking(ctx: RankContext, n: int, options: dict[str, int]) -> None:
    b = make_backend(ctx, f"same{n}", **options)
    try:
        blocking = _each_op(b, ctx.rank, ctx.size, n, launched=False, seed=1)
        launched = _each_op(b, ctx.rank, ctx.size, n, launched=True, seed=1)
        for i, (x, y) in enumerate(zip(blocking, launched, strict=True)):
            assert torch.equal(x, y), f"op #{i} (n={n}): the launched form left other bits than the blocking one"
    finally:
        b.shutdown()


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(
    ("n", "options"),
    [(1, {}), (3000, {}), (3000, {"small_bytes": 1024, "segment_bytes": 256})],
    ids=["one", "small", "rings"],
)
def test_a_launched_collective_leaves_the_bits_of_the_blocking_one(
    rank_pools: Pools, world_size: int, n: int, options: dict[str, int]
) -> None:
    rank_pools(world_size).run(launched_equals_blocking, n, options)


def launched_then_blocking(ctx: RankContext) -> None:
    """Launched collectives queue behind each other and a blocking one runs after them all,
    in call order, with nobody waiting in between: their frames' sequence numbers agree."""
    b = make_backend(ctx, "order", small_bytes=1024, segment_bytes=256)
    try:
        size, rank = ctx.size, ctx.rank
        big = torch.full((5000,), float(rank + 1))  # a ring of many segments: long in flight
        first = b.all_reduce(big, ReduceOp.SUM, timeout=60.0, async_op=True)
        small = torch.full((4,), float(rank + 1))
        second = b.all_reduce(small, ReduceOp.MAX, timeout=60.0, async_op=True)  # behind the first
        root = torch.full((3,), float(rank))
        b.broadcast(root, size - 1, timeout=60.0)  # blocking: after both
        assert first is not None and second is not None
        assert first.done and second.done  # the blocking call ran after them, so they ended before it
        assert torch.equal(big, torch.full((5000,), float(size * (size + 1) // 2)))
        assert torch.equal(small, torch.full((4,), float(size)))
        assert torch.equal(root, torch.full((3,), float(size - 1)))
        threads = {t.name for t in threading.enumerate()}
        assert not [name for name in threads if "pg-core" in name], threads  # no hop to a group thread
    finally:
        b.shutdown()


def test_a_later_blocking_collective_runs_after_the_launched_ones(rank_pools: Pools) -> None:
    rank_pools(3).run(launched_then_blocking)


def abort_with_a_launched_collective(ctx: RankContext) -> str | None:
    """Rank 0 launches an all_reduce rank 1 never joins, then aborts: the work fails at once."""
    b = make_backend(ctx, "abort", timeout=3600.0)
    if ctx.rank == 1:
        ctx.store.wait(["abort/done"])
        b.shutdown()
        return None
    work = b.all_reduce(torch.ones(8), ReduceOp.SUM, timeout=3600.0, async_op=True)
    assert work is not None and not work.done
    b.abort()
    error = work.exception(timeout=10)
    ctx.store.set("abort/done", "1")
    assert isinstance(error, GroupClosedError), error
    return str(error)


def test_abort_fails_a_launched_collective_and_leaves_nothing(rank_pools: Pools) -> None:
    assert rank_pools(2).run(abort_with_a_launched_collective, timeout=60)[0]


def shutdown_with_a_launched_collective(ctx: RankContext) -> str | None:
    """Rank 0 shuts down with a launched all_reduce rank 1 never joins: no hang, the work fails."""
    b = make_backend(ctx, "bye", timeout=3600.0)
    if ctx.rank == 1:
        ctx.store.wait(["bye/done"])
        b.shutdown()
        return None
    work = b.all_reduce(torch.ones(8), ReduceOp.SUM, timeout=3600.0, async_op=True)
    assert work is not None
    b.shutdown()
    error = work.exception(timeout=10)
    ctx.store.set("bye/done", "1")
    assert isinstance(error, PGError), error
    return type(error).__name__


def test_shutdown_with_a_launched_collective_in_flight_ends_it(rank_pools: Pools) -> None:
    assert rank_pools(2).run(shutdown_with_a_launched_collective, timeout=60)[0]


def dead_peer_in_a_launched_collective(ctx: RankContext) -> dict[str, Any] | None:
    """Through a group: rank 2 dies; the launched all_reduce of ranks 0 and 1 fails with
    PeerFailureError (not at its timeout), the group latches, the recorder says so."""
    g = ProcessGroup(
        PrefixStore("dead", ctx.store), ctx.rank, ctx.size, backends={"cpu": "tcp"}, name="dead", timeout=3600
    )
    g.barrier(timeout=60)
    if ctx.rank == 2:  # once both survivors are through the barrier (its last frame from here read)
        ctx.store.wait(["dead/through/0", "dead/through/1"])
        os._exit(0)  # die without a word
    ctx.store.set(f"dead/through/{ctx.rank}", "1")
    try:
        work = g.all_reduce(torch.ones(10), async_op=True)
        assert work is not None
        with pytest.raises(PeerFailureError) as failed:
            work.wait()
        with pytest.raises(PeerFailureError, match="stopped after all_reduce"):
            g.broadcast(torch.ones(1), 0)
        entry = [e for e in g.debug_state()["entries"] if e["op"] == "all_reduce"][-1]
        # (as for a blocking one: the peer named is rank 2, or a survivor whose ABORT says rank 2 died)
        named = failed.value.peers == (2,) or "rank 2" in str(failed.value)
        return {"named": named, "state": entry["state"], "error": entry["error"]}
    finally:
        g.shutdown()


def test_a_dead_peer_fails_a_launched_collective_and_latches_the_group(rank_pools: Pools) -> None:
    results = rank_pools(3).run(dead_peer_in_a_launched_collective, may_exit=[2], timeout=90)
    for result in results[:2]:
        assert result == {"named": True, "state": "failed", "error": "PeerFailureError"}, result
