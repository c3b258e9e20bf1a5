"""The store's lifetime, in real processes over a real ``TCPStore``: the rank that hosts the
store finishing first no longer takes the store from the others (its shutdown waits for them
to leave, at most the group's timeout); ``StoreServer`` hosts it apart from the ranks; and a
store whose host died is a short :class:`~pg_core.StoreUnavailableError`, not torch's
``DistNetworkError`` with pages of C++ frames.

Each rank is this file run as a script (``python test_store_lifetime.py SCENARIO RANK SIZE
PORT BACKEND``): port 0 hosts the store (``is_master=True``) and reports the port it got.
Ranks report events as ``@@ {json}`` lines and wait for words from the test on stdin, so
every step is ordered by the test, never by a sleep.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from pg_core import PeerFailureError, ProcessGroup, StoreServer, StoreUnavailableError, TCPStore
from pg_core.store import (
    GuardedStore,
    PrefixStore,
    _listening_addresses,
    _local_addresses,
    hosts_store,
    store_address,
    store_host,
)

PREFIX = "@@ "
SCENARIO_LIMIT_S = 120.0  # a whole scenario, process start-up on a loaded 2-core machine included
OP_TIMEOUT_S = 60.0  # operations that wait for every rank to have started
LEAVE_TIMEOUT_S = 3.0  # the group timeout that bounds the host's wait in test_host_waits_at_most_its_timeout


# -- the test side --------------------------------------------------------------------------------


class Ranks:
    """The rank processes of one scenario: started, told, heard from, and always reaped."""

    def __init__(self, scenario: str, size: int, backend: str, tmp_path: Path) -> None:
        self.scenario, self.size, self.backend, self._tmp = scenario, size, backend, tmp_path
        self.procs: dict[int, subprocess.Popen[str]] = {}
        self._events: dict[int, queue.Queue[dict[str, Any]]] = {}
        self.deadline = time.monotonic() + SCENARIO_LIMIT_S

    def start(self, rank: int, port: int) -> None:
        events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._events[rank] = events
        with open(self._tmp / f"rank{rank}.stderr", "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, __file__, self.scenario, str(rank), str(self.size), str(port), self.backend],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
        self.procs[rank] = proc
        threading.Thread(target=self._read, args=(proc, events), daemon=True).start()

    @staticmethod
    def _read(proc: subprocess.Popen[str], events: queue.Queue[dict[str, Any]]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(PREFIX):
                events.put(json.loads(line[len(PREFIX) :]))
        events.put({"event": "eof"})

    def left_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def expect(self, rank: int, event: str) -> dict[str, Any]:
        """Rank ``rank``'s next report, which must be ``event``."""
        try:
            heard = self._events[rank].get(timeout=self.left_s())
        except queue.Empty:
            pytest.fail(f"rank {rank} did not report {event!r} within {SCENARIO_LIMIT_S:g} s{self.stderr(rank)}")
        if heard["event"] != event:
            pytest.fail(f"rank {rank} reported {heard} instead of {event!r}{self.stderr(rank)}")
        return heard

    def tell(self, rank: int, word: str) -> None:
        stdin = self.procs[rank].stdin
        assert stdin is not None
        stdin.write(word + "\n")
        stdin.flush()

    def exit_code(self, rank: int) -> int:
        try:
            return self.procs[rank].wait(timeout=self.left_s())
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank {rank} did not exit within {SCENARIO_LIMIT_S:g} s{self.stderr(rank)}")

    def stderr(self, rank: int) -> str:
        text = (self._tmp / f"rank{rank}.stderr").read_text(errors="replace")
        return f"; its stderr:\n{text[-4000:]}" if text else ""

    def reap(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.stdin is not None:
                proc.stdin.close()
            if proc.stdout is not None:
                proc.stdout.close()


@pytest.fixture
def ranks(tmp_path: Path):  # type: ignore[no-untyped-def]
    made: list[Ranks] = []

    def make(scenario: str, size: int, backend: str = "tcp") -> Ranks:
        made.append(Ranks(scenario, size, backend, tmp_path))
        return made[-1]

    yield make
    for r in made:
        r.reap()


def _start_hosted(r: Ranks) -> tuple[int, TCPStore]:
    """Start rank 0, which hosts the store, then the others; the port and a client of the test's own."""
    r.start(0, 0)
    port = int(r.expect(0, "port")["port"])
    for rank in range(1, r.size):
        r.start(rank, port)
    return port, TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))


