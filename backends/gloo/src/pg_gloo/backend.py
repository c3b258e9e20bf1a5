"""``GlooBackend``: a group's operations on one ``torch.distributed.ProcessGroupGloo``.

The Gloo object is built from the group's own prefixed store, with the group's rank and
size: no ``init_process_group``, no default group, nothing global. What the wrapper adds
is what Gloo lacks for pg-core's contract, each found by testing Gloo itself:

* **Collectives are Gloo's own** (:class:`pg_core.c10d.C10dBackend`), each with the call's
  timeout in its options: a blocking one waited for in the calling thread, an asynchronous
  one launched there, Gloo's work becoming the user's (no thread per operation). A dtype Gloo
  cannot move (``int16``, complex, in the copying collectives) travels as its bytes, which is
  exact.
* **Waits that can be interrupted** (:mod:`pg_gloo.waiting`). Nothing wakes a thread waiting
  in Gloo but the operation's end or Gloo's timeout, so no caller waits there for longer than
  ``_SLICE_S``: a collective's work is waited for in slices of torch's ``Work.wait(timeout)``
  (an expired slice leaves a collective as it was), a receive by a waiter thread (a receive's
  expired wait closes every connection). Between slices a wait raises for ``abort()``
  (:class:`~pg_core.errors.GroupClosedError`), a peer gone, its deadline; Ctrl-C arrives with
  the slice's end. A wait that stops early closes Gloo's connections first (unless every peer
  it needs is gone), so a tensor is never written after its operation failed.
* **Who left, and how** (:mod:`pg_gloo.watch`): one idle connection to every peer, on which a
  rank says ``aborted`` or ``shut down`` as it goes; one that ends without a word is a rank
  that died. Errors name the group rank from it (Gloo's name a socket address), and a send
  looks at it first, so a send to a rank that died a moment ago raises instead of being lost.
* **Point to point.** Gloo's ``send`` completes only once the receiver has posted its
  receive, and a receive whose buffer is smaller than the message aborts the whole
  process (``op.preamble.length <= op.nbytes``); a larger buffer takes the message and
  leaves the rest unwritten. So a message is one Gloo message of a 16-byte header (size,
  dtype) followed by the payload, when the payload is at most ``_INLINE`` (4 MiB); the
  receiver posts a buffer with room for the largest such message, reads the header, and
  copies the payload out. A larger payload follows a header-only message as a second Gloo
  message, received straight into the tensor. The receiver refuses a message of the wrong
  size or dtype with :class:`~pg_core.errors.CollectiveMismatchError` (after draining it,
  so the stream stays in step). ``send`` copies the tensor into a buffer of the message's
  own (above 4 MiB, one a finished send left: :mod:`pg_core.buffers`) and returns at once
  (the contract's "send never waits for its receiver"); one reaper thread per backend waits
  for Gloo's sends in order and releases their buffers (torch's Gloo send work says it is
  complete only from inside ``wait()``, so a thread must wait); the sends reach it in
  batches (``_REAP_SENDS``), not with a wake-up each. The copies waiting for their receivers
  are bounded (``max_buffered_send_bytes``, default 256 MiB): past it, a send (or ``isend``)
  waits for earlier ones to be received. Gloo itself would send from the caller's tensor, but
  only when the receiver is there: the copy is what lets ``send`` return at once.
* **Coalescing** (``group.coalescing()``, API 1.3): Gloo has none (torch's ``ProcessGroupGloo``
  says ``supports_coalescing`` is False and raises on ``_start_coalescing``), so pg-gloo does
  not claim it and the core runs a batch one call after another, in order.
* **Errors are pg-core's.** Gloo's timeout becomes
  :class:`~pg_core.errors.CollectiveTimeout`; a closed or reset connection,
  :class:`~pg_core.errors.PeerFailureError` naming the rank (from the watch). Gloo closes its
  connections on a timeout (both sides see it), so after one this backend refuses everything
  at once with a ``PeerFailureError`` that says so: form a new group.
* **Abort** closes Gloo's connections, then every wait raises. Gloo's own threads stay in the
  operations they ran until those reach Gloo's timeout (nothing else wakes them), and the
  Gloo object's destructor joins them: it is let go in a thread of its own, so ``abort()``
  returns at once.
"""

