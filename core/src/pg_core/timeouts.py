"""Timeouts: how a call's ``timeout=`` becomes seconds, and deadlines for operations of several steps."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import NoReturn

from .errors import CollectiveTimeout

__all__ = ["DEFAULT_TIMEOUT", "Deadline", "retell", "seconds"]

#: Default per-operation timeout of a group, in seconds.
DEFAULT_TIMEOUT = 300.0


def seconds(timeout: float | timedelta | None, default: float) -> float:
    """``timeout`` (seconds or a ``timedelta``; ``None``: ``default``) as positive seconds."""
    if timeout is None:
        return default
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be seconds (a number) or a timedelta, got {timeout!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    return float(timeout)


class Deadline:
    """One timeout for an operation made of several steps: each step gets :meth:`left`."""

    __slots__ = ("at", "op", "seconds")

    def __init__(self, op: str, seconds: float) -> None:
        self.op = op
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left; raises :class:`~pg_core.errors.CollectiveTimeout` (naming ``op``) once none are."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise CollectiveTimeout(f"Timed out after {self.seconds:g} s in {self.op}", op=self.op)
        return left

    def remaining(self) -> float:
        """Seconds left, ``0.0`` once none are (never raises)."""
        return max(0.0, self.at - time.monotonic())


def retell(exc: CollectiveTimeout, op: str, what: str, timeout: float, seq: int | None = None) -> NoReturn:
    """Raise ``exc``, a timeout met by an internal step (a backend's ``recv_bytes``), as the
    user's ``op`` (``what``: its peer and tag, or its number), with ``exc`` as the cause and
    its ``peers`` (the ranks not heard from) carried over. Call it in an ``except`` clause:
    the try costs nothing while no timeout happens."""
    if exc.op == op and exc.seq == seq:
        raise exc  # already the user's: a Deadline of this op
    silent = f"; not heard from rank(s) {', '.join(map(str, exc.peers))}" if exc.peers else ""
    raise CollectiveTimeout(
        f"Timed out after {timeout:g} s in {op}{what}{silent}", op=op, seq=seq, peers=exc.peers
    ) from exc
