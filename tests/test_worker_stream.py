"""The worker loop fed a recorded stream: it ends in rank 0's slot state, runs the executor
calls rank 0 meant, and reports (never guesses) when the stream does not fit its slots."""

import numpy as np
import pytest

from eprt.comm import protocol as p
from eprt.comm.protocol import (
    Accept,
    Compact,
    Decode1,
    DecodeBatch,
    Prefill,
    PrefillNext,
    ProtocolError,
    Release,
    Shutdown,
    Verify,
)
from eprt.comm.slots import SlotError, SlotTable
from eprt.comm.transport import LocalLink, LocalTransport, RootDown, Transport
from eprt.comm.worker import run_worker

MAX_SLOTS = 4
HIDDEN = 3


class Loopback(LocalLink):
    """A world of two whose worker is replayed in this process: it records what rank 0 sends."""

    size = 2  # so the frames are "sent" (a world of one sends nothing)

    def __init__(self):
        self.sent = []  # ("frame", words) and ("rows", array), in send order

    def send_frame(self, out, n):
        self.sent.append(("frame", out[1 : n + 1].copy()))

    def send_rows(self, rows):
        self.sent.append(("rows", rows.copy()))


class LoopbackRoot(Transport):
    """Rank 0 of a world of two whose worker is replayed in this process."""

    def __init__(self, frame_words=16):
        super().__init__(Loopback(), frame_words)
        self.sent = self.link.sent


class ReplayTransport:
    """The worker side: hands back the recorded frames and rows, in order."""

    rank = 1

    def __init__(self, sent, fail_with=None):
        self.sent = list(sent)
        self.errors = []
        self.fail_with = fail_with  # raised once the recording runs out

    def recv_frame(self):
        if not self.sent and self.fail_with:
            raise self.fail_with
        kind, data = self.sent.pop(0)
        assert kind == "frame", "the worker asked for a frame where rank 0 sent rows"
        return data

    def recv_rows(self, n, width):
        kind, data = self.sent.pop(0)
        assert kind == "rows" and data.shape == (n, width)
        return data

    def report_error(self, text):
        self.errors.append(text)


class RecordingExecutor:
    """Records every call; keeps its slots in a SlotTable and checks each call against it, as
    the real executor does."""

    hidden_size = HIDDEN

    def __init__(self, fail_on_decode=False):
        self.calls, self.slots, self.final = [], SlotTable(MAX_SLOTS), None
        self.fail_on_decode = fail_on_decode

    def prefill(self, slot, tokens, chunk_start, chunk_len, vision_rows):
        assert tokens.dtype == np.uint32
        self.slots.settled("PREFILL")
        if self.slots.get(slot) is None:
            self.slots.occupy(slot, tokens, chunk_start, vision_rows=vision_rows)
        state = self.slots.check_chunk(slot, tokens, chunk_start, chunk_len)
        rows = None if vision_rows is None else vision_rows.tolist()
        self.calls.append(("prefill", slot, tokens.tolist(), chunk_start, chunk_len, rows))
        state.tokens.extend(tokens[chunk_start : chunk_start + chunk_len].tolist())

    def prefill_next(self, slot, chunk_start, tokens):
        assert tokens.dtype == np.uint32
        state = self.slots.check_next_chunk(slot, chunk_start, tokens.tolist())
        self.prefill(slot, np.asarray(state.prompt, np.uint32), chunk_start, len(tokens), state.vision_rows)

    def prefill_group(self, commands, vision_rows):
        self.calls.append(("group", [c.slot for c in commands]))
        for cmd, rows in zip(commands, vision_rows):
            if isinstance(cmd, Prefill):
                self.prefill(cmd.slot, np.asarray(cmd.tokens, np.uint32), cmd.chunk_start, cmd.chunk_len, rows)
            else:
                self.prefill_next(cmd.slot, cmd.chunk_start, np.asarray(cmd.tokens, np.uint32))

    def decode(self, slots, tokens):
        states = self.slots.check_decode(slots, tokens, "decode")
        if self.fail_on_decode:
            raise RuntimeError("out of KV blocks")
        self.calls.append(("decode", slots, tokens))
        for state, t in zip(states, tokens):
            state.tokens.append(t)

    def verify(self, slots, tokens, drafts):
        states = self.slots.check_verify(slots, tokens, drafts)
        self.calls.append(("verify", slots, tokens, drafts))
        for state, t, d in zip(states, tokens, drafts):
            state.tokens.extend((t, *d))
        self.slots.open(slots, drafts)

    def accept(self, slots, accepted):
        self.slots.accept(slots, accepted)
        self.calls.append(("accept", slots, accepted))

    def compact(self, slot, new_slot):
        self.slots.move(slot, new_slot)
        self.calls.append(("compact", slot, new_slot))

    def release(self, slot):
        self.slots.vacate(slot)
        self.calls.append(("release", slot))

    def shutdown(self):
        self.calls.append(("shutdown",))
        self.final = self.slots.state()
        self.slots.open_verify = None
        for slot in self.slots.occupied():
            self.slots.vacate(slot)


