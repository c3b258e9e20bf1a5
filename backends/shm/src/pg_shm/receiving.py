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
from pg_core.errors import CollectiveMismatchError, CollectiveTimeout, GroupClosedError, PeerFailureError
from pg_core.work import Work

from .layout import ALIGN, HEADER, KIND_TENSOR, message_span
from .rings import CODES, EAGER_LIMIT, STREAM_CHUNK, Ring, TensorViews
from .segment import futex_wake
from .waiting import SPINS, Flag, Liveness, wait_until

__all__ = ["Held", "Inbox", "Posted"]

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


class Posted:
    """A receive posted ahead of its message (``irecv``, or a blocking receive behind one):
    filled by whoever advances its inbox (:meth:`Inbox.advance`). ``into`` is its tensor, or
    ``None`` for a byte message (``result`` then holds it)."""

    __slots__ = ("deadline", "done", "error", "into", "kind", "op", "result", "tag", "work")

    def __init__(
        self, kind: int, tag: int, into: torch.Tensor | None, *, deadline: float, op: str, work: Work | None
    ) -> None:
        self.kind, self.tag, self.into, self.deadline, self.op, self.work = kind, tag, into, deadline, op, work
        self.done = False  # decided, under the inbox's lock; the work is completed after it is released
        self.error: BaseException | None = None
        self.result: bytearray | None = None


