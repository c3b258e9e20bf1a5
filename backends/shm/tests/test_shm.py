"""pg-shm across real processes: a dead peer, an abort and a shutdown seen by the others,
nothing left in /dev/shm, no core burnt while waiting, members on two hosts refused, and
sends up to the eager limit that never wait for their receiver.

The rank functions run in the session's rank pools (``rank_pools``), whose leak check counts
threads, descriptors, children and shared memory mappings after every call.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from pg_core import ProcessGroup
from pg_core.errors import BackendUnavailableError, CollectiveTimeout, PeerFailureError
from pg_core.ops import ReduceOp
from pg_core.store import wait_for
from pg_core.testing.pool import RankContext, RankPool
from pg_shm import plugin, rings
from pg_shm.backend import ShmBackend
from pg_shm.formation import group_prefix
from pg_shm.segment import HOST_ID_ENV

#: pg-shm is an in-repo backend: make test installs it, so a missing one fails, never skips.
pytestmark = pytest.mark.requires_backend("shm")

Pools = Callable[[int], RankPool]


def _segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith("pg-shm-")}


def _left_behind(before: set[str], within: float = 5.0) -> set[str]:
    """pg-shm segments named now that were not ``before`` and stay named for ``within``
    seconds. Other jobs on the machine (pg-shm is the default on one host) name theirs for
    the moment their formation takes; a segment left behind stays."""
    deadline = time.monotonic() + within
    while True:
        new = _segments() - before
        if not new or time.monotonic() > deadline:
            return new
        time.sleep(0.05)  # polling for other jobs' names to go, not synchronising with our ranks


def _backend(group: ProcessGroup) -> ShmBackend:
    backend = group._dispatch.instance(torch.device("cpu")).backend
    assert isinstance(backend, ShmBackend)
    return backend


def killed_peer(ctx: RankContext) -> dict[str, Any]:
    """Rank 1 SIGKILLs itself once formed; rank 0, blocked in a recv, must hear of it."""
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="shm", timeout=60)
    group.barrier()  # formed on both ranks: every segment mapped, every name unlinked
    own = group_prefix(_backend(group).ctx.group_uid)  # (other tests' groups may be forming now)
    named = sorted(name for name in _segments() if name.startswith(own))
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    try:
        group.recv(torch.empty(4), 1)
    except PeerFailureError as exc:
        raised = f"{type(exc).__name__}: {exc}"
    else:
        raised = "nothing"
    seconds = time.monotonic() - started
    group.abort()
    return {"raised": raised, "seconds": seconds, "named_after_formation": named}


def test_a_killed_peer_is_a_peer_failure_within_seconds_and_nothing_is_left(rank_pools: Pools) -> None:
    before = _segments()
    pool = RankPool(2)
    try:
        got = pool.run(killed_peer, timeout=60, may_exit=[1], check_leaks=False)
    finally:
        pool.close()
    survivor = got[0]
    assert survivor["raised"].startswith("PeerFailureError") and "rank 1" in survivor["raised"], survivor
    assert survivor["seconds"] < 5, survivor
    assert not survivor["named_after_formation"]  # nothing of the group stayed named once formed
    assert not _left_behind(before)


def stopped_peer(ctx: RankContext, how: str) -> dict[str, Any]:
    """Rank 1 aborts or shuts down while rank 0 waits for it in a recv and in an all_reduce."""
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="shm", timeout=60)
    group.barrier()
    if ctx.rank == 1:
        wait_for(ctx.store, ["waiting"], 30)
        time.sleep(0.2)  # let rank 0 fall asleep on its futex: the peer's state must wake it
        getattr(group, how)()
        return {}
    ctx.store.set("waiting", "1")
    out: dict[str, Any] = {}
    for op in ("recv", "all_reduce"):
        started = time.monotonic()
        try:
            if op == "recv":
                group.recv(torch.empty(4), 1)
            else:
                group.all_reduce(torch.ones(4))
        except PeerFailureError as exc:
            out[op] = (str(exc), time.monotonic() - started)
        else:
            out[op] = ("nothing", 0.0)
    group.abort()
    return out


@pytest.mark.parametrize(("how", "words"), [("abort", "rank 1 aborted"), ("shutdown", "rank 1 shut down")])
def test_a_peer_that_aborts_or_shuts_down_is_named_by_the_waiting_ranks(
    rank_pools: Pools, how: str, words: str
) -> None:
    got = rank_pools(2).run(stopped_peer, how, timeout=60)[0]
    message, seconds = got["recv"]
    assert words in message and seconds < 5, got
    assert words in got["all_reduce"][0], got  # the collective after it fails on the same latch or says so


def blocked_cpu(ctx: RankContext) -> dict[str, float] | None:
    """Rank 0 waits 2 s in a recv for rank 1, which sleeps first: the wait's CPU time."""
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="shm", timeout=60)
    group.barrier()
    result = None
    if ctx.rank == 1:
        time.sleep(2.0)
        group.send(torch.ones(4), 0)
    else:
        cpu, wall = time.process_time(), time.monotonic()
        got = torch.empty(4)
        group.recv(got, 1)
        result = {"cpu": time.process_time() - cpu, "wall": time.monotonic() - wall, "value": float(got[0])}
    group.shutdown()
    return result


