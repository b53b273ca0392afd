"""The transport: rank 0's word stream to the workers, the vision rows, the MoE combine and
the error channel, over mpi4py with NumPy buffers (no pickle anywhere).

Three duplicated communicators keep the traffic apart: ``ctl`` (the broadcast stream),
``moe`` (the combines inside forward passes) and ``err`` (worker error reports and rank 0's
"going down" notices), so a stray message on one can never match a receive on another.

Framing. Rank 0 appends logical words (``send_word``/``send_words``/``send_command``) and
``flush()`` sends them as one Bcast of a fixed ``frame_words`` buffer whose first word is
the count, plus one more Bcast of exactly the rest when the words overflow it. So a decode
step costs one Bcast plus the combines. ``send_vision`` appends the PREFILL's vision count
word and, when it is non-zero, flushes and broadcasts the float32 rows right after.

Waiting. Every collective is non-blocking and waited on by polling with short, growing
sleeps (ranks oversubscribed on few cores must not starve each other). While it waits,
rank 0 watches the error channel and raises ``WorkerFailed`` (after printing
``eprt: rank K failed: <error>``); a worker watches for rank 0's notice and raises
``RootDown``. A compute-time wait that exceeds EPRT_COLLECTIVE_TIMEOUT aborts the job; a
worker waiting for its next command never times out (a server may idle for hours), and
neither does ``startup_barrier`` (ranks load their weights at different speeds).

Failures. A worker that fails calls ``report_error``: rank 0 sees it at its next wait or
flush, prints it and raises ``WorkerFailed``; the runner fails its requests and closes the
transport, which sends every worker the "going down" notice, and every rank exits non-zero.
Rank 0 closing (or exiting) without having sent SHUTDOWN sends the same notice. If rank 0
never answers a report, the worker aborts the job itself after the collective timeout.
A rank killed outright (``kill -9``) is handled by MPICH's hydra, which tears the whole job
down with a non-zero exit at once; the watchdog covers launchers that do not.
"""
from __future__ import annotations

import atexit
import os
import sys
import time
from dataclasses import dataclass, fields

import numpy as np

from eprt import env
from eprt.comm.protocol import WORD_MAX, Command, ProtocolError, Shutdown, as_words, encode
from eprt.comm.slots import SlotMirror, StreamChecker

TAG_WORKER_ERROR = 1  # worker -> rank 0: utf-8 error text (the sender is the failing rank)
TAG_ROOT_DOWN = 2     # rank 0 -> worker: utf-8 reason; rank 0 is going down without SHUTDOWN
BUSY_SLEEP_MAX = 1e-4  # s, longest sleep between polls inside a compute-time collective
IDLE_SLEEP_MAX = 5e-3  # s, longest sleep while a worker waits for its next command
ABORT_GRACE = 0.5      # s between printing why and aborting, so the message reaches the terminal
DEFAULT_FRAME_WORDS = 512


class WorkerFailed(RuntimeError):
    """Raised on rank 0 when worker ``rank`` reported ``error``; the job cannot continue."""

    def __init__(self, rank: int, error: str):
        super().__init__(f"rank {rank} failed: {error}")
        self.rank, self.error = rank, error


class RootDown(RuntimeError):
    """Raised on a worker when rank 0 reports it is going down without a SHUTDOWN command."""


@dataclass
class CommStats:
    """Counters of communication started by this rank (polls are not counted)."""
    mpi_calls: int = 0    # Ibcast, Iallgather and error-channel sends
    bcasts: int = 0
    bcast_bytes: int = 0  # bytes of the broadcast buffers (frames and rows)
    allsums: int = 0       # MoE combines (in a world of one too, where they cost nothing)
    allsum_bytes: int = 0  # bytes this rank contributed to combines
    frames: int = 0        # flushes that carried words (rank 0)
    words: int = 0         # logical words sent (rank 0)

    def copy(self) -> CommStats:
        return CommStats(**{f.name: getattr(self, f.name) for f in fields(self)})

    def __sub__(self, other: CommStats) -> CommStats:
        return CommStats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})


