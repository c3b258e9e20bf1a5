"""The wire and the progress engine: a full mesh of TCP connections between the
ranks of one group, and the machinery that moves framed messages over it.

This module knows nothing about collectives. It offers *requests*: post a send
or a receive, then wait for it, or turn it into a :class:`~pg_core.work.Work`.
:mod:`pg_tcp.backend` builds every operation out of these.

Design, and why
===============

**Connections.** Every rank listens on port 0 of the interface that reaches the
store (:func:`pg_core.store.advertise_address`), publishes ``host:port`` under
``addr/<rank>`` in the group's (already prefixed) store, connects to every lower
rank and accepts every higher one. A handshake carries a magic string, the
protocol version, ``ctx.group_uid`` and the rank, and is acknowledged, so a
stray connection (another group, a port scanner) is rejected instead of being
taken for a peer. Everything is bounded by ``ctx.timeout``; the listener is
closed once the mesh stands. Sockets are non-blocking, with ``TCP_NODELAY``
(small frames leave at once) and short TCP keepalives (a vanished host is noticed
in seconds even when nothing is being sent).

**Frames.** Every message is a 32-byte header followed by ``nbytes`` of payload::

    magic u16 | kind u8 | opcode u8 | dtype u8 | pad 3 | tag i64 | seq u64 | nbytes u64

``kind`` separates the traffic that shares a connection: point-to-point tensors
(matched on (peer, tag), FIFO), variable-size byte messages (same, separate
namespace), collective frames (matched FIFO per peer and checked against the
receiver's expectation: sequence number, opcode, dtype, size and the op's
argument, which travels in ``tag``), and control frames: ARRIVED (I am blocked in
collective #seq, this opcode and argument), ABORT (collective #seq failed here,
the payload says why), BYE (I shut down cleanly; nothing follows). Because every
collective frame says what it is, ranks that call different things get
:class:`~pg_core.errors.CollectiveMismatchError` instead of reading each other's
bytes as data.

**Zero copy.** A send is one ``sendmsg([header, payload])`` whose payload is a
memoryview over the tensor's own memory; a receive that was posted before its
frame arrived is read with ``recv_into`` straight into the tensor. Only a frame
that arrives before its receive is posted ("unexpected") is buffered, once.

**Progress without a thread handoff.** There is no always-on I/O thread. Whoever
waits drives: the first waiting thread takes the *driver* role, polls every peer
socket plus a wake-up socketpair, reads frames into posted buffers (or the
unexpected queue), continues partial sends, and returns as soon as its own
request is done. Other waiting threads sleep on a condition that the driver
signals whenever something completes, and take over when it leaves. A blocking
``recv`` in the common one-thread case is therefore: one ``poll``, one or two
``recv_into``, no context switch; that is how pure Python keeps up with a C++
backend on latency. Sends are tried directly by the posting thread; only what the
kernel did not take is queued for the driver (POLLOUT). A sender whose socket is
full keeps reading its incoming side while it waits, so two ranks sending large
messages to each other never deadlock.

A background progress thread exists only for asynchronous requests (``isend``/
``irecv`` handed to the user as a ``Work``): it drives while at least one is
outstanding, so a 64 MiB ``isend`` overlaps with the caller's compute, and sleeps
on the condition otherwise.

**Failures.** EOF or a read error from a peer marks it failed at once: every
request that depends on it raises :class:`~pg_core.errors.PeerFailureError`
naming it; after a crash (EOF without BYE) every collective does, because a
collective needs every rank. A clean ``shutdown`` sends BYE first, so peers say
"rank N shut down" instead of reporting a crash, and only what needed rank N
fails. A failed *write* decides nothing by itself: the peer's last frames (an
ABORT, a BYE) are still in the receive buffer, and the reader, which reads them
and then the EOF, gives the verdict. A collective that fails locally (mismatch,
peer failure) sends ABORT to the other ranks so they raise too instead of
hanging, and breaks this group's collective stream: later collectives raise at
once (re-form the group); a BYE sent after that carries the reason too, so ranks
still waiting learn why rather than just "shut down". Point to point keeps
working. Ranks blocked in different collectives that exchange no data (two
"roots" of a ``reduce``) learn it from the ARRIVED frames that a collective
blocked for a while (min(1 s, timeout/4)) sends, which carry its opcode and
argument. A request that passes its deadline raises
:class:`~pg_core.errors.CollectiveTimeout` naming the op, the sequence number and
the ranks not heard from (the ARRIVED frames tell each rank who else reached the
collective). ``abort`` (any thread) fails everything pending with
:class:`~pg_core.errors.GroupClosedError` and closes.

**Threads and locks.** One lock (``_lock``) guards all shared state: queues,
request completion, peer status and socket *writes* (sends are non-blocking, so
it is never held across a wait). Socket *reads* belong to the driver alone and
need no lock. ``Work`` objects are completed outside the lock, so their callbacks
may call back into the backend.
"""

from __future__ import annotations

import contextlib
import mmap
import select
import socket
import struct
import threading
import time
from collections import deque
from typing import Final

import torch
from pg_core.backend import DTYPES, BackendContext, tensor_bytes
from pg_core.errors import (
    CollectiveMismatchError,
    CollectiveTimeout,
    GroupClosedError,
    PeerFailureError,
    PGError,
)
from pg_core.ops import COLLECTIVE_OPS, RedOpType
from pg_core.store import advertise_address, wait_for
from pg_core.work import Work

__all__ = ["Recv", "Request", "Send", "Transport", "describe_arg", "encode_arg", "tensor_bytes"]

# -- wire format ------------------------------------------------------------------

HEADER: Final = struct.Struct("<HBBB3xqQQ")  # magic, kind, opcode, dtype, tag, seq, nbytes
HEADER_SIZE: Final = HEADER.size  # 32
MAGIC: Final = 0x5054  # "TP"
PROTOCOL_VERSION: Final = 1
HELLO_MAGIC: Final = b"pg-tcp\x00\x01"

