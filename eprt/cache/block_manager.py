"""Paged KV block accounting with a prefix cache, deterministic so every rank makes the same
decisions from the same calls (docs/design.md, "Prefix cache").

A sequence of ``L`` tokens holds ``L // block_size + 1`` blocks: always room for the next
token. Blocks are identified by their index into the KV pool (``block_table``).
``hit_filter`` (hybrid models) shortens a prefix hit to the longest one it accepts: a hit on a
recurrent-state model is usable only where a state snapshot was saved (docs/hybrid.md).
``window`` (models with sliding-window layers): those layers' blocks form a second, bounded table
per sequence in the same pool (``eprt/cache/window.py``); the counts above are the full layers'.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterator, Sequence

import numpy as np

from eprt.cache.window import TAG, WindowGroup, WindowSpec


class OutOfBlocks(RuntimeError):
    """An allocation or growth asked for more blocks than are free."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = True, window: WindowSpec | None = None):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enabled = bool(prefix_cache)  # prefix caching on/off (lookups and inserts)
        self._free: deque[int] = deque(range(num_blocks))  # blocks with nothing worth keeping
        self._evictable: OrderedDict[int, None] = OrderedDict()  # keyed, unreferenced; LRU first
        self._refs = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}  # block -> content hash, for keyed blocks
        self._block_of: dict[bytes, int] = {}  # content hash -> block
        self._tables: dict[Hashable, list[int]] = {}
        self._seeds: dict[Hashable, tuple] = {}  # key -> (adapter, salt) of its hash chain
        # chain hashes of the matched blocks -> how many of them a hit may use (None: all)
        self.hit_filter: Callable[[list[bytes]], int] | None = None
        self.window = None if window is None else WindowGroup(self, window)  # the sliding layers' tables

    # -- queries (no state changes) ----------------------------------------------------
    def blocks_for(self, length: int) -> int:
        return length // self.block_size + 1

    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now: never-used plus evictable cached ones, less what the
        sequences' windows have reserved and not taken yet."""
        return len(self._free) + len(self._evictable) - (0 if self.window is None else self.window.reserve)

    def num_cached_blocks(self) -> int:
        """Blocks holding a prefix-cache entry, whether a live sequence uses them or not."""
        return len(self._block_of)

    def match_prefix(self, token_ids: Sequence[int], adapter: int = -1, salt: bytes = b"") -> int:
        """Prompt tokens a new sequence would reuse: a multiple of block_size, at most
        ``len - 1`` so that at least one prompt token is computed."""
        return len(self._match(token_ids, adapter, salt)[0]) * self.block_size

    def mirrored_state(self) -> dict[str, tuple]:
        """The accounting every rank mirrors, as data to hash (``--check-state``): "blocks" (the free
        list in order, the references, each sequence's table) and "prefix cache" (the keyed blocks
        and the evictable ones in LRU order)."""
        tables = sorted(self._tables.items(), key=lambda kv: repr(kv[0]))
        window = {} if self.window is None else {"window": self.window.mirrored_state()}
        return {
            **window,
            "blocks": (
                np.fromiter(self._free, np.int64, len(self._free)),
                np.asarray(self._refs, np.int64),
                tuple((repr(k), np.asarray(t, np.int64)) for k, t in tables),
            ),
            "prefix cache": (
                np.fromiter(self._evictable, np.int64, len(self._evictable)),
                tuple(sorted(self._key_of.items())),
            ),
        }

    def can_allocate(
        self, token_ids: Sequence[int], adapter: int = -1, salt: bytes = b"", max_hit: int | None = None
    ) -> bool:
        return self._cost(token_ids, *self._match(token_ids, adapter, salt, max_hit=max_hit)) <= self.num_free_blocks()

    def can_grow(self, key: Hashable, new_len: int) -> bool:
        return self.blocks_for(new_len) - len(self._table(key)) <= self.num_free_blocks()

    def can_fork(self) -> bool:
        """Whether a fork (``fork``) can get its one block now (and its window's credits)."""
        return self.num_free_blocks() >= 1 + (0 if self.window is None else self.window.decode_credits)

    def block_table(self, key: Hashable) -> list[int]:
        return list(self._table(key))

    def __contains__(self, key: Hashable) -> bool:
        return key in self._tables

    # -- changes -----------------------------------------------------------------------
    def allocate(
        self, key: Hashable, token_ids: Sequence[int], adapter: int = -1, salt: bytes = b"", max_hit: int | None = None
    ) -> int:
        """Reserve the blocks of a prompt, reusing its cached prefix (at most ``max_hit`` tokens of
        it when given); returns the cached length."""
        if key in self._tables:
            raise KeyError(f"sequence {key!r} already holds blocks")
        if len(token_ids) < 1:
            raise ValueError("cannot allocate an empty prompt")
        matched, hashes = self._match(token_ids, adapter, salt, max_hit=max_hit)
        cost = self._cost(token_ids, matched, hashes)
        if cost > self.num_free_blocks():
            raise OutOfBlocks(f"sequence {key!r} needs {cost} blocks, {self.num_free_blocks()} free")
        for b in matched:  # claim hits first so eviction cannot take them
            self._evictable.pop(b, None)
            self._refs[b] += 1
        table = matched + [self._take() for _ in range(self.blocks_for(len(token_ids)) - len(matched))]
        self._tables[key] = table
        self._seeds[key] = (adapter, salt)
        if self.window is not None:
            prompt = hashes if not self.enabled else self.chain_hashes(token_ids, adapter, salt)
            self.window.allocate(key, len(token_ids), len(matched) * self.block_size, prompt)
        return len(matched) * self.block_size

    def grow(self, key: Hashable, new_len: int, first: int | None = None) -> bool:
        """Make room for ``new_len`` tokens (no-op when the blocks are already there). ``first``: the
        step's first query position, which moves the sliding layers' window (needed with ``window``).
        True when a table changed."""
        table = self._table(key)
        extra = self.blocks_for(new_len) - len(table)
        if extra > self.num_free_blocks():
            raise OutOfBlocks(f"sequence {key!r} needs {extra} more blocks, {self.num_free_blocks()} free")
        table.extend(self._take() for _ in range(extra))
        if self.window is None:
            return extra > 0
        if first is None:
            raise ValueError(f"sequence {key!r}: growing windowed KV needs the step's first query position")
        return self.window.grow(key, new_len, first) or extra > 0

    def shrink(self, key: Hashable, new_len: int) -> int:
        """Give back the tail blocks beyond what ``new_len`` tokens need (rejected speculative
        drafts); returns how many. Only blocks this sequence alone holds and that no prefix-cache
        entry names can go: a cached or shared block is refused, never dropped."""
        table = self._table(key)
        keep = self.blocks_for(new_len)
        tail = table[keep:]
        for b in tail:
            if b in self._key_of or self._refs[b] != 1:
                raise ValueError(
                    f"sequence {key!r}: cannot shrink to {new_len} tokens, block {b} is "
                    f"{'cached' if b in self._key_of else 'shared'} (only private tail blocks roll back)"
                )
        del table[keep:]
        for b in reversed(tail):  # front of the free list: the next grow takes them again
            self._release(b, front=True)
        if self.window is not None:
            self.window.shrink(key, new_len)
        return len(tail)

    def fork(self, key: Hashable, new_key: Hashable, length: int) -> tuple[int, int] | None:
        """Give ``new_key`` the first ``length`` stored tokens of ``key``: its full blocks are shared
        (one more reference each, never written again), the block the next token goes to is a new
        one. Returns (source, copy) when that block already holds tokens the caller must copy
        (copy-on-write of the last partial block), else None. docs/design.md, "Choices"."""
        if new_key in self._tables:
            raise KeyError(f"sequence {new_key!r} already holds blocks")
        table = self._table(key)
        full = length // self.block_size
        if length < 1 or full >= len(table):
            raise ValueError(f"cannot fork {length} tokens of sequence {key!r}, which holds {len(table)} blocks")
        if not self.can_fork():
            raise OutOfBlocks(f"fork of sequence {key!r} needs 1 block, {self.num_free_blocks()} free")
        for b in table[:full]:
            self._refs[b] += 1
        partial = self._take()
        self._tables[new_key] = table[:full] + [partial]
        self._seeds[new_key] = self._seeds[key]
        if self.window is not None:
            self.window.fork(key, new_key, length)
        return (table[full], partial) if length % self.block_size else None

    def cache(self, key: Hashable, token_ids: Sequence[int]) -> None:
        """Insert the sequence's full blocks among ``token_ids`` (tokens whose KV exists)."""
        if not self.enabled:
            return
        table = self._table(key)
        n = min(len(token_ids) // self.block_size, len(table))
        hashes = self.chain_hashes(token_ids, *self._seeds[key])
        for b, h in zip(table[:n], hashes):
            if b in self._key_of or h in self._block_of:
                continue  # already keyed, or the same content lives elsewhere
            self._key_of[b] = h
            self._block_of[h] = b
        if self.window is not None:
            self.window.cache(key, hashes)

    def free(self, key: Hashable) -> int:
        """Drop the sequence's references; returns how many blocks it held."""
        table = self._tables.pop(key, None)
        if table is None:
            raise KeyError(f"sequence {key!r} holds no blocks")
        del self._seeds[key]
        for b in reversed(table):  # tail first: the head of a prefix stays longest
            self._release(b)
        if self.window is not None:
            self.window.free(key)
        return len(table)

    # -- internals -----------------------------------------------------------------------
    def _table(self, key: Hashable) -> list[int]:
        try:
            return self._tables[key]
        except KeyError:
            raise KeyError(f"sequence {key!r} holds no blocks") from None

    def _take(self) -> int:
        if self._free:
            b = self._free.popleft()
        else:
            b, _ = self._evictable.popitem(last=False)
            del self._block_of[self._key_of.pop(b)]
        self._refs[b] = 1
        return b

    def _release(self, b: int, front: bool = False) -> None:
        """Drop one reference to block b: unreferenced, it is evictable when cached, else free (at the
        front of the free list with ``front``: the next take has it again)."""
        self._refs[b] -= 1
        if self._refs[b] == 0:
            if b in self._key_of:
                self._evictable[b] = None
            elif front:
                self._free.appendleft(b)
            else:
                self._free.append(b)

    def _cost(self, token_ids: Sequence[int], matched: list[int], hashes: list[bytes]) -> int:
        """Free-count cost of allocating: every block except hits that are already live; with a
        window, its credits and the cached window blocks its copies read (kept from eviction)."""
        live_hits = sum(1 for b in matched if self._refs[b] > 0)
        cost = self.blocks_for(len(token_ids)) - live_hits
        if self.window is not None:
            cached = len(matched) * self.block_size
            lo = self.window.first_block(cached) if matched else 0
            sources = [self._block_of[h + TAG] for h in hashes[lo : len(matched)]]
            cost += self.window.credits(len(token_ids), cached) + sum(self._refs[b] == 0 for b in sources)
        return cost

    def chain_hashes(self, token_ids: Sequence[int], adapter: int = -1, salt: bytes = b"") -> list[bytes]:
        """The content hash of every full block of ``token_ids``, each chained on those before it."""
        return list(self._hashes(token_ids, adapter, salt))

    def cached_prefix_blocks(self, token_ids: Sequence[int], adapter: int = -1, salt: bytes = b"") -> int:
        """Full blocks of the prompt whose KV is cached, whether ``hit_filter`` would let a hit use them."""
        return len(self._match(token_ids, adapter, salt, filtered=False)[0])

    def _match(
        self, token_ids: Sequence[int], adapter: int, salt: bytes, filtered: bool = True, max_hit: int | None = None
    ) -> tuple[list[int], list[bytes]]:
        """The cached blocks a hit would reuse and their chain hashes."""
        if not self.enabled or len(token_ids) < 2:
            return [], []
        limit = (len(token_ids) - 1) // self.block_size
        if max_hit is not None:
            limit = min(limit, max_hit // self.block_size)
        blocks, hashes = [], []
        for h in self._hashes(token_ids[: limit * self.block_size], adapter, salt):
            b = self._block_of.get(h)
            if b is None:
                break
            blocks.append(b)
            hashes.append(h)
        if filtered and self.window is not None and blocks:
            blocks = blocks[: self.window.usable_hit(hashes)]
        if filtered and self.hit_filter is not None and blocks:
            blocks = blocks[: self.hit_filter(hashes[: len(blocks)])]
        return blocks, hashes[: len(blocks)]

    def _hashes(self, token_ids: Sequence[int], adapter: int, salt: bytes) -> Iterator[bytes]:
        """Chained content hashes of the full blocks of token_ids."""
        h = hashlib.blake2b(f"adapter:{adapter}".encode() + bytes(salt), digest_size=16).digest()
        bs = self.block_size
        for i in range(len(token_ids) // bs):
            block = ",".join(str(int(t)) for t in token_ids[i * bs : (i + 1) * bs])
            h = hashlib.blake2b(h + block.encode(), digest_size=16).digest()
            yield h