def _until_host_gone_or_leaving(r: Ranks, client: TCPStore) -> None:
    """Wait until rank 0 (the host) has exited, or has left its group and waits in shutdown() for the
    others: the moment the others' work would meet a dead store if the host did not wait. A bounded
    poll of two conditions (the process, a store key), not a synchronisation by time."""
    left = "pg-core/world/0/left/0"  # membership's layout: <namespace>/<name>/<generation>/left/<rank>
    while r.procs[0].poll() is None:
        try:
            if client.check([left]):
                return
        except RuntimeError:  # the store went with its host: rank 0 is exiting
            r.procs[0].wait(timeout=r.left_s())
            return
        try:
            r.procs[0].wait(timeout=0.01)
        except subprocess.TimeoutExpired:
            if r.left_s() <= 0:
                pytest.fail("rank 0 neither left its group nor exited")


# -- the tests ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("tcp", marks=pytest.mark.requires_backend("tcp")),
        pytest.param("gloo", marks=pytest.mark.requires_backend("gloo")),
    ],
)
def test_host_finishing_first_keeps_the_store_for_the_others(ranks: Callable[..., Ranks], backend: str) -> None:
    """The README's pattern: rank 0 hosts the store and has less work. The others form a subgroup,
    connect anew (pg-tcp reads addresses from the store) and shut down after rank 0 called
    shutdown(); they all finish cleanly, and rank 0's shutdown returns once they left."""
    r = ranks("host_first", 4, backend)
    _port, client = _start_hosted(r)
    for rank in range(4):
        assert r.expect(rank, "reduced")["value"] == [10.0] * 4
    _until_host_gone_or_leaving(r, client)
    del client
    for rank in (1, 2, 3):
        r.tell(rank, "go")
    for rank in (1, 2, 3):
        done = r.expect(rank, "done")
        assert done["sub"] == [3.0] * 3
        if rank == 3:
            assert done["received"] == [0.0, 1.0, 2.0]
    r.expect(0, "left")
    assert [r.exit_code(rank) for rank in range(4)] == [0, 0, 0, 0], [r.stderr(k) for k in range(4)]


@pytest.mark.requires_backend("tcp")
def test_host_waits_at_most_its_timeout_and_names_who_did_not_leave(ranks: Callable[..., Ranks]) -> None:
    """A member killed before it left: the host's shutdown returns after the group's timeout (not
    the default 300 s), warning that rank 2 did not leave; the member that did leave is not named."""
    r = ranks("never_leaves", 3)
    _port, client = _start_hosted(r)
    del client
    for rank in range(3):
        r.expect(rank, "reduced")
    r.procs[2].send_signal(signal.SIGKILL)
    assert r.exit_code(2) == -signal.SIGKILL
    r.expect(1, "left")
    r.tell(0, "go")
    left = r.expect(0, "left")
    assert LEAVE_TIMEOUT_S - 0.5 <= left["took"] <= LEAVE_TIMEOUT_S + 10.0, left
    (warning,) = left["warnings"]
    assert "rank(s) 2 did not" in warning, warning
    ((filename, line),) = left["at"]  # the user's `with` line, not pg-core's own frames
    assert Path(filename).resolve() == Path(__file__).resolve() and "with group:" in _line(line), (filename, line)
    assert "rank 0 hosts the store at 127.0.0.1:" in warning, warning
    assert r.exit_code(0) == 0 and r.exit_code(1) == 0


