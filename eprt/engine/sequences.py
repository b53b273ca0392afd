"""One rank's sequence state (a part of the executor): the slot table (``eprt/comm/slots.py``: each
slot's prompt and stored tokens, the one record on this rank of a sequence's length and tokens),
the pool holding each sequence's blocks (``block_pools.py``), its prefix-cache salt, and the
block-table rows the passes read (a cache of the block manager's tables, refreshed where a row
changed hands, needs a new block or its sliding window moved on: ``window_tables.py``). Every
command's accounting goes through here, on rank 0 while the step is planned and on a worker when
the command arrives (docs/design.md, "One step").
B rows, MB blocks per row.
"""

from __future__ import annotations

import hashlib

import numpy as np

from eprt.api import JobFailure
from eprt.cache.block_manager import BlockManager
from eprt.comm.slots import SlotError, SlotTable
from eprt.engine.window_tables import WindowTables


class ExecutorError(JobFailure):
    """A command this rank cannot execute (its state disagrees with the command): shared state."""


def prefix_tokens(st, length: int) -> list:
    """The first ``length`` tokens of a slot's sequence: its prompt's while they are (rank 0 plans a
    prompt's forks and snapshots before the passes that store them), then its stored tokens."""
    return list(st.prompt[:length]) if length <= len(st.prompt) else st.tokens[:length]


def vision_salt(rows: np.ndarray | None) -> bytes:
    """Prefix-cache salt of a prompt's vision rows: image placeholders are one token id
    whatever the image, so KV after them depends on the rows too. Rank 0 hashes the
    float32 rows it broadcasts, so every rank computes the same salt."""
    if rows is None or len(rows) == 0:
        return b""
    return hashlib.blake2b(np.ascontiguousarray(rows, dtype=np.float32).tobytes(), digest_size=16).digest()


