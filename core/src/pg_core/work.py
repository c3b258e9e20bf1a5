"""``Work``: the handle of an operation started with ``async_op=True``.

A ``Work`` is completed exactly once, by whoever runs the operation (the group's
progress thread, or a backend's transport), with a result or an exception.
``wait`` re-raises that exception in the caller's thread. Backends return
``Work`` objects from their asynchronous methods too, so this one class is the
whole vocabulary of asynchrony between core, plugins and users.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from .errors import CollectiveTimeout

__all__ = ["Work", "all_of", "mapped", "stop_worker", "then", "unwrap"]

#: ``driver(work, timeout)`` makes progress on ``work`` for at most ``timeout``
#: seconds (``0``: only what is ready now) and returns; it never raises for the
#: operation's own failure, which it records on the work instead.
Driver = Callable[["Work", float], None]


class Work:
    """Completion handle of one asynchronous operation.

    ``op`` names the operation for error messages. A transport that completes
    operations only while someone drives it passes ``driver``; ``wait`` and
    ``is_completed`` then call it, so polling ``is_completed()`` makes progress
    the way ``MPI_Test`` does.

    Two ways to look without raising, for code that reacts to completion (callback chains,
    drivers, transports): :attr:`done` says whether it has completed as far as is known now,
    never driving it (``is_completed`` drives), and :meth:`wait_until_done` waits a bounded
    time and returns whether it completed, instead of raising as ``wait`` does.
    """

    __slots__ = ("_callbacks", "_cond", "_done", "_driver", "_exc", "_lock", "_result", "op")

    def __init__(self, op: str = "operation", *, driver: Driver | None = None) -> None:
        self.op = op
        self._driver = driver
        # A lock always (cheap); a condition on it only once a thread blocks in wait(): most
        # works complete before anyone waits, or are driven by their waiter.
        self._lock = threading.Lock()
        self._cond: threading.Condition | None = None
        self._done = False
        self._result: Any = None
        self._exc: BaseException | None = None
        self._callbacks: list[Callable[[Work], None]] | None = None

    # -- producer side -------------------------------------------------------
    @classmethod
    def completed(cls, op: str = "operation", result: Any = None) -> Work:
        """A work that is already done (for operations that finished inline)."""
        work = cls(op)
        work._result, work._done = result, True
        return work

    @property
    def done(self) -> bool:
        """Whether the work has completed, as far as is known now: unlike :meth:`is_completed`
        it never drives the operation and never blocks (for code that only reacts to completion,
        such as a callback chain deciding whether to go on at once). A subclass whose completion
        lives elsewhere (a transport's request) overrides it."""
        return self._done

    def set_result(self, result: Any = None) -> None:
        """Complete successfully with ``result``; a second completion is ignored."""
        self._finish(result, None)

    def set_exception(self, exc: BaseException) -> None:
        """Complete with ``exc``, which ``wait`` re-raises; a second completion is ignored."""
        self._finish(None, exc)

    def add_done_callback(self, fn: Callable[[Work], None]) -> None:
        """Call ``fn(work)`` once the work completes (at once, in this thread, if it already
        has; else in the thread that completes it)."""
        if not self._done:
            with self._lock:
                if not self._done:
                    if self._callbacks is None:
                        self._callbacks = [fn]
                    else:
                        self._callbacks.append(fn)
                    return
        self._call(fn)

    def _finish(self, result: Any, exc: BaseException | None) -> None:
        with self._lock:
            if self._done:
                return
            self._result, self._exc, self._done = result, exc, True
            # a done work needs no driver, and its driver holds the backend's own operation (a
            # torch work, a request, the connections behind them) for as long as anyone holds this
            self._driver = None
            callbacks, self._callbacks = self._callbacks, None
            if self._cond is not None:
                self._cond.notify_all()
        if callbacks is not None:
            for fn in callbacks:
                self._call(fn)

    def _call(self, fn: Callable[[Work], None]) -> None:
        # A failing callback must not take down the thread that completes work
        # (a group's progress thread, a transport's): report it, carry on.
        try:
            fn(self)
        except Exception:
            logging.getLogger("pg_core").exception("a done-callback of %r raised", self)

    @property
    def driven(self) -> bool:
        """Whether the work completes only while someone drives it (made with a ``driver``:
        ``wait``, ``is_completed`` and :meth:`wait_until_done` drive it), so that a caller
        wanting its callbacks to run without waiting must drive it from a thread of its own.
        A done work is not: completion lets go of the driver."""
        return self._driver is not None

    # -- consumer side -------------------------------------------------------
    def is_completed(self) -> bool:
        """Whether the operation finished (successfully or not); never blocks."""
        driver = self._driver  # (read once: completion drops it)
        if not self._done and driver is not None:
            driver(self, 0.0)
        return self._done

    def wait(self, timeout: float | timedelta | None = None) -> bool:
        """Block until the operation finishes; re-raise its error.

        ``timeout`` (seconds) bounds this wait only; the operation keeps its own
        timeout. Exceeding it raises :class:`~pg_core.errors.CollectiveTimeout`.
        Returns ``True``, as ``torch.distributed.Work.wait`` does.
        """
        if not self._done and not self.wait_until_done(timeout):  # (done already: no clock, no call)
            raise CollectiveTimeout(
                f"{self.op}: Work.wait(timeout={timeout}) expired before the operation finished",
                op=self.op,
            )
        if self._exc is not None:
            raise self._exc
        return True

    def exception(self, timeout: float | timedelta | None = None) -> BaseException | None:
        """Wait for the operation, then return its error (``None`` if it succeeded)."""
        if not self.wait_until_done(timeout):
            raise CollectiveTimeout(f"{self.op}: not finished after {timeout} s", op=self.op)
        return self._exc

    def result(self, timeout: float | timedelta | None = None) -> Any:
        """Wait for the operation and return its value (``None`` for in-place ops)."""
        self.wait(timeout)
        return self._result

    def wait_until_done(self, timeout: float | timedelta | None = None) -> bool:
        """Block until the operation finishes or ``timeout`` seconds (``None``: no bound) pass,
        driving it as ``wait`` does; return whether it finished. Never raises for the
        operation's error or for the timeout (read :meth:`exception` once it returns ``True``),
        which is what a driver or a callback chain wants where ``wait`` would raise."""
        if isinstance(timeout, timedelta):
            timeout = timeout.total_seconds()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            driver = self._driver  # (read once: completion drops it)
            if driver is not None:
                driver(self, 1.0 if remaining is None else min(remaining, 1.0))
                continue
            with self._lock:
                if not self._done:
                    if self._cond is None:
                        self._cond = threading.Condition(self._lock)
                    self._cond.wait(None if remaining is None else remaining)
        return True

    @property
    def error(self) -> BaseException | None:
        """The operation's error once it has failed; ``None`` while it is pending or once it
        succeeded. Never waits and never drives (the cheap read a completion callback wants)."""
        return self._exc

    def wait_undriven(self, timeout: float) -> None:
        """Block until the work completes or ``timeout`` seconds pass, without driving it (for a
        driver that has nothing to drive just now); returns either way."""
        with self._lock:
            if not self._done:
                if self._cond is None:
                    self._cond = threading.Condition(self._lock)
                self._cond.wait(timeout)

    def __repr__(self) -> str:
        if not self._done:
            state = "pending"
        elif self._exc is not None:
            state = f"failed: {type(self._exc).__name__}"
        else:
            state = "completed"
        return f"<Work {self.op} {state}>"


def then(inner: Work, fn: Callable[[], None]) -> Work:
    """A work that completes after ``inner`` does and ``fn()`` (run only if ``inner`` succeeded:
    copies of staged outputs, say) has returned, with ``inner``'s result or the first error.
    Waiting on it, or polling it, drives ``inner``."""

    def step(result: Any) -> Any:
        fn()
        return result

    return mapped(inner, step)


def mapped(inner: Work, fn: Callable[[Any], Any]) -> Work:
    """A work that completes with ``fn(result)`` once ``inner`` succeeded with ``result`` (``fn``
    runs only then), or with the first error, ``inner``'s or ``fn``'s. Waiting on it, or
    polling it, drives ``inner``."""

    def drive(_: Work, timeout: float) -> None:
        if timeout <= 0:
            inner.is_completed()
        else:
            inner.wait_until_done(timeout)

    outer = Work(inner.op, driver=drive)

    def done(w: Work) -> None:
        exc = w._exc
        value = None
        if exc is None:
            try:
                value = fn(w._result)
            except BaseException as e:
                exc = e
        if exc is None:
            outer.set_result(value)
        else:
            outer.set_exception(exc)

    inner.add_done_callback(done)
    return outer


def all_of(op: str, works: list[Work]) -> Work:
    """A work that completes when every one of ``works`` has (at once for none), or with the
    first error as soon as one fails. Waiting on it, or polling it, drives them in turn."""
    outer: Work

    def drive(_: Work, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for w in works:
            if outer._done:
                return
            if timeout <= 0:
                w.is_completed()
            elif not w.wait_until_done(max(deadline - time.monotonic(), 0.0)):
                return

    outer = Work(op, driver=drive)
    left = [len(works)]
    lock = threading.Lock()

    def done(w: Work) -> None:
        if w._exc is not None:
            outer.set_exception(w._exc)
            return
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            outer.set_result(None)

    if not works:
        outer.set_result(None)
    for w in works:
        w.add_done_callback(done)
    return outer


def unwrap(outer: Work) -> Work:
    """``outer``, whose result is another work (an operation that launches one when it runs),
    as one work: done when that inner work is, with its result or the first error."""

    def drive(_: Work, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        if not outer._done:
            if timeout <= 0:
                outer.is_completed()
                return
            if not outer.wait_until_done(timeout):
                return
        inner = outer._result
        if isinstance(inner, Work):
            if timeout <= 0:
                inner.is_completed()
            else:
                inner.wait_until_done(max(deadline - time.monotonic(), 0.0))

    result = Work(outer.op, driver=drive)

    def ran(w: Work) -> None:
        inner = w._result
        if w._exc is not None:
            result.set_exception(w._exc)
        elif isinstance(inner, Work):
            inner.add_done_callback(lambda i: result.set_exception(i._exc) if i._exc else result.set_result(i._result))
        else:
            result.set_result(inner)

    outer.add_done_callback(ran)
    return result


def stop_worker(
    items: queue.SimpleQueue[Any],
    thread: threading.Thread | None,
    error: Callable[[Work], BaseException],
    *,
    join_s: float,
) -> None:
    """Stop ``thread``, a worker that runs the items of ``items`` in order until it takes
    ``None`` (each item a tuple whose first element is its :class:`Work`), and fail what it
    will not run: the stop mark is queued, the thread waited for at most ``join_s`` seconds
    (never by itself), then every work still queued completes with ``error(work)``. A thread
    still inside a call then (stuck in a backend) gets its stop mark again, for when the call
    returns. The caller refuses new items first. The one rule of the group's progress thread
    (:class:`~pg_core.executor.Executor`) and a backend's stream helpers (``instance.py``)."""
    if thread is not None:
        items.put(None)
        if thread is not threading.current_thread():
            thread.join(timeout=join_s)
    while True:
        try:
            item = items.get_nowait()
        except queue.Empty:
            break
        if item is not None:
            item[0].set_exception(error(item[0]))
    if thread is not None and thread.is_alive():
        items.put(None)
