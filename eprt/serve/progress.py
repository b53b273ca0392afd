"""The live progress of ``eprt run`` and ``eprt generate`` on stderr (rank 0 only), as users know
it from pip or tqdm: requests done / total, tokens generated so far (counted as the engine
generates them, not as requests finish) and their rate, the time elapsed and an estimate of the
time left.

``EPRT_PROGRESS`` picks the form: ``auto`` (the default) redraws one line in place twice a second
when stderr is a terminal and writes a plain line every five seconds otherwise (a log file, a pipe,
and the ranks of ``mpiexec``, whose output reaches the terminal through a pipe); ``bar`` and
``lines`` force either, ``off`` shows nothing. Nothing goes to stdout: ``--json`` and output files
never see it. While the bar is drawn, a log line written to the same stream first clears it; the
bar is redrawn below at the next tick.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from typing import TextIO

from eprt import env

BAR_INTERVAL_S = 0.5  # how often the terminal line is redrawn
LINES_INTERVAL_S = 5.0  # how often a plain line is written when stderr is not a terminal
_BAR_CELLS = 20


def progress_mode(stream: TextIO) -> str:
    """``bar``, ``lines`` or ``off``: EPRT_PROGRESS, ``auto`` resolved by whether ``stream`` is a terminal."""
    mode = env.PROGRESS.get()
    if mode == "auto":
        isatty = getattr(stream, "isatty", None)
        return "bar" if isatty is not None and isatty() else "lines"
    return mode


def clock(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour on."""
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Progress:
    """Requests done out of ``total``, and the tokens ``tokens()`` says were generated since the
    progress began (None: those of the finished requests, as ``add`` counts them).

    ``tick()`` redraws when the interval has passed (call it often: it is cheap); ``add()`` counts
    a finished request. ``delay``: nothing is shown before this many seconds (a short job stays
    silent); ``close()`` then shows the final state only if something was shown, or ``final``.
    ``budget``: the most tokens the job can generate (its max_tokens), which moves the bar and
    the estimate of the time left while few requests are done (one long prompt).
    """

    def __init__(
        self,
        total: int,
        stream: TextIO,
        what: str = "eprt run",
        tokens: Callable[[], int] | None = None,
        delay: float = 0.0,
        mode: str | None = None,
        interval: float | None = None,
        budget: int | None = None,
    ):
        self.total, self.what, self.budget = total, what, budget
        self._stream = stream
        self.mode = mode or progress_mode(stream)
        self._interval = (
            interval if interval is not None else (BAR_INTERVAL_S if self.mode == "bar" else LINES_INTERVAL_S)
        )
        self._tokens = tokens
        self._tokens_at_start = tokens() if tokens is not None else 0
        self._start = time.monotonic()
        self._delay = delay
        self._last = self._start if self.mode == "lines" else -float("inf")  # a first line only after an interval
        self.shown = False
        self.done = 0
        self.failed = 0
        self.finished_tokens = 0  # generated tokens of the finished requests
        self._on_line = False  # the bar is the cursor's line (a log record must clear it first)
        # the eprt log's handlers writing to this stream clear the bar before each record
        handlers = logging.getLogger("eprt").handlers if self.mode == "bar" else []
        self._handlers = [h for h in handlers if getattr(h, "stream", None) is stream]
        for h in self._handlers:
            h.addFilter(self._before_log)

    def _before_log(self, record: logging.LogRecord) -> bool:
        if self._on_line:
            self._stream.write("\r\x1b[K")
            self._on_line = False
            self._last = -float("inf")  # redrawn below the record at the next tick
        return True

    @property
    def tokens(self) -> int:
        """Tokens generated since the progress began."""
        if self._tokens is None:
            return self.finished_tokens
        return max(self._tokens() - self._tokens_at_start, self.finished_tokens)

    def add(self, failed: bool, tokens: int = 0) -> None:
        self.done += 1
        self.failed += int(failed)
        self.finished_tokens += tokens
        self.tick()

    def set_done(self, done: int) -> None:
        self.done = done
        self.tick()

    def tick(self) -> None:
        now = time.monotonic()
        if self.mode == "off" or now - self._start < self._delay or now - self._last < self._interval:
            return
        self._last = now
        self._show(now)

    def _show(self, now: float) -> None:
        self.shown = True
        if self.mode == "bar":
            width = shutil.get_terminal_size((100, 24)).columns - 1  # one line that never wraps
            self._stream.write("\r\x1b[K" + self.bar_line(now)[:width])
            self._on_line = True
        else:
            self._stream.write(self.line(now) + "\n")
        self._stream.flush()

    def _figures(self, now: float) -> tuple:
        elapsed = max(now - self._start, 1e-9)
        tokens = self.tokens
        return elapsed, tokens, tokens / elapsed

    def line(self, now: float | None = None) -> str:
        """The plain line: ``eprt run: 12/64 requests done, 0 failed, 3456 tokens generated, ...``."""
        elapsed, tokens, rate = self._figures(time.monotonic() if now is None else now)
        return (
            f"{self.what}: {self.done}/{self.total} requests done, {self.failed} failed, {tokens} tokens generated, "
            f"{rate:.1f} tokens/s, {elapsed:.0f}s"
        )

    def bar_line(self, now: float | None = None) -> str:
        """The terminal line: ``eprt run  12/64 [####......]  19% | 3,456 tok | 1,912 tok/s | 0:02<0:07``."""
        now = time.monotonic() if now is None else now
        elapsed, tokens, rate = self._figures(now)
        part = self.done / self.total if self.total else 1.0
        if self.budget and self.done < self.total:
            part = max(part, min(tokens / self.budget, 0.99))
        cells = int(part * _BAR_CELLS)
        left = "?" if part <= 0 else clock(elapsed * (1 - part) / part) if part < 1 else clock(0)
        failed = f" | {self.failed} failed" if self.failed else ""
        return (
            f"{self.what} {self.done}/{self.total} [{'#' * cells}{'.' * (_BAR_CELLS - cells)}] {part:4.0%} | "
            f"{tokens:,} tokens | {rate:,.0f} tokens/s | {clock(elapsed)}<{left}{failed}"
        )

    def close(self, final: bool = False) -> None:
        """Show the final state (when something was shown, or ``final``), ending the terminal line."""
        for h in self._handlers:
            h.removeFilter(self._before_log)
        if self.mode == "off" or not (self.shown or final):
            return
        self._show(time.monotonic())
        if self.mode == "bar":
            self._stream.write("\n")
            self._on_line = False
            self._stream.flush()
