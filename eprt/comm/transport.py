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
flush, prints it and raises ``WorkerFailed``; the engine fails every request in flight, closes the
transport (which sends every worker the "going down" notice), and every rank exits non-zero.
Rank 0 closing (or exiting) without having sent SHUTDOWN sends the same notice. If rank 0
never answers a report, the worker aborts the job itself after the collective timeout.
A rank killed outright (``kill -9``) is handled by MPICH's hydra, which tears the whole job
down with a non-zero exit at once; the watchdog covers launchers that do not.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, fields

import numpy as np

from eprt.comm.protocol import WORD_MAX, Command, ProtocolError, Shutdown, as_words, encode
from eprt.comm.slots import SlotMirror, StreamChecker

DEFAULT_FRAME_WORDS = 512


class WorkerFailed(RuntimeError):
    """Raised on rank 0 when worker ``rank`` reported ``error``; the job cannot continue."""

    def __init__(self, rank: int, error: str):
        super().__init__(f"rank {rank} failed: {error}")
        self.rank, self.error = rank, error


class CollectiveTimeout(WorkerFailed):
    """Raised on rank 0 (when ``watchdog_raises``) for a collective overdue past the timeout;
    ``rank`` is the first rank that did not answer a ping (-1: none could be named)."""

    def __init__(self, late: list, what: str, timeout: float):
        who = _ranks(late) if late else "no rank could be named"
        super().__init__(late[0] if late else -1, f"{what} did not complete within {timeout:g} s "
                                                  f"(EPRT_COLLECTIVE_TIMEOUT); not answering a ping: {who}")
        self.late = late


class RootDown(RuntimeError):
    """Raised on a worker when rank 0 reports it is going down without a SHUTDOWN command."""


class StartupFailed(RuntimeError):
    """Raised on every rank by ``startup_barrier`` when any rank could not start."""

    def __init__(self, failures: list):
        self.failures = failures              # [(rank, error text)]
        by_text: dict = {}
        for rank, text in failures:           # the same error on many ranks is said once
            by_text.setdefault(text, []).append(rank)
        super().__init__("; ".join(f"{_ranks(ranks)} could not start: {text}" for text, ranks in by_text.items()))


def _ranks(ranks: list) -> str:
    """"rank 3", "ranks 0, 2" or "ranks 0-8"."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


STARTUP_ERROR_BYTES = 480  # error text each rank contributes to the start-up exchange


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
        # rank 0: an overdue collective raises CollectiveTimeout (the caller answers its clients,
        # then calls abort) instead of aborting the job at once
        self.watchdog_raises = False

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
        return self._sum(np.ascontiguousarray(partial))

    def _sum(self, partial: np.ndarray) -> np.ndarray:
        """The rank-ordered sum, gathered everywhere: summing the gathered partials in rank
        order does the same float operations on the same data on every rank, so the result
        is bitwise identical everywhere. An MPI Allreduce does not promise that (its
        reduction order may differ between ranks and algorithms), and a single differing bit
        would let the ranks' KV drift apart. The price, P x the bytes of a reduce, is small
        for decode-sized T (MpiTransport switches to a reduce-scatter for large partials)."""
        gathered = self._gather(partial)  # [P, *partial.shape]
        out = gathered[0].copy()
        for r in range(1, self.size):
            out += gathered[r]
        return out

    def startup_barrier(self, error: str | None = None) -> None:
        """Every rank calls it once it has loaded its model, or failed to (``error``); waits
        without a time limit, then raises StartupFailed on every rank if any rank failed."""
        if error:
            raise StartupFailed([(self.rank, error)])

    def allgather_text(self, text: str) -> list[str]:
        """Every rank's ``text`` (at most STARTUP_ERROR_BYTES of UTF-8), in rank order, on
        every rank (start-up only: no time limit)."""
        return [text]

    def close(self, reason: str | None = None) -> None:
        """Rank 0 leaving without a SHUTDOWN (an error) tells every worker to leave too."""
        self.closed = True

    def unresponsive_ranks(self, wait_s: float = 1.0) -> list:
        """Rank 0: the worker ranks that do not answer a ping within ``wait_s`` (dead, stopped,
        or stuck outside the transport)."""
        return []

    def abort(self, message: str) -> None:
        """End the whole job now, non-zero, after printing ``message``."""
        print(message, file=sys.stderr, flush=True)
        os._exit(1)

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
    variables, not eprt settings: MPICH/Hydra and Intel MPI (and Slurm's PMI-2) set PMI_SIZE,
    Open MPI OMPI_COMM_WORLD_SIZE, MVAPICH2 MV2_COMM_WORLD_SIZE, and ``srun`` the step's task
    count (with ``--mpi=pmix`` it is the only one set). In a batch script outside ``srun``
    the step has one task, so a plain ``eprt`` there runs as a world of one."""
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS"):
        value = os.environ.get(name)
        if value:
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"launcher variable {name}={value!r} is not a task count") from None
    return 1


def open_transport(max_slots: int | None = None, vocab_size: int | None = None,
                   frame_words: int = DEFAULT_FRAME_WORDS) -> Transport:
    """The transport for this process: ``LocalTransport`` in a world of one, else an
    ``MpiTransport`` on COMM_WORLD. With ``max_slots`` rank 0 checks its own stream."""
    checker = StreamChecker(max_slots, vocab_size) if max_slots is not None else None
    if launcher_world_size() == 1:
        return LocalTransport(checker, frame_words)
    from eprt.comm.mpi_transport import MpiTransport
    return MpiTransport(checker=checker, frame_words=frame_words)
