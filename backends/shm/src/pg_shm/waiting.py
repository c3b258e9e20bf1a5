"""How a pg-shm member waits for a word another process writes: spin briefly, then sleep on
the word's futex in slices, checking between slices that it was not closed, that the
peers it waits for are alive and did not abort or shut down, and its deadline.

A peer's writes wake the sleeper only when the sleeper advertised it sleeps (a flag word
it writes); a wake-up lost to a race costs one slice (:data:`SLICE`), never a hang.
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable, Sequence
from typing import Final

from pg_core.errors import CollectiveTimeout, GroupClosedError, PeerFailureError

from .layout import ABORTED, SHUT_DOWN, STATE
from .segment import Word, futex_wait

__all__ = ["SLICE", "SPINS", "Flag", "Liveness", "wait_until"]

#: Longest sleep between two checks of the peers and the deadline (seconds).
SLICE: Final = 0.03
#: Polls of the word before sleeping (about 30-60 us of Python here): a peer that answers
#: within that is not paid a futex round trip, and one that is descheduled costs no more than
#: that before this rank sleeps and gives it the core. (``sched_yield`` between polls was
#: tried: on a loaded machine each yield gave the core away for a whole time slice, ~1 ms.)
SPINS: Final = 256


class Flag:
    """A shared "I sleep" word written by this process only, counted across its threads."""

    __slots__ = ("_count", "_lock", "word")

    def __init__(self, word: Word) -> None:
        self.word = word
        self._count = 0
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        with self._lock:
            self._count += 1
            self.word.value = 1

    def __exit__(self, *_: object) -> None:
        with self._lock:
            self._count -= 1
            if self._count == 0:
                self.word.value = 0


class Liveness:
    """What a wait checks between slices: this member closed (``closed()`` returns why, or
    ``None``), and each peer's process and state word."""

    def __init__(
        self, group: str, pids: Sequence[int], pidfds: Sequence[int | None], states: Sequence[Word | None]
    ) -> None:
        self.group = group
        self.pids = list(pids)
        self.pidfds = list(pidfds)
        self.states = list(states)
        self.closed: str | None = None

    def check(self, peers: Sequence[int], doing: str) -> None:
        """Raise ``GroupClosedError`` if this member was closed, ``PeerFailureError`` naming the
        first of ``peers`` whose process is gone or that aborted or shut down."""
        if self.closed is not None:
            raise GroupClosedError(f"group {self.group!r}: {doing} stopped: this member {self.closed}")
        for peer in peers:
            state = self.states[peer]
            value = state.value if state is not None else 0
            if value == ABORTED:
                raise PeerFailureError(f"group {self.group!r}: {doing}: rank {peer} aborted", peers=[peer])
            if value == SHUT_DOWN:
                raise PeerFailureError(f"group {self.group!r}: {doing}: rank {peer} shut down", peers=[peer])
            if self._gone(peer):
                raise PeerFailureError(
                    f"group {self.group!r}: {doing}: rank {peer} (pid {self.pids[peer]}) died", peers=[peer]
                )

    def _gone(self, peer: int) -> bool:
        fd = self.pidfds[peer]
        if fd is not None:
            try:
                return bool(select.select([fd], [], [], 0)[0])
            except (OSError, ValueError):  # closed under us: shutdown in another thread
                return False
        try:
            os.kill(self.pids[peer], 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


def state_word(address: int) -> Word:
    return Word(address + STATE, 32)


def wait_until(
    ready: Callable[[], bool],
    word: Word,
    flag: Flag,
    live: Liveness,
    peers: Sequence[int],
    *,
    deadline: float,
    doing: str,
    op: str,
    also: Callable[[], None] | None = None,
) -> None:
    """Return once ``ready()``; sleep on ``word`` (which the peers write when ``ready`` may
    have changed) while it is not. ``also`` runs before each sleep (a sender's drain request).
    Raises as :meth:`Liveness.check` does, and ``CollectiveTimeout`` naming ``op`` and
    ``peers`` past ``deadline`` (``time.monotonic()``)."""
    for _ in range(SPINS):
        if ready():
            return
    while True:
        if ready():
            return
        try:
            live.check(peers, doing)
        except PeerFailureError:
            if ready():  # what the peer wrote before it stopped is seen now: it still counts
                return
            raise
        left = deadline - time.monotonic()
        if left <= 0:
            raise CollectiveTimeout(
                f"Timed out in {op} (group {live.group!r}): {doing}; not heard from ranks {list(peers)}",
                op=op,
                peers=peers,
            )
        if also is not None:
            also()
        seen = word.value
        with flag:
            if ready():
                return
            futex_wait(word.address, seen, min(SLICE, left))
