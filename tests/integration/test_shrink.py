"""``group.shrink()``: after a rank is SIGKILLed in the middle of a collective, the survivors
get a pg-core error (not a hang), agree through the store on who is gone, and go on in a group
of the survivors, with their order kept and ``parent_ranks`` mapping back; a rank the
survivors left out is told so; members that differ in check mode cannot form one group."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from pg_core import CollectiveMismatchError, PeerFailureError, PGError, ProcessGroup
from pg_core.testing.pool import RankContext, RankPool

BACKENDS = [
    pytest.param("tcp", marks=pytest.mark.requires_backend("tcp")),
    pytest.param("gloo", marks=pytest.mark.requires_backend("gloo")),
]


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    """Its own three ranks: a test that kills one makes the pool start afresh, which the
    session's shared pools need not pay for."""
    pool = RankPool(3)
    yield pool
    pool.close()


def die_in_all_reduce(ctx: RankContext, backend: str) -> dict[str, Any] | None:
    """Rank 1 dies (SIGKILL) once ranks 0 and 2 are on their way into an all_reduce; they
    raise, shrink to a group of two, and all_reduce in it."""
    r = ctx.rank
    g = ProcessGroup(ctx.store, r, ctx.size, backends=backend, timeout=30)
    g.all_reduce(torch.ones(4))  # every connection the ring needs is made: the death is mid-run
    if r == 1:
        ctx.store.wait(["entering/0", "entering/2"])
        os.kill(os.getpid(), signal.SIGKILL)
    ctx.store.set(f"entering/{r}", "1")
    started = time.monotonic()
    try:
        g.all_reduce(torch.ones(1 << 16))
    except PGError as exc:
        failed = type(exc).__name__, time.monotonic() - started
    else:
        raise AssertionError(f"rank {r}: all_reduce with a dead rank 1 returned")
    new = g.shrink()
    g.abort()
    with new:
        t = torch.full((3,), float(r))
        new.all_reduce(t)
        return {
            "error": failed[0],
            "seconds": failed[1],
            "rank": new.rank,
            "size": new.size,
            "name": new.name,
            "parent_ranks": new.parent_ranks,
            "sum": t.tolist(),
        }


@pytest.mark.parametrize("backend", BACKENDS)
def test_survivors_of_a_killed_rank_raise_and_shrink(pool: RankPool, backend: str) -> None:
    results = pool.run(die_in_all_reduce, backend, timeout=90, may_exit=[1])
    assert results[1] is None
    for r, new_rank in ((0, 0), (2, 1)):
        got = results[r]
        assert got["seconds"] < 5.0, got  # a dead peer is an error within seconds, not at the 30 s timeout
        assert got["rank"] == new_rank and got["size"] == 2 and got["name"] == "world"
        assert got["parent_ranks"] == (0, 2)
        assert got["sum"] == [2.0, 2.0, 2.0]  # ranks 0 and 2 of the old group


def told_to_shrink(ctx: RankContext, excluded_arrives: bool) -> Any:
    """Everyone alive; ranks 0 and 1 shrink without rank 2 (``exclude``). Rank 2 reaches shrink
    only after they decided, and is told it was left out."""
    r = ctx.rank
    with ProcessGroup(ctx.store, r, ctx.size, backends="tcp", name="told", timeout=20) as g:
        if r == 2:
            ctx.store.wait(["decided"])
            if not excluded_arrives:
                return None
            with pytest.raises(PeerFailureError, match="went on without rank 2"):
                g.shrink()
            return "told"
        new = g.shrink(exclude=[2])
        ctx.store.set("decided", "1")
        with new:
            return (new.rank, new.size, new.parent_ranks)


def test_shrink_excludes_the_named_ranks_and_tells_a_late_one(rank_pools: Any) -> None:
    results = rank_pools(3).run(told_to_shrink, True, timeout=60)
    assert results == [(0, 2, (0, 1)), (1, 2, (0, 1)), "told"]


def exclude_out_of_range(ctx: RankContext) -> str:
    with ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="tcp", name="bad-exclude", timeout=10) as g:
        with pytest.raises(ValueError, match="exclude"):
            g.shrink(exclude=[5])
        return "ok"


def test_shrink_rejects_a_rank_outside_the_group(rank_pools: Any) -> None:
    assert rank_pools(2).run(exclude_out_of_range, timeout=60) == ["ok", "ok"]


def check_differs(ctx: RankContext) -> str:
    r = ctx.rank
    try:
        g = ProcessGroup(ctx.store, r, ctx.size, backends="tcp", name="half-checked", timeout=10, check=(r == 0))
    except CollectiveMismatchError as exc:
        ctx.store.set(f"tried/{r}", "1")
        return str(exc)
    # formed first: the other member is the one that differs. It must have met this formation
    # before this one aborts it (an aborted generation is skipped by later arrivals).
    ctx.store.set(f"tried/{r}", "1")
    ctx.store.wait([f"tried/{1 - r}"])
    g.abort()
    return "formed"


def test_members_that_differ_in_check_mode_do_not_form(rank_pools: Any) -> None:
    """The first member's formation record holds its check mode; the other member, which
    differs, raises at once and closes the generation, instead of meeting it in the first
    collective (where the checked rank would wait for a fingerprint that never comes)."""
    results = rank_pools(2).run(check_differs, timeout=60)
    assert sorted(x == "formed" for x in results) == [False, True], results
    refused = next(x for x in results if x != "formed")
    assert "rank 0 has check mode on and rank 1 has it off" in refused, results