def drive_rank0(root):
    """A scheduler's worth of traffic, sent the way the runner sends it: the request_timeout
    flow, a chunked prefill with vision rows, a one-token decode."""

    def prefill(slot, prompt, start, n, rows=None):
        if start == 0:  # the slot's first chunk: the whole prompt and the rows
            root.send(Prefill(slot, start, n, tuple(prompt), 0 if rows is None else len(rows)), rows)
        else:  # later chunks: their own tokens only
            root.send(PrefillNext(slot, start, tuple(prompt[start : start + n])))
        root.flush()  # the runner flushes before its forward pass

    prefill(0, [1, 2, 3, 4, 5], 0, 5)
    prefill(1, [2, 2, 3, 4, 5], 0, 5)
    root.send(DecodeBatch((0, 1), (10, 20)))
    root.flush()
    root.send(Release(0))
    root.send(Compact(1, 0))
    root.send(DecodeBatch((0,), (21,)))  # coalesced with the release and compaction
    root.flush()
    rows = np.arange(2 * HIDDEN, dtype=np.float32).reshape(2, HIDDEN)
    long_prompt = list(range(30))  # 30 tokens overflow a 16-word frame
    prefill(2, long_prompt, 0, 20, rows)
    prefill(2, long_prompt, 20, 10, rows)
    root.send(Decode1(2, 33))  # decode-one-token: the command word is the token
    root.flush()
    return rows, long_prompt


def test_worker_replaying_rank0_stream_ends_in_rank0_state():
    root = LoopbackRoot()
    rows, long_prompt = drive_rank0(root)
    root.shutdown()
    expected_state = {0: (5, (2, 2, 3, 4, 5, 20, 21)), 2: (30, tuple(long_prompt) + (33,))}
    assert [kind for kind, _ in root.sent].count("rows") == 1  # with the first chunk only
    assert root.stats.mpi_calls == 0 and root.stats.frames == 8

    worker, executor = ReplayTransport(root.sent), RecordingExecutor()
    assert run_worker(worker, executor, MAX_SLOTS, vocab_size=64) == 0
    assert worker.errors == [] and worker.sent == []
    assert executor.final == expected_state
    assert executor.calls == [
        ("prefill", 0, [1, 2, 3, 4, 5], 0, 5, None),
        ("prefill", 1, [2, 2, 3, 4, 5], 0, 5, None),
        ("decode", [0, 1], [10, 20]),
        ("release", 0),
        ("compact", 1, 0),
        ("decode", [0], [21]),
        ("prefill", 2, long_prompt, 0, 20, rows.tolist()),
        ("prefill", 2, long_prompt, 20, 10, rows.tolist()),
        ("decode", [2], [33]),
        ("shutdown",),
    ]


def frames(*commands):
    return [("frame", np.concatenate([p.encode(c) for c in commands]))]


PROMPT = Prefill(0, 0, 3, (1, 2, 3))


@pytest.mark.parametrize(
    "stream, error",
    [
        (frames(DecodeBatch((0, 2), (5, 6))), "SlotError: decode for empty slot 0"),
        (
            frames(PROMPT, Prefill(1, 0, 2, (4, 5)), Compact(0, 1)),
            "SlotError: COMPACT slot 0 -> 1: target slot is occupied",
        ),
        (frames(PROMPT, PROMPT), "already holds a prefilled sequence"),
        (frames(Prefill(0, 0, 2, (1, 2, 3)), DecodeBatch((0,), (4,))), "prefill incomplete (2 of 3"),
        (frames(Prefill(0, 0, 1, (1, 2, 3)), Prefill(0, 2, 1, (1, 2, 3))), "chunk starts at 2 but the slot holds 1"),
        (frames(Prefill(0, 0, 1, (1, 2, 3)), PrefillNext(0, 1, (2, 4))), "are not those of the prompt"),
        (frames(Prefill(0, 0, 1, (1, 2, 3)), PrefillNext(0, 2, (3,))), "chunk starts at 2 but the slot holds 1"),
        (frames(PrefillNext(1, 0, (1,))), "PREFILL_NEXT for empty slot 1"),
        (frames(Release(3)), "RELEASE for empty slot 3"),
        ([("frame", np.array([0, 0xFFFFFFE5], np.uint32))], "unknown reserved command word 0xFFFFFFE5"),
        ([("frame", np.array([4, 7], np.uint32))], "slot 4 out of range (max_slots=4)"),
        (frames(PROMPT, Verify((0,), (4,), ((5, 6),)), DecodeBatch((0,), (7,))), "awaits its ACCEPT"),
        (frames(PROMPT, Verify((0,), (4,), ((5, 6),)), Accept((0,), (3,))), "3 drafts accepted, the VERIFY sent 2"),
        (frames(PROMPT, Accept((0,), (0,))), "the open VERIFY has none"),
        (
            [("frame", np.array([0, p.PREFILL, 1, 0, 1, 5, 1, 0, p.RELEASE], np.uint32))],
            "2 words arrived between the vision count and its rows",
        ),
    ],
)
def test_bad_stream_is_reported_not_guessed(stream, error):
    worker, executor = ReplayTransport(stream), RecordingExecutor()
    assert run_worker(worker, executor, MAX_SLOTS, vocab_size=64) == 1
    assert len(worker.errors) == 1 and error in worker.errors[0], worker.errors
    assert not any(c[0] in ("decode", "compact") for c in executor.calls)


