"""What torch.distributed users reach for, as methods of the group: ``monitored_barrier``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from pg_core import ProcessGroup
from pg_core.errors import CollectiveTimeout
from pg_core.store import wait_for
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
