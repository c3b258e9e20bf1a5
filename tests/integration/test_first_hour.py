"""What a newcomer meets in the first hour, across real processes: a rank that never shows up
is named as such, the store a client waits for is waited for within the timeout and can be
interrupted, and torch's habits (``get_rank``, ``local_rank``, torch-style object lists,
``DistributedSampler``) work on a group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
from pg_core import ProcessGroup
from pg_core.errors import CollectiveTimeout
from pg_core.testing.pool import RankContext, RankPool

Pools = Callable[[int], RankPool]


def one_rank_stays_away(ctx: RankContext, backend: str) -> str | None:
    if ctx.rank == ctx.size - 1:
        return None  # this rank never creates the group
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends=backend, timeout=3)
    try:
        group.all_reduce(torch.ones(2))
    except CollectiveTimeout as exc:
        return f"{exc} | peers={exc.peers}"
    finally:
        group.abort()
    return "completed"


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("tcp", marks=pytest.mark.requires_backend("tcp")),
        pytest.param("gloo", marks=pytest.mark.requires_backend("gloo")),
    ],
)
def test_a_rank_that_never_joins_is_named_as_the_one_that_never_joined(rank_pools: Pools, backend: str) -> None:
    results = rank_pools(3).run(one_rank_stays_away, backend, timeout=60)
    for rank, message in enumerate(results[:2]):
        assert message is not None and "rank 2 of 3 never joined group 'world'" in message, (rank, message)
        assert "publish its address" not in message and "peers=(2,)" in message, (rank, message)
        other = 1 - rank  # present, and waiting in the same all_reduce: not to be listed as missing
        assert f"rank(s) {other}" not in message and f"{other}, 2" not in message, (rank, message)


# -- a client waiting for a store that never comes ---------------------------------------------------

WAITER = """
import sys, time, traceback
from datetime import timedelta
from pg_core import TCPStore
from pg_core.errors import StoreUnavailableError
start = time.monotonic()
try:
    print("waiting", flush=True)
    TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=float(sys.argv[2])))
except StoreUnavailableError as exc:
    took = time.monotonic() - start
    traceback.TracebackException.from_exception(exc, capture_locals=True)  # reprs every frame's locals
    print(f"gave up after {took:.1f} s: {exc}", flush=True)
