"""Waiting for Gloo without being stuck in it.

Torch's Gloo ``Work.wait()`` blocks in C++ until the operation ends or Gloo's own timeout
passes, and nothing else wakes it: not ``ProcessGroupGloo.abort()`` or ``shutdown()`` from
another thread, not Ctrl-C (Python runs a signal handler only once the main thread is back
in the interpreter). A collective's work can be waited for in slices: a ``wait(timeout)``
that expires raises and leaves the operation as it was, so pg-gloo waits for collectives that
way in the caller's thread. A point-to-point work cannot: its ``wait(timeout)`` that expires
closes every connection of the group (all measured, torch 2.13). So a point-to-point work (no future; it says it is complete only from inside ``wait()``) is waited
for by a :class:`Waiters` thread that sits in Gloo's wait, while the caller waits for that
thread's :class:`Ticket` in slices, between which it looks at what else may have happened: an
abort, a peer gone, a deadline passed. A waiter thread can also run a continuation once Gloo's
wait returns (:meth:`Waiters.start`'s ``then``): that is how a receive reads its header, posts
its payload's receive and the next receive of its stream, and completes an ``irecv``'s work
without anyone waiting on it (:mod:`pg_gloo.messages`). No thread can wait in Gloo itself and
stay interruptible: ``ProcessGroupGloo.abort()`` does not wake a thread blocked in a receive
(measured, torch 2.13), and ``Work::abort()``, which would, is not bound in Python.

What does wake them is the same closure a point-to-point wait's expiry makes: once pg-gloo
closes Gloo's connections (``abort()``, or a failed wait that cuts them), it posts one receive
and lets its wait expire at once (:func:`wake_gloo_waits`), and every thread blocked in Gloo
(waiter threads, the send reaper, torch's worker threads in a collective) raises within
milliseconds ("Application timeout caused pair closure"), instead of sitting there until Gloo's
own timeout.
"""

from __future__ import annotations

import _thread
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final

import torch
from pg_core.c10d import timeout_delta
from pg_core.errors import CollectiveTimeout, GroupClosedError, PeerFailureError, PGError
from pg_core.work import Work

__all__ = ["SLICE_S", "SlicedWaits", "Ticket", "Waiters", "confined_to_one_cpu", "slice_ended", "wake_gloo_waits"]

#: How often a wait looks up from its event for an abort, a peer gone or its deadline; and
#: how long past the operation's timeout it still waits for Gloo's own timeout to fire first.
SLICE_S: Final = 0.1
SLICE: Final = timeout_delta(SLICE_S)
#: what torch says when a wait with a timeout expires before a collective's work is done
SLICE_EXPIRED: Final = "Operation timed out!"
GRACE_S: Final = 2.0

#: a continuation of a Gloo wait (:meth:`Waiters.start`): called with what the wait raised, or None
Then = Callable[[BaseException | None], None]
_Item = tuple[Any, timedelta, "Ticket", "Then | None"]


#: The wire tag of :func:`wake_gloo_waits`' receive (the last one Gloo's int32 tags have; the
#: connections are closed when it is posted, so nothing can arrive on it).
_WAKE_TAG: Final = 2**31 - 1
_WAKE_WAIT: Final = timedelta(milliseconds=1)


def confined_to_one_cpu() -> bool:
    """Whether this process may run on one CPU only (its affinity; ``False`` where the platform
    does not say). Then Gloo's worker and I/O threads run only when the caller's thread lets go
    of that CPU (see :meth:`SlicedWaits._launched`)."""
    try:
        return len(os.sched_getaffinity(0)) == 1
    except (AttributeError, OSError):
        return False


def wake_gloo_waits(pg: Any, rank: int, size: int) -> None:
    """Wake every thread blocked in a wait of ``pg``, a ``ProcessGroupGloo`` whose connections
    were just closed (``pg.abort()``): a receive from a peer, posted now and waited for 1 ms,
    expires, and Gloo's expiry closes every pair with an error that every blocked wait raises
    (measured on torch 2.13: a blocked receive and a blocked all_reduce raised 5 ms later, where
    ``abort()`` alone left them until Gloo's timeout). Nothing to do in a group of one."""
    if size < 2:
        return
    scratch = torch.empty(1, dtype=torch.uint8)
    try:
        pg.recv([scratch], (rank + 1) % size, _WAKE_TAG).wait(_WAKE_WAIT)
    except RuntimeError:  # the expiry, as intended (or the pair refusing a post: closed already)
        return
    logging.getLogger("pg_gloo").warning(
        "pg-gloo: a receive posted to wake Gloo's waits after its connections closed was answered"
    )


