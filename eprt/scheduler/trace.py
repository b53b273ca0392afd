"""The one trace writer: every trace line of a step printed from its plan and its result, in the
spec's format (docs/scenarios.md; the seed trace: shared/spec/TRACE.md). The frames come from
the result (the commands the runner sent), printed as the spec's broadcast calls where the spec
shows them: PREFILL, PREFILL_NEXT, RELEASE, FORK, DECODE_CKPT, OWNER and SHUTDOWN; a DECODE_DP
frame shows as its rows per rank.
"""

from __future__ import annotations

from collections.abc import Callable

from eprt.comm import protocol as P
from eprt.scheduler.step import (
    Acceptance,
    Checkpoint,
    Chunk,
    Compaction,
    Decode,
    FreeBlocks,
    Proposal,
    Release,
    Row,
    StepPlan,
    StepResult,
    TickStart,
    Verification,
)

SHOWN = (P.Prefill, P.PrefillNext, P.Release, P.Fork, P.DecodeCkpt, P.Owner, P.Shutdown)
STREAM = 0  # the default stream every call names
STARTUP = ("bind_gpu_to_thread()", "create_stream() -> 1", "create_event() -> 2")
SHUTDOWN_LINES = (
    "fx apply Quiesce{stream=0}",
    "synchronize(stream=0)",
    "fx apply Quiesce{stream=1}",
    "synchronize(stream=1)",
    "fx teardown",
    "teardown()",
)


def name(row: Row, length: int | None = None) -> str:
    """``sI@S:len=L``: the sequence, its slot, and its stored tokens (``length``, else the row's)."""
    return f"s{row.seq.seq_id}@{row.slot}:len={row.length if length is None else length}"


def token_text(token) -> str:
    return str(token)  # a RowFailure prints as "failed"


def listed(tokens) -> str:
    return "[" + ", ".join(token_text(t) for t in tokens) + "]"


def frame_lines(cmd) -> list[str]:
    """One command as the spec's broadcast calls: the preamble, each payload word, a token array as
    its length (PREFILL's vision sync too, as the seed trace prints it)."""
    words = P.encode(cmd).tolist()
    lines = [f"ep_broadcast_cmd_for_seq(seq={words[0]}, cmd={words[1]:#x})"]
    if isinstance(cmd, P.Prefill):
        head, tail = words[2:5], [f"ep_broadcast_tokens(n={cmd.full_len})", f"ep_sync_vision_embeds(n={cmd.full_len})"]
    elif isinstance(cmd, P.PrefillNext):
        head, tail = words[2:4], [f"ep_broadcast_tokens(n={cmd.chunk_len})"]
    else:
        head, tail = words[2:], []
    return lines + [f"ep_broadcast_cmd({w:#x})" for w in head] + tail


