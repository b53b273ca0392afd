"""A hybrid model's recurrent state and its snapshots (a part of the executor; docs/hybrid.md): one
row of state per slot beside the paged KV, and snapshot rows of it at block boundaries for the
prefix cache (DECODE_CKPT), kept and evicted identically on every rank. A slot's state starts
with its first prefill pass, from the snapshot its prefix hit restores or from zeros (rank 0
allocates while it plans a step, before the passes of the step's earlier chunks have run).
"""

from __future__ import annotations

from eprt.cache.snapshots import WORD64, SnapshotIndex, prefill_points, prefix_hash64
from eprt.comm.slots import SlotError
from eprt.engine.sequences import ExecutorError
from eprt.model.kv_cache import KVCache
from eprt.model.recurrent_state import RecurrentState

SNAPSHOT_POOL_SHARE = 4  # recurrent-state snapshots may take at most 1/4 of the KV pool's memory


def snapshot_budget(cfg, num_blocks: int, block_size: int, itemsize: int, wanted: int) -> tuple[int, int]:
    """(snapshot rows, KV blocks they replace): ``wanted`` rows of the recurrent state, within
    1/SNAPSHOT_POOL_SHARE of the pool's memory, paid for in KV blocks."""
    per_block = KVCache.bytes_per_block(cfg, block_size, itemsize)
    per_row = RecurrentState.bytes_per_slot(cfg)
    rows = min(wanted, num_blocks // SNAPSHOT_POOL_SHARE * per_block // per_row)
    return rows, -(-rows * per_row // per_block)


class HybridState:
    def __init__(self, ops, cfg, max_slots: int, rows: int, seqs):
        self.state = RecurrentState(ops, cfg, max_slots, rows)
        self.snapshots = SnapshotIndex(rows) if rows else None
        self.seqs, self.cfg, self.block_size = seqs, cfg, seqs.block_size
        self._fresh: dict[int, int | None] = {}  # slot -> the snapshot row its state starts from (None: zeros)
        if self.snapshots is not None:
            seqs.pools.blocks.hit_filter = self.snapshots.usable_blocks

    def allocated(self, slot: int, st, cached: int) -> None:
        """A sequence took ``slot`` with a prefix hit of ``cached`` tokens (ending at a snapshot)."""
        self._fresh[slot] = self.snapshots.lookup(self.seqs.prefix(st, cached)) if cached else None

    def start(self, slots: list) -> None:
        """The slots starting a sequence: their state from the snapshot their hit restores, else zeros."""
        for slot in slots:
            if slot in self._fresh:
                row = self._fresh.pop(slot)
                self.state.reset(slot) if row is None else self.state.restore(row, slot)

    def freed(self, slot: int, key: int) -> None:
        self._fresh.pop(slot, None)
        if self.snapshots is not None:
            self.snapshots.forget(key)

    def prefill_points(self, st) -> tuple[int, ...]:
        """Rank 0's choice of where the slot's prompt prefill snapshots its state (token counts;
        empty without snapshots): ``eprt.cache.snapshots.prefill_points``."""
        if self.snapshots is None:
            return ()
        blocks = self.seqs.pools.blocks
        branch = blocks.cached_prefix_blocks(st.prompt, st.adapter, self.seqs.salts[st.key]) * self.block_size
        return prefill_points(st.length, len(st.prompt), branch, self.block_size)

    def due(self, st) -> bool:
        """Whether the slot sits at a block boundary worth a snapshot now (after a decode step)."""
        return self.snapshots is not None and st.length > 0 and st.length % self.block_size == 0

    def words(self, st, length: int) -> tuple[int, int, int, int]:
        """DECODE_CKPT's fields for a snapshot of the sequence's first ``length`` tokens: (snapshot
        tokens, end block, session hash, adapter id) as docs/protocol.md defines them."""
        return length, length // self.block_size, prefix_hash64(self.seqs.prefix(st, length)), st.adapter & WORD64

    def row(self, st, length: int) -> int:
        """The snapshot row of the sequence's first ``length`` tokens, taken in the index (its state
        is written by ``save``; rank 0 takes a prefill's rows while planning)."""
        turn = length >= len(st.prompt) // self.block_size * self.block_size  # the prompt's end or decoded tokens
        return self.snapshots.save(self.seqs.prefix(st, length), owner=st.key if turn else None)

    def save(self, slot: int, row: int) -> None:
        """Write the slot's state into snapshot ``row`` (the pass that reached it has run)."""
        self.state.save(slot, row)

    def check(self, slot: int, st, words: tuple) -> None:
        """DECODE_CKPT's words against the slot: its length, a block boundary, its adapter, its prefix."""
        snapshot_tokens, end_block, session_hash, adapter_id = words
        bs = self.block_size
        if snapshot_tokens != st.length or snapshot_tokens % bs or snapshot_tokens == 0:
            raise SlotError(
                f"DECODE_CKPT slot {slot}: snapshot of {snapshot_tokens} tokens, but the slot holds {st.length}; "
                f"a snapshot is taken at a block boundary (a positive multiple of {bs}) the slot has just reached"
            )
        if end_block != snapshot_tokens // bs or adapter_id != st.adapter & WORD64:
            raise SlotError(
                f"DECODE_CKPT slot {slot}: end block {end_block} / adapter {adapter_id} do not match "
                f"{snapshot_tokens // bs} / {st.adapter & WORD64} of the slot"
            )
        mine = self.words(st, snapshot_tokens)[2]
        if mine != session_hash:
            raise ExecutorError(
                f"snapshot diverged on slot {slot}: rank 0 names prefix {session_hash:#018x}, "
                f"this rank holds {mine:#018x}"
            )
