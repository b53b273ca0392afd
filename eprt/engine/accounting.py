"""Rank 0's KV accounting for the scheduler (a part of the runner, ``ModelRunner.kv``): the calls
the scheduler makes while it plans a step (``eprt/scheduler/interface.py``). Each runs the
accounting half of a command on rank 0's executor (slots, blocks, the prefix cache, snapshot
rows, owners, LoRA slots) in the order the step's frames will carry those commands; the step's
execution (``ModelRunner.execute``) sends the frames and runs the passes. A worker runs both
halves of each command when it arrives (docs/design.md, "One step").
"""

from __future__ import annotations

from dataclasses import dataclass

from eprt.comm import protocol as P
from eprt.engine.choices import choice_seed
from eprt.engine.executor import vision_salt
from eprt.engine.isolation import one_by_one
from eprt.engine.sampling import History, request_seed
from eprt.scheduler.interface import RowFailure
from eprt.scheduler.step import Admission, ForkRow


@dataclass
class SeqModelState:
    """What the runner keeps on a sequence (``seq.model_state``; never read by the scheduler)."""

    seed: int  # its sampling key: token p's draw is token_uniform(seed, p), whatever the batch
    salt: bytes  # prefix-cache salt of its vision rows, hashed once
    checkpoints: tuple = ()  # hybrid models: token counts at which this admission's prefill snapshots
    matcher: object = None  # structured outputs: its grammar's llguidance matcher (eprt/engine/structured.py)
    history: History | None = None  # penalties and bad words: the prompt's ids and the generated counts
    failure: RowFailure | None = None  # its grammar's matcher or its prompt logprobs failed: its next token is this


@dataclass(frozen=True)
class AdmissionNote:
    """``Admission.record``: what the admission's frames need besides its slot."""

    prompt_hidden: bool  # its prefill returns every prompt position's hidden state (prompt logprobs)
    adapter_frames: tuple = ()  # its adapter's LORA_LOAD (when it went into a LoRA slot now) and SLOT_ADAPTER


@dataclass(frozen=True)
class Piece:
    """A piece of a hybrid model's prefill chunk: the tokens [start, start + n), then, when
    ``snapshot`` is set, the DECODE_CKPT of the state there into snapshot ``row``."""

    start: int
    n: int
    snapshot: P.DecodeCkpt | None = None
    row: int = -1


def wants_prompt_logprobs(seq) -> bool:
    """Whether the sequence asks for prompt logprobs it does not have yet (then its prompt is
    computed whole: no prefix-cache hit, and the LM head runs over every prompt position)."""
    return seq.params.prompt_logprobs is not None and (
        seq.prompt_logprobs is None or len(seq.prompt_logprobs) < len(seq.prompt_ids)
    )


