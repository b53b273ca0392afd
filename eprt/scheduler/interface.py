"""The model interface the scheduler drives (vLLM v1's shape, kept deterministic): the scheduler
plans a step (``eprt/scheduler/step.py``) through the model's accounting calls, the model
executes it, ``execute(plan) -> StepResult``, and the scheduler takes the result. Semantics and
trace lines: docs/scenarios.md.

Accounting calls run while a step is planned and change only the KV and slot accounting (slots,
blocks, the prefix cache, snapshot rows, adapter slots), in the order the plan will send their
commands; ``execute`` then writes the plan's frames and runs its forward passes. No call keeps
anything for a later call of the scheduler's: what a step computed is in its result.

A ``seq`` argument is the scheduler's ``Sequence``; the model may read ``seq_id``, ``slot``,
``token_ids``, ``num_prompt``, ``len``, ``params``, ``adapter``, ``choice``, ``image_embeds``,
``prompt_ids``, ``output_ids``, ``prompt_logprobs`` and ``think`` (its thinking block:
``eprt/scheduler/thinking.py``), and writes none of it but ``model_state``, its own.

A row's token in a result may be a ``RowFailure`` in its place: that request alone failed
(docs/scenarios.md, "One run").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from eprt.scheduler.step import Acceptance, Admission, ForkRow, StepPlan, StepResult


@dataclass(frozen=True)
class RowFailure:
    """A row's answer in place of its next token when a stage that computes it for that request
    alone failed (its logits processing, sampling, logprobs, grammar mask): the scheduler ends the
    sequence with reason ``error`` and ``reason`` as its error, and the step goes on for the other
    rows. The trace prints it as ``failed``."""

    reason: str

    def __str__(self) -> str:
        return "failed"


class ModelInterface(Protocol):
    # -- KV accounting, while a step is planned: a sequence of length L holds L // block_size + 1 blocks
    def num_free_blocks(self) -> int: ...

    def can_admit(self, seq) -> bool:
        """Whether a slot and the blocks for seq's prompt (after prefix-cache reuse) are free now."""

    def admit(self, seq) -> Admission:
        """Take the lowest free slot and the blocks of seq's prompt, reusing cached prefix blocks."""

    def plan_chunk(self, seq, start: int, n: int) -> object:
        """The prefill chunk [start, start + n) of the admitted seq is planned: the model's note of it
        (a hybrid model's snapshots inside it, whose rows it takes now), or None."""

    def can_fork(self, seq) -> bool:
        """Whether a further choice of seq (whose prompt's last chunk is planned) can fork off it now:
        a free slot and a free block."""

    def fork(self, seq, child) -> ForkRow:
        """Take the lowest free slot for child, sharing seq's full prompt blocks and one new block."""

    def release(self, seq, finish: bool) -> int:
        """Insert seq's full blocks into the prefix cache, free its slot and blocks; ``finish``: the
        sequence ended (else it was preempted and comes back). Returns how many blocks it held."""

    def compact(self, seq, new_slot: int) -> None:
        """Move seq from seq.slot to the free new_slot (its KV stays in its blocks)."""

    def checkpoint(self, seq) -> object:
        """After a decoded token: a hybrid model's snapshot of seq's state where one is due (the
        model's note of it), else None."""

    def accept(self, step: Acceptance) -> None:
        """Close the last verify step: each row keeps what ``step.kept`` says, the rest rolls back."""

    def refresh_adapters(self) -> object:
        """Once per tick that drains requests: adapters unregistered since leave their slots (the
        model's note of it, or None)."""

    # -- drafting (the verify lane), untraced queries --------------------------------------------
    def propose_drafts(self, seq, k: int) -> list[int]: ...

    def draft_cost(self, rows: int) -> float | None:
        """A draft position's measured cost at this batch size, in decode rows; None: not measured."""

    def verify_overhead(self, rows: int) -> float:
        """What a verify step costs at this batch size whatever its drafts, in decode rows; 0: not measured."""

    def catch_up_cost(self, rows: int) -> float:
        """Decode rows per position an MTP drafter's catch-up costs; 0: not measured, or no such drafter."""

    # -- execution ---------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        """Write the plan's frames and run its forward passes; the tokens and what else they give."""