def test_a_rank_blocked_on_a_sleeping_peer_burns_no_core(rank_pools: Pools) -> None:
    got = rank_pools(2).run(blocked_cpu, timeout=60)[0]
    assert got["value"] == 1.0
    assert got["wall"] >= 1.5, got
    assert got["cpu"] < 0.1 * got["wall"], got  # slices of 30 ms: a few ms of CPU per second


def small_all_reduces(ctx: RankContext, rounds: int) -> dict[str, float]:
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="shm", timeout=60)
    t = torch.zeros(1)
    group.barrier()
    cpu, wall = time.process_time(), time.monotonic()
    for i in range(rounds):
        t.fill_(float(ctx.rank + i))
        group.all_reduce(t)
        assert float(t[0]) == sum(r + i for r in range(ctx.size))
    result = {"cpu": time.process_time() - cpu, "wall": time.monotonic() - wall}
    group.shutdown()
    return result


def test_four_ranks_on_two_cores_complete_small_all_reduces(rank_pools: Pools) -> None:
    """Oversubscribed (on this project's 2-core machines): every rank completes, and the ranks
    together use at most the machine's cores' worth of CPU (nothing spins past its peers)."""
    got = rank_pools(4).run(small_all_reduces, 500, timeout=120)
    wall = max(g["wall"] for g in got)
    cpu = sum(g["cpu"] for g in got)
    assert wall < 30, got
    assert cpu <= (os.cpu_count() or 2) * wall * 1.05, got


def mixed_all_reduces(ctx: RankContext, rounds: int) -> list[str]:
    """Small all_reduces (pg-shm's prepared one-phase path, once the group has a lane for their
    kind) interleaved with ones it hands to the general path: larger than one phase, transposed,
    another dtype or op, AVG. Every result is exact (integers), so any slip shows."""
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="shm", timeout=60)
    ranks = range(ctx.size)
    wrong = []

    def check(name: str, got: torch.Tensor, expected: torch.Tensor) -> None:
        if not torch.equal(got, expected):
            wrong.append(f"rank {ctx.rank} {name}: {got.flatten()[:4].tolist()} != {expected.flatten()[:4].tolist()}")

    for i in range(rounds):
        one = torch.tensor([float(ctx.rank + i)])
        group.all_reduce(one)
        check("1 float", one, torch.tensor([float(sum(r + i for r in ranks))]))
        grid = torch.arange(12, dtype=torch.int64).reshape(3, 4) * (ctx.rank + 1) + i
        group.all_reduce(grid, ReduceOp.MAX)
        check("int64 max", grid, torch.arange(12, dtype=torch.int64).reshape(3, 4) * ctx.size + i)
        big = torch.full((20_000,), float(ctx.rank + i))  # 80 KB: two phases per piece
        group.all_reduce(big)
        check("80 KB", big, torch.full((20_000,), float(sum(r + i for r in ranks))))
        turned = (torch.arange(6.0).reshape(2, 3) + ctx.rank).t()
        group.all_reduce(turned)
        check("transposed", turned, (torch.arange(6.0).reshape(2, 3) * ctx.size + sum(ranks)).t())
        mean = torch.full((5,), float(2 * ctx.rank * ctx.size))
        group.all_reduce(mean, ReduceOp.AVG)
        check("avg", mean, torch.full((5,), float(2 * sum(ranks))))
    group.shutdown()
    return wrong