# kinds
TENSOR: Final = 1  # point-to-point tensor, matched on (peer, tag)
BYTES: Final = 2  # point-to-point variable-size message, matched on (peer, tag)
COLL: Final = 3  # collective frame, matched FIFO per peer, checked against (seq, opcode, tag, dtype, nbytes)
ARRIVED: Final = 4  # control: "I am blocked in collective #seq", with its opcode and argument
ABORT: Final = 5  # control: "collective #seq failed here"; opcode = error kind, payload = reason
BYE: Final = 6  # control: clean shutdown, nothing follows; opcode/payload: why its collectives stopped, if they did

# dtype codes: 0 = none, 1.. = pg_core.backend.DTYPES, 255 = raw bytes
DTYPE_CODE: Final[dict[torch.dtype, int]] = {dtype: i + 1 for i, dtype in enumerate(DTYPES)}
RAW: Final = 255
OPCODE: Final[dict[str, int]] = {name: i + 1 for i, name in enumerate(COLLECTIVE_OPS)}


def encode_arg(*, root: int = -1, op: RedOpType | None = None) -> int:
    """A collective's argument as it travels in its frames' ``tag``: root and reduce op."""
    return (root + 1) << 8 | (0 if op is None else _REDOP_CODE[op])


def describe_arg(arg: int) -> str:
    root, op = (arg >> 8) - 1, arg & 0xFF
    parts = ([f"root {root}"] if root >= 0 else []) + ([_REDOP_NAME.get(op, f"op#{op}")] if op else [])
    return ", ".join(parts) or "no root or reduce op"


_REDOP_CODE: Final[dict[RedOpType, int]] = {kind: i + 1 for i, kind in enumerate(RedOpType)}
_REDOP_NAME: Final[dict[int, str]] = {code: kind.name for kind, code in _REDOP_CODE.items()}

# Why collectives stopped (opcode of an ABORT frame, or of a BYE after they did)
_ABORT_MISMATCH: Final = 1
_ABORT_PEER: Final = 2
_ABORT_CLASS: Final[dict[int, type[PGError]]] = {
    _ABORT_MISMATCH: CollectiveMismatchError,
    _ABORT_PEER: PeerFailureError,
}
_ABORT_CODE: Final[dict[type[PGError], int]] = {cls: code for code, cls in _ABORT_CLASS.items()}

_POLLIN: Final = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP
_POLLOUT: Final = select.POLLOUT
_DISCARD_CHUNK: Final = 1 << 16
_IOV_MAX: Final = 512  # buffers per sendmsg (the kernel's limit is 1024)
_EMPTY: Final = memoryview(b"")


#: Payloads this large arrive in pre-faulted anonymous memory instead of a ``bytearray``:
#: ``bytearray(n)`` zeroes every page and then faults it in while the payload is copied,
#: ``mmap`` with ``MAP_POPULATE`` maps them in one go (64 MiB: about 22 ms instead of 35).
_MMAP_BYTES: Final = 1 << 20
_POPULATE: Final = getattr(mmap, "MAP_POPULATE", 0)

Payload = bytearray | mmap.mmap


def _payload_buffer(nbytes: int) -> Payload:
    """A writable buffer of ``nbytes`` for a payload that has no posted destination."""
    if nbytes >= _MMAP_BYTES and _POPULATE:
        return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
    return bytearray(nbytes)


def _dtype_name(code: int) -> str:
    if code == RAW:
        return "bytes"
    if 1 <= code <= len(DTYPES):
        return str(DTYPES[code - 1]).removeprefix("torch.")
    return f"dtype#{code}"


def _op_name(opcode: int) -> str:
    return COLLECTIVE_OPS[opcode - 1] if 1 <= opcode <= len(COLLECTIVE_OPS) else f"op#{opcode}"


# -- requests -----------------------------------------------------------------------


class Request:
    """One posted send or receive. Completed exactly once, under the transport's lock."""

    __slots__ = ("announce_at", "deadline", "done", "error", "keep", "kind", "name", "peer", "seq", "timeout", "work")

    def __init__(
        self, name: str, kind: int, peer: int, *, seq: int | None, timeout: float, deadline: float | None, keep: object
    ) -> None:
        self.name = name  # the user-facing operation, for messages
        self.kind = kind
        self.peer = peer
        self.seq = seq  # collective sequence number; None for point to point
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout if deadline is None else deadline
        self.announce_at = 0.0  # collectives: when to tell the peers we are stuck here
        self.keep = keep  # the tensor whose memory a view points into
        self.done = False
        self.error: BaseException | None = None
        self.work: Work | None = None


class Send(Request):
    """A frame to write: the header, then the payload, which is one buffer or a list of
    buffers written back to back (scatter-gather: a message's parts are never joined)."""

    __slots__ = ("header", "parts", "sent", "total")

    def __init__(
        self,
        name: str,
        kind: int,
        peer: int,
        payload: memoryview | list[memoryview],
        *,
        opcode: int = 0,
        dtype: int = 0,
        tag: int = 0,
        seq: int | None = None,
        timeout: float,
        deadline: float | None = None,
        keep: object = None,
        wire_seq: int = 0,
    ) -> None:
        super().__init__(name, kind, peer, seq=seq, timeout=timeout, deadline=deadline, keep=keep)
        self.parts = payload if isinstance(payload, list) else [payload]
        nbytes = sum(p.nbytes for p in self.parts)
        # ``seq`` makes this part of a collective; control frames carry ``wire_seq`` without being one.
        self.header = HEADER.pack(MAGIC, kind, opcode, dtype, tag, wire_seq if seq is None else seq, nbytes)
        self.sent = 0
        self.total = HEADER_SIZE + nbytes

    def pending(self) -> list[bytes | memoryview]:
        """What is left to write, as ``sendmsg`` buffers (at most :data:`_IOV_MAX`)."""
        if self.sent < HEADER_SIZE:
            if len(self.parts) == 1:
                return [self.header[self.sent :], self.parts[0]]
            return [self.header[self.sent :], *self.parts[: _IOV_MAX - 1]]
        skip = self.sent - HEADER_SIZE
        if len(self.parts) == 1:
            return [self.parts[0][skip:]]
        out: list[bytes | memoryview] = []
        for part in self.parts:
            if skip >= part.nbytes:
                skip -= part.nbytes
                continue
            out.append(part[skip:] if skip else part)
            skip = 0
            if len(out) == _IOV_MAX:
                break
        return out

    def detach(self) -> None:
        """Copy the unsent rest of the payload, so the caller's tensors are free although
        the frame must still be finished on the wire (a started frame cannot be withdrawn)."""
        start = max(self.sent - HEADER_SIZE, 0)
        rest = bytearray(start)  # placeholders for what was written, so offsets stay as they were
        skip = start
        for part in self.parts:
            if skip >= part.nbytes:
                skip -= part.nbytes
                continue
            rest += part[skip:]
            skip = 0
        self.parts = [memoryview(rest)]
        self.keep = None


