"""The transport: rank 0's command frames to the workers, the vision rows, the MoE combine and
the error channel, over mpi4py with NumPy buffers (no pickle anywhere). Framing, waiting and
failure rules: docs/protocol.md ("Framing", "Errors") and docs/design.md ("Failure handling").

``Transport`` is what the rest of eprt calls: the frames (a part, ``FrameQueue``), the combine's
checks and counters, the start-up exchange, closing; the world's link carries the words (a part:
``LocalLink`` in a world of one, ``eprt.comm.mpi_transport.MpiLink`` over MPI, with its error
channel). ``LocalTransport`` and ``MpiTransport`` are the transport on either link.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, fields

import numpy as np

from eprt.comm.protocol import Command, Prefill, Shutdown, encode
from eprt.comm.recorder import Recorder

DEFAULT_FRAME_WORDS = 512


class WorkerFailed(RuntimeError):
    """Raised on rank 0 when worker ``rank`` reported ``error``; the job cannot continue."""

    def __init__(self, rank: int, error: str):
        super().__init__(f"rank {rank} failed: {error}")
        self.rank, self.error = rank, error


class CollectiveTimeout(WorkerFailed):
    """Raised on rank 0 (when ``watchdog_raises``) for a collective overdue past the timeout;
    ``rank`` is the first rank that did not answer (-1: none could be named), ``report`` the
    hang report's lines."""

    def __init__(self, late: list, what: str, timeout: float, report: str = ""):
        who = ranks_text(late) if late else "no rank could be named"
        super().__init__(
            late[0] if late else -1,
            f"{what} did not complete within {timeout:g} s (EPRT_COLLECTIVE_TIMEOUT); not answering: {who}{report}",
        )
        self.late = late


class RootDown(RuntimeError):
    """Raised on a worker when rank 0 reports it is going down without a SHUTDOWN command."""


class StartupFailed(RuntimeError):
    """Raised on every rank by ``startup_barrier`` when any rank could not start."""

    def __init__(self, failures: list):
        self.failures = failures  # [(rank, error text)]
        by_text: dict = {}
        for rank, text in failures:  # the same error on many ranks is said once
            by_text.setdefault(text, []).append(rank)
        super().__init__("; ".join(f"{ranks_text(ranks)} could not start: {text}" for text, ranks in by_text.items()))


def row_bytes(rows: np.ndarray) -> int:
    """Bytes a row of ``rows`` [n, ...] (from its shape: a rank sending no rows still receives some)."""
    return rows.dtype.itemsize * int(np.prod(rows.shape[1:]))


def ranks_text(ranks: list) -> str:
    """ "rank 3", "ranks 0, 2" or "ranks 0-8"."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


STARTUP_ERROR_BYTES = 480  # error text each rank contributes to the start-up exchange


@dataclass
class CommStats:
    """Counters of communication started by this rank (polls are not counted)."""

    mpi_calls: int = 0  # Ibcast, Iallgather and error-channel sends
    bcasts: int = 0
    bcast_bytes: int = 0  # bytes of the broadcast buffers (frames and rows)
    allsums: int = 0  # MoE combines (in a world of one too, where they cost nothing)
    allsum_bytes: int = 0  # bytes this rank contributed to combines
    moe_sent_bytes: int = 0  # MoE exchange bytes this rank put on the wire to other ranks
    moe_recv_bytes: int = 0  # MoE exchange bytes this rank took off the wire from other ranks
    moe_exchange_s: float = 0.0  # wall time inside the MoE exchange's collectives
    frames: int = 0  # flushes that carried words (rank 0)
    words: int = 0  # logical words sent (rank 0)

    def wire(self, sent: int, received: int) -> None:
        """Count MoE exchange bytes this rank sent to and received from other ranks (the link calls it)."""
        self.moe_sent_bytes += int(sent)
        self.moe_recv_bytes += int(received)

    def copy(self) -> CommStats:
        return CommStats(**{f.name: getattr(self, f.name) for f in fields(self)})

    def __sub__(self, other: CommStats) -> CommStats:
        return CommStats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})


class FrameQueue:
    """Rank 0's queued words (word 0 of the buffer: their count), flushed as one frame."""

    def __init__(self, frame_words: int):
        self.out = np.zeros(frame_words, np.uint32)  # word 0: count, then the pending words
        self.n = 1

    @property
    def pending(self) -> int:
        return self.n - 1

    def append(self, words: np.ndarray) -> None:
        end = self.n + len(words)
        if end > len(self.out):
            grown = np.zeros(max(end, 2 * len(self.out)), np.uint32)
            grown[: self.n] = self.out[: self.n]
            self.out = grown
        self.out[self.n : end] = words
        self.n = end


