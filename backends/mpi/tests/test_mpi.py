"""pg-mpi across real processes started by ``mpiexec``: what the backend adds to MPI, and what
pg-core's launcher support guarantees for it.

The conformance suite (``tests/conformance/test_backends.py``) certifies the backend; these
tests pin down what the contract leaves to it: MPI is not initialised by listing, groups are
communicators of exactly their members (several, overlapping, concurrent), members that are
not one MPI job are refused with the way to launch, waits give the CPU away only where ranks
share CPUs, a receive of the wrong size is an error and not MPI's truncation, timeouts and
abort, and the launched pool's guarantees (a dead rank reported, a hang dumped and killed,
nothing left behind).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
from pg_core import ProcessGroup
from pg_core.errors import CollectiveMismatchError, CollectiveTimeout
from pg_core.launchers import find_launcher, launch_command
from pg_core.ops import ReduceOp
from pg_core.procs import wait_exited
from pg_core.store import wait_for
from pg_core.testing.pool import RankContext, RankPool, RanksFailed
from pg_mpi._mpi import more_ranks_than_cpus, ranks_share_cpus
from pg_mpi.plugin import EAGER_LIMIT, MAX_TAG, is_available

pytestmark = pytest.mark.requires_backend("mpi")


Pools = Callable[[int], RankPool]


def _group(ctx: RankContext, timeout: float | None = None, **kw: Any) -> ProcessGroup:
    return ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="mpi", timeout=timeout or 30.0, **kw)


# -- availability: from the environment, without initialising MPI ------------------------------------


def test_outside_mpiexec_it_is_unavailable_and_says_how_to_launch() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    code = (
        "from pg_mpi.plugin import is_available; import sys; print(is_available()); print('mpi4py.MPI' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    reason, imported = out.stdout.strip().splitlines()
    assert "not started by an MPI launcher" in reason and "mpiexec -n N python script.py" in reason
    assert imported == "False"  # not even the library is loaded
    assert is_available() is not None  # this test process was not started by mpiexec either


LISTING = """
import json
from pg_core.registry import default_registry
entries = {e.name: e.status for e in default_registry().entries()}
from mpi4py import MPI
print(json.dumps({"mpi": entries["mpi"], "initialized": MPI.Is_initialized()}))
"""


def test_listing_under_mpiexec_says_available_without_initialising_mpi() -> None:
    command = launch_command("mpiexec", 1, [sys.executable, "-c", LISTING])
    out = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True, stdin=subprocess.DEVNULL)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"mpi": "available", "initialized": False}


def tag_bound(ctx: RankContext) -> list[int]:
    from mpi4py import MPI

    return [int(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)), MPI.Query_thread() == MPI.THREAD_MULTIPLE]


def test_the_declared_tags_fit_the_librarys_bound_and_mpi_runs_multithreaded(pools: Pools) -> None:
    [(tag_ub, multiple)] = pools(1).run(tag_bound, timeout=120)
    assert MAX_TAG == 32767 <= tag_ub
    assert multiple


# -- reductions: torch's results, whatever the library's arithmetic ----------------------------------


INTEGERS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def overflowing_integer_reductions(ctx: RankContext) -> list[str]:
    """Sums and products of each integer type's extremes over 1024 elements (past any vector
    unit's width), by all_reduce (three calls: the core then prepares it), reduce and
    reduce_scatter_tensor: what differs from torch's own wrapped-around arithmetic."""
    wrong = []
    with _group(ctx) as group:
        for dtype in INTEGERS:
            info = torch.iinfo(dtype)
            mine = torch.tensor([info.max, info.min], dtype=dtype).repeat(512 * ctx.size)
            for op, fold in ((ReduceOp.SUM, torch.add), (ReduceOp.PRODUCT, torch.mul)):
                expected = mine.clone()
                for _ in range(ctx.size - 1):
                    expected = fold(expected, mine)  # every rank holds the same values
                for call in range(3):
                    t = mine.clone()
                    group.all_reduce(t, op)
                    if not torch.equal(t, expected):
                        wrong.append(f"all_reduce #{call} {dtype} {op.type.name}: {t[:2].tolist()}")
                t = mine.clone()
                group.reduce(t, 0, op)
                if ctx.rank == 0 and not torch.equal(t, expected):
                    wrong.append(f"reduce {dtype} {op.type.name}: {t[:2].tolist()}")
                out = torch.empty(mine.numel() // ctx.size, dtype=dtype)
                group.reduce_scatter_tensor(out, mine.clone(), op)
                if not torch.equal(out, expected.chunk(ctx.size)[ctx.rank]):
                    wrong.append(f"reduce_scatter_tensor {dtype} {op.type.name}: {out[:2].tolist()}")
    return wrong


def test_integer_sums_and_products_wrap_around_as_torchs_do(pools: Pools) -> None:
    """Open MPI 5.0's AVX ``MPI_SUM`` saturates 8- and 16-bit integers (``127 + 127 = 127``);
    torch, and every other backend, wraps around (``-2``). pg-mpi asks the library and lets
    torch reduce the ones it gets wrong."""
    assert pools(2).run(overflowing_integer_reductions, timeout=180) == [[], []]


# -- waits: giving the CPU away only where ranks share CPUs -------------------------------------------


@pytest.mark.parametrize(
    ("local", "affinity", "machine", "limit", "shares"),
    [
        (2, 2, 2, None, False),  # 2 ranks free to run on 2 CPUs
        (3, 2, 2, None, True),  # 3 ranks on 2 CPUs
        (2, 1, 2, None, False),  # each rank bound to a CPU of its own (mpiexec --bind-to core)
        (3, 1, 2, None, True),  # bound, but more ranks than the machine's CPUs
        (2, 2, 64, None, False),  # a job confined to 2 of 64 CPUs (taskset)
        (3, 2, 64, None, True),
        (2, 64, 64, 1, True),  # a container limited to one CPU of a 64-CPU host
        (4, 0, 8, None, False),  # affinity unknown (no sched_getaffinity): the machine's CPUs
    ],
)
def test_ranks_share_cpus_where_the_node_has_more_ranks_than_cpus(
    local: int, affinity: int, machine: int, limit: int | None, shares: bool
) -> None:
    assert more_ranks_than_cpus(local, affinity=affinity, machine=machine, limit=limit) is shares


def test_without_the_launchers_count_of_ranks_a_wait_yields_as_if_shared() -> None:
    assert ranks_share_cpus({}) is True
    assert ranks_share_cpus({"MPI_LOCALNRANKS": "a few"}) is True
    assert ranks_share_cpus({"OMPI_COMM_WORLD_LOCAL_SIZE": str(1 << 20)}) is True
    assert ranks_share_cpus({"MPI_LOCALNRANKS": "1"}) is False


def how_waits_yield(ctx: RankContext) -> dict[str, Any]:
    with _group(ctx) as group:
        t = torch.ones(1)
        group.all_reduce(t)
        backend = group._dispatch.instance(t.device).backend
        return {"local": os.environ.get("MPI_LOCALNRANKS"), "yield_each": backend._yield_each, "sum": t.item()}


@pytest.mark.parametrize("n", [2, 3])
def test_under_mpiexec_a_wait_yields_before_each_test_only_where_ranks_outnumber_cpus(pools: Pools, n: int) -> None:
    """Hydra names the ranks on the node, and the backend decides by that count (the rule is
    tested above): on this project's 2-CPU machine 2 ranks test back to back and 3 yield."""
    shares = ranks_share_cpus({"MPI_LOCALNRANKS": str(n)})  # the ranks inherit this process's CPUs
    for got in pools(n).run(how_waits_yield, timeout=120):
        assert got == {"local": str(n), "yield_each": shares, "sum": float(n)}


# -- groups are communicators of exactly their members ------------------------------------------------


def overlapping_groups(ctx: RankContext) -> dict[str, Any]:
    """Three ranks: the world, {0, 1} and {1, 2} formed at once from two threads on rank 1,
    and a split; each reduces its own values."""
    out: dict[str, Any] = {}
    with _group(ctx) as world:
        pairs = {"a": [0, 1], "b": [1, 2]}
        mine = {k: m for k, m in pairs.items() if ctx.rank in m}

        def use(key: str, members: list[int]) -> None:
            with ProcessGroup(
                ctx.store, members.index(ctx.rank), 2, backends="mpi", name=f"pair-{key}", timeout=30
            ) as pair:
                t = torch.full((3,), float(ctx.rank + 1))
                for _ in range(5):
                    pair.all_reduce(t)
                out[key] = t.tolist()
                comm = pair._dispatch.instance(torch.device("cpu")).backend.comm
                out[f"{key}-size"] = comm.Get_size()

        threads = [threading.Thread(target=use, args=item) for item in mine.items()]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        sub = world.split(color=ctx.rank % 2, key=-ctx.rank)
        assert sub is not None
        with sub:
            t = torch.tensor([ctx.rank], dtype=torch.int64)
            sub.all_reduce(t, ReduceOp.MAX)
            out["split"] = (sub.rank, sub.size, int(t.item()))
    return out


def test_several_overlapping_groups_at_once_and_a_split(pools: Pools) -> None:
    r0, r1, r2 = pools(3).run(overlapping_groups, timeout=180)
    # pair a: ranks 0 and 1 (1 + 2 = 3, then doubled four more times)
    assert r0["a"] == r1["a"] == [3.0 * 2**4] * 3 and r0["a-size"] == 2
    assert r1["b"] == r2["b"] == [5.0 * 2**4] * 3 and r2["b-size"] == 2
    assert r0["split"] == (1, 2, 2) and r2["split"] == (0, 2, 2) and r1["split"] == (0, 1, 1)


def native_split(ctx: RankContext) -> dict[str, Any]:
    """Four ranks split into colors 7 and 3 and none, keys putting rank 3 before rank 0; then
    everyone splits again (reversed) and aborts that subgroup."""
    from mpi4py import MPI

    colors, keys = [7, 3, None, 7], [2, 0, 0, -1]
    out: dict[str, Any] = {}
    with _group(ctx) as world:
        world_ranks = world.all_gather_object(MPI.COMM_WORLD.Get_rank())
        sub = world.split(colors[ctx.rank], key=keys[ctx.rank])
        if sub is None:
            out["sub"] = None
        else:
            backend = sub._dispatch.instance(torch.device("cpu")).backend
            comm = backend.comm
            out["made_by_split"] = backend.ctx.split_from is comm  # and created inside split(), before any use
            comm_group, world_group = comm.Get_group(), MPI.COMM_WORLD.Get_group()
            out["world_ranks"] = comm_group.Translate_ranks(list(range(comm.Get_size())), world_group)
            out["expected_world_ranks"] = [world_ranks[p] for p in sub.parent_ranks]
            comm_group.Free()
            world_group.Free()
            t = torch.tensor([10**ctx.rank], dtype=torch.int64)
            sub.all_reduce(t)
            out["sub"] = (sub.rank, sub.size, sub.parent_ranks, int(t.item()))
            sub.shutdown()
            out["freed_at_shutdown"] = backend.ctx.split_from == MPI.COMM_NULL and backend.comm is None
        again = world.split(0, key=-ctx.rank)
        assert again is not None
        backend = again._dispatch.instance(torch.device("cpu")).backend
        out["again"] = (again.rank, backend.comm.Get_rank(), backend.ctx.split_from is backend.comm)
        again.abort()
        out["freed_at_abort"] = backend.ctx.split_from == MPI.COMM_NULL and backend.comm is None
    return out


def test_split_makes_each_subgroups_communicator_with_mpi_comm_split(pools: Pools) -> None:
    results = pools(4).run(native_split, timeout=180)
    assert [r["sub"] for r in results] == [(1, 2, (3, 0), 1001), (0, 1, (1,), 10), None, (0, 2, (3, 0), 1001)]
    for rank, r in enumerate(results):
        assert r["again"] == (3 - rank, 3 - rank, True) and r["freed_at_abort"], r
        if rank != 2:
            assert r["made_by_split"] and r["freed_at_shutdown"], r
            assert r["world_ranks"] == r["expected_world_ranks"], r


def unformed_split(ctx: RankContext) -> dict[str, Any]:
    """A split whose subgroup fails to form after ``MPI_Comm_split`` (the store exchange raises):
    the communicator it made is freed, and the parent goes on."""
    import pg_core.membership as membership
    from mpi4py import MPI
    from pg_mpi.backend import MPIBackend

    made: list[Any] = []
    real_split, real_form = MPIBackend.split, membership.form

    def split(self: MPIBackend, color: int | None, rank: int, *, timeout: float) -> Any:
        comm = real_split(self, color, rank, timeout=timeout)
        made.append(comm)
        return comm

    def form(store: Any, prefix: str, key: str, *args: Any, **kwargs: Any) -> Any:
        if key.startswith("split"):
            raise ConnectionError(f"the store went away forming {key}")
        return real_form(store, prefix, key, *args, **kwargs)

    out: dict[str, Any] = {}
    with _group(ctx) as world:
        MPIBackend.split, membership.form = split, form  # type: ignore[method-assign]
        try:
            world.split(0)
        except ConnectionError as exc:
            out["error"] = str(exc)
        finally:
            MPIBackend.split, membership.form = real_split, real_form  # type: ignore[method-assign]
        out["made"] = len(made) == 1 and isinstance(made[0], MPI.Intracomm)
        out["freed"] = made[0] == MPI.COMM_NULL
        t = torch.ones(1)
        world.all_reduce(t)
        out["after"] = t.item()
    return out


def test_a_communicator_that_no_subgroup_took_is_freed(pools: Pools) -> None:
    for r in pools(2).run(unformed_split, timeout=120):
        assert r == {"error": "the store went away forming split0.0", "made": True, "freed": True, "after": 2.0}, r


JOINER = """
import sys
from datetime import timedelta
import torch
from pg_core import ProcessGroup, TCPStore
from pg_core.errors import BackendUnavailableError
port, rank = int(sys.argv[1]), int(sys.argv[2])
from mpi4py import MPI  # noqa: E402  (the world rank, to pick this job's member)
if MPI.COMM_WORLD.Get_rank() == int(sys.argv[3]):
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    try:
        ProcessGroup(store, rank, 2, backends="mpi", timeout=3).all_reduce(torch.ones(1))
    except BackendUnavailableError as exc:
        print("REFUSED", " ".join(str(exc).split()), flush=True)
    else:
        print("FORMED", flush=True)
"""


@pytest.mark.parametrize(
    ("world", "members"), [(1, (0, 0)), (2, (0, 1))], ids=["two-singleton-jobs", "two-jobs-of-two"]
)
def test_members_of_different_mpi_jobs_are_refused_saying_how_to_launch(world: int, members: tuple[int, int]) -> None:
    """Two ``mpiexec`` jobs, one member from each: world rank 0 twice (seen in the store at
    once), or world ranks 0 and 1 of two jobs of two (seen by the handshake, within the timeout)."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    jobs = [
        subprocess.Popen(
            launch_command("mpiexec", world, [sys.executable, "-c", JOINER, str(store.port), str(r), str(members[r])]),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        for r in range(2)
    ]
    outputs = [job.communicate(timeout=120)[0] for job in jobs]
    for out in outputs:
        said = [line for line in out.splitlines() if line.startswith(("REFUSED", "FORMED"))]
        assert said and said[0].startswith("REFUSED"), out
        assert "not processes of one MPI job" in said[0] and "mpiexec -n N python script.py" in said[0]


# -- point to point: MPI's truncation becomes a mismatch, the stream stays in step -------------------


def wrong_size_then_right(ctx: RankContext) -> str:
    with _group(ctx) as group:
        if ctx.rank == 0:
            group.send(torch.arange(8, dtype=torch.float32), 1)
            group.send(torch.arange(2, dtype=torch.float32), 1)
            group.send(torch.arange(4, dtype=torch.float32) + 100, 1)
            group.barrier()
            return "sent"
        small = torch.empty(4)
        # MPI's truncation, as the contract's mismatch: an error from MPICH where the receive was
        # posted first ("larger than 16 bytes"), a completed receive of 32 bytes where the
        # message was already queued
        with pytest.raises(CollectiveMismatchError, match=r"the message is (larger than 16|32) bytes") as err:
            group.recv(small, 0)
        assert err.value.peers == (0,)
        with pytest.raises(CollectiveMismatchError, match=r"the message is 8 bytes"):
            group.recv(small, 0)
        group.recv(small, 0)  # both refused messages were consumed: the stream is in step
        assert small.tolist() == [100.0, 101.0, 102.0, 103.0]
        group.barrier()
        return "refused"


def test_a_receive_of_the_wrong_size_is_a_mismatch_and_the_stream_stays_in_step(pools: Pools) -> None:
    assert pools(2).run(wrong_size_then_right, timeout=120) == ["sent", "refused"]


def queued_before_irecv(ctx: RankContext) -> list[Any] | None:
    """Rank 0 sends four messages (within the eager limit) before rank 1 posts any irecv: MPI
    has them queued by the time rank 1 is out of the barrier that rank 0 joined after sending."""
    with _group(ctx) as group:
        if ctx.rank == 0:
            for n in (8, 2, 4):
                group.send(torch.arange(n, dtype=torch.float32) + 100, 1)
            group.send(torch.tensor([7.0]), 1, tag=3)
            group.barrier()
            group.barrier()
            return None
        group.barrier()  # (its polls took the messages in: rank 0 sent them before it joined)
        small = torch.empty(4)
        works = [group.irecv(small, 0) for _ in range(2)]
        works.append(group.irecv(small, 0))
        one = torch.empty(1)
        tagged = group.irecv(one, 0, tag=3)
        # a receive whose message had come is taken when it is posted: done without a wait
        seen = [w.done for w in (*works, tagged)]
        errors = []
        for w in works[:2]:
            with pytest.raises(CollectiveMismatchError) as err:
                w.wait()
            errors.append(str(err.value))
        works[2].wait()
        tagged.wait()
        group.barrier()
        return [seen, errors, small.tolist(), one.tolist()]


def test_an_irecv_whose_message_came_first_is_done_when_posted_and_still_refuses_a_wrong_size(pools: Pools) -> None:
    _, (seen, errors, small, one) = pools(2).run(queued_before_irecv, timeout=120)
    assert seen == [True, True, True, True]
    assert re.search(r"the message is (larger than 16|32) bytes", errors[0]) and "8 bytes" in errors[1]
    assert small == [100.0, 101.0, 102.0, 103.0] and one == [7.0]


def from_any_source(ctx: RankContext) -> list[Any] | None:
    """Ranks 1 and 2 each send rank 0 one message, then rank 2 one too large and one right:
    rank 0 receives from any source (blocking and with irecv), learns each sender, and a
    wrong size is a mismatch that names its sender and consumes the message."""
    with _group(ctx) as group:
        if ctx.rank > 0:
            group.send(torch.full((4,), float(ctx.rank)), 0, tag=9)
            group.barrier()  # rank 0 has both
            if ctx.rank == 2:
                group.send(torch.zeros(8), 0, tag=9)
                group.send(torch.full((4,), 7.0), 0, tag=9)
            group.barrier()
            return None
        t = torch.empty(4)
        first = group.recv(t, None, tag=9)
        got = [(first, t[0].item())]
        work = group.irecv(t, None, tag=9)
        work.wait()
        got.append((work.result(), t[0].item()))
        group.barrier()
        # (as in wrong_size_then_right: MPICH's error, or a completed receive of 32 bytes)
        with pytest.raises(
            CollectiveMismatchError, match=r"from rank 2 .*the message is (larger than 16|32) bytes"
        ) as err:
            group.recv(t, None, tag=9)
        got.append(err.value.peers)
        got.append((group.recv(t, None, tag=9), t[0].item()))
        group.barrier()
        return got


def test_a_receive_from_any_source_is_mpi_any_source(pools: Pools) -> None:
    got = pools(3).run(from_any_source, timeout=120)[0]
    assert sorted(got[:2]) == [(1, 1.0), (2, 2.0)]
    assert got[2:] == [(2,), (2, 7.0)]


def sends_before_receives(ctx: RankContext) -> list[list[float]]:
    """Both ranks send a message of the eager limit before either receives, then change their
    tensors; then, above the limit, each posts its receive before its send (a correct program
    where a send may wait for its receiver)."""
    with _group(ctx) as group:
        peer = 1 - ctx.rank
        got: list[list[float]] = []
        for n, receive_first in ((EAGER_LIMIT // 4, False), (8 << 20, True)):
            out = torch.full((n,), float(ctx.rank + 1))
            into = torch.empty(n)
            work = group.irecv(into, peer, tag=5) if receive_first else None
            group.send(out, peer, tag=5)
            out.fill_(-1.0)  # the message was taken when send returned
            if work is None:
                group.recv(into, peer, tag=5)
            else:
                work.wait()
            got.append([float(into.min()), float(into.max())])
        return got


def test_a_send_up_to_the_eager_limit_never_waits_for_its_receiver(pools: Pools) -> None:
    assert pools(2).run(sends_before_receives, timeout=180) == [[[2.0, 2.0]] * 2, [[1.0, 1.0]] * 2]


def send_above_the_limit_times_out(ctx: RankContext) -> dict[str, Any]:
    """Rank 0's blocking send of 64 KiB to rank 1, which posts no receive, times out after 1 s;
    the message stays posted, and rank 1 receives it afterwards, whole."""
    with _group(ctx) as group:
        group.barrier()  # the backend formed on both ranks (its formation is collective)
        data = torch.arange(16384, dtype=torch.float32)
        if ctx.rank == 0:
            start = time.monotonic()
            with pytest.raises(CollectiveTimeout) as err:
                group.send(data, 1, tag=6, timeout=1.0)
            took = time.monotonic() - start
            ctx.store.set("timed-out", "1")
            group.barrier()
            return {"error": str(err.value), "took": took}
        wait_for(ctx.store, ["timed-out"], 60)
        got = torch.empty_like(data)
        group.recv(got, 0, tag=6)
        group.barrier()
        return {"same": bool(torch.equal(got, data))}


def test_a_send_above_the_eager_limit_times_out_and_stays_posted(pools: Pools) -> None:
    sender, receiver = pools(2).run(send_above_the_limit_times_out, timeout=120)
    assert 0.9 <= sender["took"] < 10, sender
    assert "rank 1 has not received the message after 1 s" in sender["error"], sender
    assert f"more than {EAGER_LIMIT} bytes" in sender["error"] and "post the receive first" in sender["error"], sender
    assert receiver == {"same": True}


# -- timeouts and abort --------------------------------------------------------------------------------


def collective_timeout(ctx: RankContext) -> str:
    with _group(ctx) as group:
        group.barrier()
        if ctx.rank == 0:
            start = time.monotonic()
            with pytest.raises(CollectiveTimeout) as err:
                group.all_reduce(torch.ones(2), timeout=1.0)
            assert time.monotonic() - start >= 0.9
            ctx.store.set("timed-out", "1")
            return str(err.value)
        wait_for(ctx.store, ["timed-out"], 60)
        return ""


def test_a_collective_that_a_rank_never_joins_times_out(pools: Pools) -> None:
    said, _ = pools(2).run(collective_timeout, timeout=120)
    assert "all_reduce" in said and "1 s" in said


def receive_timeout_then_in_step(ctx: RankContext) -> str:
    """Rank 0's receive from rank 1 times out (rank 1 has sent nothing yet); rank 1 then sends,
    and rank 0's next receive gets that message: the timed-out receive was withdrawn, and its
    tensor is never written."""
    with _group(ctx) as group:
        group.barrier()  # the backend formed on both ranks
        if ctx.rank == 1:
            wait_for(ctx.store, ["timed-out"], 60)
            group.send(torch.arange(3, dtype=torch.float32), 0)
            group.barrier()
            return ""
        start = time.monotonic()
        timed_out = torch.full((3,), -1.0)
        with pytest.raises(CollectiveTimeout, match=r"recv from rank 1 .*not complete after 0.5 s") as err:
            group.recv(timed_out, 1, timeout=0.5)
        assert time.monotonic() - start >= 0.45 and err.value.peers == (1,)
        ctx.store.set("timed-out", "1")
        got = torch.empty(3)
        group.recv(got, 1)
        group.barrier()
        assert timed_out.tolist() == [-1.0] * 3  # never written into after its timeout
        return str(got.tolist())


def test_a_receive_times_out_naming_its_peer_and_is_withdrawn(pools: Pools) -> None:
    assert pools(2).run(receive_timeout_then_in_step, timeout=120)[0] == "[0.0, 1.0, 2.0]"


class _Signalling(list):
    """A list that sets ``entered`` when something is appended to it."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()

    def append(self, item: object) -> None:
        super().append(item)
        self.entered.set()


def abort_unblocks_a_receive(ctx: RankContext) -> str:
    """Rank 0 receives what rank 1 never sends, in another thread; aborting the group makes it raise."""
    group = _group(ctx)
    group.barrier()  # formed on both ranks
    if ctx.rank == 1:
        wait_for(ctx.store, ["aborted"], 60)
        group.shutdown()
        return ""
    caught: list[BaseException] = []

    def receive() -> None:
        try:
            group.recv(torch.empty(2), 1, timeout=60)
        except BaseException as exc:
            caught.append(exc)

    backend = group._dispatch.instance(torch.device("cpu")).backend
    backend._polling = _Signalling()  # the backend's record of its polling loops, telling when one starts
    th = threading.Thread(target=receive)
    th.start()
    assert backend._polling.entered.wait(30), "the receive never started waiting in MPI"
    group.abort()
    th.join(30)
    ctx.store.set("aborted", "1")
    assert not th.is_alive()
    return type(caught[0]).__name__ if caught else "nothing raised"


def test_abort_makes_a_blocked_receive_raise(pools: Pools) -> None:
    assert pools(2).run(abort_unblocks_a_receive, timeout=120)[0] == "GroupClosedError"


RAISER = r"""
import os
import sys
from datetime import timedelta
from pg_core import ProcessGroup, TCPStore
store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=60))
rank = int(os.environ["PMI_RANK"])  # Hydra's; MPI itself is left to pg-mpi to initialise
group = ProcessGroup(store, rank, 2, backends="mpi", timeout=120)
group.barrier()
sys.stdout.write(f"FORMED {rank}\n")
sys.stdout.flush()
if rank == 0:
    raise ValueError("rank 0 fails on purpose")
group.barrier()  # ends only when the launcher ends this rank: rank 0 never comes
print("the barrier returned", flush=True)
"""


@pytest.mark.timeout(180)
def test_an_uncaught_exception_ends_the_rank_without_waiting_in_mpi_finalize() -> None:
    """MPICH's ``MPI_Finalize`` waits for every rank: without pg-mpi's exit on an uncaught
    exception, rank 0 would sit in it, and rank 1 in its barrier, for the group's 120 s."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    job = subprocess.Popen(
        launch_command("mpiexec", 2, [sys.executable, "-c", RAISER, str(store.port)]),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        out, err = job.communicate(timeout=60)  # far less than the group's 120 s
    finally:
        job.kill()
        job.wait()
    assert out.count("FORMED") == 2, out  # both formed the group (mpiexec may interleave their lines)
    assert job.returncode != 0, (out, err)
    assert "ValueError: rank 0 fails on purpose" in err, err
    assert "the barrier returned" not in out, out


EXIT_HANDLER = r"""
import sys
from pg_mpi._mpi import _exit_after_uncaught_exception
class Initialised:  # MPI as the handler sees it: initialised, not finalised
    def Is_initialized(self): return True
    def Is_finalized(self): return False
if sys.argv[1] != "none":
    sys.last_value = {"error": ValueError("x"), "interrupt": KeyboardInterrupt()}[sys.argv[1]]
_exit_after_uncaught_exception(Initialised())
print("returned", flush=True)
"""


@pytest.mark.parametrize(
    ("failure", "status", "out"), [("none", 0, "returned\n"), ("error", 1, ""), ("interrupt", -2, "")]
)
def test_the_exit_handler_ends_as_python_ends_on_the_uncaught_exception(failure: str, status: int, out: str) -> None:
    command = [sys.executable, "-c", EXIT_HANDLER, failure]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert (done.returncode, done.stdout) == (status, out), done.stderr


# -- the launched pool: failures reported, nothing left behind -----------------------------------------


def hang(ctx: RankContext) -> None:
    if ctx.rank == 1:
        threading.Event().wait(3600)


def die(ctx: RankContext) -> None:
    if ctx.rank == 1:
        os._exit(7)


def pid(ctx: RankContext) -> int:
    return os.getpid()


def _gone(pids: list[int], within: float = 20.0) -> bool:
    return not wait_exited(pids, within)  # mpiexec's processes, not this one's children


def test_a_launched_pool_dumps_a_hang_reports_a_death_respawns_and_leaves_no_process() -> None:
    assert find_launcher("mpiexec") is not None
    pool = RankPool(2, launcher="mpiexec")
    try:
        first = pool.run(pid, timeout=120)
        with pytest.raises(RanksFailed) as hung:
            pool.run(hang, timeout=5)
        assert "did not finish within 5 s" in str(hung.value) and "threading.py" in str(hung.value)
        assert _gone(first)  # the hung job's whole launch was killed
        second = pool.run(pid, timeout=120)  # a fresh launch
        assert set(second).isdisjoint(first)
        with pytest.raises(RanksFailed) as died:
            pool.run(die, timeout=60)
        assert "rank 1: died" in str(died.value)
        third = pool.run(pid, timeout=120)
    finally:
        pool.close()
    assert _gone(second) and _gone(third)
    assert find_launcher("mpiexec") is not None


def test_closing_a_launched_pool_ends_mpiexec_and_its_ranks() -> None:
    pool = RankPool(3, launcher="mpiexec")
    pids = pool.run(pid, timeout=120)
    ranks = pool._ranks
    assert ranks is not None
    launcher = ranks.launcher  # type: ignore[union-attr]
    pool.close()
    assert launcher.poll() is not None
    assert _gone(pids)


# -- pg-core bench: ranks through mpiexec, raw mpi4py as the baseline ---------------------------------


@pytest.mark.slow
def test_bench_runs_pg_mpi_beside_raw_mpi4py_under_mpiexec() -> None:
    cmd = [sys.executable, "-m", "pg_core", "bench", "--backends", "mpi", "--baseline", "mpi4py", "--world-size", "2"]
    cmd += ["--ops", "all_reduce,send_recv", "--sizes", "4,64K", "--iters", "5", "--warmup", "1", "--json", "--quiet"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr
    rows = json.loads(run.stdout)
    got = {(r["op"], r["requested_size"], r["backend"]) for r in rows}
    assert got == {
        (op, size, b) for op in ("all_reduce", "send_recv") for size in (4, 65536) for b in ("mpi4py", "mpi")
    }
    for r in rows:
        assert r["status"] == "ok", r  # correctness-checked on every rank
        if r["backend"] == "mpi":
            assert r["ratio_to"] == "mpi4py" and r["ratio"] > 0, r
        else:
            assert r["baseline"] and r["ratio"] is None, r


@pytest.mark.slow
@pytest.mark.requires_backend("tcp", "gloo")
def test_bench_runs_tcp_gloo_and_mpi_in_one_run_beside_both_raw_baselines() -> None:
    """One invocation, one table: mpiexec starts every rank (pg-mpi needs it; the others do not
    mind), and the default baselines are torch's Gloo and, since mpiexec starts the ranks, raw mpi4py;
    each backend is compared with its own library's."""
    cmd = [sys.executable, "-m", "pg_core", "bench", "--backends", "tcp,gloo,mpi", "--world-size", "2"]
    cmd += ["--ops", "all_reduce", "-b", "8", "-e", "64K", "-f", "8192", "--iters", "5", "--warmup", "1"]
    cmd += ["--time-budget", "0.2", "--json", "--quiet"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr
    rows = json.loads(run.stdout)
    backends = ["torch-gloo", "mpi4py", "tcp", "gloo", "mpi"]
    assert [(r["requested_size"], r["backend"]) for r in rows] == [(s, b) for s in (8, 65536) for b in backends]
    own = {"tcp": "torch-gloo", "gloo": "torch-gloo", "mpi": "mpi4py"}
    for r in rows:
        assert r["status"] == "ok" and r["op"] == "all_reduce" and r["world_size"] == 2, r
        assert r["ratio_to"] == own.get(r["backend"]), r
        assert (r["ratio"] is None) == r["baseline"], r
