"""What torch.distributed users reach for, as methods of the group: ``monitored_barrier``, and
``recv(tensor, src=None)``, which receives from any source and returns the sender's rank; and
what torch says when a habit needs its global tables (``src=`` on a pg-core group)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from pg_core import P2POp, ProcessGroup
from pg_core.errors import CollectiveTimeout, NotSupportedError
from pg_core.store import HashStore, wait_for
from pg_core.testing.pool import RankContext, RankPool

Pools = Callable[[int], RankPool]

pytestmark = pytest.mark.requires_backend("tcp")


def monitored(ctx: RankContext, absent: int | None) -> dict[str, Any]:
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="tcp", timeout=ctx.timeout)
    try:
        group.monitored_barrier(timeout=10)  # everyone arrives
        others = [f"gave_up/{r}" for r in range(ctx.size) if r != absent]
        if ctx.rank == absent:
            # stay in the group (leaving is not what is tested) until the others have given up
            wait_for(ctx.store, others, 30)
            return {"absent": True}
        start = time.monotonic()
        try:
            group.monitored_barrier(timeout=1.0)
        except CollectiveTimeout as exc:
            return {"peers": list(exc.peers), "message": str(exc), "seconds": time.monotonic() - start}
        finally:
            ctx.store.set(f"gave_up/{ctx.rank}", "1")
        return {"peers": None}
    finally:
        group.shutdown()


def test_monitored_barrier_passes_when_everyone_arrives(rank_pools: Pools) -> None:
    assert rank_pools(3).run(monitored, None, timeout=60) == [{"peers": None}] * 3


@pytest.mark.parametrize("absent", [1, 2])
def test_monitored_barrier_names_the_rank_that_did_not_arrive(rank_pools: Pools, absent: int) -> None:
    results = rank_pools(3).run(monitored, absent, timeout=90)
    for rank, got in enumerate(results):
        if rank == absent:
            assert got == {"absent": True}
            continue
        assert got["peers"] == [absent], got
        assert f"rank(s) {absent} did not arrive within 1 s" in got["message"]
        assert 0.9 < got["seconds"] < 8.0, got


# -- recv from any source -------------------------------------------------------------------------


def serve_any_source(ctx: RankContext) -> dict[str, Any]:
    """Rank 0 serves the others as a torch user would write it: ``src = recv(t)`` (no src), then
    an answer to ``src``. Every other rank sends two requests on tag 7 and one on tag 9, which
    rank 0 takes with ``batch_isend_irecv`` of ``irecv``s with ``peer=None``."""
    with ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="tcp", timeout=ctx.timeout) as group:
        if ctx.rank != 0:
            for k in range(2):
                group.send(torch.tensor([ctx.rank * 10.0 + k]), 0, tag=7)
            group.send(torch.tensor([ctx.rank * 100.0]), 0, tag=9)
            answers = [torch.empty(1) for _ in range(2)]
            assert [group.recv(a, 0, tag=8) for a in answers] == [0, 0]  # a named src is returned too
            return {"answers": [a.item() for a in answers]}
        served = []
        for _ in range(2 * (ctx.size - 1)):
            request = torch.empty(1)
            src = group.recv(request, tag=7)
            served.append((src, request.item()))
            group.send(request * -1, src, tag=8)
        bufs = [torch.empty(1) for _ in range(ctx.size - 1)]
        works = group.batch_isend_irecv([P2POp(group.irecv, b, None, 9) for b in bufs])
        batched = [(w.result(), b.item()) for w, b in zip(works, bufs, strict=True)]
        return {"served": served, "batched": batched}


@pytest.mark.parametrize("world_size", [3, 4])
def test_recv_from_any_source_sees_each_sender_in_its_order(rank_pools: Pools, world_size: int) -> None:
    results = rank_pools(world_size).run(serve_any_source, timeout=120)
    served, batched = results[0]["served"], results[0]["batched"]
    senders = range(1, world_size)
    assert sorted(src for src, _ in served) == sorted([*senders, *senders])
    for r in senders:
        assert [v for src, v in served if src == r] == [r * 10.0, r * 10.0 + 1]  # each sender in its order
        assert results[r]["answers"] == [-(r * 10.0), -(r * 10.0 + 1)]  # answered at the rank recv returned
    assert sorted(batched) == [(r, r * 100.0) for r in senders]  # each sender once


def any_source_on_gloo(ctx: RankContext) -> str | None:
    """pg-gloo does not declare receiving from any source: refused locally, and nothing was taken."""
    with ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="gloo", timeout=ctx.timeout) as group:
        if ctx.rank != 0:
            group.send(torch.tensor([float(ctx.rank)]), 0, tag=7)
            return None
        t = torch.empty(1)
        with pytest.raises(NotSupportedError) as refused:
            group.recv(t, tag=7)
        assert not group.supports("recv_anysource")
        got = []
        for src in range(1, ctx.size):  # every message is still there for the receives that name their senders
            assert group.recv(t, src, tag=7) == src
            got.append(t.item())
        assert got == [float(r) for r in range(1, ctx.size)]
        return str(refused.value)


@pytest.mark.requires_backend("gloo")
def test_recv_from_any_source_on_a_backend_without_it_is_refused_locally(rank_pools: Pools) -> None:
    message = rank_pools(3).run(any_source_on_gloo, timeout=120)[0]
    assert message is not None and "backend 'gloo' on cpu does not declare 'recv_anysource'" in message
    assert "src=RANK" in message and "tcp" in message  # what to do instead: name the sender, or use pg-tcp


# -- torch's global ranks ------------------------------------------------------------------------


def test_a_global_src_on_an_adapted_group_is_refused_saying_to_use_group_src() -> None:
    """``dist.broadcast(t, src=0, group=g.to_torch())``: torch translates the global ``src``
    through its default group's tables, which hold no pg-core group, and names the group in its
    error; the adapter's name for itself says what to do instead."""
    with ProcessGroup(HashStore(), rank=0, size=1, backends="tcp", timeout=10) as group:
        torch_group = group.to_torch()
        t = torch.ones(2)
        for call in (
            lambda: dist.broadcast(t, src=0, group=torch_group),
            lambda: dist.send(t, dst=0, group=torch_group),
        ):
            with pytest.raises(ValueError, match="is not registered") as refused:
                call()
            message = str(refused.value)
            assert "pg-core group 'world'" in message, message
            assert (
                "group_src=/group_dst=" in message
                and "to_torch(register=True)" in message
                and "group.broadcast(t, src)" in message
            ), message
        dist.broadcast(t, group=torch_group, group_src=0)  # what the message says works
        assert not dist.is_initialized()