def slice_ended(work: Any, span: timedelta) -> bool:
    """Wait for a Gloo collective's ``work`` at most ``span``: whether it is done. Raises the
    work's own error (torch's ``RuntimeError``).

    Torch decides that a timed wait expired under its lock, then raises; the operation can end
    between that and the caller looking at it. Then ``is_completed()`` is already true although
    the wait raised :data:`SLICE_EXPIRED`: the outcome is the work's own, read by a wait that
    returns at once, never the slice's expiry taken for a failure (that once failed a
    collective every rank had finished).
    """
    try:
        work.wait(span)
    except RuntimeError as exc:
        if str(exc) != SLICE_EXPIRED:
            raise
        if not work.is_completed():
            return False
        work.wait()  # it ended as the slice expired: its result, or its own error
    return True


class Ticket:
    """One operation a waiter thread waits for: :meth:`wait` says whether Gloo's wait has
    returned, ``error`` is what it raised (or None). A bare lock, held until then: the
    cheapest hand-over between two threads that Python has (an ``Event`` costs more), and
    its timed acquire is interrupted by signals.

    ``ending`` is set by the thread that ends the operation once Gloo's wait has failed, before
    it works out the error (which may record the group broken, the alarm a waiting caller then
    finds): a caller that finds an alarm meanwhile waits for that end (:meth:`settled`)."""

    __slots__ = ("_done", "ending", "error", "finished")

    def __init__(self) -> None:
        self._done = _thread.allocate_lock()
        self._done.acquire()
        self.error: BaseException | None = None
        self.finished = False
        self.ending = False

    def set(self) -> None:
        self.finished = True
        self._done.release()

    def wait(self, seconds: float) -> bool:
        """Whether the operation is done, waiting at most ``seconds``."""
        if self.finished:
            return True
        if self._done.acquire(timeout=seconds):
            self._done.release()
            return True
        return False

    def settled(self) -> bool:
        """Whether the operation is done, looked at once an alarm is about to stop its wait: one
        more slice, or, while its end is under way (``ending``), until that end (at most
        :data:`GRACE_S`: the end works out its error, and at most waits 0.5 s for a peer's last
        word). The end may be what raised the alarm (its timeout broke the group), so the
        operation ends with its own outcome, however late the thread ending it is scheduled."""
        return self.wait(SLICE_S) or (self.ending and self.wait(GRACE_S))


