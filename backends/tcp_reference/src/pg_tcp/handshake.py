"""pg-tcp's connection handshake: how a rank reaches a peer, and what the two ends say
before the first frame (:mod:`pg_tcp.wire`) crosses.

This module holds the protocol's formats, its cryptography and its verdicts, as functions
that touch no transport state: reading a peer's address from the store and connecting to
it (:func:`read_address`, :func:`connect`), taking what waits in the listener
(:func:`accept`), the hello (:func:`hello`, :data:`HELLO`), and the checks of an
authenticated job (:func:`challenge`, :func:`answer_challenge`, :func:`proven`), which
return what to send or raise :class:`Refused` saying why a connection is refused.
:mod:`pg_tcp.transport` runs them from its progress engine and applies their outcome to its
peers and connections under its lock (which connection a pair uses, what fails when a peer
is lost): that state is the engine's, never this module's.

The hello
=========

A connection opens with a hello from the rank that made it (the *maker*)::

    magic 8s | protocol version u16 | rank u32 | flags u8 | pad 1 | uid length u16 | group uid

(:data:`HELLO`, then ``ctx.group_uid``; :data:`HELLO_MAGIC`, :data:`pg_tcp.wire.PROTOCOL_VERSION`,
flags 0). The *acceptor* answers in the same format, with its own rank and one of the
``REPLY_*`` codes as flags. So a stray connection (another group, a port scanner) is dropped
instead of being taken for a peer, and the maker knows it reached the right process. Without a
job secret the maker does not wait for the answer: its frames follow its hello at once.

**One connection per pair.** If both ranks of a pair connect at the same moment, the lower
rank's connection wins: the higher rank answers it with :data:`REPLY_SWITCH`, ends its own
connection with a RETIRE frame behind whatever it already sent on it, and sends on the lower
rank's from then on; the lower rank reads nothing that follows the SWITCH before it has read
the RETIRE, so messages keep their order. The lower rank answers the higher rank's with
:data:`REPLY_CROSSED` (its own hello comes, then the peer's RETIRE). :data:`REPLY_OK` means
the acceptor had no connection of its own and will make none. A rank shutting down answers
:data:`REPLY_CLOSING` (my BYE comes on my own connection) or :data:`REPLY_GONE` (I never sent
you anything: take this for my BYE), and reads nothing.

**Second claims.** A rank makes at most one connection to a peer, and none at all once it has
answered the peer's with OK. So an accepted hello for a rank that already made its connection,
or whose answer said it makes none, is someone else's: refused, logged with the claimed rank
and the remote address, never read.

Authenticated jobs (protocol 4)
===============================

With a job secret (``ctx.auth_key``: ``PG_CORE_AUTH_KEY``, ``ProcessGroup(..., auth_key=)``) a
connection proves both ends hold it before any frame crosses. The maker's hello carries the
:data:`AUTH` flag and a fresh :data:`NONCE`-byte nonce; the acceptor answers with its own
nonce and a MAC (:func:`mac`: HMAC-SHA256 under the secret) over the protocol version, the
group uid, both ranks, both nonces and the word "acceptor" (:func:`challenge`); the maker
checks it, then sends its own MAC over the same fields with "maker" (:func:`answer_challenge`),
and only then lets its queued frames go (until then the connection is *gated*). The acceptor
reads nothing from the connection but those :data:`MAC` bytes until they verified
(:func:`proven`). Binding both nonces and both ranks makes every MAC good for one connection
only: a hello replayed from a capture is refused at once (the acceptor remembers the last
:data:`SEEN_NONCES` nonces it answered, :class:`NonceLedger`), and one replayed with a fresh
nonce cannot produce the maker's MAC for the acceptor's new nonce. A hello without the flag to
an authenticated rank, one with it to a rank without a key, a wrong MAC and a replay are
refused: the connection is closed unread and a warning on the ``pg_tcp`` logger names the
claimed rank and the remote address. A maker whose acceptor fails to prove itself loses that
peer. The secret never travels; TCP is not encrypted.

Reaching a peer
===============

Every rank publishes ``host:port`` under ``addr/<rank>`` in the group's store. A maker reads
it (:func:`read_address`: within the operation's deadline, in slices so that an abort is
noticed; or, for a probe, only if it is already there) and connects (:func:`connect`). Sockets
are non-blocking, with ``TCP_NODELAY`` (small frames leave at once) and short TCP keepalives (a
vanished host is noticed in seconds even when nothing is being sent): :func:`tune`.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Final

from pg_core.auth import AuthKey
from pg_core.errors import AuthenticationError, CollectiveTimeout
from pg_core.store import Store, wait_for

from .wire import PROTOCOL_VERSION

__all__ = [
    "AUTH",
    "CHALLENGE_IN",
    "HELLO",
    "HELLO_IN",
    "HELLO_MAGIC",
    "HELLO_TIMEOUT",
    "MAC",
    "MAX_UID",
    "NONCE",
    "OPEN",
    "PROOF_IN",
    "REPLY_CLOSING",
    "REPLY_CROSSED",
    "REPLY_GONE",
    "REPLY_IN",
    "REPLY_OK",
    "REPLY_SWITCH",
    "SEEN_NONCES",
    "Closing",
    "NonceLedger",
    "NotPublished",
    "Refused",
    "accept",
    "answer_challenge",
    "challenge",
    "connect",
    "hello",
    "hello_extra",
    "mac",
    "proven",
    "read_address",
    "tune",
]

HELLO_MAGIC: Final = b"pg-tcp\x00\x01"
#: The hello, and the acceptor's answer in the same format: magic, protocol version, rank,
#: flags (the answer's; 0 in a hello), length of the group_uid that follows.
HELLO: Final = struct.Struct("<8sHIBxH")
MAX_UID: Final = 4096
REPLY_OK: Final = 0  # "use this connection"
REPLY_SWITCH: Final = 1  # "use this connection; mine to you retires (RETIRE on it): read what follows here after that"
REPLY_CLOSING: Final = 2  # "I am shutting down; nothing comes here: my BYE comes on my own connection to you"
REPLY_GONE: Final = 3  # "I am shutting down, and I never sent you anything": a BYE
REPLY_CROSSED: Final = 4  # "use this connection; mine to you crossed it (its hello comes, then its RETIRE)"
#: Flag of an authenticated job's hello and challenge: a nonce (and the challenge's MAC) follow the uid.
AUTH: Final = 0x80
NONCE: Final = 32
MAC: Final = 32
SEEN_NONCES: Final = 4096  # hello nonces remembered, to refuse a replayed hello at once

# Where a connection is in its handshake (the transport keeps it on the connection)
OPEN: Final = 0  # frames flow
HELLO_IN: Final = 1  # accepted: waiting for the maker's hello
REPLY_IN: Final = 2  # made here: waiting for the acceptor's answer (frames already go out)
CHALLENGE_IN: Final = 3  # made here, authenticated job: waiting for the acceptor's nonce and MAC (frames held)
PROOF_IN: Final = 4  # accepted, authenticated job: challenge sent, waiting for the maker's MAC (nothing else read)

HELLO_TIMEOUT: Final = 10.0  # a maker says hello right after connecting; a silent stray is dropped after this
_STORE_SLICE_S: Final = 0.25  # store waits in slices, so that abort() is noticed


class Refused(Exception):
    """A connection fails the handshake; ``str()`` says why, for the log line."""


class NotPublished(Exception):
    """The peer has not published its address yet (a probe that does not wait)."""


class Closing(Exception):
    """The transport closed while a connection was being made."""


# -- reaching a peer ----------------------------------------------------------------------


def tune(sock: socket.socket) -> None:
    """Make ``sock`` non-blocking, with ``TCP_NODELAY`` and short keepalives."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


