"""``StoreBackend``: point-to-point messages as keys in the group's store.

``send`` writes the tensor's bytes under ``msg/{src}->{dst}/{tag}/{n}``, where ``n``
counts the messages this rank sent to ``dst`` with ``tag``; ``recv`` waits for the key
with the next ``n`` it expects from ``(src, tag)``, reads it into the tensor and deletes
it. A store value is bounded (torch's TCPStore drops a client that sends one over 8 MiB), so
a message travels in pieces of at most :data:`PIECE_BYTES`: the pieces after the first under
``.../{n}/{i}``, then the key itself, holding the number of pieces and the first one (written
last: a receiver that sees it finds every piece there). A store write never waits for the receiver, so ``send`` satisfies the contract's
"must not wait for the receiver" and the default ``isend``/``irecv`` (a helper thread)
are enough. Every collective is ``pg_core.algorithms``' default, built on these two.

After a collective times out, pg-core itself refuses the group's later collectives, so a
late message is never paired with another operation; this backend needs no guard of its own.

Limitations, by design of an example: each message is a round trip to the store (slow),
and a dead peer is seen only as a :class:`~pg_core.errors.CollectiveTimeout`, not a
prompt :class:`~pg_core.errors.PeerFailureError`.
"""

from __future__ import annotations

import struct
import threading
import time

import torch
from pg_core.backend import Backend, BackendContext
from pg_core.errors import CollectiveMismatchError, CollectiveTimeout, GroupClosedError

__all__ = ["StoreBackend"]

_POLL_MIN_S = 0.0005
_POLL_MAX_S = 0.01
#: the most bytes one store value carries (torch's TCPStore refuses values over 8 MiB)
PIECE_BYTES = 4 * 1024 * 1024
_COUNT = struct.Struct("<q")


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor's memory (any dtype, 0-dim included)."""
    return tensor.reshape(-1).view(torch.uint8)


class StoreBackend(Backend):
    """A pg-core backend whose only transport is ``ctx.store`` (cpu tensors, every dtype)."""

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self._store = ctx.store
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._sent: dict[tuple[int, int], int] = {}  # (dst, tag) -> messages sent
        self._received: dict[tuple[int, int], int] = {}  # (src, tag) -> messages consumed
        # One receive at a time per (src, tag): messages are consumed in order, and a recv
        # that times out leaves its message for the next one instead of skipping it.
        self._recv_locks: dict[tuple[int, int], threading.Lock] = {}

    @staticmethod
    def _key(src: int, dst: int, tag: int, n: int) -> str:
        return f"msg/{src}->{dst}/{tag}/{n}"

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise GroupClosedError(f"storecomm backend of group {self.ctx.group_name!r} is closed")

    # -- the two required methods ------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> None:
        self._check_open()
        data = _byte_view(tensor).numpy().tobytes()  # a copy: the tensor may be reused at once
        with self._lock:
            n = self._sent.get((dst, tag), 0)
            self._sent[(dst, tag)] = n + 1
        key = self._key(self.rank, dst, tag, n)
        pieces = [data[i : i + PIECE_BYTES] for i in range(0, len(data), PIECE_BYTES)] or [b""]
        # torch's stub says str, but the c10d store takes bytes (values are byte strings)
        for i, piece in enumerate(pieces[1:], start=1):
            self._check_open()  # abort() stops a large send between pieces (its head never goes: no message)
            self._store.set(f"{key}/{i}", piece)  # type: ignore[arg-type]
        self._check_open()
        self._store.set(key, _COUNT.pack(len(pieces)) + pieces[0])  # type: ignore[arg-type]

    def recv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> None:
        self._check_open()
        deadline = time.monotonic() + timeout
        with self._lock:
            lock = self._recv_locks.setdefault((src, tag), threading.Lock())
        if not lock.acquire(timeout=max(timeout, 0.0)):
            raise self._timeout(src, tag, timeout, "an earlier recv of the same (peer, tag) is still waiting")
        try:
            n = self._received.get((src, tag), 0)
            key = self._key(src, self.rank, tag, n)
            delay = _POLL_MIN_S
            # Poll with check() rather than store.wait(): polling notices abort() and the
            # deadline without leaving a half-finished wait on the store connection.
            while not self._store.check([key]):
                self._check_open()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._timeout(src, tag, timeout, f"no message {key!r} in the store")
                time.sleep(min(delay, left))
                delay = min(delay * 2, _POLL_MAX_S)
            head = self._store.get(key)
            (count,) = _COUNT.unpack_from(head)
            rest = [f"{key}/{i}" for i in range(1, count)]
            data = head[_COUNT.size :] + b"".join(self._store.get(k) for k in rest)
            for k in (key, *rest):
                self._store.delete_key(k)
            self._received[(src, tag)] = n + 1  # consumed, even if it does not fit below
        finally:
            lock.release()
        out = _byte_view(tensor)
        if len(data) != out.numel():
            raise CollectiveMismatchError(
                f"storecomm: message {n} from rank {src} with tag {tag} has {len(data)} bytes, "
                f"but the receive buffer ({tuple(tensor.shape)}, {tensor.dtype}) has {out.numel()}",
                peers=(src,),
            )
        if data:
            out.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def _timeout(self, src: int, tag: int, timeout: float, why: str) -> CollectiveTimeout:
        message = f"recv from rank {src} with tag {tag} timed out after {timeout:g} s"
        return CollectiveTimeout(f"storecomm: {message} ({why})", op="recv", peers=(src,))

    # -- life ----------------------------------------------------------------------
    def shutdown(self) -> None:
        self._closed.set()
        super().shutdown()

    def abort(self) -> None:
        self._closed.set()  # a recv polling in another thread raises GroupClosedError
        super().abort()
