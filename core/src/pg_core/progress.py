"""A progress bar for long runs (``pg-core bench``): one line on a terminal, redrawn in place.

No third-party dependency: the line is rewritten after a carriage return (``\\r``) and
cleared to its end (``ESC [K``), so it only makes sense on a terminal. Whoever owns the
stream decides whether to draw it (:meth:`ProgressBar.wanted`: a terminal, and not
``--quiet``); anything else (a pipe, a file, a CI log) gets no bar, and no control
characters. Log lines printed through :meth:`ProgressBar.print` scroll above the bar.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Final, TextIO

__all__ = ["ProgressBar"]

#: The fewest seconds between two redraws that only move the clock.
REDRAW_S: Final[float] = 0.5
_CLEAR: Final[str] = "\r\x1b[K"  # to the line's start, then erase to its end


class ProgressBar:
    """``[=====>    ] 12/40  all_reduce 64 KiB on gloo  0:07`` on ``stream``: cases done of
    ``total``, what is being measured now, and the time since the bar was made.

    :meth:`update` redraws at once; :meth:`tick` redraws when the clock has moved on
    (call it as often as convenient); :meth:`close` erases the bar, leaving the cursor at
    the start of an empty line.
    """

    def __init__(
        self,
        stream: TextIO,
        total: int,
        *,
        width: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream, self.total = stream, max(total, 0)
        self.done, self.current = 0, ""
        self._clock = clock
        self._start = self._last = clock()
        self._width = width if width is not None else _terminal_width(stream)
        self._shown = False

    @staticmethod
    def wanted(stream: TextIO, quiet: bool = False) -> bool:
        """Whether to draw a bar on ``stream``: it is a terminal and the user did not ask for quiet."""
        if quiet:
            return False
        try:
            return stream.isatty()
        except (AttributeError, ValueError):  # no isatty, or closed
            return False

    def line(self) -> str:
        """The bar as it is drawn now, at most the terminal's width less one column."""
        minutes, seconds = divmod(int(self._clock() - self._start), 60)
        hours, minutes = divmod(minutes, 60)
        clock = f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"
        cells = 20
        filled = cells * self.done // self.total if self.total else cells
        bar = "=" * filled + (">" + " " * (cells - filled - 1) if filled < cells else "")
        parts = (f"[{bar}]", f"{self.done}/{self.total}", self.current, clock)
        return "  ".join(p for p in parts if p)[: max(self._width - 1, 10)]

    def update(self, *, done: int | None = None, current: str | None = None) -> None:
        """Set the cases done and what runs now (each if given), and redraw."""
        if done is not None:
            self.done = min(done, self.total)
        if current is not None:
            self.current = current
        self._draw()

    def tick(self) -> None:
        """Redraw if :data:`REDRAW_S` have passed since the last redraw (the clock moves)."""
        if self._clock() - self._last >= REDRAW_S:
            self._draw()

    def print(self, text: str) -> None:
        """Write ``text`` as a line of its own above the bar, and redraw the bar below it."""
        self.stream.write(_CLEAR + text.rstrip("\n") + "\n")
        self._draw()

    def close(self) -> None:
        """Erase the bar (a no-op if it was never drawn)."""
        if self._shown:
            self.stream.write(_CLEAR)
            self.stream.flush()
            self._shown = False

    def _draw(self) -> None:
        self._last = self._clock()
        self.stream.write(_CLEAR + self.line())
        self.stream.flush()
        self._shown = True


def _terminal_width(stream: TextIO) -> int:
    """The terminal's columns; 80 where it does not say (a pty nobody sized reports 0)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns or 80
    except (AttributeError, OSError, ValueError):
        return 80
