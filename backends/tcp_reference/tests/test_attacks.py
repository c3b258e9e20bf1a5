"""pg-tcp against peers that lie: oversized frame headers, a second claim of a live rank,
a send to a rank that was just killed, and in an authenticated job strangers without the
key, a replayed captured hello and a key holder's second claim of a live rank. (The attacks
on the store and on objects, on every backend, are tests/integration/test_attacks.py.)

Every test runs real processes over loopback sockets (the workspace's ``rank_pools``).
A stranger is a pool rank that builds no backend: it reads the victim's address from the
store and speaks pg-tcp's handshake by hand over a raw socket. Nothing here waits by
sleeping: each side waits for a store key, a socket event or a process state, bounded.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from pg_core.auth import AuthKey
from pg_core.backend import BackendContext
from pg_core.dtypes import dtype_code
from pg_core.errors import PeerFailureError, PGError
from pg_core.ops import ReduceOp
from pg_core.store import AuthenticatedStore, PrefixStore
from pg_core.testing.pool import RankContext, RankPool
from pg_tcp import handshake
from pg_tcp.backend import TCPBackend
from pg_tcp.handshake import AUTH, HELLO, HELLO_MAGIC
from pg_tcp.wire import BYTES, HEADER, MAGIC, PROTOCOL_VERSION, RAW, TENSOR

Pools = Callable[[int], RankPool]

GIB = 1 << 30
#: How much a rank's resident memory may grow while it refuses a frame (the frame itself is never allocated).
RSS_SLACK_MB = 64.0


def make_backend(
    ctx: RankContext, name: str, *, timeout: float, auth_key: AuthKey | None = None, **options: Any
) -> TCPBackend:
    return TCPBackend(
        BackendContext(
            store=PrefixStore(f"{name}/cpu/tcp", ctx.store),
            rank=ctx.rank,
            size=ctx.size,
            device=torch.device("cpu"),
            timeout=timeout,
            group_name=name,
            group_uid=f"{name}-{ctx.job}",
            backend_name="tcp",
            options=options,
            auth_key=auth_key,
        )
    )


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def hello(ctx: RankContext, name: str, as_rank: int, victim: int = 0) -> socket.socket:
    """A raw connection to ``victim`` of group ``name`` that says hello as ``as_rank``."""
    key = f"{name}/cpu/tcp/addr/{victim}"
    ctx.store.wait([key])
    host, _, port = ctx.store.get(key).decode().rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    uid = f"{name}-{ctx.job}".encode()
    sock.sendall(HELLO.pack(HELLO_MAGIC, PROTOCOL_VERSION, as_rank, 0, len(uid)) + uid)
    return sock


def header(kind: int, nbytes: int, *, tag: int = 7, dtype: int = RAW) -> bytes:
    return HEADER.pack(MAGIC, kind, 0, dtype, tag, 0, nbytes)


def wait_closed(sock: socket.socket, within: float) -> bool:
    """Whether the other end closed ``sock`` within ``within`` seconds (what it sent is read and dropped)."""
    deadline = time.monotonic() + within
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(1 << 16):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False
    return False


# -- 1. frames are bounded before allocation --------------------------------------------


def oversized_frame(ctx: RankContext, name: str, where: str, nbytes: int) -> tuple[float, float, str, Any, bool] | None:
    if ctx.rank == 1:  # the stranger: takes rank 1's place and announces nbytes
        ctx.store.wait([f"{name}/posted"])
        with hello(ctx, name, as_rank=1) as sock:
            kind = TENSOR if where == "tensor" else BYTES
            sock.sendall(header(kind, nbytes, tag=7, dtype=7 if kind == TENSOR else RAW))
            closed = wait_closed(sock, 10.0)
        ctx.store.set(f"{name}/closed", "1" if closed else "0")
        return None
    b = make_backend(ctx, name, timeout=30.0)
    try:
        before = rss_mb()
        ctx.store.set(f"{name}/posted", "1")
        with pytest.raises(PGError) as info:
            if where == "recv_bytes":  # a posted receive of unknown size: the announced size would be allocated
                b.recv_bytes(1, 7, timeout=30.0)
            elif where == "tensor":  # a posted tensor receive knows its size: 4 bytes
                b.recv(torch.empty(1), 1, 7, timeout=30.0)
            else:  # nothing posted on tag 7: the frame would be buffered ahead of its receive
                b.recv_bytes(1, 8, timeout=30.0)
        after = rss_mb()
        ctx.store.wait([f"{name}/closed"])
        closed = ctx.store.get(f"{name}/closed") == b"1"  # the stranger saw its connection dropped
        return before, after, str(info.value), (type(info.value).__name__, getattr(info.value, "peers", None)), closed
    finally:
        b.shutdown()


@pytest.mark.parametrize("where", ["recv_bytes", "unexpected"])
@pytest.mark.parametrize("nbytes", [GIB, 1 << 40], ids=["1GiB", "2**40"])
def test_an_oversized_frame_is_refused_before_allocation(rank_pools: Pools, where: str, nbytes: int) -> None:
    name = f"big-{where}-{nbytes.bit_length()}"
    result = rank_pools(2).run(oversized_frame, name, where, nbytes, timeout=90)[0]
    assert result is not None
    before, after, message, (cls, peers), closed = result
    assert after - before < RSS_SLACK_MB, f"RSS {before:.0f} -> {after:.0f} MB: {message}"
    assert cls == "PeerFailureError" and peers == (1,), message
    assert closed, "the connection that announced the frame was not dropped"
    assert "rank 1" in message and str(nbytes) in message and "max_" in message, message


def test_a_tensor_frame_larger_than_its_posted_receive_drops_the_connection(rank_pools: Pools) -> None:
    result = rank_pools(2).run(oversized_frame, "big-tensor", "tensor", 1 << 40, timeout=90)[0]
    assert result is not None
    before, after, message, (cls, peers), closed = result
    assert after - before < RSS_SLACK_MB, f"RSS {before:.0f} -> {after:.0f} MB: {message}"
    assert cls == "PeerFailureError" and peers == (1,), message
    assert closed, "the connection that announced the frame was not dropped"
    assert str(1 << 40) in message, message


def limits_from_a_real_peer(ctx: RankContext) -> tuple[str, str] | None:
    """A real peer over the limits: a byte message above max_message_bytes, and messages
    piling up ahead of their receives above max_unexpected_bytes. A tensor whose receive is
    posted may be larger than max_message_bytes: its size is known."""
    options: dict[str, Any] = {"max_message_bytes": 4096, "max_unexpected_bytes": 16384}
    results: list[str] = []
    for round_ in ("message", "unexpected"):
        b = make_backend(ctx, f"lim-{round_}", timeout=30.0, **options)
        try:
            if ctx.rank == 0:
                got = torch.empty(8192)  # 32 KiB, posted before it is sent: allowed
                b.recv(got, 1, 1, timeout=30.0)
                assert got.eq(1).all()
                ctx.store.set(f"lim-{round_}/go", "1")
                with pytest.raises(PeerFailureError) as info:
                    if round_ == "message":
                        b.recv_bytes(1, 2, timeout=30.0)
                    else:  # waiting on tag 9 while tag 3's messages pile up: four fit, the fifth does not
                        b.recv_bytes(1, 9, timeout=30.0)
                assert info.value.peers == (1,)
                results.append(str(info.value))
                ctx.store.set(f"lim-{round_}/done", "1")
            else:
                b.send(torch.ones(8192), 0, 1, timeout=30.0)
                ctx.store.wait([f"lim-{round_}/go"])
                if round_ == "message":
                    b.send_bytes(b"x" * 5000, 0, 2, timeout=30.0)
                else:
                    for _ in range(5):
                        b.send_bytes(b"y" * 4000, 0, 3, timeout=30.0)
                ctx.store.wait([f"lim-{round_}/done"])
                # the receiver dropped this connection: what needs it now fails with a pg-core error
                with pytest.raises(PeerFailureError):
                    b.recv_bytes(0, 4, timeout=30.0)
        finally:
            b.abort()
    return (results[0], results[1]) if ctx.rank == 0 else None


def test_limits_hold_against_a_real_peer(rank_pools: Pools) -> None:
    result = rank_pools(2).run(limits_from_a_real_peer, timeout=120)[0]
    assert result is not None
    message, unexpected = result
    assert "5000" in message and "max_message_bytes" in message and "rank 1" in message, message
    assert "max_unexpected_bytes" in unexpected and "rank 1" in unexpected, unexpected


def a_tensor_over_the_budget_waits_for_its_receive(ctx: RankContext) -> bool | None:
    """A legitimate tensor larger than max_unexpected_bytes that arrives before its receive
    is not buffered: it waits in the kernel (its connection parked) and is read straight into
    the receive once that is posted."""
    b = make_backend(ctx, "park", timeout=30.0, max_unexpected_bytes=4096)
    try:
        big = torch.arange(16384, dtype=torch.float32)  # 64 KiB
        if ctx.rank == 1:
            ctx.store.wait(["park/waiting"])
            b.send(big, 0, 1, timeout=30.0)
            ctx.store.set("park/sent", "1")
        elif ctx.rank == 2:
            ctx.store.wait(["park/sent"])
            b.send(torch.ones(1), 0, 0, timeout=30.0)
        parked = None
        if ctx.rank == 0:
            ctx.store.set("park/waiting", "1")
            b.recv(torch.empty(1), 2, 0, timeout=30.0)  # rank 1's frame lands while this waits
            parked = len(b._transport._parked) == 1
            got = torch.empty(16384)
            b.recv(got, 1, 1, timeout=30.0)
            assert torch.equal(got, big)
        t = torch.ones(3)
        b.all_reduce(t, ReduceOp.SUM, timeout=30.0)
        assert t.tolist() == [3.0] * 3
        return parked
    finally:
        b.shutdown()


def test_a_tensor_over_the_budget_waits_for_its_receive(rank_pools: Pools) -> None:
    assert rank_pools(3).run(a_tensor_over_the_budget_waits_for_its_receive, timeout=90)[0] is True


def bad_limit(ctx: RankContext) -> str:
    with pytest.raises(ValueError) as info:
        make_backend(ctx, "bad-limit", timeout=10.0, max_message_bytes="lots")
    return str(info.value)


def test_a_bad_limit_is_refused_by_name(rank_pools: Pools) -> None:
    message = rank_pools(1).run(bad_limit)[0]
    assert "max_message_bytes" in message and "lots" in message, message


# -- 2. a second claim of a live rank is refused ---------------------------------------------


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def impersonation(ctx: RankContext) -> list[str] | None:
    name, size = "imp", 3
    if ctx.rank == 3:  # the stranger: not a member; says hello to rank 0 as rank 2
        ctx.store.wait([f"{name}/ready"])
        with hello(ctx, name, as_rank=2) as sock:
            sock.sendall(header(BYTES, 4) + b"EVIL")
            host, port = sock.getsockname()[:2]
            local = f"{host}:{port}"
            closed = wait_closed(sock, 10.0)
        ctx.store.set(f"{name}/stranger", local if closed else "not closed")
        return None
    job = dataclasses.replace(ctx, size=size)
    records = _Records()
    logging.getLogger("pg_tcp").addHandler(records)
    b = make_backend(job, name, timeout=30.0)
    try:
        t = torch.full((3,), float(ctx.rank))
        b.all_reduce(t, ReduceOp.SUM, timeout=30.0)  # connects every pair (rank 0 to rank 2 among them)
        assert t.tolist() == [3.0] * 3
        if ctx.rank == 2:
            b.send_bytes(b"msg0", 0, 0, timeout=30.0)
            ctx.store.wait([f"{name}/stranger"])
            for i in range(1, 6):
                b.send_bytes(f"msg{i}".encode(), 0, 0, timeout=30.0)
        got: list[str] = []
        if ctx.rank == 0:
            got.append(bytes(b.recv_bytes(2, 0, timeout=30.0)).decode())
            ctx.store.set(f"{name}/ready", "1")
            for _ in range(5):  # waiting here, rank 0 reads the stranger's hello
                got.append(bytes(b.recv_bytes(2, 0, timeout=30.0)).decode())
            assert got == [f"msg{i}" for i in range(6)], got
            stranger = ctx.store.get(f"{name}/stranger").decode()
            assert stranger != "not closed", "rank 0 kept the stranger's connection open"
            assert any("rank 2" in m and stranger in m for m in records.messages), (stranger, records.messages)
        t = torch.full((3,), float(ctx.rank + 1))
        b.all_reduce(t, ReduceOp.SUM, timeout=30.0)
        assert t.tolist() == [6.0] * 3
        return got
    finally:
        logging.getLogger("pg_tcp").removeHandler(records)
        b.shutdown()


def test_a_second_claim_of_a_live_rank_is_refused(rank_pools: Pools) -> None:
    results = rank_pools(4).run(impersonation, timeout=120)
    assert results[0] == [f"msg{i}" for i in range(6)]


# -- 3. a send to a rank killed a moment earlier fails ------------------------------------------


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):  # reaped (between the open and the read, too)
        return True


def send_to_the_just_killed(ctx: RankContext) -> tuple[str, float, tuple[int, ...]] | None:
    b = make_backend(ctx, "killed", timeout=3600.0)
    try:
        t = torch.ones(4)
        b.all_reduce(t, ReduceOp.SUM, timeout=60.0)  # every pair connected
        if ctx.rank == 2:
            ctx.store.set("killed/pid", str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        if ctx.rank == 1:
            ctx.store.wait(["killed/done"])
            return None
        try:
            pid = int(ctx.store.get("killed/pid"))
            deadline = time.monotonic() + 30.0
            while not _dead(pid):  # the kernel closes a process's sockets as it dies
                assert time.monotonic() < deadline, f"rank 2 (pid {pid}) did not die"
                os.sched_yield()
            start = time.monotonic()
            with pytest.raises(PeerFailureError) as info:
                b.send(torch.ones(256), 2, 0, timeout=3600.0)  # 1 KiB
            return str(info.value), time.monotonic() - start, info.value.peers
        finally:
            ctx.store.set("killed/done", "1")
    finally:
        b.shutdown()


def test_a_send_to_a_rank_killed_a_moment_earlier_fails(rank_pools: Pools) -> None:
    result = rank_pools(3).run(send_to_the_just_killed, may_exit=[2], timeout=90)[0]
    assert result is not None
    message, seconds, peers = result
    assert peers == (2,) and "rank 2" in message, message
    assert seconds < 5.0, seconds


# -- 4. an authenticated job: strangers with the store but not the key --------------------------


def strangers_without_the_key(ctx: RankContext) -> list[str] | None:
    name, size, key = "authed", 2, AuthKey("the job's secret")
    uid = f"{name}-{ctx.job}".encode()
    if ctx.rank == 2:  # the stranger: reads rank 0's address, has no key
        ctx.store.wait([f"{name}/ready"])
        seen: list[str] = []
        addr = ctx.store.get(f"{name}/cpu/tcp/addr/0")  # MAC || address: readable, though not forgeable
        host, _, port = addr[32:].decode().rpartition(":")
        plain = HELLO.pack(HELLO_MAGIC, PROTOCOL_VERSION, 1, 0, len(uid)) + uid
        captured = HELLO.pack(HELLO_MAGIC, PROTOCOL_VERSION, 1, AUTH, len(uid)) + uid + os.urandom(32)
        # an unauthenticated hello; an authenticated-looking one with a made-up MAC; that hello replayed
        for said in (plain, captured, captured):
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.sendall(said)
                sock.sendall((b"" if said is plain else os.urandom(32)) + header(BYTES, 4) + b"EVIL")
                seen.append("closed" if wait_closed(sock, 10.0) else "open")
        ctx.store.set(f"{name}/stranger", ",".join(seen))
        return seen
    job = dataclasses.replace(ctx, size=size)
    records = _Records()
    logging.getLogger("pg_tcp").addHandler(records)
    authed = AuthenticatedStore(ctx.store, key)
    job = dataclasses.replace(job, store=authed)
    b = make_backend(job, name, timeout=30.0, auth_key=key)
    try:
        t = torch.full((3,), float(ctx.rank + 1))
        b.all_reduce(t, ReduceOp.SUM, timeout=30.0)
        assert t.tolist() == [3.0] * 3
        if ctx.rank == 0:
            ctx.store.set(f"{name}/ready", "1")
            b.recv_bytes(1, 0, timeout=60.0)  # rank 0 drives its connections: every stranger's is read and refused
        else:
            ctx.store.wait([f"{name}/stranger"])
            b.send_bytes(b"real", 0, 0, timeout=30.0)
        t = torch.full((3,), float(ctx.rank + 1))
        b.all_reduce(t, ReduceOp.SUM, timeout=30.0)
        assert t.tolist() == [3.0] * 3
        return records.messages
    finally:
        logging.getLogger("pg_tcp").removeHandler(records)
        b.shutdown()


def test_strangers_without_the_key_are_refused(rank_pools: Pools) -> None:
    results = rank_pools(3).run(strangers_without_the_key, timeout=120)
    assert results[2] == ["closed", "closed", "closed"]
    logged = " ".join(results[0])
    assert "not authenticated" in logged
    assert "wrong MAC" in logged
    assert "replayed hello" in logged


# -- 5. an authenticated job: a captured hello replayed, a key holder claiming a live rank ----------


def read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def replay_and_second_claim(ctx: RankContext) -> list[str] | None:
    """Ranks 0-2 form an authenticated group; rank 3 is not a member. It replays to rank 2
    the hello (and proof) rank 0 sent when it connected to rank 2, captured; then, holding
    the key (a process of the job that is not rank 2), completes the handshake with rank 0
    as rank 2, which is connected, and sends a frame. Both are refused and logged; the
    group's messages and collectives go on."""
    name, size, key = "authed-claim", 3, AuthKey("the job's secret")
    uid = f"{name}-{ctx.job}".encode()
    if ctx.rank == 3:
        ctx.store.wait([f"{name}/captured"])
        captured = bytes.fromhex(ctx.store.get(f"{name}/captured").decode())
        seen: list[str] = []
        address = AuthenticatedStore(ctx.store, key).get(f"{name}/cpu/tcp/addr/2").decode()
        host, _, port = address.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:  # the replay, to rank 2
            sock.sendall(captured + header(BYTES, 4) + b"EVIL")
            seen.append("closed" if wait_closed(sock, 10.0) else "open")
        address = AuthenticatedStore(ctx.store, key).get(f"{name}/cpu/tcp/addr/0").decode()
        host, _, port = address.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:  # rank 2's second claim, to rank 0
            mine = os.urandom(32)
            sock.sendall(HELLO.pack(HELLO_MAGIC, PROTOCOL_VERSION, 2, AUTH, len(uid)) + uid + mine)
            _, _, rank, flags, length = HELLO.unpack(read_exactly(sock, HELLO.size))
            answer = read_exactly(sock, length + 64)
            theirs, proof = answer[length : length + 32], answer[length + 32 :]
            version, ranks = PROTOCOL_VERSION.to_bytes(2, "little"), (2).to_bytes(4, "little") + bytes(4)
            assert rank == 0 and flags & AUTH
            assert proof == key.mac(b"pg-tcp", version, uid, ranks, mine, theirs, b"acceptor")  # rank 0 is real
            sock.sendall(key.mac(b"pg-tcp", version, uid, ranks, mine, theirs, b"maker") + header(BYTES, 4) + b"EVIL")
            seen.append("closed" if wait_closed(sock, 10.0) else "open")
        ctx.store.set(f"{name}/stranger", ",".join(seen))
        return seen
    job = dataclasses.replace(ctx, size=size, store=AuthenticatedStore(ctx.store, key))
    records = _Records()
    logging.getLogger("pg_tcp").addHandler(records)
    b = make_backend(job, name, timeout=30.0, auth_key=key)
    try:
        t = torch.full((3,), float(ctx.rank))
        b.all_reduce(t, ReduceOp.SUM, timeout=30.0)  # every pair connected: rank 0 made its connection to rank 2
        if ctx.rank == 0:
            transport = b._transport
            peer = transport._peers[2]
            assert peer is not None and peer.send is not None and peer.send.initiated
            conn = peer.send
            hello_bytes = handshake.hello(0, uid, AUTH) + conn.nonces[0]
            proof = handshake.mac(key, uid, maker=0, acceptor=2, nonces=conn.nonces, role=b"maker")
            ctx.store.set(f"{name}/captured", (hello_bytes + proof).hex())
        if ctx.rank == 1:
            ctx.store.wait([f"{name}/stranger"])
            b.send_bytes(b"to 0", 0, 0, timeout=30.0)
            b.send_bytes(b"to 2", 2, 0, timeout=30.0)
        else:  # rank 0 and rank 2 drive their connections while they wait: the stranger's are read and refused
            assert bytes(b.recv_bytes(1, 0, timeout=60.0)) == f"to {ctx.rank}".encode()
        t = torch.full((3,), float(ctx.rank + 1))
        b.all_reduce(t, ReduceOp.SUM, timeout=30.0)
        assert t.tolist() == [6.0] * 3
        return records.messages
    finally:
        logging.getLogger("pg_tcp").removeHandler(records)
        b.shutdown()


