"""What a newcomer meets in the first hour, across real processes: a rank that never shows up
is named as such, the store a client waits for is waited for within the timeout and can be
interrupted, and torch's habits (``get_rank``, ``local_rank``, torch-style object lists,
``DistributedSampler``) work on a group."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta

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
        assert "never published" not in message and "peers=(2,)" in message, (rank, message)
        other = 1 - rank  # present, and waiting in the same all_reduce: not to be listed as missing
        assert f"rank(s) {other}" not in message and f"{other}, 2" not in message, (rank, message)


# -- a client waiting for a store that never comes ---------------------------------------------------

WAITER = """
import sys, time
from datetime import timedelta
from pg_core import TCPStore
from pg_core.errors import StoreUnavailableError
print("waiting", flush=True)
start = time.monotonic()
try:
    TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=float(sys.argv[2])))
except StoreUnavailableError as exc:
    print(f"gave up after {time.monotonic() - start:.1f} s: {exc}", flush=True)
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


def test_a_client_started_before_its_store_connects_once_the_store_is_up() -> None:
    from pg_core import TCPStore

    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pg_core import TCPStore; TCPStore('127.0.0.1', int(sys.argv[1])).set('k', 'v')",
            str(port),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        host = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
        host.wait(["k"], timedelta(seconds=60))
        assert host.get("k") == b"v"
        assert proc.wait(timeout=60) == 0
        assert isinstance(host, torch.distributed.TCPStore)  # torch's store: everything torch takes, it takes
    finally:
        proc.kill()