def test_executor_failure_is_reported():
    worker = ReplayTransport(frames(PROMPT, DecodeBatch((0,), (4,))))
    assert run_worker(worker, RecordingExecutor(fail_on_decode=True), MAX_SLOTS) == 1
    assert worker.errors == ["RuntimeError: out of KV blocks"]


def test_root_going_down_ends_the_loop_with_shutdown():
    worker = ReplayTransport(frames(PROMPT), fail_with=RootDown("rank 0 is going down: boom"))
    executor = RecordingExecutor()
    assert run_worker(worker, executor, MAX_SLOTS) == 1
    assert worker.errors == [] and executor.calls[-1] == ("shutdown",)


def test_a_frames_run_of_prefills_is_one_group_ended_by_another_command_or_the_frame():
    long_prompt = tuple(range(30))  # overflows the 16-word frame: one frame all the same
    stream = frames(Prefill(0, 0, 3, (1, 2, 3)), Prefill(1, 0, 20, long_prompt), Prefill(2, 0, 2, (7, 8)))
    stream += frames(PrefillNext(1, 20, long_prompt[20:]), DecodeBatch((0, 2), (4, 9)), Prefill(3, 0, 1, (5,)))
    stream += frames(Release(0)) + frames(p.Shutdown())
    worker, executor = ReplayTransport(stream), RecordingExecutor()
    assert run_worker(worker, executor, MAX_SLOTS, vocab_size=64) == 0
    assert [c[:2] for c in executor.calls] == [
        ("group", [0, 1, 2]),
        ("prefill", 0),
        ("prefill", 1),
        ("prefill", 2),
        ("prefill", 1),  # a run of one: the single-command call
        ("decode", [0, 2]),
        ("prefill", 3),
        ("release", 0),
        ("shutdown",),
    ]


def test_rank0_sends_only_whole_commands_with_their_rows():
    root = LoopbackRoot()
    with pytest.raises(ValueError, match="announces 1 vision rows but 0 were given"):
        root.send(Prefill(0, 0, 3, (1, 2, 3), vision_rows=1))
    with pytest.raises(ValueError, match="2-D float array"):
        root.send(Prefill(0, 0, 3, (1, 2, 3), vision_rows=3), np.zeros(3, np.float32))
    with pytest.raises(ProtocolError, match="collides with the reserved command words"):
        root.send(Decode1(0, 0xFFFFFFF0))
    assert root.queue.pending == 0 and root.sent == []  # nothing half-sent


def test_slot_table_leaves_state_unchanged_on_error():
    table = SlotTable(2)
    table.occupy(0, (1, 2, 3), stored=3)
    before = table.state()
    with pytest.raises(SlotError, match="slot listed twice"):
        table.check_decode((0, 0), (1, 2), "decode")
    with pytest.raises(SlotError, match="empty slot 1"):
        table.check_decode((0, 1), (1, 2), "decode")
    with pytest.raises(SlotError, match="target slot is occupied"):
        table.move(0, 0)
    with pytest.raises(SlotError, match="already occupied"):
        table.occupy(0, (4,), stored=0)
    assert table.state() == before


def test_world_of_one_needs_no_mpi():
    t = LocalTransport()
    partial = np.ones((2, 3), np.float32)
    assert t.allsum(partial) is partial
    t.send(PROMPT)
    with pytest.raises(RuntimeError, match="not flushed"):  # a compute call never flushes commands
        t.allsum(partial)
    t.flush()
    assert t.allsum(partial) is partial
    assert (t.stats.mpi_calls, t.stats.words, t.stats.frames) == (0, len(p.encode(PROMPT)), 1)
    with pytest.raises(TypeError, match="float32"):
        t.allsum(np.ones((2, 3)))


def test_verify_then_accept_rolls_back_rejected_drafts_on_the_worker():
    # VERIFY stores the row's token and drafts; the ACCEPT riding in the next frame keeps the
    # accepted drafts only, then the next VERIFY / DECODE_BATCH continue from there.
    stream = frames(PROMPT, Prefill(1, 0, 2, (7, 8)), Verify((0, 1), (4, 9), ((5, 6), (10, 11, 12))))
    stream += frames(Accept((0, 1), (1, 3)), Verify((0,), (20,), ((21, 22, 23, 24),)))
    stream += frames(Accept((0,), (0,)), DecodeBatch((0, 1), (30, 13)), Release(1), Shutdown())
    worker, executor = ReplayTransport(stream), RecordingExecutor()
    assert run_worker(worker, executor, MAX_SLOTS, vocab_size=64) == 0, worker.errors
    assert executor.final == {0: (3, (1, 2, 3, 4, 5, 20, 30))}
    kinds = [c[0] for c in executor.calls if c[0] not in ("prefill", "group")]
    assert kinds == ["verify", "accept", "verify", "accept", "decode", "release", "shutdown"]
