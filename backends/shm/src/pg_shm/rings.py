"""Point to point over per-pair rings in shared memory.

Each ordered pair of members has a ring in the sender's segment (:mod:`pg_shm.layout`).
A message is a header (kind, dtype code, tag, payload bytes) and its payload; the sender
publishes bytes by moving ``head``, the receiver frees them by moving ``tail``.

**Sending.** A message that fits in the ring's free space now is written by the caller at
once (the common case: no thread, no system call unless the receiver sleeps). Otherwise it
goes to the ring's sender thread (one per peer, started on first need), which writes queued
messages in order as space frees up, streaming a message larger than the ring through it
while the receiver drains it. A message of at most :data:`EAGER_LIMIT` bytes never waits for
its receiver: while its sender thread waits for space, it rings the receiver's *drainer*
(a thread per member, asleep on a futex), which moves whole waiting messages out of the
ring into the receiver's process. A larger message waits until the receiver takes it.

**Receiving.** Per peer, received-but-unmatched messages are kept per (kind, tag) in
arrival order; a receive takes from there first, then reads the ring: a message of its
(kind, tag) is copied straight into the receiver's tensor (streamed while the sender
writes it), one of another tag is read into a buffer and kept. A receive of the wrong size
or dtype consumes the message and raises ``CollectiveMismatchError``, its tensor untouched.
A sender whose large send failed midway (timeout, abort) marks the ring broken, and its
receiver raises ``PeerFailureError`` rather than waiting for the rest.
"""

from __future__ import annotations

import ctypes
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch
from pg_core.dtypes import dtype_code, dtype_from_code
from pg_core.errors import CollectiveMismatchError, PeerFailureError
from pg_core.work import Work

from .layout import (
    BROKEN,
    HEAD,
    HEADER,
    KIND_TENSOR,
    RECV_SLEEPS,
    SENDER_SLEEPS,
    TAIL,
    WANT_DRAIN,
    message_span,
)
from .segment import Segment, Word, futex_wake
from .waiting import Flag, Liveness, wait_until

__all__ = ["EAGER_LIMIT", "RING_BYTES", "Inbox", "Outbox", "Payload"]

#: The declared eager limit (``Capabilities.eager_limit_bytes``): 1 MiB.
EAGER_LIMIT: Final = 1 << 20
#: A ring's bytes: one message of :data:`EAGER_LIMIT` bytes with its header fits an empty ring.
RING_BYTES: Final = message_span(EAGER_LIMIT)

Payload = list[memoryview]


def _parts_bytes(parts: Payload) -> int:
    return sum(p.nbytes for p in parts)


class _Ring:
    """The words and bytes of one ring, as either end maps them."""

    def __init__(self, segment: Segment, offset: int, meta: int, capacity: int) -> None:
        self.head = segment.word(offset + HEAD)
        self.tail = segment.word(offset + TAIL)
        self.sender_sleeps = segment.word(offset + SENDER_SLEEPS, 32)
        self.recv_sleeps = segment.word(offset + RECV_SLEEPS, 32)
        self.want_drain = segment.word(offset + WANT_DRAIN, 32)
        self.broken = segment.word(offset + BROKEN, 32)
        self.capacity = capacity
        self.data = segment.view[offset + meta : offset + meta + capacity]
        self.base = segment.address + offset + meta

    def move_in(self, pos: int, address: int, n: int) -> None:
        """Copy ``n`` bytes at ``address`` into the ring at ``pos`` (wrapping)."""
        cap = self.capacity
        off = pos % cap
        first = min(n, cap - off)
        ctypes.memmove(self.base + off, address, first)
        if n > first:
            ctypes.memmove(self.base, address + first, n - first)

    def move_out(self, pos: int, address: int, n: int) -> None:
        """Copy ``n`` bytes of the ring at ``pos`` (wrapping) to ``address``."""
        cap = self.capacity
        off = pos % cap
        first = min(n, cap - off)
        ctypes.memmove(address, self.base + off, first)
        if n > first:
            ctypes.memmove(address + first, self.base, n - first)

    def release(self) -> None:
        self.data.release()


class _Job:
    __slots__ = ("code", "deadline", "keep", "kind", "nbytes", "parts", "tag", "work")

    def __init__(
        self, kind: int, code: int, tag: int, parts: Payload, *, deadline: float, work: Work, keep: object
    ) -> None:
        self.kind, self.code, self.tag, self.parts, self.deadline, self.work = kind, code, tag, parts, deadline, work
        self.keep = keep  # what the parts view (a tensor): alive until written, whatever the caller drops
        self.nbytes = _parts_bytes(parts)