class LocalLink:
    """A world of one rank: nobody to send to or hear from; no MPI at all."""

    rank, size, any_thread, timeout = 0, 1, True, float("inf")

    def bind(self, transport) -> None:
        self.transport = transport

    def send_frame(self, out: np.ndarray, n: int) -> None:
        pass

    def send_rows(self, rows: np.ndarray) -> None:
        pass

    def check_channel(self) -> None:
        pass

    def startup_barrier(self, error: str | None = None) -> None:
        if error:
            raise StartupFailed([(self.rank, error)])

    def allgather_text(self, text: str) -> list[str]:
        return [text]

    def recv_frame(self) -> np.ndarray:
        raise RuntimeError("recv_frame: this rank has no rank 0 to receive from")

    def recv_rows(self, n: int, width: int) -> np.ndarray:
        raise RuntimeError("recv_rows: this rank has no rank 0 to receive from")

    def report_error(self, text: str) -> None:
        raise RuntimeError("report_error is for worker ranks")

    def close(self, reason: str | None = None) -> None:
        self.transport.closed = True
        self.transport.recorder.close()

    def shut_down(self) -> None:
        pass

    def unresponsive_ranks(self, wait_s: float = 2.0) -> list[int]:
        return []

    def abort(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)
        os._exit(1)


