"""``Messages``: pg-gloo's point to point, a layer of :class:`~pg_gloo.backend.GlooBackend`.

Gloo's ``send`` completes only once the receiver has posted its receive, and a receive whose
buffer is smaller than the message aborts the whole process (``op.preamble.length <=
op.nbytes``); a larger buffer takes the message and leaves the rest unwritten. So a message is
one Gloo message of a 16-byte header (size, dtype) followed by the payload, when the payload is
at most ``_INLINE`` (4 MiB); a larger payload follows a header-only message as a second Gloo
message, received straight into the tensor. ``send`` copies the tensor (within
``max_buffered_send_bytes`` of copies not yet received) and returns at once; one reaper thread
per backend waits for Gloo's sends in order and releases their buffers. The backend module's
docstring says why, with the measurements.
"""

from __future__ import annotations

import queue
import struct
import threading
import time
from typing import TYPE_CHECKING, Any, Final

import torch
from pg_core.backend import BackendContext, tensor_bytes
from pg_core.buffers import SpareBuffers
from pg_core.c10d import flat_bytes, timeout_delta
from pg_core.dtypes import dtype_code, dtype_from_code, dtype_name
from pg_core.errors import CollectiveMismatchError, CollectiveTimeout
from pg_core.work import Work

from .waiting import SLICE_S
from .watch import PeerWatch

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = ["MAX_BUFFERED_SEND_BYTES", "Messages", "Sent"]

#: The header's dtype field for a ``send_bytes`` message.
_BYTES: Final = -1

#: A message's first Gloo message starts with this header: the payload's size and dtype
#: code, two little-endian int64.
_HEADER: Final = struct.Struct("<qq")
_HEAD: Final = _HEADER.size
#: The largest payload that travels in the first Gloo message, right after the header; a
#: larger one is a second Gloo message. The receiver posts its first receive before it knows
#: the message (Gloo aborts the process on a message larger than its receive), so each
#: receive takes a buffer of ``_HEAD + _INLINE`` bytes: untouched memory but for the bytes
#: that arrive. One message, not two, because a Gloo message sent before its receive is
#: posted waits for it, and with the reaper thread waiting on the send the second message
#: of a pair took 1-2 ms to arrive (16 KiB to 256 KiB ping-pong, ranks pinned to cores:
#: medians of 1.1-1.9 ms one way as two messages against 70-130 us as one).
_INLINE: Final = 4 << 20

#: Sends handed to the reaper thread together: a batch goes when it holds this many sends or
#: this many bytes, or a payload sent after its header (its buffer is large, and goes back to
#: the spare buffers at once), and when the reaper wakes on its own, every ``_REAP_S`` seconds
#: while sends are waiting (so a failed send is recorded within that). Waking the reaper for
#: every send cost a 4-byte ping-pong 82 of its 228 us one way (2 ranks on 2 cores, 4000
#: iterations in 20 interleaved rounds).
_REAP_SENDS: Final = 64
_REAP_BYTES: Final = 16 << 20
_REAP_S: Final = 0.05

#: The default bound on bytes copied by sends whose receiver has not taken them yet
#: (``options={"gloo": {"max_buffered_send_bytes": N}}``): past it, a send waits for earlier ones.
MAX_BUFFERED_SEND_BYTES: Final = 256 << 20

#: A send in flight: Gloo's work, the buffer it sends, destination, deadline, and the spare
#: buffer that one is part of (or None).
Sent = tuple[Any, torch.Tensor, int, float, "torch.Tensor | None"]


