"""``PeerWatch``: one idle TCP connection to every peer, to learn which rank is gone and how.

Gloo notices a peer that died (its connections close), but its error names a socket address,
not a group rank, and it cannot tell a rank that aborted or shut down from one that was killed.
So each pg-gloo backend keeps, beside Gloo's own connections, one connection per peer that
carries nothing but a last word: ``b"A"`` when its rank aborts, ``b"S"`` when it shuts down.
An end of stream without that word is a rank whose process died (the kernel closes a killed
process's sockets at once). One selector thread per backend reads them all; it costs nothing
while nothing happens.

Formation: every rank listens on an ephemeral port of the address Gloo uses, writes the port
and a random token under ``pg-gloo-watch/RANK`` in the group's store, connects to every lower
rank (saying its rank and proving it read the store, or with an auth key that it holds the
key), and accepts one connection from every higher rank. A connection that says anything else,
or nothing within the formation's time, is closed (a stray); once every peer is connected the
listening socket is closed, so nothing outside the group can reach the watch after formation.
"""

from __future__ import annotations

import hmac
import os
import select
import selectors
import socket
import struct
import threading
import time
from typing import Final

from pg_core.auth import AuthKey
from pg_core.errors import AuthenticationError, CollectiveTimeout, PeerFailureError
from pg_core.store import Store, wait_for

__all__ = ["ABORTED", "DIED", "SHUT_DOWN", "PeerWatch"]

#: how a peer left, as the errors say it
ABORTED: Final = "aborted"
SHUT_DOWN: Final = "shut down"
DIED: Final = "died (its connection closed without a word: killed, or its process ended)"

_WORDS: Final = {b"A": ABORTED, b"S": SHUT_DOWN}
#: a connector's hello: its rank, then 32 bytes of proof (the listener's token, or its MAC)
_HELLO: Final = struct.Struct("<q32s")


