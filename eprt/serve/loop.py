"""The engine's scheduler loop on the main thread, stopped by an event or by SIGINT/SIGTERM.

MPI stays on the main thread, so ``eprt serve`` and ``eprt run`` both do their client
work (HTTP handlers, the batch writer) on other threads and hand the main thread to
``EngineLoop.run``. The first SIGINT/SIGTERM sets ``stop``: the engine stops taking
work, finishes what is in flight and returns, and the launcher then shuts the worker
ranks down. A second signal raises ``KeyboardInterrupt`` to abandon in-flight work.
"""
from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger("eprt.serve")

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class EngineLoop:
    def __init__(self, engine):
        self.engine = engine
        self.stop = threading.Event()      # set to ask the loop to finish in-flight work and return
        self.stopped = threading.Event()   # set once the loop has returned (or failed)
        self.signalled = False             # whether a signal (not the program) asked to stop

    def run(self) -> None:
        """Run the engine loop until ``stop`` is set and in-flight requests are done."""
        installed = threading.current_thread() is threading.main_thread()
        previous = {s: signal.signal(s, self._on_signal) for s in _SIGNALS} if installed else {}
        try:
            self.engine.serve_forever(self.stop)
        finally:
            self.stopped.set()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _on_signal(self, signum, frame) -> None:
        if self.stop.is_set():
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: abandoning in-flight work")
        self.signalled = True
        self.stop.set()
        log.warning("%s: finishing in-flight requests, then shutting down (send it again to abort)",
                    signal.Signals(signum).name)
