"""Which recurrent-state snapshots a hybrid model keeps (docs/hybrid.md, "Prefix cache").

A fixed number of rows, each holding the state at the end of one block-aligned prefix, keyed by
that prefix's chain hash (``BlockManager.chain_hashes``); least recently used rows are evicted.
Every rank sees the same calls and keeps the same rows. Rank 0 decides where to snapshot, in the
spirit of Marconi: where a prompt branches off a cached prefix, and at a sequence's last block
boundary (its prompt's end, then each boundary decoding passes, replacing the last: the turn end).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

WORD64 = (1 << 64) - 1


def prefix_hash64(prefix: bytes) -> int:
    """DECODE_CKPT's session hash: the first 8 bytes of the prefix's chain hash, little-endian."""
    return int.from_bytes(prefix[:8], "little")


def prefill_points(cached: int, prompt_len: int, cached_prefix: int, block_size: int) -> tuple[int, ...]:
    """Token counts at which a prompt's prefill snapshots its state: the branch point
    ``cached_prefix`` (KV cached there, but no snapshot served the hit) and the prompt's last
    block boundary; only those past the hit ``cached``."""
    end = prompt_len // block_size * block_size
    return tuple(sorted({p for p in (cached_prefix, end) if p > cached}))


class SnapshotIndex:
    """Rows ``0 .. rows-1``; ``save`` hands out the row to write, ``lookup`` the row to read."""

    def __init__(self, rows: int):
        if rows < 1:
            raise ValueError(f"a snapshot index needs rows >= 1, got {rows}")
        self.rows = rows
        self._row_of: OrderedDict[bytes, int] = OrderedDict()  # prefix hash -> row; least recent first
        self._free = list(range(rows - 1, -1, -1))  # pop() gives the lowest row
        self._used: set[bytes] = set()  # snapshots a hit has restored
        self._turn: dict[Hashable, bytes] = {}  # sequence -> its latest turn snapshot
        self.saved = self.restored = self.evicted = 0

    def __len__(self) -> int:
        return len(self._row_of)

    def mirrored_state(self) -> tuple:
        """The rows every rank mirrors, as data to hash (``--check-state``): each snapshot's row in
        LRU order, the free rows, the restored ones and each sequence's turn snapshot."""
        turns = sorted((repr(k), v) for k, v in self._turn.items())
        return tuple(self._row_of.items()), tuple(self._free), tuple(sorted(self._used)), tuple(turns)

    def __contains__(self, prefix: bytes) -> bool:
        return prefix in self._row_of

    def usable_blocks(self, hashes: list[bytes]) -> int:
        """The longest hit (in blocks) among the cached prefix ``hashes`` that ends at a snapshot."""
        return next((n for n in range(len(hashes), 0, -1) if hashes[n - 1] in self._row_of), 0)

    def lookup(self, prefix: bytes) -> int:
        """The row of the snapshot of ``prefix`` (a hit): it becomes the most recently used."""
        self._row_of.move_to_end(prefix)
        self._used.add(prefix)
        self.restored += 1
        return self._row_of[prefix]

    def save(self, prefix: bytes, owner: Hashable | None = None) -> int:
        """The row to write the snapshot of ``prefix`` into. ``owner``: the sequence whose turn-end
        snapshot this is; its previous one goes unless a hit has used it (then it is shared)."""
        if owner is not None:
            previous = self._turn.get(owner)
            stale = previous is not None and previous != prefix and previous not in self._used
            if stale and previous in self._row_of:  # (unless evicted meanwhile)
                self._free.append(self._row_of.pop(previous))
            self._turn[owner] = prefix
        self.saved += 1
        if prefix in self._row_of:
            self._row_of.move_to_end(prefix)
            return self._row_of[prefix]
        if self._free:
            row = self._free.pop()
        else:
            old, row = self._row_of.popitem(last=False)
            self._used.discard(old)
            self.evicted += 1
        self._row_of[prefix] = row
        return row

    def forget(self, owner: Hashable) -> None:
        """The sequence ended: its last turn snapshot stays, no longer replaced."""
        self._turn.pop(owner, None)
