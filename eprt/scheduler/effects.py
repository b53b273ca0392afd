"""Side effects the scheduler plans, and the runner that executes them: each effect's
``line()`` is its ``fx ...`` trace line (printed only with a tracer) and ``perform(model)``
makes exactly the model calls docs/scenarios.md lists for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

DEFAULT_STREAM = 0


class Tracer(Protocol):
    def tick(self, k: int) -> None:
        """Called once per tick, after the plan (prints ``-- tick K``)."""

    def effect(self, line: str) -> None:
        """Called with an effect's trace line right before it runs."""


@dataclass(frozen=True)
class Decode:
    """One batched decode step; rows in ascending slot order. Advances each row's len and
    returns the next token of every row."""

    rows: tuple

    def line(self) -> str:
        return f"fx launch Decode{{n={len(self.rows)}, ctx=Unified, readback=Argmax}}"

    def perform(self, model) -> list[int]:
        rows = list(self.rows)
        model.decode_batch([s.token_ids[-1] for s in rows], rows, stream=DEFAULT_STREAM)
        for r, seq in enumerate(rows):
            seq.len += 1
            model.commit_ctx(seq, n=1, base=seq.len - 1, row=r)
        return list(model.argmax_batch(row=0, n=len(rows), stream=DEFAULT_STREAM))


@dataclass(frozen=True)
class MarconiCheckpoint:
    """Snapshot of a hybrid model's SSM state after an accepted token (no-op otherwise)."""

    seq: object

    def line(self) -> str:
        return "fx apply MarconiCheckpoint"

    def perform(self, model) -> None:
        model.decode_marconi_checkpoint(self.seq)


@dataclass(frozen=True)
class ReleaseSeq:
    """Give back a sequence's slot and blocks (inserting its full blocks into the prefix
    cache first). ``finish`` is False for a preemption: the sequence goes back to the queue."""

    seq: object
    cache: bool = True
    finish: bool = True

    def line(self) -> str:
        what = "finish_sequence" if self.finish else "preempt"
        return f"fx apply ReleaseSeq{{cache={str(self.cache).lower()}, {what}}}"

    def perform(self, model) -> int:
        if self.cache:
            model.cache_sequence(self.seq)
        return model.free_sequence(self.seq)


@dataclass(frozen=True)
class ForkSeq:
    """A further choice of a prompt whose prefill has just ended: a slot of its own sharing the
    parent's KV (FORK). Returns the child's slot."""

    parent: object
    child: object

    def line(self) -> str:
        return "fx apply ForkSeq"

    def perform(self, model) -> int:
        return model.fork_sequence(self.parent, self.child)


@dataclass(frozen=True)
class CompactSlot:
    """Move a surviving sequence down to a lower free slot."""

    seq: object
    target: int

    def line(self) -> str:
        return f"fx apply CompactSlot{{target={self.target}}}"

    def perform(self, model) -> None:
        model.compact_sequence(self.seq, new_slot=self.target)


@dataclass(frozen=True)
class EpShutdown:
    def line(self) -> str:
        return "fx apply EpShutdown"

    def perform(self, model) -> None:
        model.ep_shutdown()


@dataclass(frozen=True)
class Quiesce:
    stream: int

    def line(self) -> str:
        return f"fx apply Quiesce{{stream={self.stream}}}"

    def perform(self, model) -> None:
        model.synchronize(stream=self.stream)


@dataclass(frozen=True)
class Teardown:
    def line(self) -> str:
        return "fx teardown"

    def perform(self, model) -> None:
        model.teardown()


class EffectRunner:
    def __init__(self, model, tracer: Tracer | None = None):
        self.model = model
        self.tracer = tracer

    def run(self, fx):
        if self.tracer is not None:
            self.tracer.effect(fx.line())
        return fx.perform(self.model)


@dataclass(frozen=True)
class Verify:
    """One batched verify step (speculative decoding): row r appends its last token and
    ``drafts[r]``; returns, per row, the tokens it emits (accepted drafts, then one more)."""

    rows: tuple
    drafts: tuple

    def line(self) -> str:
        k = max(len(d) for d in self.drafts)
        return f"fx launch Verify{{n={len(self.rows)}, k={k}, ctx=Unified, readback=Argmax}}"

    def perform(self, model) -> list[list[int]]:
        rows = list(self.rows)
        model.verify_batch([s.token_ids[-1] for s in rows], rows, list(self.drafts), stream=DEFAULT_STREAM)
        return list(model.verify_readback(stream=DEFAULT_STREAM))


@dataclass(frozen=True)
class AcceptDrafts:
    """Close a verify step: row r kept ``kept[r]`` of its emitted tokens (cut short by a stop or
    a limit), so its KV now holds its last token and ``kept[r] - 1`` drafts; the rest roll back."""

    rows: tuple
    kept: tuple

    def line(self) -> str:
        return f"fx apply AcceptDrafts{{n={len(self.rows)}}}"

    def perform(self, model) -> None:
        for r, (seq, n) in enumerate(zip(self.rows, self.kept)):
            seq.len += n
            model.commit_ctx(seq, n=n, base=seq.len - n, row=r)
            seq.accepted_tokens = (seq.accepted_tokens or 0) + n - 1
        model.accept_drafts(list(self.rows), [n - 1 for n in self.kept])
