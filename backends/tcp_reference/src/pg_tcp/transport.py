"""The progress engine: TCP connections between the ranks of one group, made pair by pair
on first use, and the machinery that moves framed messages over them, under one lock.

This module knows nothing about collectives. It offers *requests*: post a send
or a receive, then wait for it, or turn it into a :class:`~pg_core.work.Work`.
:mod:`pg_tcp.backend` builds every operation out of these.

Design, and why
===============

**Connections, made on first use.** Constructing a transport waits for nobody: every
rank listens on port 0 of the interface that reaches the store
(:func:`pg_core.store.advertise_address`) and publishes ``host:port`` under
``addr/<rank>`` in the group's (already prefixed) store. A pair of ranks connects
when one of them first needs the other, as NCCL builds its point-to-point
communicators on first use, so point to point needs only its two ranks:

* a rank connects at once to *send* point to point: a send must not wait for
  its receiver, who may be busy elsewhere (the kernel accepts the connection and
  buffers the frame while the receiving process is not looking);
* in a collective, the lower rank of each pair connects at once, and the higher
  one waits for it (both are in the collective, and only one of them connects);
* a receive, and the higher rank in a collective, wait for the peer's connection,
  and connect themselves only if none came within min(1 s, timeout/4): that finds
  a peer that is gone without waiting for the timeout;
* the address is read from the store, polled through
  :func:`pg_core.store.wait_for` (the store may be shared) within the operation's
  deadline. A peer that never publishes one (never creates its backend) fails the
  operation at its timeout with :class:`~pg_core.errors.CollectiveTimeout` naming
  the operation and the peer; a peer whose listener is gone (it shut down or died)
  refuses the connection, which fails what needs it with
  :class:`~pg_core.errors.PeerFailureError` at once.

A connection opens with a hello, proves the job's secret where there is one, and settles
which connection of a pair carries the frames: :mod:`pg_tcp.handshake` says how (its
formats, its cryptography and its verdicts); this module runs it from the progress engine
and applies the verdicts to its peers and connections. Sockets are non-blocking, with
``TCP_NODELAY`` and short TCP keepalives (:func:`pg_tcp.handshake.tune`).

**Frames.** Every message is a 32-byte header followed by its payload, in the format of
:mod:`pg_tcp.wire`: point-to-point tensors (matched on (peer, tag), FIFO), byte messages
(same, separate namespace), collective frames (matched FIFO per peer and checked against
the receiver's expectation: sequence number, opcode, dtype, size and the op's argument),
and control frames (ARRIVED, ABORT, BYE, RETIRE, ABORTED). Because every collective frame
says what it is, ranks that call different things get
:class:`~pg_core.errors.CollectiveMismatchError` instead of reading each other's bytes as data.

**Limits on what a peer announces.** A header's ``nbytes`` is checked before anything is
allocated for it. A tensor or collective frame with a posted receive takes that receive's
size (a frame of another size is a mismatch, read past through a small scratch buffer; one
larger than both the receive and ``max_message_bytes`` is refused). A byte message may
announce at most ``max_message_bytes`` (option, default :data:`DEFAULT_MAX_MESSAGE_BYTES`).
Frames held ahead of their receive (unexpected) may total ``max_unexpected_bytes`` per peer
(option, default :data:`DEFAULT_MAX_UNEXPECTED_BYTES`): a byte message beyond it is refused,
a tensor or collective frame beyond it *parks* its connection (not read; the payload waits in
the kernel, TCP holds the sender) until a receive is posted, and is routed again then.
Control frames carry at most 64 KiB. A refused frame drops every connection of its peer
unread: the peer is lost as if it crashed (``PeerFailureError`` naming it, the announced size
and the option, on whatever needed it), the collectives stop with an ABORT to the others,
and the line is logged on the ``pg_tcp`` logger.

**Receiving from any source.** A tensor receive may name no peer (:data:`ANY`): it takes
the oldest message queued on its tag from any peer (each arrival is numbered), or is
posted and takes the first to arrive. Named and any-source receives of one tag wait in
one order (each posted receive is numbered): an arriving message goes to the oldest of
the receives that accept it, the one naming its sender or an any-source one, so every
peer's messages are received in the order it sent them, as MPI's matching does. An
any-source receive waits for the peers' connections and, after min(1 s, timeout/4), makes
one to each peer that has none, which finds the peers that are gone; once every other rank
is gone it fails with :class:`~pg_core.errors.PeerFailureError`, and at its deadline with
:class:`~pg_core.errors.CollectiveTimeout` naming every other rank.

**Zero copy.** A send is one ``sendmsg([header, payload])`` whose payload is a
memoryview over the tensor's own memory; a receive that was posted before its
frame arrived is read with ``recv_into`` straight into the tensor. Only a frame
that arrives before its receive is posted ("unexpected") is buffered, once, and only
the unwritten rest of a blocking send whose receiver is not reading (next section).

**Blocking sends that do not fit the kernel.** A blocking ``send``/``send_bytes`` never
waits for its receiver, whatever its size (``eager_limit_bytes`` ``None``): it writes
from the caller's memory while the socket takes bytes, and once the socket has taken
nothing for :data:`_STALL_S` (the receiver is not reading: it computes, or has not
reached its receive) it copies the part not written yet, never what the kernel already
took, and returns; the caller may then reuse its tensor at once. The *drain thread*
(:meth:`Transport._drain_loop`, made on first use, normal priority) finishes such frames
while nobody else drives; any thread that waits in pg-tcp writes them too (queued on the
connection, in order: messages keep their order per (peer, tag), and a later send to
that peer queues behind them). The copies may total ``max_buffered_send_bytes`` (option,
default :data:`DEFAULT_MAX_BUFFERED_SEND_BYTES`): a send whose copy would go beyond it,
while earlier ones are still buffered, keeps writing from the caller's memory and waits
for them to drain, at most until its own deadline, then raises
:class:`~pg_core.errors.CollectiveTimeout` saying so and what to do. A send with nothing
buffered before it is always taken, whatever its size: the budget is on the total, it is
not an eager limit. A peer that fails with frames buffered for it fails them silently; the
next operation that needs it raises :class:`~pg_core.errors.PeerFailureError`, as for any
failed write. ``shutdown`` writes them before its BYE (bounded by its timeout); ``abort``
drops them. ``isend`` never copies: its caller leaves the tensor alone until the
``Work`` completes.

**Progress without a thread handoff.** There is no always-on I/O thread. Whoever
waits drives: the first waiting thread takes the *driver* role, polls every
connection, the listener and a wake-up socketpair, reads frames into posted
buffers (or the unexpected queue), continues partial sends, accepts connections,
and returns as soon as its own request is done. Other waiting threads sleep on a
condition that the driver signals whenever something completes, and take over when
it leaves. A blocking ``recv`` in the common one-thread case is therefore: one
``poll``, one or two ``recv_into``, no context switch; that is how pure Python
keeps up with a C++ backend on latency. Sends are tried directly by the posting
thread; only what the kernel did not take is queued for the driver (POLLOUT). A
sender whose socket is full keeps reading its incoming side while it waits, so two
ranks sending large messages to each other never deadlock.

Besides the drain thread (above), a background progress thread exists only for asynchronous requests (``isend``/
``irecv`` handed to the user as a ``Work``, and the messages of a launched collective,
:meth:`Transport.post_async`): it drives while at least one is outstanding, so a 64 MiB
``isend`` overlaps with the caller's compute, and sleeps on the condition otherwise.
A thread that waits for a request of its own drives first: it takes the driver role over
from the progress thread (whose poll it interrupts through the wake-up socketpair), and
the progress thread stands by while such a thread is here. So the data of an
asynchronous request waited for at once lands, and its ``Work``'s callbacks run (the
next steps of a launched collective), in the waiter's own thread, without a thread
switch after the data arrives. The progress thread runs at the idle scheduling class
where there is one (``SCHED_IDLE``), and is not woken for each asynchronous request: for
:data:`PROGRESS_LINGER_S` after the last one it looks every :data:`PROGRESS_TICK_S` on its
own, so a request its poster left without waiting starts moving within that, and one the
poster waits for at once costs no wake-up of it (which made it take the GIL just as the
reply landed); after a quiet spell it sleeps until a post wakes it
(see :meth:`Transport._await_async`).

**Failures.** EOF or a read error from a peer marks it failed: every
request that depends on it raises :class:`~pg_core.errors.PeerFailureError`
naming it, and so does every later request that needs it. The verdict waits only for
what the peer sent before it went: a crashed process's kernel ends each of its
connections on its own, so while the peer has another connection open here, or one
waits in our listener (two ranks that connected to each other at once), that one is
read to its end first, at most :data:`_SUSPECT_S` more. A connection the peer refuses
(its listener is gone) is judged the same way: what it sent before it went may still
wait in our listener. A collective fails only
if it needs the peer: one that needs nothing more from it (the peer did its part and
left: a rank that exits right after a barrier while the others are still in theirs)
completes, crash or clean shutdown alike, since what the peer sent is here; after a
crash, a collective the peer never reached fails as it begins. A clean ``shutdown`` sends BYE first (and answers the
connections it never used, so their makers do not take its exit for a crash), so
peers say "rank N shut down" instead of reporting a crash, and only what needed
rank N fails; it closes only once the peers' kernels acknowledged every byte sent
(a socket closed with unread bytes is reset, and a reset discards what was not
delivered yet, the BYE included). A failed *write* decides nothing by itself: the peer's last frames
(an ABORT, a BYE) are still in the receive buffer, and the reader, which reads them
and then the EOF, gives the verdict. A collective that fails locally (mismatch,
peer failure) sends ABORT to the connected ranks so they raise too instead of
hanging, and breaks this group's collective stream from that collective on: later
collectives raise at once (re-form the group), while an earlier one that a slower rank
is still in goes on (the failing rank finished it: the ABORT for collective #s stops
nothing before #s). A BYE sent after that carries the reason and the collective too,
so ranks still waiting learn why rather than just "shut down"; a rank whose collectives
stopped answers an ARRIVED for one it will not finish with an ABORT (the waiter may
have had no connection from it when it stopped). Point to point keeps working. Ranks blocked in different collectives that exchange no data (two
"roots" of a ``reduce``) learn it from the ARRIVED frames that a collective
blocked for a while (min(1 s, timeout/4)) sends, which carry its opcode and
argument. A request that passes its deadline raises
:class:`~pg_core.errors.CollectiveTimeout` naming the op, the sequence number and
the ranks not heard from (the ARRIVED frames tell each rank who else reached the
collective). ``abort`` (any thread) fails everything pending with
:class:`~pg_core.errors.GroupClosedError` and closes; before closing it writes ABORTED on
every connection a peer reads from it, as far as the kernel takes it at once (it never
waits for a peer), so a peer blocked in a receive from it or in a collective raises
:class:`~pg_core.errors.PeerFailureError` saying "rank N aborted" rather than taking it for
a crash. A connection whose last frame is half written gets no ABORTED: its peer sees it
close (a crash, to it).

**Threads and locks.** One lock (``_lock``) guards all shared state: queues,
request completion, peer and connection status and socket *writes* (sends are
non-blocking, so it is never held across a wait). Socket *reads*, accepting, and
registering or closing sockets in the poller belong to the driver alone. Making a
connection (reading the store, ``connect``) happens in the thread that needs it,
outside the lock, one thread per peer at a time. ``Work`` objects are completed
outside the lock, so their callbacks may call back into the backend.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import logging
import mmap
import os
import secrets
import select
import socket
import termios
import threading
import time
from collections import deque
from typing import Final

from pg_core.backend import BackendContext
from pg_core.errors import (
    BackendUnavailableError,
    CollectiveMismatchError,
    CollectiveTimeout,
    GroupClosedError,
    PeerFailureError,
    PGError,
    StoreUnavailableError,
)
from pg_core.store import advertise_address
from pg_core.work import Work

from .handshake import (
    AUTH,
    CHALLENGE_IN,
    HELLO,
    HELLO_IN,
    HELLO_MAGIC,
    HELLO_TIMEOUT,
    MAC,
    MAX_UID,
    NONCE,
    OPEN,
    PROOF_IN,
    REPLY_CLOSING,
    REPLY_CROSSED,
    REPLY_GONE,
    REPLY_IN,
    REPLY_OK,
    REPLY_SWITCH,
    Closing,
    NonceLedger,
    NotPublished,
    Refused,
    accept,
    answer_challenge,
    challenge,
    connect,
    hello,
    hello_extra,
    proven,
    read_address,
)
from .wire import (
    ABORT,
    ABORTED,
    ARRIVED,
    BYE,
    BYTES,
    COLL,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_CONTROL_BYTES,
    OPCODE,
    PROTOCOL_VERSION,
    REASON_CLASS,
    REASON_CODE,
    RETIRE,
    TENSOR,
    Frame,
    describe_arg,
    describe_dtype,
    describe_op,
    reason_code,
)

__all__ = [
    "ANY",
    "DEFAULT_MAX_BUFFERED_SEND_BYTES",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_MAX_UNEXPECTED_BYTES",
    "Recv",
    "Request",
    "Send",
    "Transport",
]

_log = logging.getLogger("pg_tcp")

#: The peer of a tensor receive from any source, until a message is matched to it (then its sender).
ANY: Final = -1

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


# -- requests -----------------------------------------------------------------------


class Request:
    """One posted send or receive. Completed exactly once, under the transport's lock."""

    __slots__ = (
        "announce_at",
        "deadline",
        "done",
        "error",
        "keep",
        "kind",
        "name",
        "peer",
        "probe_at",
        "seq",
        "timeout",
        "work",
    )

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
        self.probe_at = 0.0  # no connection to the peer yet: when to try to make one
        self.keep = keep  # the tensor whose memory a view points into
        self.done = False
        self.error: BaseException | None = None
        self.work: Work | None = None


