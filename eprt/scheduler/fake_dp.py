"""The recording fake under dp attention: one KV pool per rank (``OwnerPools``, the real runner's
owner choice), the OWNER frame ahead of each admission and the rows per rank of each decode step
in the trace (docs/scenarios.md, "dp attention")."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from eprt.cache.owners import OwnerPools
from eprt.comm.protocol import OWNER, RELEASE
from eprt.scheduler.fake import FakeModelError, RecordingModel, seq_name


class DpRecordingModel(RecordingModel):
    def __init__(
        self,
        emit: Callable[[str], None],
        scripts: dict,
        *,
        rank_blocks: list,
        num_slots: int = 8,
        block_size: int = 16,
        prefix_cache: bool = True,
        drafts: dict | None = None,
        failures: dict | None = None,
    ):
        super().__init__(
            emit, scripts, num_slots=num_slots, num_blocks=1, block_size=block_size, drafts=drafts, failures=failures
        )
        self.pools = OwnerPools(rank_blocks, block_size, prefix_cache)
        self.blocks = None  # every block lives in an owner's pool
        self.owner: dict = {}  # seq_id -> owner rank of its current admission

    # -- KV memory, per owner rank -----------------------------------------------------------
    def num_free_blocks(self) -> int:
        n = self.pools.num_free_blocks()
        self.emit(f"num_free_blocks() -> {n}")
        return n

    def pool_of(self, seq) -> int:
        return self.owner[seq.seq_id]

    def free_blocks_in(self, pool: int) -> int:
        n = self.pools.pools[pool].num_free_blocks()
        self.emit(f"num_free_blocks(rank={pool}) -> {n}")
        return n

    def can_admit(self, seq) -> bool:
        return self.pools.choose(seq.token_ids[: seq.num_prompt], seq.adapter) is not None

    def alloc_sequence(self, seq) -> int:
        if None not in self.slots:
            raise FakeModelError(f"alloc_sequence for s{seq.seq_id} with every slot occupied")
        prompt = seq.token_ids[: seq.num_prompt]
        owner = self.pools.choose(prompt, seq.adapter)
        if owner is None:
            raise FakeModelError(f"alloc_sequence for s{seq.seq_id}: no rank has room for its prompt")
        slot = self.slots.index(None)
        self._frame(slot, OWNER, owner, 0)  # prompt_hidden 0: the fake computes no prompt logprobs
        seq.cached = self.pools.pools[owner].allocate(seq.seq_id, prompt, seq.adapter)
        self.slots[slot], self.owner[seq.seq_id] = seq.seq_id, owner
        self.emit(f"alloc_sequence() -> slot {slot} on rank {owner}")
        return slot

    def cache_sequence(self, seq) -> None:
        self._check_slot(seq)
        self._pool(seq).cache(seq.seq_id, seq.token_ids[: seq.len])
        self.emit(f"cache_sequence({seq_name(seq)})")

    def free_sequence(self, seq) -> int:
        self._check_slot(seq)
        n = self.pools.pools[self.owner.pop(seq.seq_id)].free(seq.seq_id)
        self.slots[seq.slot] = None
        self.emit(f"free_sequence({seq_name(seq)}, blocks={n})")
        self._frame(seq.slot, RELEASE)
        return n

    def _pool(self, seq):
        return self.pools.pools[self.owner[seq.seq_id]]

    # -- compute -----------------------------------------------------------------------------
    def decode_batch(self, tokens, seqs: list, stream: int) -> None:
        if len(tokens) != len(seqs) or not seqs:
            raise FakeModelError(f"decode_batch with {len(tokens)} tokens for {len(seqs)} sequences")
        for seq in seqs:
            self._check_slot(seq)
            if seq.len != len(seq.token_ids) - 1:
                raise FakeModelError(f"decode of {seq_name(seq)} whose KV is not up to date")
            self._pool(seq).grow(seq.seq_id, seq.len + 1)
        self._batch_out = [self._answer(seq, seq.len) for seq in seqs]
        names = ", ".join(f'"{seq_name(s)}"' for s in seqs)
        counts = np.bincount([self.owner[s.seq_id] for s in seqs], minlength=len(self.pools)).tolist()
        self.emit(f"decode_batch(tokens=[{', '.join(map(str, tokens))}], seqs=[{names}], stream={stream})")
        self.emit(f"rows_per_rank({counts})")
