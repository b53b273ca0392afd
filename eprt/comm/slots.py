"""The slot mirror: what every rank believes about the sequence slots.

Rank 0 owns the slots; each worker replays the broadcast commands onto a ``SlotMirror`` and
refuses any command that does not fit what it holds (a decode for an empty slot, a compaction
onto an occupied slot, a prefill chunk that does not continue the prompt, ...), rather than
guessing. Rank 0 can keep the same mirror of the stream it sends (``StreamChecker``), so a
bad stream is caught before it leaves rank 0 and both sides can be compared in tests.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from eprt.comm.protocol import (Command, Compact, Decode1, DecodeBatch, DecodeCkpt, Decoder, Prefill,
                                ProtocolError, Release, Shutdown, Verify)


class SlotError(ProtocolError):
    """A well-formed command that does not fit the current slot state."""


class UnsupportedCommand(ProtocolError):
    """A reserved command (speculative verify, hybrid-SSM checkpoint) this build cannot run."""


@dataclass
class SlotState:
    tokens: list[int]  # tokens whose KV is stored, in position order (prompt, then decoded)
    prompt_len: int    # the whole prompt's length; the prefill is done once len(tokens) reaches it

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def prefilled(self) -> bool:
        return self.length >= self.prompt_len


class SlotMirror:
    """Slots ``0 .. max_slots-1``, each empty (None) or holding a ``SlotState``."""

    def __init__(self, max_slots: int):
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        self.max_slots = max_slots
        self.slots: list[SlotState | None] = [None] * max_slots

    def state(self) -> dict[int, tuple[int, tuple[int, ...]]]:
        """Occupied slots as ``{slot: (prompt_len, tokens)}``: comparable across ranks."""
        return {i: (s.prompt_len, tuple(s.tokens)) for i, s in enumerate(self.slots) if s is not None}

    def occupied(self, slot: int) -> bool:
        return self.slots[self._check_range(slot)] is not None

    def apply(self, cmd: Command) -> None:
        """Validate ``cmd`` against the mirror and update it; raises SlotError, leaving the
        mirror unchanged, when the command does not fit."""
        if isinstance(cmd, Prefill):
            self._prefill(cmd)
        elif isinstance(cmd, Decode1):
            self._decode([cmd.slot], [cmd.token], "decode")
        elif isinstance(cmd, DecodeBatch):
            self._decode(cmd.slots, cmd.tokens, "DECODE_BATCH")
        elif isinstance(cmd, Compact):
            self._held(cmd.slot, "COMPACT")
            if cmd.new_slot == cmd.slot or self.occupied(cmd.new_slot):
                raise SlotError(f"COMPACT slot {cmd.slot} -> {cmd.new_slot}: target slot is occupied")
            self.slots[cmd.new_slot], self.slots[cmd.slot] = self.slots[cmd.slot], None
        elif isinstance(cmd, Release):
            self._held(cmd.slot, "RELEASE")
            self.slots[cmd.slot] = None
        elif isinstance(cmd, Shutdown):
            self.slots = [None] * self.max_slots
        elif isinstance(cmd, Verify):
            raise UnsupportedCommand(f"VERIFY_K{len(cmd.drafts)} (slot {cmd.slot}) is reserved for "
                                     "speculative decoding, which this build does not support")
        elif isinstance(cmd, DecodeCkpt):
            raise UnsupportedCommand(f"DECODE_CKPT (slot {cmd.slot}) is reserved for hybrid-SSM "
                                     "models, which this build does not support")
        else:
            raise ProtocolError(f"not a protocol command: {cmd!r}")

    def _prefill(self, cmd: Prefill) -> None:
        end = cmd.chunk_start + cmd.chunk_len
        if end > cmd.full_len:
            raise SlotError(f"PREFILL slot {cmd.slot}: chunk [{cmd.chunk_start}, {end}) runs past "
                            f"the prompt of {cmd.full_len} tokens")
        s = self.slots[self._check_range(cmd.slot)]
        if s is None:
            # A first chunk may start past 0: the prefix [0, chunk_start) comes from the prefix cache.
            self.slots[cmd.slot] = SlotState(list(cmd.tokens[:end]), cmd.full_len)
            return
        if s.prefilled:
            raise SlotError(f"PREFILL slot {cmd.slot}: the slot already holds a prefilled sequence "
                            f"(len {s.length}); RELEASE it first")
        if cmd.chunk_start != s.length:
            raise SlotError(f"PREFILL slot {cmd.slot}: chunk starts at {cmd.chunk_start} but the "
                            f"slot holds {s.length} tokens")
        if cmd.full_len != s.prompt_len or tuple(cmd.tokens[:s.length]) != tuple(s.tokens):
            raise SlotError(f"PREFILL slot {cmd.slot}: chunk belongs to a different prompt than "
                            "the one being prefilled in that slot")
        s.tokens.extend(cmd.tokens[cmd.chunk_start:end])

    def _decode(self, slots: Sequence[int], tokens: Sequence[int], what: str) -> None:
        if len(slots) != len(tokens):
            raise SlotError(f"{what}: {len(slots)} slots but {len(tokens)} tokens")
        if len(set(slots)) != len(slots):
            raise SlotError(f"{what}: slot listed twice in {list(slots)}")
        for slot in slots:
            s = self._held(slot, what)
            if not s.prefilled:
                raise SlotError(f"{what} slot {slot}: prefill incomplete "
                                f"({s.length} of {s.prompt_len} prompt tokens)")
        for slot, token in zip(slots, tokens):
            self.slots[slot].tokens.append(int(token))

    def _held(self, slot: int, what: str) -> SlotState:
        s = self.slots[self._check_range(slot)]
        if s is None:
            raise SlotError(f"{what} for empty slot {slot}")
        return s

    def _check_range(self, slot: int) -> int:
        if not 0 <= slot < self.max_slots:
            raise SlotError(f"slot {slot} out of range (max_slots={self.max_slots})")
        return slot


class StreamChecker:
    """Decodes outgoing words and applies them to a mirror, the way every worker will.

    Rank 0's transport feeds it each frame before sending, so an invalid stream raises on
    rank 0 instead of failing on the workers; ``mirror`` is rank 0's view of the slots.
    """

    def __init__(self, max_slots: int, vocab_size: int | None = None):
        self.decoder = Decoder(max_slots=max_slots, vocab_size=vocab_size)
        self.mirror = SlotMirror(max_slots)

    def feed(self, words: np.ndarray | Sequence[int]) -> list[Command]:
        self.decoder.feed(words)
        cmds = []
        for cmd in self.decoder:
            self.mirror.apply(cmd)
            cmds.append(cmd)
        return cmds
