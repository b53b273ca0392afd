"""The sliding-window layers' KV blocks (docs/design.md, "Sliding-window KV"): a second table per
sequence in the same pool as its full-attention blocks, whose blocks are freed as the window moves
on, so a sequence holds a bounded number of them whatever its length.

A step whose first query sits at position q reads keys from q - window + 1 on; the group keeps the
blocks from ``first_block(q)`` = (q + 1 - X) // block_size on, X the window rounded up to whole
blocks, so that in decode the window drops a block exactly when the sequence takes a new one. A
step of T positions holds at most ``span(T)`` = X / block_size + 1 + ceil((T - 1) / block_size)
blocks. Each sequence reserves ``credits`` blocks of the pool up front (a prompt's for its largest
prefill chunk, then a decode step's with its drafts), counted out of the free blocks until it
holds them: the scheduler's accounting (a sequence of length L holds L // block_size + 1 blocks,
one more at each block boundary) stays exact, and a window's growth never fails.

The group's blocks are private to their sequence: a prefix-cache hit or a fork copies the window's
blocks (``pop_copies``: the KV copies the executor makes) instead of sharing them. Blocks the window
leaves behind are cached when their content is known (the prompt's full blocks; at release, the
window's), under their chain hash tagged with ``TAG``, so a later prompt's hit finds the KV its
first window needs. Every rank runs the same calls, so every rank makes the same choices.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

NULL = -1  # a table entry the window has left: its block is freed (tables given to kernels hold 0 there)
TAG = b"window"  # appended to a chain hash: the window group's cached copy of that block


@dataclass(frozen=True)
class WindowSpec:
    """The window (keys a query reads, itself included) and the most positions one step queries:
    ``prefill_tokens`` per prefill chunk (0: a whole prompt), ``decode_tokens`` per decode or
    verify row (1 + drafts)."""

    tokens: int
    prefill_tokens: int = 0
    decode_tokens: int = 1

    def __post_init__(self):
        for name in ("tokens", "decode_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"WindowSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.prefill_tokens < 0:
            raise ValueError(f"WindowSpec.prefill_tokens must be >= 0, got {self.prefill_tokens}")

    def span(self, tokens: int, block_size: int) -> int:
        """The most window blocks a step of ``tokens`` positions holds: X / block_size + 1 +
        ceil((tokens - 1) / block_size), X the window rounded up to whole blocks."""
        return -(-self.tokens // block_size) + 1 + -(-(max(1, tokens) - 1) // block_size)

    def longest(self, blocks: int, block_size: int) -> int:
        """The longest sequence a pool of ``blocks`` holds with its window's blocks: L // block_size + 1
        for the full layers plus what the window reserves, a prompt of P tokens min(span(its chunk),
        P // block_size + 1) while it is prefilled (a prompt shorter than a chunk: as many again),
        a decoding sequence span(decode_tokens)."""
        whole = blocks // 2 * block_size - 1  # prompts prefilled in one chunk
        chunk = self.prefill_tokens
        prompts = (
            whole
            if not chunk or whole < chunk
            else max(chunk - 1, (blocks - self.span(chunk, block_size)) * block_size - 1)
        )
        return min(prompts, (blocks - self.span(self.decode_tokens, block_size)) * block_size - 1)


class WindowGroup:
    """The sliding layers' tables of one block manager (``BlockManager.window``), drawing on its pool
    through ``pool._take`` / ``pool._release`` and its prefix-cache index."""

    def __init__(self, pool, spec: WindowSpec):
        self.pool, self.spec, self.bs = pool, spec, pool.block_size
        self.reach = -(-spec.tokens // self.bs)  # X / block_size
        self._tables: dict[Hashable, list[int]] = {}
        self._credits: dict[Hashable, int] = {}
        self._prompt: dict[Hashable, tuple] = {}  # key -> (prompt length, its full blocks' chain hashes)
        self.reserve = 0  # sum over sequences of credits - blocks held: counted out of the free blocks
        self._copies: list[tuple[int, int]] = []  # (source, destination) KV copies not yet popped

    # -- arithmetic --------------------------------------------------------------------------
    def first_block(self, first):
        """The first block a step whose first query is at ``first`` keeps (an int, or an int array)."""
        if isinstance(first, np.ndarray):
            return np.maximum(0, (first + 1) // self.bs - self.reach)
        return max(0, (first + 1) // self.bs - self.reach)

    def span(self, tokens: int) -> int:
        """The most blocks a step of ``tokens`` positions holds."""
        return self.spec.span(tokens, self.bs)

    def credits(self, prompt_len: int, cached: int) -> int:
        """What a prompt of ``prompt_len`` tokens with ``cached`` of them hit reserves while it prefills."""
        left = prompt_len - cached
        chunk = min(left, self.spec.prefill_tokens) if self.spec.prefill_tokens else left
        return max(self.decode_credits, min(self.span(chunk), self.pool.blocks_for(prompt_len)))

    @property
    def decode_credits(self) -> int:
        return self.span(self.spec.decode_tokens)

    def usable_hit(self, hashes: list) -> int:
        """How many of the matched blocks (their chain hashes) a hit may use: the most, n, whose
        window before position n * block_size is cached."""
        for n in range(len(hashes), 0, -1):
            if all(h + TAG in self.pool._block_of for h in hashes[self.first_block(n * self.bs) : n]):
                return n
        return 0

    # -- a sequence's life -------------------------------------------------------------------
    def allocate(self, key: Hashable, prompt_len: int, cached: int, hashes: list) -> None:
        """A new sequence hit ``cached`` tokens: its window's blocks before them are copied from the
        cache. ``hashes``: its prompt's full blocks' chain hashes (none without a prefix cache)."""
        hit = cached // self.bs
        lo = self.first_block(cached) if hit else 0
        sources = [self.pool._block_of[hashes[i] + TAG] for i in range(lo, hit)]
        self._claim(sources)
        table = [NULL] * lo + [self._copy(src) for src in sources]
        self._settle(sources)
        self._tables[key] = table
        self._prompt[key] = (prompt_len, list(hashes))
        self._credits[key] = self.credits(prompt_len, cached)
        self.reserve += self._credits[key] - self._held(key)

    def grow(self, key: Hashable, new_len: int, first: int) -> bool:
        """A step queries positions ``first`` .. ``new_len`` - 1 (room for ``new_len`` tokens):
        leave the blocks before its window, then take what it writes. True when the table changed."""
        table = self._tables[key]
        lo, hi = self.first_block(first), self.pool.blocks_for(new_len)
        changed = self._leave(key, lo)
        prompt_len, _ = self._prompt[key]
        if first >= prompt_len and self._credits[key] > self.decode_credits:  # prefill done
            self.reserve -= self._credits[key] - self.decode_credits
            self._credits[key] = self.decode_credits
        if hi - lo > self._credits[key]:
            raise RuntimeError(
                f"sequence {key!r}: a step of positions {first}..{new_len - 1} needs {hi - lo} window blocks, "
                f"more than the {self._credits[key]} it reserved (window {self.spec})"
            )
        while len(table) < hi:
            table.append(self.pool._take())
            self.reserve -= 1
            changed = True
        return changed

    def shrink(self, key: Hashable, new_len: int) -> None:
        """Give back the tail beyond ``new_len`` tokens (rejected drafts)."""
        table = self._tables[key]
        for b in reversed(table[self.pool.blocks_for(new_len) :]):
            self.pool._release(b, front=True)
            self.reserve += 1
        del table[self.pool.blocks_for(new_len) :]

    def fork(self, key: Hashable, new_key: Hashable, length: int) -> None:
        """``new_key`` continues ``key`` after its first ``length`` tokens: copies of the blocks its
        first decode step reads (credits: a decode step's)."""
        table = self._tables[key]
        lo = self.first_block(length)
        sources = table[lo : self.pool.blocks_for(length)]
        self._tables[new_key] = [NULL] * lo + [self._copy(src) for src in sources]
        self._prompt[new_key] = (0, [])
        self._credits[new_key] = self.decode_credits
        self.reserve += self._credits[new_key] - self._held(new_key)

    def cache(self, key: Hashable, hashes: list) -> None:
        """Key the window's full blocks (``hashes``: the sequence's chain hashes of its stored tokens)."""
        table = self._tables[key]
        for i in range(min(len(hashes), len(table))):
            if table[i] != NULL:
                self._key(table[i], hashes[i])

    def free(self, key: Hashable) -> None:
        table = self._tables.pop(key)
        for b in reversed(table):
            if b != NULL:
                self.pool._release(b)
        self.reserve -= self._credits.pop(key) - sum(b != NULL for b in table)
        del self._prompt[key]

    # -- queries ----------------------------------------------------------------------------
    def table(self, key: Hashable) -> list[int]:
        """The window's table, block ids by block index (0 where the window has left: never read)."""
        return [max(b, 0) for b in self._tables[key]]

    def first_held(self, key: Hashable) -> int:
        """The first block index the sequence's window still holds (its table's NULLs come first)."""
        table = self._tables[key]
        lo, hi = 0, len(table)
        while lo < hi:  # bisect: NULL entries form a prefix
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if table[mid] == NULL else (lo, mid)
        return lo

    def pop_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies the last allocations and forks asked for, in order."""
        copies, self._copies = self._copies, []
        return copies

    def mirrored_state(self) -> tuple:
        tables = sorted(self._tables.items(), key=lambda kv: repr(kv[0]))
        credits = sorted((repr(k), c) for k, c in self._credits.items())
        return tuple((repr(k), np.asarray(t, np.int64)) for k, t in tables), tuple(credits), self.reserve

    # -- internals --------------------------------------------------------------------------
    def _held(self, key: Hashable) -> int:
        return sum(b != NULL for b in self._tables[key])

    def _copy(self, src: int) -> int:
        dst = self.pool._take()
        self._copies.append((src, dst))
        return dst

    def _claim(self, blocks: Sequence[int]) -> None:
        """Keep cached blocks out of eviction while the copies of them are taken."""
        for b in blocks:
            self.pool._evictable.pop(b, None)
            self.pool._refs[b] += 1

    def _settle(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self.pool._release(b)

    def _leave(self, key: Hashable, lo: int) -> bool:
        """Free the blocks before block ``lo``, caching those of the prompt's full blocks."""
        table, (_, hashes) = self._tables[key], self._prompt[key]
        changed = False
        for i in range(self.first_held(key), min(lo, len(table))):
            if i < len(hashes):
                self._key(table[i], hashes[i])
            self.pool._release(table[i])
            table[i] = NULL
            self.reserve += 1
            changed = True
        return changed

    def _key(self, block: int, chain_hash: bytes) -> None:
        pool, tagged = self.pool, chain_hash + TAG
        if pool.enabled and block not in pool._key_of and tagged not in pool._block_of:
            pool._key_of[block] = tagged
            pool._block_of[tagged] = block