@pytest.mark.requires_backend("tcp")
def test_store_server_outlives_every_rank(ranks: Callable[..., Ranks]) -> None:
    """StoreServer hosts the store in the test process: rank 0 exits first, without waiting for
    anyone (it does not host), and ranks 1 and 2 still form a subgroup and talk."""
    with StoreServer() as server:
        assert server.host == "127.0.0.1" and server.address == f"127.0.0.1:{server.port}" and server.port > 0
        r = ranks("server", 3)
        for rank in range(3):
            r.start(rank, server.port)
        for rank in range(3):
            assert r.expect(rank, "reduced")["value"] == [6.0] * 4
        assert r.expect(0, "left")["warnings"] == []
        assert r.exit_code(0) == 0  # gone before the others go on
        for rank in (1, 2):
            r.tell(rank, "go")
        for rank in (1, 2):
            assert r.expect(rank, "done")["sub"] == [2.0] * 3
        assert r.exit_code(1) == 0 and r.exit_code(2) == 0
        port = server.port
    assert server.closed
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_store_server_hosts_until_closed() -> None:
    """In one process: the server's store is hosted here, a client's is not (they share the port),
    and close() releases the port."""
    server = StoreServer(port=0)
    try:
        client = TCPStore(server.host, server.port, is_master=False, timeout=timedelta(seconds=10))
        client.set("k", "v")
        assert server.store.get("k") == b"v"
        assert hosts_store(server.store) and hosts_store(client)  # the port is served from this process
        assert repr(server) == f"<StoreServer 127.0.0.1:{server.port}>"
        del client
    finally:
        server.close()
    assert server.closed and "closed" in repr(server)
    with pytest.raises(RuntimeError, match="is closed"):
        _ = server.store
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.port), timeout=5).close()


def test_hosting_means_this_port_listening_here_on_the_stores_own_host() -> None:
    """What hosts_store combines: the addresses this process listens on at a port (as bound, or
    the wildcard), and the addresses of a host that are this machine's (none for a host
    elsewhere, so a store there is not hosted here even if this process serves its port number)."""
    with socket.socket() as one, socket.socket() as every:
        one.bind(("127.0.0.1", 0))
        one.listen()
        every.bind(("0.0.0.0", 0))
        every.listen()
        port = one.getsockname()[1]
        assert _listening_addresses(port) == {"127.0.0.1"}
        assert _listening_addresses(every.getsockname()[1]) == {"0.0.0.0"}
    assert _listening_addresses(port) == set()  # closed: nothing listens
    assert _local_addresses("127.0.0.1") == {"127.0.0.1"} and "127.0.0.1" in _local_addresses("localhost")
    assert _local_addresses("192.0.2.1") == set()  # TEST-NET-1: never this machine's
    assert _local_addresses("no-such-host.invalid") == set()


def test_a_guarded_store_translates_a_lost_server_once_and_carries_what_torch_forwards() -> None:
    """In one process: through a PrefixStore (as every backend sees it), the methods torch forwards
    to a Python store work; once the server is gone, the first call is StoreUnavailableError naming
    the address, and later ones are too, without asking torch again."""
    server = StoreServer()
    client = TCPStore(server.host, server.port, is_master=False, timeout=timedelta(seconds=10))
    guarded = GuardedStore(client)
    prefixed = PrefixStore("group", guarded)
    prefixed.set("a", "1")
    prefixed.multi_set(["b"], ["2"])
    assert prefixed.multi_get(["a", "b"]) == [b"1", b"2"] and prefixed.add("n", 2) == 2
    assert prefixed.compare_set("c", "", "3") == b"3" and prefixed.check(["a", "c"])
    assert prefixed.num_keys() >= 4 and prefixed.delete_key("c") and not prefixed.check(["c"])
    assert store_address(prefixed) == server.address and store_host(prefixed) == "127.0.0.1"
    server.close()  # nothing else here holds the server: it stops
    with pytest.raises(StoreUnavailableError) as first:
        prefixed.get("a")
    assert first.value.address == server.address and isinstance(first.value, PeerFailureError)
    assert first.value.__suppress_context__ and first.value.__cause__ is None
    with pytest.raises(StoreUnavailableError, match=f"the store at {server.address} is gone"):
        guarded.check(["a"])


