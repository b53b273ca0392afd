"""The model interface the scheduler drives, in two parts: the calls that do work
(``ModelInterface``) and the calls that exist only for the trace (``TraceCalls``, no-ops
that the recording fake overrides to print). Semantics and trace lines: docs/scenarios.md.

A ``seq`` argument is the scheduler's ``Sequence``; the model may read ``seq_id``, ``slot``,
``token_ids``, ``num_prompt``, ``len``, ``params``, ``adapter``, ``image_embeds`` and ``think`` (its
thinking block: ``eprt/scheduler/thinking.py``), may set
``seq.cached`` in ``alloc_sequence``, may keep its own state in ``seq.model_state``, and writes
``seq.logprobs`` / ``seq.prompt_logprobs`` (before the token they describe is accepted).

A call that returns a row's next token (``argmax_on_device``, ``argmax_batch``, ``verify_readback``)
may return a ``RowFailure`` in its place: that request alone failed (docs/scenarios.md, "One run").
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol


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
    # -- KV memory: a sequence of length L holds L // block_size + 1 blocks ---------------------
    def num_free_blocks(self) -> int: ...

    def can_admit(self, seq) -> bool:
        """Whether the blocks for seq's prompt (after prefix-cache reuse) are free now (untraced)."""

    def alloc_sequence(self, seq) -> int:
        """Take the lowest free slot, reserve blocks for the prompt (reusing cached prefix
        blocks; sets seq.cached) and return the slot."""

    def cache_sequence(self, seq) -> None:
        """Insert the sequence's full KV blocks into the prefix cache (release path)."""

    def free_sequence(self, seq) -> int:
        """Free the slot and the sequence's blocks, and tell the workers (RELEASE); returns
        how many blocks it held."""

    def can_fork(self, seq) -> bool:
        """Whether a further choice of the prefilled seq can fork off it now: a free slot and
        a free block (untraced)."""

    def fork_sequence(self, seq, child) -> int:
        """Take the lowest free slot for child, a further choice of the prefilled seq: it shares
        seq's full KV blocks and copies the partial last one (FORK); returns the slot. The next
        argmax_batch has one more row, the prompt's logits again, sampled for child."""

    def compact_sequence(self, seq, new_slot: int) -> None:
        """Move the sequence from seq.slot to new_slot (COMPACT; KV stays in its blocks)."""

    # -- compute: each call sends the frame the workers need (PREFILL, DECODE_BATCH) --------
    def prefill(self, seq, start: int, n: int, stream: int) -> None:
        """Prefill seq.token_ids[start:start+n] (the scheduler then sets seq.len = start + n)."""

    def argmax_on_device(self, row: int, stream: int) -> int:
        """The next token from the last prefill (sampled per seq.params; greedy at T=0)."""

    def decode_batch(self, tokens: Seq[int], seqs: list, stream: int) -> None:
        """One decode step: tokens[r] is appended to seqs[r] at position seqs[r].len."""

    def argmax_batch(self, row: int, n: int, stream: int) -> list[int]:
        """The next token of rows [row, row+n) of the last decode_batch."""

    # -- shutdown ------------------------------------------------------------------------------
    def ep_shutdown(self) -> None:
        """Send SHUTDOWN to the workers."""

    def synchronize(self, stream: int) -> None: ...

    def teardown(self) -> None: ...


class TraceCalls:
    """The interface's trace-only calls: no-ops for a model without streams, adapters,
    drafters or recurrent state."""

    def bind_gpu_to_thread(self) -> None:
        pass

    def create_stream(self) -> int:
        return 1

    def create_event(self) -> int:
        return 2

    def adapter_id_for(self, adapter: int) -> int:
        return adapter

    def acquire_adapter_slot(self, adapter: int) -> None:
        pass

    def commit_ctx(self, seq, n: int, base: int, row: int) -> None:
        pass

    def decode_marconi_checkpoint(self, seq) -> None:
        pass

    def draft_cost(self, rows: int) -> float | None:
        """Untraced: a draft position's measured cost at this batch size, in decode rows (a decode
        step's time over its rows); None: not measured (speculation.DRAFT_COST)."""
        return None

    def verify_overhead(self, rows: int) -> float:
        """Untraced: what a verify step costs at this batch size whatever its drafts, in decode
        rows, as measured (speculation.StepCosts); 0: not measured."""
        return 0.0

    def catch_up_cost(self, rows: int) -> float:
        """Untraced: decode rows per position that an MTP drafter's catch-up costs at this batch
        size, as measured (speculation.StepCosts); 0: not measured, or no such drafter."""
        return 0.0

    # untraced hints of the prefill lane (docs/scenarios.md, "Prefill lane"): a model that runs a
    # tick's prefill chunks as one forward learns them ahead; these defaults decline
    def admit_ahead(self, seq) -> int | None:
        """If ``can_admit(seq)``: hold what this tick's ``alloc_sequence(seq)`` will take and return
        the cached length it will set; None otherwise (or when the model does not plan ahead)."""
        return None

    def plan_prefills(self, chunks: list) -> None:
        """The (seq, start, n) chunks this tick's prefill lane will run, in order."""