def test_prepared_small_all_reduces_interleave_with_the_general_path(rank_pools: Pools) -> None:
    got = rank_pools(3).run(mixed_all_reduces, 40, timeout=120)
    assert got == [[], [], []], got


def other_hosts(ctx: RankContext) -> str:
    os.environ[HOST_ID_ENV] = "host-a" if ctx.rank < 2 else "host-b"
    try:
        group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="shm", timeout=30)
        try:
            group.all_reduce(torch.ones(1))
        finally:
            group.abort()
    except BackendUnavailableError as exc:
        return str(exc)
    finally:
        del os.environ[HOST_ID_ENV]
    return "formed"


def test_members_on_two_hosts_are_refused_clearly(rank_pools: Pools) -> None:
    before = _segments()
    for message in rank_pools(3).run(other_hosts, timeout=60):
        assert "ranks [0, 1] on 'host-a'" in message and "ranks [2] on 'host-b'" in message, message
        assert "tcp" in message and "gloo" in message, message
    assert not _left_behind(before)


def unmappable(ctx: RankContext) -> str:
    """Rank 1 cannot open the others' segments (as in a container with its own /dev/shm)."""
    from pg_shm import segment

    real = segment.Segment.open

    def refuse(path: Path, size: int) -> segment.Segment:
        raise PermissionError(13, "Permission denied", str(path))

    if ctx.rank == 1:
        segment.Segment.open = refuse  # type: ignore[method-assign,assignment]
    try:
        group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="shm", timeout=30)
        try:
            group.all_reduce(torch.ones(1))
        finally:
            group.abort()
    except BackendUnavailableError as exc:
        return str(exc)
    finally:
        segment.Segment.open = real  # type: ignore[method-assign]
    return "formed"


def test_members_that_do_not_share_dev_shm_all_refuse_alike(rank_pools: Pools) -> None:
    before = _segments()
    for message in rank_pools(3).run(unmappable, timeout=60):
        assert "rank 1 cannot map rank 0's segment" in message and "Permission denied" in message, message
        assert "do not share /dev/shm" in message and "tcp" in message, message
    assert not _left_behind(before)


def full_dev_shm(ctx: RankContext) -> str:
    """Rank 1 finds /dev/shm full when it creates its segment."""
    from pg_shm import segment

    real = segment.Segment.create

    def full(prefix: str, size: int) -> segment.Segment:
        raise OSError(28, "No space left on device")

    if ctx.rank == 1:
        segment.Segment.create = full  # type: ignore[method-assign,assignment]
    try:
        group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="shm", timeout=30)
        try:
            group.barrier()
        finally:
            group.abort()
    except BackendUnavailableError as exc:
        return str(exc)
    finally:
        segment.Segment.create = real  # type: ignore[method-assign]
    return "formed"


def test_a_full_dev_shm_is_refused_by_every_member_with_what_to_do(rank_pools: Pools) -> None:
    before = _segments()
    for message in rank_pools(2).run(full_dev_shm, timeout=60):
        assert "rank 1 could not create" in message and "No space left" in message, message
        assert "slot_bytes" in message and "--shm-size" in message, message
    assert not _left_behind(before)


