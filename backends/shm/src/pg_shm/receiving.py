"""The receiving end of a ring (:mod:`pg_shm.rings`).

Per peer, received-but-unmatched messages are kept per (kind, tag) in arrival order; a receive
takes from there first, then reads the ring: a message of its (kind, tag) is copied straight
into the receiver's tensor (streamed while the sender writes it), one of another tag is read
into a buffer and kept. A receive of the wrong size or dtype consumes the message and raises
``CollectiveMismatchError``, its tensor untouched. :meth:`Inbox.drain` is the drainer's part:
whole small messages moved out of a full ring while their sender asks for room.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from ctypes import memmove

import torch
from pg_core.backend import tensor_bytes
from pg_core.dtypes import dtype_code, dtype_from_code
from pg_core.errors import CollectiveMismatchError, PeerFailureError

from .layout import ALIGN, HEADER, KIND_TENSOR, message_span
from .rings import CODES, EAGER_LIMIT, Ring
from .segment import futex_wake
from .waiting import SPINS, Flag, Liveness, wait_until

__all__ = ["Held", "Inbox"]

_HEADER_BYTES = HEADER.size
_ALIGN = ALIGN
_ALIGN_MASK = ~(ALIGN - 1)
_unpack_header = HEADER.unpack_from


class Held:
    """The bytes of messages this member's inboxes hold (read out of a ring, not received
    yet), against ``limit`` (the ``max_unexpected_bytes`` option): the drainer moves a
    message only within it; a receive that reads past a message of another tag keeps it
    whatever the count (it is this member's own call)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.bytes = 0
        self._lock = threading.Lock()

    def take(self, n: int, *, within: bool) -> bool:
        """Count ``n`` more bytes held; with ``within``, only if that stays within the limit."""
        with self._lock:
            if within and self.bytes + n > self.limit:
                return False
            self.bytes += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.bytes -= n


class Inbox:
    """This member's receiving end of ``peer``'s ring to it."""

    def __init__(self, ring: Ring, peer: int, live: Liveness, group: str, held: Held) -> None:
        self.ring = ring
        self.held = held
        self.peer = peer
        self.live = live
        self.group = group
        self.lock = threading.Lock()
        self._kept: dict[tuple[int, int], deque[tuple[int, bytearray]]] = {}
        self._flag = Flag(ring.recv_sleeps)
        self.broken: str | None = None
        # what receive_tensor's common case reads, looked up once
        self._head, self._tail, self._sender_sleeps = ring.head.cell, ring.tail.cell, ring.sender_sleeps.cell
        self._tail_address, self._cap, self._data, self._base = ring.tail.address, ring.capacity, ring.data, ring.base

    def receive_tensor(self, into: torch.Tensor, tag: int, timeout: float, op: str) -> None:
        """:meth:`receive` of a tensor message (deadline ``timeout`` seconds from now): the
        common case (the next message in the ring is this one, whole, not wrapping, and nothing
        is kept) copied straight into ``into`` from cells looked up once; after a short spin
        for it, anything else takes :meth:`receive`."""
        head, tail, data, cap = self._head, self._tail, self._data, self._cap
        nbytes = into.nbytes
        span = (_HEADER_BYTES + nbytes + _ALIGN - 1) & _ALIGN_MASK  # message_span, inlined
        for spin in (True, False):
            with self.lock:
                seen = head.value
                start = tail.value
                if self.broken is None and not self._kept and seen - start >= span:
                    off = start % cap
                    k, code, t, n = _unpack_header(data, off)
                    if (
                        k == KIND_TENSOR
                        and t == tag
                        and n == nbytes
                        and code == CODES.get(into.dtype, 0)
                        and off + span <= cap
                    ):
                        if nbytes:
                            memmove(into.data_ptr(), self._base + off + _HEADER_BYTES, nbytes)
                        tail.value = start + span
                        if self._sender_sleeps.value:
                            futex_wake(self._tail_address)
                        return
            if not spin:
                break
            for _ in range(SPINS):  # the sender is usually a few microseconds away: poll the bare cell
                if head.value != seen:
                    break
        self.receive(KIND_TENSOR, tag, into, time.monotonic() + timeout, op)

    def receive(self, kind: int, tag: int, into: torch.Tensor | None, deadline: float, op: str) -> bytearray | None:
        """The next message of (``kind``, ``tag``): copied into ``into`` (a tensor, whose size
        and dtype must match), or returned (``into=None``: a byte message)."""
        ring = self.ring
        head, tail = ring.head.cell, ring.tail.cell
        while True:
            with self.lock:
                if self.broken is not None:
                    self.live.check([], op)  # broken by this member's close: say that
                    raise PeerFailureError(self.broken, peers=[self.peer])
                kept = self._kept.get((kind, tag))
                if kept:
                    code, buffer = kept.popleft()
                    self.held.give(len(buffer))
                    return self._deliver(code, buffer, into)
                while True:
                    seen = head.value  # read before deciding there is nothing: what the wait compares with
                    start = tail.value
                    if seen - start < HEADER.size:
                        break
                    k, code, t, nbytes = HEADER.unpack_from(ring.data, start % ring.capacity)
                    if k == kind and t == tag:
                        if into is not None:
                            if nbytes != into.nbytes or code != dtype_code(into.dtype):
                                self._stream_out(nbytes, None, deadline, self._doing(op, tag), op)  # read past it
                                raise self._mismatch(into, code, nbytes)
                            span = message_span(nbytes)
                            if seen - start >= span:  # whole: straight into the tensor
                                if nbytes:
                                    ring.move_out(start + HEADER.size, into.data_ptr(), nbytes)
                                tail.value = start + span
                                if ring.sender_sleeps.cell.value:
                                    futex_wake(ring.tail.address)
                                return None
                            self._stream_out(nbytes, tensor_bytes(into), deadline, self._doing(op, tag), op)
                            return None
                        buffer = bytearray(nbytes)
                        self._stream_out(nbytes, memoryview(buffer), deadline, self._doing(op, tag), op)
                        return buffer
                    buffer = bytearray(nbytes)
                    self._stream_out(nbytes, memoryview(buffer), deadline, self._doing(op, tag), op)
                    self.held.take(nbytes, within=False)
                    self._kept.setdefault((k, t), deque()).append((code, buffer))
                    futex_wake(ring.head.address)  # another thread of this member may wait for it
            for _ in range(SPINS):  # the sender is usually a few microseconds away: poll the bare cell
                if head.value != seen:
                    break
            else:
                self._wait(self._moved(seen, kind, tag), deadline, self._doing(op, tag), op)

    def _doing(self, op: str, tag: int) -> str:
        """What a receive is doing, for errors: formatted only on the slow paths (it costs about
        what a whole small receive does)."""
        return f"{op} from rank {self.peer} (tag {tag})"

    def _moved(self, seen: int, kind: int, tag: int) -> Callable[[], bool]:
        head = self.ring.head
        return lambda: head.value != seen or bool(self._kept.get((kind, tag)))

    def _past(self, pos: int) -> Callable[[], bool]:
        head = self.ring.head
        return lambda: head.value > pos

    def drain(self) -> None:
        """The drainer's work: move whole messages of at most the eager limit out of the ring
        into this process, while the sender asks for room. Never blocks."""
        ring = self.ring
        if not ring.want_drain.value or not self.lock.acquire(blocking=False):
            return
        try:
            while True:
                tail, head = ring.tail.value, ring.head.value
                if head - tail < HEADER.size:
                    return
                k, code, t, nbytes = HEADER.unpack_from(ring.data, tail % ring.capacity)
                if nbytes > EAGER_LIMIT or head - tail < message_span(nbytes):
                    return
                if not self.held.take(nbytes, within=True):  # spent: the sender waits for a receive
                    ring.refused.value = 1
                    return
                ring.refused.value = 0
                buffer = bytearray(nbytes)
                self._copy_out(tail + HEADER.size, memoryview(buffer))
                self._advance(tail + message_span(nbytes))
                self._kept.setdefault((k, t), deque()).append((code, buffer))
                futex_wake(ring.head.address)
        finally:
            self.lock.release()

    # -- inside the lock -------------------------------------------------------------
    def _deliver(self, code: int, buffer: bytearray, into: torch.Tensor | None) -> bytearray | None:
        if into is None:
            return buffer
        if not self._matches(into, code, len(buffer)):
            raise self._mismatch(into, code, len(buffer))
        if buffer:
            tensor_bytes(into)[:] = buffer
        return None

    @staticmethod
    def _matches(into: torch.Tensor, code: int, nbytes: int) -> bool:
        return nbytes == into.numel() * into.element_size() and code == dtype_code(into.dtype)

    def _mismatch(self, into: torch.Tensor, code: int, nbytes: int) -> CollectiveMismatchError:
        theirs = dtype_from_code(code) if code else "bytes (a send_bytes message)"
        return CollectiveMismatchError(
            f"group {self.group!r}: recv from rank {self.peer}: the message is {nbytes} bytes of {theirs}, the "
            f"receiving tensor {into.numel() * into.element_size()} bytes of {into.dtype} {tuple(into.shape)}; "
            "the tensor is unchanged",
            peers=[self.peer],
        )

    def _stream_out(self, nbytes: int, dst: memoryview | None, deadline: float, doing: str, op: str) -> None:
        """Consume the message whose header is at ``tail``: its payload into ``dst`` (or
        nowhere), waiting for the sender to write it where it is not whole yet."""
        ring = self.ring
        start = ring.tail.value
        pos = start + HEADER.size
        end = pos + nbytes
        if ring.head.value >= start + message_span(nbytes):  # whole: one copy
            if dst is not None and nbytes:
                self._copy_out(pos, dst)
            self._advance(start + message_span(nbytes))
            return
        self._advance(pos)
        try:
            while pos < end:
                avail = ring.head.value - pos
                if avail <= 0:
                    self._wait(self._past(pos), deadline, doing, op)
                    continue
                k = min(avail, end - pos)
                if dst is not None:
                    done = pos - start - HEADER.size
                    self._copy_out(pos, dst[done : done + k])
                pos += k
                self._advance(pos)
            final = start + message_span(nbytes)
            if final > pos:
                self._wait(lambda: ring.head.value >= final, deadline, doing, op)
                self._advance(final)
        except BaseException as exc:  # the ring now stands inside a message: nothing after it can be read
            self.broken = (
                f"group {self.group!r}: the stream from rank {self.peer} is broken: a {nbytes}-byte message "
                f"stopped midway here ({type(exc).__name__})"
            )
            raise

    def _wait(self, ready: Callable[[], bool], deadline: float, doing: str, op: str) -> None:
        ring = self.ring

        def ready_or_broken() -> bool:
            if ready():
                return True
            if ring.broken.value:
                raise PeerFailureError(
                    f"group {self.group!r}: {doing}: rank {self.peer}'s send stopped midway (it timed out or was "
                    "aborted); this stream is broken",
                    peers=[self.peer],
                )
            return False

        wait_until(
            ready_or_broken, ring.head, self._flag, self.live, [self.peer], deadline=deadline, doing=doing, op=op
        )

    def _advance(self, tail: int) -> None:
        ring = self.ring
        ring.tail.value = tail
        if ring.sender_sleeps.value:
            futex_wake(ring.tail.address)

    def _copy_out(self, pos: int, dst: memoryview) -> None:
        data, cap = self.ring.data, self.ring.capacity
        n = dst.nbytes
        off = pos % cap
        first = min(n, cap - off)
        dst[:first] = data[off : off + first]
        if n > first:
            dst[first:] = data[: n - first]
