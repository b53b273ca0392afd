"""The sliding layers' side of the executor's forward passes (windowed KV: eprt/cache/window.py):
their block tables and slots beside the full layers', as ``AttnBatch.window``. A decoding slot's
window table is cached per slot like its full table (``ShardExecutor._tables``) and rebuilt when
the block manager moved its window (``moved``)."""

from __future__ import annotations

import numpy as np

from eprt.model.kv_cache import KVCache
from eprt.model.moe_model import AttnBatch, PrefillPart


class WindowTables:
    """Per slot: the window's table [MB] (0 where the window has left) and its first held block."""

    def __init__(self, max_slots: int):
        self.tables = np.zeros((max_slots, 8), dtype=np.int32)  # [slots, MB]
        self.first = np.zeros(max_slots, dtype=np.int64)  # [slots]

    def store(self, slot: int, group, key) -> None:
        """Cache the slot's window table from the block manager's window ``group``."""
        table = group.table(key)
        if len(table) > self.tables.shape[1]:
            grown = np.zeros((self.tables.shape[0], max(len(table), 2 * self.tables.shape[1])), dtype=np.int32)
            grown[:, : self.tables.shape[1]] = self.tables
            self.tables = grown
        self.tables[slot, : len(table)] = table
        self.tables[slot, len(table) :] = 0
        self.first[slot] = group.first_held(key)

    def moved(self, group, rows: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """[B] bool: the rows whose window a step with first queries at ``lengths`` moves on."""
        return group.first_block(lengths) > self.first[rows]

    def rows(self, slots, width: int) -> np.ndarray:
        """The cached tables [B, width] of ``slots`` (a slot per row)."""
        return self.tables[np.asarray(slots, dtype=np.int64), :width]

    def decode(self, batch: AttnBatch, slots, lengths: np.ndarray, block_size: int) -> AttnBatch:
        """A decode step's window batch: row b writes position lengths[b] through its window table."""
        tables = self.rows(slots, batch.block_tables.shape[1])  # [B, MB]
        slot_mapping = tables[np.arange(len(slots)), lengths // block_size] * block_size + lengths % block_size
        return AttnBatch(
            batch.positions, slot_mapping.astype(np.int32), block_tables=tables, context_lens=batch.context_lens
        )


def prefill_window(group, kv: KVCache, keys: list, parts: tuple) -> AttnBatch | None:
    """A prefill pass's window batch: the sequences ``keys``' windows over their chunks ``parts`` (the
    full layers' PrefillParts, in token order); None without windowed KV."""
    if group is None:
        return None
    maps, window_parts, positions = [], [], []
    for key, p in zip(keys, parts):
        table = np.asarray(group.table(key), dtype=np.int32)
        pos = np.arange(p.start_pos, p.start_pos + p.length, dtype=np.int32)
        maps.append(kv.slots(table, pos))
        window_parts.append(PrefillPart(p.offset, p.length, table, p.start_pos, p.state_slot))
        positions.append(pos)
    return AttnBatch(np.concatenate(positions), np.concatenate(maps), parts=tuple(window_parts))
