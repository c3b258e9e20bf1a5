"""A soak: 4 ranks in 3 groups at once (a pg-tcp world, a pg-gloo world, and pg-tcp pairs
formed from the first), mixed collectives, point to point and objects, blocking and
asynchronous, with the pairs and the pg-gloo group torn down and formed again every round,
for ``PG_CORE_SOAK_SECONDS`` (default 60: what ``make test`` runs; set it higher to soak
longer). Every result is checked exactly (small integers in float32); after the first rounds
no rank may grow in threads, file descriptors or resident memory beyond the tolerances
below, and the pool checks that nothing is left once the groups are shut down."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch
from pg_core import ProcessGroup, ReduceOp
from pg_core.testing.pool import RankContext, RankPool

pytestmark = [pytest.mark.requires_backend("tcp"), pytest.mark.requires_backend("gloo")]

SECONDS = float(os.environ.get("PG_CORE_SOAK_SECONDS", "60"))
#: growth allowed past the baseline (taken after the warm-up rounds)
THREADS_TOLERANCE = 2
FDS_TOLERANCE = 8
RSS_TOLERANCE_MB = 64.0
WARM_UP_ROUNDS = 3


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _round(world: ProcessGroup, ctx: RankContext, n: int) -> None:
    """One round of mixed work; raises AssertionError on any wrong value."""
    r, size = ctx.rank, ctx.size
    total = size * (size - 1) / 2  # the sum of the ranks

    t = torch.full((1000,), float(r + n))
    world.all_reduce(t)
    assert torch.equal(t, torch.full((1000,), total + size * n)), (n, t[:3])

    outs = [torch.empty(3) for _ in range(size)]
    work = world.all_gather(outs, torch.full((3,), float(r * n)), async_op=True)
    assert work is not None
    b = torch.full((5,), float(r))
    world.broadcast(b, src=n % size)
    work.wait()
    assert [o[0].item() for o in outs] == [float(q * n) for q in range(size)]
    assert torch.equal(b, torch.full((5,), float(n % size)))

    rs = torch.empty(2)
    world.reduce_scatter_tensor(rs, torch.full((2 * size,), float(n)), op=ReduceOp.MAX)
    assert torch.equal(rs, torch.full((2,), float(n)))

    # the pairs: formed, used and shut down every round
    mine = [0, 1] if r < 2 else [2, 3]
    with world.new_group(mine) as pair:
        peer = 1 - pair.rank
        got = torch.empty(64)
        if pair.rank == 0:
            pair.send(torch.full((64,), float(n)), dst=peer, tag=n)
            pair.recv(got, src=peer, tag=n)
        else:
            pair.recv(got, src=peer, tag=n)
            pair.send(got + 1, dst=peer, tag=n)
        assert torch.equal(got, torch.full((64,), float(n + 1 - pair.rank)))
        said = pair.all_gather_object({"rank": r, "round": n})
        assert said == [{"rank": q, "round": n} for q in mine]

    # a pg-gloo group over all four: formed, used and shut down every round
    with ProcessGroup(ctx.store, r, size, backends="gloo", name="soak-gloo", timeout=ctx.timeout) as gloo:
        g = torch.full((17,), float(r))
        gloo.all_reduce(g)
        assert torch.equal(g, torch.full((17,), total))
        gathered = torch.empty(size * 2)
        gloo.all_gather_into_tensor(gathered, torch.full((2,), float(r + n)))
        assert gathered.tolist() == [float(q + n) for q in range(size) for _ in range(2)]


def soak(ctx: RankContext, seconds: float) -> dict[str, Any]:
    r = ctx.rank
    with ProcessGroup(ctx.store, r, ctx.size, backends="tcp", name="soak", timeout=ctx.timeout) as world:
        n, base = 0, None
        deadline = time.monotonic() + seconds
        while True:
            # rank 0's clock decides for everyone: every rank runs the same number of rounds
            go = torch.tensor([float(time.monotonic() < deadline or n < WARM_UP_ROUNDS + 2)])
            world.broadcast(go, src=0)
            if not go.item():
                break
            _round(world, ctx, n)
            n += 1
            if n == WARM_UP_ROUNDS:
                base = (threading.active_count(), _fds(), _rss_mb())
        assert base is not None
        end = (threading.active_count(), _fds(), _rss_mb())
        grew = (end[0] - base[0], end[1] - base[1], end[2] - base[2])
        assert grew[0] <= THREADS_TOLERANCE and grew[1] <= FDS_TOLERANCE and grew[2] <= RSS_TOLERANCE_MB, (
            f"rank {r} grew by {grew[0]} threads, {grew[1]} descriptors, {grew[2]:.1f} MB over {n} rounds"
        )
        return {"rounds": n, "grew": grew}


def test_soak_mixed_groups_teardown_and_reform(rank_pools: Any) -> None:
    pool: RankPool = rank_pools(4)
    results = pool.run(soak, SECONDS, timeout=SECONDS + 120)
    rounds = {res["rounds"] for res in results}
    assert len(rounds) == 1 and rounds.pop() >= WARM_UP_ROUNDS + 2, results
