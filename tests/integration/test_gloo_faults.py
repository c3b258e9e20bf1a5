"""pg-gloo with a dead peer: one of three ranks is SIGKILLed while the others are in an
all_reduce, blocked in a receive from it, about to send to it, or idle before a collective.
Every survivor raises a pg-core error naming the dead rank within seconds (not at the group's
30 s timeout), stays usable, and forms a group of two with the other survivor on the same store."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from pg_core import PeerFailureError, PGError, ProcessGroup
from pg_core.store import wait_for
from pg_core.testing.pool import RankContext, RankPool

pytestmark = pytest.mark.requires_backend("gloo")


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    """Its own three ranks: each test kills one, and the pool starts afresh after."""
    pool = RankPool(3)
    yield pool
    pool.close()


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has died: every thread of it is a zombie or gone (its leader turns
    zombie before its other threads end, and its sockets close only with the last of them)."""
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    return False
    except (FileNotFoundError, ProcessLookupError):  # the process, or a thread, went while being read
        pass
    return True


def _in_wait(thread: int) -> bool:
    """Whether ``thread`` waits in pg-gloo's wait (its stack is in it)."""
    frame = sys._current_frames().get(thread)
    while frame is not None:
        if frame.f_code.co_name == "_until":
            return True
        frame = frame.f_back
    return False


def _say_ready_once_waiting(ctx: RankContext) -> threading.Thread:
    """Set ``ready/RANK`` once this rank's main thread waits in its call (bounded)."""
    main = threading.main_thread().ident
    assert main is not None

    def watch() -> None:
        deadline = time.monotonic() + 10
        while not _in_wait(main) and time.monotonic() < deadline:
            time.sleep(0.002)
        ctx.store.set(f"ready/{ctx.rank}", "1")

    thread = threading.Thread(target=watch)
    thread.start()
    return thread


def dies(ctx: RankContext, case: str) -> dict[str, Any] | None:
    """Rank 1 dies (SIGKILL) once ranks 0 and 2 are ready: waiting in ``case`` (all_reduce,
    recv), or before it (send, idle: they call it once rank 1's process is gone)."""
    r = ctx.rank
    g = ProcessGroup(ctx.store, r, ctx.size, backends="gloo", timeout=30, name="doomed")
    g.all_reduce(torch.ones(4))  # every connection is up: the death comes mid-run
    if r == 1:
        ctx.store.set("pid/1", str(os.getpid()))
        wait_for(ctx.store, ["ready/0", "ready/2"], 30)
        os.kill(os.getpid(), signal.SIGKILL)
    wait_for(ctx.store, ["pid/1"], 30)
    pid = int(ctx.store.get("pid/1"))
    helper = None
    if case in ("send", "idle"):  # the death happens before the call
        ctx.store.set(f"ready/{r}", "1")
        deadline = time.monotonic() + 10
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.002)
    else:
        helper = _say_ready_once_waiting(ctx)
    started = time.monotonic()
    try:
        if case == "all_reduce":
            g.all_reduce(torch.ones(1 << 16))
        elif case == "recv":
            g.recv(torch.empty(4), 1)
        elif case == "send":
            g.send(torch.ones(256), 1)
        else:
            g.barrier()
    except PGError as exc:
        error = exc
    else:
        raise AssertionError(f"rank {r}: {case} with a dead rank 1 returned")
    seconds = time.monotonic() - started
    if helper is not None:
        helper.join()
    g.abort()
    with ProcessGroup(ctx.store, r // 2, 2, backends="gloo", timeout=30, name="survivors") as new:
        t = torch.full((3,), float(r))
        new.all_reduce(t)
    return {
        "error": type(error).__name__,
        "peers": getattr(error, "peers", None),
        "said": str(error),
        "seconds": seconds,
        "sum": t.tolist(),
    }


@pytest.mark.parametrize("case", ["all_reduce", "recv", "send", "idle"])
def test_survivors_of_a_killed_rank_name_it_and_go_on(pool: RankPool, case: str) -> None:
    results = pool.run(dies, case, timeout=120, may_exit=[1])
    assert results[1] is None
    for r in (0, 2):
        got = results[r]
        assert got["error"] == PeerFailureError.__name__, got
        assert got["peers"] == (1,) and "rank 1 died" in got["said"], got
        assert got["seconds"] < 5.0, got  # not at the group's 30 s timeout
        assert got["sum"] == [2.0, 2.0, 2.0]  # ranks 0 and 2, in a group of their own
