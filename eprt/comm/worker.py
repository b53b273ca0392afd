"""The worker-rank loop: decode rank 0's commands and run them on the executor until SHUTDOWN.

A command that does not decode, does not fit the executor's slots, or fails is reported to
rank 0 and ends the loop: a worker never guesses (docs/protocol.md, "Errors").
"""

from __future__ import annotations

import logging
from typing import Protocol

import numpy as np

from eprt.comm.protocol import (
    Command,
    Compact,
    Decode1,
    DecodeBatch,
    DecodeCkpt,
    DecodeDp,
    Decoder,
    Owner,
    Prefill,
    PrefillNext,
    ProtocolError,
    Release,
    Shutdown,
    Verify,
)
from eprt.comm.transport import RootDown

log = logging.getLogger(__name__)


class UnsupportedCommand(ProtocolError):
    """A reserved command (speculative verify) this build cannot run."""


class Executor(Protocol):
    """What a worker runs each command on (``eprt.engine.executor.ShardExecutor``): every call
    checks the command against the executor's slot table and mirrors what rank 0 does,
    including the MoE combines inside the forward passes."""

    hidden_size: int  # width of one vision row (the model's hidden size)

    def prefill(
        self, slot: int, tokens: np.ndarray, chunk_start: int, chunk_len: int, vision_rows: np.ndarray | None
    ) -> object:
        """Prefill ``tokens[chunk_start : chunk_start + chunk_len]`` into ``slot`` (the return
        value, logits on rank 0, is not used by workers). ``tokens``: uint32 [full prompt];
        ``vision_rows``: float32 [rows, hidden_size] for the prompt's image placeholders, or None."""

    def prefill_next(self, slot: int, chunk_start: int, tokens: np.ndarray) -> object:
        """Prefill the next chunk of the prompt (and vision rows) the slot's PREFILL brought;
        ``tokens``: uint32 [chunk_len], the prompt's tokens from ``chunk_start``."""

    def decode(self, slots: list[int], tokens: list[int]) -> None:
        """One decode step; row r appends ``tokens[r]`` to ``slots[r]`` (DECODE_BATCH and
        decode-one-token alike)."""

    def compact(self, slot: int, new_slot: int) -> None:
        """Move the sequence in ``slot`` to the empty ``new_slot``."""

    def checkpoint(self, slot: int, snapshot_tokens: int, end_block: int, session_hash: int, adapter_id: int) -> None:
        """DECODE_CKPT: save the slot's recurrent state as the snapshot of its first ``snapshot_tokens``
        tokens (a hybrid model with the prefix cache on; refused otherwise)."""

    def release(self, slot: int) -> None:
        """Free the sequence in ``slot``."""

    def assign_owner(self, slot: int, owner: int) -> None:
        """OWNER (dp attention, an executor whose ``dp`` is true): the next PREFILL into ``slot`` is
        owned by rank ``owner``. DECODE_DP calls ``decode(slots, tokens, counts)``."""

    def shutdown(self) -> None:
        """Free every slot and everything else the executor holds."""


class WorkerTransport(Protocol):
    """The worker side of ``eprt.comm.transport.Transport`` that the loop uses."""

    rank: int

    def recv_frame(self) -> np.ndarray:
        """The next frame's words (uint32); blocks without a time limit."""

    def recv_rows(self, n: int, width: int) -> np.ndarray:
        """The vision rows announced by the last PREFILL: float32 [n, width]."""

    def report_error(self, text: str) -> None:
        """Tell rank 0 this rank failed and wait until the job goes down."""


def run_worker(transport: WorkerTransport, executor: Executor, max_slots: int, vocab_size: int | None = None) -> int:
    """Serve rank 0's commands until SHUTDOWN (returns 0 after ``executor.shutdown()``).

    Returns 1 after a failure was reported to rank 0, or when rank 0 announced it is going
    down without a SHUTDOWN (then ``executor.shutdown()`` runs too).
    """
    decoder = Decoder(max_slots=max_slots, vocab_size=vocab_size)
    try:
        while True:
            cmd = decoder.next()
            if cmd is None:
                decoder.feed(transport.recv_frame())
                continue
            if isinstance(cmd, Shutdown):
                executor.shutdown()
                return 0
            _execute(cmd, transport, executor, decoder)
    except RootDown as e:
        log.error("rank %d: %s", transport.rank, e)
        executor.shutdown()
        return 1
    except Exception as e:  # noqa: BLE001 - every failure goes to rank 0, then the loop ends
        log.error("rank %d: command failed", transport.rank, exc_info=True)
        transport.report_error(f"{type(e).__name__}: {e}")
        return 1


def _execute(cmd: Command, transport: WorkerTransport, executor: Executor, decoder: Decoder) -> None:
    if isinstance(cmd, Prefill):
        rows = None
        if cmd.vision_rows:
            if decoder.pending:
                raise ProtocolError(
                    f"PREFILL slot {cmd.slot}: {decoder.pending} words arrived between the vision count and its rows"
                )
            rows = transport.recv_rows(cmd.vision_rows, executor.hidden_size)
        tokens = np.asarray(cmd.tokens, np.uint32)  # [full_len]
        executor.prefill(cmd.slot, tokens, cmd.chunk_start, cmd.chunk_len, rows)
    elif isinstance(cmd, PrefillNext):
        executor.prefill_next(cmd.slot, cmd.chunk_start, np.asarray(cmd.tokens, np.uint32))
    elif isinstance(cmd, Decode1):
        executor.decode([cmd.slot], [cmd.token])
    elif isinstance(cmd, DecodeBatch):
        executor.decode(list(cmd.slots), list(cmd.tokens))
    elif isinstance(cmd, Compact):
        executor.compact(cmd.slot, cmd.new_slot)
    elif isinstance(cmd, Release):
        executor.release(cmd.slot)
    elif isinstance(cmd, Verify):
        raise UnsupportedCommand(
            f"VERIFY_K{len(cmd.drafts)} (slot {cmd.slot}) is reserved for "
            "speculative decoding, which this build does not support"
        )
    elif isinstance(cmd, (Owner, DecodeDp)) and not getattr(executor, "dp", False):
        raise ProtocolError(
            f"{type(cmd).__name__} (slot {cmd.slots if isinstance(cmd, DecodeDp) else cmd.slot}) "
            "is for dp attention, but this rank runs replicated attention"
        )
    elif isinstance(cmd, Owner):
        executor.assign_owner(cmd.slot, cmd.owner)
    elif isinstance(cmd, DecodeDp):
        executor.decode(list(cmd.slots), list(cmd.tokens), list(cmd.counts))
    elif isinstance(cmd, DecodeCkpt):
        executor.checkpoint(cmd.slot, cmd.snapshot_tokens, cmd.end_block, cmd.session_hash, cmd.adapter_id)
    else:
        raise ProtocolError(f"no worker action for {cmd!r}")
