"""The progress line of ``eprt run`` on stderr (rank 0 only: only rank 0 runs the batch).

On a terminal the line is redrawn in place twice a second; into a log file a full line
is written every ten seconds, so logs stay readable.
"""

from __future__ import annotations

import time
from typing import TextIO


class Progress:
    def __init__(self, total: int, stream: TextIO, interval: float | None = None):
        self.total = total
        self._stream = stream
        self._tty = stream.isatty()
        self._interval = interval if interval is not None else (0.5 if self._tty else 10.0)
        self._start = time.monotonic()
        self._last = -float("inf")
        self.done = 0
        self.failed = 0
        self.tokens = 0  # generated tokens of the results written so far

    def add(self, failed: bool, tokens: int = 0) -> None:
        self.done += 1
        self.failed += int(failed)
        self.tokens += tokens
        self._maybe_print()

    def _line(self) -> str:
        elapsed = max(time.monotonic() - self._start, 1e-9)
        return (
            f"eprt run: {self.done}/{self.total} requests done, {self.failed} failed, "
            f"{self.tokens / elapsed:.1f} tokens/s, {elapsed:.0f}s"
        )

    def _maybe_print(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self._interval:
            return
        self._last = now
        if self._tty:
            self._stream.write("\r\x1b[K" + self._line())
        else:
            self._stream.write(self._line() + "\n")
        self._stream.flush()

    def close(self) -> None:
        """Print the final state of the line (and end it on a terminal)."""
        self._maybe_print(force=True)
        if self._tty:
            self._stream.write("\n")
            self._stream.flush()