class Outbox:
    """This member's sending end of its ring to ``peer``."""

    def __init__(self, ring: _Ring, peer: int, live: Liveness, doorbell: Word, group: str) -> None:
        self.ring = ring
        self.peer = peer
        self.live = live
        self.doorbell = doorbell  # the peer's drainer futex
        self.group = group
        self._lock = threading.Lock()
        self._queue: deque[_Job] = deque()
        self._busy = False
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._flag = Flag(ring.sender_sleeps)
        self.broken: str | None = None

    # -- the caller's side -----------------------------------------------------------
    def post_tensor(self, tensor: torch.Tensor, code: int, tag: int, *, deadline: float, op: str) -> Work | None:
        """:meth:`post` of a tensor: the common case (it fits now) copied straight from its memory."""
        ring = self.ring
        nbytes = tensor.numel() * tensor.element_size()
        span = message_span(nbytes)
        with self._lock:
            head = ring.head.value
            if (
                self.broken is None
                and not self._queue
                and not self._busy
                and span <= ring.capacity - (head - ring.tail.value)
            ):
                self._write_header(head, KIND_TENSOR, code, tag, nbytes)
                if nbytes:
                    ring.move_in(head + HEADER.size, tensor.data_ptr(), nbytes)
                ring.head.value = head + span
                if ring.recv_sleeps.value:
                    futex_wake(ring.head.address)
                return None
        return self.post(KIND_TENSOR, code, tag, tensor_parts(tensor), deadline=deadline, op=op, keep=tensor)

    def post(
        self, kind: int, code: int, tag: int, parts: Payload, *, deadline: float, op: str, keep: object = None
    ) -> Work | None:
        """Write the message now if it fits (``None``), else queue it for the sender thread and
        return the work that completes once it is written (large: once the peer took it)."""
        ring = self.ring
        nbytes = _parts_bytes(parts)
        span = message_span(nbytes)
        with self._lock:
            if self.broken is not None:
                raise PeerFailureError(self.broken, peers=[self.peer])
            head = ring.head.value
            if not self._queue and not self._busy and span <= ring.capacity - (head - ring.tail.value):
                self._write_header(head, kind, code, tag, nbytes)
                pos = head + HEADER.size
                for part in parts:
                    self._copy_in(pos, part)
                    pos += part.nbytes
                ring.head.value = head + span
                if ring.recv_sleeps.value:
                    futex_wake(ring.head.address)
                return None
            work = Work(op)
            self._queue.append(_Job(kind, code, tag, parts, deadline=deadline, work=work, keep=keep))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"pg-shm {self.group} send to {self.peer}", daemon=True
                )
                self._thread.start()
            else:
                self._wake.notify()
            return work

    def close(self) -> bool:
        """Stop the sender thread (queued messages fail); wake it if it waits. Whether it has
        stopped (it leaves within a slice of the member being closed)."""
        with self._lock:
            self._wake.notify_all()
        futex_wake(self.ring.tail.address)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
            return not self._thread.is_alive()
        return True

    # -- the sender thread -----------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and self.live.closed is None:
                    self._wake.wait(0.5)
                if self.live.closed is not None and not self._queue:
                    return
                job = self._queue.popleft()
                self._busy = True
            try:
                if self.live.closed is not None or self.broken is not None:
                    self.live.check([], f"send to rank {self.peer}")
                    raise PeerFailureError(self.broken or "", peers=[self.peer])
                self._stream(job)
            except BaseException as exc:
                job.work.set_exception(exc)
            else:
                job.work.set_result(None)
            finally:
                job.parts, job.keep = [], None
                with self._lock:
                    self._busy = False

    def _stream(self, job: _Job) -> None:
        ring = self.ring
        cap = ring.capacity
        doing = f"send of {job.nbytes} bytes to rank {self.peer}"
        eager = job.nbytes <= EAGER_LIMIT
        need = message_span(job.nbytes) if eager else message_span(0)
        head = ring.head.value

        def room() -> int:
            return cap - (head - ring.tail.value)

        def ask_drain() -> None:
            ring.want_drain.value = 1
            futex_wake(self.doorbell.address)

        def wait_room(n: int) -> None:
            wait_until(
                lambda: room() >= n,
                ring.tail,
                self._flag,
                self.live,
                [self.peer],
                deadline=job.deadline,
                doing=doing,
                op="send",
                also=ask_drain if eager else None,
            )

        wait_room(need)
        ring.want_drain.value = 0
        self._write_header(head, job.kind, job.code, job.tag, job.nbytes)
        if eager:
            pos = head + HEADER.size
            for part in job.parts:
                self._copy_in(pos, part)
                pos += part.nbytes
            self._publish(head + message_span(job.nbytes))
            return
        # streamed: the header first, then the payload as the receiver frees room
        head += HEADER.size
        self._publish(head)
        try:
            for part in job.parts:
                done = 0
                while done < part.nbytes:
                    if room() <= 0:
                        wait_room(1)
                    k = min(room(), part.nbytes - done)
                    self._copy_in(head, part[done : done + k])
                    head += k
                    done += k
                    self._publish(head)
            pad = message_span(job.nbytes) - HEADER.size - job.nbytes
            if pad:
                wait_room(pad)
                self._publish(head + pad)
        except BaseException as exc:
            self.broken = (
                f"group {self.group!r}: the stream to rank {self.peer} is broken: a {job.nbytes}-byte send stopped "
                f"midway ({type(exc).__name__})"
            )
            ring.broken.value = 1
            futex_wake(ring.head.address)
            raise

    def _publish(self, head: int) -> None:
        self.ring.head.value = head
        if self.ring.recv_sleeps.value:
            futex_wake(self.ring.head.address)

    def _write_header(self, pos: int, kind: int, code: int, tag: int, nbytes: int) -> None:
        HEADER.pack_into(self.ring.data, pos % self.ring.capacity, kind, code, tag, nbytes)

    def _copy_in(self, pos: int, src: memoryview) -> None:
        data, cap = self.ring.data, self.ring.capacity
        n = src.nbytes
        off = pos % cap
        first = min(n, cap - off)
        data[off : off + first] = src[:first]
        if n > first:
            data[: n - first] = src[first:]