class Transport:
    """The API both world sizes share, on a link (``LocalLink``, ``MpiLink``). Rank 0: ``send``,
    ``flush``, ``shutdown``. Workers: ``recv_frame``, ``recv_rows``, ``report_error``. Everyone:
    ``startup_barrier``, ``allsum``, ``close``."""

    def __init__(self, link, frame_words: int = DEFAULT_FRAME_WORDS):
        if frame_words < 16:
            raise ValueError(f"frame_words must be >= 16, got {frame_words}")
        self.link = link
        self.rank, self.size = link.rank, link.size
        self.stats = CommStats()
        self.frame_words = frame_words
        self.collectives = 0  # collectives this rank has started
        self.recorder = Recorder(self.rank, self.size)  # the flight recorder (the engine may swap in one with payloads)
        self.dump_dir: str | None = None  # where dump_frames writes; None: nowhere
        self.queue = FrameQueue(frame_words)
        self.workers_told = False  # SHUTDOWN sent, or every rank knows the job ends: close tells nobody
        self._failed: WorkerFailed | None = None  # rank 0: the worker failure this transport raised
        self.closed = False
        self.any_thread = link.any_thread  # whether collectives may run on another thread than MPI's
        self.timeout = link.timeout  # s a compute-time collective may take (EPRT_COLLECTIVE_TIMEOUT)
        # rank 0: an overdue collective raises CollectiveTimeout (the caller answers its clients,
        # then calls abort) instead of aborting the job at once
        self.watchdog_raises = False
        link.bind(self)

    # -- rank 0 ------------------------------------------------------------------------------
    def send(self, cmd: Command, vision_rows: np.ndarray | None = None) -> None:
        """Queue one command's words (``protocol.encode``); a PREFILL announcing vision rows is
        flushed at once and its ``vision_rows`` [rows, hidden] follow as one broadcast."""
        words = encode(cmd)
        n = len(vision_rows) if vision_rows is not None else 0
        if n != (cmd.vision_rows if isinstance(cmd, Prefill) else 0):
            raise ValueError(
                f"{type(cmd).__name__} announces {getattr(cmd, 'vision_rows', 0)} vision rows but {n} were given"
            )
        if n and (vision_rows.ndim != 2 or vision_rows.dtype.kind != "f"):
            raise ValueError(
                f"vision rows must be a 2-D float array [rows, hidden], got {vision_rows.shape} {vision_rows.dtype}"
            )
        self.send_words(words)
        if n:
            self.flush()
            rows = np.ascontiguousarray(vision_rows, np.float32)
            if self.size > 1:
                self.link.send_rows(rows)
            self.recorder.rows(rows, self.collectives, sent=True)

    def send_words(self, words: np.ndarray) -> None:
        """Queue one command's words as ``protocol`` encoded them (``DecodeBatchWords.fill``)."""
        _require_root(self, "send")
        self.queue.append(words)

    def flush(self) -> None:
        """Send every pending word (no MPI call when none is pending)."""
        _require_root(self, "flush")
        self.link.check_channel()
        n = self.queue.pending
        if n == 0:
            return
        out = self.queue.out
        out[0] = n
        if self.size > 1:
            self.link.send_frame(out, n)
        self.recorder.frame(out[1 : n + 1], self.collectives, sent=True)
        self.queue.n = 1
        self.stats.frames += 1
        self.stats.words += n

    def shutdown(self) -> None:
        """Send SHUTDOWN (the last command of every run) and flush it."""
        self.send(Shutdown())
        self.flush()
        self.workers_told = True
        self.link.shut_down()

    # -- everyone ------------------------------------------------------------------------------
    def allsum(self, partial: np.ndarray) -> np.ndarray:
        """The MoE combine: the sum over ranks of ``partial`` (float32, same shape everywhere),
        bitwise identical on every rank (``MpiLink.sum``). In a world of one it returns ``partial``
        itself. Rank 0 must have flushed the command of this forward pass: workers cannot join a
        pass whose command they have not received."""
        if not isinstance(partial, np.ndarray) or partial.dtype != np.float32:
            raise TypeError(f"allsum takes a float32 ndarray, got {getattr(partial, 'dtype', type(partial))}")
        _require_flushed(self, "allsum")
        self.stats.allsums += 1
        if self.size == 1:
            self.recorder.combine(partial, partial, self.collectives)
            return partial
        self.stats.mpi_calls += 1
        self.stats.allsum_bytes += partial.nbytes
        began = time.perf_counter()
        result = self.link.sum(np.ascontiguousarray(partial))
        self.stats.moe_exchange_s += time.perf_counter() - began
        self.recorder.combine(partial, result, self.collectives)
        return result

    # -- dp attention: the MoE exchange and the step's gather (docs/protocol.md, "dp attention") --
    def allgather_rows(self, rows: np.ndarray, counts: list[int]) -> np.ndarray:
        """Every rank's ``rows`` [counts[r], ...] (any dtype, the same trailing shape everywhere),
        concatenated in rank order, on every rank."""
        _dp_begin(self, rows, counts, "allgather_rows")
        if self.size == 1:
            return rows
        width = row_bytes(rows)
        self.stats.wire((self.size - 1) * rows.nbytes, (sum(counts) - counts[self.rank]) * width)
        began = time.perf_counter()
        out = self.link.allgather_rows(np.ascontiguousarray(rows), counts)
        self.stats.moe_exchange_s += time.perf_counter() - began
        return out

    def allgather_words(self, words: np.ndarray, labels: list | None = None) -> np.ndarray:
        """Every rank's ``words`` (uint64 [n], the same n everywhere) in rank order [P, n], on every
        rank: ``--check-state``'s digests, named by ``labels`` in the flight recorder (not a MoE
        exchange, so not counted as one)."""
        row = np.ascontiguousarray(words, np.uint64).reshape(1, -1)
        _require_flushed(self, "allgather_words")
        self.recorder.words(row[0], labels, self.collectives)
        return row if self.size == 1 else self.link.allgather_rows(row, [1] * self.size)

    def scatter_sum_rows(self, partial: np.ndarray, counts: list[int]) -> np.ndarray:
        """``partial``: float32 [sum(counts), D], block r (``counts[r]`` rows) meant for rank r.
        Returns this rank's block summed over every rank's ``partial`` in rank order: the float
        operations of ``allsum`` on those rows, so the same bits."""
        if partial.dtype != np.float32 or partial.shape[0] != sum(counts):
            raise TypeError(f"scatter_sum_rows takes float32 [{sum(counts)}, D], got {partial.dtype} {partial.shape}")
        _dp_begin(self, partial[: counts[self.rank]], counts, "scatter_sum_rows")
        if self.size == 1:
            return partial
        began = time.perf_counter()
        out = self.link.scatter_sum_rows(np.ascontiguousarray(partial), counts)
        self.stats.moe_exchange_s += time.perf_counter() - began
        return out

    def alltoall_rows(self, rows: np.ndarray, send: list[int], recv: list[int]) -> np.ndarray:
        """The all-to-all exchange (docs/protocol.md, "MoE exchange"): ``rows`` [sum(send), ...] (any
        dtype), block r (``send[r]`` rows) meant for rank r; returns the blocks every rank meant for
        this one, in rank order [sum(recv), ...]. Every rank knows its ``recv`` counts beforehand (the
        routing is known everywhere), so no counts travel. This rank's own block never leaves it."""
        P, me = self.size, self.rank
        if len(send) != P or len(recv) != P or rows.shape[0] != sum(send):
            raise ValueError(
                f"alltoall_rows: {rows.shape[0]} rows with send counts {list(send)} and receive counts "
                f"{list(recv)}; needs {P} counts each and sum(send) rows"
            )
        _require_flushed(self, "alltoall_rows")
        if P == 1:
            return rows
        width = row_bytes(rows)
        self.stats.wire((sum(send) - send[me]) * width, (sum(recv) - recv[me]) * width)
        began = time.perf_counter()
        out = self.link.alltoall_rows(np.ascontiguousarray(rows), list(send), list(recv))
        took = time.perf_counter() - began
        self.stats.moe_exchange_s += took
        self.recorder.alltoall(list(send), list(recv), width, took, self.collectives)
        return out

    def gather_rows(self, rows: np.ndarray, counts: list[int]) -> np.ndarray | None:
        """Rank 0: every rank's ``rows`` [counts[r], ...] concatenated in rank order; None elsewhere."""
        _dp_begin(self, rows, counts, "gather_rows")
        return rows if self.size == 1 else self.link.gather_rows(np.ascontiguousarray(rows), counts)

    def startup_barrier(self, error: str | None = None) -> None:
        """Every rank calls it once it has loaded its model, or failed to (``error``); waits
        without a time limit, then raises StartupFailed on every rank if any rank failed."""
        self.link.startup_barrier(error)

    def allgather_text(self, text: str) -> list[str]:
        """Every rank's ``text`` (at most STARTUP_ERROR_BYTES of UTF-8), in rank order, on
        every rank (start-up only: no time limit)."""
        return self.link.allgather_text(text)

    def dump_frames(self, reason: str, report: str = "") -> None:
        """Write the flight recorder to ``dump_dir`` (when set), saying so on stderr."""
        if self.dump_dir is not None:
            path = self.recorder.dump(self.dump_dir, reason, report)
            print(f"eprt: rank {self.rank}: flight recorder written to {path} ({reason})", file=sys.stderr, flush=True)

    def close(self, reason: str | None = None) -> None:
        """Rank 0 leaving without a SHUTDOWN (an error) tells every worker to leave too."""
        self.link.close(reason)

    def unresponsive_ranks(self, wait_s: float = 2.0) -> list[int]:
        """Rank 0: the worker ranks that do not answer within ``wait_s`` (dead, stopped, or stuck
        outside the transport); the ranks known dead, at once, when there are any."""
        return self.link.unresponsive_ranks(wait_s)

    @property
    def failed(self) -> WorkerFailed | None:
        """Rank 0: the worker failure already raised (the job is ending), else None."""
        return self._failed

    def fail(self, failure: WorkerFailed) -> None:
        """Rank 0: a worker failed; the job cannot continue (raises ``failure``)."""
        self._failed = failure
        raise failure

    def check_peers(self) -> None:
        """Rank 0, between waits (e.g. when told a rank died): raise WorkerFailed naming a worker
        that reported an error or died, if any did."""
        _require_root(self, "check_peers")
        self.link.check_channel()

    def abort(self, message: str) -> None:
        """End the whole job now, non-zero, after printing ``message``."""
        self.link.abort(message)

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(None if exc is None else f"{type(exc).__name__}: {exc}")

    # -- workers -------------------------------------------------------------------------------
    def recv_frame(self) -> np.ndarray:
        """The words of rank 0's next frame; waits without a time limit (the server may idle)."""
        return self.link.recv_frame()

    def recv_rows(self, n: int, width: int) -> np.ndarray:
        """The vision rows [n, width] announced by the last PREFILL."""
        return self.link.recv_rows(n, width)

    def report_error(self, text: str) -> None:
        """Tell rank 0 this worker failed and wait until the job goes down."""
        self.link.report_error(text)


