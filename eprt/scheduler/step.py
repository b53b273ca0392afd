"""The step as data (vLLM v1's shape, kept deterministic): ``Scheduler`` plans a ``StepPlan``, the
model's ``execute(plan)`` returns a ``StepResult``, and the scheduler's update takes the result;
one trace writer prints both (``eprt/scheduler/trace.py``; the lines: docs/scenarios.md).

A plan is frozen data. Its rows name the scheduler's sequences, which the model reads and never
writes: what a step computes for a sequence (its tokens, logprobs) comes back in the result.
The KV accounting a plan implies (slots taken and freed, blocks, prefix-cache entries, snapshot
rows) is done while it is planned, through the model's accounting calls (``interface.py``), so
the plan already holds what that accounting answered (an admission's slot and prefix hit, the
blocks a release freed); ``execute`` writes the plan's frames and runs its forward passes. A plan
runs in the order of its fields: checkpoints, the ACCEPT, rollbacks, releases (the end of tick's,
then the room events' preemptions), prefill chunks, the decode or verify step, compactions, the
shutdown.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Row:
    """A sequence as a step names it: its slot and the tokens whose KV is stored when the step starts."""

    seq: object  # the scheduler's Sequence (read-only for the model)
    slot: int
    length: int


@dataclass(frozen=True)
class Admission:
    """What admitting a sequence took: its slot and prefix-cache hit (``cached`` tokens), its owner
    rank under dp attention, and ``record``, the model's own note of it (for its frames)."""

    slot: int
    cached: int
    owner: int | None = None
    record: object = None


@dataclass(frozen=True)
class ForkRow:
    """A further choice forked off a chunk's sequence right after its prompt's last chunk (FORK)."""

    child: object  # the choice's Sequence
    slot: int
    record: object = None  # the model's note of the fork (the block to copy)


@dataclass(frozen=True)
class Chunk:
    """Prefill prompt tokens ``[row.length, row.length + n)`` of ``row.seq``; ``admission`` when
    this is the first chunk of an admission; ``forks`` after the prompt's last chunk;
    ``record``: the model's note of the chunk (where a hybrid model snapshots inside it)."""

    row: Row
    n: int
    prompt_len: int
    admission: Admission | None = None
    forks: tuple[ForkRow, ...] = ()
    record: object = None

    @property
    def end(self) -> int:
        return self.row.length + self.n

    @property
    def last(self) -> bool:
        """Whether this chunk ends the prompt (its result is the sequence's first token)."""
        return self.end == self.prompt_len


@dataclass(frozen=True)
class Release:
    """A sequence's slot and blocks given back (its full blocks cached first): at the end of a tick
    (``finish``) or to make room for a decode step (a preemption). ``blocks``: how many it held."""

    row: Row
    finish: bool
    blocks: int
    cache: bool = True


@dataclass(frozen=True)
class Compaction:
    """A surviving sequence moved down to the free slot ``target`` (COMPACT)."""

    row: Row
    target: int


@dataclass(frozen=True)
class Checkpoint:
    """After a decoded token: a hybrid model's snapshot of the row's recurrent state (``record``: the
    model's DECODE_CKPT, or None where no snapshot is due)."""

    row: Row
    record: object = None


@dataclass(frozen=True)
class Decode:
    """One batched decode step: row r appends ``tokens[r]``; rows in ascending slot order."""

    rows: tuple[Row, ...]
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class Verification:
    """One verify step (speculative decoding): row r appends ``tokens[r]`` and ``drafts[r]``."""

    rows: tuple[Row, ...]
    tokens: tuple[int, ...]
    drafts: tuple[tuple[int, ...], ...]

    @property
    def k(self) -> int:
        return max(len(d) for d in self.drafts)


@dataclass(frozen=True)
class Acceptance:
    """Closes the last verify step: row r kept ``kept[r]`` of its emitted tokens, so its KV holds its
    token and ``kept[r] - 1`` drafts; the rest roll back (ACCEPT). Rows at their verify's lengths."""

    rows: tuple[Row, ...]
    kept: tuple[int, ...]


@dataclass(frozen=True)
class Rollback:
    """A row whose generated token was discarded (an EOS inside its thinking block): its last ``n``
    stored tokens go, and its next step stores and computes them again (ROLLBACK)."""

    row: Row
    n: int = 1


@dataclass(frozen=True)
class FreeBlocks:
    """A read of the free KV blocks while planning (``pool``: the owner rank under dp attention)."""

    n: int
    pool: int | None = None


@dataclass(frozen=True)
class Proposal:
    """The drafter's answer for a row while planning a verify step (before cuts to free blocks)."""

    row: Row
    k: int
    drafts: tuple[int, ...]


@dataclass(frozen=True)
class TickStart:
    """A tick's plan: the adapters of the requests drained this tick (none: no adapter calls),
    the free blocks read after it; ``startup`` on the run's first tick; ``record``: the model's
    note of adapters it unloaded."""

    tick: int
    drained: tuple[int, ...]
    free_blocks: int
    startup: bool = False
    record: object = None


@dataclass(frozen=True)
class StepPlan:
    """One step's work; every field optional (see the module's docstring for the order)."""

    start: TickStart | None = None
    checkpoints: tuple[Checkpoint, ...] = ()
    accept: Acceptance | None = None
    rollbacks: tuple[Rollback, ...] = ()
    releases: tuple[Release, ...] = ()
    room: tuple[FreeBlocks | Release, ...] = ()  # the decode lane's reads and preemptions, in order
    chunks: tuple[Chunk, ...] = ()
    drafting: tuple[Proposal | FreeBlocks, ...] = ()  # the verify lane's proposals and reads, in order
    decode: Decode | None = None
    verify: Verification | None = None
    compactions: tuple[Compaction, ...] = ()
    shutdown: bool = False

    def all_releases(self) -> list[Release]:
        """The plan's releases in execution order: the end of tick's, then the preemptions."""
        return list(self.releases) + [e for e in self.room if isinstance(e, Release)]

    def __bool__(self) -> bool:
        return any(
            (self.start, self.checkpoints, self.accept, self.rollbacks, self.releases, self.room, self.chunks)
        ) or any((self.drafting, self.decode, self.verify, self.compactions, self.shutdown))


@dataclass
class StepResult:
    """What executing a plan gave: ``first[i]`` the first tokens of chunk i when it ends a prompt
    (its sequence's, then each fork's); ``tokens`` a decode step's, ``emitted`` a verify step's per
    row (accepted drafts, then one more); a token may be a ``RowFailure``. ``logprobs``: seq_id ->
    the TokenLogprobs of its new tokens; ``prompt_logprobs``: seq_id -> the prompt positions'
    TokenLogprobs computed now; ``cumulative``: seq_id -> the logprob its new token adds (best_of).
    ``frames``: (plan item, command) of every command sent, in stream order."""

    first: dict = field(default_factory=dict)
    tokens: list = field(default_factory=list)
    emitted: list = field(default_factory=list)
    logprobs: dict = field(default_factory=dict)
    prompt_logprobs: dict = field(default_factory=dict)
    cumulative: dict = field(default_factory=dict)
    frames: list = field(default_factory=list)

    def frames_of(self, item) -> list:
        """The commands a plan item sent, in order."""
        return [cmd for owner, cmd in self.frames if owner is item]
