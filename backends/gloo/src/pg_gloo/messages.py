"""``Messages``: pg-gloo's point to point, a layer of :class:`~pg_gloo.backend.GlooBackend`.

Gloo's ``send`` completes only once the receiver has posted its receive (at every size: a
4-byte send waits for it too), and a receive whose buffer is smaller than the message aborts
the whole process (``op.preamble.length <= op.nbytes``); a larger buffer takes the message
and leaves the rest unwritten. So every pg-gloo message starts with a 16-byte header (size,
dtype), and every receive's first Gloo receive has room for the largest first message there
is, ``_FIRST`` bytes; it reads the header before anything reaches the caller's tensor.

* **At most** :data:`~pg_gloo.plugin.EAGER_LIMIT_BYTES` **(the declared eager limit)**: one Gloo
  message of the header and a copy of the payload. ``send`` (and ``isend``, whose work is then
  done) returns at once; one reaper thread per backend waits for Gloo's sends in order and
  drops their buffers (within ``max_buffered_send_bytes`` of copies not yet received). The
  receiver copies the payload out of its first buffer.
* **Above it**: a header-only Gloo message, then the payload as a second one, sent straight
  from the caller's tensor and received straight into the receiver's: no copy on either side.
  ``send`` waits until Gloo has sent it (the receiver has posted its receive: the contract's
  API 1.10); ``isend`` returns a work that completes then, and the caller leaves the tensor
  alone until it does. The receiver posts the payload's receive once the header said the
  size and dtype are the tensor's, so a mismatch never reaches Gloo's abort: the receive
  fails with :class:`~pg_core.errors.CollectiveMismatchError`, its tensor untouched, after
  draining the payload into scratch memory so that the stream stays in step.
* ``send_bytes`` copies at every size (the message's parts are joined into a buffer of its
  own, from :mod:`pg_core.buffers` above the limit) and never waits for its receiver.

**Receives, in the caller's thread.** A receive (``recv``, ``recv_bytes``, ``irecv``) posts its
first Gloo receive when it is called, unless an earlier receive of its (peer, tag) stream has
not read its header yet: Gloo matches one tag's messages to receives in posting order, and a
second first-receive posted early would take the earlier message's payload. It then waits
behind that one, in the stream's queue, and is posted the moment the earlier header is read.
A waiter thread (:class:`~pg_gloo.waiting.Waiters`) sits in Gloo's wait and, when it returns,
reads the header, posts the payload's receive (or copies the payload out) and posts the next
queued receive: the receive completes without anyone waiting on it, and a caller waits for
it in slices (:meth:`~pg_gloo.waiting.SlicedWaits._until`). The module ``pg_gloo.backend``'s
docstring says why, with the measurements in docs/decisions.md.
"""

from __future__ import annotations

import collections
import logging
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
from pg_core.errors import CollectiveMismatchError, CollectiveTimeout, GroupClosedError, PeerFailureError, PGError
from pg_core.work import Work

from .plugin import EAGER_LIMIT_BYTES
from .waiting import GRACE_S, SLICE_S, Ticket, Waiters
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
#: The largest payload that travels in the first Gloo message, right after the header (the
#: declared eager limit); a larger one is a second Gloo message.
_INLINE: Final = EAGER_LIMIT_BYTES
#: Every receive's first Gloo receive takes a buffer of this many bytes (a spare one: untouched
#: memory but for the bytes that arrive), since it is posted before the message is known.
_FIRST: Final = _HEAD + _INLINE

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

_log = logging.getLogger("pg_gloo")


