"""The model interface the scheduler drives: exactly the calls the trace records.

Two implementations: ``eprt.scheduler.fake.RecordingModel`` (prints each call, for
scenarios and golden traces) and ``eprt.engine.runner.ModelRunner`` (the real model on
rank 0, which also sends the broadcast frames of ``shared/spec/PROTOCOL.md`` to the
worker ranks).

A ``seq`` argument is the scheduler's ``Sequence`` (``eprt/scheduler/sequence.py``); the
model may read these attributes and nothing else:
    seq.seq_id        int, the request's id (printed ``s<seq_id>``)
    seq.slot          int, the slot the sequence occupies (-1 before alloc)
    seq.token_ids     list[int], prompt tokens followed by every generated token
    seq.num_prompt    int, how many of token_ids are prompt (after a preemption the
                      re-admitted prompt is the old prompt plus the tokens generated so far)
    seq.len           int, tokens whose KV is stored (prompt len after prefill; +1 per decode)
    seq.params        eprt.engine.api.SamplingParams
    seq.adapter       int, the adapter id (-1: the active one)
    seq.image_embeds  numpy [n, D] float32 or None
and the model may set ``seq.cached`` (prefix-cache hit length) inside ``alloc_sequence``
and keep its own per-sequence state in ``seq.model_state`` (the scheduler never reads it).

Block accounting (shared by the fake and the real runner through
``eprt.cache.block_manager.BlockManager``): a sequence of length L holds
``L // block_size + 1`` blocks, i.e. always room for the next token.
"""
from __future__ import annotations

from typing import Protocol, Sequence as Seq


class ModelInterface(Protocol):
    # -- start-up ----------------------------------------------------------------------
    def bind_gpu_to_thread(self) -> None: ...
    def create_stream(self) -> int: ...
    def create_event(self) -> int: ...

    # -- adapters (-1 means "the active adapter"; without LoRA support both are no-ops) --
    def adapter_id_for(self, adapter: int) -> int: ...
    def acquire_adapter_slot(self, adapter: int) -> None: ...

    # -- KV memory -----------------------------------------------------------------------
    def num_free_blocks(self) -> int: ...
    def can_admit(self, seq) -> bool:
        """Whether the blocks for seq's prompt (after prefix-cache reuse) are free now.
        Not part of the trace (no line is printed)."""
    def alloc_sequence(self, seq) -> int:
        """Take the lowest free slot, reserve blocks for the prompt (reusing cached prefix
        blocks; sets seq.cached) and return the slot."""
    def cache_sequence(self, seq) -> None:
        """Insert the sequence's full KV blocks into the prefix cache (release path)."""
    def free_sequence(self, seq) -> int:
        """Free the slot and the sequence's blocks; returns how many blocks it held."""
    def compact_sequence(self, seq, new_slot: int) -> None:
        """Move the sequence from seq.slot to new_slot (KV stays in its blocks)."""

    # -- the broadcast frame (rank 0 -> workers); the real runner coalesces the words ----
    def ep_broadcast_cmd_for_seq(self, seq: int, cmd: int) -> None: ...
    def ep_broadcast_cmd(self, word: int) -> None: ...
    def ep_broadcast_tokens(self, tokens: Seq[int]) -> None: ...
    def ep_sync_vision_embeds(self, seq) -> None:
        """The vision sync after a PREFILL's token array (count word, then rows)."""

    # -- compute -------------------------------------------------------------------------
    def prefill(self, seq, start: int, n: int, stream: int) -> None:
        """Prefill seq.token_ids[start:start+n] into seq's KV; afterwards seq.len is
        start + n (the scheduler updates seq.len)."""
    def argmax_on_device(self, row: int, stream: int) -> int:
        """The next token from the last prefill (sampled per seq.params; greedy at T=0)."""
    def decode_batch(self, tokens: Seq[int], seqs: list, stream: int) -> None:
        """One decode step: tokens[r] is appended to seqs[r] at position seqs[r].len.
        The real runner sends the DECODE_BATCH frame itself."""
    def commit_ctx(self, seq, n: int, base: int, row: int) -> None: ...
    def argmax_batch(self, row: int, n: int, stream: int) -> list[int]:
        """The next token of rows [row, row+n) of the last decode_batch."""
    def decode_marconi_checkpoint(self, seq) -> None: ...

    # -- shutdown ------------------------------------------------------------------------
    def ep_shutdown(self) -> None:
        """Send SHUTDOWN (printed as ep_broadcast_cmd_for_seq(seq=0, cmd=0xffffffff))."""
    def synchronize(self, stream: int) -> None: ...
    def teardown(self) -> None: ...