class Recv(Request):
    __slots__ = ("buf", "dtype", "nbytes", "opcode", "result", "tag")

    def __init__(
        self,
        name: str,
        kind: int,
        peer: int,
        buf: memoryview | None,
        *,
        opcode: int = 0,
        dtype: int = 0,
        tag: int = 0,
        seq: int | None = None,
        timeout: float,
        deadline: float | None = None,
        keep: object = None,
    ) -> None:
        super().__init__(name, kind, peer, seq=seq, timeout=timeout, deadline=deadline, keep=keep)
        self.buf = buf  # None: variable size, allocated on arrival
        self.nbytes = -1 if buf is None else buf.nbytes
        self.opcode = opcode
        self.dtype = dtype
        self.tag = tag
        self.result: Payload | None = None

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.peer, self.kind, 0 if self.kind == COLL else self.tag)


# -- peers -----------------------------------------------------------------------------

Frame = tuple[int, int, int, int, int, int]  # kind, opcode, dtype, tag, seq, nbytes


class _Peer:
    """One connection. Reader fields belong to the driver; the rest to ``_lock``."""

    __slots__ = (
        "closed",
        "crashed",
        "dest",
        "fd",
        "frame",
        "got",
        "hdr",
        "hdr_got",
        "hdr_view",
        "mask",
        "outq",
        "rank",
        "send_error",
        "sock",
        "target",
    )

    def __init__(self, rank: int, sock: socket.socket) -> None:
        self.rank = rank
        self.sock = sock
        self.fd = sock.fileno()
        self.outq: deque[Send] = deque()
        self.closed: str | None = None  # why this peer can no longer be talked to
        self.crashed = False
        self.send_error: str | None = None  # writing failed; the reader will tell why
        self.mask = 0  # what the poller watches
        # reader state (driver only)
        self.hdr = bytearray(HEADER_SIZE)
        self.hdr_view = memoryview(self.hdr)
        self.hdr_got = 0
        self.frame: Frame | None = None  # the frame whose payload is being read
        self.dest: memoryview | None = None  # where it goes (None: discard)
        self.target: Recv | Payload | None = None
        self.got = 0


# -- the transport -----------------------------------------------------------------------