def _state_of(pid: int) -> str:
    """The process's state letter from /proc (``T``: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def stalled_stream(ctx: RankContext) -> dict[str, str] | None:
    """Rank 0 isends 16 MiB and stops itself (SIGSTOP) with the message part-way in the ring:
    rank 1's receive times out inside the message, and its next receive from rank 0 says the
    stream is broken instead of reading the rest of the payload as a header."""
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="shm", timeout=60)
    group.barrier()
    if ctx.rank == 0:
        work = group.isend(torch.ones(4 << 20), 1)
        ring = _backend(group).outboxes[1].ring
        deadline = time.monotonic() + 10
        while ring.head.value < 512 << 10 and time.monotonic() < deadline:  # part of it is in the ring
            time.sleep(0.001)
        ctx.store.set("pid", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)  # rank 1 continues it once it has seen what it needs
        wait_for(ctx.store, ["seen"], 60)
        group.abort()
        del work
        return None
    wait_for(ctx.store, ["pid"], 60)
    stopped = int(ctx.store.get("pid"))
    deadline = time.monotonic() + 30
    while _state_of(stopped) != "T" and time.monotonic() < deadline:  # rank 0 has stopped itself
        time.sleep(0.001)
    assert _state_of(stopped) == "T", f"rank 0 (pid {stopped}) never stopped"
    out = {}
    try:
        group.recv(torch.empty(4 << 20), 0, timeout=1.0)
    except CollectiveTimeout as exc:
        out["first"] = f"{type(exc).__name__}: {exc}"
    try:
        group.recv(torch.empty(4), 0, timeout=1.0)
    except PeerFailureError as exc:
        out["second"] = f"{type(exc).__name__}: {exc}"
    os.kill(int(ctx.store.get("pid")), signal.SIGCONT)
    ctx.store.set("seen", "1")
    group.abort()
    return out


def test_a_receive_that_stops_inside_a_message_leaves_its_stream_broken_not_misread(rank_pools: Pools) -> None:
    got = rank_pools(2).run(stalled_stream, timeout=60, check_leaks=False)[1]
    assert got.get("first", "").startswith("CollectiveTimeout"), got
    assert "stream from rank 0 is broken" in got.get("second", ""), got


def absent_peer(ctx: RankContext) -> str | None:
    """Rank 1 never forms the backend: rank 0's formation times out and removes its segment."""
    if ctx.rank == 1:
        wait_for(ctx.store, ["done"], 60)
        return None
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="shm", timeout=2)
    try:
        group.all_reduce(torch.ones(1))
    except CollectiveTimeout as exc:
        return str(exc)
    finally:
        group.abort()
        ctx.store.set("done", "1")
    return "formed"


def test_a_formation_that_times_out_leaves_nothing(rank_pools: Pools) -> None:
    before = _segments()
    got = rank_pools(2).run(absent_peer, timeout=60)[0]
    assert "Timed out" in got, got
    assert not _left_behind(before)


def eager_then_large(ctx: RankContext) -> dict[str, float] | None:
    """Rank 0 sends 64 messages of 64 KiB (4 MiB, four rings' worth) before rank 1 receives
    any: each returns (the drainer makes room). A 3 MiB send then waits for its receive."""
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="shm", timeout=60)
    group.barrier()
    piece = torch.empty(16384)
    if ctx.rank == 0:
        started = time.monotonic()
        for i in range(64):
            group.send(piece.fill_(float(i)), 1)
        eager = time.monotonic() - started
        ctx.store.set("sent", "1")
        large = torch.arange(3 * 262144, dtype=torch.float32)
        started = time.monotonic()
        group.send(large, 1)
        blocked = time.monotonic() - started
        group.shutdown()
        return {"eager": eager, "blocked": blocked}
    wait_for(ctx.store, ["sent"], 60)
    time.sleep(1.0)
    for i in range(64):
        group.recv(piece, 0)
        assert float(piece[0]) == i and float(piece[-1]) == i
    large = torch.empty(3 * 262144)
    group.recv(large, 0)
    assert torch.equal(large, torch.arange(3 * 262144, dtype=torch.float32))
    group.shutdown()
    return None


def test_sends_up_to_the_eager_limit_never_wait_and_larger_ones_wait_for_their_receive(rank_pools: Pools) -> None:
    got = rank_pools(2).run(eager_then_large, timeout=120)[0]
    assert got["eager"] < 5, got
    assert got["blocked"] >= 0.9, got  # the receiver slept 1 s before taking anything


def test_the_plugin_declares_the_rings_eager_limit() -> None:
    assert plugin.EAGER_LIMIT == rings.EAGER_LIMIT
    assert plugin.CAPABILITIES.eager_limit_bytes == rings.EAGER_LIMIT
    assert rings.RING_BYTES >= rings.EAGER_LIMIT + 32


