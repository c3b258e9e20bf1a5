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
abort, a peer gone, a deadline passed.
"""

from __future__ import annotations

import queue
import threading
from datetime import timedelta
from typing import Any

__all__ = ["Ticket", "Waiters"]


class Ticket:
    """One operation a waiter thread waits for: ``done`` is set once Gloo's wait returned,
    ``error`` is what it raised (or None)."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None


class Waiters:
    """Threads that sit in Gloo's ``Work.wait()`` on behalf of callers who must stay
    interruptible; one per operation waited for at the same time, kept for the next one.
    Receives from different peers never wait for each other."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._idle: list[queue.SimpleQueue[tuple[Any, timedelta, Ticket] | None]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._count = 0

    def start(self, work: Any, timeout: timedelta) -> Ticket:
        """A thread now waits for Gloo's ``work`` (at most ``timeout``, Gloo's own bound)."""
        ticket = Ticket()
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
            if inbox is None:
                self._count += 1
                inbox = queue.SimpleQueue()
                threading.Thread(
                    target=self._run, args=(inbox,), name=f"pg-gloo-{self._name}-wait-{self._count}", daemon=True
                ).start()
        inbox.put((work, timeout, ticket))
        return ticket

    def _run(self, inbox: queue.SimpleQueue[tuple[Any, timedelta, Ticket] | None]) -> None:
        while True:
            item = inbox.get()
            if item is None:
                return
            work, timeout, ticket = item
            try:
                work.wait(timeout)
            except BaseException as exc:  # Gloo's RuntimeError, for the caller to translate
                ticket.error = exc
            ticket.done.set()
            del item, work, ticket
            with self._lock:
                if self._closed:
                    return
                self._idle.append(inbox)

    def close(self) -> None:
        """Let the idle threads end; a busy one ends once its Gloo wait returns (after an abort,
        at Gloo's own timeout: nothing else wakes it)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for inbox in idle:
            inbox.put(None)