class Transport:
    """A connected mesh for one group and the requests that move data over it.

    Construct with a :class:`~pg_core.backend.BackendContext`: that connects to
    every peer (collectively: every rank constructs one) or raises. Thread-safe.
    """

    def __init__(self, ctx: BackendContext) -> None:
        self.rank = ctx.rank
        self.size = ctx.size
        self.label = f"pg-tcp group {ctx.group_name!r} rank {ctx.rank}"
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # "something completed / the driver left"
        self._sleepers = 0  # threads waiting on _cond
        self._idle = threading.Condition(self._lock)  # the progress thread, when nothing is asynchronous
        self._driving = False
        self._driver_ident = 0
        self._closed: str | None = None  # "shut down" / "aborted": no new requests
        self._stopping = False  # the progress thread must exit
        self._posted: dict[tuple[int, int, int], deque[Recv]] = {}
        self._unexpected: dict[tuple[int, int, int], deque[tuple[Frame, Payload]]] = {}
        self._pending_coll: set[Request] = set()  # collective requests not yet done
        self._async: set[Request] = set()  # requests a user holds a Work for
        self._finished_works: list[Request] = []  # completed under the lock, to settle outside it
        self._broken: tuple[type[PGError], str, tuple[int, ...]] | None = None  # why collectives stopped
        self._heard = [-1] * ctx.size  # highest collective seq each peer is known to have reached
        self._announced = -1
        self._current: tuple[int, int, int] = (0, 0, 0)  # seq, opcode, arg of this rank's latest collective
        self._arrivals: dict[int, tuple[int, int, int]] = {}  # peer -> (seq, opcode, arg) it announced
        self._thread: threading.Thread | None = None
        self._scratch = memoryview(bytearray(_DISCARD_CHUNK))
        self._peers: list[_Peer | None] = [None] * ctx.size
        self._by_fd: dict[int, _Peer] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._poller = select.poll()
        self._poller.register(self._wake_r.fileno(), select.POLLIN)
        self._poll_dirty = True
        try:
            for rank, sock in _connect_mesh(ctx).items():
                peer = _Peer(rank, sock)
                self._peers[rank] = peer
                self._by_fd[peer.fd] = peer
        except BaseException:
            self._wake_r.close()
            self._wake_w.close()
            raise

    # == posting ==============================================================================

    def post_send(self, req: Send) -> Send:
        """Start ``req``: written now as far as the kernel takes it, the rest queued."""
        with self._lock:
            peer = self._admit(req)
            if peer is not None:
                self._send_locked(peer, req)
        if self._finished_works:
            self._settle()
        return req

    def post_recv(self, req: Recv) -> Recv:
        """Start ``req``: matched now against a frame that already arrived, or posted."""
        with self._lock:
            peer = self._admit(req)
            if peer is None:
                return req
            key = req.key
            queue = self._unexpected.get(key)
            if not queue:
                if peer.closed is not None:
                    self._complete(req, self._peer_error(req, peer))
                    return req
                posted = self._posted.get(key)
                if posted is None:
                    posted = self._posted[key] = deque()
                posted.append(req)
                return req
            frame, payload = queue.popleft()
            if not queue:
                del self._unexpected[key]
        self._deliver(req, frame, payload, req.peer, req.seq)  # an early frame
        self._settle()
        return req

    def _admit(self, req: Request) -> _Peer | None:
        """Register ``req``; ``None`` if it failed at once (closed, broken, bad peer). Under the lock."""
        if self._closed is not None:
            self._complete(req, GroupClosedError(f"{self.label}: {req.name} after the group was {self._closed}"))
            return None
        peer = self._peers[req.peer] if 0 <= req.peer < self.size else None
        if peer is None:
            self._complete(req, ValueError(f"{self.label}: {req.name} with peer {req.peer}: no such peer"))
            return None
        if req.seq is not None:
            if self._broken is not None:
                self._complete(req, self._broken_error(req.name, req.seq))
                return None
            self._pending_coll.add(req)
        return peer

    def post_async(self, req: Request) -> Work:
        """A ``Work`` for ``req`` that completes even if nobody waits (the progress thread drives)."""
        return self._attach_work(req, background=True)

    def work_for(self, req: Request) -> Work:
        """A ``Work`` for ``req`` that the caller is about to wait on itself (no progress thread)."""
        return self._attach_work(req, background=False)

    def _attach_work(self, req: Request, *, background: bool) -> Work:
        work = Work(req.name, driver=lambda w, t: self._drive_work(req, t))
        with self._lock:
            req.work = work
            if req.done:
                self._finished_works.append(req)
            elif background:
                self._async.add(req)
                if self._thread is None and not self._stopping:
                    self._thread = threading.Thread(
                        target=self._progress_loop, name=f"{self.label} progress", daemon=True
                    )
                    self._thread.start()
                else:
                    self._idle.notify()
        if background or req.done:
            self._settle()
        return work

    # == waiting ==============================================================================

    def wait(self, req: Request) -> None:
        """Drive progress until ``req`` completes; raise its error."""
        while not req.done:
            now = time.monotonic()
            if now >= req.deadline:
                self._expire(req)
                break
            limit = req.deadline
            if req.seq is not None:
                limit = self._maybe_announce(req, now, limit)
            self._drive(req, limit - now)
        if req.error is not None:
            raise req.error

    def _drive_work(self, req: Request, timeout: float) -> None:
        """The ``Work`` driver: progress for at most ``timeout`` s; errors stay on the work."""
        now = time.monotonic()
        if not req.done:
            if now >= req.deadline:
                self._expire(req)
            else:
                limit = min(req.deadline, now + timeout)
                if req.seq is not None:
                    limit = self._maybe_announce(req, now, limit)
                self._drive(req, limit - now)
        if req.done and req.work is not None:
            _settle_work(req)

    def _maybe_announce(self, req: Request, now: float, limit: float) -> float:
        """For a collective blocked for a while, tell every peer we reached it (once per seq)."""
        assert req.seq is not None
        if req.announce_at == 0.0:
            req.announce_at = now + min(1.0, req.timeout / 4)
        if self._announced >= req.seq:
            return limit
        if now >= req.announce_at:
            with self._lock:
                seq, opcode, arg = self._current
                if self._announced < req.seq and seq == req.seq:
                    self._announced = seq
                    for peer in self._live_peers():
                        announce = Send(
                            "arrived",
                            ARRIVED,
                            peer.rank,
                            _EMPTY,
                            opcode=opcode,
                            tag=arg,
                            wire_seq=seq,
                            timeout=req.timeout,
                        )
                        self._send_locked(peer, announce)
            self._settle()
            return limit
        return min(limit, req.announce_at)

    def _drive(self, want: Request | None, timeout: float) -> None:
        """One round of progress: become the driver and poll, or sleep until the driver signals."""
        with self._lock:
            if (want is not None and want.done) or self._stopping:
                return
            if self._driving:
                self._sleepers += 1
                self._cond.wait(timeout)
                self._sleepers -= 1
                return
            self._driving = True
            self._driver_ident = threading.get_ident()
        try:
            self._poll_round(want, timeout)
        finally:
            with self._lock:
                self._driving = False
                self._driver_ident = 0
                if self._sleepers:
                    self._cond.notify_all()
            if self._finished_works:
                self._settle()

    def _poll_round(self, want: Request | None, timeout: float) -> None:
        if self._poll_dirty:
            self._sync_poller()
        events = self._poller.poll(max(0.0, timeout) * 1000.0)
        for fd, mask in events:
            peer = self._by_fd.get(fd)
            if peer is None:
                try:
                    while self._wake_r.recv(4096):
                        pass
                except OSError:
                    pass
                continue
            if self._closed == "aborted":
                return
            if mask & _POLLOUT:
                self._flush(peer)
            if mask & _POLLIN and peer.closed is None:
                self._read(peer, want)

    def _sync_poller(self) -> None:
        """Make the poller watch POLLIN on live peers, POLLOUT where sends are queued. Driver only."""
        with self._lock:
            self._poll_dirty = False
            for peer in self._peers:
                if peer is None:
                    continue
                writable = peer.outq and peer.send_error is None
                want = 0 if peer.closed is not None else _POLLIN | (_POLLOUT if writable else 0)
                if want == peer.mask:
                    continue
                if want == 0:
                    self._poller.unregister(peer.fd)
                elif peer.mask == 0:
                    self._poller.register(peer.fd, want)
                else:
                    self._poller.modify(peer.fd, want)
                peer.mask = want

    def _wake_driver(self) -> None:
        """Interrupt the driver's poll (it must pick up new work). Under the lock."""
        if self._driving and self._driver_ident != threading.get_ident():
            with contextlib.suppress(OSError):  # full: it is being woken already
                self._wake_w.send(b"\0")

    # == sending ==============================================================================

    def _send_locked(self, peer: _Peer, req: Send) -> None:
        if peer.closed is not None:
            self._complete(req, self._peer_error(req, peer))
            return
        if not peer.outq and peer.send_error is None:
            try:
                req.sent = peer.sock.sendmsg(req.pending())
            except BlockingIOError:
                pass
            except OSError as exc:
                self._send_failed(peer, exc)
            if req.sent == req.total:
                self._complete(req, None)
                return
            self._poll_dirty = True
            self._wake_driver()
        peer.outq.append(req)

    def _send_failed(self, peer: _Peer, exc: OSError) -> None:
        """Writing to ``peer`` failed (it closed or reset). Under the lock.

        Not a verdict yet: what the peer said before it went (an ABORT, a BYE) is
        still in our receive buffer, so stop writing and let the reader, which
        reads those frames and then the EOF, decide between "shut down" and a
        crash. The queued sends fail then.
        """
        if peer.send_error is None:
            peer.send_error = f"connection to rank {peer.rank} failed while sending: {exc}"
            self._poll_dirty = True
            self._wake_driver()

    def _flush(self, peer: _Peer) -> None:
        """Continue queued sends to ``peer`` (the driver, on POLLOUT)."""
        with self._lock:
            outq = peer.outq
            while outq and peer.closed is None:
                req = outq[0]
                try:
                    req.sent += peer.sock.sendmsg(req.pending())
                except BlockingIOError:
                    return
                except OSError as exc:
                    self._send_failed(peer, exc)
                    return
                if req.sent < req.total:
                    return
                outq.popleft()
                self._complete(req, None)
            self._poll_dirty = True

    # == receiving ============================================================================

    def _read(self, peer: _Peer, want: Request | None) -> None:
        """Read whatever ``peer`` has for us, frame by frame (the driver, on POLLIN)."""
        sock = peer.sock
        while True:
            try:
                if peer.frame is None:
                    n = sock.recv_into(peer.hdr_view[peer.hdr_got :])
                elif peer.dest is None:
                    n = sock.recv_into(self._scratch, min(_DISCARD_CHUNK, peer.frame[5] - peer.got))
                else:
                    n = sock.recv_into(peer.dest[peer.got :])
            except BlockingIOError:
                return
            except OSError as exc:
                with self._lock:
                    self._lose_peer(
                        peer, peer.send_error or f"connection to rank {peer.rank} failed: {exc}", crashed=True
                    )
                return
            if n == 0:
                with self._lock:
                    self._lose_peer(
                        peer,
                        f"rank {peer.rank} closed its connection without saying goodbye (did its process die?)",
                        crashed=True,
                    )
                return
            if peer.frame is None:
                peer.hdr_got += n
                if peer.hdr_got < HEADER_SIZE:
                    continue
                peer.hdr_got = 0
                if not self._begin_frame(peer):
                    return
            else:
                peer.got += n
            frame = peer.frame
            if frame is not None and peer.got == frame[5]:
                self._end_frame(peer)
                if peer.closed is not None or (want is not None and want.done):
                    return

    def _begin_frame(self, peer: _Peer) -> bool:
        """A header arrived: decide where its payload goes. False if the stream is unusable."""
        magic, kind, opcode, dtype, tag, seq, nbytes = HEADER.unpack_from(peer.hdr)
        if magic != MAGIC or not TENSOR <= kind <= BYE:
            with self._lock:
                self._lose_peer(
                    peer, f"rank {peer.rank} sent a malformed frame (magic {magic:#x}, kind {kind})", crashed=True
                )
            return False
        frame: Frame = (kind, opcode, dtype, tag, seq, nbytes)
        peer.frame, peer.got, peer.dest, peer.target = frame, 0, None, None
        if kind >= ARRIVED:
            if kind in (ABORT, BYE):
                reason = peer.target = bytearray(nbytes)
                peer.dest = memoryview(reason)
            return True
        with self._lock:
            if kind == COLL:
                self._heard[peer.rank] = max(self._heard[peer.rank], seq)
                if self._broken is not None:
                    return True  # collectives are over: discard
            posted = self._posted.get((peer.rank, kind, 0 if kind == COLL else tag))
            if posted:
                req = posted.popleft()
                error = self._check(req, frame)
                if error is not None:
                    self._complete(req, error)
                    if kind == COLL:
                        self._break_collectives(CollectiveMismatchError, str(error), (peer.rank,), seq, notify=True)
                    return True
                if req.buf is None:
                    req.result = _payload_buffer(nbytes)
                    peer.dest = memoryview(req.result)
                else:
                    peer.dest = req.buf
                peer.target = req
                return True
        buf = peer.target = _payload_buffer(nbytes)
        peer.dest = memoryview(buf)
        return True

    def _end_frame(self, peer: _Peer) -> None:
        """A payload is complete: finish its receive, queue it as unexpected, or act on it."""
        frame, target = peer.frame, peer.target
        assert frame is not None
        peer.frame, peer.dest, peer.target, peer.got = None, None, None, 0
        kind, opcode, _, tag, seq, _ = frame
        if isinstance(target, Recv):
            with self._lock:
                self._complete(target, None)
            return
        with self._lock:
            if kind == ARRIVED:
                self._heard[peer.rank] = max(self._heard[peer.rank], seq)
                self._arrivals[peer.rank] = (seq, opcode, tag)
                self._compare_arrival(peer.rank)
                return
            if target is None:
                return  # discarded
            if kind in (ABORT, BYE) and opcode:
                reason = bytes(target).decode(errors="replace")
                cls = _ABORT_CLASS.get(opcode, CollectiveMismatchError)
                self._break_collectives(cls, f"rank {peer.rank} reported: {reason}", (peer.rank,), seq, notify=False)
            if kind == BYE:
                self._lose_peer(peer, f"rank {peer.rank} shut down", crashed=False)
            if kind in (ABORT, BYE):
                return
            if kind == COLL and self._broken is not None:
                return  # collectives stopped while it was in flight
            key = (peer.rank, kind, 0 if kind == COLL else tag)
            posted = self._posted.get(key)
            if not posted:  # nobody asked yet: keep it for the receive to come
                queue = self._unexpected.get(key)
                if queue is None:
                    queue = self._unexpected[key] = deque()
                queue.append((frame, target))
                return
            req = posted.popleft()  # posted while the payload was in flight
        self._deliver(req, frame, target, peer.rank, seq if kind == COLL else None)

    def _deliver(self, req: Recv, frame: Frame, payload: Payload, peer: int, seq: int | None) -> None:
        """Check ``frame`` against ``req``, copy its payload in (outside the lock: it may be
        large) and complete ``req``; a collective frame that does not match (``seq`` given)
        stops the group's collectives."""
        error = self._check(req, frame)
        if error is None:
            if req.buf is None:
                req.result = payload
            else:
                req.buf[:] = payload
        with self._lock:
            self._complete(req, error)
            if error is not None and seq is not None:
                self._break_collectives(CollectiveMismatchError, str(error), (peer,), seq, notify=True)

    def _check(self, req: Recv, frame: Frame) -> PGError | None:
        """``None`` if ``frame`` is what ``req`` expects, else the error saying how they differ."""
        kind, opcode, dtype, tag, seq, nbytes = frame
        if kind == COLL:
            if (seq, opcode, tag, dtype, nbytes) == (req.seq, req.opcode, req.tag, req.dtype, req.nbytes):
                return None
            theirs = f"{_op_name(opcode)} #{seq} ({describe_arg(tag)}; {nbytes} bytes of {_dtype_name(dtype)})"
            ours = (
                f"{_op_name(req.opcode)} #{req.seq} ({describe_arg(req.tag)}; "
                f"{req.nbytes} bytes of {_dtype_name(req.dtype)})"
            )
            return CollectiveMismatchError(
                f"{self.label}: collective mismatch: rank {req.peer} sent a message of {theirs} "
                f"where this rank expected one of {ours}; every rank must call the same collectives "
                "in the same order with matching shapes, dtypes, roots and reduce ops",
                peers=(req.peer,),
            )
        if kind == TENSOR and (dtype != req.dtype or nbytes != req.nbytes):
            return CollectiveMismatchError(
                f"{self.label}: recv from rank {req.peer} (tag {req.tag}) into {req.nbytes} bytes of "
                f"{_dtype_name(req.dtype)}, but the message carries {nbytes} bytes of {_dtype_name(dtype)}; "
                "send and recv must use tensors of the same dtype and number of elements",
                peers=(req.peer,),
            )
        return None

    # == completion and failure ==================================================================

    def _complete(self, req: Request, error: BaseException | None) -> None:
        """Finish ``req`` once. Under the lock."""
        if req.done:
            return
        req.error = error
        req.done = True
        if req.seq is not None:
            self._pending_coll.discard(req)
        if req.work is not None:
            self._async.discard(req)
            self._finished_works.append(req)
        if self._sleepers:
            self._cond.notify_all()

    def _settle(self) -> None:
        """Complete the ``Work`` of finished requests, outside the lock (callbacks may re-enter)."""
        with self._lock:
            finished, self._finished_works = self._finished_works, []
        for req in finished:
            _settle_work(req)

    def _withdraw(self, req: Request) -> None:
        """Take a pending request out of the queues before failing it. Under the lock."""
        if isinstance(req, Recv):
            posted = self._posted.get(req.key)
            if posted is not None and req in posted:
                posted.remove(req)
            # else: its payload is being read right now; the reader drops the completion.
        elif isinstance(req, Send):
            peer = self._peers[req.peer]
            if peer is not None and req in peer.outq:
                if req.sent == 0:  # nothing on the wire yet
                    peer.outq.remove(req)
                else:  # partly on the wire: the frame must be finished, from a private copy
                    req.detach()

    def _expire(self, req: Request) -> None:
        """``req`` passed its deadline: fail it with CollectiveTimeout."""
        with self._lock:
            if req.done:
                return
            self._withdraw(req)
            if req.seq is None:
                peers: tuple[int, ...] = (req.peer,)
                what = f"{req.name} {'to' if isinstance(req, Send) else 'from'} rank {req.peer}"
            else:
                peers = tuple(p for p in range(self.size) if p != self.rank and self._heard[p] < req.seq)
                peers = peers or (req.peer,)
                what = f"{req.name} (collective #{req.seq})"
            error = CollectiveTimeout(
                f"{self.label}: {what} timed out after {req.timeout:g} s; not heard from rank(s) "
                f"{', '.join(map(str, peers))}",
                op=req.name,
                seq=req.seq,
                peers=peers,
            )
            self._complete(req, error)
            if req.seq is not None:
                self._break_collectives(CollectiveTimeout, str(error), peers, req.seq, notify=False)
        self._settle()

    def _peer_error(self, req: Request, peer: _Peer) -> PeerFailureError:
        what = f"{req.name} (collective #{req.seq})" if req.seq is not None else req.name
        return PeerFailureError(f"{self.label}: {what} needs rank {peer.rank}, but {peer.closed}", peers=(peer.rank,))

    def _lose_peer(self, peer: _Peer, reason: str, *, crashed: bool) -> None:
        """``peer`` can no longer be talked to: fail what depends on it. Under the lock."""
        if peer.closed is not None:
            return
        peer.closed = reason
        peer.crashed = crashed
        self._poll_dirty = True
        self._wake_driver()
        doomed: list[Request] = [r for key, queue in self._posted.items() if key[0] == peer.rank for r in queue]
        doomed.extend(peer.outq)
        if isinstance(peer.target, Recv):
            doomed.append(peer.target)
        for key in [key for key in self._posted if key[0] == peer.rank]:
            del self._posted[key]
        peer.outq.clear()
        for req in doomed:
            self._complete(req, self._peer_error(req, peer))
        if crashed:  # a crashed rank cannot finish any collective: everyone must stop
            self._break_collectives(PeerFailureError, reason, (peer.rank,), None, notify=False)
        else:  # tell the others if a collective of ours failed because of it
            for req in doomed:
                if req.seq is not None:
                    self._break_collectives(PeerFailureError, reason, (peer.rank,), req.seq, notify=True)
                    break

    def _break_collectives(
        self, cls: type[PGError], reason: str, peers: tuple[int, ...], seq: int | None, *, notify: bool
    ) -> None:
        """Stop this group's collectives: fail every pending one, refuse later ones, and
        (``notify``) send ABORT so the other ranks stop too. Under the lock."""
        if self._broken is not None:
            return
        self._broken = (cls, reason, peers)
        for req in list(self._pending_coll):
            self._withdraw(req)
            self._complete(req, self._broken_error(req.name, req.seq))
        self._posted = {k: q for k, q in self._posted.items() if k[1] != COLL}
        self._unexpected = {k: q for k, q in self._unexpected.items() if k[1] != COLL}
        if notify:
            code = _ABORT_CODE.get(cls, _ABORT_MISMATCH)
            payload = memoryview(f"collective #{seq}: {reason}".encode())
            for peer in self._live_peers():
                self._send_locked(
                    peer, Send("abort", ABORT, peer.rank, payload, opcode=code, wire_seq=seq or 0, timeout=30.0)
                )

    def _broken_error(self, op: str, seq: int | None) -> PGError:
        assert self._broken is not None
        cls, reason, peers = self._broken
        message = f"{self.label}: {op} (collective #{seq}) cannot run: this group's collectives stopped: {reason}"
        if cls is CollectiveTimeout:
            return CollectiveTimeout(message, op=op, seq=seq, peers=peers)
        if cls is PeerFailureError:
            return PeerFailureError(message, peers=peers)
        return CollectiveMismatchError(message, peers=peers)

    def begin_collective(self, op: str, seq: int, arg: int) -> None:
        """Collective #``seq`` starts on this rank; raise now if it cannot succeed
        (closed, broken, a peer gone, a peer known to be in another collective)."""
        with self._lock:
            self._current = (seq, OPCODE[op], arg)
            for announced in list(self._arrivals):
                self._compare_arrival(announced)
            if self._closed is not None:
                raise GroupClosedError(f"{self.label}: {op} after the group was {self._closed}")
            if self._broken is not None:
                raise self._broken_error(op, seq)
            for peer in self._peers:
                # A crashed peer fails every collective. One that shut down cleanly finished all of
                # its collectives, this one included: it needed nothing more from this rank, and what
                # it sent is already here; a receive that still needs it fails when it is posted.
                if peer is not None and peer.closed is not None and peer.crashed:
                    raise PeerFailureError(
                        f"{self.label}: {op} (collective #{seq}) needs every rank, but {peer.closed}",
                        peers=(peer.rank,),
                    )

    def _compare_arrival(self, peer: int) -> None:
        """A peer blocked in collective #seq: if this rank is at #seq, do they agree? Under the lock."""
        seq, opcode, arg = self._arrivals[peer]
        ours, our_opcode, our_arg = self._current
        if seq != ours:
            if seq < ours:
                del self._arrivals[peer]
            return
        del self._arrivals[peer]
        if (opcode, arg) != (our_opcode, our_arg):
            self._break_collectives(
                CollectiveMismatchError,
                f"collective mismatch at collective #{seq}: rank {peer} is blocked in "
                f"{_op_name(opcode)} ({describe_arg(arg)}) while rank {self.rank} is in "
                f"{_op_name(our_opcode)} ({describe_arg(our_arg)})",
                (peer,),
                seq,
                notify=True,
            )

    def _live_peers(self) -> list[_Peer]:
        return [p for p in self._peers if p is not None and p.closed is None]

    # == the progress thread ==================================================================

    def _progress_loop(self) -> None:
        """Drive progress while asynchronous requests are outstanding; sleep otherwise."""
        while True:
            with self._lock:
                while not self._async and not self._stopping:
                    self._idle.wait()
                if self._stopping:
                    return
                now = time.monotonic()
                expired = [r for r in self._async if r.deadline <= now]
                horizon = min(r.deadline for r in self._async) - now
            for req in expired:
                self._expire(req)
            self._drive(None, min(max(horizon, 0.0), 0.5))

    # == life ===========================================================================

    def shutdown(self, timeout: float) -> None:
        """Drain queued sends (bounded by ``timeout``), say BYE, close everything."""
        with self._lock:
            if self._closed is not None:
                return
            self._closed = "shut down"
            for req in [r for q in self._posted.values() for r in q]:
                self._complete(req, GroupClosedError(f"{self.label}: {req.name} was pending at shutdown"))
            self._posted.clear()
            code, reason = 0, _EMPTY
            if self._broken is not None and self._broken[0] in _ABORT_CODE:
                # peers still waiting learn why, not just "shut down" (a timeout each rank sees for itself)
                code = _ABORT_CODE[self._broken[0]]
                reason = memoryview(self._broken[1].encode())
            for peer in self._live_peers():
                self._send_locked(peer, Send("bye", BYE, peer.rank, reason, opcode=code, timeout=timeout))
        self._settle()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not any(p.outq for p in self._live_peers()):
                    break
            self._drive(None, min(0.1, deadline - time.monotonic()))
        self._close("shut down")

    def abort(self) -> None:
        """Fail everything pending with GroupClosedError, wake every waiter, close. Any thread."""
        with self._lock:
            if self._closed == "aborted":
                return
            self._closed = "aborted"
            doomed = [r for q in self._posted.values() for r in q] + list(self._async) + list(self._pending_coll)
            for peer in self._peers:
                if peer is not None:
                    doomed.extend(peer.outq)
                    if isinstance(peer.target, Recv):
                        doomed.append(peer.target)
            for req in doomed:
                self._complete(req, GroupClosedError(f"{self.label}: {req.name} was aborted"))
            self._wake_driver()
            self._cond.notify_all()
        self._settle()
        self._close("aborted")

    def _close(self, how: str) -> None:
        with self._lock:
            self._stopping = True
            self._cond.notify_all()
            self._idle.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10.0)
        with self._lock:
            # let a driver in another thread leave its poll before the sockets go
            deadline = time.monotonic() + 5.0
            while self._driving and self._driver_ident != threading.get_ident() and time.monotonic() < deadline:
                self._wake_driver()
                self._sleepers += 1
                self._cond.wait(0.05)
                self._sleepers -= 1
            # whatever is still pending (a drain that timed out) fails now
            leftovers = [r for q in self._posted.values() for r in q] + list(self._async) + list(self._pending_coll)
            for peer in self._peers:
                if peer is not None:
                    leftovers.extend(peer.outq)
                    peer.outq.clear()
            self._posted.clear()
            for req in leftovers:
                self._complete(
                    req, GroupClosedError(f"{self.label}: {req.name} did not finish before the group was {how}")
                )
            for peer in self._peers:
                if peer is not None:
                    if peer.closed is None:
                        peer.closed = f"this rank's transport was {how}"
                    peer.sock.close()
            self._wake_r.close()
            self._wake_w.close()
        self._settle()

    @property
    def closed(self) -> bool:
        return self._closed is not None