class _Receive:
    """One receive: where its payload goes (``tensor``; ``None`` for ``recv_bytes``, whose
    ``result`` is a new buffer), and ``done``, set once it has ended (``done.error`` says how)."""

    __slots__ = ("deadline", "done", "result", "src", "tag", "tensor", "timeout", "what")

    def __init__(self, what: str, tensor: torch.Tensor | None, src: int, tag: int, timeout: float) -> None:
        self.what, self.tensor, self.src, self.tag, self.timeout = what, tensor, src, tag, timeout
        self.deadline = time.monotonic() + timeout
        self.done = Ticket()
        self.result: bytearray | None = None

    def refusal(self, nbytes: int, code: int) -> str | None:
        """Why the message (``nbytes`` of dtype ``code``) is not this receive's, or None."""
        tensor = self.tensor
        if tensor is None:
            if code == _BYTES:
                return None
            return (
                f"recv_bytes from rank {self.src} (tag {self.tag}): the message is {_describe(nbytes, code)} "
                "sent with send, not send_bytes"
            )
        want = tensor.numel() * tensor.element_size()
        if nbytes == want and code == dtype_code(tensor.dtype):
            return None
        sent = "a send_bytes message" if code == _BYTES else _describe(nbytes, code)
        return (
            f"recv from rank {self.src} (tag {self.tag}): the message is {sent}, the receiving tensor "
            f"{_describe(want, dtype_code(tensor.dtype))}"
        )

    def end(self, error: BaseException | None = None) -> None:
        self.done.error = error
        self.done.set()


