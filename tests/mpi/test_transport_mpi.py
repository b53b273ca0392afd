"""The MPI transport at any world size:
    mpiexec -n 2 python -m pytest --with-mpi -q tests/mpi      (and -n 3)
    python -m pytest --with-mpi -q tests/mpi                    (a world of one)
Every rank runs every test; assertions come after the communication, so a failing check
on one rank never leaves the others waiting in a collective.
"""

import io
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from eprt.comm import protocol as p
from eprt.comm.logging import setup_logging
from eprt.comm.protocol import Compact, Decode1, DecodeBatch, Decoder, Prefill, Release, Shutdown
from eprt.comm.worker import run_worker

MPI = pytest.importorskip("mpi4py.MPI")
from eprt.comm.mpi_transport import MpiTransport  # noqa: E402
from eprt.comm.transport import RootDown, StartupFailed, WorkerFailed  # noqa: E402

TIMEOUT = 20.0  # watchdog for these tests: a bug aborts the job instead of hanging it
D = 5


@pytest.fixture
def t():
    transport = MpiTransport(frame_words=16, timeout=TIMEOUT)
    yield transport
    if not transport.closed:  # end the stream cleanly so the next test starts in step
        if transport.rank == 0:
            transport.shutdown()
        else:
            dec = Decoder()
            while not any(isinstance(c, Shutdown) for c in dec):
                dec.feed(transport.recv_frame())
        transport.close()


def recv_commands(t, n):
    dec, got, bcasts = Decoder(max_slots=4), [], []
    while len(got) < n:
        before = t.stats.bcasts
        dec.feed(t.recv_frame())
        bcasts.append(t.stats.bcasts - before)
        got.extend(dec)
    return got, bcasts


@pytest.mark.mpi
def test_frames_arrive_in_order_coalesced(t):
    long_prompt = tuple(range(40))  # 40 tokens overflow the 16-word frame: 2 Bcasts
    flushes = [
        [Prefill(0, 0, 3, (1, 2, 3))],
        [DecodeBatch((0,), (7,))],
        [Prefill(1, 0, 40, long_prompt), Release(0)],
        [Compact(1, 0), Decode1(0, 9)],
    ]
    cmds = [c for group in flushes for c in group]
    if t.rank == 0:
        bcasts = []
        for group in flushes:
            before = t.stats.bcasts
            for c in group:
                t.send(c)
            t.flush()
            bcasts.append(t.stats.bcasts - before)
        got = cmds
    else:
        got, bcasts = recv_commands(t, len(cmds))
    assert got == cmds
    assert bcasts == ([1, 1, 2, 1] if t.size > 1 else [0, 0, 0, 0])
    if t.rank == 0:
        assert t.stats.words == sum(len(p.encode(c)) for c in cmds) and t.stats.frames == 4


@pytest.mark.mpi
def test_startup_barrier_waits_untimed_for_slow_loaders():
    t = MpiTransport(timeout=0.2)
    opened = t.stats.copy()  # (opening the links is one exchange)
    if t.rank == t.size - 1:
        time.sleep(0.6)  # a slow model load, longer than the watchdog's limit
    t.startup_barrier()
    if t.rank == 0:
        t.shutdown()
    else:
        t.recv_frame()
    t.close()
    assert (t.stats - opened).mpi_calls == (0 if t.size == 1 else 2)
    if t.rank == 0:
        with pytest.raises(RuntimeError, match="recv_frame is for worker ranks"):
            t.recv_frame()


@pytest.mark.mpi
def test_vision_rows_follow_their_prefill(t):
    rows = np.random.default_rng(0).standard_normal((3, D)).astype(np.float32)  # [rows, hidden]
    prefill = Prefill(2, 0, 4, (1, 2, 3, 4), vision_rows=3)
    if t.rank == 0:
        t.send(prefill, rows)
        t.send(DecodeBatch((2,), (9,)))
        t.flush()
        got, got_rows, left = [prefill, DecodeBatch((2,), (9,))], rows, 0
    else:
        dec = Decoder()
        dec.feed(t.recv_frame())
        first = dec.next()
        left = dec.pending  # rank 0 flushed right after the count: nothing may follow it
        got_rows = t.recv_rows(first.vision_rows, D)
        dec.feed(t.recv_frame())
        got = [first, dec.next()]
    assert got == [prefill, DecodeBatch((2,), (9,))] and left == 0
    assert np.array_equal(got_rows, rows)


