"""The slot table: the one record of the sequence slots on each rank (docs/protocol.md, "Slots").

Every check of a command against the slots is here; a failed check raises ``SlotError`` and
leaves the table unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from eprt.comm.protocol import ProtocolError


class SlotError(ProtocolError):
    """A well-formed command that does not fit the current slot state."""


@dataclass
class SlotState:
    key: int  # block-manager key: an occupancy counter, identical on every rank
    prompt: tuple[int, ...]  # the whole prompt (the PREFILL's tokens)
    tokens: list[int]  # tokens whose KV is stored: a prefix of the prompt, then decoded tokens
    adapter: int = -1
    vision_rows: object = None  # the PREFILL's vision rows [n, D], kept for its later chunks
    pending: int = 0  # drafts the open VERIFY stored after the row's token, until its ACCEPT

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def prefilled(self) -> bool:
        return self.length >= len(self.prompt)


class SlotTable:
    """Slots ``0 .. max_slots-1``, each empty (None) or holding a ``SlotState``."""

    def __init__(self, max_slots: int):
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        self.max_slots = max_slots
        self._slots: list[SlotState | None] = [None] * max_slots
        self.next_key = 0  # the key the next occupied slot gets
        self.open_verify: tuple[int, ...] | None = None  # slots of a VERIFY whose ACCEPT has not come

    def state(self) -> dict[int, tuple[int, tuple[int, ...]]]:
        """Occupied slots as ``{slot: (prompt length, stored tokens)}``: comparable across ranks."""
        return {i: (len(s.prompt), tuple(s.tokens)) for i, s in enumerate(self._slots) if s is not None}

    def mirrored_state(self) -> tuple:
        """Everything the slots hold, as data to hash (``--check-state``)."""
        held = tuple(
            (i, s.key, np.asarray(s.prompt, np.int64), np.asarray(s.tokens, np.int64), s.adapter, s.pending)
            for i, s in enumerate(self._slots)
            if s is not None
        )
        return held, self.next_key, self.open_verify

    def get(self, slot: int) -> SlotState | None:
        return self._slots[self._check_range(slot)]

    def lowest_free(self) -> int | None:
        return next((i for i, s in enumerate(self._slots) if s is None), None)

    def occupied(self) -> list[int]:
        return [i for i, s in enumerate(self._slots) if s is not None]

    def settled(self, what: str) -> None:
        """Refuse any command but ACCEPT while a VERIFY is open (its ACCEPT is the next command)."""
        if self.open_verify is not None:
            raise SlotError(
                f"{what} while the VERIFY of slots {list(self.open_verify)} awaits its ACCEPT "
                "(an ACCEPT must follow every VERIFY)"
            )

    def held(self, slot: int, what: str) -> SlotState:
        s = self.get(slot)
        if s is None:
            raise SlotError(f"{what} for empty slot {slot}")
        return s

    # -- changes -----------------------------------------------------------------------------
    def occupy(
        self, slot: int, prompt: Sequence[int], stored: int, adapter: int = -1, vision_rows: object = None
    ) -> SlotState:
        """Put a prompt into the empty ``slot``, its first ``stored`` tokens already in KV."""
        self.settled("PREFILL")
        if self.get(slot) is not None:
            raise SlotError(f"slot {slot} is already occupied")
        prompt = tuple(int(t) for t in prompt)
        state = SlotState(self.next_key, prompt, list(prompt[:stored]), adapter, vision_rows)
        self.next_key += 1
        self._slots[slot] = state
        return state

    def check_chunk(self, slot: int, prompt: Sequence[int], start: int, n: int) -> SlotState:
        """The held slot that the chunk ``prompt[start : start + n]`` continues."""
        self.settled("PREFILL")
        s = self.held(slot, "PREFILL")
        if s.prefilled:
            raise SlotError(
                f"PREFILL slot {slot}: the slot already holds a prefilled sequence (len {s.length}); RELEASE it first"
            )
        if start != s.length:
            raise SlotError(f"PREFILL slot {slot}: chunk starts at {start} but the slot holds {s.length} tokens")
        if n < 1 or start + n > len(prompt):
            raise SlotError(
                f"PREFILL slot {slot}: chunk [{start}, {start + n}) does not fit the prompt of {len(prompt)} tokens"
            )
        if len(prompt) != len(s.prompt) or tuple(prompt[: s.length]) != tuple(s.tokens):
            raise SlotError(
                f"PREFILL slot {slot}: chunk belongs to a different prompt than the one being prefilled in that slot"
            )
        return s

    def check_next_chunk(self, slot: int, start: int, tokens: Sequence[int]) -> SlotState:
        """The held slot whose prompt ``tokens`` continue at ``start`` (a PREFILL_NEXT)."""
        s = self.held(slot, "PREFILL_NEXT")
        end = start + len(tokens)
        if tuple(int(t) for t in tokens) != s.prompt[start:end] or end > len(s.prompt):
            raise SlotError(
                f"PREFILL_NEXT slot {slot}: tokens [{start}, {end}) are not those of the prompt "
                f"the slot's PREFILL brought ({len(s.prompt)} tokens)"
            )
        return self.check_chunk(slot, s.prompt, start, len(tokens))

    def check_decode(self, slots: Sequence[int], tokens: Sequence[int], what: str) -> list[SlotState]:
        """The states of a decode step's rows: distinct, held, prefilled slots."""
        self.settled(what)
        if len(slots) != len(tokens):
            raise SlotError(f"{what}: {len(slots)} slots but {len(tokens)} tokens")
        if len(set(slots)) != len(slots):
            raise SlotError(f"{what}: slot listed twice in {list(slots)}")
        try:  # the common case in one pass; any doubt takes the checks below, which name the row
            states = [self._slots[slot] if slot >= 0 else None for slot in slots]
            if all(s is not None and len(s.tokens) >= len(s.prompt) for s in states):
                return states
        except (IndexError, TypeError):
            pass
        states = [self.held(slot, what) for slot in slots]
        for slot, s in zip(slots, states):
            if not s.prefilled:
                raise SlotError(f"{what} slot {slot}: prefill incomplete ({s.length} of {len(s.prompt)} prompt tokens)")
        return states

    def check_verify(self, slots: Sequence[int], tokens: Sequence[int], drafts: Sequence[Sequence[int]]) -> list:
        """The states of a VERIFY's rows: those of a decode step, one draft list per row."""
        if len(drafts) != len(slots):
            raise SlotError(f"VERIFY: {len(slots)} slots but {len(drafts)} draft lists")
        return self.check_decode(slots, tokens, "VERIFY")

    def open(self, slots: Sequence[int], drafts: Sequence[Sequence[int]]) -> None:
        """Record the VERIFY just run: its drafts are pending until ``accept``."""
        for slot, d in zip(slots, drafts):
            self._slots[slot].pending = len(d)
        self.open_verify = tuple(int(s) for s in slots)

    def accept(self, slots: Sequence[int], accepted: Sequence[int]) -> list[tuple[SlotState, int]]:
        """Close the open VERIFY: row r keeps ``accepted[r]`` of its pending drafts. Returns
        (state, drafts dropped) per row; the stored tokens lose the dropped ones."""
        if self.open_verify is None or tuple(slots) != self.open_verify:
            raise SlotError(
                f"ACCEPT of slots {list(slots)}, but the open VERIFY has "
                f"{'none' if self.open_verify is None else list(self.open_verify)} (same slots, same order)"
            )
        if len(accepted) != len(slots):
            raise SlotError(f"ACCEPT: {len(slots)} slots but {len(accepted)} counts")
        states = [self._slots[slot] for slot in slots]
        for slot, s, a in zip(slots, states, accepted):
            if not 0 <= a <= s.pending:
                raise SlotError(f"ACCEPT slot {slot}: {a} drafts accepted, the VERIFY sent {s.pending}")
        out = []
        for s, a in zip(states, accepted):
            dropped, s.pending = s.pending - a, 0
            del s.tokens[len(s.tokens) - dropped :]
            out.append((s, dropped))
        self.open_verify = None
        return out

    def move(self, slot: int, new_slot: int) -> None:
        self.settled("COMPACT")
        s = self.held(slot, "COMPACT")
        if new_slot == slot or self.get(new_slot) is not None:
            raise SlotError(f"COMPACT slot {slot} -> {new_slot}: target slot is occupied")
        self._slots[new_slot], self._slots[slot] = s, None

    def vacate(self, slot: int, what: str = "RELEASE") -> SlotState:
        self.settled(what)
        s = self.held(slot, what)
        self._slots[slot] = None
        return s

    def _check_range(self, slot: int) -> int:
        if not 0 <= slot < self.max_slots:
            raise SlotError(f"slot {slot} out of range (max_slots={self.max_slots})")
        return slot
