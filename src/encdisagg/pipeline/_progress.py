"""A small progress bar for the demo, on stderr (no dependency)."""

from __future__ import annotations

import time
from typing import TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    """``[#########-----------]  9/20  completed=8 aborted=1  3.1 s``.

    Redraws in place on a terminal; elsewhere (a file, a pipe) it writes only the final line.
    Reads the wall clock for display only.
    """

    def __init__(self, total: int, *, stream: TextIO, width: int = 30) -> None:
        self.total = total
        self.done = 0
        self.counts: dict[str, int] = {}
        self._stream = stream
        self._width = width
        self._start = time.monotonic()
        isatty = getattr(stream, "isatty", None)
        self._live = bool(isatty and isatty())

    def line(self) -> str:
        filled = self._width * self.done // max(1, self.total)
        bar = "#" * filled + "-" * (self._width - filled)
        counts = " ".join(f"{key}={value}" for key, value in sorted(self.counts.items()))
        elapsed = time.monotonic() - self._start
        return (
            f"[{bar}] {self.done:>{len(str(self.total))}}/{self.total}  {counts}  {elapsed:.1f} s"
        )

    def draw(self) -> None:
        if self._live:
            self._stream.write("\r" + self.line())
            self._stream.flush()

    def advance(self, label: str) -> None:
        self.done += 1
        self.counts[label] = self.counts.get(label, 0) + 1
        self.draw()

    def finish(self) -> None:
        self._stream.write(("\r" if self._live else "") + self.line() + "\n")
        self._stream.flush()
