"""pg-shm's drainer holds at most ``max_unexpected_bytes`` of messages its member has not
received yet: past that it leaves them in the ring, and a send that then finds no room waits
for its receiver and fails at its timeout, naming the option."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from pg_core import ProcessGroup
from pg_core.errors import CollectiveTimeout
from pg_core.store import wait_for
from pg_core.testing.pool import RankContext, RankPool

pytestmark = pytest.mark.requires_backend("shm")

Pools = Callable[[int], RankPool]


def flooded_receiver(ctx: RankContext) -> dict[str, Any]:
    """Rank 0 sends 1 MiB messages to rank 1, which receives none until rank 0 is done: with a
    2 MiB budget the drainer moves two out of the ring, the ring holds one more, and the next
    send waits for the receiver and fails at its timeout, saying why. Then rank 1 receives
    what was sent, exact."""
    mib = 1 << 20
    options = {"shm": {"max_unexpected_bytes": 2 * mib}}
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="shm", timeout=60, options=options)
    group.barrier()
    n = mib // 4
    out: dict[str, Any] = {}
    if ctx.rank == 0:
        sent, started = 0, time.monotonic()
        try:
            for i in range(6):
                group.send(torch.full((n,), float(i)), 1, timeout=3.0)
                sent += 1
        except CollectiveTimeout as exc:
            out["raised"] = str(exc)
        out["sent"], out["seconds"] = sent, time.monotonic() - started
        ctx.store.set("sent", str(sent))
    else:
        wait_for(ctx.store, ["sent"], 60)
        sent = int(ctx.store.get("sent"))
        got = torch.empty(n)
        out["right"] = []
        for i in range(sent):
            group.recv(got, 0)
            out["right"].append(bool(torch.equal(got, torch.full((n,), float(i)))))
    group.barrier()
    group.shutdown()
    return out


def test_the_drainer_holds_at_most_its_budget_and_a_send_past_it_fails_clearly(rank_pools: Pools) -> None:
    got = rank_pools(2).run(flooded_receiver, timeout=120)
    sender, receiver = got
    assert sender["sent"] == 3, got  # two drained within the budget, one in the ring
    assert "max_unexpected_bytes" in sender.get("raised", ""), got
    assert sender["seconds"] < 10, got
    assert receiver["right"] == [True, True, True], got