def read_address(
    store: Store, rank: int, deadline: float, *, block: bool, closing: Callable[[], bool], label: str
) -> tuple[str, int]:
    """The ``(host, port)`` rank ``rank`` published in ``store``. ``block``: wait for it until
    ``deadline`` (:class:`~pg_core.errors.CollectiveTimeout` then; :class:`Closing` as soon as
    ``closing()`` says so); else raise :class:`NotPublished` if it is not there yet. A value
    that is no address is an :class:`~pg_core.errors.AuthenticationError`: someone else wrote
    to the group's keys."""
    key = f"addr/{rank}"
    if not block:
        if not store.check([key]):
            raise NotPublished
    else:
        while True:  # in slices, so that abort() is noticed
            left = deadline - time.monotonic()
            if left <= 0:
                raise CollectiveTimeout(
                    f"Timed out waiting for rank {rank} to publish its address (has it created its pg-tcp backend?)"
                )
            if closing():
                raise Closing
            try:
                wait_for(store, [key], min(left, _STORE_SLICE_S), what=f"{label}: address")
                break
            except CollectiveTimeout:
                continue
    said = bytes(store.get(key))
    try:
        host, _, port = said.decode().rpartition(":")
        return host, int(port)
    except ValueError:  # UnicodeDecodeError included
        raise AuthenticationError(
            f"{label}: store key {key!r} holds {said[:40]!r}, not the address rank {rank} publishes: "
            "someone else wrote to this group's keys (run the job with PG_CORE_AUTH_KEY to refuse them)",
            key=key,
        ) from None


