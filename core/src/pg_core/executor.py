"""Executor: the order of one group's collectives: queue, sequence numbers, failure latch, drain, abort.

Collectives of a group run one at a time, in the order they were called, each with the
next sequence number (a coalesced batch is one entry that takes a number per collective it
holds, :meth:`Executor.take`): a blocking one in the caller's thread when nothing is queued (no
thread handoff), an asynchronous one on the group's progress thread, and a blocking one
called while asynchronous ones are queued behind them. Calling collectives in the same
order on every rank is the user's obligation; the sequence number is how backends that can
see a mismatch name it.

After a collective fails (timeout, peer failure, mismatch) the executor refuses the
group's later collectives: the ranks may be out of step, with messages still in flight.

Every collective passes here, so here is where the group's flight recorder
(:mod:`pg_core.recorder`) notes each one: when it takes its sequence number, and when it
ends (a collective the backend launched ends when its work does).
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

from .errors import CollectiveMismatchError, CollectiveTimeout, GroupClosedError, PeerFailureError, PGError
from .recorder import FlightRecorder, describe_args
from .work import Work, stop_worker

__all__ = ["Executor"]

#: a queued operation: its work, op, function, and what the recorder notes (the backend's args, the device type)
_Item = tuple[Work, str, Callable[[int], Any], tuple[Any, ...], str]

#: ``arg`` of :meth:`Executor.call` meaning "the sequence number" (what :meth:`Executor.run` passes)
_SEQ: Any = object()

#: The failures after which ranks may be out of step: the executor refuses later collectives.
_LATCHED = (CollectiveTimeout, PeerFailureError, CollectiveMismatchError)


class Executor:
    """Runs one group's collectives in order; ``name`` is the group's, for messages.
    ``explain``, where given, is called as ``explain(op, seq, exc)`` with every failure of a
    collective that stops the group (:class:`CollectiveTimeout`, whose op and sequence number
    are set first, :class:`PeerFailureError`, :class:`CollectiveMismatchError`), to say more
    where the group knows more (members that never joined, who is where:
    :meth:`pg_core.recorder.Tracer.explain`). ``recorder``, where given, notes every
    collective (``None``: recording is off)."""

    __slots__ = (
        "__weakref__",
        "_broken",
        "_exec_lock",
        "_explain",
        "_lock",
        "_name",
        "_next_seq",
        "_pending",
        "_queue",
        "_recorder",
        "_worker",
        "_worker_ident",
        "lost",
        "seq",
        "state",
    )

    def __init__(
        self,
        name: str,
        explain: Callable[[str, int, BaseException], None] | None = None,
        recorder: FlightRecorder | None = None,
    ) -> None:
        self._name = name
        self._explain = explain
        self._recorder = recorder
        self._lock = threading.Lock()  # guards _pending, _worker, _worker_ident, state
        self._exec_lock = threading.Lock()  # held while a collective runs
        self._pending = 0
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        #: the progress thread's ident while it runs (compared on every blocking call: cheaper than the thread)
        self._worker_ident: int | None = None
        #: ``None`` while open, else what closed it: "shutting down", "shut down" or "aborted" (a plain
        #: attribute, not a property: the point-to-point lane reads it on every call; only this class writes it)
        self.state: str | None = None
        self._broken: tuple[type[PGError], str] | None = None
        self._next_seq = 1
        #: the sequence number of the collective running now (they run one at a time)
        self.seq = 0
        #: the ranks a collective's PeerFailureError named (what ProcessGroup.shrink takes for dead)
        self.lost: set[int] = set()

    @property
    def failed(self) -> bool:
        """Whether a collective failed (the group refuses later ones)."""
        return self._broken is not None

    def check_open(self) -> None:
        if self.state is not None:
            raise GroupClosedError(f"group {self._name!r} is {self.state}; create a new group to communicate again")

    def run(
        self, op: str, fn: Callable[[int], Any], *, async_op: bool, args: tuple[Any, ...] = (), device: str = ""
    ) -> Any:
        """Run collective ``op`` as ``fn(seq)`` in order. Blocking: returns ``fn``'s result;
        ``async_op``: a :class:`Work` whose ``result()`` it is. ``args`` (the backend's
        arguments) and ``device`` (its type) are what the recorder notes of it."""
        if async_op:
            return self._queued(op, fn, async_op=True, args=args, device=device)
        return self.call(op, fn, _SEQ, args, device)

    def call(self, op: str, fn: Callable[[Any], Any], arg: Any, args: tuple[Any, ...] = (), device: str = "") -> Any:
        """Run collective ``op`` as ``fn(arg)``, blocking, in order; return its result. In the
        caller's thread when nothing is queued (the hot path: no closure, no handoff), else
        queued behind what is. :meth:`run` passes the sequence number as ``arg``."""
        if self._worker_ident is not None and self._worker_ident == threading.get_ident():
            raise RuntimeError(
                f"{op}: a blocking operation cannot run on group {self._name!r}'s progress thread (from a Work "
                "callback); pass async_op=True there"
            )
        if self._pending == 0:  # nothing queued (read again under the lock that queued ones need)
            running = self._exec_lock
            running.acquire()  # not `with`: on this hot path, acquire/release cost half as much
            try:
                if self._pending == 0:
                    if self.state is not None:
                        self.check_open()
                    return self._invoke(op, fn, arg, args, device)
            finally:
                running.release()
        return self._queued(op, fn if arg is _SEQ else lambda _seq: fn(arg), async_op=False, args=args, device=device)

    def launch(self, op: str, fn: Callable[[int], Work], args: tuple[Any, ...] = (), device: str = "") -> Work:
        """Launch collective ``op`` as ``fn(seq)``, which starts it and returns its work, in
        order, in the caller's thread (a backend that launches, API 1.2): no progress thread,
        no handoff. The work's failure latches the group, and the recorder notes the
        collective when the work ends. Whenever anything is other than open, idle and in
        order (an operation queued, the group closing or closed, a collective failed, a call
        from the progress thread), it goes the way :meth:`call` goes: behind what is queued,
        or refused."""
        worker = self._worker_ident
        if (
            self._pending
            or self.state is not None
            or self._broken is not None
            or (worker is not None and worker == threading.get_ident())
        ):
            return self.call(op, lambda seq: self._watch(op, seq, -1, fn(seq)), _SEQ, args, device)  # type: ignore[no-any-return]
        running = self._exec_lock
        running.acquire()
        try:
            if not self._pending:  # still nothing queued, now that no other collective can start
                seq = self.seq = self._next_seq
                self._next_seq = seq + 1
                recorder = self._recorder
                record = -1 if recorder is None else recorder.collective(seq, op, describe_args(op, args), device)
                try:
                    work = fn(seq)
                except BaseException as exc:
                    if recorder is not None:
                        recorder.finished(record, exc)
                    self.latch(op, seq, exc)
                    raise
                return self._watch(op, seq, record, work)
        finally:
            running.release()
        return self.call(op, lambda seq: self._watch(op, seq, -1, fn(seq)), _SEQ, args, device)  # type: ignore[no-any-return]

    def _watch(self, op: str, seq: int, record: int, work: Work) -> Work:
        """``work``, launched as collective ``op`` number ``seq``: when it ends, a failure
        latches the group and the recorder's ``record`` (``-1``: none, or noted by
        :meth:`_invoke`) ends with it. One callback, run where the work completes."""
        recorder = self._recorder if record >= 0 else None
        if recorder is not None:
            recorder.launched(record)
        # launched and finished already: no callback to register. The Work's own state, not the
        # overridable `done` (a transport's request may be done before its work holds the error)
        if work._done:
            exc = work.error
            if exc is not None:
                self.latch(op, seq, exc)
            if recorder is not None:
                recorder.finished(record, exc)
            return work
        latch = self.latch

        def ended(done: Work) -> None:
            exc = done.error
            if exc is not None:
                latch(op, seq, exc)
            if recorder is not None:
                recorder.finished(record, exc)

        work.add_done_callback(ended)
        return work

    def lane(self, op: str, fn: Callable[[Any], Any], device: str = "") -> Callable[[Any], Any]:
        """``fn`` as a blocking collective ``op`` that runs as :meth:`call` would run it, made for
        a group's hottest call (a blocking all_reduce on a backend's prepared call): one frame, its
        state read from the closure. Whenever anything is other than open, idle and in order (an
        operation queued, the group closing or closed, a collective failed, a call from the
        progress thread), it hands the call to :meth:`call`, which queues, refuses or raises as usual.
        ``arg`` is the collective's one tensor, written in place; ``device`` its device type
        (for the recorder)."""
        lock = self._exec_lock
        acquire, release, call, latch, ident = lock.acquire, lock.release, self.call, self.latch, threading.get_ident
        recorder = self._recorder

        def run(arg: Any) -> Any:
            worker = self._worker_ident
            if self._pending or self.state is not None or self._broken is not None or (worker and worker == ident()):
                return call(op, fn, arg, (arg,), device)
            acquire()
            try:
                if not self._pending:  # still nothing queued, now that no other collective can start
                    seq = self.seq = self._next_seq
                    self._next_seq = seq + 1
                    try:
                        return fn(arg)
                    except _LATCHED as exc:
                        latch(op, seq, exc)
                        raise
            finally:
                release()
            return call(op, fn, arg, (arg,), device)  # an asynchronous one was queued meanwhile: behind it

        if recorder is None:
            return run
        begin, finished = recorder.tensor_collective, recorder.finished

        def recorded(arg: Any) -> Any:  # run, noting the collective in the group's flight recorder
            worker = self._worker_ident
            if self._pending or self.state is not None or self._broken is not None or (worker and worker == ident()):
                return call(op, fn, arg, (arg,), device)
            acquire()
            try:
                if not self._pending:
                    seq = self.seq = self._next_seq
                    self._next_seq = seq + 1
                    record = begin(seq, op, arg, device)
                    try:
                        result = fn(arg)
                    except BaseException as exc:
                        finished(record, exc)
                        if isinstance(exc, _LATCHED):
                            latch(op, seq, exc)
                        raise
                    finished(record)
                    return result
            finally:
                release()
            return call(op, fn, arg, (arg,), device)

        return recorded

    def launch_lane(self, op: str, start: Callable[[Any], Work], device: str = "") -> Callable[[Any], Work]:
        """``start`` as a launched collective ``op`` that runs as :meth:`launch` would run it, made
        for a group's hottest asynchronous call (``all_reduce(t, async_op=True)`` on a backend that
        launches): one frame, its state read from the closure, no closure made per call, the
        recorder noting the one tensor directly (:meth:`FlightRecorder.tensor_collective`).
        ``start(arg)`` starts the collective on ``arg``, its one tensor, written in place (an
        in-place collective without a root), and returns its work, which is watched as
        :meth:`launch` watches it; ``device`` is the tensor's device type (for the recorder).
        Whenever anything is other than open, idle and in order (an operation queued, the group
        closing or closed, a collective failed, a call from the progress thread), it hands the
        call to :meth:`launch`, which queues, refuses or raises as usual."""
        lock = self._exec_lock
        acquire, release, launch, latch, watch = lock.acquire, lock.release, self.launch, self.latch, self._watch
        ident = threading.get_ident
        recorder = self._recorder
        begin = None if recorder is None else recorder.tensor_collective
        finished = None if recorder is None else recorder.finished

        def run(arg: Any) -> Work:
            worker = self._worker_ident
            if self._pending or self.state is not None or self._broken is not None or (worker and worker == ident()):
                return launch(op, lambda _seq: start(arg), (arg,), device)
            acquire()
            try:
                if not self._pending:  # still nothing queued, now that no other collective can start
                    seq = self.seq = self._next_seq
                    self._next_seq = seq + 1
                    record = -1 if begin is None else begin(seq, op, arg, device)
                    try:
                        work = start(arg)
                    except BaseException as exc:
                        if finished is not None:
                            finished(record, exc)
                        latch(op, seq, exc)
                        raise
                    return watch(op, seq, record, work)
            finally:
                release()
            return launch(op, lambda _seq: start(arg), (arg,), device)  # queued meanwhile: behind it

        return run

    def _queued(
        self, op: str, fn: Callable[[int], Any], *, async_op: bool, args: tuple[Any, ...] = (), device: str = ""
    ) -> Any:
        work = Work(op)
        with self._lock:
            self.check_open()
            self._pending += 1
            if self._worker is None:
                self._worker = threading.Thread(
                    target=_work_loop, args=(self._queue, weakref.ref(self)), name=f"pg-core-{self._name}", daemon=True
                )
                self._worker.start()
                self._worker_ident = self._worker.ident
            self._queue.put((work, op, fn, args, device))
        return work if async_op else work.result()

    def _invoke(
        self, op: str, fn: Callable[[Any], Any], arg: Any = _SEQ, args: tuple[Any, ...] = (), device: str = ""
    ) -> Any:
        seq = self.seq = self._next_seq
        self._next_seq = seq + 1
        if self._broken is not None:
            raise self._stopped(op)
        recorder = self._recorder
        if recorder is None:
            try:
                return fn(seq if arg is _SEQ else arg)
            except _LATCHED as exc:
                self.latch(op, seq, exc)
                raise
        record = recorder.collective(seq, op, describe_args(op, args), device)
        try:
            result = fn(seq if arg is _SEQ else arg)
        except BaseException as exc:
            recorder.finished(record, exc)
            if isinstance(exc, _LATCHED):
                self.latch(op, seq, exc)
            raise
        if isinstance(result, Work):  # launched: it ends when its work does
            recorder.launched(record)
            result.add_done_callback(lambda done: recorder.finished(record, done.exception(0)))
        else:
            recorder.finished(record)
        return result

    def _stopped(self, op: str) -> PGError:
        kind, reason = self._broken or (PGError, "")
        return kind(
            f"{op}: collectives of group {self._name!r} stopped after {reason}; ranks may be out of step, "
            "so form the group again (point to point still works)"
        )

    def take(self, op: str, count: int = 1) -> int:
        """``count`` more sequence numbers for the collective that is running (a coalesced batch
        holding several collectives takes one each); returns the first. Raises as a new
        collective would if the group's collectives stopped after a failure."""
        if self._broken is not None:
            raise self._stopped(op)
        first = self._next_seq
        self._next_seq = first + count
        self.seq = first + count - 1
        return first

    def latch(self, op: str, seq: int, exc: BaseException | None) -> None:
        """Refuse later collectives if collective ``op`` number ``seq`` failed with ``exc`` in a way
        that can leave ranks out of step (inline, or a launched collective's work later); the
        first such failure is the one named."""
        if isinstance(exc, _LATCHED):
            if isinstance(exc, PeerFailureError):
                self.lost.update(exc.peers)
            if isinstance(exc, CollectiveTimeout):  # the backend knows the peers; the executor knows op and seq
                exc.op, exc.seq = op, seq
            if self._explain is not None:
                self._explain(op, seq, exc)
            if self._broken is None:
                self._broken = (type(exc), f"{op} (collective #{seq}) failed: {exc}")

    def _run_queued(
        self, work: Work, op: str, fn: Callable[[int], Any], args: tuple[Any, ...] = (), device: str = ""
    ) -> None:
        try:
            with self._exec_lock:
                if self.state in ("shut down", "aborted"):
                    raise GroupClosedError(f"group {self._name!r} was {self.state} before this operation ran")
                result = self._invoke(op, fn, _SEQ, args, device)
        except BaseException as exc:
            with self._lock:
                self._pending -= 1
            work.set_exception(exc)
        else:
            with self._lock:
                self._pending -= 1
            work.set_result(result)

    # -- life -------------------------------------------------------------------------
    def drain(self, timeout: float) -> bool:
        """Refuse new operations, let queued ones finish (at most ``timeout`` seconds), then
        wait for a running one. ``False`` if it was closed already."""
        with self._lock:
            if self.state is not None:
                return False
            self.state = "shutting down"
            worker, self._worker, self._worker_ident = self._worker, None, None
            if worker is not None:
                self._queue.put(None)
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout=timeout)
        with self._lock:
            self.state = "shut down"
        return True

    @property
    def running(self) -> threading.Lock:
        """Held while a collective runs: whoever closes the backends holds it, so none is
        closed under a collective that is running inline in another thread."""
        return self._exec_lock

    def abort(self, release: Callable[[], None]) -> bool:
        """Refuse everything now, call ``release`` (which aborts the backends, so operations
        blocked in other threads raise), then fail what is still queued. ``False`` if it was
        aborted already."""
        with self._lock:
            if self.state == "aborted":
                return False
            self.state = "aborted"
            worker, self._worker, self._worker_ident = self._worker, None, None
        release()
        aborted = GroupClosedError(f"group {self._name!r} was aborted")
        stop_worker(self._queue, worker, lambda _: aborted, join_s=10.0)  # what never ran fails
        return True


def _work_loop(q: queue.SimpleQueue[_Item | None], ref: weakref.ref[Executor]) -> None:
    """The progress thread: runs queued operations in order. It holds the executor only
    weakly between operations, so a group dropped without shutdown() is collected."""
    while True:
        item = q.get()
        if item is None:
            return
        work, op, fn, args, device = item
        del item  # nothing may keep the group (fn's closure) alive while waiting for the next item
        executor = ref()
        if executor is None:
            work.set_exception(GroupClosedError("the group was garbage-collected before this operation ran"))
        else:
            executor._run_queued(work, op, fn, args, device)
        del executor, work, fn, args