class Messages:
    """Point to point over Gloo (see the module docstring); the backend holds the state."""

    ctx: BackendContext
    _lock: threading.Lock
    _buffered: int
    _buffered_cond: threading.Condition
    _budget: int
    _unreaped: list[Sent]
    _unreaped_bytes: int
    _sends: queue.SimpleQueue[list[Sent] | None]
    _spares: SpareBuffers
    _reaper: threading.Thread | None
    _send_errors: dict[int, BaseException]
    _watch: PeerWatch

    if TYPE_CHECKING:

        @property
        def c10d(self) -> Any: ...

        def _ready(self, what: str, peers: Sequence[int] = (), *, receiving: bool = False) -> Any: ...

        def _alarm(
            self, what: str, peers: Sequence[int], *, kinds: frozenset[str] = ..., patience: float = ...
        ) -> None: ...

        def _error(self, exc: BaseException, what: str, timeout: float, peers: Sequence[int] = ()) -> BaseException: ...

        def _wait(
            self,
            post: Callable[[], Any],
            what: str,
            timeout: float,
            peers: Sequence[int] = (),
            *,
            bounded: bool = False,
            async_op: bool = False,
        ) -> Work | None: ...

    # -- point to point: header and payload in one Gloo message (a large payload after it), on the caller's tag --
    def send(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> None:
        code = dtype_code(tensor.dtype)
        assert code is not None  # the core passes declared dtypes only
        nbytes = tensor.numel() * tensor.element_size()
        self._room(nbytes, dst, timeout, "send")
        if nbytes <= _INLINE:  # (cpu: the only device pg-gloo declares point to point for)
            self._post(_message(nbytes, code, tensor_bytes(tensor)), None, dst, tag, timeout=timeout, what="send")
        else:
            spare = self._spares.take(nbytes)
            payload = spare[:nbytes]
            payload.copy_(flat_bytes(tensor))
            self._post(_message(nbytes, code), payload, dst, tag, timeout=timeout, what="send", spare=spare)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> Work:
        """The message is Gloo's (in a buffer of its own) when this returns: the work is done."""
        self.send(tensor, dst, tag, timeout=timeout)
        return Work.completed("isend")

    def send_bytes(self, data: Any, dst: int, tag: int, *, timeout: float) -> None:
        views = [memoryview(p).cast("B") for p in data]  # the message's parts (API >= 1.1)
        nbytes = sum(v.nbytes for v in views)
        self._room(nbytes, dst, timeout, "send_bytes")
        inline = nbytes <= _INLINE
        first = torch.empty(_HEAD + nbytes if inline else _HEAD, dtype=torch.uint8)
        _HEADER.pack_into(tensor_bytes(first), 0, nbytes, _BYTES)
        spare = None if inline else self._spares.take(nbytes)
        payload = None if spare is None else spare[:nbytes]
        target, offset = (tensor_bytes(first), _HEAD) if payload is None else (tensor_bytes(payload), 0)
        for view in views:
            target[offset : offset + view.nbytes] = view
            offset += view.nbytes
        self._post(first, payload, dst, tag, timeout=timeout, what="send_bytes", spare=spare)

    def _room(self, nbytes: int, dst: int, timeout: float, what: str) -> None:
        """Wait until a copy of ``nbytes`` more fits in the budget of buffered sends (alone, any
        size fits), handing the sends gathered so far to the reaper first, so that it frees them
        as their receivers take them. Interruptible as every wait; bounded by ``timeout``."""
        with self._lock:
            if self._buffered == 0 or self._buffered + nbytes <= self._budget:
                return
            batch = self._take_unreaped()
        if batch:
            self._sends.put(batch)
        deadline = time.monotonic() + timeout
        with self._buffered_cond:
            while self._buffered and self._buffered + nbytes > self._budget:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CollectiveTimeout(
                        f"{what} to rank {dst}: {self._buffered} bytes of earlier sends were not taken by their "
                        f"receivers within {timeout:g} s (max_buffered_send_bytes={self._budget})",
                        op=what,
                        peers=[dst],
                    )
                self._buffered_cond.wait(min(left, SLICE_S))
                self._alarm(what, [dst])

    def _post(
        self,
        first: torch.Tensor,
        payload: torch.Tensor | None,
        dst: int,
        tag: int,
        *,
        timeout: float,
        what: str,
        spare: torch.Tensor | None = None,
    ) -> None:
        """Gloo's sends of a message (``payload`` a slice of ``spare`` where given, which goes
        back to the spare buffers once Gloo is done with it)."""
        self._watch.check(dst)  # a peer that died a moment ago: raise now, not lose the message
        pg = self._ready(what, [dst])
        deadline = time.monotonic() + timeout
        try:
            works = [(pg.send([first], dst, tag), (first,))]
            if payload is not None:
                works.append((pg.send([payload], dst, tag), (payload,)))
        except RuntimeError as exc:
            raise self._error(exc, what, timeout, [dst]) from exc
        batch = None
        with self._lock:
            if self._reaper is None:
                self._reaper = threading.Thread(
                    target=self._reap, name=f"pg-gloo-{self.ctx.group_name}-sends", daemon=True
                )
                self._reaper.start()
            for work, buffer in works:
                self._unreaped.append((work, buffer[0], dst, deadline, spare if buffer[0] is payload else None))
                self._unreaped_bytes += buffer[0].numel()
                self._buffered += buffer[0].numel()
            if payload is not None or len(self._unreaped) >= _REAP_SENDS or self._unreaped_bytes >= _REAP_BYTES:
                batch = self._take_unreaped()
        if batch:
            self._sends.put(batch)

    def _take_unreaped(self) -> list[Sent]:
        """The sends gathered so far, for the reaper (the caller holds ``_lock``)."""
        batch, self._unreaped, self._unreaped_bytes = self._unreaped, [], 0
        return batch

    def _reap(self) -> None:
        """Wait for Gloo's sends in order, batch by batch, and drop their buffers; a failure
        is recorded for the destination's next operation. (A thread must: torch's Gloo send work
        tells it is complete only from inside ``wait()``, so nothing could poll it.) Every
        ``_REAP_S`` seconds that sends are waiting in ``_unreaped``, it takes them itself."""
        while True:
            try:
                batch = self._sends.get(timeout=_REAP_S if self._unreaped else 1.0)
            except queue.Empty:
                with self._lock:
                    batch = self._take_unreaped()
            if batch is None:
                return
            while batch:
                self._reaped(batch.pop(0))
            del batch

    def _reaped(self, sent: Sent) -> None:
        """Wait for one send (to its deadline); give its spare buffer back, or record its failure."""
        work, buffer, dst, deadline, spare = sent
        try:
            work.wait(timeout_delta(max(deadline - time.monotonic(), 0.001)))
        except RuntimeError as exc:
            self._send_errors.setdefault(dst, self._error(exc, f"send to rank {dst}", 0.0, [dst]))
        else:
            if spare is not None:
                self._spares.give(spare)
        with self._buffered_cond:
            self._buffered -= buffer.numel()
            self._buffered_cond.notify_all()

    def recv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        nbytes, code, first, view = self._first(src, tag, timeout, "recv")
        want = tensor.numel() * tensor.element_size()
        if nbytes != want or code != dtype_code(tensor.dtype):
            self._spares.give(first)
            self._discard(nbytes, src, tag, deadline, "recv")
            sent = "a send_bytes message" if code == _BYTES else _describe(nbytes, code)
            raise CollectiveMismatchError(
                f"recv from rank {src} (tag {tag}): the message is {sent}, the receiving tensor "
                f"{_describe(want, dtype_code(tensor.dtype))}",
                peers=[src],
            )
        if nbytes <= _INLINE:
            tensor_bytes(tensor)[:] = view[_HEAD : _HEAD + nbytes]
            self._spares.give(first)  # (view, of its memory, is used up)
            return
        self._spares.give(first)
        pg = self.c10d
        self._wait(
            lambda: pg.recv([flat_bytes(tensor)], src, tag),
            "recv",
            deadline - time.monotonic(),
            [src],
            bounded=True,
        )

    def recv_bytes(self, src: int, tag: int, *, timeout: float) -> bytearray:
        deadline = time.monotonic() + timeout
        nbytes, code, first, view = self._first(src, tag, timeout, "recv_bytes")
        if code != _BYTES:
            self._spares.give(first)
            self._discard(nbytes, src, tag, deadline, "recv_bytes")
            raise CollectiveMismatchError(
                f"recv_bytes from rank {src} (tag {tag}): the message is {_describe(nbytes, code)} sent with send, "
                "not send_bytes",
                peers=[src],
            )
        if nbytes <= _INLINE:
            message = bytearray(view[_HEAD : _HEAD + nbytes])
            self._spares.give(first)  # (view, of its memory, is used up)
            return message
        self._spares.give(first)
        buffer = bytearray(nbytes)
        pg = self.c10d
        target = torch.frombuffer(buffer, dtype=torch.uint8)
        self._wait(lambda: pg.recv([target], src, tag), "recv_bytes", deadline - time.monotonic(), [src], bounded=True)
        return buffer

    def _first(self, src: int, tag: int, timeout: float, what: str) -> tuple[int, int, torch.Tensor, memoryview]:
        """The next message's first Gloo message from ``src`` on ``tag``: the payload's size,
        its dtype code, the buffer it arrived in (a spare one: give it back once ``view`` is used
        up) and a view of that buffer's bytes (which does not keep it alive). If the receive
        fails, the buffer is not kept (Gloo may still write to it)."""
        pg = self._ready(what, [src], receiving=True)
        first = self._spares.take(_HEAD + _INLINE)
        head = first if first.numel() == _HEAD + _INLINE else first[: _HEAD + _INLINE]
        self._wait(lambda: pg.recv([head], src, tag), what, timeout, [src], bounded=True)
        view = tensor_bytes(first)
        nbytes, code = _HEADER.unpack_from(view)
        return nbytes, code, first, view

    def _discard(self, nbytes: int, src: int, tag: int, deadline: float, what: str) -> None:
        """Receive a refused message's payload, so the next receive on its stream reads the next message."""
        if nbytes > _INLINE:
            scratch = torch.empty(nbytes, dtype=torch.uint8)
            self._wait(
                lambda: self.c10d.recv([scratch], src, tag), what, deadline - time.monotonic(), [src], bounded=True
            )


def _describe(nbytes: int, code: int | None) -> str:
    dtype = dtype_from_code(code) if code is not None and code > 0 else None
    if dtype is None:
        return f"{nbytes} bytes"
    size = torch.empty((), dtype=dtype).element_size()
    return f"{nbytes // size} x {dtype_name(dtype)} ({nbytes} bytes)"


def _message(nbytes: int, code: int, payload: memoryview | None = None) -> torch.Tensor:
    """A message's first Gloo message: the header, then ``payload`` if given (it fits)."""
    first = torch.empty(_HEAD + (0 if payload is None else nbytes), dtype=torch.uint8)
    view = tensor_bytes(first)
    _HEADER.pack_into(view, 0, nbytes, code)
    if payload is not None:
        view[_HEAD:] = payload
    return first