class Messages:
    """Point to point over Gloo (see the module docstring); the backend holds the state."""

    ctx: BackendContext
    rank: int
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
    _aborted: bool
    _watch: PeerWatch
    _waiters: Waiters
    #: per (peer, tag): the receives whose first Gloo receive is not posted yet, behind the one
    #: (first in line) whose header has not arrived (see the module docstring)
    _streams: dict[tuple[int, int], collections.deque[_Receive]]
    #: sends above the eager limit whose payload Gloo has not sent yet (``shutdown`` drains them)
    _large: set[Ticket]

    if TYPE_CHECKING:

        @property
        def c10d(self) -> Any: ...

        def _ready(self, what: str, peers: Sequence[int] = (), *, receiving: bool = False) -> Any: ...

        def _alarm(
            self, what: str, peers: Sequence[int], *, kinds: frozenset[str] = ..., patience: float = ...
        ) -> None: ...

        def _error(self, exc: BaseException, what: str, timeout: float, peers: Sequence[int] = ()) -> BaseException: ...

        def _until(
            self,
            waited: Callable[[float], bool],
            what: str,
            timeout: float,
            peers: Sequence[int],
            *,
            ticket: Ticket | None = ...,
        ) -> None: ...

        def _cut(self, why: str) -> None: ...

    # -- sending ------------------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes <= _INLINE:  # (cpu: the only device pg-gloo declares point to point for)
            self._send_eager(tensor, nbytes, dst, tag, timeout)
            return
        sent = self._send_large(tensor, nbytes, dst, tag, timeout=timeout, what="send")
        self._until(sent.wait, "send", timeout, [dst], ticket=sent)
        if sent.error is not None:
            raise sent.error

    def isend(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> Work:
        """At most the eager limit, the message is Gloo's (in a buffer of its own) when this
        returns: the work is done. Above it, Gloo sends from ``tensor`` itself, and the work
        completes once it has (the caller leaves ``tensor`` alone until then)."""
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes <= _INLINE:
            self._send_eager(tensor, nbytes, dst, tag, timeout)
            return Work.completed("isend")
        return self._ended_work(
            self._send_large(tensor, nbytes, dst, tag, timeout=timeout, what="isend"), "isend", timeout, dst
        )

    def _send_eager(self, tensor: torch.Tensor, nbytes: int, dst: int, tag: int, timeout: float) -> None:
        code = dtype_code(tensor.dtype)
        assert code is not None  # the core passes declared dtypes only
        self._room(nbytes, dst, timeout, "send")
        self._post(_message(nbytes, code, tensor_bytes(tensor)), None, dst, tag, timeout=timeout, what="send")

    def _send_large(
        self, tensor: torch.Tensor, nbytes: int, dst: int, tag: int, *, timeout: float, what: str
    ) -> Ticket:
        """Post a message above the eager limit: its header (eager, to the reaper), then Gloo's
        send of the payload from ``tensor``'s memory. The ticket is set once Gloo has sent it
        (a waiter thread waits in Gloo), its ``error`` pg-core's."""
        code = dtype_code(tensor.dtype)
        assert code is not None
        self._post(_message(nbytes, code), None, dst, tag, timeout=timeout, what=what)
        pg = self._ready(what, [dst])
        try:
            work = pg.send([flat_bytes(tensor)], dst, tag)
        except RuntimeError as exc:
            raise self._error(exc, what, timeout, [dst]) from exc
        sent = Ticket()
        self._large.add(sent)

        def ended(error: BaseException | None) -> None:
            sent.ending = error is not None  # (before the error is worked out: see Ticket)
            sent.error = None if error is None else self._error(error, f"{what} to rank {dst}", timeout, [dst])
            self._large.discard(sent)
            sent.set()

        self._waiters.start(work, timeout_delta(timeout), then=ended)
        return sent

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

    # -- receiving ----------------------------------------------------------------------------
    def recv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> None:
        received = self._receive("recv", tensor, src, tag, timeout)
        self._until(received.done.wait, "recv", timeout, [src], ticket=received.done)
        if received.done.error is not None:
            raise received.done.error

    def irecv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> Work:
        """Posted now, in the stream's order (see the module docstring); the work completes when
        the message is in ``tensor``, whether or not anyone waits on it."""
        return self._ended_work(self._receive("irecv", tensor, src, tag, timeout).done, "irecv", timeout, src)

    def recv_bytes(self, src: int, tag: int, *, timeout: float) -> bytearray:
        received = self._receive("recv_bytes", None, src, tag, timeout)
        self._until(received.done.wait, "recv_bytes", timeout, [src], ticket=received.done)
        if received.done.error is not None:
            raise received.done.error
        assert received.result is not None
        return received.result

    def _receive(self, what: str, tensor: torch.Tensor | None, src: int, tag: int, timeout: float) -> _Receive:
        """A receive, in line on its stream: its first Gloo receive posted now if nothing is
        ahead of it, else once the receive ahead has read its header."""
        self._ready(what, [src], receiving=True)
        receive = _Receive(what, tensor, src, tag, timeout)
        key = (src, tag)
        with self._lock:
            line = self._streams.get(key)
            if line is None:
                line = self._streams[key] = collections.deque()
            line.append(receive)
            first = len(line) == 1
        if first:
            self._post_first(receive)
        return receive

    def _post_first(self, receive: _Receive) -> None:
        """Post ``receive``'s first Gloo receive; a waiter thread reads its header (:meth:`_headed`)."""
        first = self._spares.take(_FIRST)
        try:
            pg = self.c10d
            work = pg.recv([first if first.numel() == _FIRST else first[:_FIRST]], receive.src, receive.tag)
        except (RuntimeError, PeerFailureError) as exc:  # (the second: closed by an abort meanwhile)
            self._spares.give(first)
            receive.end(self._refused(exc, receive))
            self._next(receive)
            return
        self._waiters.start(
            work,
            timeout_delta(max(receive.deadline - time.monotonic(), 0.001)),
            then=lambda error: self._headed(receive, first, error),
        )

    def _refused(self, exc: BaseException, receive: _Receive) -> BaseException:
        if self._aborted:
            return GroupClosedError(f"{receive.what}: backend 'gloo' of group {self.ctx.group_name!r} was aborted")
        return self._error(exc, receive.what, receive.timeout, [receive.src])

    def _headed(self, receive: _Receive, first: torch.Tensor, error: BaseException | None) -> None:
        """(A waiter thread, once the first Gloo receive ended.) Take the message, post its
        payload's receive, or refuse it; post the next receive of the stream; then, last, end the
        receive (its caller wakes to a thread about to let go of the GIL: :class:`Waiters`), so
        that a caller's next receive on the stream finds nothing ahead of it and posts at once."""
        ended: BaseException | None = None
        try:
            if error is not None:  # the buffer is not kept: Gloo may still write to it
                receive.done.ending = True  # (before the error is worked out: see Ticket)
                ended = self._refused(error, receive)
            else:
                view = tensor_bytes(first)
                nbytes, code = _HEADER.unpack_from(view)
                refusal = receive.refusal(nbytes, code)
                if nbytes > _INLINE:
                    self._spares.give(first)
                    self._post_payload(receive, nbytes, refusal)
                    return
                if refusal is None:
                    if receive.tensor is None:
                        receive.result = bytearray(view[_HEAD : _HEAD + nbytes])
                    else:
                        tensor_bytes(receive.tensor)[:] = view[_HEAD : _HEAD + nbytes]
                else:
                    ended = CollectiveMismatchError(refusal, peers=[receive.src])
                self._spares.give(first)  # (view, of its memory, is used up)
        except BaseException as exc:
            ended = exc
        finally:
            self._next(receive)
        receive.end(ended)  # last: the caller wakes to a thread about to let go of the GIL

    def _post_payload(self, receive: _Receive, nbytes: int, refusal: str | None) -> None:
        """Post the receive of a payload above the eager limit: straight into the tensor, into a
        new buffer (``recv_bytes``), or into scratch memory when the message is refused."""
        if refusal is not None:
            target = torch.empty(nbytes, dtype=torch.uint8)
        elif receive.tensor is None:
            receive.result = bytearray(nbytes)
            target = torch.frombuffer(receive.result, dtype=torch.uint8)
        else:
            target = flat_bytes(receive.tensor)
        try:
            work = self.c10d.recv([target], receive.src, receive.tag)
        except (RuntimeError, PeerFailureError) as exc:
            receive.end(self._refused(exc, receive))
            return

        def landed(error: BaseException | None, memory: torch.Tensor = target) -> None:
            del memory  # (kept alive until Gloo is done with it)
            if error is not None:
                receive.done.ending = True
                receive.end(self._refused(error, receive))
            elif refusal is not None:
                receive.end(CollectiveMismatchError(refusal, peers=[receive.src]))
            else:
                receive.end()

        self._waiters.start(work, timeout_delta(max(receive.deadline - time.monotonic(), 0.001)), then=landed)

    def _next(self, receive: _Receive) -> None:
        """``receive`` has read its header (or failed): post the next receive of its stream."""
        key = (receive.src, receive.tag)
        with self._lock:
            line = self._streams.get(key)
            if not line or line[0] is not receive:
                return
            line.popleft()
            if not line:
                del self._streams[key]
                return
            following = line[0]
        self._post_first(following)

    # -- works -------------------------------------------------------------------------------
    def _ended_work(self, ended: Ticket, what: str, timeout: float, peer: int) -> Work:
        """A work that completes as ``ended`` does (with its ``error``), driven by whoever waits:
        each slice waits for ``ended``, and between slices it looks for an abort, ``peer`` gone
        and the deadline, as a blocking call does. Polling never blocks."""
        deadline = time.monotonic() + timeout + GRACE_S

        def drive(work: Work, budget: float) -> None:
            if not ended.wait(min(budget, SLICE_S) if budget > 0 else 0.0):
                if budget <= 0:
                    return
                try:
                    self._alarm(what, [peer])
                    if time.monotonic() > deadline:
                        raise CollectiveTimeout(f"{what}: not done after {timeout:g} s", op=what, peers=[peer])
                except PGError as stopped:
                    if not ended.settled():  # else its own end (its timeout broke the group, say) says it
                        work.set_exception(self._stopped(stopped, what, peer, timeout))
                        return
                else:
                    return
            if ended.error is not None:
                work.set_exception(ended.error)
            else:
                work.set_result(None)

        return Work(what, driver=drive)

    def _stopped(self, exc: PGError, what: str, peer: int, timeout: float) -> PGError:
        """What stops a work of :meth:`_ended_work` (an alarm, or its deadline passed), once Gloo's
        connections are closed where Gloo may still write into its tensor: a peer it needs is alive."""
        if isinstance(exc, PeerFailureError):
            if set(exc.peers) != {peer}:  # the peer is alive, and Gloo may still write
                self._cut(f"{what} failed: {exc}")
        elif isinstance(exc, CollectiveTimeout):  # Gloo's own timeout did not fire: stop it writing
            self._cut(f"{what} did not end within {timeout:g} s")
        return exc

    def _drain_large(self, bound: float) -> None:
        """Wait (at most ``bound`` seconds) for the sends above the eager limit still in flight."""
        deadline = time.monotonic() + bound
        for sent in list(self._large):
            if not sent.wait(max(deadline - time.monotonic(), 0.0)):
                return


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
