"""dp attention's KV pools: one block manager per owner rank, mirrored on every rank from the one
command stream, and rank 0's choice of a new sequence's owner (docs/design.md, "dp attention")."""

from __future__ import annotations

from collections.abc import Sequence

from eprt.cache.block_manager import BlockManager
from eprt.cache.window import WindowSpec


class OwnerPools:
    """``pools[r]``: the blocks of rank r's KV pool (``sizes[r]`` blocks), as rank r accounts them."""

    def __init__(
        self, sizes: Sequence[int], block_size: int, prefix_cache: bool = True, window: WindowSpec | None = None
    ):
        if not sizes:
            raise ValueError("OwnerPools needs the pool size of at least one rank")
        self.pools = [BlockManager(int(n), block_size, prefix_cache=prefix_cache, window=window) for n in sizes]

    def __len__(self) -> int:
        return len(self.pools)

    def num_free_blocks(self) -> int:
        return sum(p.num_free_blocks() for p in self.pools)

    def used_blocks(self, rank: int) -> int:
        """Blocks of rank's pool that live sequences hold (cached, unreferenced blocks count as free)."""
        pool = self.pools[rank]
        return pool.num_blocks - pool.num_free_blocks()

    def choose(
        self, tokens: Sequence[int], adapter: int = -1, salt: bytes = b"", queued: Sequence[int] | None = None
    ) -> int | None:
        """The owner of a new prompt among the ranks with room for it: the longest prefix-cache hit
        first (affinity), then the fewest queued prefill tokens (``queued[r]``: rank r's prompt tokens
        not computed yet; none when not given), then the fewest blocks in use (least KV tokens), then
        the lowest rank; None when no rank has room now."""
        best = None
        for rank, pool in enumerate(self.pools):
            if pool.can_allocate(tokens, adapter, salt):
                work = 0 if queued is None else queued[rank]
                key = (-pool.match_prefix(tokens, adapter, salt), work, self.used_blocks(rank), rank)
                best = key if best is None else min(best, key)
        return None if best is None else best[-1]
