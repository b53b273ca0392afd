"""The worker-rank loop: decode rank 0's commands and run them on the executor until SHUTDOWN.

A command that does not decode, does not fit the executor's slots, or fails is reported to
rank 0 and ends the loop: a worker never guesses (docs/protocol.md, "Errors").
"""

from __future__ import annotations

import logging
from typing import Protocol

import numpy as np

from eprt.comm.protocol import Command, Decoder, Prefill, PrefillNext, ProtocolError, Shutdown, declaration
from eprt.comm.transport import RootDown

log = logging.getLogger(__name__)


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

    def prefill_group(self, commands: list, vision_rows: list) -> object:
        """Two or more PREFILL / PREFILL_NEXT commands of one frame as one forward pass, each
        as ``prefill`` / ``prefill_next`` would run it; ``vision_rows[i]``: PREFILL i's rows or None."""

    def decode(self, slots: list[int], tokens: list[int]) -> None:
        """One decode step; row r appends ``tokens[r]`` to ``slots[r]`` (DECODE_BATCH and
        decode-one-token alike)."""

    def verify(self, slots: list[int], tokens: list[int], drafts: list[tuple[int, ...]]) -> None:
        """VERIFY: row r appends ``tokens[r]`` and its drafts to ``slots[r]`` in one forward pass;
        the drafts stay pending until the ACCEPT."""

    def verify_mtp(self, slots: list[int], tokens: list[int], counts: list[int]) -> object:
        """VERIFY_MTP: the MTP layer drafts ``counts[r]`` tokens for row r (the same on every rank),
        then the VERIFY of ``tokens`` and those drafts runs."""

    def accept(self, slots: list[int], accepted: list[int]) -> None:
        """ACCEPT: row r keeps ``accepted[r]`` drafts of the last VERIFY; the rest roll back."""

    def fork(self, slot: int, new_slot: int) -> None:
        """Occupy the empty ``new_slot`` with a copy of the prefilled sequence in ``slot``."""

    def compact(self, slot: int, new_slot: int) -> None:
        """Move the sequence in ``slot`` to the empty ``new_slot``."""

    def checkpoint(self, slot: int, snapshot_tokens: int, end_block: int, session_hash: int, adapter_id: int) -> None:
        """DECODE_CKPT: save the slot's recurrent state as the snapshot of its first ``snapshot_tokens``
        tokens (a hybrid model with the prefix cache on; refused otherwise)."""

    def switch_placement(self, epoch: int, table: np.ndarray) -> None:
        """EPLB_PLACEMENT: hold the experts of ``table`` [layers, slots] from the next forward pass."""

    def release(self, slot: int) -> None:
        """Free the sequence in ``slot``."""

    adapters: object  # its LoRA slots: ``load`` (LORA_LOAD), ``unload`` (LORA_UNLOAD), ``set_slot`` (SLOT_ADAPTER)

    def assign_owner(self, slot: int, owner: int, prompt_hidden: bool = False) -> None:
        """OWNER (dp attention, an executor whose ``dp`` is true): the next PREFILL into ``slot`` is
        owned by rank ``owner`` (which returns every prompt position's hidden state to rank 0 if
        ``prompt_hidden``). DECODE_DP calls ``decode(slots, tokens, counts)``."""

    def check_state(self, step: int, transport) -> None:
        """CHECK_STATE (``--check-state``): compare this rank's digests of its mirrored state with
        every rank's, over ``transport``; raises when they differ."""

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
    group: list = []  # (command, vision rows) of the frame's current run of prefills
    try:
        while True:
            cmd = decoder.next()
            if isinstance(cmd, (Prefill, PrefillNext)):
                group.append((cmd, _vision_rows(cmd, transport, executor, decoder)))
                continue
            if group:  # the run ended (another command, or the frame's end): one forward
                _prefill(group, executor)
                group = []
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


def _vision_rows(cmd, transport: WorkerTransport, executor: Executor, decoder: Decoder) -> np.ndarray | None:
    """The rows a PREFILL announces, received right after its frame (None when it announces none)."""
    if not isinstance(cmd, Prefill) or not cmd.vision_rows:
        return None
    if decoder.pending:
        raise ProtocolError(
            f"PREFILL slot {cmd.slot}: {decoder.pending} words arrived between the vision count and its rows"
        )
    return transport.recv_rows(cmd.vision_rows, executor.hidden_size)


def _prefill(group: list, executor: Executor) -> None:
    """A frame's consecutive PREFILL / PREFILL_NEXT commands: one forward pass, as rank 0 ran them
    (docs/protocol.md, "Batched prefill"); a run of one takes the single-command calls."""
    if len(group) > 1:
        executor.prefill_group([c for c, _ in group], [r for _, r in group])
        return
    cmd, rows = group[0]
    if isinstance(cmd, Prefill):
        executor.prefill(cmd.slot, np.asarray(cmd.tokens, np.uint32), cmd.chunk_start, cmd.chunk_len, rows)
    else:
        executor.prefill_next(cmd.slot, cmd.chunk_start, np.asarray(cmd.tokens, np.uint32))


def _execute(cmd: Command, transport: WorkerTransport, executor: Executor, decoder: Decoder) -> None:
    """Run one command as its declaration says (``protocol.DECLARATIONS``: the worker's dispatch)."""
    spec = declaration(cmd)
    if spec.dp_only and not getattr(executor, "dp", False):
        where = cmd.slots if hasattr(cmd, "slots") else cmd.slot
        raise ProtocolError(
            f"{type(cmd).__name__} (slot {where}) is for dp attention, but this rank runs replicated attention"
        )
    spec.action(executor, cmd, transport)