from __future__ import annotations

import queue
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch
from pg_core.backend import BackendContext, tensor_bytes
from pg_core.buffers import SpareBuffers
from pg_core.c10d import C10dBackend, first_line, flat_bytes, timeout_delta
from pg_core.dtypes import dtype_code, dtype_from_code, dtype_name
from pg_core.errors import CollectiveMismatchError, CollectiveTimeout, GroupClosedError, PeerFailureError
from pg_core.ops import ReduceOp
from pg_core.store import advertise_address
from pg_core.work import Work, then
from torch.distributed import ProcessGroupGloo

from .waiting import Waiters
from .watch import DIED, PeerWatch

__all__ = ["GlooBackend"]

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

#: How often a wait looks up from its event for an abort, a peer gone or its deadline; and
#: how long past the operation's timeout it still waits for Gloo's own timeout to fire first.
_SLICE_S: Final = 0.1
_SLICE: Final = timeout_delta(_SLICE_S)
#: what torch says when a wait with a timeout expires before a collective's work is done
_SLICE_EXPIRED: Final = "Operation timed out!"
_GRACE_S: Final = 2.0

#: The default bound on bytes copied by sends whose receiver has not taken them yet
#: (``options={"gloo": {"max_buffered_send_bytes": N}}``): past it, a send waits for earlier ones.
MAX_BUFFERED_SEND_BYTES: Final = 256 << 20

#: Gloo's words for a connection that is gone (its pair.cc messages).
_PEER_GONE: Final = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Read error",
    "Write error",
    "Broken pipe",
    "Connection refused",
    "Socket closed",
)


#: A send in flight: Gloo's work, the buffer it sends, destination, deadline, and the spare
#: buffer that one is part of (or None).
_Sent = tuple[Any, torch.Tensor, int, float, "torch.Tensor | None"]


