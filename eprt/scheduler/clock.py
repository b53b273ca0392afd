"""Clocks that request deadlines are measured on.

The scheduler reads ``now()`` and calls ``end_tick()`` once at the end of every tick,
just before it checks deadlines. A request submitted with a timeout of ``t`` gets the
deadline ``now() + t`` and times out at the end of the first tick where
``now() >= deadline``.
"""

from __future__ import annotations

import time


class WallClock:
    """Seconds on the monotonic clock: what real runs use."""

    def now(self) -> float:
        return time.monotonic()

    def end_tick(self) -> None:
        pass


class VirtualClock:
    """Counts completed ticks: what scenarios use, so traces do not depend on speed.

    During tick K the clock reads K - 1 (ticks completed so far) and it reads K once the
    tick ends; a request arriving at tick A with ``timeout_ticks = T`` therefore times out
    at the end of tick A + T - 1 ("the T-th tick after arrival", counting tick A).
    """

    def __init__(self) -> None:
        self.ticks = 0

    def now(self) -> float:
        return float(self.ticks)

    def end_tick(self) -> None:
        self.ticks += 1