class Send(Request):
    """A frame to write: the header, then the payload, which is one buffer or a list of
    buffers written back to back (scatter-gather: a message's parts are never joined)."""

    __slots__ = ("conn", "copied", "header", "hlen", "parts", "sent", "skipped", "total")

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
        self.hlen = HEADER_SIZE
        self.sent = 0
        self.total = HEADER_SIZE + nbytes
        self.conn: _Conn | None = None  # the connection it was queued on
        self.skipped = 0  # payload bytes written before ``parts`` became a copy of the rest
        self.copied = 0  # bytes of that copy a blocking send left behind (counted against the budget)

    @classmethod
    def raw(cls, name: str, peer: int, data: bytes) -> Send:
        """Bytes written as they are, without a frame header: a connection's hello."""
        req = cls(name, 0, peer, _EMPTY, timeout=_CONTROL_TIMEOUT)
        req.header = data
        req.hlen = req.total = len(data)
        return req

    def pending(self) -> list[bytes | memoryview]:
        """What is left to write, as ``sendmsg`` buffers (at most :data:`_IOV_MAX`)."""
        if self.sent < self.hlen:
            if len(self.parts) == 1:
                return [self.header[self.sent :], self.parts[0]]
            return [self.header[self.sent :], *self.parts[: _IOV_MAX - 1]]
        skip = self.sent - self.hlen - self.skipped
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

    def unwritten(self) -> int:
        """Payload bytes not written yet."""
        return self.total - max(self.sent, self.hlen)

    def copy_rest(self) -> tuple[int, bytes]:
        """A copy of the payload not written yet, and where in the payload it starts. Only
        what is left is copied, never what the kernel already took."""
        start = max(self.sent - self.hlen, 0)
        skip = start - self.skipped
        pieces: list[memoryview] = []
        for part in self.parts:
            if skip >= part.nbytes:
                skip -= part.nbytes
                continue
            pieces.append(part[skip:] if skip else part)
            skip = 0
        if len(pieces) == 1:
            return start, bytes(pieces[0])
        return start, b"".join(pieces)

    def adopt(self, start: int, rest: bytes) -> None:
        """Write the payload from ``start`` on out of ``rest`` (see :meth:`copy_rest`): the
        caller's buffers are free. Whatever was written since the copy was made is skipped
        in it. Under the transport's lock."""
        self.parts = [memoryview(rest)]
        self.skipped = start
        self.keep = None

    def detach(self) -> None:
        """Copy the unsent rest of the payload, so the caller's tensors are free although
        the frame must still be finished on the wire (a started frame cannot be withdrawn)."""
        self.adopt(*self.copy_rest())


class Recv(Request):
    """A receive; ``peer`` :data:`ANY` (tensors only): from whichever peer sends on its tag,
    and the sender's rank once a message is matched to it."""

    __slots__ = ("any", "buf", "dtype", "nbytes", "opcode", "order", "result", "tag")

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
        self.any = peer == ANY
        self.order = 0  # when it was posted (receives are matched oldest first)

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.peer, self.kind, 0 if self.kind == COLL else self.tag)


# -- connections and peers ----------------------------------------------------------------

#: Limits on what a peer may announce (options of the backend; see the module docstring).
DEFAULT_MAX_MESSAGE_BYTES: Final = 256 << 20
DEFAULT_MAX_UNEXPECTED_BYTES: Final = 512 << 20
#: What blocking sends may hold copied here, written after they returned (option
#: ``max_buffered_send_bytes``; see "Blocking sends that do not fit the kernel").
DEFAULT_MAX_BUFFERED_SEND_BYTES: Final = 256 << 20
#: A blocking send whose socket took nothing for this long hands its rest over (copied):
#: its receiver is not reading now. While the receiver reads, the send writes from the
#: caller's memory itself, with no copy.
_STALL_S: Final = 0.005
_BUDGET_POLL_S: Final = 0.05  # a send held back by the budget looks again at least this often

#: A failed connection's verdict on its peer waits at most this long for what the peer sent on
#: its other connection (open, or still in the listener) to be read: see ``_judge_suspects``.
_SUSPECT_S: Final = 1.0
_PROBE_S: Final = 1.0  # a rank waiting for a connection makes one itself after min(this, timeout/4)
PROGRESS_LINGER_S: Final = 1.0  # the progress thread keeps looking this long after the last asynchronous request
PROGRESS_TICK_S: Final = (
    0.001  # ... every this often, unwoken: an asynchronous request nobody drives waits at most this
)
_RETRY_S: Final = 0.1  # a connection this rank must make could not be made yet: try again after this
_SHUTDOWN_HELLOS_S: Final = 1.0  # at shutdown: how long to wait for the hellos of connections never read
_FLUSH_POLL_S: Final = 0.01  # at shutdown: how often to look whether the kernel has delivered what was sent
_TIOCOUTQ: Final = getattr(termios, "TIOCOUTQ", None)  # bytes a socket has sent that its peer has not acknowledged
_TCP_INFO: Final = getattr(socket, "TCP_INFO", None)  # its first byte is the connection's state
_TCP_CLOSE: Final = 7  # that state once the connection is over (a reset, both sides closed)
_CONTROL_TIMEOUT: Final = 30.0


class _Conn:
    """One TCP connection to a peer (or, accepted, to a peer not known yet). Reader fields
    belong to the driver; the rest to ``_lock``."""

    __slots__ = (
        "dead",
        "dest",
        "ended",
        "fd",
        "frame",
        "gated",
        "got",
        "hdr",
        "hdr_got",
        "hdr_view",
        "held",
        "hello",
        "hello_by",
        "initiated",
        "mask",
        "nonces",
        "outq",
        "parked",
        "peer",
        "quiet",
        "remote",
        "resume",
        "send_error",
        "sock",
        "state",
        "target",
    )

    def __init__(self, sock: socket.socket, peer: _Peer | None, *, initiated: bool) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = peer  # None: accepted, hello not read yet
        self.initiated = initiated  # made by this rank
        self.state = REPLY_IN if initiated else HELLO_IN
        self.hello_by = 0.0  # accepted: drop it if its hello has not come by then
        self.outq: deque[Send] = deque()
        self.send_error: str | None = None  # writing failed; the reader will tell why
        self.mask = 0  # what the poller watches
        self.held = False  # do not read: frames here come after a RETIRE not read yet
        self.ended = False  # the peer sends nothing more here
        self.quiet = False  # its EOF is expected, not a crash
        self.dead = False  # to be closed by the driver
        self.parked = False  # do not read: a frame too large to buffer waits here for its receive
        self.resume = False  # a parked frame's receive may be posted: route its header again
        self.remote = ""  # host:port of the other end, for messages
        self.gated = False  # made here, authenticated job: frames wait in outq until the acceptor proved itself
        self.nonces = (b"", b"")  # authenticated job: (maker's, acceptor's) nonce of this connection
        # reader state (driver only)
        self.hdr = bytearray(HEADER_SIZE)
        self.hdr_view = memoryview(self.hdr)
        self.hdr_got = 0
        self.hello: tuple[int, int, bytearray] | None = None  # rank, flags, uid being read
        self.frame: Frame | None = None  # the frame whose payload is being read
        self.dest: memoryview | None = None  # where it goes (None: discard)
        self.target: Recv | Payload | None = None
        self.got = 0


class _Peer:
    """Another rank of the group: its connections and what waits for one. Under ``_lock``."""

    __slots__ = (
        "accepted",
        "address",
        "backlog",
        "buffered",
        "closed",
        "connecting",
        "conns",
        "crashed",
        "hold",
        "rank",
        "sealed",
        "send",
        "suspect",
        "suspect_crashed",
        "suspect_until",
    )

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.conns: list[_Conn] = []
        self.send: _Conn | None = None  # the connection this rank writes to it on
        self.backlog: deque[Send] = deque()  # sends posted before there was a connection
        self.connecting = False  # a thread of this rank is making a connection to it
        self.address: tuple[str, int] | None = None
        self.hold = 0  # SWITCH answers read minus RETIRE frames read (> 0: hold the switched connection)
        self.closed: str | None = None  # why this peer can no longer be talked to
        self.crashed = False
        self.buffered = 0  # payload bytes from it held ahead of their receives (unexpected)
        self.accepted = False  # a connection it made was taken: it makes no second one
        self.sealed = False  # it answered ours saying it has none of its own: it makes none
        self.suspect: str | None = None  # a connection of it failed: why; the verdict waits (_judge_suspects)
        self.suspect_until = 0.0  # the verdict comes by then, whatever its other connections still hold
        self.suspect_crashed = False  # the verdict is a crash (a connection failed), not a refusal alone


# -- the transport -----------------------------------------------------------------------


