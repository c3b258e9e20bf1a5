"""The sending end of a ring (:mod:`pg_shm.rings`).

A message that fits in the ring's free space now is written by the caller at once (the
common case: no thread, no system call unless the receiver sleeps). Otherwise it goes to the
ring's sender thread (one per peer, started on first need), which writes queued messages in
order as space frees up, streaming a message larger than the ring through it while the
receiver drains it, a piece (:data:`~pg_shm.rings.STREAM_CHUNK`) at a time at both ends, so
that the two copies run at once. A message of at most :data:`~pg_shm.rings.EAGER_LIMIT` bytes never waits
for its receiver: while its sender thread waits for space, it rings the receiver's *drainer*
(a thread per member, asleep on a futex), which moves whole waiting messages out of the ring
into the receiver's process. A larger message waits until the receiver takes it. A sender
whose large send failed midway (timeout, abort) marks the ring broken, so its receiver raises
``PeerFailureError`` rather than waiting for the rest.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from ctypes import memmove

import torch
from pg_core.errors import CollectiveTimeout, PeerFailureError
from pg_core.work import Work

from .layout import ALIGN, HEADER, KIND_TENSOR, message_span
from .rings import CODES, EAGER_LIMIT, STREAM_CHUNK, Payload, Ring, TensorViews, parts_bytes, tensor_parts
from .segment import Word, futex_wake
from .waiting import Flag, Liveness, wait_until

__all__ = ["Outbox"]

_HEADER_BYTES = HEADER.size
_ALIGN = ALIGN
_ALIGN_MASK = ~(ALIGN - 1)
_pack_header = HEADER.pack_into


class _Job:
    __slots__ = ("code", "deadline", "keep", "kind", "nbytes", "parts", "tag", "work")

    def __init__(
        self, kind: int, code: int, tag: int, parts: Payload, *, deadline: float, work: Work, keep: object
    ) -> None:
        self.kind, self.code, self.tag, self.parts, self.deadline, self.work = kind, code, tag, parts, deadline, work
        self.keep = keep  # what the parts view (a tensor): alive until written, whatever the caller drops
        self.nbytes = parts_bytes(parts)


class Outbox:
    """This member's sending end of its ring to ``peer``."""

    def __init__(
        self,
        ring: Ring,
        peer: int,
        live: Liveness,
        doorbell: Word,
        group: str,
        *,
        hold: Callable[[], None],
        leave: Callable[[], None],
    ) -> None:
        self.ring = ring
        self._hold, self._leave = hold, leave  # the sender thread's reference to the mappings
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
        # what post_tensor's common case reads, looked up once
        self._head, self._tail, self._recv_sleeps = ring.head.cell, ring.tail.cell, ring.recv_sleeps.cell
        self._head_address, self._cap, self._data, self._base = ring.head.address, ring.capacity, ring.data, ring.base
        self._views = TensorViews()  # of the tensors the common case copies from

    # -- the caller's side -----------------------------------------------------------
    def post_tensor(self, tensor: torch.Tensor, tag: int, timeout: float, op: str) -> Work | None:
        """:meth:`post` of a tensor (deadline ``timeout`` seconds from now): the common case (it
        fits now, without wrapping) copied straight from its memory (through a
        :class:`~pg_shm.rings.TensorViews` view where it has one), its words read from cells
        looked up once (about 1.3 us of Python)."""
        nbytes = tensor.nbytes
        span = (_HEADER_BYTES + nbytes + _ALIGN - 1) & _ALIGN_MASK  # message_span, inlined
        code = CODES.get(tensor.dtype, 0)
        with self._lock:
            head = self._head.value
            if (
                self.broken is None
                and not self._queue
                and not self._busy
                and span <= self._cap - (head - self._tail.value)
                and (pos := head % self._cap) + span <= self._cap  # the message does not wrap
            ):
                _pack_header(self._data, pos, KIND_TENSOR, code, tag, nbytes)
                if nbytes:
                    address = tensor.data_ptr()
                    view = self._views.get((address, nbytes))
                    if view is not None:
                        self._data[pos + _HEADER_BYTES : pos + _HEADER_BYTES + nbytes] = view
                    else:
                        memmove(self._base + pos + _HEADER_BYTES, address, nbytes)
                        self._views.note(address, nbytes)
                self._head.value = head + span
                if self._recv_sleeps.value:
                    futex_wake(self._head_address)
                return None
        deadline = time.monotonic() + timeout
        return self.post(KIND_TENSOR, code, tag, tensor_parts(tensor), deadline=deadline, op=op, keep=tensor)

    def post(
        self, kind: int, code: int, tag: int, parts: Payload, *, deadline: float, op: str, keep: object = None
    ) -> Work | None:
        """Write the message now if it fits (``None``), else queue it for the sender thread and
        return the work that completes once it is written (large: once the peer took it)."""
        ring = self.ring
        nbytes = parts_bytes(parts)
        span = message_span(nbytes)
        with self._lock:
            if self.broken is not None:
                self.live.check([], op)  # broken by this member's close: say that
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
            # checked under the lock: the close takes it after marking the member closed, so a
            # thread started here is one the close sees (and joins), and a queued job is one
            # the thread fails
            self.live.check([], op)
            work = Work(op)
            self._queue.append(_Job(kind, code, tag, parts, deadline=deadline, work=work, keep=keep))
            if self._thread is None:
                thread = threading.Thread(
                    target=self._run, name=f"pg-shm {self.group} send to {self.peer}", daemon=True
                )
                self._hold()  # the caller holds one, so the mappings are there: the thread's own
                try:
                    thread.start()
                except BaseException:
                    self._queue.pop()
                    self._leave()
                    raise
                self._thread = thread
            else:
                self._wake.notify()
            return work

    def close(self, deadline: float) -> None:
        """Once the member is closed: wake the sender thread (queued messages fail) and join it
        until ``deadline`` (``time.monotonic()``); it leaves within a slice. The caller holds a
        reference to the mappings (the wake-up touches the ring)."""
        with self._lock:
            self._wake.notify_all()
            thread = self._thread
        futex_wake(self.ring.tail.address)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    # -- the sender thread -----------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        finally:
            self._leave()

    def _serve(self) -> None:
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

        def ring_bell() -> None:  # the peer's drainer advances a receive posted for this one
            futex_wake(self.doorbell.address)

        def wait_room(n: int) -> None:
            try:
                wait_until(
                    lambda: room() >= n,
                    ring.tail,
                    self._flag,
                    self.live,
                    [self.peer],
                    deadline=job.deadline,
                    doing=doing,
                    op="send",
                    also=ask_drain if eager else ring_bell,
                )
            except CollectiveTimeout as exc:
                if not ring.refused.value:
                    raise
                raise CollectiveTimeout(
                    f"Timed out in send (group {self.group!r}): {doing}: rank {self.peer} holds its "
                    "max_unexpected_bytes of messages it has not received yet, so this one waited for a receive "
                    "that did not come; receive them there, or raise the shm option max_unexpected_bytes (the "
                    "same on every rank)",
                    op="send",
                    peers=[self.peer],
                ) from exc

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
                    k = min(room(), part.nbytes - done, STREAM_CHUNK)
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