@pytest.mark.requires_backend("tcp")
def test_ranks_in_the_hosting_process_are_not_waited_for() -> None:
    """Threads as ranks, in the process that hosts the store: they cannot outlive it, so shutting
    them down one after another never waits for the next (it would take the group's timeout)."""
    timeout = 30.0
    with StoreServer() as server:
        groups: list[ProcessGroup] = []
        for rank in range(3):  # forming never waits for the others
            groups.append(ProcessGroup(server.store, rank=rank, size=3, backends="tcp", timeout=timeout))
        threads = [threading.Thread(target=g.all_reduce, args=(torch.ones(2),)) for g in groups]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=OP_TIMEOUT_S)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = time.monotonic()
            for g in groups:
                g.shutdown()
            took = time.monotonic() - start
    assert [str(w.message) for w in caught] == [] and took < timeout / 2, took


@pytest.mark.requires_backend("tcp")
def test_a_dead_store_host_is_a_short_pg_core_error(ranks: Callable[..., Ranks]) -> None:
    """Rank 0 hosts the store and dies (no shutdown). Whatever the others then ask of the store (a
    new group; a backend created now; pg-tcp reading the address of a peer it never talked to)
    raises StoreUnavailableError, a PeerFailureError naming the address and what to do, short,
    with no C++ frames and no torch error chained; and each rank still shuts down cleanly."""
    r = ranks("host_dies", 4)
    port, client = _start_hosted(r)
    del client
    for rank in range(4):
        r.expect(rank, "reduced")
    assert r.exit_code(0) == 0
    for rank in (1, 2, 3):
        r.tell(rank, "go")
    expected = ["new group", "a backend created now"]
    for rank in (1, 2, 3):
        outcomes = r.expect(rank, "tried")["outcomes"]
        assert [o["what"] for o in outcomes] == expected + (["a new connection"] if rank == 1 else [])
        for o in outcomes:
            assert o["type"] == "StoreUnavailableError" and o["peer_failure"], o
            message = o["message"]
            assert f"the store at 127.0.0.1:{port} is gone" in message and "has exited" in message, message
            assert "StoreServer" in message and "shutdown()" in message, message
            assert "frame #" not in message and len(message) < 400, message
            assert not o["chained"], o
        assert r.expect(rank, "closed")
        assert r.exit_code(rank) == 0


# -- the rank side --------------------------------------------------------------------------------


def _report(event: str, **data: Any) -> None:
    print(PREFIX + json.dumps({"event": event, **data}), flush=True)


def _hear(word: str) -> None:
    heard = sys.stdin.readline().strip()
    if heard != word:  # "" when the test is gone: end, rather than wait for nobody
        raise SystemExit(f"expected {word!r} from the test, got {heard!r}")


def _world(store: TCPStore, rank: int, size: int, backend: str, timeout: float = OP_TIMEOUT_S) -> ProcessGroup:
    group = ProcessGroup(store, rank=rank, size=size, backends=backend, timeout=timeout)
    t = torch.full((4,), float(rank + 1))
    group.all_reduce(t, timeout=OP_TIMEOUT_S)
    _report("reduced", value=t.tolist())
    return group


def host_first(store: TCPStore, rank: int, size: int, backend: str) -> None:
    group = _world(store, rank, size, backend)
    if rank == 0:
        group.shutdown()
        _report("left")
        return
    _hear("go")
    sub = group.new_group([1, 2, 3])
    s = torch.ones(3)
    sub.all_reduce(s)
    received = torch.empty(3)
    if rank == 1:  # point to point on the world group, after its host left it
        group.send(torch.arange(3.0), dst=3)
    elif rank == 3:
        group.recv(received, src=1)
    sub.shutdown()
    group.shutdown()
    _report("done", sub=s.tolist(), received=received.tolist() if rank == 3 else None)


def _line(number: int) -> str:
    return Path(__file__).read_text().splitlines()[number - 1]


