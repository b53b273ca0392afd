"""The engine's scheduler loop on the main thread (MPI stays there; clients run on other
threads): the first SIGINT/SIGTERM finishes what is in flight, a second raises
KeyboardInterrupt, SIGUSR1 (a rank died: the transport's links or MPICH's launcher say so) raises
the transport's ``WorkerFailed`` naming it, else ``RankLost``; ``health()`` reports a
failed loop or one stalled with work pending (docs/serving.md).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass

from eprt.api import ENGINE_FAILED, JobFailure

log = logging.getLogger("eprt.serve")

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_WATCH_S = 0.25  # how often the progress watcher samples the engine's counters


class RankLost(JobFailure):
    """The MPI launcher reported (SIGUSR1) that a rank of the job died; ``ranks``: the worker
    ranks that then did not answer a ping (empty if none could be named)."""

    def __init__(self, ranks: list):
        who = "rank " + ", ".join(map(str, ranks)) if ranks else "a rank"
        super().__init__(f"{who} died (the MPI launcher reported it with SIGUSR1; it no longer answers)")
        self.ranks = ranks


@dataclass(frozen=True)
class Health:
    ok: bool
    status: str  # "ok", "shutting down", "failed", "stalled"
    detail: str = ""


class EngineLoop:
    def __init__(self, engine, stall_s: float = 30.0):
        self.engine = engine
        self.stall_s = stall_s  # pending work and no scheduler step for this long: unhealthy
        self.stop = threading.Event()  # set to ask the loop to finish in-flight work and return
        self.stopped = threading.Event()  # set once the loop has returned (or failed)
        self.signalled = False  # whether a signal (not the program) asked to stop
        self.failure: BaseException | None = None  # what ended the loop, if it failed
        self._progress_at = time.monotonic()  # last time a step was seen, or no work pending
        self._ticks = None

    def run(self) -> None:
        """Run the engine loop until ``stop`` is set and in-flight requests are done; on a
        failure, end every request in flight with an error, record it and re-raise."""
        installed = threading.current_thread() is threading.main_thread()
        previous = {}
        if installed:
            previous = {s: signal.signal(s, self._on_signal) for s in _SIGNALS}
            previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._on_rank_lost)
        threading.Thread(target=self._watch, name="eprt-progress", daemon=True).start()
        try:
            self.engine.serve_forever(self.stop)
        except BaseException as e:
            self.failure = e
            self.engine.fail(f"{ENGINE_FAILED}: {type(e).__name__}: {e}")  # a failure outside a step too
            raise
        finally:
            self.stopped.set()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def health(self) -> Health:
        if self.failure is not None:
            return Health(False, "failed", f"{type(self.failure).__name__}: {self.failure}")
        if self.stop.is_set() or self.stopped.is_set():
            return Health(False, "shutting down")
        idle_s = time.monotonic() - self._progress_at
        if idle_s > self.stall_s:
            return Health(
                False,
                "stalled",
                f"work is pending and no scheduler step completed for {idle_s:.1f}s (limit {self.stall_s:g}s)",
            )
        return Health(True, "ok")

    def _watch(self) -> None:
        """Note the time of every new scheduler step, or of having nothing to do."""
        while not self.stopped.wait(_WATCH_S):
            stats = self.engine.stats()
            ticks, pending = stats.get("ticks"), stats.get("running", 0) + stats.get("waiting", 0)
            if ticks != self._ticks or not pending:
                self._ticks, self._progress_at = ticks, time.monotonic()

    def _on_signal(self, signum, frame) -> None:
        if self.stop.is_set():
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: abandoning in-flight work")
        self.signalled = True
        self.stop.set()
        log.warning(
            "%s: finishing in-flight requests, then shutting down (send it again to abort)", signal.Signals(signum).name
        )

    def _on_rank_lost(self, signum, frame) -> None:
        transport = getattr(self.engine, "transport", None)
        if transport is None:
            raise RankLost([])
        if transport.failed is not None:
            return  # a second notice of a failure already raised
        transport.check_peers()  # a rank whose link closed (or that reported an error), named
        raise RankLost(transport.unresponsive_ranks())