def partials(size, shape=(7, 33)):
    """Each rank's contribution, known to every rank: wide dynamic range, so the summation
    order shows in the low bits."""
    out = []
    for r in range(size):
        g = np.random.default_rng(100 + r)
        out.append((g.standard_normal(shape) * 10.0 ** g.uniform(-4, 4, shape)).astype(np.float32))
    return out


@pytest.mark.mpi
def test_allsum_is_bitwise_identical_on_every_rank(t):
    mine = partials(t.size)
    before = t.stats.copy()
    out = t.allsum(mine[t.rank])  # [T, D]
    used = t.stats - before
    everyone = np.empty((t.size,) + out.shape, np.float32)  # [P, T, D]
    MPI.COMM_WORLD.Allgather(out, everyone)
    for r in range(t.size):
        assert np.array_equal(everyone[r].view(np.uint32), out.view(np.uint32)), f"rank {r} differs"
    # and it is the rank-ordered sum, the bits of the device combine and the dp reduce-scatter: a
    # path that summed in another order would still agree across ranks, and differ from them at 3+
    assert np.array_equal(out.view(np.uint32), rank_ordered_sum(mine).view(np.uint32))
    assert (used.allsums, used.mpi_calls) == ((1, 1) if t.size > 1 else (1, 0))


def rank_ordered_sum(parts: list) -> np.ndarray:
    out = parts[0].copy()
    for part in parts[1:]:
        out += part
    return out


@pytest.mark.mpi
def test_dp_reduce_scatter_gives_each_rank_its_rows_of_the_rank_ordered_sum(t):
    counts = [3 + r for r in range(t.size)]  # uneven blocks, decode-sized
    mine = partials(t.size, shape=(sum(counts), 96))
    out = t.scatter_sum_rows(mine[t.rank], counts)
    start = sum(counts[: t.rank])
    want = rank_ordered_sum(mine)[start : start + counts[t.rank]]
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))


@pytest.mark.mpi
def test_large_allsum_is_the_rank_ordered_sum_bitwise(t):
    # a prefill-sized partial (over REDUCE_SCATTER_MIN_BYTES): on 3+ ranks it goes through a
    # reduce-scatter and an all-gather, and must still be bitwise the rank-ordered sum everywhere
    from eprt.comm.mpi_transport import REDUCE_SCATTER_MIN_BYTES

    mine = partials(t.size, shape=(701, 512))  # 1.4 MB, an element count no world size divides
    assert mine[0].nbytes >= REDUCE_SCATTER_MIN_BYTES
    before = t.stats.copy()
    out = t.allsum(mine[t.rank])
    used = t.stats - before
    assert np.array_equal(out.view(np.uint32), rank_ordered_sum(mine).view(np.uint32))
    everyone = np.empty((t.size,) + out.shape, np.float32)
    MPI.COMM_WORLD.Allgather(out, everyone)
    assert all(np.array_equal(everyone[r].view(np.uint32), out.view(np.uint32)) for r in range(t.size))
    assert used.mpi_calls == {1: 0, 2: 1}.get(t.size, 2)


@pytest.mark.mpi
def test_allsum_never_flushes_commands(t):
    zeros = np.zeros((2, D), np.float32)
    if t.rank == 0:
        t.send(Prefill(0, 0, 2, (3, 4)))
        with pytest.raises(RuntimeError, match="2 command words|not flushed"):
            t.allsum(zeros)  # refused before any collective: the workers would not join it
        t.flush()
    else:
        recv_commands(t, 1)
    t.allsum(zeros)


class CombiningExecutor:
    """A toy model: every prefill and decode runs one MoE combine, like a forward pass."""

    hidden_size = D

    def __init__(self, t):
        self.t, self.slots, self.final = t, {}, None  # slot -> (prompt length, stored tokens)

    def prefill(self, slot, tokens, chunk_start, chunk_len, vision_rows):
        prompt, stored = self.slots.get(slot, (len(tokens), []))
        self.slots[slot] = (prompt, stored + tokens[chunk_start : chunk_start + chunk_len].tolist())
        self.t.allsum(np.full((chunk_len, D), self.t.rank, np.float32))

    def decode(self, slots, tokens):
        for slot, token in zip(slots, tokens):
            self.slots[slot][1].append(token)
        self.t.allsum(np.full((len(slots), D), self.t.rank, np.float32))

    def compact(self, slot, new_slot):
        self.slots[new_slot] = self.slots.pop(slot)

    def release(self, slot):
        del self.slots[slot]

    def shutdown(self):
        self.final = {s: (n, tuple(tokens)) for s, (n, tokens) in self.slots.items()}


