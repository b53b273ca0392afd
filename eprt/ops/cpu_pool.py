"""The threads a rank's compiled kernels share out a call's work with (``--cpu-threads``).

A call is cut into chunks (panels of a product, rows of attention) that threads take one at a
time from an atomic counter (``cpu_simd.claim``): the calling thread starts at once and takes
chunk after chunk, and the pool's threads, woken when the call is posted, take what is left when
they get a core. So the caller never waits for a thread that has not started (on a busy machine a
thread can wait milliseconds for a core; a barrier at every call made 2 threads 8x slower than 1
there), only for chunks already taken. Each chunk is computed whole by one thread, so which
thread took it never changes a bit. Pure Python: the kernels it runs release the GIL.
"""

from __future__ import annotations

import threading
import time

import numpy as np


class ChunkPool:
    """Up to ``size`` helper threads, started on first use, that join each posted call."""

    def __init__(self):
        self._cond = threading.Condition()
        self._job: tuple | None = None  # (generation, fn, args, helpers wanted, the helpers' errors)
        self._generation = 0
        self._threads: list = []
        self._one_call = threading.Lock()  # calls from several threads take turns

    def _grow(self, helpers: int) -> None:
        while len(self._threads) < helpers:
            t = threading.Thread(target=self._help, args=(len(self._threads),), name="eprt-cpu", daemon=True)
            self._threads.append(t)
            t.start()

    def _help(self, index: int) -> None:
        seen = 0
        while True:
            with self._cond:
                while self._job is None or self._job[0] == seen:
                    self._cond.wait()
                seen, fn, args, wanted, errors = self._job
            if index < wanted:
                try:
                    fn(*args)  # takes chunks until none is left (a late call finds none)
                except BaseException as e:  # noqa: BLE001 - the caller raises it
                    errors.append(e)

    def run(self, fn, args: tuple, counters: np.ndarray, chunks: int, threads: int) -> None:
        """fn(*args, counters) on this thread and up to ``threads`` - 1 helpers; fn takes chunks
        (claim(counters, 0) < chunks) and counts each one done (claim(counters, 1)). Returns when
        all ``chunks`` are done."""
        args = (*args, counters)
        if threads <= 1 or chunks <= 1:
            fn(*args)
            return
        with self._one_call:
            self._grow(threads - 1)
            errors: list = []
            with self._cond:
                self._generation += 1
                self._job = (self._generation, fn, args, threads - 1, errors)
                self._cond.notify_all()
            fn(*args)
            while counters[1] < chunks:  # chunks a helper took and is still computing
                if errors:
                    raise RuntimeError(f"a compute thread failed: {errors[0]!r}") from errors[0]
                time.sleep(0)
            with self._cond:
                self._job = None


POOL = ChunkPool()
THREAD_MIN_BYTES = 1 << 18  # a product uses another thread per this many bytes of weights it reads
CHUNKS_PER_THREAD = 4  # a shared call is cut into this many chunks per thread


def new_counters() -> np.ndarray:
    """[taken, done] for one call."""
    return np.zeros(2, np.int64)


def threads_for(threads: int, weight_bytes: int) -> int:
    """The threads worth using on a product reading ``weight_bytes`` of weights: at most one per
    THREAD_MIN_BYTES (waking a thread for less costs more than it saves)."""
    return max(1, min(threads, weight_bytes // THREAD_MIN_BYTES))


def share(fn, args: tuple, units: int, threads: int) -> None:
    """fn(*args, chunks, counters) over ``units`` panels or rows (CHUNKS_PER_THREAD chunks a thread),
    on ``threads`` threads: the compiled kernels' shared-out calls."""
    chunks = 1 if threads <= 1 else min(units, CHUNKS_PER_THREAD * threads)
    POOL.run(fn, (*args, chunks), new_counters(), chunks, threads)