class Accounts:
    def __init__(self, executor, pools, rng, adapters=None, guides=None):
        self.executor, self.pools, self._rng = executor, pools, rng
        self.adapters = adapters  # the adapters part (eprt/engine/adapter_slots.py), or None: none served
        self.guides = guides  # eprt.engine.structured.GuidedRows (set by the engine)
        self.accepted_tokens = 0  # speculative drafts accepted, over every ACCEPT

    @property
    def pooled(self) -> bool:
        """One KV pool per owner rank (dp attention): the scheduler asks ``pool_of`` and ``free_blocks_in``."""
        return self.pools.pooled

    def num_free_blocks(self) -> int:
        return self.pools.num_free_blocks()

    def pool_of(self, seq) -> int:
        return self.pools.pool_of(seq)

    def free_blocks_in(self, pool: int) -> int:
        return self.pools.free_blocks_in(pool)

    def admission_pool(self, seq) -> int | None:
        return self.pools.admission_pool(seq, self.state_of(seq).salt)

    def state_of(self, seq) -> SeqModelState:
        """The runner's per-sequence state, made once (a preempted sequence keeps it)."""
        if seq.model_state is None:
            seed = choice_seed(request_seed(seq.params, self._rng), seq.choice)
            seq.model_state = SeqModelState(seed=seed, salt=vision_salt(seq.image_embeds))
            if seq.params.guide is not None:  # compiled at submit; a matcher that fails fails its row
                (matcher,) = one_by_one(
                    [seq.params.guide], self.guides.compiler.matcher, "the structured-output grammar"
                )
                if isinstance(matcher, RowFailure):
                    seq.model_state.failure = matcher
                else:
                    seq.model_state.matcher = matcher
        return seq.model_state

    # ---- admission ---------------------------------------------------------------------------
    def can_admit(self, seq) -> bool:
        if self.executor.slots.lowest_free() is None:
            return False  # every slot taken (by running sequences, forks, or this step's admissions)
        if seq.adapter != -1 and (self.adapters is None or not self.adapters.can_place(self.executor, seq.adapter)):
            return False  # every LoRA slot holds an adapter running sequences use
        return self.pools.has_room(seq, self.state_of(seq).salt, 0 if wants_prompt_logprobs(seq) else None)

    def admit(self, seq) -> Admission:
        """The lowest free slot, its owner under dp attention, the adapter's LoRA slot, the prompt's blocks."""
        if seq.adapter != -1 and self.adapters is None:
            raise ValueError(f"adapter {seq.adapter} requested but this engine serves no adapters (--max-loras 0)")
        slot, state = self.executor.slots.lowest_free(), self.state_of(seq)
        if slot is None:
            raise RuntimeError("admission with every slot occupied")
        hidden = wants_prompt_logprobs(seq)
        owner = self.pools.place(seq, state.salt, slot, hidden)
        frames = () if seq.adapter == -1 else tuple(self.adapters.admit(self.executor, slot, seq.adapter))
        prompt = seq.token_ids[: seq.num_prompt]
        cached = self.executor.allocate(
            slot, prompt, seq.adapter, seq.image_embeds, state.salt, max_hit=0 if hidden else None
        )
        hybrid = self.executor.hybrid
        state.checkpoints = () if hybrid is None else hybrid.prefill_points(self.executor.slots.get(slot))
        return Admission(slot, cached, owner, AdmissionNote(hidden, frames))

    def plan_chunk(self, seq, start: int, n: int) -> tuple:
        """The chunk's blocks (a sliding window's taken now, in stream order: a fork after the prompt's
        last chunk copies them) and its pieces: split where a hybrid model snapshots its state (the
        rows taken now)."""
        end, piece, out = start + n, start, []
        self.executor.seqs.grow(seq.slot, self.executor.slots.get(seq.slot), end, start)
        points = self.state_of(seq).checkpoints
        for stop in sorted({p for p in points if start < p <= end} | {end}):
            snapshot, row = None, -1
            if stop in points:
                snapshot = P.DecodeCkpt(seq.slot, *self.executor.checkpoint_words(seq.slot, stop))
                row = self.executor.hybrid.row(self.executor.slots.get(seq.slot), stop)
            if stop > piece or snapshot is not None:
                out.append(Piece(piece, stop - piece, snapshot, row))
            piece = stop
        return tuple(out)

    # ---- forks, releases, compaction ------------------------------------------------------
    def can_fork(self, seq) -> bool:
        return self.executor.seqs.can_fork(seq.slot)

    def fork(self, seq, child) -> ForkRow:
        """A further choice of seq's prompt, forked when its last chunk is planned (its KV is copied
        once the chunk's pass has run): the lowest free slot, seq's full blocks, one new block."""
        slot = self.executor.slots.lowest_free()
        if slot is None:
            raise RuntimeError("fork with every slot occupied")
        copy = self.executor.fork_slots(seq.slot, slot, seq.len)
        parent = self.state_of(seq)  # choice 0: its seed is the request's key
        child.model_state = SeqModelState(
            seed=choice_seed(parent.seed, child.choice), salt=parent.salt, failure=parent.failure
        )
        if parent.matcher is not None:  # the fork's grammar state starts where the parent's is: the prompt's end
            child.model_state.matcher = parent.matcher.deep_copy()
        return ForkRow(child, slot, copy)

    def release(self, seq, finish: bool) -> int:
        return self.executor.release(seq.slot)

    def compact(self, seq, new_slot: int) -> None:
        self.executor.compact(seq.slot, new_slot)

    def checkpoint(self, seq) -> P.DecodeCkpt | None:
        """After a decoded token: a hybrid model snapshots at each block boundary decoding reaches,
        the latest replacing the sequence's previous one (its turn end survives)."""
        hybrid = self.executor.hybrid
        if hybrid is None or not hybrid.due(self.executor.slots.get(seq.slot)):
            return None
        words = self.executor.checkpoint_words(seq.slot)
        self.executor.checkpoint(seq.slot, *words)
        return P.DecodeCkpt(seq.slot, *words)

    def accept(self, step) -> None:
        """The verify step's ACCEPT: each row keeps ``kept - 1`` drafts, the rest roll back."""
        accepted = [n - 1 for n in step.kept]
        self.executor.accept([r.slot for r in step.rows], accepted)
        self.accepted_tokens += sum(accepted)

    def rollback(self, seq, n: int) -> None:
        """A discarded token gives its step back: the sequence's last ``n`` stored tokens go."""
        self.executor.rollback(seq.slot, n)

    def refresh_adapters(self) -> list | None:
        """Empty the slots of adapters unregistered since the last tick (their LORA_UNLOADs)."""
        if self.adapters is None:
            return None
        return self.adapters.unload_orphans(self.executor) or None