def _require_root(transport: Transport, what: str) -> None:
    if transport.rank != 0:
        raise RuntimeError(f"{what}: only rank 0 sends commands (this is rank {transport.rank})")


def _require_flushed(transport: Transport, what: str) -> None:
    """Rank 0 may start a collective only with no words queued: the workers would not join it."""
    if transport.rank == 0 and transport.queue.pending:
        raise RuntimeError(
            f"{what} with {transport.queue.pending} command words not flushed: the workers "
            "have not been told to run this forward pass"
        )


def _dp_begin(transport: Transport, rows: np.ndarray, counts: list[int], what: str) -> None:
    rank, size = transport.rank, transport.size
    if len(counts) != size or rows.shape[0] != counts[rank]:
        raise ValueError(
            f"{what}: {rows.shape[0]} rows here, but the counts {list(counts)} name "
            f"{counts[rank] if len(counts) == size else '?'} for rank {rank} of {size}"
        )
    _require_flushed(transport, what)
    transport.stats.allsums += 1
    transport.stats.allsum_bytes += rows.nbytes


class LocalTransport(Transport):
    """A world of one rank: frames are only counted; no MPI at all."""

    def __init__(self, frame_words: int = DEFAULT_FRAME_WORDS):
        super().__init__(LocalLink(), frame_words)