class Inbox:
    """This member's receiving end of ``peer``'s ring to it."""

    def __init__(self, ring: _Ring, peer: int, live: Liveness, group: str) -> None:
        self.ring = ring
        self.peer = peer
        self.live = live
        self.group = group
        self.lock = threading.Lock()
        self._kept: dict[tuple[int, int], deque[tuple[int, bytearray]]] = {}
        self._flag = Flag(ring.recv_sleeps)
        self.broken: str | None = None

    def receive(self, kind: int, tag: int, into: torch.Tensor | None, deadline: float, op: str) -> bytearray | None:
        """The next message of (``kind``, ``tag``): copied into ``into`` (a tensor, whose size
        and dtype must match), or returned (``into=None``: a byte message)."""
        ring = self.ring
        doing = f"{op} from rank {self.peer} (tag {tag})"
        while True:
            with self.lock:
                if self.broken is not None:
                    raise PeerFailureError(self.broken, peers=[self.peer])
                kept = self._kept.get((kind, tag))
                if kept:
                    code, buffer = kept.popleft()
                    return self._deliver(code, buffer, into)
                while True:
                    seen = ring.head.value  # read before deciding there is nothing: what the wait compares with
                    if seen - ring.tail.value < HEADER.size:
                        break
                    k, code, t, nbytes = HEADER.unpack_from(ring.data, ring.tail.value % ring.capacity)
                    if (k, t) == (kind, tag):
                        if into is not None:
                            if not self._matches(into, code, nbytes):
                                self._stream_out(nbytes, None, deadline, doing, op)  # read past it
                                raise self._mismatch(into, code, nbytes)
                            start = ring.tail.value
                            if seen - start >= message_span(nbytes):  # whole: straight into the tensor
                                if nbytes:
                                    ring.move_out(start + HEADER.size, into.data_ptr(), nbytes)
                                self._advance(start + message_span(nbytes))
                                return None
                            self._stream_out(nbytes, memoryview_of(into), deadline, doing, op)
                            return None
                        buffer = bytearray(nbytes)
                        self._stream_out(nbytes, memoryview(buffer), deadline, doing, op)
                        return buffer
                    buffer = bytearray(nbytes)
                    self._stream_out(nbytes, memoryview(buffer), deadline, doing, op)
                    self._kept.setdefault((k, t), deque()).append((code, buffer))
                    futex_wake(ring.head.address)  # another thread of this member may wait for it
            self._wait(self._moved(seen, kind, tag), deadline, doing, op)

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
            memoryview_of(into)[:] = buffer
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


def memoryview_of(tensor: torch.Tensor) -> memoryview:
    from pg_core.backend import tensor_bytes

    return tensor_bytes(tensor)


def parts_of(data: object) -> Payload:
    """``send_bytes``' argument as byte views."""
    seq: Sequence[Any] = data if isinstance(data, list | tuple) else [data]
    return [memoryview(p).cast("B") for p in seq]


def tensor_parts(tensor: torch.Tensor) -> Payload:
    return [memoryview_of(tensor)] if tensor.numel() else []


def make_ring(segment: Segment, offset: int, meta: int, capacity: int) -> _Ring:
    return _Ring(segment, offset, meta, capacity)