class GlooBackend(C10dBackend):
    """One ``ProcessGroupGloo`` per group formation and device type."""

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        #: why this backend cannot communicate any more (Gloo closed its connections), or None
        self._broken: str | None = None
        #: Gloo's sends in flight, in posting order, each with its buffer (Gloo needs it until the
        #: receiver has the message), destination, deadline and the spare buffer it is part of, if
        #: any: gathered in ``_unreaped`` (under ``_lock``), handed to the reaper thread in batches
        #: (see ``_REAP_SENDS``), which waits for them in order
        self._unreaped: list[_Sent] = []
        self._unreaped_bytes = 0
        self._sends: queue.SimpleQueue[list[_Sent] | None] = queue.SimpleQueue()
        #: buffers of finished messages, for the next ones: large sends' payloads and receives'
        #: first buffers (a fresh tensor of megabytes costs its page faults: pg_core.buffers)
        self._spares = SpareBuffers()
        self._reaper: threading.Thread | None = None
        self._lock = threading.Lock()
        #: held while Gloo's connections are being closed (abort, or a failed wait that cuts them)
        self._closing = threading.Lock()
        #: a send the reaper saw fail, per destination: raised by that peer's next operation
        self._send_errors: dict[int, BaseException] = {}
        #: set once ``abort()`` has closed Gloo's connections: blocked operations raise
        self._aborted = False
        #: bytes of sends copied and not yet taken by their receivers, bounded by ``_budget``
        self._buffered = 0
        self._buffered_cond = threading.Condition(self._lock)
        self._budget = _budget(ctx.options.get("max_buffered_send_bytes", MAX_BUFFERED_SEND_BYTES))
        self._everyone = tuple(r for r in range(ctx.size) if r != ctx.rank)
        self._waiters = Waiters(ctx.group_name)
        options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        host = str(ctx.options.get("addr") or advertise_address(ctx.store))
        options._devices = [ProcessGroupGloo.create_device(hostname=host)]  # Gloo listens on this address only
        options._timeout = timeout_delta(ctx.timeout)
        options._threads = int(ctx.options.get("threads", 2))
        self._watch = PeerWatch(
            ctx.store,
            ctx.rank,
            ctx.size,
            host,
            ctx.timeout,
            name=ctx.group_name,
            uid=ctx.group_uid,
            auth_key=ctx.auth_key,
        )
        try:
            self._pg = ProcessGroupGloo(self.rendezvous("Gloo connect"), ctx.rank, ctx.size, options)
        except RuntimeError as exc:
            self._watch.close(b"A")
            raise self._error(exc, "connect", ctx.timeout) from exc
        except BaseException:
            self._watch.close(b"A")
            raise

    # -- errors -------------------------------------------------------------------------
    def _ready(self, what: str, peers: Sequence[int] = ()) -> Any:
        """The Gloo object, or the error this backend's state calls for, before anything is sent
        (``peers``: whom the operation needs; a collective needs everyone)."""
        pg = self._pg
        if pg is not None and self._broken is None and not self._send_errors and not self._watch.gone:
            return pg  # the common case, first
        self._alarm(what, peers or self._everyone)
        for peer in peers:
            failed = self._send_errors.get(peer)
            if failed is not None:
                raise PeerFailureError(f"{what}: an earlier send to rank {peer} failed: {failed}", peers=[peer])
        return self.c10d

    def _alarm(self, what: str, peers: Sequence[int]) -> None:
        """Raise what stops an operation that needs ``peers``: this backend aborted or broken,
        or one of them gone (a peer that died, aborted or shut down)."""
        if self._aborted:
            raise GroupClosedError(
                f"{what}: backend 'gloo' of group {self.ctx.group_name!r} was aborted while the operation waited"
            )
        if self._broken is not None:
            raise PeerFailureError(
                f"{what}: backend 'gloo' of group {self.ctx.group_name!r} cannot communicate any more: {self._broken}. "
                "Gloo's connections are closed; form a new group (or shrink() this one)",
                peers=peers,
            )
        gone = self._watch.gone
        lost = [p for p in peers if p in gone]
        if lost:
            raise PeerFailureError(f"{what}: {_who(lost, gone)}", peers=_blamed(lost, gone))

    def _error(self, exc: BaseException, what: str, timeout: float, peers: Sequence[int] = ()) -> BaseException:
        """Gloo's ``RuntimeError`` as pg-core's error (anything unrecognised is returned as is)."""
        text = first_line(exc)
        if "Timed out" in text or "timed out" in text:
            self._broken = f"{what} timed out after {timeout:g} s"
            return CollectiveTimeout(
                f"{what}: Gloo gave up after {timeout:g} s ({text}); Gloo closes its connections on a timeout, "
                "so this group's gloo backend refuses every later operation: form a new group",
                op=what,
                peers=peers,
            )
        gone = self._watch.wait_gone(0.5) if any(words in text for words in _PEER_GONE) else {}
        lost = [p for p in (peers or self._everyone) if p in gone] or sorted(gone)
        if lost:  # the watch knows who, and how: Gloo's text names a socket address
            return PeerFailureError(f"{what}: {_who(lost, gone)} (Gloo: {text})", peers=_blamed(lost, gone))
        if "Application timeout caused pair closure" in text:
            self._broken = self._broken or "Gloo closed its connections after a timeout"
            return PeerFailureError(
                f"{what}: Gloo's connection was closed by an earlier timeout ({text}); form a new group", peers=peers
            )
        if any(words in text for words in _PEER_GONE):
            return PeerFailureError(f"{what}: a peer closed its Gloo connection ({text})", peers=peers)
        return exc

    # -- waiting: never inside Gloo, so that abort, a peer's death and Ctrl-C reach the caller (pg_gloo.waiting) --
    def _until(self, waited: Callable[[float], bool], what: str, timeout: float, peers: Sequence[int]) -> None:
        """Wait in slices (``waited(seconds)`` waits at most that long and says whether the
        operation is done), raising between them if this backend was aborted, a peer in ``peers``
        is gone, or ``timeout`` (plus Gloo's grace) has passed. Whatever stops the wait early
        (those, or ``KeyboardInterrupt``) leaves Gloo's operation posted: unless every peer it
        needs is gone, Gloo's connections are closed first, so nothing is written into the
        caller's tensors afterwards."""
        if waited(_SLICE_S):
            return
        deadline = time.monotonic() + timeout + _GRACE_S
        done = False
        try:
            while not (done := waited(_SLICE_S)):
                try:
                    self._alarm(what, peers)
                except PeerFailureError as exc:
                    if set(exc.peers) != set(peers):  # some peer it needs is alive, and may still write
                        self._cut(f"{what} failed: {exc}")
                    raise
                if time.monotonic() > deadline:
                    self._cut(f"{what} did not end within {timeout:g} s")
                    raise CollectiveTimeout(
                        f"{what}: not done after {timeout:g} s, and Gloo's own timeout did not fire; "
                        "its connections are closed: form a new group",
                        op=what,
                        peers=peers,
                    )
        except BaseException:
            if not done and not self._aborted:
                self._cut(f"{what} was interrupted in rank {self.rank}")  # KeyboardInterrupt, say
            raise

    def _cut(self, why: str) -> None:
        """Close Gloo's connections now (the operations in flight can then write nothing more)
        and refuse everything after, saying ``why``."""
        with self._closing:
            if self._broken is None:
                self._broken = why
            pg = self._pg
            if pg is not None:
                pg.abort()

    def _finish(self, work: Any, what: str, timeout: float, peers: Sequence[int]) -> None:
        """Wait for a collective's Gloo ``work`` (see :meth:`_until`), then raise its error as
        pg-core's. A collective's work can be waited for in slices in C++ (a wait that expires
        raises, and leaves the operation as it was), which costs nothing over one wait."""

        def waited(seconds: float) -> bool:
            try:
                work.wait(_SLICE if seconds == _SLICE_S else timeout_delta(seconds))
            except RuntimeError as exc:
                if work.is_completed() or str(exc) != _SLICE_EXPIRED:
                    raise self._error(exc, what, timeout, peers) from exc
                return False
            return True

        self._until(waited, what, timeout, peers)

    def _received(self, work: Any, what: str, timeout: float, peers: Sequence[int]) -> None:
        """Wait for a point-to-point Gloo ``work``: a waiter thread waits in Gloo (a receive's
        wait cannot be sliced: one that expires closes every connection), the caller in slices."""
        ticket = self._waiters.start(work, timeout_delta(timeout))
        self._until(ticket.done.wait, what, timeout, peers)
        if ticket.error is not None:
            raise self._error(ticket.error, what, timeout, peers) from ticket.error

    def _wait(
        self,
        post: Callable[[], Any],
        what: str,
        timeout: float,
        peers: Sequence[int] = (),
        *,
        bounded: bool = False,
        async_op: bool = False,
    ) -> Work | None:
        """Post an operation and wait for it (``bounded``: point to point, whose peers are
        given); with ``async_op``, return a work for it instead."""
        try:
            work = post()
        except RuntimeError as exc:
            raise self._error(exc, what, timeout, peers) from exc
        if async_op:
            return self._launched(work, what, timeout, peers)
        if bounded:
            self._received(work, what, timeout, peers)
        else:
            self._finish(work, what, timeout, self._everyone)
        return None

    def _launched(self, torch_work: Any, what: str, timeout: float, peers: Sequence[int]) -> Work:
        """A collective's Gloo work as pg-core's, driven by whoever waits on it or polls it: each
        slice of a wait is Gloo's own (see :meth:`_finish`), and between slices it looks for an
        abort, a peer gone and the deadline, as a blocking call does."""
        deadline = time.monotonic() + timeout + _GRACE_S
        needs = peers or self._everyone

        def drive(work: Work, budget: float) -> None:
            try:
                if budget > 0:
                    torch_work.wait(_SLICE if budget >= _SLICE_S else timeout_delta(budget))
                elif not torch_work.is_completed():
                    return
                else:
                    torch_work.wait()
            except RuntimeError as exc:
                if torch_work.is_completed() or str(exc) != _SLICE_EXPIRED:
                    work.set_exception(self._error(exc, what, timeout, needs))
                    return
                try:
                    self._alarm(what, needs)
                    if time.monotonic() > deadline:
                        raise CollectiveTimeout(f"{what}: not done after {timeout:g} s", op=what, peers=needs)
                except (PeerFailureError, CollectiveTimeout) as failed:
                    self._cut(f"{what} failed: {failed}")
                    work.set_exception(failed)
                except GroupClosedError as closed:
                    work.set_exception(closed)
                return
            work.set_result(None)

        return Work(what, driver=drive)

    def prepared_all_reduce(
        self, dtype: torch.dtype, op: ReduceOp, *, timeout: float
    ) -> Callable[[torch.Tensor], None] | None:
        """The blocking all_reduce with its options built once, waited for as every other call."""
        if super().prepared_all_reduce(dtype, op, timeout=timeout) is None:
            return None
        opts = self._opts("allreduce", timeout, op=op)
        ready, error, finish, everyone = self._ready, self._error, self._finish, self._everyone

        def run(tensor: torch.Tensor) -> None:
            pg = ready("all_reduce")
            try:
                work = pg.allreduce([tensor], opts)
            except RuntimeError as exc:
                raise error(exc, "all_reduce", timeout) from exc
            try:
                work.wait(_SLICE)  # the first slice, inline: most calls end in it
                return
            except RuntimeError as exc:
                if work.is_completed() or str(exc) != _SLICE_EXPIRED:
                    raise error(exc, "all_reduce", timeout, everyone) from exc
            finish(work, "all_reduce", timeout, everyone)

        return run

    #: what Gloo's copying collectives refuse ("Invalid scalar type"): moved as bytes
    as_bytes = frozenset({torch.int16, torch.complex64, torch.complex128})

    #: a coalesced batch runs one call after another (the core's order): torch's Gloo cannot
    #: launch several as one (torch 2.13: ``supports_coalescing`` is False and
    #: ``_start_coalescing`` raises; pinned by ``test_gloo_has_no_coalescing``)
    coalesces = False

    # -- collectives: where Gloo differs ------------------------------------------------------
    def reduce(
        self, tensor: torch.Tensor, dst: int, op: ReduceOp, *, timeout: float, async_op: bool = False
    ) -> Work | None:
        # Gloo uses every rank's buffer as scratch: off the root, the input must not change
        return super().reduce(
            tensor if dst == self.rank else tensor.clone(), dst, op, timeout=timeout, async_op=async_op
        )

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: ReduceOp,
        *,
        timeout: float,
        async_op: bool = False,
    ) -> Work | None:
        return self._reduce_then_slice(output, torch.cat([t.reshape(-1) for t in input_list]), op, timeout, async_op)

    def reduce_scatter_tensor(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, *, timeout: float, async_op: bool = False
    ) -> Work | None:
        return self._reduce_then_slice(output, input.reshape(-1).clone(), op, timeout, async_op)

    def _reduce_then_slice(
        self, output: torch.Tensor, whole: torch.Tensor, op: ReduceOp, timeout: float, async_op: bool
    ) -> Work | None:
        """Gloo's reduce-scatter is an all-reduce of the whole input and a slice of it (what
        ``ProcessGroupGloo`` does itself), but its work has no future, so it could not complete an
        asynchronous call without a thread: the all-reduce is posted here instead, on a copy."""
        piece = output.numel()

        def copy_out() -> None:
            output.reshape(-1).copy_(whole[self.rank * piece : (self.rank + 1) * piece])

        work = super().all_reduce(whole, op, timeout=timeout, async_op=async_op)
        if work is None:
            copy_out()
            return None
        return then(work, copy_out)

    def all_to_all(
        self, output_list: list[torch.Tensor], input_list: list[torch.Tensor], *, timeout: float, async_op: bool = False
    ) -> Work | None:
        outs = [flat_bytes(t) for t in output_list]
        ins = [flat_bytes(t) for t in input_list]
        if len({t.numel() for t in outs} | {t.numel() for t in ins}) == 1:  # Gloo's alltoall: equal sizes only
            return super().all_to_all(outs, ins, timeout=timeout, async_op=async_op)
        # pieces of different sizes: one alltoall_base over the bytes, then the pieces copied out
        joined = torch.cat(ins) if ins else torch.empty(0, dtype=torch.uint8)
        received = torch.empty(sum(t.numel() for t in outs), dtype=torch.uint8)
        out_sizes, in_sizes = [t.numel() for t in outs], [t.numel() for t in ins]

        def copy_out() -> None:
            for out, piece in zip(outs, received.split(out_sizes), strict=True):
                out.copy_(piece)

        work = super().all_to_all_single(received, joined, out_sizes, in_sizes, timeout=timeout, async_op=async_op)
        if work is None:
            copy_out()
            return None
        return then(work, copy_out)

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
                self._buffered_cond.wait(min(left, _SLICE_S))
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

    def _take_unreaped(self) -> list[_Sent]:
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

    def _reaped(self, sent: _Sent) -> None:
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
        pg = self._ready(what, [src])
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

    # -- life ---------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._broken is not None:  # Gloo's connections are closed: nothing to drain
            self.abort(word=b"S")
            return
        self._stop_reaper(self.ctx.timeout + 1.0)  # the sends in flight first
        self._watch.close(b"S")
        self._waiters.close()
        super().shutdown()
        self._spares.clear()

    def abort(self, word: bytes = b"A") -> None:
        """Close Gloo's connections now, then make every wait raise: operations blocked in other
        threads get :class:`~pg_core.errors.GroupClosedError` within ``_SLICE_S``, and the peers
        are told (their errors say this rank aborted). Gloo's own threads still sit in the
        operations they were running until those reach Gloo's timeout (nothing else wakes them);
        the Gloo object is let go in a thread of its own, whose end waits for them."""
        with self._closing:
            pg, self._pg = self._pg, None
            if pg is not None:
                pg.abort()
            self._broken = self._broken or "the group was aborted"
            self._aborted = True
        self._watch.close(word)
        self._stop_reaper(0.0)
        self._waiters.close()
        with self._buffered_cond:
            self._buffered_cond.notify_all()
        self._spares.clear()
        if pg is not None:
            self._release(pg)

    @staticmethod
    def _release(pg: Any) -> None:
        """Let go of an aborted Gloo object without waiting: its destructor joins Gloo's threads,
        which end only once the operations they run reach Gloo's timeout."""
        holder = [pg]
        del pg
        threading.Thread(target=_let_go, args=(holder,), name="pg-gloo-release", daemon=True).start()

    def _stop_reaper(self, bound: float) -> None:
        with self._lock:
            reaper, self._reaper = self._reaper, None
            batch = self._take_unreaped()
        if reaper is not None:
            self._sends.put(batch)
            self._sends.put(None)
            if bound > 0:
                reaper.join(timeout=bound)


def _let_go(holder: list[Any]) -> None:
    time.sleep(0.01)  # let go of the GIL first (see pg_core.c10d._GIL_HANDOFF_S)
    holder.clear()


def _who(lost: Sequence[int], gone: dict[int, str]) -> str:
    """The peers gone, the dead first (a peer that aborted after a death is its consequence)."""
    return "; ".join(f"rank {p} {gone[p]}" for p in sorted(lost, key=lambda p: gone[p] != DIED))


def _blamed(lost: Sequence[int], gone: dict[int, str]) -> list[int]:
    """Whom an error names (its ``peers``, which ``shrink()`` leaves out): the peers that died,
    or if none did, those that aborted or shut down."""
    return [p for p in lost if gone[p] == DIED] or list(lost)


def _budget(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"pg-gloo option max_buffered_send_bytes={value!r}: give a non-negative number of bytes "
            f"(default {MAX_BUFFERED_SEND_BYTES}); sends past it wait until earlier ones are received"
        )
    return value


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
