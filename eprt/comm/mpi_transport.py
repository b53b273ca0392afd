"""``MpiTransport``: the transport over mpi4py (see ``transport.py`` for the framing, the
waiting policy and the failure handling it implements), on its parts: ``MpiLink``, the words
over MPI (the frames' broadcasts, the combines, the start-up exchange, each wait polled with the
watchdog), and ``ErrorChannel``, the error channel (a worker's failure, rank 0's going-down
notice, the hang report, aborts). Imported only when the launcher started more than one rank.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import sys
import time

import numpy as np

from eprt import env
from eprt.comm.links import DIED, Links, NoLinks
from eprt.comm.transport import (
    DEFAULT_FRAME_WORDS,
    STARTUP_ERROR_BYTES,
    CollectiveTimeout,
    RootDown,
    StartupFailed,
    Transport,
    WorkerFailed,
)

TAG_WORKER_ERROR = 1  # worker -> rank 0: utf-8 error text (the sender is the failing rank)
TAG_ROOT_DOWN = 2  # rank 0 -> worker: utf-8 reason; rank 0 is going down without SHUTDOWN
TAG_STATUS_ASK = 3  # rank 0 -> worker, on a watchdog expiry: "what are you waiting on?" (empty)
TAG_STATUS = 4  # worker -> rank 0: utf-8 answer ("waiting on X, collective #N")
STATUS_GRACE = 2.0  # s rank 0 waits for the answers before naming the ranks that gave none
BUSY_SPIN = 2e-4  # s a collective polls without sleeping first: its own latency when every rank is there
BUSY_SLEEP_MAX = 1e-4  # s, longest sleep between polls inside a compute-time collective
IDLE_SLEEP_MAX = 5e-3  # s, longest sleep while a worker waits for its next command
IDLE_SPIN = 0.05  # s a worker waits for its next command at BUSY_SLEEP_MAX before backing off to IDLE_SLEEP_MAX
ABORT_GRACE = 0.5  # s between printing why and aborting, so the message reaches the terminal
REDUCE_SCATTER_MIN_BYTES = 1 << 20  # MoE partials from this size on 3+ ranks: reduce-scatter


class MpiTransport(Transport):
    """The transport over ``comm`` (COMM_WORLD by default); construct it on every rank in the
    same order (it duplicates communicators and opens the links, collectives). ``links``: open
    rank 0's link to every worker (``eprt.comm.links``), which names a dead rank at once."""

    def __init__(
        self, comm=None, frame_words: int = DEFAULT_FRAME_WORDS, timeout: float | None = None, links: bool = True
    ):
        super().__init__(MpiLink(comm, timeout, links), frame_words)