class _Stream:
    """The message at the ring's tail being read in pieces as its sender writes it: into
    ``dst`` (or nowhere), then ``then(buffer)`` once whole."""

    __slots__ = ("dst", "end", "final", "owner", "pos", "start", "then")

    def __init__(
        self, start: int, nbytes: int, dst: memoryview | None, then: Callable[[], None] | None, owner: Posted | None
    ) -> None:
        self.start, self.pos = start, start + _HEADER_BYTES
        self.end, self.final = self.pos + nbytes, start + message_span(nbytes)
        self.dst, self.then, self.owner = dst, then, owner


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
        # posted receives per (kind, tag), in posting order, and how many in all (read unlocked
        # by the fast paths and the drainer: a stale read only sends them the general way)
        self._posted: dict[tuple[int, int], deque[Posted]] = {}
        self.posted = 0
        self._stream: _Stream | None = None
        self._finished: list[Posted] = []  # decided under the lock, completed after it (_complete)
        # what receive_tensor's common case reads, looked up once
        self._head, self._tail, self._sender_sleeps = ring.head.cell, ring.tail.cell, ring.sender_sleeps.cell
        self._tail_address, self._cap, self._data, self._base = ring.tail.address, ring.capacity, ring.data, ring.base
        self._views = TensorViews()  # of the tensors the common case copies into

    def receive_tensor(self, into: torch.Tensor, tag: int, timeout: float, op: str) -> None:
        """:meth:`receive` of a tensor message (deadline ``timeout`` seconds from now): the
        common case (:meth:`take_tensor`) first, again after a short spin for it; anything else
        takes :meth:`receive`."""
        head = self._head
        for spin in (True, False):
            seen = self.take_tensor(into, tag)
            if seen < 0:
                return
            if not spin or self.posted:
                break
            for _ in range(SPINS):  # the sender is usually a few microseconds away: poll the bare cell
                if head.value != seen:
                    break
        self.receive(KIND_TENSOR, tag, into, time.monotonic() + timeout, op)

    def take_tensor(self, into: torch.Tensor, tag: int) -> int:
        """Receive a tensor message of ``tag`` into ``into`` if it is the common case
        (:meth:`_take_at_tail`, with nothing kept or posted). Never blocks. ``-1`` once
        received, else the ring's head as read (what a spin compares with)."""
        with self.lock:
            seen = self._head.value
            if self._take_at_tail(into, tag, seen, posted=0):
                return -1
        return seen

    def _take_at_tail(self, into: torch.Tensor, tag: int, seen: int, *, posted: int) -> bool:
        """(Under the lock.) The common case, for a receive of its own (``posted=0``: none is
        posted) or for the wait of the only receive posted (``posted=1``): nothing kept, none
        streamed, the peer not broken, and the next message in the ring (written up to
        ``seen``) a tensor message of ``tag`` for ``into``, whole, not wrapping, the tensor's
        size and dtype. Then it is copied straight into ``into`` (through a
        :class:`~pg_shm.rings.TensorViews` view where it has one) from cells looked up once, the
        ring moved on, and this returns True."""
        if self.posted != posted or self._kept or self._stream is not None or self.broken is not None:
            return False
        tail, cap = self._tail, self._cap
        nbytes = into.nbytes
        span = (_HEADER_BYTES + nbytes + _ALIGN - 1) & _ALIGN_MASK  # message_span, inlined
        start = tail.value
        if seen - start < span:
            return False
        off = start % cap
        k, code, t, n = _unpack_header(self._data, off)
        if k != KIND_TENSOR or t != tag or n != nbytes or code != CODES.get(into.dtype, 0) or off + span > cap:
            return False
        if nbytes:
            address = into.data_ptr()
            view = self._views.get((address, nbytes))
            if view is not None:
                view[:] = self._data[off + _HEADER_BYTES : off + _HEADER_BYTES + nbytes]
            else:
                memmove(address, self._base + off + _HEADER_BYTES, nbytes)
                self._views.note(address, nbytes)
        tail.value = start + span
        if self._sender_sleeps.value:
            futex_wake(self._tail_address)
        return True

    def receive(self, kind: int, tag: int, into: torch.Tensor | None, deadline: float, op: str) -> bytearray | None:
        """The next message of (``kind``, ``tag``): copied into ``into`` (a tensor, whose size
        and dtype must match), or returned (``into=None``: a byte message)."""
        ring = self.ring
        head, tail = ring.head.cell, ring.tail.cell
        while True:
            if self.posted or self._stream is not None:  # behind posted receives: one of them now
                return self._behind(self.post(kind, tag, into, deadline=deadline, op=op, work=None))
            with self.lock:
                if self.broken is not None:
                    self.live.check([], op)  # broken by this member's close: say that
                    raise PeerFailureError(self.broken, peers=[self.peer])
                if self.posted or self._stream is not None:
                    continue
                if (kind, tag) in self._kept:
                    code, buffer = self._pop_kept((kind, tag))
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
            while self._stream is None:  # (one stands inside a message: the posted receives' part)
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

    # -- posted receives ---------------------------------------------------------------
    @property
    def waiting(self) -> bool:
        """Whether posted receives (or a message read in pieces for them) are pending."""
        return bool(self.posted) or self._stream is not None

    def post(
        self, kind: int, tag: int, into: torch.Tensor | None, *, deadline: float, op: str, work: Work | None
    ) -> Posted:
        """Post a receive of (``kind``, ``tag``) behind every receive posted before it, take what
        is there now without waiting, and return it (done already, or pending: :meth:`drive`)."""
        posted = Posted(kind, tag, into, deadline=deadline, op=op, work=work)
        with self.lock:
            if self.broken is not None:
                posted.done, posted.error = True, PeerFailureError(self.broken, peers=[self.peer])
                self._finished.append(posted)
            else:
                key = (kind, tag)
                if key not in self._posted and key in self._kept:
                    self._take_kept(posted, key)
                else:
                    self._posted.setdefault(key, deque()).append(posted)
                    self.posted += 1
                    self._advance_posted()
            finished = self._take_finished()
        self._complete(finished)
        return posted

    def drive(self, posted: Posted, until: float) -> None:
        """Advance the posted receives until ``posted`` is done, waiting for the sender (spin,
        then futex) until ``until`` (``time.monotonic()``): past its own deadline it fails with
        ``CollectiveTimeout``, a dead or closed peer or a close of this member fails it (and the
        inbox's other posted receives) as a blocking receive fails; ``until`` before its deadline
        only ends this drive."""
        head = self.ring.head
        into = posted.into if posted.kind == KIND_TENSOR else None
        while True:
            with self.lock:
                seen = head.value  # read before deciding there is nothing: what the wait compares with
                if not posted.done:
                    # the only receive posted here, its message next in the ring: take it as recv does
                    if into is not None and self._take_at_tail(into, posted.tag, seen, posted=1):
                        self._pop_posted((KIND_TENSOR, posted.tag))
                        self._done(posted)
                    else:
                        self._advance_posted()
                finished = self._take_finished()
            self._complete(finished)
            if posted.done:
                return
            cell = head.cell
            for _ in range(SPINS):  # the sender is usually a few microseconds away: poll the bare cell
                if cell.value != seen or posted.done:
                    break
            else:
                self._sleep(posted, seen, until)
                if posted.done:
                    return
                if time.monotonic() >= until and until < posted.deadline:
                    return

    def _sleep(self, posted: Posted, seen: int, until: float) -> None:
        """:meth:`drive`'s wait (spin, then futex) for the ring's head to move past ``seen``."""
        ring, key = self.ring, (posted.kind, posted.tag)
        head, broken = ring.head, ring.broken
        doing = self._doing(posted.op, posted.tag)

        def moved() -> bool:
            return posted.done or head.value != seen or bool(broken.value) or bool(self._kept.get(key))

        try:
            wait_until(
                moved, head, self._flag, self.live, [self.peer],
                deadline=min(until, posted.deadline), doing=doing, op=posted.op,
            )  # fmt: skip
        except CollectiveTimeout as exc:
            if time.monotonic() < posted.deadline:
                return
            self._fail(posted, exc, every=False)
        except (PeerFailureError, GroupClosedError) as exc:
            self._fail(posted, exc, every=True)

    def poll(self) -> None:
        """Advance the posted receives as far as they go now, never blocking (``is_completed``)."""
        if not self.lock.acquire(blocking=False):
            return
        try:
            self._advance_posted()
            finished = self._take_finished()
        finally:
            self.lock.release()
        self._complete(finished)

    def unattended(self) -> None:
        """The drainer's part in posted receives: advance them, fail those past their deadline,
        and all of them once the peer is gone or this member closed. Never blocks."""
        if not self.waiting or not self.lock.acquire(blocking=False):
            return
        try:
            self._advance_posted()
            now = time.monotonic()
            late = [p for queue in self._posted.values() for p in queue if p.deadline <= now]
            owner = self._stream.owner if self._stream is not None else None
            if owner is not None and owner.deadline <= now:
                late.append(owner)
            for posted in late:
                self._fail_locked(posted, self._timeout(posted), every=False)
            if self.waiting:
                try:
                    self.live.check([self.peer], self._doing("irecv", 0 if owner is None else owner.tag))
                except (PeerFailureError, GroupClosedError) as exc:
                    self._fail_all(exc)
            finished = self._take_finished()
        finally:
            self.lock.release()
        self._complete(finished)

    def close(self, error: BaseException, timeout: float) -> None:
        """Fail every posted receive with ``error`` (this member's close)."""
        if not self.lock.acquire(timeout=timeout):  # a blocking receive holds it: it fails on its own
            return
        try:
            self._fail_all(error)
            finished = self._take_finished()
        finally:
            self.lock.release()
        self._complete(finished)

    def _behind(self, posted: Posted) -> bytearray | None:
        """A blocking receive posted behind others: driven here to its end."""
        if not posted.done:
            self.drive(posted, posted.deadline)
        assert posted.done, "pg-shm: a blocking receive's drive ended before its deadline"
        if posted.error is not None:
            raise posted.error
        return posted.result

    def _fail(self, posted: Posted, error: BaseException, *, every: bool) -> None:
        with self.lock:
            self._advance_posted()  # what came before the failure still counts
            if not posted.done:
                if every:
                    self._fail_all(error)
                else:
                    self._fail_locked(posted, error, every=False)
            finished = self._take_finished()
        self._complete(finished)

    def _timeout(self, posted: Posted) -> CollectiveTimeout:
        return CollectiveTimeout(
            f"Timed out in {posted.op} (group {self.group!r}): {self._doing(posted.op, posted.tag)}; not heard "
            f"from ranks [{self.peer}]",
            op=posted.op,
            peers=[self.peer],
        )

    def _complete(self, finished: list[Posted]) -> None:
        """Complete the works of receives decided under the lock (outside it: their callbacks
        may post more), and wake a thread of this member that sleeps waiting for one."""
        for posted in finished:
            work = posted.work
            if work is not None:
                if posted.error is not None:
                    work.set_exception(posted.error)
                else:
                    work.set_result(None)
        if finished and self.ring.recv_sleeps.value:
            futex_wake(self.ring.head.address)

    # -- inside the lock -------------------------------------------------------------
    def _take_finished(self) -> list[Posted]:
        finished, self._finished = self._finished, []
        return finished

    def _done(self, posted: Posted, error: BaseException | None = None) -> None:
        posted.done, posted.error = True, error
        self._finished.append(posted)

    def _pop_kept(self, key: tuple[int, int]) -> tuple[int, bytearray]:
        """The first kept message of ``key`` (there is one), no longer held; a key with none
        left is removed (an empty ``_kept`` is what the fast path asks)."""
        kept = self._kept[key]
        code, buffer = kept.popleft()
        if not kept:
            del self._kept[key]
        self.held.give(len(buffer))
        return code, buffer

    def _pop_posted(self, key: tuple[int, int]) -> Posted:
        """The first receive posted for ``key`` (there is one); a key with none left is removed."""
        queue = self._posted[key]
        posted = queue.popleft()
        if not queue:
            del self._posted[key]
        self.posted -= 1
        return posted

    def _take_kept(self, posted: Posted, key: tuple[int, int]) -> None:
        code, buffer = self._pop_kept(key)
        try:
            posted.result = self._deliver(code, buffer, posted.into)
        except CollectiveMismatchError as exc:
            self._done(posted, exc)
        else:
            self._done(posted)

    def _advance_posted(self) -> None:
        """Move the ring's messages into the posted receives, in ring order, as far as the
        sender has written them (a message of a tag nobody posted for is kept, as a receive
        reading past it keeps it), while any are posted. Never blocks."""
        ring = self.ring
        while self.posted or self._stream is not None:
            if self.broken is not None:
                self._fail_all(PeerFailureError(self.broken, peers=[self.peer]))
                return
            stream = self._stream
            if stream is not None:
                if not self._read_on(stream):
                    if ring.broken.value:
                        self._fail_all(
                            PeerFailureError(
                                f"group {self.group!r}: rank {self.peer}'s send stopped midway (it timed out or was "
                                "aborted); this stream is broken",
                                peers=[self.peer],
                            )
                        )
                    return
                self._stream = None
                if stream.then is not None:
                    stream.then()
                continue
            for key in [key for key in self._posted if key in self._kept]:
                while key in self._posted and key in self._kept:
                    self._take_kept(self._pop_posted(key), key)
            if not self.posted:
                return
            start = ring.tail.value
            if ring.head.value - start < _HEADER_BYTES:
                return
            k, code, t, nbytes = _unpack_header(ring.data, start % ring.capacity)
            if (k, t) in self._posted:
                posted = self._pop_posted((k, t))
                into = posted.into
                span = message_span(nbytes)
                if (  # the common case: whole in the ring, not wrapping, the right size: one copy
                    into is not None
                    and ring.head.value - start >= span
                    and start % ring.capacity + span <= ring.capacity
                    and nbytes == into.nbytes
                    and code == CODES.get(into.dtype, 0)
                ):
                    if nbytes:
                        memmove(into.data_ptr(), self._base + start % ring.capacity + _HEADER_BYTES, nbytes)
                    self._advance(start + span)
                    self._done(posted)
                    continue
                self._stream = self._into_posted(posted, start, code, nbytes)
            else:  # read past it, as a receive does
                buffer = bytearray(nbytes)
                self.held.take(nbytes, within=False)
                self._stream = _Stream(start, nbytes, memoryview(buffer), self._keeping(k, t, code, buffer), None)

    def _into_posted(self, posted: Posted, start: int, code: int, nbytes: int) -> _Stream:
        into = posted.into
        if into is None:
            buffer = posted.result = bytearray(nbytes)
            return _Stream(start, nbytes, memoryview(buffer), lambda: self._done(posted), posted)
        if nbytes != into.nbytes or code != dtype_code(into.dtype):
            self._done(posted, self._mismatch(into, code, nbytes))
            return _Stream(start, nbytes, None, None, None)  # read past it
        return _Stream(start, nbytes, tensor_bytes(into) if nbytes else None, lambda: self._done(posted), posted)

    def _keeping(self, kind: int, tag: int, code: int, buffer: bytearray) -> Callable[[], None]:
        def keep() -> None:
            self._kept.setdefault((kind, tag), deque()).append((code, buffer))
            futex_wake(self.ring.head.address)  # another thread of this member may wait for it

        return keep

    def _read_on(self, stream: _Stream) -> bool:
        """Copy what the sender wrote of ``stream``'s message; whether it is all consumed."""
        pos = stream.pos
        while (n := min(self.ring.head.value, stream.end) - pos) > 0:  # a piece at a time (STREAM_CHUNK)
            n = min(n, STREAM_CHUNK)
            if stream.dst is not None:
                done = pos - stream.start - _HEADER_BYTES
                self._copy_out(pos, stream.dst[done : done + n])
            stream.pos = pos = pos + n
            self._advance(pos)
        head = self.ring.head.value
        if pos < stream.end or head < stream.final:
            return False
        if stream.final > pos:
            self._advance(stream.final)
        return True

    def _fail_locked(self, posted: Posted, error: BaseException, *, every: bool) -> None:
        """Fail ``posted``; one whose message is being read breaks the stream (as a blocking
        receive failing midway does), failing every posted receive."""
        if posted.done:
            return
        stream = self._stream
        if every or (stream is not None and stream.owner is posted):
            self._fail_all(error)
            return
        key = (posted.kind, posted.tag)
        queue = self._posted.get(key)
        if queue is not None and posted in queue:
            queue.remove(posted)
            if not queue:
                del self._posted[key]
            self.posted -= 1
        self._done(posted, error)

    def _fail_all(self, error: BaseException) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            self.broken = (
                f"group {self.group!r}: the stream from rank {self.peer} is broken: a message stopped midway here "
                f"({type(error).__name__})"
            )
            if stream.owner is not None and not stream.owner.done:
                self._done(stream.owner, error)
        for queue in self._posted.values():
            for posted in queue:
                self._done(posted, error)
        self._posted.clear()
        self.posted = 0

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
                k = min(avail, end - pos, STREAM_CHUNK)
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