class PeerWatch:
    """Connections to every peer of one backend; ``gone`` maps a rank to how it left.

    ``gone`` is filled by the watch's thread as soon as a peer is seen gone (a dict read is
    all a wait needs to look at it between slices).
    ``close(word)`` tells every peer this rank's last word and releases the thread and sockets.
    """

    def __init__(
        self,
        store: Store,
        rank: int,
        size: int,
        host: str,
        timeout: float,
        *,
        name: str,
        uid: str,
        auth_key: AuthKey | None,
    ) -> None:
        self.gone: dict[int, str] = {}
        self._seen_at: dict[int, float] = {}
        self._rank, self._uid, self._key = rank, uid, auth_key
        self._peers: dict[socket.socket, int] = {}
        self._by_rank: dict[int, socket.socket] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        if size > 1:
            try:
                self._form(store, size, host, timeout)
            except BaseException:
                self._close_sockets()
                raise
            self._thread = threading.Thread(target=self._run, name=f"pg-gloo-{name}-watch", daemon=True)
            self._thread.start()

    def _proof(self, listener: int, connector: int, token: bytes) -> bytes:
        if self._key is None:
            return token
        return self._key.mac(b"pg-gloo-watch", self._uid.encode(), b"%d %d" % (listener, connector), token)

    def _form(self, store: Store, size: int, host: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        token = os.urandom(32)
        with socket.create_server((host, 0), family=_family(host), backlog=size + 8) as listener:
            store.set(f"pg-gloo-watch/{self._rank}", f"{host} {listener.getsockname()[1]} {token.hex()}")
            for peer in range(self._rank):
                key = f"pg-gloo-watch/{peer}"
                wait_for(store, [key], max(deadline - time.monotonic(), 0.001), what=f"watch of rank {peer}")
                said = bytes(store.get(key))
                try:
                    their_host, port, theirs = said.decode().split()
                    address, secret = (their_host, int(port)), bytes.fromhex(theirs)
                except ValueError:  # UnicodeDecodeError included
                    raise AuthenticationError(
                        f"pg-gloo watch: store key {key!r} holds {said[:40]!r}, not the address rank {peer} published: "
                        "someone else wrote to this group's keys (run the job with PG_CORE_AUTH_KEY to refuse them)",
                        key=key,
                    ) from None
                try:
                    conn = socket.create_connection(address, timeout=max(deadline - time.monotonic(), 0.001))
                except OSError as exc:
                    raise PeerFailureError(
                        f"pg-gloo watch: rank {peer} published {their_host}:{port} but does not accept connections "
                        f"there ({exc}): it left or died while the group formed",
                        peers=[peer],
                    ) from None
                self._peers[conn] = peer
                conn.sendall(_HELLO.pack(self._rank, self._proof(peer, self._rank, secret)))
            waiting = set(range(self._rank + 1, size))
            while waiting:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CollectiveTimeout(
                        f"pg-gloo watch: ranks {sorted(waiting)} did not connect within {timeout:g} s", peers=waiting
                    )
                listener.settimeout(left)
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                admitted = self._admit(conn, token, waiting, min(left, 5.0))
                if admitted is None:
                    conn.close()  # a stray: not a peer of this formation
                    continue
                waiting.discard(admitted)
                self._peers[conn] = admitted
        for conn in self._peers:
            conn.settimeout(None)
        self._by_rank = {peer: conn for conn, peer in self._peers.items()}

    def _admit(self, conn: socket.socket, token: bytes, waiting: set[int], within: float) -> int | None:
        """The rank a new connection proves it is, or None."""
        conn.settimeout(within)
        data = b""
        try:
            while len(data) < _HELLO.size:
                chunk = conn.recv(_HELLO.size - len(data))
                if not chunk:
                    return None
                data += chunk
        except OSError:
            return None
        peer, proof = _HELLO.unpack(data)
        expected = self._proof(self._rank, peer, token)
        if peer not in waiting or not _same(proof, expected):
            return None
        return int(peer)

    def _run(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._wake_r, selectors.EVENT_READ)
            for peer_conn in list(self._peers):
                sel.register(peer_conn, selectors.EVENT_READ)
            while True:
                for key, _ in sel.select():
                    if key.fileobj is self._wake_r:
                        return
                    conn = key.fileobj
                    assert isinstance(conn, socket.socket)
                    try:
                        word = conn.recv(1)
                    except OSError:
                        word = b""
                    sel.unregister(conn)
                    with self._lock:
                        peer = self._peers.get(conn)
                    if peer is not None:
                        self._seen(peer, _WORDS.get(word, DIED))

    def _seen(self, peer: int, how: str) -> None:
        if peer not in self.gone:
            self._seen_at.setdefault(peer, time.monotonic())
            self.gone.setdefault(peer, how)

    def first_seen(self, peers: list[int]) -> float:
        """When the first of ``peers`` (all in ``gone``) was seen gone (``time.monotonic()``)."""
        return min(self._seen_at.get(p, 0.0) for p in peers)

    def check(self, peer: int) -> None:
        """Look now (one ``poll``) whether ``peer`` has left, rather than when the watch's thread
        gets to it: a send to a rank that died a moment ago must fail, not be lost."""
        if peer in self.gone:
            return
        with self._lock:
            conn = self._by_rank.get(peer)
        if conn is None:
            return
        try:
            readable = _poll_in(conn)
            word = conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) if readable else None
        except BlockingIOError:
            return
        except OSError:
            word = b""
        if word is not None:
            self._seen(peer, _WORDS.get(word, DIED))

    def wait_gone(self, within: float) -> dict[int, str]:
        """``gone``, waiting up to ``within`` seconds for a first peer to be seen gone (Gloo may
        notice a closed connection a moment before this thread does)."""
        deadline = time.monotonic() + within
        while not self.gone and self._thread is not None and time.monotonic() < deadline:
            time.sleep(0.005)
        return dict(self.gone)

    def close(self, word: bytes) -> None:
        """Tell every peer still connected this rank's last word (``b"A"`` or ``b"S"``), then
        release the thread and the sockets. Idempotent."""
        with self._lock:
            peers, self._peers, self._by_rank = self._peers, {}, {}
        for conn in peers:
            try:
                conn.sendall(word)
            except OSError:
                pass
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)
        for conn in peers:
            conn.close()
        self._close_sockets()

    def _close_sockets(self) -> None:
        for conn in self._peers:
            conn.close()
        self._wake_r.close()
        self._wake_w.close()


def _poll_in(conn: socket.socket) -> bool:
    poller = select.poll()
    poller.register(conn, select.POLLIN)
    return bool(poller.poll(0))


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _same(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)