class Waiters:
    """Threads that sit in Gloo's ``Work.wait()`` on behalf of callers who must stay
    interruptible; one per operation waited for at the same time, kept for the next one.
    Receives from different peers never wait for each other.

    Once Gloo's wait returns, a thread is idle again before it runs the continuation, and a
    continuation wakes its caller as its last step: the caller, woken, finds the GIL about to be
    let go (the thread's next step is to park on its queue) instead of being scheduled only to
    wait for it behind the rest of the continuation (on a core the two threads share, each such
    wake-up is two more context switches; measured in docs/decisions.md). A work handed to a
    thread while it runs a continuation waits only for that continuation, never for a Gloo wait."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._idle: list[queue.SimpleQueue[_Item | None]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._count = 0

    def start(self, work: Any, timeout: timedelta, *, then: Then | None = None) -> Ticket:
        """A thread now waits for Gloo's ``work`` (at most ``timeout``, Gloo's own bound), then
        calls ``then(error)`` (``error``: what Gloo's wait raised, or None) before it sets the
        ticket: a continuation that runs whether or not anyone waits."""
        ticket = Ticket()
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
            if inbox is None:
                self._count += 1
                inbox = queue.SimpleQueue()
                threading.Thread(
                    target=self._run, args=(inbox,), name=f"pg-gloo-{self._name}-wait-{self._count}", daemon=True
                ).start()
        inbox.put((work, timeout, ticket, then))
        return ticket

    def _run(self, inbox: queue.SimpleQueue[_Item | None]) -> None:
        while True:
            item = inbox.get()
            if item is None:
                return
            work, timeout, ticket, then = item
            try:
                work.wait(timeout)
            except BaseException as exc:  # Gloo's RuntimeError, for the caller to translate
                ticket.error, ticket.ending = exc, True
            del item, work
            with self._lock:  # idle again before the continuation wakes anyone (see the class)
                closed = self._closed
                if not closed:
                    self._idle.append(inbox)
            if then is not None:
                try:
                    then(ticket.error)
                except BaseException:  # a continuation ends its own operation; never this thread
                    logging.getLogger("pg_gloo").exception("a continuation of a Gloo wait raised")
                del then
            ticket.set()
            del ticket
            if closed:
                return

    def close(self) -> None:
        """Let the idle threads end; a busy one ends once its Gloo wait returns (after an abort,
        at Gloo's own timeout: nothing else wakes it)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for inbox in idle:
            inbox.put(None)


class SlicedWaits:
    """How :class:`~pg_gloo.backend.GlooBackend` waits for Gloo (see the module docstring);
    the backend holds the state, and says in ``_alarm`` what stops a wait."""

    rank: int
    _pg: Any
    _broken: str | None
    _aborted: bool
    _closing: threading.Lock
    _waiters: Waiters
    _everyone: tuple[int, ...]
    _one_cpu: bool

    if TYPE_CHECKING:

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
        ticket: Ticket | None = None,
    ) -> None:
        """Wait in slices (``waited(seconds)`` waits at most that long and says whether the
        operation is done), raising between them if this backend was aborted, a peer in ``peers``
        is gone, or ``timeout`` (plus Gloo's grace) has passed. Whatever stops the wait early
        (those, or ``KeyboardInterrupt``) leaves Gloo's operation posted: unless every peer it
        needs is gone, Gloo's connections are closed first, so nothing is written into the
        caller's tensors afterwards. Before an alarm stops it, the wait looks once more (one
        slice; for an operation a thread ends, its ``ticket``, until that end where it is under
        way: :meth:`Ticket.settled`): an operation that ended meanwhile ends with its own outcome
        (its own end may be what raised the alarm: a Gloo timeout, recorded by the thread that
        waited in Gloo, breaks the group before that thread hands the operation its error)."""
        if waited(SLICE_S):
            return
        deadline = time.monotonic() + timeout + GRACE_S
        done = False
        try:
            while not (done := waited(SLICE_S)):
                try:
                    self._alarm(what, peers)
                except PGError as exc:
                    if done := (ticket.settled() if ticket is not None else waited(SLICE_S)):
                        return  # its own end (its timeout broke the group, say) says what happened
                    if isinstance(exc, PeerFailureError) and set(exc.peers) != set(peers):
                        self._cut(f"{what} failed: {exc}")  # some peer it needs is alive, and may still write
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
                self._wake(pg)

    def _wake(self, pg: Any) -> None:
        """Wake the threads blocked in ``pg``'s waits once its connections are closed
        (:func:`wake_gloo_waits`)."""
        wake_gloo_waits(pg, self.rank, len(self._everyone) + 1)

    def _finish(self, work: Any, what: str, timeout: float, peers: Sequence[int]) -> None:
        """Wait for a collective's Gloo ``work`` (see :meth:`_until`), then raise its error as
        pg-core's. A collective's work can be waited for in slices in C++ (a wait that expires
        raises, and leaves the operation as it was), which costs nothing over one wait."""

        def waited(seconds: float) -> bool:
            try:
                return slice_ended(work, SLICE if seconds == SLICE_S else timeout_delta(seconds))
            except RuntimeError as exc:
                raise self._error(exc, what, timeout, peers) from exc

        self._until(waited, what, timeout, peers)

    def _received(self, work: Any, what: str, timeout: float, peers: Sequence[int]) -> None:
        """Wait for a point-to-point Gloo ``work``: a waiter thread waits in Gloo (a receive's
        wait cannot be sliced: one that expires closes every connection), the caller in slices."""
        ticket = self._waiters.start(work, timeout_delta(timeout))
        self._until(ticket.wait, what, timeout, peers, ticket=ticket)
        if ticket.error is not None:
            raise self._error(ticket.error, what, timeout, peers) from ticket.error

    def _await(self, work: Any, what: str, timeout: float, peers: Sequence[int], *, bounded: bool) -> None:
        """Wait for a blocking call's Gloo ``work`` (the base class posted it): a receive or send
        (``bounded``: point to point, whose peers are given) through a waiter thread, a collective
        in slices of Gloo's own wait."""
        if bounded:
            self._received(work, what, timeout, peers)
        else:
            self._finish(work, what, timeout, self._everyone)

    def _launched(self, torch_work: Any, what: str, timeout: float, peers: Sequence[int]) -> Work:
        """A collective's Gloo work as pg-core's, driven by whoever waits on it or polls it: each
        slice of a wait is Gloo's own (see :meth:`_finish`), and between slices it looks for an
        abort, a peer gone and the deadline, as a blocking call does.

        Where the process has one CPU (``_one_cpu``: ranks pinned a core each), the caller's
        thread first yields it: Gloo runs the collective on its own threads, which on that CPU
        start only once the caller lets go, and a blocking call does at once (it waits), while an
        asynchronous one returns to Python first. 5 us of Python between posting a 4-byte
        all_reduce and waiting for it made raw torch's 113 us 137-141; a yield first, 116-120
        (2 ranks pinned, 2026-12-07)."""
        if self._one_cpu:
            os.sched_yield()
        deadline = time.monotonic() + timeout + GRACE_S
        needs = peers or self._everyone

        def drive(work: Work, budget: float) -> None:
            try:
                if budget > 0:
                    done = slice_ended(torch_work, SLICE if budget >= SLICE_S else timeout_delta(budget))
                elif done := torch_work.is_completed():
                    torch_work.wait()
            except RuntimeError as exc:
                work.set_exception(self._error(exc, what, timeout, needs))
                return
            if done:
                work.set_result(None)
                return
            if budget <= 0:  # a poll: nothing to look at until someone waits
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

        return Work(what, driver=drive)