class Transport:
    """The API both world sizes share. Rank 0: ``send_*``, ``flush``, ``shutdown``. Workers:
    ``recv_frame``, ``recv_rows``, ``report_error``. Everyone: ``startup_barrier``,
    ``allsum``, ``close``.

    ``checker`` (rank 0 only) decodes every outgoing frame onto a slot mirror first, so a
    stream the workers would reject raises ``ProtocolError`` here instead.
    """

    def __init__(self, rank: int, size: int, checker: StreamChecker | None, frame_words: int):
        if frame_words < 16:
            raise ValueError(f"frame_words must be >= 16, got {frame_words}")
        self.rank, self.size = rank, size
        self.stats = CommStats()
        self.checker = checker if rank == 0 else None
        self.frame_words = frame_words
        self._out = np.zeros(frame_words, np.uint32)  # word 0: count, then the pending words
        self._n = 1
        self._shutdown_sent = False
        self.closed = False

    @property
    def mirror(self) -> SlotMirror | None:
        """Rank 0's view of the slots after the frames sent so far (None without a checker)."""
        return self.checker.mirror if self.checker is not None else None

    # -- rank 0 ------------------------------------------------------------------------------
    def send_word(self, word: int) -> None:
        if not 0 <= word <= WORD_MAX:
            raise ProtocolError(f"{word} is not an unsigned 32-bit protocol word")
        self._append(np.array([word], np.uint32))

    def send_words(self, words) -> None:
        self._append(as_words(words))

    def send_command(self, cmd: Command) -> None:
        self._append(encode(cmd))

    def send_vision(self, rows: np.ndarray | None) -> None:
        """The vision sync of a PREFILL: the row count word, then (if any) the rows."""
        n = 0 if rows is None else len(rows)
        if n and (not isinstance(rows, np.ndarray) or rows.ndim != 2 or rows.dtype.kind != "f"):
            raise ValueError(f"vision rows must be a 2-D float array [rows, hidden], got {rows!r:.80}")
        self.send_word(n)
        if n:
            self.flush()
            if self.size > 1:
                self._send_rows(np.ascontiguousarray(rows, np.float32))

    def flush(self) -> None:
        """Send every pending word (no MPI call when none is pending)."""
        self._require_root("flush")
        self._check_channel()
        n = self._n - 1
        if n == 0:
            return
        if self.checker is not None:
            self.checker.feed(self._out[1:self._n])
        self._out[0] = n
        if self.size > 1:
            self._send_frame(self._out, n)
        self._n = 1
        self.stats.frames += 1
        self.stats.words += n

    def shutdown(self) -> None:
        """Send SHUTDOWN (the last command of every run) and flush it."""
        self.send_command(Shutdown())
        self.flush()
        self._shutdown_sent = True

    # -- everyone ------------------------------------------------------------------------------
    def allsum(self, partial: np.ndarray) -> np.ndarray:
        """The MoE combine: the sum over ranks of ``partial`` (float32, same shape everywhere),
        bitwise identical on every rank. Rank 0 flushes pending words first (workers cannot
        join a forward pass whose command they have not received). In a world of one it
        returns ``partial`` itself."""
        if not isinstance(partial, np.ndarray) or partial.dtype != np.float32:
            raise TypeError(f"allsum takes a float32 ndarray, got {getattr(partial, 'dtype', type(partial))}")
        if self.rank == 0:
            self.flush()
        self.stats.allsums += 1
        if self.size == 1:
            return partial
        self.stats.mpi_calls += 1
        self.stats.allsum_bytes += partial.nbytes
        gathered = self._gather(np.ascontiguousarray(partial))  # [P, *partial.shape]
        # Summing the gathered partials in rank order does the same float operations on the
        # same data on every rank, so the result is bitwise identical everywhere. An MPI
        # Allreduce does not promise that (its reduction order may differ between ranks and
        # algorithms), and a single differing bit would let the ranks' KV drift apart. The
        # price, P x the bytes of a reduce, is small for decode-sized T.
        out = gathered[0].copy()
        for r in range(1, self.size):
            out += gathered[r]
        return out

    def startup_barrier(self) -> None:
        """Every rank calls it once its model is loaded, before the first command."""

    def close(self, reason: str | None = None) -> None:
        """Rank 0 leaving without a SHUTDOWN (an error) tells every worker to leave too."""
        self.closed = True

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(None if exc is None else f"{type(exc).__name__}: {exc}")

    # -- workers and hooks -----------------------------------------------------------------------
    def recv_frame(self) -> np.ndarray:
        raise RuntimeError("recv_frame: this rank has no rank 0 to receive from")

    def recv_rows(self, n: int, width: int) -> np.ndarray:
        raise RuntimeError("recv_rows: this rank has no rank 0 to receive from")

    def report_error(self, text: str) -> None:
        raise RuntimeError("report_error is for worker ranks")

    def _append(self, words: np.ndarray) -> None:
        self._require_root("send")
        end = self._n + len(words)
        if end > len(self._out):
            grown = np.zeros(max(end, 2 * len(self._out)), np.uint32)
            grown[:self._n] = self._out[:self._n]
            self._out = grown
        self._out[self._n:end] = words
        self._n = end

    def _require_root(self, what: str) -> None:
        if self.rank != 0:
            raise RuntimeError(f"{what}: only rank 0 sends commands (this is rank {self.rank})")

    def _check_channel(self) -> None:
        pass

    def _send_frame(self, out: np.ndarray, n: int) -> None:
        pass  # a world of one: nobody to send to

    def _send_rows(self, rows: np.ndarray) -> None:
        pass

    def _gather(self, partial: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class LocalTransport(Transport):
    """A world of one rank: the stream is only checked and counted; no MPI at all."""

    def __init__(self, checker: StreamChecker | None = None, frame_words: int = DEFAULT_FRAME_WORDS):
        super().__init__(0, 1, checker, frame_words)


def launcher_world_size() -> int:
    """The world size the MPI launcher announced (1 when not launched by one), read without
    importing mpi4py so a single-rank run never loads MPI. These are the launchers' own
    variables (MPICH/hydra, Slurm PMI, Open MPI), not eprt settings."""
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        value = os.environ.get(name)
        if value:
            return int(value)
    return 1


def open_transport(max_slots: int | None = None, vocab_size: int | None = None,
                   frame_words: int = DEFAULT_FRAME_WORDS) -> Transport:
    """The transport for this process: ``LocalTransport`` in a world of one, else an
    ``MpiTransport`` on COMM_WORLD. With ``max_slots`` rank 0 checks its own stream."""
    checker = StreamChecker(max_slots, vocab_size) if max_slots is not None else None
    if launcher_world_size() == 1:
        return LocalTransport(checker, frame_words)
    return MpiTransport(checker=checker, frame_words=frame_words)


class MpiTransport(Transport):
    """The transport over ``comm`` (COMM_WORLD by default); construct it on every rank in the
    same order (it duplicates communicators, a collective)."""

    def __init__(self, comm=None, checker: StreamChecker | None = None,
                 frame_words: int = DEFAULT_FRAME_WORDS, timeout: float | None = None):
        from mpi4py import MPI
        self._MPI = MPI
        self._world = MPI.COMM_WORLD if comm is None else comm
        super().__init__(self._world.Get_rank(), self._world.Get_size(), checker, frame_words)
        self.timeout = float(env.COLLECTIVE_TIMEOUT.get() if timeout is None else timeout)
        if not self.timeout > 0:
            raise ValueError(f"EPRT_COLLECTIVE_TIMEOUT must be > 0 seconds, got {self.timeout:g}")
        self._ctl, self._moe, self._err = self._world.Dup(), self._world.Dup(), self._world.Dup()
        self._inflight = False      # a wait was left by an exception: the comms are unusable
        self._failed: WorkerFailed | None = None
        if self.rank == 0:
            atexit.register(self._at_exit)  # a rank 0 that dies of an exception still frees the workers

    # -- the hooks of Transport ----------------------------------------------------------------
    def _send_frame(self, out: np.ndarray, n: int) -> None:
        fw = self.frame_words
        self._bcast(out[:fw], "a command frame")
        if n + 1 > fw:
            self._bcast(out[fw:n + 1], "a command frame's overflow")

    def _send_rows(self, rows: np.ndarray) -> None:
        self._bcast(rows, "the vision rows")

    def _gather(self, partial: np.ndarray) -> np.ndarray:
        gathered = np.empty((self.size,) + partial.shape, np.float32)  # [P, *partial.shape]
        self._wait(self._moe.Iallgather(partial, gathered), "the MoE combine")
        return gathered

    def startup_barrier(self) -> None:
        """Wait, without a time limit, until every rank has loaded its model: ranks load at
        different speeds, and only after this barrier are the collectives timed."""
        if self.size == 1:
            return
        self.stats.mpi_calls += 1
        self._wait(self._ctl.Ibarrier(), "the start-up barrier", idle=True)

    def recv_frame(self) -> np.ndarray:
        """The words of rank 0's next frame; waits without a time limit (the server may idle)."""
        self._require_worker("recv_frame")
        fw = self.frame_words
        frame = np.empty(fw, np.uint32)
        self._bcast(frame, "the next command", idle=True)
        n = int(frame[0])
        if n < fw:
            return frame[1:n + 1]
        rest = np.empty(n + 1 - fw, np.uint32)
        self._bcast(rest, "a command frame's overflow")
        return np.concatenate([frame[1:], rest])

    def recv_rows(self, n: int, width: int) -> np.ndarray:
        self._require_worker("recv_rows")
        rows = np.empty((n, width), np.float32)  # [rows, hidden]
        self._bcast(rows, "the vision rows")
        return rows

    def report_error(self, text: str) -> None:
        """Tell rank 0 this worker failed, then wait for rank 0's notice that the job is going
        down; if none comes within the collective timeout, abort the job from here."""
        self._require_worker("report_error")
        data = np.frombuffer(text.encode("utf-8", "replace"), np.uint8)
        req = self._err.Isend(data, dest=0, tag=TAG_WORKER_ERROR)
        self.stats.mpi_calls += 1
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self._root_notice() is not None:
                req.Test()
                return
            time.sleep(BUSY_SLEEP_MAX)
        self._abort(f"eprt: rank {self.rank} failed: {text}\neprt: rank {self.rank}: rank 0 did not "
                    f"answer the error report within {self.timeout:g} s; aborting the job")

    def close(self, reason: str | None = None) -> None:
        """Release the communicators. Rank 0 closing without a SHUTDOWN sent (or after a
        worker failed) sends every worker the notice instead, so none waits forever."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self._at_exit)
        if self.rank == 0 and (not self._shutdown_sent or self._failed or self._inflight):
            why = reason or "rank 0 stopped without SHUTDOWN"
            if self._failed is not None and str(self._failed) not in why:
                why = f"{why} ({self._failed})"
            self._notify_workers(why)
        elif not self._inflight:
            for c in (self._ctl, self._moe, self._err):
                c.Free()

    # -- waiting, the watchdog and the error channel ------------------------------------------------
    def _bcast(self, buf: np.ndarray, what: str, idle: bool = False) -> None:
        self.stats.mpi_calls += 1
        self.stats.bcasts += 1
        self.stats.bcast_bytes += buf.nbytes
        self._wait(self._ctl.Ibcast(buf, root=0), what, idle)

    def _wait(self, req, what: str, idle: bool = False) -> None:
        """Poll ``req`` to completion with growing sleeps, watching the error channel; a
        compute-time wait (not ``idle``) longer than the collective timeout aborts the job."""
        self._inflight = True
        deadline = None if idle else time.monotonic() + self.timeout
        delay, cap = 0.0, IDLE_SLEEP_MAX if idle else BUSY_SLEEP_MAX
        while not req.Test():
            self._check_channel()
            if deadline is not None and time.monotonic() > deadline:
                self._watchdog(what)
            time.sleep(delay)
            delay = min(cap, 2 * delay if delay else 1e-5)
        self._inflight = False

    def _check_channel(self) -> None:
        if self.rank != 0:
            reason = self._root_notice()
            if reason is not None:
                raise RootDown(f"rank 0 is going down: {reason}")
            return
        if self._failed is not None:
            raise self._failed
        status = self._MPI.Status()
        if self._err.Iprobe(source=self._MPI.ANY_SOURCE, tag=TAG_WORKER_ERROR, status=status):
            src = status.Get_source()
            text = self._recv_text(src, TAG_WORKER_ERROR, status)
            print(f"eprt: rank {src} failed: {text}", file=sys.stderr, flush=True)
            self._failed = WorkerFailed(src, text)
            raise self._failed

    def _root_notice(self) -> str | None:
        status = self._MPI.Status()
        if self._err.Iprobe(source=0, tag=TAG_ROOT_DOWN, status=status):
            return self._recv_text(0, TAG_ROOT_DOWN, status)
        return None

    def _recv_text(self, src: int, tag: int, status) -> str:
        data = np.empty(status.Get_count(self._MPI.BYTE), np.uint8)
        self._err.Recv(data, source=src, tag=tag)
        return data.tobytes().decode("utf-8", "replace")

    def _notify_workers(self, reason: str) -> None:
        data = np.frombuffer(reason.encode("utf-8", "replace"), np.uint8)
        reqs = [self._err.Isend(data, dest=k, tag=TAG_ROOT_DOWN) for k in range(1, self.size)]
        self.stats.mpi_calls += len(reqs)
        deadline = time.monotonic() + self.timeout
        while not self._MPI.Request.Testall(reqs):
            if time.monotonic() > deadline:
                self._abort(f"eprt: rank 0: could not tell the workers to stop ({reason}); aborting")
            time.sleep(BUSY_SLEEP_MAX)

    def _watchdog(self, what: str) -> None:
        if self.rank == 0:
            try:
                self._check_channel()  # a worker's report explains the stall better than we can
            except WorkerFailed:
                pass
        self._abort(f"eprt: rank {self.rank}: {what} did not complete within {self.timeout:g} s "
                    "(EPRT_COLLECTIVE_TIMEOUT); a rank died or fell out of step; aborting the job")

    def _abort(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)
        time.sleep(ABORT_GRACE)  # MPI_Abort tears the job down before hydra forwards our stderr
        self._world.Abort(1)

    def _require_worker(self, what: str) -> None:
        if self.rank == 0:
            raise RuntimeError(f"{what} is for worker ranks")

    def _at_exit(self) -> None:
        self.close("rank 0 exited without closing its transport")