class MpiLink:
    """The words over MPI: three duplicated communicators so traffic cannot cross (``ctl``: the
    command stream, ``moe``: the combines, ``err``: the error channel), every collective
    non-blocking and polled (``wait``)."""

    def __init__(self, comm=None, timeout: float | None = None, links: bool = True):
        from mpi4py import MPI

        self.MPI = MPI
        self.world = MPI.COMM_WORLD if comm is None else comm
        self.rank, self.size = self.world.Get_rank(), self.world.Get_size()
        self.timeout = float(env.COLLECTIVE_TIMEOUT.get() if timeout is None else timeout)
        if not self.timeout > 0:
            raise ValueError(f"EPRT_COLLECTIVE_TIMEOUT must be > 0 seconds, got {self.timeout:g}")
        self.ctl, self.moe, self.err = self.world.Dup(), self.world.Dup(), self.world.Dup()
        self.busy_spin = BUSY_SPIN if not self._oversubscribed() else 0.0  # (a spinning rank would take a core)
        # MPI calls may come from a thread other than the one that initialised MPI (never two at once)
        self.any_thread = MPI.Query_thread() >= MPI.THREAD_SERIALIZED
        self.inflight = False  # a wait was left by an exception: the comms are unusable
        self.waiting_on = "nothing"  # what the current (or last) wait is for, for the hang report
        self.links = NoLinks()
        self._open_links = links

    def bind(self, transport) -> None:
        """The transport the link serves (its counters, recorder and failure); opens the links."""
        self.t = transport
        self.errors = ErrorChannel(self)
        atexit.register(self.errors.at_exit)  # a rank 0 that dies of an exception still frees the workers
        if self._open_links and self.size > 1:
            poke = self.errors.poke if self.rank == 0 else None
            self.links = Links(self.rank, self.size, transport.allgather_text, poke)

    # -- rank 0 --------------------------------------------------------------------------------
    def send_frame(self, out: np.ndarray, n: int) -> None:
        fw = self.t.frame_words
        self.bcast(out[:fw], "a command frame")
        if n + 1 > fw:
            self.bcast(out[fw : n + 1], "a command frame's overflow")

    def send_rows(self, rows: np.ndarray) -> None:
        self.bcast(rows, "the vision rows")

    def shut_down(self) -> None:
        self.links.close()  # the workers leave now: their links close in order

    # -- the combines ------------------------------------------------------------------------
    def sum(self, partial: np.ndarray) -> np.ndarray:
        """The rank-ordered sum, gathered everywhere: summing the gathered partials in rank
        order does the same float operations on the same data on every rank, so the result
        is bitwise identical everywhere. An MPI Allreduce does not promise that (its
        reduction order may differ between ranks and algorithms), and a single differing bit
        would let the ranks' KV drift apart. The price, P x the bytes of a reduce, is small
        for decode-sized T; large partials on 3+ ranks take ``_reduce_scatter``."""
        if self.size >= 3 and partial.nbytes >= REDUCE_SCATTER_MIN_BYTES:
            return self._reduce_scatter(partial)
        gathered = np.empty((self.size,) + partial.shape, np.float32)  # [P, *partial.shape]
        self.t.stats.wire((self.size - 1) * partial.nbytes, (self.size - 1) * partial.nbytes)
        self.wait(self.moe.Iallgather(partial, gathered), "the MoE combine")
        out = gathered[0].copy()
        for r in range(1, self.size):
            out += gathered[r]
        return out

    def _reduce_scatter(self, partial: np.ndarray) -> np.ndarray:
        """Large partials on 3+ ranks (prefill chunks): a reduce-scatter, rank r summing slice r
        of every rank's partial in rank order, then an all-gather of the sums. The float
        operations are those of the gather-and-sum, so the bits are the same on every rank
        (and as with the gather), while each rank receives about 2x the partial instead of
        (P - 1)x. Small partials (decode) keep the single all-gather: one collective's latency."""
        P, MPI = self.size, self.MPI
        flat = partial.reshape(-1)
        bounds = [r * flat.size // P for r in range(P + 1)]
        counts = [bounds[r + 1] - bounds[r] for r in range(P)]
        mine = counts[self.rank]
        parts = np.empty((P, mine), np.float32)  # [P, slice]: every rank's slice
        both = 4 * ((flat.size - mine) + (P - 1) * mine)  # the reduce-scatter's and the all-gather's, each way
        self.t.stats.wire(both, both)
        self.t.stats.mpi_calls += 1  # (allsum counted the first)
        self.wait(
            self.moe.Ialltoallv(
                [flat, (counts, bounds[:-1]), MPI.FLOAT], [parts, ([mine] * P, [r * mine for r in range(P)]), MPI.FLOAT]
            ),
            "the MoE combine (reduce-scatter)",
        )
        reduced = parts[0].copy()
        for r in range(1, P):
            reduced += parts[r]
        out = np.empty(flat.size, np.float32)
        reqs = self.moe.Iallgatherv(reduced, [out, (counts, bounds[:-1]), MPI.FLOAT])
        self.wait(reqs, "the MoE combine (all-gather)")
        return out.reshape(partial.shape)

    def allgather_rows(self, rows: np.ndarray, counts: list[int]) -> np.ndarray:
        width = int(np.prod(rows.shape[1:], dtype=np.int64)) * rows.itemsize  # bytes per row
        out = np.empty((sum(counts),) + rows.shape[1:], rows.dtype)
        sizes = [c * width for c in counts]
        self.t.stats.mpi_calls += 1
        self.wait(
            self.moe.Iallgatherv([rows, self.MPI.BYTE], [out, (sizes, _offsets(sizes)), self.MPI.BYTE]),
            "the dp MoE all-gather",
        )
        return out

    def scatter_sum_rows(self, partial: np.ndarray, counts: list[int]) -> np.ndarray:
        MPI, width, mine = self.MPI, int(np.prod(partial.shape[1:], dtype=np.int64)), counts[self.rank]
        parts = np.empty((self.size, mine) + partial.shape[1:], np.float32)  # [P, mine, D]: every rank's block
        send = [c * width for c in counts]
        self.t.stats.wire(4 * (sum(send) - send[self.rank]), 4 * (self.size - 1) * mine * width)
        self.t.stats.mpi_calls += 1
        self.wait(
            self.moe.Ialltoallv(
                [partial, (send, _offsets(send)), MPI.FLOAT],
                [parts, ([mine * width] * self.size, [r * mine * width for r in range(self.size)]), MPI.FLOAT],
            ),
            "the dp MoE reduce-scatter",
        )
        out = parts[0].copy()
        for r in range(1, self.size):  # rank order: the bits of the replicated combine
            out += parts[r]
        return out

    def alltoall_rows(self, rows: np.ndarray, send: list[int], recv: list[int]) -> np.ndarray:
        """One variable all-to-all of rows as bytes (MPI Ialltoallv), blocks in rank order."""
        width = int(np.prod(rows.shape[1:], dtype=np.int64)) * rows.itemsize  # bytes per row
        out = np.empty((sum(recv),) + rows.shape[1:], rows.dtype)
        sizes, got = [c * width for c in send], [c * width for c in recv]
        self.t.stats.mpi_calls += 1
        self.wait(
            self.moe.Ialltoallv(
                [rows, (sizes, _offsets(sizes)), self.MPI.BYTE], [out, (got, _offsets(got)), self.MPI.BYTE]
            ),
            "the MoE all-to-all",
        )
        return out

    def gather_rows(self, rows: np.ndarray, counts: list[int]) -> np.ndarray | None:
        width = int(np.prod(rows.shape[1:], dtype=np.int64)) * rows.itemsize
        sizes = [c * width for c in counts]
        out = np.empty((sum(counts),) + rows.shape[1:], rows.dtype) if self.rank == 0 else None
        recv = [out, (sizes, _offsets(sizes)), self.MPI.BYTE] if self.rank == 0 else None
        self.t.stats.mpi_calls += 1
        self.wait(self.moe.Igatherv([rows, self.MPI.BYTE], recv, root=0), "the dp gather of sampled rows")
        return out

    # -- start-up ------------------------------------------------------------------------------
    def startup_barrier(self, error: str | None = None) -> None:
        """Wait, without a time limit, until every rank has loaded its model or failed to:
        ranks load at different speeds, and only after this exchange are the collectives
        timed. Every rank contributes its error text (empty: ready), so a rank that could
        not start (a checkpoint missing on one node) ends the job on every rank, named."""
        if self.size == 1:
            if error:
                raise StartupFailed([(self.rank, error)])
            return
        failures = [(r, text) for r, text in enumerate(self.allgather_text(error or "")) if text]
        if failures:
            self.t.workers_told = True  # every rank raises StartupFailed and leaves: nobody to tell
            self.links.close()
            raise StartupFailed(failures)

    def allgather_text(self, text: str) -> list[str]:
        if self.size == 1:
            return [text]
        mine = np.zeros(STARTUP_ERROR_BYTES, np.uint8)
        raw = text.encode("utf-8", "replace")[:STARTUP_ERROR_BYTES]
        mine[: len(raw)] = np.frombuffer(raw, np.uint8)
        every = np.empty((self.size, STARTUP_ERROR_BYTES), np.uint8)
        self.t.stats.mpi_calls += 1
        self.wait(self.ctl.Iallgather(mine, every), "the start-up exchange", idle=True)
        return [bytes(row).rstrip(b"\0").decode("utf-8", "replace") for row in every]

    # -- workers -----------------------------------------------------------------------------
    def recv_frame(self) -> np.ndarray:
        """The words of rank 0's next frame; waits without a time limit (the server may idle)."""
        self._require_worker("recv_frame")
        fw = self.t.frame_words
        frame = np.empty(fw, np.uint32)
        self.bcast(frame, "the next command", idle=True)
        n = int(frame[0])
        if n < fw:
            words = frame[1 : n + 1]
        else:
            rest = np.empty(n + 1 - fw, np.uint32)
            self.bcast(rest, "a command frame's overflow")
            words = np.concatenate([frame[1:], rest])
        self.t.recorder.frame(words, self.t.collectives, sent=False)
        return words

    def recv_rows(self, n: int, width: int) -> np.ndarray:
        self._require_worker("recv_rows")
        rows = np.empty((n, width), np.float32)  # [rows, hidden]
        self.bcast(rows, "the vision rows")
        self.t.recorder.rows(rows, self.t.collectives, sent=False)
        return rows

    def report_error(self, text: str) -> None:
        self._require_worker("report_error")
        self.errors.report(text)

    def check_channel(self) -> None:
        self.errors.check()

    def unresponsive_ranks(self, wait_s: float = STATUS_GRACE) -> list[int]:
        return self.errors.unresponsive_ranks(wait_s)

    def abort(self, message: str) -> None:
        self.errors.abort(message)

    def close(self, reason: str | None = None) -> None:
        """Release the communicators. Rank 0 closing without a SHUTDOWN sent (or after a
        worker failed) sends every worker the notice instead, so none waits forever."""
        t = self.t
        if t.closed:
            return
        t.closed = True
        atexit.unregister(self.errors.at_exit)
        if self.rank == 0 and (not t.workers_told or t.failed or self.inflight):
            why = reason or "rank 0 stopped without SHUTDOWN"
            if t.failed is not None and str(t.failed) not in why:
                why = f"{why} ({t.failed})"
            self.errors.notify_workers(why)
        elif not self.inflight:
            for c in (self.ctl, self.moe, self.err):
                c.Free()
        self.links.close()

    # -- waiting ---------------------------------------------------------------------------------
    def bcast(self, buf: np.ndarray, what: str, idle: bool = False) -> None:
        stats = self.t.stats
        stats.mpi_calls += 1
        stats.bcasts += 1
        stats.bcast_bytes += buf.nbytes
        self.wait(self.ctl.Ibcast(buf, root=0), what, idle)

    def wait(self, req, what: str, idle: bool = False) -> None:
        """Poll ``req`` to completion with growing sleeps, watching the error channel; a
        compute-time wait (not ``idle``) longer than the collective timeout aborts the job."""
        self.inflight = True
        self.t.collectives += 1
        self.waiting_on = what
        start = time.monotonic()
        # A worker's watchdog waits a little longer than rank 0's, so rank 0 reports the hang.
        deadline = None if idle else start + self.timeout + (0 if self.rank == 0 else STATUS_GRACE + 1.0)
        # Between the steps of a running job the next command comes within rank 0's host work
        # (milliseconds): an idle wait polls as a compute-time one for IDLE_SPIN, then backs off.
        # A nonblocking collective advances only inside Test: sleeping between polls from the start
        # made one that every rank was ready for take ~0.3 ms instead of ~20 us (2 ranks, 32 KB).
        delay, cap, spin = 0.0, BUSY_SLEEP_MAX, start + self.busy_spin
        while not req.Test():
            self.errors.check()
            now = time.monotonic()
            if now < spin:
                continue
            if deadline is not None and now > deadline:
                self.errors.watchdog(what)
            if idle and now - start > IDLE_SPIN:
                cap = IDLE_SLEEP_MAX
            time.sleep(delay)
            delay = min(cap, 2 * delay if delay else 1e-5)
        self.inflight = False

    def watchdog(self, what: str) -> None:
        """A collective outside ``wait`` (NCCL's) is overdue: as ``wait`` does (ErrorChannel.watchdog)."""
        self.errors.watchdog(what)

    def _oversubscribed(self) -> bool:
        """Whether this node's ranks outnumber the cores this process may run on (a collective)."""
        local = self.world.Split_type(self.MPI.COMM_TYPE_SHARED)
        try:
            ranks = local.Get_size()
        finally:
            local.Free()
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return ranks > cores

    def _require_worker(self, what: str) -> None:
        if self.rank == 0:
            raise RuntimeError(f"{what} is for worker ranks")


class ErrorChannel:
    """The error channel of an ``MpiLink`` (its ``err`` communicator): a worker's failure report
    and rank 0's going-down notice, the hang report on a watchdog expiry, the links' news of a
    dead rank, and aborts."""

    def __init__(self, link: MpiLink):
        self.link, self.t, self.MPI, self.rank = link, link.t, link.MPI, link.rank

    def check(self) -> None:
        """Between polls: a worker hears rank 0's notice (RootDown) or its death, and answers status
        asks; rank 0 hears a worker's failure or death (WorkerFailed, the job's end)."""
        if self.rank != 0:
            reason = self.root_notice()
            if reason is not None:
                raise RootDown(f"rank 0 is going down: {reason}")
            self._check_root_alive()
            self._answer_status_ask()
            return
        if self.t.failed is not None:
            raise self.t.failed
        status = self.MPI.Status()
        if self.link.err.Iprobe(source=self.MPI.ANY_SOURCE, tag=TAG_WORKER_ERROR, status=status):
            src = status.Get_source()
            text = self._recv_text(src, TAG_WORKER_ERROR, status)
            print(f"eprt: rank {src} failed: {text}", file=sys.stderr, flush=True)
            self._fail(src, text)
        if self.link.links.lost:  # (the links said so on stderr)
            self._fail(self.link.links.lost[0], DIED)

    def _fail(self, rank: int, text: str) -> None:
        failure = WorkerFailed(rank, text)
        self.t.dump_frames(f"rank {rank} failed: {text}")
        self.t.fail(failure)

    def report(self, text: str) -> None:
        """Tell rank 0 this worker failed, then wait for rank 0's notice that the job is going
        down; if none comes within the collective timeout, abort the job from here."""
        self.t.dump_frames(f"this rank failed: {text}")
        data = np.frombuffer(text.encode("utf-8", "replace"), np.uint8)
        req = self.link.err.Isend(data, dest=0, tag=TAG_WORKER_ERROR)
        self.t.stats.mpi_calls += 1
        deadline = time.monotonic() + self.link.timeout
        while time.monotonic() < deadline:
            if self.root_notice() is not None:
                req.Test()
                return
            self._check_root_alive()
            time.sleep(BUSY_SLEEP_MAX)
        self.abort(
            f"eprt: rank {self.rank} failed: {text}\neprt: rank {self.rank}: rank 0 did not "
            f"answer the error report within {self.link.timeout:g} s; aborting the job"
        )

    def _check_root_alive(self) -> None:
        """A worker whose link to rank 0 closed without a goodbye (rank 0 died: the links said so)
        ends the job: nobody is left to send it a command or a notice."""
        if self.link.links.lost:
            self.abort(f"eprt: rank {self.rank}: rank 0 is gone; aborting the job")

    def poke(self, peer: int) -> None:
        """Rank 0's links found ``peer`` dead (on their thread): a wait in the transport sees it at its
        next poll; a main thread waiting elsewhere (eprt serve idle) is woken by SIGUSR1, the signal
        that MPICH's launcher sends for a dead rank too, when a handler for it is installed."""
        if callable(signal.getsignal(signal.SIGUSR1)):
            os.kill(os.getpid(), signal.SIGUSR1)

    def _answer_status_ask(self) -> None:
        status = self.MPI.Status()
        if self.link.err.Iprobe(source=0, tag=TAG_STATUS_ASK, status=status):
            self._recv_text(0, TAG_STATUS_ASK, status)
            answer = json.dumps(self.progress()).encode()
            self.link.err.Send(np.frombuffer(answer, np.uint8), dest=0, tag=TAG_STATUS)
            self.t.dump_frames("rank 0 found a collective overdue")

    def progress(self) -> dict:
        """Where this rank stands, for the hang report: host, collectives started, what it waits
        on, the last command it sent or received, seconds since its last recorded progress."""
        recorder = self.t.recorder
        last = next((e["head"] for e in reversed(recorder.ring) if e["kind"] == "frame"), "none")
        return {
            "host": socket.gethostname(),
            "collective": self.t.collectives,
            "waiting_on": self.link.waiting_on,
            "last_command": last,
            "idle_s": round(time.monotonic() - recorder.last_progress, 1),
        }

    def hang_report(self, wait_s: float = STATUS_GRACE) -> dict[int, dict | None]:
        """Rank 0, when a collective is overdue: every rank's ``progress()`` (the workers asked on
        the error channel); a rank that does not answer within ``wait_s`` (stopped, dead, or
        busy outside eprt) maps to None."""
        err, size = self.link.err, self.link.size
        empty = np.zeros(0, np.uint8)
        asks = [err.Isend(empty, dest=k, tag=TAG_STATUS_ASK) for k in range(1, size)]
        answers: dict[int, dict | None] = {0: self.progress(), **dict.fromkeys(range(1, size))}
        deadline = time.monotonic() + wait_s
        status = self.MPI.Status()
        while time.monotonic() < deadline and None in answers.values():
            if err.Iprobe(source=self.MPI.ANY_SOURCE, tag=TAG_STATUS, status=status):
                src = status.Get_source()
                answers[src] = json.loads(self._recv_text(src, TAG_STATUS, status))
            else:
                time.sleep(BUSY_SLEEP_MAX)
        for req in asks:
            req.Test()
        return answers

    def unresponsive_ranks(self, wait_s: float = STATUS_GRACE) -> list[int]:
        if self.link.links.lost:
            return sorted(self.link.links.lost)
        return [rank for rank, text in self.hang_report(wait_s).items() if text is None]

    def root_notice(self) -> str | None:
        status = self.MPI.Status()
        if self.link.err.Iprobe(source=0, tag=TAG_ROOT_DOWN, status=status):
            return self._recv_text(0, TAG_ROOT_DOWN, status)
        return None

    def _recv_text(self, src: int, tag: int, status) -> str:
        data = np.empty(status.Get_count(self.MPI.BYTE), np.uint8)
        self.link.err.Recv(data, source=src, tag=tag)
        return data.tobytes().decode("utf-8", "replace")

    def notify_workers(self, reason: str) -> None:
        data = np.frombuffer(reason.encode("utf-8", "replace"), np.uint8)
        alive = [k for k in range(1, self.link.size) if k not in self.link.links.lost]
        reqs = [self.link.err.Isend(data, dest=k, tag=TAG_ROOT_DOWN) for k in alive]
        self.t.stats.mpi_calls += len(reqs)
        deadline = time.monotonic() + self.link.timeout
        while not self.MPI.Request.Testall(reqs):
            if time.monotonic() > deadline:
                self.abort(f"eprt: rank 0: could not tell the workers to stop ({reason}); aborting")
            time.sleep(BUSY_SLEEP_MAX)

    def watchdog(self, what: str) -> None:
        report = ""
        if self.rank == 0:
            try:
                self.check()  # a worker's report explains the stall better than we can
            except WorkerFailed:
                if self.t.watchdog_raises:
                    raise
            answers = self.hang_report()
            silent = [rank for rank, answer in answers.items() if answer is None]
            report = "\n" + hang_table(answers)
            self.t.dump_frames(f"{what} overdue", report)
            if self.t.watchdog_raises:
                raise CollectiveTimeout(silent, what, self.link.timeout, report)
        self.abort(
            f"eprt: rank {self.rank}: {what} did not complete within {self.link.timeout:g} s "
            f"(EPRT_COLLECTIVE_TIMEOUT); a rank died or fell out of step; aborting the job{report}"
        )

    def abort(self, message: str) -> None:
        self.link.links.close()  # an abort is no death: the other ranks must not report one
        sys.stderr.write(message + "\n")  # one write: the links' thread prints too
        sys.stderr.flush()
        time.sleep(ABORT_GRACE)  # MPI_Abort tears the job down before hydra forwards our stderr
        self.link.world.Abort(1)
        os._exit(1)  # MPICH's MPI_Abort can return before the launcher's kill arrives: run nothing more

    def at_exit(self) -> None:
        if self.rank == 0:
            self.t.close("rank 0 exited without closing its transport")
        else:
            self.link.links.close()  # an exit is no death


def _offsets(sizes: list[int]) -> list[int]:
    return [sum(sizes[:r]) for r in range(len(sizes))]


def hang_table(answers: dict[int, dict | None]) -> str:
    """The hang report: one line per rank; a rank that did not answer is named as such."""
    lines = [f"eprt: {'rank':>4}  {'host':<16} {'collective':>10}  {'last command':<22} {'idle s':>6}  state"]
    for rank, a in sorted(answers.items()):
        if a is None:
            lines.append(
                f"eprt: {rank:>4}  {'?':<16} {'?':>10}  {'?':<22} {'?':>6}  did not answer within "
                f"{STATUS_GRACE:g} s (stopped, dead, or busy outside eprt)"
            )
        else:
            lines.append(
                f"eprt: {rank:>4}  {a['host'][:16]:<16} {a['collective']:>10}  {a['last_command'][:22]:<22} "
                f"{a['idle_s']:>6}  waiting on {a['waiting_on']}"
            )
    return "\n".join(lines)