def connect(address: tuple[str, int], rank: int, deadline: float, *, closing: Callable[[], bool]) -> socket.socket:
    """A connected, tuned socket to rank ``rank``'s listener at ``address``, within
    ``deadline`` (:class:`~pg_core.errors.CollectiveTimeout`; ``socket.timeout``, an
    ``OSError`` such as a refused connection). :class:`Closing` if ``closing()``."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise CollectiveTimeout(f"Timed out before rank {rank} could be reached")
    if closing():
        raise Closing
    sock = socket.create_connection(address, timeout=min(left, HELLO_TIMEOUT))
    try:
        tune(sock)
    except OSError:
        sock.close()
        raise
    return sock


def accept(listener: socket.socket) -> Iterator[tuple[socket.socket, str]]:
    """Every connection waiting in ``listener`` (non-blocking), tuned, with its remote
    ``host:port``; those that cannot be tuned are closed and skipped."""
    while True:
        try:
            sock, remote = listener.accept()
        except OSError:  # BlockingIOError (nothing more waits) among them
            return
        try:
            tune(sock)
        except OSError:
            sock.close()
            continue
        yield sock, f"{remote[0]}:{remote[1]}"


# -- the hello ----------------------------------------------------------------------------


def hello(rank: int, uid: bytes, flags: int) -> bytes:
    """A hello (flags 0 or :data:`AUTH`) or an answer (a ``REPLY_*`` code, or :data:`AUTH`)
    from ``rank`` of the group ``uid``."""
    return HELLO.pack(HELLO_MAGIC, PROTOCOL_VERSION, rank, flags, len(uid)) + uid


def hello_extra(state: int, flags: int) -> int:
    """How many bytes follow the uid of a hello read in ``state`` with ``flags``: an
    authenticated hello's nonce, and an authenticated answer's nonce and MAC."""
    if state in (CHALLENGE_IN, HELLO_IN) and flags & AUTH:
        return NONCE + (MAC if state == CHALLENGE_IN else 0)
    return 0


# -- authenticated jobs: challenge and response over both ends' nonces ------------------


def mac(key: AuthKey, uid: bytes, *, maker: int, acceptor: int, nonces: tuple[bytes, bytes], role: bytes) -> bytes:
    """The MAC one end of an authenticated connection proves itself with: over the
    protocol, the group, both ranks, both nonces (maker's, acceptor's) and its role
    (``b"maker"`` or ``b"acceptor"``)."""
    version = PROTOCOL_VERSION.to_bytes(2, "little")
    ranks = maker.to_bytes(4, "little") + acceptor.to_bytes(4, "little")
    return key.mac(b"pg-tcp", version, uid, ranks, nonces[0], nonces[1], role)


class NonceLedger:
    """The hello nonces an acceptor answered lately (the last :data:`SEEN_NONCES`), so that a
    replayed hello is refused at once. Not thread-safe: the transport's lock guards it."""

    __slots__ = ("_order", "_seen")

    def __init__(self) -> None:
        self._seen: set[bytes] = set()
        self._order: deque[bytes] = deque()

    def __contains__(self, nonce: object) -> bool:
        return nonce in self._seen

    def remember(self, nonce: bytes) -> None:
        self._seen.add(nonce)
        self._order.append(nonce)
        if len(self._order) > SEEN_NONCES:
            self._seen.discard(self._order.popleft())