class Transport:
    """The connections of one rank of one group and the requests that move data over them.

    Construct with a :class:`~pg_core.backend.BackendContext`: that listens and publishes
    this rank's address in the store, and waits for nobody. Connections are made on first
    use (see the module docstring). Thread-safe.
    """

    def __init__(self, ctx: BackendContext) -> None:
        self.rank = ctx.rank
        self.size = ctx.size
        self.label = f"pg-tcp group {ctx.group_name!r} rank {ctx.rank}"
        self._store = ctx.store
        self._key = ctx.auth_key  # the job's secret (API 1.8), or None: hellos are not authenticated
        self._nonces = NonceLedger()  # hello nonces already answered (the latest ones)
        self._uid = ctx.group_uid.encode()
        if len(self._uid) > MAX_UID:
            raise ValueError(f"{self.label}: group_uid is longer than {MAX_UID} bytes")
        self._max_message = ctx.byte_option("max_message_bytes", DEFAULT_MAX_MESSAGE_BYTES)
        self._max_unexpected = ctx.byte_option("max_unexpected_bytes", DEFAULT_MAX_UNEXPECTED_BYTES)
        self._parked: set[_Conn] = set()  # connections whose next frame waits for its receive
        self._suspects: set[_Peer] = set()  # peers with a failed connection, their verdict pending
        self._max_buffered = ctx.byte_option("max_buffered_send_bytes", DEFAULT_MAX_BUFFERED_SEND_BYTES)
        self._buffered: set[Send] = set()  # blocking sends that returned with their rest copied here
        self._buffered_bytes = 0  # the bytes of those copies
        self._drainer: threading.Thread | None = None  # writes them while nobody else drives
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # "something completed / the driver left"
        self._sleepers = 0  # threads waiting on _cond
        self._idle = threading.Condition(self._lock)  # the progress thread, when nothing is asynchronous
        self._linger_until = (
            0.0  # the progress thread looks every PROGRESS_TICK_S until then (the last post + PROGRESS_LINGER_S)
        )
        self._lingering = False  # it is in such a timed look: posts need not wake it
        self._drain_idle = threading.Condition(self._lock)  # the drain thread, when nothing is buffered
        self._driving = False
        self._driver_ident = 0
        self._driver_background = False  # the progress thread is the driver
        self._foreground = 0  # threads in _drive before the progress thread: waiters and the drain thread
        self._waiters = 0  # threads in _drive waiting for a request of their own: they drive first of all
        self._driver_yields = False  # the driver is the progress or the drain thread: a waiter takes over
        self._closed: str | None = None  # "shut down" / "aborted": no new requests
        self._stopping = False  # the progress thread must exit
        self._posted: dict[tuple[int, int, int], deque[Recv]] = {}  # (peer or ANY, kind, tag) -> receives
        self._unexpected: dict[tuple[int, int, int], deque[tuple[Frame, Payload, int]]] = {}  # (peer, kind, tag)
        self._posts = 0  # receives posted so far: their order
        self._queued = 0  # messages queued as unexpected so far: their order
        self._pending_coll: set[Request] = set()  # collective requests not yet done
        self._async: set[Request] = set()  # requests a user holds a Work for
        self._finished_works: list[Request] = []  # completed under the lock, to settle outside it
        self._broken: tuple[type[PGError], str, tuple[int, ...]] | None = None  # why collectives stopped
        self._stopped_from = 0  # once they did: the first collective (seq) that cannot run; earlier ones go on
        self._heard = [-1] * ctx.size  # highest collective seq each peer is known to have reached
        self._announced = -1
        self._current: tuple[int, int, int] = (0, 0, 0)  # seq, opcode, arg of this rank's latest collective
        self._arrivals: dict[int, tuple[int, int, int]] = {}  # peer -> (seq, opcode, arg) it announced
        self._thread: threading.Thread | None = None
        self._scratch = memoryview(bytearray(_DISCARD_CHUNK))
        self._peers: list[_Peer | None] = [None if r == ctx.rank else _Peer(r) for r in range(ctx.size)]
        self._conns: dict[int, _Conn] = {}  # fd -> connection, every one (accepted ones not known yet too)
        self._anonymous: set[_Conn] = set()  # accepted, hello not read yet
        self._poller = select.poll()
        self._poll_dirty = True
        self._listener: socket.socket | None = None
        self._listen_fd = -1
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._wake_fd = self._wake_r.fileno()
        self._poller.register(self._wake_fd, select.POLLIN)
        if ctx.size > 1:
            try:
                self._listen(ctx)
            except BaseException:
                self._wake_r.close()
                self._wake_w.close()
                raise

    def _listen(self, ctx: BackendContext) -> None:
        """Listen on port 0 of the interface that reaches the store and publish the address."""
        host = advertise_address(ctx.store, ctx.options.get("addr"))
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.bind((host, 0))
            listener.listen(ctx.size + 8)
            listener.setblocking(False)
            port = listener.getsockname()[1]
        except OSError as exc:
            listener.close()
            raise BackendUnavailableError(f"{self.label}: cannot listen on {host}: {exc}") from exc
        try:
            ctx.store.set(f"addr/{ctx.rank}", f"{host}:{port}")
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self._listen_fd = listener.fileno()
        self._poller.register(self._listen_fd, select.POLLIN)

    # == posting ==============================================================================

    def post_send(self, req: Send) -> Send:
        """Start ``req``: written now as far as the kernel takes it, the rest queued.

        A point-to-point send to a connected peer first reads what is waiting (one poll that
        does not block): a peer that died since the last read has left its EOF or reset there,
        and the send fails with PeerFailureError instead of handing the kernel bytes that can
        no longer be delivered."""
        self._prepare(req)
        if req.kind in (TENSOR, BYTES) and 0 <= req.peer < self.size:
            peer = self._peers[req.peer]
            if peer is not None and peer.send is not None and peer.closed is None:
                self._drive(None, 0.0)
        with self._lock:
            peer = self._admit(req)
            if peer is not None:
                self._send_locked(peer, req)
        if self._finished_works:
            self._settle()
        return req

    def post_recv(self, req: Recv) -> Recv:
        """Start ``req``: matched now against a frame that already arrived, or posted."""
        self._prepare(req)
        with self._lock:
            if req.any:
                early = self._match_any(req)
                if early is None:
                    return req
                frame, payload = early
            else:
                peer = self._admit(req)
                if peer is None:
                    return req
                key = req.key
                queue = self._unexpected.get(key)
                if not queue:
                    if peer.closed is not None:
                        self._lost(req, peer)
                        return req
                    self._post(req)
                    return req
                frame, payload, _ = queue.popleft()
                if not queue:
                    del self._unexpected[key]
                peer.buffered -= frame[5]
        self._deliver(req, frame, payload, req.peer, req.seq)  # an early frame
        self._settle()
        return req

    def _post(self, req: Recv) -> None:
        """Queue ``req`` for the frame to come, numbered in posting order. Under the lock."""
        self._posts += 1
        req.order = self._posts
        posted = self._posted.get(req.key)
        if posted is None:
            posted = self._posted[req.key] = deque()
        posted.append(req)
        if self._parked:  # a frame too large to buffer may be this receive's: route it again
            self._unpark()

    def _unpark(self) -> None:
        """Let the driver route the parked frames' headers again. Under the lock."""
        for conn in self._parked:
            conn.parked = False
            conn.resume = True
        self._parked.clear()
        self._poll_dirty = True
        self._wake_driver()

    def _unbuffer(self, rank: int, nbytes: int) -> None:
        """``nbytes`` held from ``rank`` ahead of their receive are no longer held. Under the lock."""
        peer = self._peers[rank]
        if peer is not None:
            peer.buffered -= nbytes

    def _match_any(self, req: Recv) -> tuple[Frame, Payload] | None:
        """An any-source receive: the oldest frame queued on its tag from any peer (``req.peer``
        becomes its sender), or ``None``: posted, or failed (closed, every other rank gone).
        Under the lock."""
        if self._closed is not None:
            self._complete(req, GroupClosedError(f"{self.label}: {req.name} after the group was {self._closed}"))
            return None
        oldest: deque[tuple[Frame, Payload, int]] | None = None
        sender = ANY
        for rank in range(self.size):
            queue = self._unexpected.get((rank, req.kind, req.tag))
            if queue and (oldest is None or queue[0][2] < oldest[0][2]):
                oldest, sender = queue, rank
        if oldest is None:
            if self._nobody_left():
                self._complete(req, self._nobody_left_error(req))
            else:
                self._post(req)
            return None
        frame, payload, _ = oldest.popleft()
        if not oldest:
            del self._unexpected[(sender, req.kind, req.tag)]
        self._unbuffer(sender, frame[5])
        req.peer = sender
        return frame, payload

    def _nobody_left(self) -> bool:
        """Whether every other rank is gone (an any-source receive can get nothing more). Under the lock."""
        return all(peer is None or peer.closed is not None for peer in self._peers)

    def _nobody_left_error(self, req: Recv) -> PeerFailureError:
        others = [peer for peer in self._peers if peer is not None]
        why = "; ".join(f"{peer.closed}" for peer in others)
        return PeerFailureError(
            f"{self.label}: {req.name} from any rank (tag {req.tag}): every other rank is gone ({why})",
            peers=[peer.rank for peer in others],
        )

    def _take_posted(self, rank: int, kind: int, tag: int) -> Recv | None:
        """The posted receive a frame from ``rank`` goes to: the oldest of those naming ``rank``
        and, for a tensor, the any-source ones of its tag (``peer`` becomes ``rank``). Under the lock."""
        named = self._posted.get((rank, kind, 0 if kind == COLL else tag))
        anyone = self._posted.get((ANY, kind, tag)) if kind == TENSOR else None
        if anyone and (not named or anyone[0].order < named[0].order):
            req = anyone.popleft()
            req.peer = rank
            return req
        return named.popleft() if named else None

    def _prepare(self, req: Request) -> None:
        """Connect to ``req``'s peer first if there is no connection and it is this rank's to
        make now (see the module docstring). Outside the lock."""
        peer = self._peers[req.peer] if 0 <= req.peer < self.size else None
        if peer is not None and peer.send is None and peer.closed is None and self._initiates(req, peer):
            self._connect_for(req, block=True)

    def _initiates(self, req: Request, peer: _Peer) -> bool:
        """Whether this rank connects to ``peer`` for ``req`` at once, rather than waiting for
        the peer's connection: to send point to point (a send must not wait for its receiver),
        and as the lower rank of a collective's pair (both are in it: one connects, no race)."""
        if req.seq is not None:
            return self.rank < peer.rank
        return isinstance(req, Send) and req.kind in (TENSOR, BYTES)

    def _admit(self, req: Request) -> _Peer | None:
        """Register ``req``; ``None`` if it failed (closed, broken, bad peer, or already). Under the lock."""
        if req.done:  # making the connection failed it
            return None
        if self._closed is not None:
            self._complete(req, GroupClosedError(f"{self.label}: {req.name} after the group was {self._closed}"))
            return None
        peer = self._peers[req.peer] if 0 <= req.peer < self.size else None
        if peer is None:
            self._complete(req, ValueError(f"{self.label}: {req.name} with peer {req.peer}: no such peer"))
            return None
        if req.seq is not None:
            if self._stopped(req.seq):
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
                self._linger_until = time.monotonic() + PROGRESS_LINGER_S
                if self._thread is None and not self._stopping:
                    self._thread = threading.Thread(
                        target=self._progress_loop, name=f"{self.label} progress", daemon=True
                    )
                    self._thread.start()
                elif not self._lingering:  # it looks within PROGRESS_TICK_S anyway: waking it costs the poster
                    self._idle.notify()
        if self._finished_works:  # (ours, if it completed already; the thread that finished others settles them)
            self._settle()
        return work

    # == connections ==========================================================================

    def _connect_for(self, req: Request, *, block: bool, probe: _Peer | None = None) -> None:
        """Make a connection to ``req``'s peer (or to ``probe``, one of an any-source receive's
        peers), unless it has one or one is being made. ``block``: wait for the peer's address
        within ``req``'s deadline; else only if it is published already. A failure fails ``req``
        (CollectiveTimeout at its deadline; nothing for a probe: other peers may still send) or
        the peer (a refused connection: it is gone). Outside the lock."""
        peer = self._peers[req.peer] if probe is None else probe
        assert peer is not None
        self._progress_now()  # a connection the peer made may be waiting: take it rather than make a second
        with self._lock:
            if peer.send is not None or peer.closed is not None or peer.connecting:
                return
            if peer.suspect is not None:  # a connection of it failed: its verdict comes, not a new one
                return
            if self._closed is not None or req.done:
                return
            peer.connecting = True
        try:
            sock = self._dial(peer, req.deadline, block=block)
        except (NotPublished, Closing):
            sock = None
        except StoreUnavailableError as exc:  # (a ConnectionError, but the store's host is gone, not the peer)
            self._connect_failed(peer)
            if probe is None:
                self._fail(req, exc)
            return
        except TimeoutError as exc:  # CollectiveTimeout (the store) or socket.timeout (connect)
            self._connect_failed(peer)
            if probe is None:
                self._expire(req, f"no connection to rank {peer.rank}: {exc}")
            return
        except OSError as exc:  # refused, unreachable: nothing listens there any more
            # A peer that sent something and then left may have left its connection, its
            # frames (and its BYE) in our listener or unread on a connection we took: those are
            # read first, by whoever drives (another thread may, now), and the verdict waits for
            # them (_judge_suspects), as for a connection that fails.
            with self._lock:
                peer.connecting = False
                if peer.send is None and peer.closed is None:
                    self._suspect(
                        peer,
                        f"rank {peer.rank} does not accept connections (it shut down or its process died): {exc}",
                        crashed=False,
                    )
                    self._wake_driver()  # its poll's timeout is now at most the verdict's deadline
            self._progress_now()
            self._settle()
            return
        except RuntimeError as exc:  # the store failed (torch raises DistStoreError, a RuntimeError)
            self._connect_failed(peer)
            if probe is not None:
                return
            self._fail(
                req,
                PeerFailureError(
                    f"{self.label}: {req.name}: cannot read rank {peer.rank}'s address from the store: {exc}",
                    peers=(peer.rank,),
                ),
            )
            return
        except BaseException:
            self._connect_failed(peer)
            raise
        with self._lock:
            peer.connecting = False
            if sock is None:
                return
            if peer.send is not None or peer.closed is not None or self._closed is not None:
                sock.close()  # one came meanwhile: drop ours before saying a word, so it is never used
                return
            conn = _Conn(sock, peer, initiated=True)
            self._add_conn(conn)
            peer.conns.append(conn)
            if self._key is None:
                self._write(conn, Send.raw("hello", peer.rank, self._hello(0)))
            else:  # no frame leaves before the acceptor proved it holds the key, and we did
                conn.nonces = (secrets.token_bytes(NONCE), b"")
                conn.state, conn.gated = CHALLENGE_IN, True
                self._write(conn, Send.raw("hello", peer.rank, self._hello(AUTH) + conn.nonces[0]))
            self._attach(peer, conn)
        self._settle()

    def _connect_failed(self, peer: _Peer) -> None:
        with self._lock:
            peer.connecting = False

    def _dial(self, peer: _Peer, deadline: float, *, block: bool) -> socket.socket:
        """A connected, tuned socket to ``peer``'s listener (its address read from the store
        once). Outside the lock."""
        if peer.address is None:
            peer.address = read_address(
                self._store, peer.rank, deadline, block=block, closing=self._closing, label=self.label
            )
        return connect(peer.address, peer.rank, deadline, closing=self._closing)

    def _closing(self) -> bool:
        return self._closed is not None

    def _hello(self, flags: int) -> bytes:
        return hello(self.rank, self._uid, flags)

    def _progress_now(self) -> None:
        """Two rounds of progress that do not block (accept, then read hellos); none if
        another thread drives (it does the same)."""
        if self._listener is not None:
            self._drive(None, 0.0)
            self._drive(None, 0.0)

    def _add_conn(self, conn: _Conn) -> None:
        """Under the lock; the driver registers it with the poller."""
        self._conns[conn.fd] = conn
        self._poll_dirty = True
        self._wake_driver()

    def _attach(self, peer: _Peer, conn: _Conn) -> None:
        """``conn`` becomes what this rank sends to ``peer`` on; what waited for it goes. Under the lock."""
        peer.send = conn
        backlog, peer.backlog = peer.backlog, deque()
        for req in backlog:
            self._write(conn, req)
        self._poll_dirty = True
        self._wake_driver()

    def _tick_connect(self, req: Request, peer: _Peer, now: float, limit: float, *, block: bool) -> float:
        """``req`` waits and its peer has no connection yet. If the connection is this rank's to
        make, (re)try to make it (``block``: waiting for the peer's address); otherwise wait for
        the peer's, and after min(1 s, timeout/4) probe: make one if the peer's address is
        published (a refused connection says the peer is gone). Returns when to look again.
        Outside the lock."""
        if peer.connecting:  # another thread is making it
            return limit
        immediate = self._initiates(req, peer)
        grace = min(_PROBE_S, req.timeout / 4)
        if req.probe_at == 0.0 and not immediate:
            req.probe_at = now + grace
        if now >= req.probe_at:
            self._connect_for(req, block=block and immediate)
            req.probe_at = time.monotonic() + (_RETRY_S if immediate else grace)
        return min(limit, req.probe_at)

    def _tick_any(self, req: Request, now: float, limit: float) -> float:
        """An any-source receive waits for its peers' connections; after min(1 s, timeout/4), and
        again as often, it probes every peer that has none: makes one if the peer's address is
        published (a refused connection says the peer is gone). Returns when to look again.
        Outside the lock."""
        grace = min(_PROBE_S, req.timeout / 4)
        if req.probe_at == 0.0:
            req.probe_at = now + grace
        if now >= req.probe_at:
            for peer in self._peers:
                if req.done or req.peer != ANY:
                    break
                if peer is not None and peer.send is None and peer.closed is None and not peer.connecting:
                    self._connect_for(req, block=False, probe=peer)
            req.probe_at = time.monotonic() + grace
        return min(limit, req.probe_at)

    def _tick(self, req: Request, now: float, limit: float, *, block: bool) -> float:
        """What ``req`` waits for besides its frame: the connection to its peer
        (:meth:`_tick_connect`), or an any-source receive's to every peer (:meth:`_tick_any`).
        Returns when to look again. Outside the lock."""
        if req.peer == ANY:
            return self._tick_any(req, now, limit)
        peer = self._peers[req.peer]
        if peer is not None and peer.send is None and peer.closed is None:
            return self._tick_connect(req, peer, now, limit, block=block)
        return limit

    # == waiting ==============================================================================

    def wait(self, req: Request) -> None:
        """Drive progress until ``req`` completes; raise its error."""
        while not req.done:
            now = time.monotonic()
            if now >= req.deadline:
                self._expire(req)
                break
            limit = self._tick(req, now, req.deadline, block=True)
            if req.done:
                break
            now = time.monotonic()
            if req.seq is not None:
                limit = self._maybe_announce(req, now, limit)
            self._drive(req, limit - now)
        if req.error is not None:
            raise req.error

    def wait_send(self, req: Send) -> None:
        """A blocking send's wait (point to point): return once the frame is written, or once
        its socket has taken nothing for :data:`_STALL_S` (the receiver is not reading) with
        the unwritten rest copied and handed to the drain thread, which finishes it. The copy
        waits while earlier sends hold ``max_buffered_send_bytes`` (a send with nothing
        buffered before it is always taken), at most until the send's deadline:
        CollectiveTimeout then, saying what to do. Raises the send's error, if it failed by
        then; a failure after it returned is the peer's (see "Blocking sends that do not fit
        the kernel" in the module docstring)."""
        last, since = -1, 0.0
        while not req.done:
            now = time.monotonic()
            if now >= req.deadline:
                self._expire(req, self._over_budget(req))
                break
            wake = now + _STALL_S
            if req.sent != last:
                last, since = req.sent, now
            elif now - since >= _STALL_S:
                if self._hand_over(req):
                    break
                wake = now + _BUDGET_POLL_S  # held back by the budget: wait for earlier sends to drain
            limit = self._tick(req, now, req.deadline, block=True)
            if req.done:
                break
            self._drive(req, min(limit, wake) - time.monotonic())
        if req.error is not None:
            raise req.error

    def _over_budget(self, req: Send) -> str | None:
        """Why ``req`` could not be handed over, if the budget is what stopped it."""
        with self._lock:
            held = self._buffered_bytes
            if not held or held + req.unwritten() <= self._max_buffered:
                return None
        return (
            f"it waited for the {held} bytes that earlier sends left buffered here to drain, and its own "
            f"{req.unwritten()} bytes would exceed max_buffered_send_bytes={self._max_buffered}: their receivers "
            "have not taken them; post the matching receives sooner, use isend and wait for it, or raise the "
            "backend option max_buffered_send_bytes"
        )

    def _hand_over(self, req: Send) -> bool:
        """Copy what ``req`` has not written and leave it to the drain thread; ``False`` if
        the budget holds it back (or it completed meanwhile: then ``req.done``)."""
        with self._lock:
            if req.done:
                return True
            need = req.unwritten()
            if self._buffered_bytes and self._buffered_bytes + need > self._max_buffered:
                return False
        start, rest = req.copy_rest()  # outside the lock: the caller's memory stays as it is until we return
        with self._lock:
            if req.done:
                return True
            req.adopt(start, rest)
            req.copied = len(rest)
            self._buffered.add(req)
            self._buffered_bytes += req.copied
            if self._drainer is None and not self._stopping:
                self._drainer = threading.Thread(target=self._drain_loop, name=f"{self.label} drain", daemon=True)
                self._drainer.start()
            else:
                self._drain_idle.notify()
        return True

    def _drive_work(self, req: Request, timeout: float) -> None:
        """The ``Work`` driver: progress for at most ``timeout`` s; errors stay on the work."""
        now = time.monotonic()
        if not req.done:
            if now >= req.deadline:
                self._expire(req)
            else:
                limit = self._tick(req, now, min(req.deadline, now + timeout), block=timeout > 0)
                now = time.monotonic()
                if req.seq is not None and not req.done:
                    limit = self._maybe_announce(req, now, limit)
                if not req.done:
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

    def _drive(self, want: Request | None, timeout: float, *, background: bool = False, drain: bool = False) -> None:
        """One round of progress: become the driver and poll, or sleep until the driver signals.

        A thread waiting for a request of its own (``want``) drives before the progress thread
        (``background``): it takes the role over (the progress thread's poll is interrupted, and
        it stands by while such a thread is here), so what completes the waiter's request, and
        the callbacks of its work, run in the waiter's thread, with no thread switch after the
        data arrives."""
        with self._lock:
            if (want is not None and want.done) or self._stopping:
                return
            if background and self._foreground:  # a waiter or the drain thread drives: stand by
                self._idle.wait(timeout)
                return
            waiter = want is not None
            if drain and self._waiters:  # a waiter drives (its polls write buffered sends too): stand by
                self._sleepers += 1
                self._cond.wait(timeout)
                self._sleepers -= 1
                return
            foreground = waiter or drain  # the drain thread, too, comes before the idle progress thread
            if self._driving:
                if (waiter and self._driver_yields) or (drain and self._driver_background):
                    self._wake_driver()  # the driver yields on its next round
                self._sleepers += 1
                self._foreground += foreground
                self._waiters += waiter
                self._cond.wait(timeout)
                self._sleepers -= 1
                self._foreground -= foreground
                self._waiters -= waiter
                return
            self._driving = True
            self._driver_background = background
            self._driver_yields = background or drain
            self._driver_ident = threading.get_ident()
            self._foreground += foreground
            self._waiters += waiter
        try:
            self._poll_round(want, timeout)
        finally:
            with self._lock:
                self._driving = False
                self._driver_background = self._driver_yields = False
                self._driver_ident = 0
                self._foreground -= foreground
                self._waiters -= waiter
                if self._sleepers:
                    self._cond.notify_all()
                if foreground and not self._foreground and self._async and not self._lingering:
                    self._idle.notify_all()  # the progress thread drives what is left (it looks soon if lingering)
            if self._finished_works:
                self._settle()

    def _poll_round(self, want: Request | None, timeout: float) -> None:
        if self._poll_dirty:
            self._sync_poller()
        if self._suspects:  # a verdict is due by its deadline, whatever else comes
            timeout = min(timeout, min(p.suspect_until for p in self._suspects) - time.monotonic())
        events = self._poller.poll(max(0.0, timeout) * 1000.0)
        for fd, mask in events:
            if fd == self._wake_fd:
                try:
                    while self._wake_r.recv(4096):
                        pass
                except OSError:
                    pass
                continue
            if self._closed == "aborted":
                return
            if fd == self._listen_fd:
                self._accept()
                continue
            conn = self._conns.get(fd)
            if conn is None or conn.dead:
                continue
            if mask & _POLLOUT:
                self._flush(conn)
            if mask & _POLLIN and not conn.dead and (conn.peer is None or conn.peer.closed is None):
                if conn.held or conn.parked:  # not reading it; an error or hang-up on it, though, is news
                    if mask & (select.POLLERR | select.POLLHUP):
                        if conn.held:  # what it holds is read once the RETIRE before it is (or its
                            with self._lock:  # connection fails); its writes fail: stop watching it
                                self._send_failed(conn, OSError(errno.ECONNRESET, "hung up"))
                        else:
                            self._conn_lost(conn, f"connection to rank {conn.peer.rank if conn.peer else '?'} failed")
                    continue
                self._read(conn, want)
        if self._anonymous:
            self._drop_silent_strays()
        if self._suspects:
            self._judge_suspects()

    def _judge_suspects(self) -> None:
        """Give the verdict on each peer one of whose connections failed, once what it sent
        before it went has been read (driver only, at the end of a poll round). A crashed
        process's kernel ends all its connections at once, but each on its own: the one that
        carried its last messages may still be open here, or still waiting in our listener
        (its hello unread), when the other's reset is read. So the verdict waits while the
        peer has another connection open, or a connection is waiting to be accepted or to
        say hello, at most until ``suspect_until``."""
        now = time.monotonic()
        pending: bool | None = None  # whether connections wait to be accepted or to say hello
        with self._lock:
            suspects = list(self._suspects)
        for peer in suspects:
            with self._lock:
                if peer.closed is not None:
                    self._suspects.discard(peer)
                    continue
                if now < peer.suspect_until:
                    if any(not c.dead and not c.ended and not c.parked for c in peer.conns):
                        continue  # their end, which comes too, gives the verdict
                    if pending is None:
                        pending = self._connections_waiting()
                    if pending:
                        continue  # the next round reads them: poll returns at once
                self._suspects.discard(peer)
                assert peer.suspect is not None
                self._lose_peer(peer, peer.suspect, crashed=peer.suspect_crashed)
        if suspects:
            self._settle()

    def _connections_waiting(self) -> bool:
        """Whether the listener has connections to accept or an accepted one has bytes of its
        hello to read, now (no wait). Under the lock, driver only."""
        socks = [c.sock for c in self._anonymous if not c.dead]
        if self._listener is not None:
            socks.append(self._listener)
        if not socks:
            return False
        try:
            readable, _, _ = select.select(socks, [], [], 0)
        except (OSError, ValueError):
            return False
        return bool(readable)

    def _sync_poller(self) -> None:
        """Watch POLLIN where reading, POLLOUT where sends are queued; close dead connections. Driver only."""
        with self._lock:
            self._poll_dirty = False
            for conn in list(self._conns.values()):
                if conn.dead:
                    self._discard(conn)
                    continue
                peer = conn.peer
                want = 0
                if peer is None or peer.closed is None:
                    if not conn.ended and not conn.held and not conn.parked:
                        want |= _POLLIN
                    if conn.outq and conn.send_error is None and not (conn.gated and conn.outq[0].kind != 0):
                        want |= _POLLOUT
                if want == conn.mask:
                    continue
                if want == 0:
                    self._poller.unregister(conn.fd)
                elif conn.mask == 0:
                    self._poller.register(conn.fd, want)
                else:
                    self._poller.modify(conn.fd, want)
                conn.mask = want

    def _discard(self, conn: _Conn) -> None:
        """Close a dead connection; what was still queued on it fails. Under the lock, driver only."""
        if conn.mask:
            self._poller.unregister(conn.fd)
            conn.mask = 0
        self._conns.pop(conn.fd, None)
        self._anonymous.discard(conn)
        self._parked.discard(conn)
        peer = conn.peer
        if peer is not None:
            if conn in peer.conns:
                peer.conns.remove(conn)
            if peer.send is conn:
                peer.send = None
        leftovers: list[Request] = list(conn.outq)
        conn.outq.clear()
        if isinstance(conn.target, Recv):
            leftovers.append(conn.target)
        for req in leftovers:
            self._complete(
                req,
                PeerFailureError(f"{self.label}: {req.name}: connection to rank {req.peer} closed", peers=(req.peer,)),
            )
        conn.sock.close()

    def _wake_driver(self) -> None:
        """Interrupt the driver's poll (it must pick up new work). Under the lock."""
        if self._driving and self._driver_ident != threading.get_ident():
            with contextlib.suppress(OSError):  # full: it is being woken already
                self._wake_w.send(b"\0")

    # == accepting ==========================================================================

    def _accept(self) -> None:
        """Take every connection waiting in the listener; their hellos are read next. Driver only."""
        assert self._listener is not None
        for sock, remote in accept(self._listener):
            conn = _Conn(sock, None, initiated=False)
            conn.remote = remote
            conn.hello_by = time.monotonic() + HELLO_TIMEOUT
            with self._lock:
                self._add_conn(conn)
                self._anonymous.add(conn)

    def _drop_silent_strays(self) -> None:
        now = time.monotonic()
        with self._lock:
            for conn in list(self._anonymous):
                if conn.hello_by < now:
                    self._anonymous.discard(conn)
                    conn.dead = True
                    self._poll_dirty = True

    def _identify(self, conn: _Conn, rank: int, uid: bytes) -> bool:
        """An accepted connection said hello as ``rank``: answer it and put it to use. True
        if frames may be read from it now. Under the lock."""
        self._anonymous.discard(conn)
        peer = self._peers[rank] if 0 <= rank < self.size else None
        if uid != self._uid or peer is None:
            conn.dead = True  # another group's, or not pg-tcp at all
            self._poll_dirty = True
            return False
        if peer.closed is not None:
            conn.dead = True  # a peer already gone
            self._poll_dirty = True
            return False
        if self._closed is None and (peer.accepted or peer.sealed):
            # A rank makes at most one connection to a peer, and none once it answered the peer's
            # saying it had none of its own: whoever this is, it is not that rank.
            # (Shutting down, this rank answers every hello with "closing" and reads nothing: see below.)
            why = "it already made its connection" if peer.accepted else "it answered ours saying it makes none"
            self._refuse_claim(conn, rank, why)
            return False
        peer.accepted = True
        conn.peer = peer
        conn.state = OPEN
        peer.conns.append(conn)
        if self._closed is not None:  # shutting down: say so, rather than let it take our exit for a crash
            self._write(
                conn, Send.raw("closing", rank, self._hello(REPLY_GONE if peer.send is None else REPLY_CLOSING))
            )
            conn.ended = conn.quiet = True
            self._poll_dirty = True
            return False
        if peer.send is None:
            self._write(conn, Send.raw("reply", rank, self._hello(REPLY_OK)))
            self._attach(peer, conn)
        elif self.rank > rank:
            # Both connected at once, and the lower rank's connection wins: everything sent on
            # ours so far is followed by RETIRE, and the rest goes on this one.
            old = peer.send
            self._write(conn, Send.raw("reply", rank, self._hello(REPLY_SWITCH)))
            self._write(old, Send("retire", RETIRE, rank, _EMPTY, timeout=_CONTROL_TIMEOUT))
            old.quiet = True
            peer.send = conn
            self._poll_dirty = True
        else:
            # Both connected at once, and ours wins: the peer retires this one once it has
            # read our hello; until then frames from it arrive here.
            self._write(conn, Send.raw("reply", rank, self._hello(REPLY_CROSSED)))
        return True

    def _refuse_claim(self, conn: _Conn, rank: int, why: str) -> None:
        """Drop an accepted connection that claims ``rank`` although it cannot be that rank's;
        nothing read from it is delivered. Under the lock, driver only."""
        _log.warning(
            "%s: refused a connection from %s that says hello as rank %d: %s (a second claim of a live rank)",
            self.label,
            conn.remote or "?",
            rank,
            why,
        )
        conn.dead = True
        self._discard(conn)  # closed now: the stranger learns at once, and nothing of it is read

    def _answered(self, conn: _Conn, rank: int, flags: int, uid: bytes) -> bool:
        """The acceptor answered a connection this rank made. True if frames may be read
        from it now. Under the lock."""
        peer = conn.peer
        assert peer is not None
        if rank != peer.rank or uid != self._uid:
            self._lose_peer(
                peer,
                f"the address rank {peer.rank} published is answered by another process (rank {rank} of "
                f"{'this' if uid == self._uid else 'another'} group)",
                crashed=True,
            )
            return False
        conn.state = OPEN
        if flags == REPLY_OK:
            # The peer had no connection of its own to us, and will make none: a connection
            # that claims to be it from now on is someone else's.
            peer.sealed = True
        if flags == REPLY_SWITCH:
            peer.hold += 1
            if peer.hold > 0:
                conn.held = True
                self._poll_dirty = True
                return False
        elif flags in (REPLY_CLOSING, REPLY_GONE):
            conn.ended = conn.quiet = True
            self._poll_dirty = True
            if flags == REPLY_GONE:
                self._lose_peer(peer, f"rank {peer.rank} shut down", crashed=False)
            else:
                self._stop_sending(peer, conn)
            return False
        return True

    def _retired(self, conn: _Conn) -> None:
        """RETIRE came on ``conn``: the peer sends nothing more on it. Under the lock, driver only."""
        peer = conn.peer
        assert peer is not None
        conn.ended = conn.quiet = True
        conn.dead = True
        if peer.send is conn:  # the peer is shutting down; its BYE comes on its own connection
            self._stop_sending(peer, conn)
        elif peer.rank > self.rank:  # the higher rank switched to our connection
            peer.hold -= 1
            if peer.hold <= 0:
                for other in peer.conns:
                    other.held = False
        self._poll_dirty = True

    def _stop_sending(self, peer: _Peer, conn: _Conn) -> None:
        """The peer will not read ``conn`` any more (it is shutting down). Under the lock."""
        if peer.send is conn:
            peer.send = None
        doomed = list(conn.outq)
        conn.outq.clear()
        for req in doomed:
            self._complete(
                req,
                PeerFailureError(
                    f"{self.label}: {req.name} to rank {peer.rank}: it is shutting down", peers=(peer.rank,)
                ),
            )

    # == sending ==============================================================================

    def _send_locked(self, peer: _Peer, req: Send) -> None:
        if peer.closed is not None:
            self._lost(req, peer)
            return
        conn = peer.send
        if conn is None:  # the connection is being made, by this rank or the peer
            peer.backlog.append(req)
            return
        self._write(conn, req)

    def _write(self, conn: _Conn, req: Send) -> None:
        """Write ``req`` on ``conn`` as far as the kernel takes it; queue the rest. Under the lock."""
        req.conn = conn
        if conn.gated and req.kind != 0:  # a frame before the handshake ended: held (raw hellos go)
            conn.outq.append(req)
            return
        if not conn.outq and conn.send_error is None:
            try:
                req.sent = conn.sock.sendmsg(req.pending())
            except BlockingIOError:
                pass
            except OSError as exc:
                self._send_failed(conn, exc)
            if req.sent == req.total:
                self._complete(req, None)
                return
            self._poll_dirty = True
            self._wake_driver()
        conn.outq.append(req)

    def _send_failed(self, conn: _Conn, exc: OSError) -> None:
        """Writing to ``conn`` failed (the peer closed or reset). Under the lock.

        Not a verdict yet: what the peer said before it went (an ABORT, a BYE) is
        still in our receive buffer, so stop writing and let the reader, which
        reads those frames and then the EOF, decide between "shut down" and a
        crash. The queued sends fail then.
        """
        if conn.send_error is None:
            rank = conn.peer.rank if conn.peer is not None else "?"
            conn.send_error = f"connection to rank {rank} failed while sending: {exc}"
            self._poll_dirty = True
            self._wake_driver()

    def _flush(self, conn: _Conn) -> None:
        """Continue queued sends on ``conn`` (the driver, on POLLOUT)."""
        with self._lock:
            outq = conn.outq
            while outq and not conn.dead and (conn.peer is None or conn.peer.closed is None):
                req = outq[0]
                if conn.gated and req.kind != 0 and req.sent == 0:
                    break
                try:
                    req.sent += conn.sock.sendmsg(req.pending())
                except BlockingIOError:
                    return
                except OSError as exc:
                    self._send_failed(conn, exc)
                    return
                if req.sent < req.total:
                    return
                outq.popleft()
                self._complete(req, None)
            self._poll_dirty = True

    # == receiving ============================================================================

    def _read(self, conn: _Conn, want: Request | None) -> None:
        """Read whatever ``conn`` has for us: the hello or its answer, then frame by frame
        (the driver, on POLLIN)."""
        sock = conn.sock
        while True:
            if conn.resume:  # a parked header: its receive may be posted now
                conn.resume = False
                if not self._begin_frame(conn):
                    return
                continue
            try:
                if conn.state != OPEN:
                    if conn.hello is None:
                        n = sock.recv_into(conn.hdr_view[conn.hdr_got : HELLO.size])
                    else:
                        n = sock.recv_into(memoryview(conn.hello[2])[conn.got :])
                elif conn.frame is None:
                    n = sock.recv_into(conn.hdr_view[conn.hdr_got :])
                elif conn.dest is None:
                    n = sock.recv_into(self._scratch, min(_DISCARD_CHUNK, conn.frame[5] - conn.got))
                else:
                    n = sock.recv_into(conn.dest[conn.got :])
            except BlockingIOError:
                return
            except OSError as exc:
                rank = conn.peer.rank if conn.peer is not None else "?"
                self._conn_lost(conn, conn.send_error or f"connection to rank {rank} failed: {exc}")
                return
            if n == 0:
                rank = conn.peer.rank if conn.peer is not None else "?"
                self._conn_lost(
                    conn, f"rank {rank} closed its connection without saying goodbye (did its process die?)"
                )
                return
            if conn.state != OPEN:
                if not self._read_hello(conn, n):
                    return
                continue
            if conn.frame is None:
                conn.hdr_got += n
                if conn.hdr_got < HEADER_SIZE:
                    continue
                conn.hdr_got = 0
                if not self._begin_frame(conn):
                    return
            else:
                conn.got += n
            frame = conn.frame
            if frame is not None and conn.got == frame[5]:
                self._end_frame(conn)
                peer = conn.peer
                if (
                    conn.ended
                    or conn.held
                    or (peer is not None and peer.closed is not None)
                    or (want is not None and want.done)
                ):
                    return

    def _read_hello(self, conn: _Conn, n: int) -> bool:
        """``n`` more bytes of a hello or an answer arrived. False: stop reading ``conn`` now
        (not one of ours, held, or it ends); True: read on. Driver only."""
        if conn.hello is None:
            conn.hdr_got += n
            if conn.hdr_got < HELLO.size:
                return True
            conn.hdr_got = 0
            magic, version, rank, flags, uid_len = HELLO.unpack_from(conn.hdr)
            if magic != HELLO_MAGIC or version != PROTOCOL_VERSION or uid_len > MAX_UID:
                self._bad_hello(conn, f"magic {magic!r}, protocol version {version}")
                return False
            conn.hello = (rank, flags, bytearray(uid_len + hello_extra(conn.state, flags)))
            conn.got = 0
        else:
            conn.got += n
        rank, flags, uid = conn.hello
        if conn.got < len(uid):
            return True
        conn.hello = None
        conn.got = 0
        with self._lock:
            if conn.state == PROOF_IN:
                return self._proven(conn, rank, bytes(uid))
            if conn.state == CHALLENGE_IN:
                return self._challenged(conn, rank, flags, bytes(uid))
            if conn.state == HELLO_IN and (self._key is not None or flags & AUTH):
                return self._authenticate(conn, rank, flags, bytes(uid))
            if conn.initiated:
                return self._answered(conn, rank, flags, bytes(uid))
            return self._identify(conn, rank, bytes(uid))

    # -- authenticated jobs: challenge and response over both ends' nonces -------------------
    def _refuse(self, conn: _Conn, rank: int, why: str) -> bool:
        """Drop an accepted connection that failed authentication; nothing of it is read.
        Under the lock, driver only."""
        self._anonymous.discard(conn)
        _log.warning(
            "%s: refused a connection from %s that says hello as rank %d: %s", self.label, conn.remote or "?", rank, why
        )
        conn.dead = True
        self._discard(conn)
        return False

    def _authenticate(self, conn: _Conn, rank: int, flags: int, rest: bytes) -> bool:
        """An accepted connection said hello, and this job (or the hello) is authenticated:
        answer with this end's nonce and MAC, then read only the maker's MAC. Under the lock."""
        try:
            conn.nonces, answer = challenge(
                self._key,
                self._uid,
                size=self.size,
                me=self.rank,
                rank=rank,
                flags=flags,
                rest=rest,
                ledger=self._nonces,
            )
        except Refused as exc:
            return self._refuse(conn, rank, str(exc))
        self._write(conn, Send.raw("challenge", rank, answer))
        conn.state = PROOF_IN
        conn.hello = (rank, flags, bytearray(MAC))  # what is read next: the maker's MAC, nothing else
        return True

    def _proven(self, conn: _Conn, rank: int, mac: bytes) -> bool:
        """The maker's MAC arrived: verify it, then take the connection as an ordinary hello."""
        assert self._key is not None
        if not proven(self._key, self._uid, maker=rank, me=self.rank, nonces=conn.nonces, proof=mac):
            return self._refuse(conn, rank, "it failed to prove it holds the job's key (wrong MAC)")
        conn.state = HELLO_IN
        return self._identify(conn, rank, self._uid)

    def _challenged(self, conn: _Conn, rank: int, flags: int, rest: bytes) -> bool:
        """The acceptor answered this rank's authenticated hello: verify its MAC, prove ours,
        and let the held frames go. Under the lock."""
        peer = conn.peer
        assert peer is not None and self._key is not None
        if not flags & AUTH:
            if flags in (REPLY_CLOSING, REPLY_GONE) and rest == self._uid and rank == peer.rank:
                conn.state = REPLY_IN  # it is shutting down and read nothing: nothing to prove
                conn.gated = False
                return self._answered(conn, rank, flags, rest)
            self._lose_peer(peer, f"rank {peer.rank}'s address answered without authentication", crashed=True)
            return False
        try:
            theirs, proof = answer_challenge(
                self._key, self._uid, me=self.rank, peer=peer.rank, rank=rank, mine=conn.nonces[0], rest=rest
            )
        except Refused:
            _log.warning(
                "%s: the process at rank %d's address %s failed to prove it holds the job's key",
                self.label,
                peer.rank,
                conn.remote or "?",
            )
            self._lose_peer(
                peer,
                f"the address rank {peer.rank} published did not prove it holds the job's key (PG_CORE_AUTH_KEY)",
                crashed=True,
            )
            return False
        conn.nonces = (conn.nonces[0], theirs)
        conn.outq.appendleft(Send.raw("proof", peer.rank, proof))
        conn.gated = False
        conn.state = REPLY_IN
        self._poll_dirty = True
        self._wake_driver()
        return True

    def _bad_hello(self, conn: _Conn, what: str) -> None:
        with self._lock:
            if conn.peer is None:  # a stray: drop it
                self._anonymous.discard(conn)
                conn.dead = True
                self._poll_dirty = True
            else:
                self._lose_peer(
                    conn.peer,
                    f"the address rank {conn.peer.rank} published does not answer as pg-tcp does ({what})",
                    crashed=True,
                )

    def _conn_lost(self, conn: _Conn, reason: str) -> None:
        """EOF or an error on ``conn`` (the driver). Expected when the connection was ending;
        otherwise the peer crashed."""
        with self._lock:
            peer = conn.peer
            if peer is None or conn.quiet or peer.closed is not None:
                self._anonymous.discard(conn)
                conn.dead = conn.ended = True
                self._poll_dirty = True
                return
            # The verdict is not this connection's alone: what the peer sent on its other one,
            # or on one still in our listener, is read first (_judge_suspects, this round).
            conn.dead = conn.ended = True
            self._poll_dirty = True
            self._suspect(peer, reason, crashed=True)
            for other in peer.conns:  # a RETIRE it was held for will not come after this
                other.held = False

    def _suspect(self, peer: _Peer, reason: str, *, crashed: bool) -> None:
        """A connection to or from ``peer`` failed (``crashed``) or it refused ours: its verdict
        is given by :meth:`_judge_suspects` once what it sent is read, with the first reason.
        Under the lock."""
        if peer.suspect is None:
            peer.suspect = reason
            peer.suspect_until = time.monotonic() + _SUSPECT_S
        peer.suspect_crashed = peer.suspect_crashed or crashed
        self._suspects.add(peer)

    def _begin_frame(self, conn: _Conn) -> bool:
        """A header arrived: decide where its payload goes, within the limits on what a peer
        may announce (see the module docstring). False: stop reading ``conn`` now (the stream
        is unusable, or the frame waits, parked, for its receive)."""
        peer = conn.peer
        assert peer is not None
        magic, kind, opcode, dtype, tag, seq, nbytes = HEADER.unpack_from(conn.hdr)
        if magic != MAGIC or not TENSOR <= kind <= ABORTED:
            with self._lock:
                self._lose_peer(
                    peer, f"rank {peer.rank} sent a malformed frame (magic {magic:#x}, kind {kind})", crashed=True
                )
            return False
        frame: Frame = (kind, opcode, dtype, tag, seq, nbytes)
        conn.frame, conn.got, conn.dest, conn.target = frame, 0, None, None
        if kind >= ARRIVED:
            if nbytes > MAX_CONTROL_BYTES:
                with self._lock:
                    self._refuse_frame(conn, f"a control frame of {nbytes} bytes (at most {MAX_CONTROL_BYTES})")
                return False
            if kind in (ABORT, BYE, ABORTED):
                reason = conn.target = bytearray(nbytes)
                conn.dest = memoryview(reason)
            return True
        with self._lock:
            if kind == COLL:
                self._heard[peer.rank] = max(self._heard[peer.rank], seq)
                if self._stopped(seq):
                    return True  # collectives are over from this one on: discard
            req = self._take_posted(peer.rank, kind, tag)
            if req is not None:
                if req.buf is None and nbytes > self._max_message:  # a byte message: only the cap bounds it
                    self._refuse_frame(conn, f"a message of {nbytes} bytes", "max_message_bytes", req)
                    return False
                error = self._check(req, frame)
                if error is not None:
                    if nbytes > max(self._max_message, req.nbytes):  # too large even to read past
                        self._refuse_frame(
                            conn,
                            f"a message of {nbytes} bytes for a receive of {req.nbytes} bytes",
                            "max_message_bytes",
                            req,
                        )
                        return False
                    self._complete(req, error)
                    if kind == COLL:
                        self._break_collectives(CollectiveMismatchError, str(error), (peer.rank,), seq, notify=True)
                    return True
                if req.buf is None:
                    try:
                        req.result = _payload_buffer(nbytes)
                    except (MemoryError, OSError) as exc:
                        self._refuse_frame(
                            conn, f"a message of {nbytes} bytes, which cannot be allocated ({exc})", req=req
                        )
                        return False
                    conn.dest = memoryview(req.result)
                else:
                    conn.dest = req.buf
                conn.target = req
                return True
            # Nobody asked for it yet: held until its receive, within the peer's budget.
            if kind == BYTES and nbytes > self._max_message:
                self._refuse_frame(conn, f"a message of {nbytes} bytes", "max_message_bytes")
                return False
            if peer.buffered + nbytes > self._max_unexpected:
                if kind == BYTES:
                    self._refuse_frame(
                        conn,
                        f"a message of {nbytes} bytes while {peer.buffered} bytes from it wait for their receives",
                        "max_unexpected_bytes",
                    )
                    return False
                # A tensor's receive knows its size: the frame waits in the kernel (this connection
                # is not read meanwhile) until a receive is posted, and is judged against it then.
                conn.frame = None
                conn.parked = True
                self._parked.add(conn)
                self._poll_dirty = True
                return False
            peer.buffered += nbytes
        try:
            buf = conn.target = _payload_buffer(nbytes)
        except (MemoryError, OSError) as exc:
            with self._lock:
                self._refuse_frame(conn, f"a message of {nbytes} bytes, which cannot be allocated ({exc})")
            return False
        conn.dest = memoryview(buf)
        return True

    def _refuse_frame(self, conn: _Conn, what: str, option: str | None = None, req: Recv | None = None) -> None:
        """``conn``'s peer announced more than it may: drop its connections unread, fail what
        depends on it (``req``, the receive the frame was for, too) and stop the collectives,
        telling the other ranks. Under the lock, driver only."""
        peer = conn.peer
        assert peer is not None
        limits = {"max_message_bytes": self._max_message, "max_unexpected_bytes": self._max_unexpected}
        limit = limits.get(option or "")
        reason = f"rank {peer.rank} announced {what}" + (
            f", over this rank's {option} of {limit} (a pg-tcp option: raise it on every rank if such "
            "messages are legitimate)"
            if option is not None
            else ""
        )
        reason += "; its connection was dropped unread"
        _log.warning("%s: %s (from %s)", self.label, reason, conn.remote or f"rank {peer.rank}'s address")
        conn.frame = None
        self._break_collectives(PeerFailureError, reason, (peer.rank,), None if req is None else req.seq, notify=True)
        self._lose_peer(peer, reason, crashed=True)
        if req is not None:
            self._complete(req, self._peer_error(req, peer))
        for other in list(peer.conns):  # closed now, not at the next round: the peer learns at once
            other.dead = True
            self._discard(other)

    def _end_frame(self, conn: _Conn) -> None:
        """A payload is complete: finish its receive, queue it as unexpected, or act on it."""
        frame, target, peer = conn.frame, conn.target, conn.peer
        assert frame is not None and peer is not None
        conn.frame, conn.dest, conn.target, conn.got = None, None, None, 0
        kind, opcode, _, tag, seq, nbytes = frame
        if isinstance(target, Recv):
            with self._lock:
                self._complete(target, None)
            return
        with self._lock:
            if kind <= COLL and target is not None:  # held ahead of a receive until now
                peer.buffered -= nbytes
            if kind == ARRIVED:
                self._heard[peer.rank] = max(self._heard[peer.rank], seq)
                if self._stopped(seq):
                    # It waits in a collective this rank will never finish: say why. (It may have
                    # had no connection from here when the collectives stopped, so no ABORT.)
                    self._send_abort(peer, seq)
                    return
                self._arrivals[peer.rank] = (seq, opcode, tag)
                self._compare_arrival(peer.rank)
                return
            if kind == RETIRE:
                self._retired(conn)
                return
            if kind == ABORTED:  # it failed whatever it was in; it finishes no collective
                said = bytes(target).decode(errors="replace") if target is not None else ""
                conn.ended = conn.quiet = True
                reason = f"rank {peer.rank} aborted" + (f" ({said})" if said else "")
                self._lose_peer(peer, reason, crashed=True)
                # it finishes no collective from #seq on (0: it did not say): every rank's stop there
                self._break_collectives(PeerFailureError, reason, (peer.rank,), seq or None, notify=False)
                return
            if target is None:
                return  # discarded
            if kind in (ABORT, BYE) and opcode:
                reason = bytes(target).decode(errors="replace")
                cls = REASON_CLASS.get(opcode, CollectiveMismatchError)
                self._break_collectives(cls, f"rank {peer.rank} reported: {reason}", (peer.rank,), seq, notify=False)
            if kind == BYE:
                self._lose_peer(peer, f"rank {peer.rank} shut down", crashed=False)
            if kind in (ABORT, BYE):
                return
            if kind == COLL and self._stopped(seq):
                return  # collectives stopped while it was in flight
            req = self._take_posted(peer.rank, kind, tag)  # posted while the payload was in flight
            if req is None:  # nobody asked yet: keep it for the receive to come
                key = (peer.rank, kind, 0 if kind == COLL else tag)
                queue = self._unexpected.get(key)
                if queue is None:
                    queue = self._unexpected[key] = deque()
                self._queued += 1
                queue.append((frame, target, self._queued))
                peer.buffered += nbytes
                return
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
            theirs = f"{describe_op(opcode)} #{seq} ({describe_arg(tag)}; {nbytes} bytes of {describe_dtype(dtype)})"
            ours = (
                f"{describe_op(req.opcode)} #{req.seq} ({describe_arg(req.tag)}; "
                f"{req.nbytes} bytes of {describe_dtype(req.dtype)})"
            )
            return CollectiveMismatchError(
                f"{self.label}: collective mismatch: rank {req.peer} sent a message of {theirs} "
                f"where this rank expected one of {ours}; every rank must call the same collectives "
                "in the same order with matching shapes, dtypes, roots and reduce ops",
                peers=(req.peer,),
            )
        if kind == TENSOR and (dtype != req.dtype or nbytes != req.nbytes):
            what = (
                f"recv from any rank took a message from rank {req.peer}" if req.any else f"recv from rank {req.peer}"
            )
            return CollectiveMismatchError(
                f"{self.label}: {what} (tag {req.tag}) into {req.nbytes} bytes of "
                f"{describe_dtype(req.dtype)}, but the message carries {nbytes} bytes of {describe_dtype(dtype)}; "
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
        if self._buffered and isinstance(req, Send) and req in self._buffered:
            self._buffered.discard(req)
            self._buffered_bytes -= req.copied
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
                return
            # else its payload is being read right now: the rest of it goes to the scratch buffer,
            # never into the tensor, whose receive fails now (the frame is read to its end: the
            # stream stays in step). The driver reads ``conn.dest`` afresh for every chunk.
            for reading in self._conns.values():
                if reading.target is req:
                    reading.dest, reading.target = None, None
        elif isinstance(req, Send):
            peer = self._peers[req.peer] if 0 <= req.peer < self.size else None
            if peer is not None and req in peer.backlog:
                peer.backlog.remove(req)
                return
            conn = req.conn
            if conn is not None and req in conn.outq:
                if req.sent == 0:  # nothing on the wire yet
                    conn.outq.remove(req)
                else:  # partly on the wire: the frame must be finished, from a private copy
                    req.detach()

    def _expire(self, req: Request, why: str | None = None) -> None:
        """``req`` passed its deadline: fail it with CollectiveTimeout (``why``: what it waited for)."""
        with self._lock:
            if req.done:
                return
            self._withdraw(req)
            if isinstance(req, Recv) and req.peer == ANY:  # nothing came on its tag, from any other rank
                peers: tuple[int, ...] = tuple(p.rank for p in self._peers if p is not None)
                what = f"{req.name} from any rank (tag {req.tag})"
            elif req.seq is None:
                peers = (req.peer,)
                what = f"{req.name} {'to' if isinstance(req, Send) else 'from'} rank {req.peer}"
            else:
                peers = tuple(p for p in range(self.size) if p != self.rank and self._heard[p] < req.seq)
                peers = peers or (req.peer,)
                what = f"{req.name} (collective #{req.seq})"
            error = CollectiveTimeout(
                f"{self.label}: Timed out after {req.timeout:g} s in {what}; not heard from rank(s) "
                f"{', '.join(map(str, peers))}" + (f" ({why})" if why else ""),
                op=req.name,
                seq=req.seq,
                peers=peers,
            )
            self._complete(req, error)
            if req.seq is not None:
                self._break_collectives(CollectiveTimeout, str(error), peers, req.seq, notify=False)
        self._settle()

    def _fail(self, req: Request, error: PGError) -> None:
        """Fail ``req`` with ``error`` (a collective's failure stops the collectives)."""
        with self._lock:
            if req.done:
                return
            self._withdraw(req)
            self._complete(req, error)
            if req.seq is not None:
                self._break_collectives(type(error), str(error), (req.peer,), req.seq, notify=True)
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
        doomed.extend(peer.backlog)
        peer.backlog.clear()
        for conn in peer.conns:
            doomed.extend(conn.outq)
            conn.outq.clear()
            if isinstance(conn.target, Recv):
                doomed.append(conn.target)
        for key in [key for key in self._posted if key[0] == peer.rank]:
            del self._posted[key]
        for req in doomed:
            self._complete(req, self._peer_error(req, peer))
        if self._nobody_left():  # receives from any source can get nothing more
            for key in [key for key in self._posted if key[0] == ANY]:
                for req in self._posted.pop(key):
                    self._complete(req, self._nobody_left_error(req))
        # A collective of ours that needed it fails, stops the collectives and tells the others.
        # One that needs nothing more from it goes on, crash or not: what the peer sent before it
        # went is here (a peer that finished a barrier and exited owes nothing). A message of this
        # collective posted to it later fails as it is posted (_lost), and if it crashed, the next
        # collective fails at its start (begin_collective): it cannot finish one any more.
        for req in doomed:
            if req.seq is not None:
                self._break_collectives(PeerFailureError, reason, (peer.rank,), req.seq, notify=True)
                break

    def _lost(self, req: Request, peer: _Peer) -> None:
        """``req`` needs ``peer``, which is gone: fail it; a collective's message stops the
        collectives and tells the other ranks, as when the peer went while it was pending.
        Under the lock."""
        self._complete(req, self._peer_error(req, peer))
        if req.seq is not None and peer.closed is not None:
            self._break_collectives(PeerFailureError, peer.closed, (peer.rank,), req.seq, notify=True)

    def _break_collectives(
        self, cls: type[PGError], reason: str, peers: tuple[int, ...], seq: int | None, *, notify: bool
    ) -> None:
        """Stop this group's collectives from collective #``seq`` on (``None``: all of them):
        fail the pending ones, refuse later ones, and (``notify``) send ABORT so the other ranks
        stop too. A collective before #``seq`` goes on: the rank that failed #``seq`` finished it,
        so what it owes that one is sent (a rank that is still in it is not held up by one that
        has gone past it). Under the lock."""
        start = 0 if seq is None else seq
        if self._broken is not None and start >= self._stopped_from:
            return
        self._broken = (cls, reason, peers)
        self._stopped_from = start
        for req in list(self._pending_coll):
            if req.seq is not None and req.seq >= start:
                self._withdraw(req)
                self._complete(req, self._broken_error(req.name, req.seq))
        for key in [k for k in self._posted if k[1] == COLL]:
            kept = deque(r for r in self._posted[key] if r.seq is not None and r.seq < start)
            if kept:
                self._posted[key] = kept
            else:
                del self._posted[key]
        for key in [k for k in self._unexpected if k[1] == COLL]:
            queue = self._unexpected[key]
            self._unbuffer(key[0], sum(frame[5] for frame, _, _ in queue if frame[4] >= start))
            held = deque(item for item in queue if item[0][4] < start)
            if held:
                self._unexpected[key] = held
            else:
                del self._unexpected[key]
        if self._parked:  # a parked collective frame is to be read past now
            self._unpark()
        if notify:
            for peer in self._live_peers():
                self._send_abort(peer, seq)

    def _send_abort(self, peer: _Peer, seq: int | None) -> None:
        """Tell ``peer`` why this rank's collectives stopped (an ABORT for collective #``seq``).
        Under the lock, once they stopped."""
        assert self._broken is not None
        cls, reason, _ = self._broken
        payload = memoryview(f"collective #{seq}: {reason}".encode())
        abort = Send("abort", ABORT, peer.rank, payload, opcode=reason_code(cls), wire_seq=seq or 0, timeout=30.0)
        self._send_locked(peer, abort)

    def _stopped(self, seq: int) -> bool:
        """Whether collective #``seq`` cannot run: the collectives stopped at or before it. Under the lock."""
        return self._broken is not None and seq >= self._stopped_from

    def _broken_error(self, op: str, seq: int | None) -> PGError:
        assert self._broken is not None
        cls, reason, peers = self._broken
        message = f"{self.label}: {op} (collective #{seq}) cannot run: this group's collectives stopped: {reason}"
        if cls is CollectiveTimeout:
            return CollectiveTimeout(message, op=op, seq=seq, peers=peers)
        if issubclass(cls, PeerFailureError):  # StoreUnavailableError among them
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
            if self._stopped(seq):
                raise self._broken_error(op, seq)
            for peer in self._peers:
                # A peer that crashed before it reached this collective can never take part: it
                # fails now, and the collectives stop here, telling the other ranks (one of them
                # may wait for this rank and know nothing of the crash). One that reached it (its
                # frames of it came) may have done its part before it went: the collective runs,
                # and a receive that still needs the peer fails when it is posted. One that shut
                # down cleanly finished all of its collectives, this one included: it needed nothing
                # more from this rank, and what it sent is already here.
                if peer is not None and peer.closed is not None and peer.crashed and self._heard[peer.rank] < seq:
                    error = PeerFailureError(
                        f"{self.label}: {op} (collective #{seq}) needs every rank, but {peer.closed}",
                        peers=(peer.rank,),
                    )
                    self._break_collectives(PeerFailureError, peer.closed, (peer.rank,), seq, notify=True)
                    raise error

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
                f"{describe_op(opcode)} ({describe_arg(arg)}) while rank {self.rank} is in "
                f"{describe_op(our_opcode)} ({describe_arg(our_arg)})",
                (peer,),
                seq,
                notify=True,
            )

    def _live_peers(self) -> list[_Peer]:
        """The peers this rank can send to now: not gone, and connected."""
        return [p for p in self._peers if p is not None and p.closed is None and p.send is not None]

    # == the progress thread ==================================================================

    def _progress_loop(self) -> None:
        """Drive progress while asynchronous requests are outstanding; sleep otherwise.

        The thread runs at the idle scheduling class where the platform has one (Linux's
        ``SCHED_IDLE``): it only has to move data while the thread that posted it computes,
        so it takes a core nobody else wants. Being woken for every asynchronous request
        then never preempts the thread that posted it, which usually waits for it at once and
        drives it itself: at normal priority that wake-up cost a launched 4-byte all_reduce
        between two ranks pinned to one core each 30-60 us, at idle priority 5-20 us
        (docs/benchmarks.md)."""
        with contextlib.suppress(AttributeError, OSError):  # (not Linux, or refused: normal priority)
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        while True:
            with self._lock:
                if self._stopping:
                    return
                if not self._await_async():
                    continue
                now = time.monotonic()
                expired = [r for r in self._async if r.deadline <= now]
                horizon = min(r.deadline for r in self._async)
                waiting = list(self._async)
            for req in expired:
                self._expire(req)
            for req in waiting:  # never waits for the store here: other requests need this thread
                if not req.done:
                    horizon = self._tick(req, now, horizon, block=False)
            self._drive(None, min(max(horizon - time.monotonic(), 0.0), 0.5), background=True)

    def _await_async(self) -> bool:
        """The progress thread's sleep, under the lock: ``True`` when it has to act (an
        asynchronous request nobody else drives, or one past its deadline), ``False`` to look
        again.

        The thread is not woken for each asynchronous request: the poster usually waits for
        it at once and drives it itself, and a wake-up would make this thread take the GIL
        just then; at the idle scheduling class on a busy core it may keep it while preempted,
        and the waiter, whose reply has landed, waits for it (measured: /work/notes/tcp-async.md).
        Instead, until :data:`PROGRESS_LINGER_S` after the last asynchronous request, it looks every
        :data:`PROGRESS_TICK_S` unwoken, and a request left to it (its poster went on without waiting)
        starts moving within that; after a quiet :data:`PROGRESS_LINGER_S` it sleeps until the next
        request wakes it."""
        now = time.monotonic()
        horizon = min((r.deadline for r in self._async), default=None)
        if self._async and (not self._foreground or (horizon is not None and horizon <= now)):
            return True
        if now < self._linger_until:
            self._lingering = True
            wait = PROGRESS_TICK_S if horizon is None else min(PROGRESS_TICK_S, horizon - now)
            self._idle.wait(max(wait, 0.0))
            self._lingering = False
        elif horizon is None:
            self._idle.wait()
        else:  # a waiter drives; it wakes this thread when it leaves (or the earliest deadline does)
            self._idle.wait(min(max(horizon - now, 0.0), 0.5))
        return False

    def _drain_loop(self) -> None:
        """Write what blocking sends left buffered (:meth:`wait_send`) while nobody else drives;
        sleep while nothing is buffered.

        Unlike the progress thread, this one runs at normal priority: it finishes sends that
        already returned, whose receivers may be reading now while this process computes,
        and at the idle class it would get no CPU then on a busy host. It drives before the
        progress thread (which stands by, or yields the driver role, while it is here)."""
        while True:
            with self._lock:
                while not self._buffered and not self._stopping:
                    self._drain_idle.wait()
                if self._stopping:
                    return
            self._drive(None, 0.5, drain=True)

    # == life ===========================================================================

    def shutdown(self, timeout: float) -> None:
        """Answer connections never read, drain queued sends (bounded by ``timeout``), say
        BYE, close everything."""
        with self._lock:
            if self._closed is not None:
                return
            self._closed = "shut down"
            doomed: list[Request] = [r for q in self._posted.values() for r in q]
            for peer in self._peers:
                if peer is not None:
                    doomed.extend(peer.backlog)
                    peer.backlog.clear()
            for req in doomed:
                self._complete(req, GroupClosedError(f"{self.label}: {req.name} was pending at shutdown"))
            self._posted.clear()
        self._settle()
        # Connections made to this rank that it never read: read their hellos, so that their
        # makers hear "shut down" (see _identify) instead of taking the exit for a crash.
        deadline = time.monotonic() + min(timeout, _SHUTDOWN_HELLOS_S)
        self._progress_now()
        while self._anonymous and time.monotonic() < deadline:
            self._drive(None, min(0.05, max(deadline - time.monotonic(), 0.0)))
        with self._lock:
            code, reason = 0, _EMPTY
            if self._broken is not None and self._broken[0] in REASON_CODE:
                # peers still waiting learn why, not just "shut down" (a timeout each rank sees for itself)
                code = REASON_CODE[self._broken[0]]
                reason = memoryview(self._broken[1].encode())
            for peer in self._live_peers():
                assert peer.send is not None
                bye = Send("bye", BYE, peer.rank, reason, opcode=code, wire_seq=self._stopped_from, timeout=timeout)
                self._write(peer.send, bye)
                for conn in peer.conns:  # a connection both made at once whose RETIRE is still to come
                    if conn is not peer.send and not conn.quiet and not conn.dead and conn.state == OPEN:
                        self._write(conn, Send("retire", RETIRE, peer.rank, _EMPTY, timeout=timeout))
                        conn.quiet = True
            for conn in list(self._anonymous):  # still silent: whoever it is, nothing comes from here
                self._write(conn, Send.raw("closing", -1, self._hello(REPLY_CLOSING)))
                conn.ended = conn.quiet = True
        self._settle()
        # Deliver before closing: what is queued here, then what the kernel holds. A socket
        # closed with unread bytes in it (a hello's answer that came late, an ARRIVED frame)
        # is reset, not closed, and a reset throws away whatever the kernel had not yet
        # delivered (a large frame, the BYE): its peer would see a crash. So wait (reading,
        # bounded by the timeout) until the peers have everything, then read what came.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                live = [c for c in self._conns.values() if not c.dead and c.send_error is None]
                queued = any(c.outq for c in live)
                # a peer that is gone (reset, BYE) acknowledges nothing more: its count never falls
                socks = [c.sock for c in live if c.peer is None or c.peer.closed is None]
            if not queued and not any(_unacknowledged(sock) for sock in socks):
                break
            self._drive(None, min(0.1 if queued else _FLUSH_POLL_S, max(deadline - time.monotonic(), 0.0)))
        self._progress_now()
        self._close("shut down")

    def abort(self) -> None:
        """Fail everything pending with GroupClosedError, wake every waiter, close. Any thread."""
        with self._lock:
            if self._closed == "aborted":
                return
            if self._closed is None:  # (a rank shutting down said BYE, or is saying it)
                self._say_aborted()
            self._closed = "aborted"
            doomed = [r for q in self._posted.values() for r in q] + list(self._async) + list(self._pending_coll)
            for peer in self._peers:
                if peer is not None:
                    doomed.extend(peer.backlog)
            for conn in self._conns.values():
                doomed.extend(conn.outq)
                if isinstance(conn.target, Recv):
                    doomed.append(conn.target)
            for req in doomed:
                self._complete(req, GroupClosedError(f"{self.label}: {req.name} was aborted"))
            self._wake_driver()
            self._cond.notify_all()
        self._settle()
        self._close("aborted")

    def _say_aborted(self) -> None:
        """Tell every peer this rank aborted: an ABORTED frame on each connection a peer reads
        from it, written only as far as the kernel takes it now (abort never waits for a peer).
        A connection whose handshake has not ended, or whose frame half on the wire the kernel
        will not take the rest of now, gets none: that peer sees the connection close. Under
        the lock."""
        # the first collective this rank will not finish: the one it is in, or the next
        unfinished = self._current[0] + (0 if self._pending_coll else 1)
        goodbye = HEADER.pack(MAGIC, ABORTED, 0, 0, 0, unfinished, 0)
        for peer in self._live_peers():
            conn = peer.send
            assert conn is not None
            if conn.gated or conn.dead or conn.send_error is not None:
                continue
            head = conn.outq[0] if conn.outq else None
            with contextlib.suppress(OSError):  # BlockingIOError among them: then it goes without
                if head is not None and (head.kind == 0 or head.sent > 0):  # a hello, or a frame begun
                    while head.sent < head.total:
                        sent = conn.sock.sendmsg(head.pending())
                        if sent == 0:
                            break
                        head.sent += sent
                    if head.sent < head.total:
                        continue
                    conn.outq.popleft()
                    self._complete(head, None)
                    head = conn.outq[0] if conn.outq else None
                    if head is not None and head.kind == 0:  # a raw hello behind it: too many to finish now
                        continue
                conn.sock.send(goodbye)

    def _close(self, how: str) -> None:
        with self._lock:
            self._stopping = True
            self._cond.notify_all()
            self._idle.notify_all()
            self._drain_idle.notify_all()
            self._wake_driver()  # a background thread driving leaves its poll now, not at its timeout
            threads = [t for t in (self._thread, self._drainer) if t is not None]
            self._thread = self._drainer = None
        for thread in threads:
            if thread is not threading.current_thread():
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
                    leftovers.extend(peer.backlog)
                    peer.backlog.clear()
                    if peer.closed is None:
                        peer.closed = f"this rank's transport was {how}"
            for conn in self._conns.values():
                leftovers.extend(conn.outq)
                conn.outq.clear()
                conn.sock.close()
            self._conns.clear()
            self._anonymous.clear()
            self._posted.clear()
            for req in leftovers:
                self._complete(
                    req, GroupClosedError(f"{self.label}: {req.name} did not finish before the group was {how}")
                )
            if self._listener is not None:
                self._listener.close()
            self._wake_r.close()
            self._wake_w.close()
        self._settle()

    @property
    def closed(self) -> bool:
        return self._closed is not None


def _unacknowledged(sock: socket.socket) -> int:
    """Bytes written to ``sock`` that its peer's kernel has not acknowledged yet (0 where the
    platform cannot say, or the connection is over: after a reset, Linux goes on counting
    what was in flight, though nothing will ever acknowledge it)."""
    if _TIOCOUTQ is None:
        return 0
    if _TCP_INFO is not None:
        try:
            if sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 1)[0] == _TCP_CLOSE:
                return 0
        except (OSError, ValueError):
            return 0
    buf = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), _TIOCOUTQ, buf, True)
    except (OSError, ValueError):
        return 0
    return buf[0]


def _settle_work(req: Request) -> None:
    work = req.work
    assert work is not None
    if req.error is not None:
        work.set_exception(req.error)
    elif isinstance(req, Recv) and req.any:
        work.set_result(req.peer)  # an any-source receive's value: its sender
    else:
        work.set_result(getattr(req, "result", None))
