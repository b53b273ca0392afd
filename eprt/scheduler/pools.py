"""KV pools as the scheduler sees them (docs/scenarios.md, "dp attention"): one shared pool under
replicated attention; under dp attention one per owner rank (``model.pooled``: here ``model`` is the
KV accounting, ``interface.py``), the model answering ``pool_of(seq)`` and ``free_blocks_in(pool)``.
A decode step that cannot grow preempts within the short pool only.
"""

from __future__ import annotations

from collections import Counter

from eprt.scheduler.step import FreeBlocks


def reader(model, events: list):
    """``read(pool)``: the model's free blocks in ``pool`` (None: the one shared pool), each read
    recorded in ``events`` (the trace prints them)."""

    def read(pool: int | None) -> int:
        n = model.num_free_blocks() if pool is None else model.free_blocks_in(pool)
        events.append(FreeBlocks(n, pool))
        return n

    return read


def pooled(model) -> bool:
    return bool(getattr(model, "pooled", False))


def short_pool(model, rows: list, block_size: int, read) -> int | None:
    """The pool that cannot give each of its rows crossing a block boundary a new block (the lowest
    such owner rank under dp attention; 0 for the one shared pool), or None when every row can grow.
    ``read(pool)``: the free blocks of ``pool`` (None: the one shared pool), as the trace records them."""
    crossing = [s for s in rows if (s.len + 1) % block_size == 0]
    if not pooled(model):
        return None if not crossing or len(crossing) <= read(None) else 0
    need = Counter(model.pool_of(s) for s in crossing)
    return next((pool for pool in sorted(need) if need[pool] > read(pool)), None)


def in_pool(model, seq, pool: int) -> bool:
    """Whether seq's blocks are in ``pool`` (always, with one shared pool)."""
    return not pooled(model) or model.pool_of(seq) == pool


def pool_key(model, seq) -> int:
    """The pool seq's blocks are in (0 for the one shared pool)."""
    return model.pool_of(seq) if pooled(model) else 0


def free_after_decode(model, rows: list, block_size: int, read) -> dict:
    """Blocks each pool has left once a decode step of ``rows`` has taken a new block for each row
    crossing a block boundary: {pool: blocks}, {0: blocks} with one shared pool (``read``: as in
    ``short_pool``)."""
    crossing = Counter(pool_key(model, s) for s in rows if (s.len + 1) % block_size == 0)
    if not pooled(model):
        return {0: read(None) - crossing[0]}
    return {pool: read(pool) - crossing[pool] for pool in sorted({model.pool_of(s) for s in rows})}


class PrefillBudget:
    """A tick's prefill budget (docs/scenarios.md, "One run"): ``tokens`` prompt tokens of chunks
    (0: unlimited) for the one shared pool, or under dp attention for each owner rank's pool, so
    every owner with prompts to prefill gets its chunks in every prefill step."""

    def __init__(self, model, tokens: int):
        self.model, self.tokens = model, tokens or None  # None: unlimited
        self.spent: Counter = Counter()

    def left(self, pool: int) -> int | None:
        """Tokens ``pool`` may still take this tick (None: unlimited)."""
        return None if self.tokens is None else self.tokens - self.spent[pool]

    def spend(self, pool: int, n: int) -> None:
        self.spent[pool] += n

    def exhausted(self) -> bool:
        """Whether no chunk fits this tick any more (known for the one shared pool only)."""
        return not pooled(self.model) and self.left(0) == 0

    def admission(self, seq) -> int:
        """The pool the admission of seq (which ``can_admit``) would prefill in: its owner's."""
        return self.model.admission_pool(seq) if pooled(self.model) else 0
