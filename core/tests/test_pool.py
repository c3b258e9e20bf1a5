"""The rank-process pool that every multi-rank test runs on must itself be trustworthy:
results come back per rank, failures carry tracebacks, hangs end with stack dumps,
deaths and leaks are reported."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from pg_core.testing.pool import RankPool, RanksFailed


def exchange(ctx, x):
    ctx.store.set(f"k{ctx.rank}", str(ctx.rank * x))
    peer = (ctx.rank + 1) % ctx.size
    ctx.store.wait([f"k{peer}"])
    return int(ctx.store.get(f"k{peer}"))


def raise_on_rank_1(ctx):
    if ctx.rank == 1:
        raise ValueError("planted failure")


def hang_on_rank_0(ctx):
    if ctx.rank == 0:
        threading.Event().wait(3600)  # past the test's hang guard: only the pool's timeout ends it in time


def exit_on_rank_1(ctx):
    if ctx.rank == 1:
        os._exit(3)


def leak_a_thread(ctx):
    threading.Thread(target=time.sleep, args=(30,), daemon=True, name="leaky").start()


def test_results_come_back_per_rank_and_store_namespaces_are_per_call(rank_pools):
    pool = rank_pools(3)
    assert pool.run(exchange, 10) == [10, 20, 0]
    assert pool.run(exchange, 1) == [1, 2, 0]  # same keys, fresh namespace


def test_an_exception_fails_the_call_with_its_traceback(rank_pools):
    with pytest.raises(RanksFailed, match="rank 1: raised ValueError: planted failure") as info:
        rank_pools(3).run(raise_on_rank_1)
    assert set(info.value.outcomes) == {1}


@pytest.mark.timeout(120)  # hang guard: a pool that ignored its timeout would wait out the hour
def test_a_hang_ends_at_the_timeout_with_stacks_and_the_pool_recovers(rank_pools):
    pool = rank_pools(3)
    with pytest.raises(RanksFailed, match=r"did not finish within 3 s(.|\n)*in hang_on_rank_0") as info:
        pool.run(hang_on_rank_0, timeout=3)
    assert set(info.value.outcomes) == {0}, info.value.outcomes  # the hung rank, not the others
    assert pool.run(exchange, 2) == [2, 4, 0]


def test_deaths_are_reported_unless_expected(rank_pools):
    pool = rank_pools(3)
    assert pool.run(exit_on_rank_1, may_exit=[1]) == [None, None, None]
    with pytest.raises(RanksFailed, match=r"rank 1: died \(exit code 3\)"):
        pool.run(exit_on_rank_1)
    assert pool.run(exchange, 3) == [3, 6, 0]


def test_leaked_threads_fail_the_call(rank_pools):
    with pytest.raises(RanksFailed, match="leaked threads"):
        rank_pools(2).run(leak_a_thread)


def drop_a_socket_inside_a_reference_cycle(ctx):
    """A listening socket that only a reference cycle keeps (as an exception's traceback
    keeps a closed backend's frames): the collector frees it, so it is no leak."""
    import gc
    import socket

    gc.disable()  # until the next call: only the leak check's own collection can free the cycle
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    cycle: dict = {"socket": listener}
    cycle["self"] = cycle


def enable_the_collector(ctx):
    import gc

    gc.enable()


def test_what_only_the_collector_frees_is_not_a_leak(rank_pools):
    pool = rank_pools(2)
    try:
        assert pool.run(drop_a_socket_inside_a_reference_cycle) == [None, None]
    finally:
        pool.run(enable_the_collector)


_PROCESS_WIDE: list = []  # what a library starts once per process and keeps (NCCL's RAS service, say)


def start_a_process_wide_listener(ctx):
    """Once per process, as a library's service would: a listening socket kept for good."""
    if not _PROCESS_WIDE:
        import socket

        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        _PROCESS_WIDE.append(listener)


def test_a_leaked_socket_is_named_by_what_it_is(rank_pools):
    from pg_core.testing.pool import RankPool

    with RankPool(1) as pool, pytest.raises(RanksFailed, match=r"socket:\[\d+\] \(tcp 0100007F:[0-9A-F]{4} -> "):
        pool.run(start_a_process_wide_listener)


def test_a_prelude_starts_process_wide_services_before_the_leak_check_and_again_after_a_restart():
    from pg_core.testing.pool import RankPool

    with RankPool(2, prelude=(start_a_process_wide_listener, ())) as pool:
        assert pool.run(start_a_process_wide_listener) == [None, None]  # started by the prelude: no leak
        assert pool.run(exit_on_rank_1, may_exit=[1]) == [None, None]  # the workers restart on the next call
        assert pool.run(start_a_process_wide_listener) == [None, None]  # the prelude ran again in the new ones
        with pytest.raises(RanksFailed, match="leaked threads"):
            pool.run(leak_a_thread)  # anything else a call leaves is still found


def _folders(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("pg-core-pool-"))


@pytest.fixture
def own_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temporary directory of the test's own, for this process (tempfile) and its children (TMPDIR)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile reads TMPDIR again
    return tmp


@pytest.mark.timeout(240)
def test_a_pool_removes_its_folder_when_it_closes_and_a_dead_pools_when_it_respawns(own_tmp: Path) -> None:
    pool = RankPool(2)
    assert _folders(own_tmp) == []  # made when the workers start
    assert pool.run(exchange, 1) == [1, 0]
    (first,) = _folders(own_tmp)
    assert first.startswith(f"pg-core-pool-{os.getpid()}-")
    pool.run(exit_on_rank_1, may_exit=[1])  # the pool is dead: the next call starts fresh workers
    assert pool.run(exchange, 2) == [2, 0]
    (second,) = _folders(own_tmp)
    assert second != first
    pool.close()
    assert _folders(own_tmp) == []


CONTROLLER = """
import sys
from pg_core.testing.pool import RankPool
sys.path.insert(0, sys.argv[1])
from test_pool import exchange
pool = RankPool(1)
pool.run(exchange, 1)
print("started", flush=True)
if sys.argv[2] == "raise":
    raise KeyboardInterrupt  # as Ctrl-C would, with the pool never closed
sys.stdin.read()  # until the test kills this controller
"""


@pytest.mark.timeout(240)
def test_a_controller_that_is_interrupted_leaves_no_folder_and_one_killed_has_its_removed_by_the_next_pool(
    own_tmp: Path,
) -> None:
    here = str(Path(__file__).parent)
    run = subprocess.run(
        [sys.executable, "-c", CONTROLLER, here, "raise"], check=False, capture_output=True, text=True, timeout=180
    )
    assert "started" in run.stdout and "KeyboardInterrupt" in run.stderr, run.stdout + run.stderr
    assert _folders(own_tmp) == []

    killed = subprocess.Popen(
        [sys.executable, "-c", CONTROLLER, here, "wait"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert killed.stdout is not None and killed.stdout.readline() == "started\n"
        (left,) = _folders(own_tmp)
        assert left.startswith(f"pg-core-pool-{killed.pid}-")
    finally:
        killed.kill()  # SIGKILL: no exit handler runs; its workers die with it
        killed.wait(30)
    with RankPool(1) as pool:
        assert pool.run(exchange, 3) == [0]
        assert left not in _folders(own_tmp)  # the gone controller's folder went when this pool started
    assert _folders(own_tmp) == []
