"""Byte buffers a backend reuses from one message to the next.

A backend whose ``send`` must not wait for its receiver (the contract's rule) copies each
message into a buffer of its own. A fresh tensor of many megabytes is slow to write: each of
its pages faults on first touch, and the allocator gives large blocks back to the system when
they are freed, so the next one faults again (``torch.empty`` plus ``copy_`` of 64 MiB took
45 ms on this project's 2-core CI machine, the same copy into a buffer used before 11 ms).
:class:`SpareBuffers` keeps the buffers of finished messages, up to a bound in bytes, for the
next messages to be copied into. pg-mpi and pg-gloo use it for their sends, pg-gloo also for
the buffer a receive reads a message's header into.
"""

from __future__ import annotations

import threading
from typing import Final

import torch

__all__ = ["SpareBuffers"]

#: Bytes a :class:`SpareBuffers` keeps unless told otherwise.
DEFAULT_LIMIT: Final = 256 << 20


class SpareBuffers:
    """CPU ``uint8`` buffers kept for reuse, at most ``limit`` bytes of them (the oldest go
    first). Thread-safe. A buffer is the taker's alone until it is given back, and must not
    be given back while anything (a library's request in flight) may still read or write it.
    """

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self.limit = limit
        self._kept: list[torch.Tensor] = []
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` (its contents undefined): the smallest kept one that
        is large enough, else a new one of exactly ``nbytes``. Slice it to the size in use."""
        with self._lock:
            best = -1
            for i, buffer in enumerate(self._kept):
                if buffer.numel() >= nbytes and (best < 0 or buffer.numel() < self._kept[best].numel()):
                    best = i
            if best >= 0:
                buffer = self._kept.pop(best)
                self._bytes -= buffer.numel()
                return buffer
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, buffer: torch.Tensor) -> None:
        """Keep ``buffer`` (one that :meth:`take` returned, whole) for a later :meth:`take`;
        one larger than the limit is let go."""
        if buffer.numel() > self.limit:
            return
        with self._lock:
            self._kept.append(buffer)
            self._bytes += buffer.numel()
            while self._bytes > self.limit:
                self._bytes -= self._kept.pop(0).numel()

    def clear(self) -> None:
        """Let every kept buffer go (a backend's shutdown)."""
        with self._lock:
            self._kept.clear()
            self._bytes = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)

    @property
    def nbytes(self) -> int:
        """Bytes kept now."""
        return self._bytes