def challenge(
    key: AuthKey | None,
    uid: bytes,
    *,
    size: int,
    me: int,
    rank: int,
    flags: int,
    rest: bytes,
    ledger: NonceLedger,
) -> tuple[tuple[bytes, bytes], bytes]:
    """An accepted connection said hello as ``rank`` (``rest``: its uid and what followed):
    the connection's nonces (maker's, acceptor's) and the challenge this end ``me`` answers
    with, or :class:`Refused` (no key here, none in the hello, another group, a replay)."""
    if key is None:
        raise Refused("its hello is authenticated but this job has no key (PG_CORE_AUTH_KEY)")
    if not flags & AUTH:
        raise Refused("its hello is not authenticated and this job is (another job, or a stranger)")
    their_uid, nonce = rest[: len(rest) - NONCE], rest[len(rest) - NONCE :]
    if their_uid != uid or not 0 <= rank < size or rank == me:
        raise Refused("another group's hello")
    if nonce in ledger:
        raise Refused("a replayed hello (its nonce was answered before)")
    ledger.remember(nonce)
    nonces = (nonce, secrets.token_bytes(NONCE))
    return nonces, hello(me, uid, AUTH) + nonces[1] + mac(
        key, uid, maker=rank, acceptor=me, nonces=nonces, role=b"acceptor"
    )


def proven(key: AuthKey, uid: bytes, *, maker: int, me: int, nonces: tuple[bytes, bytes], proof: bytes) -> bool:
    """Whether the maker's ``proof`` (read after this end's challenge) is its MAC."""
    return hmac.compare_digest(proof, mac(key, uid, maker=maker, acceptor=me, nonces=nonces, role=b"maker"))


def answer_challenge(
    key: AuthKey, uid: bytes, *, me: int, peer: int, rank: int, mine: bytes, rest: bytes
) -> tuple[bytes, bytes]:
    """The acceptor of the connection this end ``me`` made to ``peer`` with nonce ``mine``
    answered as ``rank`` with ``rest`` (uid, its nonce, its MAC): the acceptor's nonce and the
    proof to send back, or :class:`Refused` if the answer is not ``peer``'s of this group
    holding the key."""
    their_uid = rest[: len(rest) - NONCE - MAC]
    nonce, their_mac = rest[len(their_uid) : len(their_uid) + NONCE], rest[len(their_uid) + NONCE :]
    nonces = (mine, nonce)
    if (
        rank != peer
        or their_uid != uid
        or not hmac.compare_digest(their_mac, mac(key, uid, maker=me, acceptor=peer, nonces=nonces, role=b"acceptor"))
    ):
        raise Refused(f"the process at rank {peer}'s address failed to prove it holds the job's key")
    return nonce, mac(key, uid, maker=me, acceptor=peer, nonces=nonces, role=b"maker")
