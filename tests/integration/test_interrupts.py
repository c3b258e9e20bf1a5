"""Ctrl-C and ``abort()`` reach a rank blocked in a receive, on pg-tcp and pg-mpi (pg-gloo's
own waits are tested in ``backends/gloo/tests/test_gloo_faults.py``): rank 1 sends rank 0
SIGINT, or calls ``abort()`` on its own group from another thread, while rank 0 waits for a
message from rank 1 that never comes; rank 0 gets ``KeyboardInterrupt`` (or, after its abort,
``GroupClosedError``) within a second, not at the operation's 30 s timeout."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import pytest
import torch
from pg_core import GroupClosedError, ProcessGroup
from pg_core.store import wait_for
from pg_core.testing.pool import RankContext, RankPool

Pools = Callable[[int], RankPool]
PoolFor = Callable[..., RankPool]  # the pool_for fixture (tests/integration/conftest.py)

BACKENDS = [
    pytest.param("tcp", marks=pytest.mark.requires_backend("tcp")),
    pytest.param("mpi", marks=pytest.mark.requires_backend("mpi")),
]


def interrupted(ctx: RankContext, backend: str, how: str) -> float | None:
    """Rank 0's seconds from the interruption to its exception; rank 1 interrupts."""
    r = ctx.rank
    with ProcessGroup(ctx.store, r, ctx.size, backends=backend, name=f"interrupt-{how}", timeout=30) as g:
        g.barrier()  # formed and connected
        if r == 1:
            ctx.store.wait(["blocked"])
            ctx.store.set("at", repr(time.monotonic()))  # one host: both ranks read one monotonic clock
            if how == "ctrl_c":
                os.kill(int(ctx.store.get("pid")), signal.SIGINT)
            ctx.store.wait(["done"])
            return None
        ctx.store.set("pid", str(os.getpid()))
        # abort: this rank's own, from another thread, once rank 1 says "now"
        # (polled: a blocking store wait would hold the store client that the main thread uses too)
        aborter = threading.Thread(target=lambda: (wait_for(ctx.store, ["at"], 30), g.abort()))
        # "blocked" is said once the receive is under way (the flight recorder has it started), by a
        # thread of its own: said before the call, a SIGINT could land before the receive began
        announcer = threading.Thread(target=_announce_once_receiving, args=(g, ctx))
        try:
            if how == "abort":
                aborter.start()
            announcer.start()
            expected = GroupClosedError if how == "abort" else KeyboardInterrupt
            with pytest.raises(expected):
                g.recv(torch.empty(4), src=1)
            took = time.monotonic() - float(ctx.store.get("at"))
        finally:
            announcer.join()
            if aborter.ident is not None:
                aborter.join()
            ctx.store.set("done", "1")
        g.abort()
        return took


def _announce_once_receiving(g: ProcessGroup, ctx: RankContext) -> None:
    """Set "blocked" once ``g``'s flight recorder shows this rank's receive started (at most 30 s)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if any(e["op"] == "recv" and e["state"] == "started" for e in g.debug_state()["entries"]):
            ctx.store.set("blocked", "1")
            return
        time.sleep(0.001)
    raise AssertionError("rank 0's receive never showed as started in its flight recorder")


@pytest.mark.parametrize("how", ["ctrl_c", "abort"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_blocked_receive_is_interrupted_within_a_second(backend: str, how: str, pool_for: PoolFor) -> None:
    took, _ = pool_for(backend).run(interrupted, backend, how, timeout=90)
    assert took is not None and took < 1.0, took
