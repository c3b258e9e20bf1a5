"""``ShmBackend``: the ranks of one host over shared memory.

Formation (:mod:`pg_shm.formation`) maps one segment per member and leaves nothing in
``/dev/shm``. Point to point runs over per-pair rings (:mod:`pg_shm.rings`); the hot
collectives over shared slots (:mod:`pg_shm.collectives`); every other collective is the
core's default (:mod:`pg_core.algorithms`) on point to point. Waits spin briefly and then
sleep on a futex in slices (:mod:`pg_shm.waiting`), checking the peers' processes, so a dead
peer is a ``PeerFailureError`` within a slice and oversubscribed ranks do not burn a core.

Threads: a *drainer* per member (asleep on a futex; it moves small messages out of a full
ring when their sender asks, so sends up to the eager limit never wait for their receiver,
within the ``max_unexpected_bytes`` budget; and it advances launched collectives that
nobody drives),
and a sender thread per peer, started the first time a message does not fit in the ring
at once. ``shutdown()`` and ``abort()`` wake and stop them.

Mappings: every user of the segments holds a reference while it may touch them (each
operation between entering and leaving the backend, the drainer and each sender thread for
their whole lives, and a close while it wakes and joins them); closing refuses new users, and
whoever drops the last reference after the close unmaps. So no thread reads or writes a
segment after it is unmapped, whatever the interleaving, and a thread that is slow to leave
keeps the mappings only until it does.
"""

from __future__ import annotations

import mmap
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from pg_core.backend import Backend, BackendContext
from pg_core.dtypes import dtype_code
from pg_core.errors import GroupClosedError
from pg_core.ops import RedOpType, ReduceOp
from pg_core.work import Work

from . import collectives
from .formation import form
from .layout import ABORTED, DOORBELL, KIND_BYTES, KIND_TENSOR, RING_META, SHUT_DOWN, STATE, Layout
from .receiving import Held, Inbox, Posted
from .rings import EAGER_LIMIT, RING_BYTES, Ring, parts_of
from .segment import Word, futex_wait, futex_wake
from .sending import Outbox
from .waiting import SLICE, Liveness

__all__ = ["ShmBackend"]

#: Bytes of each of a member's two collective slots (``slot_bytes`` option). 64 MiB all_reduce
#: at 2 ranks, load 7 on 2 cores (2026-11-27): 104 ms with 4 MiB slots (32 phases), 64 ms with
#: 16 MiB (8 phases), torch's Gloo 88 ms in the same processes. A member's segment is two slots
#: plus 1 MiB per peer: 35 MiB at 4 ranks.
DEFAULT_SLOT_BYTES = 16 << 20
#: Most bytes of messages a member's drainer holds for receives not posted yet (the
#: ``max_unexpected_bytes`` option, at least the eager limit), as pg-tcp's buffered sends are
#: bounded: past it a send to this member waits for a receive and fails at its timeout
#: saying so. Sends up to the eager limit never wait while it is not spent.
DEFAULT_MAX_UNEXPECTED = 256 << 20
#: How often the drainer advances launched collectives that nobody waits for, while there are
#: any (seconds): a waiter drives its own at once; this is for a rank busy elsewhere (a
#: blocking receive that needs the peer's collective to finish first), about 20 us each time.
UNATTENDED = 0.002
#: Longest a close waits for its own threads to leave (they do within a slice of its wake-ups).
JOIN_S = 2.0