class TraceWriter:
    """``write(plan, result)`` after each step; ``emit`` takes each line."""

    def __init__(self, emit: Callable[[str], None]):
        self.emit = emit

    def write(self, plan: StepPlan, result: StepResult) -> None:
        self._result = result
        if plan.start is not None:
            self._start(plan.start)
        for item in plan.checkpoints:
            self._checkpoint(item)
        if plan.accept is not None:
            self._accept(plan.accept)
        for item in plan.releases:
            self._release(item)
        for item in plan.room:
            self._room(item)
        for i, chunk in enumerate(plan.chunks):
            self._chunk(chunk, result.first.get(i))
        for item in plan.drafting:
            self._room(item)
        if plan.decode is not None:
            self._decode(plan.decode, result.tokens)
        if plan.verify is not None:
            self._verify(plan.verify, result.emitted)
        for item in plan.compactions:
            self._compaction(item)
        if plan.shutdown:
            self.emit("fx apply EpShutdown")
            self._frames(plan)
            for line in SHUTDOWN_LINES:
                self.emit(line)

    def _frames(self, item, kinds: tuple = SHOWN) -> None:
        for cmd in self._result.frames_of(item):
            if isinstance(cmd, kinds):
                for line in frame_lines(cmd):
                    self.emit(line)

    def _start(self, start: TickStart) -> None:
        if start.startup:
            for line in STARTUP:
                self.emit(line)
        if start.drained:
            self.emit("adapter_id_for(-1)")  # the cohort's active adapter
            for adapter in start.drained:
                self.emit(f"adapter_id_for({adapter})")
        self.emit(f"num_free_blocks() -> {start.free_blocks}")
        self.emit(f"-- tick {start.tick}")

    def _room(self, item) -> None:
        if isinstance(item, FreeBlocks):
            where = "" if item.pool is None else f"rank={item.pool}"
            self.emit(f"num_free_blocks({where}) -> {item.n}")
        elif isinstance(item, Release):
            self._release(item)
        elif isinstance(item, Proposal):
            drafts = ", ".join(map(str, item.drafts))
            self.emit(f"propose_drafts({name(item.row)}, k={item.k}) -> [{drafts}]")

    def _release(self, item: Release) -> None:
        what = "finish_sequence" if item.finish else "preempt"
        self.emit(f"fx apply ReleaseSeq{{cache={str(item.cache).lower()}, {what}}}")
        if item.cache:
            self.emit(f"cache_sequence({name(item.row)})")
        self.emit(f"free_sequence({name(item.row)}, blocks={item.blocks})")
        self._frames(item)

    def _chunk(self, chunk: Chunk, first) -> None:
        row, adm = chunk.row, chunk.admission
        adapter = row.seq.adapter
        if adm is not None:
            self._frames(chunk, (P.Owner,))
            where = "" if adm.owner is None else f" on rank {adm.owner}"
            self.emit(f"alloc_sequence() -> slot {adm.slot}{where}")
            self.emit(f"adapter_id_for({adapter})")
            self.emit(f"acquire_adapter_slot({adapter})")
        self._frames(chunk, (P.Prefill, P.PrefillNext, P.DecodeCkpt))
        self.emit(f"prefill(n={chunk.n}, {name(row, chunk.end)}, stream={STREAM})")
        for fork in chunk.forks:
            self.emit("fx apply ForkSeq")
            self.emit(f"fork_sequence({name(row, chunk.end)}, s{fork.child.seq_id}) -> slot {fork.slot}")
            self._frames(fork)
            self.emit(f"acquire_adapter_slot({fork.child.adapter})")
        if first is None:
            return
        if chunk.forks:
            self.emit(f"argmax_batch(row=0, n={len(first)}, stream={STREAM}) -> {listed(first)}")
        else:
            self.emit(f"argmax_on_device(row=0, stream={STREAM}) -> {token_text(first[0])}")

    def _decode(self, step: Decode, tokens: list) -> None:
        rows = step.rows
        self.emit(f"fx launch Decode{{n={len(rows)}, ctx=Unified, readback=Argmax}}")
        seqs = ", ".join(f'"{name(r)}"' for r in rows)
        self.emit(f"decode_batch(tokens={listed(step.tokens)}, seqs=[{seqs}], stream={STREAM})")
        for cmd in self._result.frames_of(step):
            if isinstance(cmd, P.DecodeDp):
                self.emit(f"rows_per_rank({list(cmd.counts)})")
        for r, row in enumerate(rows):
            self.emit(f"commit_ctx({name(row, row.length + 1)}, n=1, base={row.length}, row={r})")
        self.emit(f"argmax_batch(row=0, n={len(rows)}, stream={STREAM}) -> {listed(tokens)}")

    def _verify(self, step: Verification, emitted: list) -> None:
        rows = step.rows
        self.emit(f"fx launch Verify{{n={len(rows)}, k={step.k}, ctx=Unified, readback=Argmax}}")
        seqs = ", ".join(f'"{name(r)}"' for r in rows)
        drafts = ", ".join("[" + ", ".join(map(str, d)) + "]" for d in step.drafts)
        self.emit(f"verify_batch(tokens={listed(step.tokens)}, drafts=[{drafts}], seqs=[{seqs}], stream={STREAM})")
        self.emit(f"verify_readback(stream={STREAM}) -> [{', '.join(listed(e) for e in emitted)}]")

    def _accept(self, item: Acceptance) -> None:
        self.emit(f"fx apply AcceptDrafts{{n={len(item.rows)}}}")
        for r, (row, m) in enumerate(zip(item.rows, item.kept)):
            self.emit(f"commit_ctx({name(row, row.length + m)}, n={m}, base={row.length}, row={r})")
        seqs = ", ".join(f'"{name(row, row.length + m)}"' for row, m in zip(item.rows, item.kept))
        self.emit(f"accept_drafts(seqs=[{seqs}], accepted={listed(m - 1 for m in item.kept)})")

    def _checkpoint(self, item: Checkpoint) -> None:
        self.emit("fx apply MarconiCheckpoint")
        self.emit(f"decode_marconi_checkpoint({name(item.row)})")
        self._frames(item)

    def _compaction(self, item: Compaction) -> None:
        self.emit(f"fx apply CompactSlot{{target={item.target}}}")
        self.emit(f"compact_sequence({name(item.row)}, new_slot={item.target})")
        self._frames(item)