def test_a_replayed_hello_and_a_key_holders_second_claim_are_refused(rank_pools: Pools) -> None:
    results = rank_pools(4).run(replay_and_second_claim, timeout=120)
    assert results[3] == ["closed", "closed"]
    assert any("replayed hello" in m and "rank 0" in m for m in results[2] or []), results[2]
    assert any("second claim" in m and "rank 2" in m for m in results[0] or []), results[0]


# -- a receive that timed out is never written into afterwards -------------------------------


def half_a_frame_then_the_rest(ctx: RankContext) -> tuple[str, int, int] | None:
    """Rank 1's place is taken by a raw peer that sends a 16 KiB tensor frame for rank 0's
    posted receive, but only half its payload before rank 0's receive times out, and the
    other half after: rank 0 reads it (driving progress in another receive) and throws it away."""
    name = "half-frame"
    n = 4096
    if ctx.rank == 1:
        ctx.store.wait([f"{name}/posted"])
        with hello(ctx, name, as_rank=1) as sock:
            code = dtype_code(torch.float32)
            assert code is not None
            sock.sendall(header(TENSOR, n * 4, tag=7, dtype=code))
            sock.sendall(torch.ones(n // 2).numpy().tobytes())
            ctx.store.wait([f"{name}/timed-out"])
            sock.sendall(torch.ones(n // 2).numpy().tobytes())
            ctx.store.set(f"{name}/rest-sent", "1")
            ctx.store.wait([f"{name}/done"])
        return None
    b = make_backend(ctx, name, timeout=30.0)
    try:
        t = torch.zeros(n)
        ctx.store.set(f"{name}/posted", "1")
        with pytest.raises(PGError) as info:
            b.recv(t, 1, 7, timeout=1.0)
        ctx.store.set(f"{name}/timed-out", "1")
        ctx.store.wait([f"{name}/rest-sent"])
        with pytest.raises(PGError):  # drives progress: the rest of the frame is read meanwhile
            b.recv(torch.empty(1), 1, 8, timeout=0.5)
        return type(info.value).__name__, int(t[: n // 2].count_nonzero()), int(t[n // 2 :].count_nonzero())
    finally:
        ctx.store.set(f"{name}/done", "1")
        b.shutdown()


def test_a_receive_that_timed_out_mid_payload_is_not_written_after(rank_pools: Pools) -> None:
    result = rank_pools(2).run(half_a_frame_then_the_rest, timeout=60)[0]
    assert result is not None
    error, first_half, second_half = result
    assert error == "CollectiveTimeout"
    assert first_half == 2048  # what arrived before the timeout is there
    assert second_half == 0  # what arrived after it went nowhere near the tensor
