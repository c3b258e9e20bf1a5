"""pg-mpi's promises where MPI itself promises little, across real processes under ``mpiexec``:
a rank that starts late holds nobody past the group's timeout (MPICH's ``MPI_Init`` waits for
every rank of the job), a collective given up on after its timeout is never completed by a
rank that comes to it late (MPI cannot cancel a collective, and matches them by order alone),
point to point holds no copies for receivers that are slow (an ``isend`` sends from the tensor
itself, and a blocking send above the eager limit waits for its receiver),
and a rank that aborts tells the others, whose operations that need it raise
``PeerFailureError`` ("rank 1 aborted") at once instead of at their timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import pytest
import torch
from pg_core import ProcessGroup
from pg_core.errors import CollectiveTimeout, PeerFailureError
from pg_core.launchers import launch_command
from pg_core.store import wait_for
from pg_core.testing.pool import RankContext, RankPool

if TYPE_CHECKING:
    from pg_mpi.backend import MPIBackend

pytestmark = pytest.mark.requires_backend("mpi")

Pools = Callable[[int], RankPool]

MiB = 1 << 20


# -- start-up: MPI_Init waits for every rank of the job; pg-mpi waits for it only until the timeout ----

LATE_START = r"""
import json, os, sys, time
from datetime import timedelta
import torch
from pg_core import ProcessGroup
from pg_core.store import wait_for
from torch.distributed import TCPStore
rank, timeout = int(os.environ["PMI_RANK"]), float(sys.argv[2])
store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=60))
if rank == 2:  # starts (and so initialises MPI) only once the others have given up on it
    wait_for(store, ["done/0", "done/1"], 60)
start = time.monotonic()
try:
    ProcessGroup(store, rank, 3, backends="mpi", timeout=timeout).all_reduce(torch.ones(1))
    out = {"rank": rank, "error": None}
except Exception as exc:
    out = {"rank": rank, "error": type(exc).__name__, "text": " ".join(str(exc).split())}
