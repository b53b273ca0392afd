"""Where a rank keeps each sequence's blocks (a part of the executor's sequence state): one block
manager under replicated attention, the same on every rank; under dp attention a mirror of every
rank's pool, each sequence in its owner's (named by OWNER ahead of its PREFILL), this rank
holding KV only for the sequences it owns (docs/design.md, "dp attention").
"""

from __future__ import annotations

import numpy as np

from eprt.cache.block_manager import BlockManager
from eprt.cache.owners import OwnerPools
from eprt.comm.slots import SlotError
from eprt.engine.sequences import ExecutorError


class SharedBlocks:
    """Replicated attention: one pool, every sequence's KV on every rank."""

    dp = False

    def __init__(self, blocks: BlockManager):
        self.blocks = blocks

    def for_new(self, slot: int) -> BlockManager:
        """The block manager a sequence allocated into the empty ``slot`` keeps its blocks in."""
        return self.blocks

    def of(self, slot: int) -> BlockManager:
        """The block manager holding the blocks of the sequence in ``slot``."""
        return self.blocks

    def holds_kv(self, slot: int) -> bool:
        """Whether this rank stores the KV of the sequence in ``slot``."""
        return True

    def forked(self, slot: int, new_slot: int) -> None:
        pass

    def freed(self, slot: int) -> None:
        pass

    def moved(self, slot: int, new_slot: int) -> None:
        pass

    def managers(self) -> dict:
        """Every block manager this rank mirrors, by the suffix its digests are named with."""
        return {"": self.blocks}


class OwnerBlocks:
    """dp attention: ``pools.pools[r]`` mirrors rank r's pool; ``owners[slot]`` each slot's owner."""

    dp = True

    def __init__(self, pools: OwnerPools, rank: int, max_slots: int):
        self.pools, self.rank = pools, rank
        self.blocks = pools.pools[rank]  # this rank's own pool: the blocks its KV lives in
        self.owners = np.full(max_slots, -1, dtype=np.int64)  # [slots] owner rank of each occupied slot
        self.pending: dict[int, tuple] = {}  # slot -> (owner, prompt_hidden) named by OWNER, for its next PREFILL
        self.prompt_hidden: dict[int, bool] = {}  # slot -> its prefill returns every position's hidden state

    def assign(self, slot: int, owner: int, prompt_hidden: bool, occupied: bool) -> None:
        """OWNER: the sequence the next PREFILL puts into the empty ``slot`` lives on rank ``owner``."""
        if not 0 <= owner < len(self.pools):
            raise ExecutorError(f"OWNER slot {slot}: rank {owner} is outside the world [0, {len(self.pools)})")
        if occupied:
            raise SlotError(f"OWNER slot {slot}: the slot is occupied")
        self.pending[slot] = (owner, bool(prompt_hidden))

    def for_new(self, slot: int) -> BlockManager:
        """The pool of the owner OWNER named for the slot's next PREFILL."""
        owner, prompt_hidden = self.pending.pop(slot, (None, False))
        if owner is None:
            raise ExecutorError(f"PREFILL slot {slot}: under dp attention an OWNER frame must name its rank first")
        self.owners[slot] = owner
        self.prompt_hidden[slot] = prompt_hidden
        return self.pools.pools[owner]

    def of(self, slot: int) -> BlockManager:
        return self.pools.pools[self.owners[slot]]

    def holds_kv(self, slot: int) -> bool:
        return self.owners[slot] == self.rank

    def forked(self, slot: int, new_slot: int) -> None:
        """FORK: the copy lives with the original, in its owner's pool."""
        self.owners[new_slot] = self.owners[slot]

    def freed(self, slot: int) -> None:
        self.owners[slot] = -1
        self.prompt_hidden.pop(slot, None)

    def moved(self, slot: int, new_slot: int) -> None:
        self.owners[new_slot], self.owners[slot] = self.owners[slot], -1
        if slot in self.prompt_hidden:
            self.prompt_hidden[new_slot] = self.prompt_hidden.pop(slot)

    def managers(self) -> dict:
        return {f" of rank {r}'s pool": p for r, p in enumerate(self.pools.pools)}