class Sequences:
    def __init__(self, max_slots: int, block_size: int, pools):
        self.slots = SlotTable(max_slots)
        self.pools = pools  # block_pools.SharedBlocks | OwnerBlocks
        self.block_size = block_size
        self.salts: dict[int, bytes] = {}  # slot key -> prefix-cache salt (snapshot hashes)
        self.pending_adapter: dict[int, int] = {}  # slot -> adapter id its next PREFILL uses (SLOT_ADAPTER)
        self._tables = np.zeros((max_slots, 8), dtype=np.int32)  # [slots, MB] block table of each slot
        self._table_key = np.full(max_slots, -1, dtype=np.int64)  # block-manager key each row was built for
        self._table_len = np.zeros(max_slots, dtype=np.int64)  # blocks in each row
        self.wtables = None if pools.blocks.window is None else WindowTables(max_slots)  # windowed KV's rows

    # ---- occupancy ---------------------------------------------------------------------------
    def allocate(self, slot: int, tokens, adapter: int, vision_rows, salt: bytes, max_hit: int | None):
        """Occupy the empty ``slot`` with a prompt, reserving its blocks; (its state, the prefix-cache hit).
        With windowed KV, a hit's window blocks are copies of cached ones (``window_copies``)."""
        if self.slots.get(slot) is not None:
            raise SlotError(f"slot {slot} is already occupied")
        key = self.slots.next_key
        blocks = self.pools.for_new(slot)
        cached = blocks.allocate(key, [int(t) for t in tokens], adapter, salt, max_hit=max_hit)
        st = self.slots.occupy(slot, tokens, cached, adapter, vision_rows)
        self.salts[key] = salt
        return st, cached

    def blocks_of(self, slot: int) -> BlockManager:
        return self.pools.of(slot)

    def window_copies(self, slot: int) -> list:
        """The (source, destination) KV block copies the slot's pool's window asked for since the last
        call (a prefix hit's or a fork's window blocks; none without windowed KV)."""
        window = self.blocks_of(slot).window
        return [] if window is None else window.pop_copies()

    def cache(self, slot: int, upto: int | None = None) -> None:
        """Offer the slot's full blocks among its first ``upto`` stored tokens to the prefix cache."""
        st = self.slots.held(slot, "cache")
        self.blocks_of(slot).cache(st.key, st.tokens if upto is None else st.tokens[:upto])

    def free(self, slot: int) -> tuple[int, int]:
        """Empty the slot and free its blocks: (its key, how many blocks it held)."""
        blocks = self.blocks_of(slot)
        key = self.slots.vacate(slot).key
        self.salts.pop(key, None)
        self.pools.freed(slot)
        return key, blocks.free(key)

    def fork(self, slot: int, new_slot: int, length: int) -> list:
        """FORK's accounting: ``new_slot`` holds the first ``length`` tokens of the sequence in ``slot``
        (its prompt, which rank 0 forks while planning, before the prompt's last pass has run), its
        full blocks shared and one new block (with windowed KV, copies of its window's blocks).
        Returns the (source, copy) blocks whose KV is copied once the parent's pass has run."""
        st = self.slots.held(slot, "FORK")
        if self.slots.get(new_slot) is not None:
            raise SlotError(f"FORK slot {slot} -> {new_slot}: target slot is occupied")
        key = self.slots.next_key
        copy = self.blocks_of(slot).fork(st.key, key, length)
        child = self.slots.occupy(new_slot, st.prompt, 0, st.adapter, st.vision_rows)
        child.tokens.extend(prefix_tokens(st, length))
        self.salts[key] = self.salts[st.key]
        self.pools.forked(slot, new_slot)
        return ([] if copy is None else [copy]) + self.window_copies(slot)

    def can_fork(self, slot: int) -> bool:
        """Whether FORK of ``slot`` can run now: a free slot and a free block in its pool."""
        return self.slots.lowest_free() is not None and self.blocks_of(slot).can_fork()

    def move(self, slot: int, new_slot: int) -> None:
        self.slots.move(slot, new_slot)
        self.pools.moved(slot, new_slot)

    def prefix(self, st, length: int) -> bytes:
        """The chain hash of the first ``length`` tokens of the sequence ``st`` (its salt and adapter)."""
        blocks = self.pools.blocks  # (the hash does not depend on the pool)
        return blocks.chain_hashes(prefix_tokens(st, length), st.adapter, self.salts[st.key])[-1]

    # ---- a step's rows -----------------------------------------------------------------------
    def grow(self, slot: int, st, new_len: int, first: int) -> bool:
        """Room in the slot's pool for ``new_len`` tokens of ``st``, for a step whose first query is at
        ``first`` (which moves a sliding window on; BlockManager.grow); True when a table changed."""
        return self.blocks_of(slot).grow(st.key, new_len, first=first)

    def chunk(self, c, allocate) -> tuple:
        """A prefill chunk's accounting: its slot's first chunk on a worker allocates as rank 0 did
        (``allocate(chunk, adapter)`` gives the hit, which must be the chunk's start), then the chunk
        continues the slot and its owner's pool grows to hold it. Returns (state, the new tokens)."""
        tokens = [int(t) for t in c.tokens]
        if self.slots.get(c.slot) is None:  # first chunk on a worker: allocate exactly as rank 0 did
            cached = allocate(c, self.pending_adapter.pop(c.slot, -1))
            if cached != c.chunk_start:
                raise ExecutorError(
                    f"prefix cache diverged on slot {c.slot}: this rank reuses {cached} tokens, "
                    f"rank 0 sent chunk_start={c.chunk_start}"
                )
        st = self.slots.check_chunk(c.slot, tokens, c.chunk_start, c.chunk_len)
        end = c.chunk_start + c.chunk_len
        self.grow(c.slot, st, end, c.chunk_start)  # (on rank 0: done while planning, Accounts.plan_chunk)
        return st, tokens[c.chunk_start : end]

    def tables(self, slots: list, states: list, need: np.ndarray) -> np.ndarray:
        """Block tables [B, MB] (zero-padded) of rows ``slots`` whose KV this rank holds, with room
        for ``need[r]`` blocks each: a row goes back to the block manager (and grows) only where its
        slot changed hands, it needs a new block or its window moves on (the step's first query at
        each row's length)."""
        rows = np.asarray(slots, dtype=np.int64)  # [B]
        keys = np.fromiter((st.key for st in states), dtype=np.int64, count=len(states))
        lengths = np.fromiter((st.length for st in states), dtype=np.int64, count=len(states))
        stale = (self._table_key[rows] != keys) | (self._table_len[rows] < need)
        if self.wtables is not None:
            stale |= self.wtables.moved(self.pools.blocks.window, rows, lengths)
        for r in np.flatnonzero(stale):
            st = states[r]
            self.grow(int(rows[r]), st, int(need[r] - 1) * self.block_size, st.length)
            self._store_table(int(rows[r]), st.key)
        return self._tables[rows, : int(self._table_len[rows].max())]

    def table_rows(self, slots: list, pick) -> np.ndarray:
        """The cached block tables of ``slots[pick]`` (each row's index into ``slots``), as wide as the
        widest of ``slots``'. [len(pick), MB]"""
        return self._tables[np.asarray(slots, dtype=np.int64)[pick], : int(self._table_len[slots].max())]

    def window_rows(self, slots: list, pick) -> np.ndarray:
        """``table_rows``' windowed-KV counterpart: the sliding layers' tables of ``slots[pick]``."""
        return self.wtables.rows(np.asarray(slots, dtype=np.int64)[pick], int(self._table_len[slots].max()))

    def refresh(self, slot: int, key: int) -> None:
        """The slot's row after its block table shrank (an ACCEPT's rollback)."""
        self._store_table(slot, key)

    def _store_table(self, slot: int, key: int) -> None:
        table = self.blocks_of(slot).block_table(key)
        width = self._tables.shape[1]
        if len(table) > width:
            grown = np.zeros((self._tables.shape[0], max(len(table), 2 * width)), dtype=np.int32)
            grown[:, :width] = self._tables
            self._tables = grown
        self._tables[slot, : len(table)] = table
        self._tables[slot, len(table) :] = 0
        self._table_key[slot], self._table_len[slot] = key, len(table)
        if self.wtables is not None:
            self.wtables.store(slot, self.blocks_of(slot).window, key)

    def mirror(self, states: list, slots: list, appended: list) -> None:
        """Rows whose KV another rank holds (dp attention), as on their owner: each row's ``appended``
        tokens stored and its blocks grown to hold them in its owner's pool."""
        for st, slot, new in zip(states, slots, appended):
            self.grow(slot, st, st.length + len(new), st.length)
            st.tokens.extend(new)

    def check_lengths(self, rows) -> None:
        """Rank 0: each planned row's length (the scheduler's, ``Row.length``) is its slot's, the one
        record of it: a scheduler that drifts from the slots fails the step naming the row."""
        for row in rows:
            st = self.slots.held(row.slot, "a planned row")
            if st.length != row.length:
                raise ExecutorError(
                    f"slot {row.slot}: the plan's row has length {row.length} but the slot holds {st.length} tokens"
                )

    def rollback(self, slot: int, n: int):
        """ROLLBACK's accounting: the slot's last ``n`` generated tokens dropped, its tail blocks beyond
        what the kept length needs given back. Returns the slot's state."""
        self.slots.settled("ROLLBACK")
        st = self.slots.held(slot, "ROLLBACK")
        if not 1 <= n <= st.length - len(st.prompt):
            raise SlotError(
                f"ROLLBACK slot {slot}: {n} tokens, but it holds {st.length - len(st.prompt)} generated ones"
            )
        del st.tokens[st.length - n :]
        if self.blocks_of(slot).shrink(st.key, st.length) and self.pools.holds_kv(slot):
            self.refresh(slot, st.key)
        return st

    def accept(self, slots: list, accepted: list) -> list:
        """ACCEPT's accounting: each row keeps ``accepted[r]`` drafts, its tail blocks beyond what that
        length needs given back. Returns (slot, state, drafts dropped) per row."""
        out = []
        for slot, (st, dropped) in zip(slots, self.slots.accept(slots, accepted)):
            if dropped and self.blocks_of(slot).shrink(st.key, st.length) and self.pools.holds_kv(slot):
                self.refresh(slot, st.key)
            out.append((slot, st, dropped))
        return out
