"""Check mode across real processes, on every in-repo cpu backend (pg-mpi's ranks started by
``mpiexec``): with ``check=True`` a collective whose size, dtype (float32 against int32, the
same byte count), root or reduce op differs between ranks raises ``CollectiveMismatchError``
on every rank, naming both sides, where pg-gloo alone aborts the process and pg-mpi alone
returns wrong results; matching programs give the right results, and no process dies."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from pg_core import CollectiveMismatchError, ProcessGroup, ReduceOp
from pg_core.testing.pool import RankContext, RankPool

Pools = Callable[[int], RankPool]
PoolFor = Callable[..., RankPool]  # the pool_for fixture (tests/integration/conftest.py)

BACKENDS = [
    pytest.param("tcp", marks=pytest.mark.requires_backend("tcp")),
    pytest.param("gloo", marks=pytest.mark.requires_backend("gloo")),
    pytest.param("mpi", marks=pytest.mark.requires_backend("mpi")),
]


def pid(ctx: RankContext) -> int:
    return os.getpid()


def matching(ctx: RankContext, backend: str) -> dict[str, Any]:
    """A program every rank calls alike, in check mode: its results."""
    r = ctx.rank
    with ProcessGroup(ctx.store, r, ctx.size, backends=backend, name="matching", timeout=ctx.timeout, check=True) as g:
        out: dict[str, Any] = {"check": g.check}
        t = torch.full((4,), float(r + 1))
        for _ in range(2):  # twice: the blocking all_reduce's fast path keeps checking
            g.all_reduce(t)
        out["all_reduce"] = t.tolist()
        b = torch.full((3,), float(r))
        g.broadcast(b, src=1)
        out["broadcast"] = b.tolist()
        m = torch.full((2,), float(r + 1))
        g.all_reduce(m, ReduceOp.MAX)
        out["max"] = m.tolist()
        # uneven splits: rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 3 to rank 0 and 1 to itself
        sends = [[1, 2], [3, 1]][r]
        recvs = [sends_of[r] for sends_of in ([1, 2], [3, 1])]
        inp = torch.full((sum(sends),), float(r))
        got = torch.empty(sum(recvs))
        g.all_to_all_single(got, inp, recvs, sends)
        out["all_to_all_single"] = got.tolist()
        work = g.all_reduce(torch.ones(2), async_op=True)
        assert work is not None
        work.wait()
        g.barrier()
        return out


def async_then_p2p(ctx: RankContext, backend: str) -> list[float]:
    """An asynchronous collective (and coalesced batch) does not wait for the others' check
    before returning: rank 0 starts an all_reduce, then sends rank 1 what rank 1 waits for
    before it calls its own."""
    r = ctx.rank
    with ProcessGroup(ctx.store, r, ctx.size, backends=backend, name="async", timeout=20, check=True) as g:
        g.barrier()  # the backend exists now: where it launches, an asynchronous call is launched at once
        t = torch.full((2,), float(r + 1))
        if r == 0:
            work = g.all_reduce(t, async_op=True)
            g.send(torch.ones(1), dst=1)
            assert work is not None
            work.wait()
        else:
            g.recv(torch.empty(1), src=0)
            g.all_reduce(t)
        u = torch.full((2,), float(r + 1))
        if r == 0:  # the same with an asynchronous coalesced batch
            with g.coalescing(async_op=True) as batch:
                g.all_reduce(u)
                g.all_reduce(torch.ones(1))
            g.send(torch.ones(1), dst=1)
            batch.wait()
        else:
            g.recv(torch.empty(1), src=0)
            with g.coalescing():
                g.all_reduce(u)
                g.all_reduce(torch.ones(1))
        return t.tolist() + u.tolist()


#: per case, what rank 0 and rank 1 call
CASES: dict[str, tuple[Callable[[ProcessGroup], object], Callable[[ProcessGroup], object]]] = {
    "size": (lambda g: g.all_reduce(torch.zeros(4)), lambda g: g.all_reduce(torch.zeros(8))),
    "dtype": (lambda g: g.all_reduce(torch.zeros(4)), lambda g: g.all_reduce(torch.zeros(4, dtype=torch.int32))),
    "root": (lambda g: g.broadcast(torch.zeros(4), src=0), lambda g: g.broadcast(torch.zeros(4), src=1)),
    "reduce_op": (lambda g: g.all_reduce(torch.zeros(4)), lambda g: g.all_reduce(torch.zeros(4), ReduceOp.MAX)),
}


def mismatching(ctx: RankContext, backend: str, case: str) -> dict[str, Any]:
    """Rank 0 and rank 1 call different collectives, in check mode: what each raises, then
    what the group's next collective raises."""
    r = ctx.rank
    g = ProcessGroup(ctx.store, r, ctx.size, backends=backend, name=f"mismatch-{case}", timeout=ctx.timeout, check=True)
    try:
        g.all_reduce(torch.ones(1))  # a matching collective first: the mismatch is #2
        out: dict[str, Any] = {}
        try:
            CASES[case][r](g)
        except CollectiveMismatchError as exc:
            out["error"] = (str(exc), exc.peers)
        else:
            out["error"] = None
        try:
            g.all_reduce(torch.ones(1))
        except CollectiveMismatchError as exc:
            out["after"] = str(exc)
        return out
    finally:
        g.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_matching_programs_give_the_right_results_in_check_mode(pool_for: PoolFor, backend: str) -> None:
    results = pool_for(backend).run(matching, backend, timeout=120)
    for out in results:
        assert out["check"] is True
        assert out["all_reduce"] == [6.0] * 4  # 1 + 2, then 3 + 3
        assert out["broadcast"] == [1.0] * 3
        assert out["max"] == [2.0] * 2
    assert results[0]["all_to_all_single"] == [0.0, 1.0, 1.0, 1.0]
    assert results[1]["all_to_all_single"] == [0.0, 0.0, 1.0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_asynchronous_collective_returns_before_the_others_check(pool_for: PoolFor, backend: str) -> None:
    assert pool_for(backend).run(async_then_p2p, backend, timeout=120) == [[3.0] * 4] * 2


#: what each case's error names, per rank's side
SIDES = {
    "size": ("all_reduce #2 float32[4] SUM on cpu", "all_reduce #2 float32[8] SUM on cpu"),
    "dtype": ("all_reduce #2 float32[4] SUM on cpu", "all_reduce #2 int32[4] SUM on cpu"),
    "root": ("broadcast #2 float32[4] root 0 on cpu", "broadcast #2 float32[4] root 1 on cpu"),
    "reduce_op": ("all_reduce #2 float32[4] SUM on cpu", "all_reduce #2 float32[4] MAX on cpu"),
}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_mismatch_raises_on_every_rank_naming_both_sides_and_no_process_dies(pool_for: PoolFor, backend: str) -> None:
    pool = pool_for(backend)
    before = pool.run(pid, timeout=60)
    for case, (side0, side1) in SIDES.items():
        results = pool.run(mismatching, backend, case, timeout=120)
        for rank, out in enumerate(results):
            assert out["error"] is not None, f"{backend} {case}: rank {rank} raised nothing"
            message, peers = out["error"]
            assert f"rank 0: {side0}" in message, message
            assert f"rank 1: {side1}" in message, message
            assert peers == (1 - rank,)
            assert "stopped after" in out["after"]
    assert pool.run(pid, timeout=60) == before  # the same processes: none died (a dead one is respawned)