def never_leaves(store: TCPStore, rank: int, size: int, backend: str) -> None:
    group = _world(store, rank, size, backend, timeout=LEAVE_TIMEOUT_S)
    if rank == 2:
        _hear("never")  # killed here
    elif rank == 1:
        group.shutdown()
        _report("left")
    else:
        _hear("go")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = time.monotonic()
            with group:  # the block's end is the shutdown: the warning points here, at the user's line
                pass
            took = time.monotonic() - start
        _report(
            "left", took=took, warnings=[str(w.message) for w in caught], at=[(w.filename, w.lineno) for w in caught]
        )


def server(store: TCPStore, rank: int, size: int, backend: str) -> None:
    group = _world(store, rank, size, backend)
    if rank == 0:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            group.shutdown()  # not the host: returns at once (a host would wait for ranks 1, 2, and warn)
        _report("left", warnings=[str(w.message) for w in caught])
        return
    _hear("go")
    sub = group.new_group([1, 2])
    s = torch.ones(3)
    sub.all_reduce(s)
    sub.shutdown()
    group.shutdown()
    _report("done", sub=s.tolist())


def host_dies(store: TCPStore, rank: int, size: int, backend: str) -> None:
    group = _world(store, rank, size, backend)
    # formed now, used after the store is gone: their backends (and connections) are made then
    fresh = ProcessGroup(store, rank=rank, size=size, backends=backend, name="fresh", timeout=OP_TIMEOUT_S)
    pairs = ProcessGroup(store, rank=rank, size=size, backends=backend, name="pairs", timeout=OP_TIMEOUT_S)
    t = torch.ones(2)
    if rank in (1, 3):  # pg-tcp connects 1-2 and 3-0 only: every backend made, 1 never met 3
        pairs.send(t, dst=rank + 1 if rank == 1 else 0)
    else:
        pairs.recv(t, src=1 if rank == 2 else 3)
    group.barrier()  # every rank is done with the store: rank 1's send to 2 read 2's address
    if rank == 0:
        os._exit(0)  # dies with the store: no shutdown, no goodbye
    _hear("go")
    attempts: list[tuple[str, Callable[[], Any]]] = [
        ("new group", lambda: group.new_group([1, 2, 3])),
        ("a backend created now", lambda: fresh.all_reduce(torch.ones(2))),
    ]
    if rank == 1:
        attempts.append(("a new connection", lambda: pairs.send(t, dst=3)))
    outcomes = []
    for what, attempt in attempts:
        try:
            attempt()
        except Exception as exc:
            outcomes.append(
                {
                    "what": what,
                    "type": type(exc).__name__,
                    "peer_failure": isinstance(exc, StoreUnavailableError) and isinstance(exc, PeerFailureError),
                    "message": str(exc),
                    "chained": exc.__cause__ is not None
                    or (exc.__context__ is not None and not exc.__suppress_context__),
                }
            )
        else:
            outcomes.append({"what": what, "type": "(succeeded)"})
    _report("tried", outcomes=outcomes)
    for g in (fresh, pairs, group):  # their own resources go; leaving needs no store that is gone
        g.shutdown()
    _report("closed")


SCENARIOS: dict[str, Callable[[TCPStore, int, int, str], None]] = {
    "host_first": host_first,
    "never_leaves": never_leaves,
    "server": server,
    "host_dies": host_dies,
}


def _main(argv: list[str]) -> None:
    scenario, rank, size, port, backend = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    watchdog = threading.Timer(SCENARIO_LIMIT_S, os._exit, args=(3,))  # should the test be gone
    watchdog.daemon = True
    watchdog.start()
    try:
        store = TCPStore("127.0.0.1", port, is_master=port == 0, wait_for_workers=False, timeout=timedelta(seconds=30))
        if port == 0:
            _report("port", port=store.port)
        SCENARIOS[scenario](store, rank, size, backend)
    except BaseException:
        _report("error", traceback=traceback.format_exc())
        raise
    finally:
        sys.stdout.flush()


if __name__ == "__main__":
    _main(sys.argv[1:])