class ShmBackend(Backend):
    """pg-shm's backend (see the module docstring and the README)."""

    def __init__(self, ctx: BackendContext) -> None:
        self.ctx = ctx
        self.rank, self.size = ctx.rank, ctx.size
        slot = ctx.byte_option("slot_bytes", DEFAULT_SLOT_BYTES, minimum=4096)
        held = Held(ctx.byte_option("max_unexpected_bytes", DEFAULT_MAX_UNEXPECTED, minimum=EAGER_LIMIT))
        self.layout = Layout(ctx.size, RING_BYTES, slot // 64 * 64)
        self._members = form(ctx, self.layout)
        self._life = threading.Lock()  # the close and the release: one of each
        #: references to the mappings, one entry each (see the module docstring and _enter)
        self._users: list[None] = []
        self._released = False
        segments = self._members.segments
        name = ctx.group_name
        states = [None if r == self.rank else Word(s.address + STATE, 32) for r, s in enumerate(segments)]
        self.live = Liveness(name, self._members.pids, self._members.pidfds, states)
        self._state = Word(segments[self.rank].address + STATE, 32)
        self._doorbell = Word(segments[self.rank].address + DOORBELL, 32)
        self.outboxes: dict[int, Outbox] = {}
        self.inboxes: dict[int, Inbox] = {}
        for peer in range(self.size):
            if peer == self.rank:
                continue
            mine = Ring(segments[self.rank], self.layout.ring(self.rank, peer), RING_META, RING_BYTES)
            theirs = Ring(segments[peer], self.layout.ring(peer, self.rank), RING_META, RING_BYTES)
            peer_bell = Word(segments[peer].address + DOORBELL, 32)
            self.outboxes[peer] = Outbox(mine, peer, self.live, peer_bell, name, hold=self._hold, leave=self._leave)
            self.inboxes[peer] = Inbox(theirs, peer, self.live, name, held)
        self.shared = collectives.Shared(
            self.rank, self.size, segments, self.layout, self.live, enter=self._enter, leave=self._leave
        )
        self._small_launches: dict[tuple[torch.dtype, RedOpType], Callable[[torch.Tensor, float], Work | None]] = {}
        self._drainer: threading.Thread | None = None
        if self.size > 1:
            self._drainer = threading.Thread(target=self._drain, name=f"pg-shm {name} drainer", daemon=True)
            self._users.append(None)  # the drainer's reference, dropped as it leaves
            try:
                self._drainer.start()
            except BaseException:
                self._users.pop()
                raise

    # -- point to point ----------------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> None:
        self._enter()
        try:
            work = self.outboxes[dst].post_tensor(tensor, tag, timeout, "send")
        finally:
            self._leave()
        if work is not None:
            self._await(work, timeout)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> Work:
        self._enter()
        try:
            work = self.outboxes[dst].post_tensor(tensor, tag, timeout, "isend")
        finally:
            self._leave()
        return Work.completed("isend") if work is None else work

    def recv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> None:
        self._enter()
        try:
            self.inboxes[src].receive_tensor(tensor, tag, timeout, "recv")
        finally:
            self._leave()

    def irecv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> Work:
        """Post a receive in ``src``'s inbox (:meth:`pg_shm.receiving.Inbox.post`), in this
        thread: behind the receives posted on that peer before it, taking what is there now.
        Its work completes when waited for or polled, when a later receive from ``src`` runs,
        or, with nobody doing that, by the drainer (which also fails it at its deadline or when
        ``src`` is gone); ``abort()``/``shutdown()`` fail it at once. A message that is there
        already, in the common case (:meth:`~pg_shm.receiving.Inbox.take_tensor`), is received
        at once: the work is done."""
        inbox = self.inboxes[src]
        posted: Posted | None = None

        def drive(work: Work, budget: float) -> None:
            if posted is None or posted.done:
                return
            try:
                self._enter()
            except GroupClosedError as exc:
                work.set_exception(exc)
                return
            try:
                if budget <= 0:
                    inbox.poll()
                else:
                    inbox.drive(posted, time.monotonic() + budget)
            finally:
                self._leave()

        self._enter()
        try:
            if inbox.take_tensor(tensor, tag) < 0:
                return Work.completed("irecv")
            work = Work("irecv", driver=drive)
            posted = inbox.post(KIND_TENSOR, tag, tensor, deadline=time.monotonic() + timeout, op="irecv", work=work)
        finally:
            self._leave()
        return work

    def send_bytes(self, data: Any, dst: int, tag: int, *, timeout: float) -> None:
        work = self._post(KIND_BYTES, None, parts_of(data), dst, tag=tag, timeout=timeout, op="send_bytes")
        if work is not None:
            self._await(work, timeout)

    def recv_bytes(self, src: int, tag: int, *, timeout: float) -> bytearray | mmap.mmap:
        self._enter()
        try:
            message = self.inboxes[src].receive(KIND_BYTES, tag, None, time.monotonic() + timeout, "recv_bytes")
        finally:
            self._leave()
        assert message is not None
        return message

    def _post(
        self, kind: int, tensor: torch.Tensor | None, parts: list[memoryview], dst: int, *, tag: int, timeout: float,
        op: str,
    ) -> Work | None:  # fmt: skip
        self._enter()
        try:
            code = (dtype_code(tensor.dtype) or 0) if tensor is not None else 0
            return self.outboxes[dst].post(kind, code, tag, parts, deadline=time.monotonic() + timeout, op=op)
        finally:
            self._leave()

    def _await(self, work: Work, timeout: float) -> None:
        work.wait(timeout + 5 * SLICE)  # the sender thread keeps the deadline; this only bounds the wait
        if not work.is_completed():
            self.live.check([], "send")
        error = work.exception(0)
        if error is not None:
            raise error

    # -- collectives over shared slots ---------------------------------------------------
    #: collectives launch with ``async_op=True`` (API 1.2), in the caller's thread: see :meth:`_collective`
    launches = True

    def _collective(self, op: str, steps: collectives.Steps, timeout: float, async_op: bool) -> Work | None:
        """Run a shared-slot collective's steps here (blocking), or launch them: run here as far
        as they go without a peer, returning a work that waiting on (or polling) drives, that a
        later collective drives before its own steps, and that the drainer drives where nobody
        does (:class:`pg_shm.collectives.Shared`). Either way after every collective launched
        before it, with the call's deadline."""
        self._enter()
        try:
            if async_op:
                return self.shared.launch(op, steps, time.monotonic() + timeout)
            self.shared.run(op, steps, time.monotonic() + timeout)
        finally:
            self._leave()
        return None

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, timeout: float, async_op: bool = False) -> Work | None:
        if async_op and op.type is not RedOpType.PREMUL_SUM:  # a small one: prepared once per kind
            key = (tensor.dtype, op.type)
            small = self._small_launches.get(key)
            if small is None:
                small = self._small_launches[key] = self.shared.small_launch(tensor.dtype, op)
            self._enter()
            try:
                work = small(tensor, time.monotonic() + timeout)
            finally:
                self._leave()
            if work is not None:
                return work
        return self._collective("all_reduce", self.shared.all_reduce(tensor, op), timeout, async_op)

    def prepared_all_reduce(
        self, dtype: torch.dtype, op: ReduceOp, *, timeout: float
    ) -> Callable[[torch.Tensor], None] | None:
        """A blocking all_reduce of ``dtype`` with ``op``, looked up once (API 1.5)."""
        shared, enter, leave, monotonic = self.shared, self._enter, self._leave, time.monotonic
        small = shared.small_all_reduce(dtype, op)

        def run(tensor: torch.Tensor) -> None:
            enter()
            try:
                if not small(tensor, monotonic() + timeout):
                    shared.run("all_reduce", shared.all_reduce(tensor, op), monotonic() + timeout)
            finally:
                leave()

        return run

    def broadcast(self, tensor: torch.Tensor, src: int, *, timeout: float, async_op: bool = False) -> Work | None:
        return self._collective("broadcast", self.shared.broadcast(tensor, src), timeout, async_op)

    def barrier(self, *, timeout: float, async_op: bool = False) -> Work | None:
        return self._collective("barrier", self.shared.barrier(), timeout, async_op)

    def all_gather_into_tensor(
        self, output: torch.Tensor, input: torch.Tensor, *, timeout: float, async_op: bool = False
    ) -> Work | None:
        return self._collective(
            "all_gather_into_tensor", self.shared.all_gather_into_tensor(output, input), timeout, async_op
        )

    def reduce_scatter_tensor(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, *, timeout: float, async_op: bool = False
    ) -> Work | None:
        return self._collective(
            "reduce_scatter_tensor", self.shared.reduce_scatter_tensor(output, input, op), timeout, async_op
        )

    # -- life ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        self._close("was shut down", SHUT_DOWN)

    def abort(self) -> None:
        self._close("aborted", ABORTED)

    def _close(self, why: str, state: int) -> None:
        with self._life:
            if self.live.closed is not None:
                return
            self._users.append(None)  # this close's own reference (taken first): its wake-ups touch the segments
            self.live.closed = why  # from here on no one new enters
            self._state.value = state
        try:
            closed = GroupClosedError(f"group {self.ctx.group_name!r}: pg-shm backend {why}")
            self.shared.fail_pending(closed)
            for word in self._wake_words():
                futex_wake(word)
            for inbox in self.inboxes.values():
                inbox.close(closed, JOIN_S)
            # The threads leave within a slice of the wake-ups; joining them only keeps them from
            # outliving the close. One that does not (bounded: the close waits for no peer) keeps
            # the mappings through its reference until it leaves, and unmaps them then.
            deadline = time.monotonic() + JOIN_S
            for box in self.outboxes.values():
                box.close(deadline)
            if self._drainer is not None and self._drainer is not threading.current_thread():
                self._drainer.join(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            self._leave()

    def _wake_words(self) -> Sequence[int]:
        words = [self._doorbell.address, *self.shared.wake_words()]
        for box in self.outboxes.values():
            words += [box.ring.head.address, box.ring.tail.address]
        for inbox in self.inboxes.values():
            words += [inbox.ring.head.address, inbox.ring.tail.address]
        return words

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        for box in self.outboxes.values():
            box.ring.release()
        for inbox in self.inboxes.values():
            inbox.ring.release()
        self.shared.release()
        self._members.close()

    def _enter(self) -> None:
        """Take a reference for an operation, or raise ``GroupClosedError`` once closed.

        Without a lock, since every operation pays for it twice (a lock taken and released
        here and in :meth:`_leave` cost a 4-byte send about 0.4 us): a reference is an entry
        of ``_users``, appended or popped in one step under the GIL. A caller looks at
        ``live.closed`` only after its entry is in, and the close marks the member closed
        before anyone looks at ``_users`` for the release; so either the caller sees the
        close and leaves without touching the segments, or every look for the last
        reference sees the caller's until it leaves."""
        self._users.append(None)
        if self.live.closed is not None:
            self._leave()
            raise GroupClosedError(f"group {self.ctx.group_name!r}: pg-shm backend {self.live.closed}")

    def _hold(self) -> None:
        """Take a reference for a thread that a holder of one starts (the mappings are still
        there: its holder has not left), whether or not the member was closed meanwhile."""
        assert self._users and not self._released, "pg-shm: a thread started without a reference"
        self._users.append(None)

    def _leave(self) -> None:
        """Drop a reference; whoever drops the last one after the close unmaps (once: a caller
        that entered after the close, saw it and left, may find none left too)."""
        users = self._users
        users.pop()
        if not users and self.live.closed is not None:
            with self._life:
                if not users:  # (one that entered meanwhile saw the close: it releases as it leaves)
                    self._release()

    def _drain(self) -> None:
        bell = self._doorbell
        try:
            shared, inboxes = self.shared, list(self.inboxes.values())
            while self.live.closed is None:
                posted = any(inbox.waiting for inbox in inboxes)
                futex_wait(bell.address, 0, UNATTENDED if posted or shared.pending() else SLICE)
                if self.live.closed is not None:
                    return
                for inbox in inboxes:
                    inbox.drain()
                    inbox.unattended()
                shared.background()
        finally:
            self._leave()