def _settle_work(req: Request) -> None:
    work = req.work
    assert work is not None
    if req.error is not None:
        work.set_exception(req.error)
    else:
        work.set_result(getattr(req, "result", None))


# -- connection setup ---------------------------------------------------------------------

_HELLO: Final = struct.Struct("<8sHIH")  # magic, protocol version, rank, len(group_uid)
_ACK: Final = b"pg-tcp-ok"
_HELLO_TIMEOUT: Final = 10.0  # a peer says hello right after connecting; a silent stray is dropped


def _connect_mesh(ctx: BackendContext) -> dict[int, socket.socket]:
    """Connect to every other rank of the group; returns rank -> connected socket."""
    if ctx.size == 1:
        return {}
    deadline = time.monotonic() + ctx.timeout
    host = advertise_address(ctx.store, ctx.options.get("addr"))
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    socks: dict[int, socket.socket] = {}
    try:
        listener.bind((host, 0))
        listener.listen(ctx.size)
        port = listener.getsockname()[1]
        ctx.store.set(f"addr/{ctx.rank}", f"{host}:{port}")
        uid = ctx.group_uid.encode()
        hello = _HELLO.pack(HELLO_MAGIC, PROTOCOL_VERSION, ctx.rank, len(uid)) + uid

        # 1. connect to every lower rank and say hello (their listeners exist: they published)
        for rank in range(ctx.rank):
            key = f"addr/{rank}"
            try:
                wait_for(ctx.store, [key], _left(deadline, ctx, rank))  # polled: the store may be shared
            except Exception as exc:  # torch raises DistStoreError (a RuntimeError) on a store timeout
                raise TimeoutError(f"rank {rank} did not publish its address in the store: {exc}") from exc
            peer_host, _, peer_port = ctx.store.get(key).decode().rpartition(":")
            sock = socket.create_connection((peer_host, int(peer_port)), timeout=_left(deadline, ctx, rank))
            socks[rank] = sock
            sock.sendall(hello)
        # 2. accept every higher rank; check its hello; acknowledge it
        while len(socks) < ctx.size - 1:
            listener.settimeout(_left(deadline, ctx, None))
            conn, _ = listener.accept()
            conn.settimeout(min(_left(deadline, ctx, None), _HELLO_TIMEOUT))
            try:
                head = _recv_exact(conn, _HELLO.size)
                magic, version, rank, uid_len = _HELLO.unpack(head)
                their_uid = _recv_exact(conn, uid_len) if magic == HELLO_MAGIC and uid_len < 4096 else b""
            except (OSError, struct.error):  # includes a stray that stays silent past _HELLO_TIMEOUT
                conn.close()
                continue
            if magic != HELLO_MAGIC or version != PROTOCOL_VERSION or their_uid != uid:
                conn.close()  # not one of ours
                continue
            if not ctx.rank < rank < ctx.size or rank in socks:
                conn.close()
                raise PeerFailureError(
                    f"pg-tcp: rank {ctx.rank} got a second connection claiming rank {rank}", peers=(rank,)
                )
            conn.sendall(_ACK)
            socks[rank] = conn
        # 3. collect the acknowledgements of the lower ranks
        for rank in range(ctx.rank):
            socks[rank].settimeout(_left(deadline, ctx, rank))
            if _recv_exact(socks[rank], len(_ACK)) != _ACK:
                raise PeerFailureError(f"pg-tcp: rank {rank} refused rank {ctx.rank}'s connection", peers=(rank,))
    except TimeoutError as exc:
        for sock in socks.values():
            sock.close()
        missing = sorted(set(range(ctx.size)) - set(socks) - {ctx.rank})
        raise CollectiveTimeout(
            f"pg-tcp group {ctx.group_name!r} rank {ctx.rank}: could not connect to rank(s) {missing} "
            f"within {ctx.timeout:g} s ({exc})",
            op="connect",
            peers=missing,
        ) from exc
    except OSError as exc:
        for sock in socks.values():
            sock.close()
        raise PeerFailureError(
            f"pg-tcp group {ctx.group_name!r} rank {ctx.rank}: setting up connections failed: {exc}"
        ) from exc
    except BaseException:
        for sock in socks.values():
            sock.close()
        raise
    finally:
        listener.close()
    for sock in socks.values():
        _tune(sock)
    return socks


def _left(deadline: float, ctx: BackendContext, rank: int | None) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("setup deadline passed" + ("" if rank is None else f" while connecting to rank {rank}"))
    return left


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed during the handshake")
        buf += chunk
    return bytes(buf)


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)