except KeyboardInterrupt:
    print(f"interrupted after {time.monotonic() - start:.1f} s", flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _waiter(port: int, timeout: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", WAITER, str(port), str(timeout)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "waiting\n"
    return proc


def test_a_client_waits_for_a_store_that_never_comes_within_its_timeout_and_says_why() -> None:
    proc = _waiter(_free_port(), 2.0)
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "gave up after" in out and "no store server" in out and "is_master=True" in out, out
    took = float(out.split("gave up after ", 1)[1].split(" s", 1)[0])
    assert 1.5 <= took < 10.0, out  # torch's own client takes twice its timeout, and more


def test_a_client_waiting_for_its_store_is_interrupted_by_ctrl_c() -> None:
    proc = _waiter(_free_port(), 300.0)
    try:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert "interrupted after" in out, out


EARLY_CLIENT = """
import socket, sys
real = socket.create_connection
told = []
def create_connection(*args, **kwargs):  # says when the client found nobody listening yet
    try:
        return real(*args, **kwargs)
    except OSError:
        if not told:
            told.append(print("refused", flush=True))
        raise
socket.create_connection = create_connection
from pg_core import TCPStore
store = TCPStore("127.0.0.1", int(sys.argv[1]), timeout=60)  # seconds, as the rest of pg-core takes them
store.set("k", "v")
"""


def test_a_client_started_before_its_store_connects_once_the_store_is_up() -> None:
    from pg_core import TCPStore

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", EARLY_CLIENT, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "refused\n"  # it is waiting: now host the store
        host = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
        host.wait(["k"], timedelta(seconds=60))
        assert host.get("k") == b"v"
        assert proc.wait(timeout=60) == 0
        assert isinstance(host, torch.distributed.TCPStore)  # torch's store: everything torch takes, it takes
        assert isinstance(host, TCPStore) and issubclass(torch.distributed.TCPStore, TCPStore)
    finally:
        proc.kill()
    with pytest.raises(TypeError, match="subclass torch.distributed.TCPStore instead"):
        type("Mine", (TCPStore,), {})


# -- a torch user's habits -----------------------------------------------------------------------------


def torch_habits(ctx: RankContext, backend: str) -> dict[str, Any]:
    from torch.utils.data import DistributedSampler

    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends=backend, timeout=ctx.timeout)
    try:
        out: dict[str, Any] = {"rank": group.get_rank(), "size": group.get_world_size()}
        gathered: list[Any] = [None] * ctx.size
        out["returned"] = group.all_gather_object(gathered, {"r": ctx.rank})  # torch's order: list, then obj
        out["gathered"] = gathered
        keyword: list[Any] = [None] * ctx.size
        group.all_gather_object(object_list=keyword, obj=ctx.rank * 10)
        out["keyword"] = keyword
        out["ours"] = group.all_gather_object(ctx.rank)  # pg-core's own form returns the list
        out["ours_keyword"] = group.all_gather_object(obj=ctx.rank + 1)
        mixed: list[Any] = [None] * ctx.size
        group.all_gather_object(mixed, obj=-1)  # torch accepts the object by keyword after the list
        out["mixed"] = mixed
        try:
            group.all_gather_object(None, ctx.rank)
        except TypeError as exc:
            out["none_list"] = str(exc)
        async_list: list[Any] = [None] * ctx.size
        work = group.all_gather_object(async_list, -ctx.rank, async_op=True)
        work.wait()
        out["async"] = async_list
        objects = ["a", {"b": 1}, None] if ctx.rank == 1 else [None, None, None]
        out["bcast_returned"] = group.broadcast_object_list(objects, src=1)
        out["bcast"] = objects
        try:
            group.all_gather_object([None] * (ctx.size + 1), ctx.rank)
        except ValueError as exc:
            out["wrong_length"] = str(exc)
        sampler = DistributedSampler(range(10), num_replicas=group.size, rank=group.rank, shuffle=False)
        out["sampled"] = list(sampler)
        out["default_group"] = torch.distributed.is_initialized()
        return out
    finally:
        group.shutdown()


@pytest.mark.requires_backend("tcp")
def test_torch_habits_work_on_a_group(rank_pools: Pools) -> None:
    n = 3
    results = rank_pools(n).run(torch_habits, "tcp", timeout=120)
    for rank, out in enumerate(results):
        assert (out["rank"], out["size"]) == (rank, n)
        assert out["returned"] is None and out["gathered"] == [{"r": r} for r in range(n)]
        assert out["keyword"] == [0, 10, 20]
        assert out["ours"] == [0, 1, 2] and out["ours_keyword"] == [1, 2, 3]
        assert out["mixed"] == [-1, -1, -1]
        assert "object_list must be a list, got NoneType" in out["none_list"]
        assert out["async"] == [0, -1, -2]
        assert out["bcast_returned"] is None and out["bcast"] == ["a", {"b": 1}, None]
        assert "object_list has 4 entries" in out["wrong_length"] and "size 3" in out["wrong_length"]
        padded = [*range(10), 0, 1]  # torch's sampler pads 10 items to 12, a multiple of 3, from the start
        assert out["sampled"] == padded[rank::n]
        assert out["default_group"] is False


@pytest.mark.requires_backend("tcp")
def test_local_rank_comes_from_the_launchers_variables() -> None:
    from pg_core import StoreServer

    with StoreServer() as server:
        for env, local in (
            ({"PG_RANK": "0", "PG_WORLD_SIZE": "1", "PG_LOCAL_RANK": "1", "PG_STORE": server.address}, 1),
            (
                {
                    "RANK": "0",
                    "WORLD_SIZE": "1",
                    "LOCAL_RANK": "1",
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(server.port),
                    "TORCHELASTIC_USE_AGENT_STORE": "True",  # torchrun's agent hosts the store: a client here
                },
                1,
            ),
        ):
            with ProcessGroup.from_env("tcp", env=env, timeout=30) as group:
                assert group.local_rank == local
                with group.new_group([0]) as sub:  # the process's, whichever group is asked
                    assert sub.local_rank == local
                with group.split(color=0) as part:
                    assert part.local_rank == local
    script = "from pg_core import HashStore, ProcessGroup\nwith ProcessGroup(HashStore(), 0, 1, backends='tcp') as g: print(g.local_rank)"
    clean = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "PG_LOCAL_RANK",
            "LOCAL_RANK",
            "SLURM_LOCALID",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "MPI_LOCALRANKID",
            "PG_RANK",
            "RANK",
            "SLURM_PROCID",
            "PMI_RANK",
            "OMPI_COMM_WORLD_RANK",
        )
    }
    for extra, shown in (({}, "None"), ({"LOCAL_RANK": "3", "RANK": "5", "WORLD_SIZE": "8"}, "3")):
        got = subprocess.run(
            [sys.executable, "-c", script],
            env={**clean, **extra},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert got.stdout.strip() == shown, got.stderr