out["seconds"] = time.monotonic() - start
store.set(f"done/{rank}", "1")
print("RESULT", json.dumps(out), flush=True)
wait_for(store, ["done/2"], 60)  # (a rank leaving while its MPI_Init still runs would end the job)
"""


@pytest.mark.timeout(180)
def test_a_rank_that_starts_late_holds_the_others_no_longer_than_their_timeout() -> None:
    """Rank 2 of 3 calls MPI_Init only after ranks 0 and 1 have raised: without a bound, their
    first operation would wait inside MPI_Init for as long as rank 2 takes."""
    from torch.distributed import TCPStore

    timeout = 3.0
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    job = subprocess.run(
        launch_command("mpiexec", 3, [sys.executable, "-c", LATE_START, str(store.port), str(timeout)]),
        capture_output=True,
        text=True,
        timeout=150,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    results = {
        r["rank"]: r
        for r in (json.loads(line.split(" ", 1)[1]) for line in job.stdout.splitlines() if line.startswith("RESULT"))
    }
    assert sorted(results) == [0, 1, 2], (job.stdout, job.stderr)
    for rank in (0, 1):
        got = results[rank]
        assert got["error"] == "CollectiveTimeout", got
        # (the core sees in the store that rank 2 never joined, and says so in place of pg-mpi's
        # "MPI_Init has not returned ...: MPICH's MPI_Init waits until every rank ... has called it")
        assert "rank 2 of 3 never joined" in got["text"], got
        assert timeout - 0.1 <= got["seconds"] <= timeout + 2.0, got
    assert results[2]["error"] == "CollectiveTimeout", results[2]  # the others never set their world ranks
    assert job.returncode == 0, job.stderr


# -- a collective given up on is never completed against ---------------------------------------------


def late_rank(ctx: RankContext) -> dict[str, Any]:
    """Ranks 0 and 1 time out in an all_reduce (the prepared form: the group's second) that
    rank 2 calls only afterwards; rank 2's call must not complete against theirs, nothing is
    written into their tensors after their timeout, and new groups of the same processes work."""
    out: dict[str, Any] = {}
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="mpi", timeout=1.5, name="given-up")
    first = torch.ones(2)
    group.all_reduce(first)  # all three: the next call of this kind is the prepared one
    mine = torch.full((2,), float(ctx.rank + 1))
    if ctx.rank < 2:
        try:
            group.all_reduce(mine)
        except CollectiveTimeout:
            out["timed_out"] = True
        # (what MPI's algorithm wrote before the timeout, the two ranks' partial sum, stays: the
        # tensor's contents are undefined after a timeout, but nothing is written afterwards)
        at_timeout = mine.tolist()
        ctx.store.set(f"gave-up/{ctx.rank}", "1")
        wait_for(ctx.store, ["late-done"], 60)
        out["untouched"] = mine.tolist() == at_timeout
    else:
        wait_for(ctx.store, ["gave-up/0", "gave-up/1"], 60)
        start = time.monotonic()
        try:
            group.all_reduce(mine)
            out["completed"] = mine.tolist()
        except CollectiveTimeout as exc:
            out["refused"] = " ".join(str(exc).split())
            out["peers"] = list(exc.peers)
        out["seconds"] = time.monotonic() - start
        ctx.store.set("late-done", "1")
    group.abort()
    with ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="mpi", timeout=30, name="after") as again:
        t = torch.full((2,), float(ctx.rank + 1))
        again.all_reduce(t)
        out["new_group"] = t.tolist()
        if ctx.rank < 2:
            pair = again.new_group([0, 1])
            assert pair is not None
            p = torch.ones(1)
            pair.all_reduce(p)
            out["pair"] = p.item()
            pair.shutdown()
        again.barrier()
    return out


def test_a_collective_others_gave_up_on_is_refused_to_the_rank_that_comes_late(pools: Pools) -> None:
    r0, r1, r2 = pools(3).run(late_rank, timeout=120)
    for r in (r0, r1):
        assert r == {"timed_out": True, "untouched": True, "new_group": [6.0, 6.0], "pair": 2.0}, r
    assert "completed" not in r2, r2
    assert "gave up on this group's collective #2" in r2["refused"] and r2["peers"] == [0, 1], r2
    assert r2["seconds"] < 1.0 and r2["new_group"] == [6.0, 6.0], r2


# -- flow control: what a slow receiver costs the sender -----------------------------------------------


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def slow_receiver(ctx: RankContext, count: int) -> dict[str, Any]:
    """Rank 0 sends ``count`` x 64 MiB to rank 1, which receives only once told: first as
    ``isend``\\ s of one tensor (sent from the tensor itself: none done before rank 1 receives,
    nothing copied), then as blocking ``send``\\ s (above the eager limit: each waits until rank 1
    has posted its receive, nothing copied). Rank 1 posts each of those receives a moment after
    rank 0 says it is sending, and says when."""
    size = 64 * MiB
    with ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="mpi", timeout=60) as group:
        group.barrier()  # the backend and MPI's shared memory are set up
        if ctx.rank == 1:
            got = torch.empty(size, dtype=torch.uint8)
            sums, posted_at = [], []
            wait_for(ctx.store, ["posted"], 120)
            for _ in range(count):
                group.recv(got, 0)
                sums.append(int(got[:: 1 << 16].sum()))
            for i in range(count):
                wait_for(ctx.store, [f"sending/{i}"], 120)
                time.sleep(0.1)  # (what is measured: rank 0's send returns only after this receive is posted)
                posted_at.append(time.monotonic())
                group.recv(got, 0)
                sums.append(int(got[:: 1 << 16].sum()))
            group.barrier()
            return {"sums": sums, "posted_at": posted_at}
        backend = cast("MPIBackend", group._dispatch.instance(torch.device("cpu")).backend)
        data = torch.full((size,), 3, dtype=torch.uint8)
        before = _rss()
        works = [group.isend(data, 1) for _ in range(count)]
        posted = _rss()
        done_at_once = sum(w.is_completed() for w in works)
        ctx.store.set("posted", "1")
        for w in works:
            w.wait()
        out: dict[str, Any] = {"isend_growth": posted - before, "done_at_once": done_at_once}
        before, peak, returned_at = _rss(), 0, []
        for i in range(count):
            ctx.store.set(f"sending/{i}", "1")
            group.send(data, 1)
            returned_at.append(time.monotonic())
            peak = max(peak, _rss())
        out.update(send_growth=peak - before, copied=backend._copied, returned_at=returned_at)
        group.barrier()
        return out


@pytest.mark.timeout(300)
def test_sends_above_the_eager_limit_wait_for_the_receiver_and_copy_nothing(pools: Pools) -> None:
    """64 MiB messages to a receiver that takes them only later: the isends are sent from the
    tensor (none done before it is received, no memory grows), and a blocking send above pg-mpi's
    eager limit returns only once its receiver has posted the receive, copying nothing."""
    count = 4
    sender, receiver = pools(2).run(slow_receiver, count, timeout=240)
    assert receiver["sums"] == [3 * 1024] * (2 * count)
    assert sender["done_at_once"] == 0, sender
    assert sender["isend_growth"] <= 16 * MiB, sender
    assert sender["send_growth"] <= 16 * MiB and sender["copied"] == 0, sender
    for returned, posted in zip(sender["returned_at"], receiver["posted_at"], strict=True):
        assert returned >= posted, (sender, receiver)


# -- a rank that aborts tells the others -----------------------------------------------------------------


def _failure(exc: PeerFailureError, at: float) -> dict[str, Any]:
    return {"text": " ".join(str(exc).split()), "peers": list(exc.peers), "after": time.monotonic() - at}


def aborting_rank(ctx: RankContext) -> dict[str, Any]:
    """Rank 1 aborts while rank 0 is blocked in a recv from it (with an irecv from rank 2
    posted before) and rank 2 is in an all_reduce: both raise ``PeerFailureError`` naming rank
    1; rank 0's receive from rank 2 is left alone and completes once rank 2 sends, nothing is
    written into the withdrawn receive's tensor, and later operations that need rank 1 are
    refused at once. The group's timeout (30 s) is far beyond what the test allows (2 s)."""
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="mpi", timeout=30, name="abort-notice")
    out: dict[str, Any] = {}
    group.barrier()  # formed
    if ctx.rank == 1:
        wait_for(ctx.store, ["blocked/0", "blocked/2"], 60)
        ctx.store.set("at", repr(time.monotonic()))  # one host: every rank reads one monotonic clock
        group.abort()
        wait_for(ctx.store, ["done/0", "done/2"], 60)
        return out
    try:
        if ctx.rank == 0:
            from_two = torch.zeros(4)
            work = group.irecv(from_two, src=2)
            from_one = torch.full((4,), -1.0)
            ctx.store.set("blocked/0", "1")
            try:
                group.recv(from_one, src=1)
                out["received"] = from_one.tolist()
            except PeerFailureError as exc:
                out["recv"] = _failure(exc, float(ctx.store.get("at")))
            ctx.store.set("send-now", "1")
            work.wait()
            out["from_two"] = from_two.tolist()
            out["untouched"] = from_one.tolist() == [-1.0] * 4
            start = time.monotonic()
            try:
                group.send(torch.ones(1), 1)
                out["later_send"] = "sent"
            except PeerFailureError as exc:
                out["later_send"] = {"text": " ".join(str(exc).split()), "peers": list(exc.peers)}
            out["later_seconds"] = time.monotonic() - start
        else:
            ctx.store.set("blocked/2", "1")
            try:
                group.all_reduce(torch.ones(4))
                out["reduced"] = True
            except PeerFailureError as exc:
                out["all_reduce"] = _failure(exc, float(ctx.store.get("at")))
            wait_for(ctx.store, ["send-now"], 60)
            group.send(torch.full((4,), 7.0), 0)
        group.shutdown()
    finally:
        ctx.store.set(f"done/{ctx.rank}", "1")
    return out


def test_a_rank_that_aborts_is_named_by_the_peers_that_wait_for_it(pools: Pools) -> None:
    r0, _, r2 = pools(3).run(aborting_rank, timeout=120)
    for got in (r0.get("recv"), r2.get("all_reduce")):
        assert got is not None, (r0, r2)
        assert "rank 1 aborted" in got["text"] and got["peers"] == [1], got
        assert got["after"] < 2.0, got
    assert r0["recv"]["text"].startswith("recv from rank 1"), r0
    assert r2["all_reduce"]["text"].startswith("all_reduce"), r2
    assert r0["from_two"] == [7.0] * 4 and r0["untouched"], r0
    later = r0["later_send"]
    assert isinstance(later, dict) and "rank 1 aborted" in later["text"] and later["peers"] == [1], r0
    assert r0["later_seconds"] < 0.5, r0