@pytest.mark.mpi
def test_worker_loop_matches_rank0_over_mpi(t):
    steps = [
        Prefill(0, 0, 3, (1, 2, 3)),
        Prefill(1, 0, 2, (4, 5)),
        DecodeBatch((0, 1), (6, 7)),
        Release(0),
        Compact(1, 0),
        DecodeBatch((0,), (8,)),
        Decode1(0, 9),
    ]
    expected = {0: (2, (4, 5, 7, 8, 9))}
    if t.rank == 0:
        for cmd in steps:
            t.send(cmd)
            if isinstance(cmd, (Prefill, DecodeBatch, Decode1)):
                n = cmd.chunk_len if isinstance(cmd, Prefill) else len(getattr(cmd, "slots", (0,)))
                t.flush()
                t.allsum(np.zeros((n, D), np.float32))  # rank 0's forward pass
        final, rc = expected, 0
        t.shutdown()
        t.close()
    else:
        ex = CombiningExecutor(t)
        rc = run_worker(t, ex, max_slots=4)
        t.close()
        final = ex.final
    assert rc == 0 and final == expected


@pytest.mark.mpi(min_size=2)
def test_worker_error_reaches_rank0(t, capfd):
    zeros = np.zeros((2, D), np.float32)
    if t.rank == 0:
        with pytest.raises(WorkerFailed) as failed:
            t.allsum(zeros)  # rank 1 never joins: it reports instead
        t.close("test over")
        assert (failed.value.rank, failed.value.error) == (1, "ValueError: boom")
        assert "eprt: rank 1 failed: ValueError: boom" in capfd.readouterr().err
    elif t.rank == 1:
        t.report_error("ValueError: boom")  # returns once rank 0's notice arrives
        t.close()
    else:
        with pytest.raises(RootDown, match="test over"):
            t.allsum(zeros)
        t.close()


@pytest.mark.mpi(min_size=2)
def test_idle_workers_leave_when_rank0_goes_down(t):
    if t.rank == 0:
        t.close("scheduler crashed")
    else:
        with pytest.raises(RootDown, match="scheduler crashed"):
            t.recv_frame()
        t.close()


def test_world_of_one_never_imports_mpi4py():
    code = (
        "import sys; from eprt.comm.world import open_transport, LocalTransport; "
        "from eprt.comm.protocol import Release; t = open_transport(); t.send(Release(0)); t.flush(); "
        "assert isinstance(t, LocalTransport) and 'mpi4py' not in sys.modules; print('ok')"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "HYDRA_"))}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def test_logging_is_rank_aware():
    def log_as(rank, all_ranks):
        buf = io.StringIO()
        log = setup_logging(rank, all_ranks=all_ranks, level="INFO", stream=buf)
        log.getChild("test").info("hello")
        log.getChild("test").error("bad")
        return buf.getvalue().splitlines()

    assert log_as(0, False) == ["[rank 0] INFO eprt.test: hello", "[rank 0] ERROR eprt.test: bad"]
    assert log_as(2, False) == ["[rank 2] ERROR eprt.test: bad"]
    assert log_as(2, True) == ["[rank 2] INFO eprt.test: hello", "[rank 2] ERROR eprt.test: bad"]
    with pytest.raises(ValueError, match="unknown log level 'LOUD'"):
        setup_logging(0, level="LOUD")


@pytest.mark.mpi
def test_startup_exchange_names_every_rank_that_failed():
    t = MpiTransport(timeout=5)
    failing = t.size - 1
    with pytest.raises(StartupFailed, match=f"rank {failing} could not start: OSError: disk gone"):
        t.startup_barrier("OSError: disk gone" if t.rank == failing else None)
    # Every rank knows the job ends: rank 0 sends no going-down notice. It used to, and one that
    # overtook a worker's still-pending exchange turned its StartupFailed into RootDown (a CI flake).
    notices = []
    if t.rank == 0:
        t.close()
    MPI.COMM_WORLD.Barrier()  # rank 0 has closed
    if t.rank != 0:
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline and not notices:
            notices += [n for n in [t.link.errors.root_notice()] if n is not None]
        t.close()
    assert notices == []