def _blocked_ops(backend: ShmBackend) -> list[tuple[str, Callable[[], object]]]:
    """Rank 0's operations that block on rank 1 (which takes nothing and joins nothing), called
    on the backend itself so that all of them are inside it at once: a large send streaming
    through a full ring, small sends queued behind it, an isend being waited, receives of a
    tensor and of bytes, and an all_reduce; and tiny sends one after another on a stream of
    their own (rank 1's drainer takes them in), each entering and leaving the backend, so the
    close lands between a send's entering and its leaving as often as anywhere."""
    large = torch.ones((rings.EAGER_LIMIT * 3) // 4)  # 3 MiB: more than the ring, so it streams
    small = torch.ones(16384)  # 64 KiB: eager, queued behind the large one
    tiny = torch.ones(1)

    def sends_until_closed() -> None:
        while True:
            backend.send(tiny, 1, 20, timeout=20)

    ops: list[tuple[str, Callable[[], object]]] = [
        ("large send", lambda: backend.send(large, 1, 1, timeout=20)),
        ("isend wait", lambda: backend.isend(large.clone(), 1, 2, timeout=20).wait(20)),
        ("recv", lambda: backend.recv(torch.empty(8), 1, 3, timeout=20)),
        ("recv_bytes", lambda: backend.recv_bytes(1, 4, timeout=20)),
        ("send_bytes", lambda: backend.send_bytes(bytes(2 << 20), 1, 5, timeout=20)),
        ("all_reduce", lambda: backend.all_reduce(torch.ones(4), ReduceOp.SUM, timeout=20)),
        ("tiny sends", sends_until_closed),
    ]
    for i in range(3):
        ops.append((f"small send {i}", lambda i=i: backend.send(small, 1, 10 + i, timeout=20)))  # type: ignore[misc]
    return ops


def closed_under_load(ctx: RankContext, rounds: int) -> dict[str, Any] | None:
    """Per round, a fresh group: rank 1 sends rank 0 a burst of small messages (rank 0's
    drainer moves them out of the ring) while rank 0 blocks, each on a thread, in every
    operation of :func:`_blocked_ops`; then rank 0 aborts or shuts down (alternating) with all
    of them under way. Each must raise ``GroupClosedError`` (or have completed), and the
    process must survive: a segment unmapped under a thread that still reads it is a SIGSEGV,
    which the pool reports as rank 0's death."""
    import random
    import threading

    from pg_core import PrefixStore
    from pg_core.errors import GroupClosedError

    outcomes: dict[str, int] = {}
    slow: list[float] = []
    for r in range(rounds):
        store = PrefixStore(f"round-{r}", ctx.store)
        group = ProcessGroup(store, ctx.rank, ctx.size, backends="shm", timeout=30)
        group.barrier()
        backend = _backend(group)
        if ctx.rank == 1:
            burst = torch.ones(8192)  # 32 KiB each, 8 MiB in all: rank 0's ring fills over and over
            with contextlib.suppress(PeerFailureError, GroupClosedError, CollectiveTimeout):
                for _ in range(256):
                    backend.send(burst, 0, 99, timeout=20)
            wait_for(store, ["closed"], 60)
            group.abort()
            continue
        errors: dict[str, BaseException | None] = {}

        def run(name: str, op: Callable[[], object]) -> None:
            try:
                op()
            except BaseException as exc:  # judged below
                errors[name] = exc
            else:
                errors[name] = None

        threads = [threading.Thread(target=run, args=op, daemon=True) for op in _blocked_ops(backend)]
        for t in threads:
            t.start()
        # jitter, not synchronisation: the close must land at a different point of the
        # operations each round (entering, waiting for room, streaming, draining, leaving)
        time.sleep(random.uniform(0.0, 0.05))
        started = time.monotonic()
        if r % 2 == 0:
            group.abort()
        else:
            group.shutdown()
        slow.append(time.monotonic() - started)
        for t in threads:
            t.join(timeout=10)
        assert not any(t.is_alive() for t in threads), f"round {r}: an operation did not return after the close"
        store.set("closed", "1")
        for name, exc in errors.items():
            key = "completed" if exc is None else type(exc).__name__
            outcomes[key] = outcomes.get(key, 0) + 1
            assert exc is None or isinstance(exc, GroupClosedError), f"round {r}: {name} raised {exc!r}"
    return None if ctx.rank == 1 else {"outcomes": outcomes, "close_seconds": max(slow)}


def test_closing_under_every_kind_of_blocked_operation_never_touches_an_unmapped_segment(rank_pools: Pools) -> None:
    got = rank_pools(2).run(closed_under_load, 40, timeout=300)[0]
    assert got["outcomes"].get("GroupClosedError", 0) > 0, got
    assert got["close_seconds"] < 3, got  # abort and shutdown wait for no peer
