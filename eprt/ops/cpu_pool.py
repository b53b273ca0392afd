"""The threads a rank's compiled kernels share out a call's work with (``--cpu-threads``).

A call is cut into chunks (panels of a product, rows of attention) that threads take one at a
time from an atomic counter (``cpu_simd.claim``): the calling thread starts at once and takes
chunk after chunk, and the pool's threads, woken when the call is posted, take what is left when
they get a core. So the caller never waits for a thread that has not started (on a busy machine a
thread can wait milliseconds for a core; a barrier at every call made 2 threads 8x slower than 1
there), only for chunks already taken: the chunks shrink as the call goes on (``spans``), so that
wait is a small chunk's. A helper that finished a call watches for the next one for about a
millisecond (compiled, the GIL released: ``cpu_simd.await_post``) before it sleeps, so the calls
of a step find it awake (a sleeping thread took 70 - 100 us to join a call on this machine's
virtual cores, spinning ~30). Each chunk is computed whole by one thread, so which thread took it
never changes a bit. Pure Python: the kernels it runs release the GIL.
"""

from __future__ import annotations

import functools
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
        self._posted = np.zeros(1, np.int64)  # the generation of the last call posted, for watching helpers

    def _grow(self, helpers: int) -> None:
        watch = _watcher() if len(self._threads) < helpers else None
        while len(self._threads) < helpers:
            args = (len(self._threads), watch)
            t = threading.Thread(target=self._help, args=args, name="eprt-cpu", daemon=True)
            self._threads.append(t)
            t.start()

    def _help(self, index: int, watch) -> None:
        seen = 0
        while True:
            if watch is not None:
                watch(self._posted, seen)  # returns at the next post, or after about a millisecond
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
        if threads <= 1:
            fn(*args)
            return
        with self._one_call:
            self._grow(threads - 1)
            errors: list = []
            with self._cond:
                self._generation += 1
                self._job = (self._generation, fn, args, threads - 1, errors)
                self._posted[0] = self._generation
                self._cond.notify_all()
            fn(*args)
            while counters[1] < chunks:  # chunks a helper took and is still computing
                if errors:
                    raise RuntimeError(f"a compute thread failed: {errors[0]!r}") from errors[0]
                time.sleep(0)
            with self._cond:
                self._job = None


def _watcher():
    """The compiled watch helpers wait in before they sleep (None without numba: they sleep at once)."""
    try:
        from eprt.ops.cpu_simd import await_post
    except ImportError:
        return None
    return await_post


POOL = ChunkPool()
THREAD_MIN_BYTES = 1 << 18  # a product uses another thread per this many bytes of weights it reads
SHRINK = 2  # each chunk of a call is what is left / (SHRINK * threads): the last ones are small


def new_counters() -> np.ndarray:
    """[taken, done] for one call."""
    return np.zeros(2, np.int64)


def threads_for(threads: int, weight_bytes: int) -> int:
    """The threads worth using on a product reading ``weight_bytes`` of weights: at most one per
    THREAD_MIN_BYTES (waking a thread for less costs more than it saves)."""
    return max(1, min(threads, weight_bytes // THREAD_MIN_BYTES))


@functools.lru_cache(maxsize=1024)
def spans(units: int, threads: int, even: int = 0) -> np.ndarray:
    """Chunk edges [chunks + 1] over ``units`` panels or rows for ``threads`` threads (chunk j is
    units edges[j] .. edges[j + 1]; never written): ``even`` > 0, min(units, even * threads) equal
    chunks (for calls whose every chunk reads all the weights); else chunks of what is left /
    (SHRINK * threads), at least one unit, so the first are large (few claims) and the last small
    (little time waiting for another thread's last one)."""
    if threads <= 1 or units <= 1:
        return np.array([0, max(units, 0)], np.int64)
    if even:
        chunks = min(units, even * threads)
        return np.array([j * units // chunks for j in range(chunks + 1)], np.int64)
    edges = [0]
    while edges[-1] < units:
        edges.append(edges[-1] + max(1, (units - edges[-1]) // (SHRINK * threads)))
    return np.array(edges, np.int64)


def share(fn, args: tuple, units: int, threads: int, even: int = 0) -> None:
    """fn(*args, edges, counters) over ``units`` panels or rows in the chunks ``spans`` gives, on
    ``threads`` threads: the compiled kernels' shared-out calls."""
    edges = spans(units, threads, even)
    POOL.run(fn, (*args, edges), new_counters(), len(edges) - 1, threads if len(edges) > 2 else 1)
