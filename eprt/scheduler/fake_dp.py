"""The recording fake under dp attention: one KV pool per rank (``OwnerPools``, the real runner's
owner choice), the OWNER frame ahead of each admission and the rows per rank of each decode step
(docs/scenarios.md, "dp attention")."""

from __future__ import annotations

import numpy as np

from eprt.cache.owners import OwnerPools
from eprt.comm import protocol as P
from eprt.scheduler.fake import FakeModelError, RecordingModel
from eprt.scheduler.step import Admission, StepResult


class DpRecordingModel(RecordingModel):
    pooled = True  # one KV pool per owner rank

    def __init__(self, scripts: dict, *, rank_blocks: list, block_size: int = 16, prefix_cache: bool = True, **kw):
        super().__init__(scripts, num_blocks=1, block_size=block_size, **kw)
        self.pools = OwnerPools(rank_blocks, block_size, prefix_cache)
        self.blocks = None  # every block lives in an owner's pool
        self.owner: dict = {}  # seq_id -> owner rank of its current admission

    # -- KV accounting, per owner rank ---------------------------------------------------------
    def num_free_blocks(self) -> int:
        return self.pools.num_free_blocks()

    def pool_of(self, seq) -> int:
        return self.owner[seq.seq_id]

    def free_blocks_in(self, pool: int) -> int:
        return self.pools.pools[pool].num_free_blocks()

    def can_admit(self, seq) -> bool:
        return None in self.slots and self.pools.choose(seq.token_ids[: seq.num_prompt], seq.adapter) is not None

    def admit(self, seq) -> Admission:
        prompt = seq.token_ids[: seq.num_prompt]
        owner = self.pools.choose(prompt, seq.adapter)
        if owner is None:
            raise FakeModelError(f"admission of s{seq.seq_id}: no rank has room for its prompt")
        slot = self._take_slot(seq)
        cached = self.pools.pools[owner].allocate(seq.seq_id, prompt, seq.adapter)
        self.owner[seq.seq_id] = owner
        return Admission(slot, cached, owner)

    def _free(self, seq) -> int:
        return self.pools.pools[self.owner.pop(seq.seq_id)].free(seq.seq_id)

    def _pool(self, seq):
        return self.pools.pools[self.owner[seq.seq_id]]

    def _fork_owner(self, seq, child) -> None:
        self.owner[child.seq_id] = self.owner[seq.seq_id]

    # -- execution ---------------------------------------------------------------------------
    def _admission_frames(self, chunk, out: StepResult) -> None:
        adm = chunk.admission
        if adm is not None:  # prompt_hidden 0: the fake computes no prompt logprobs
            out.frames.append((chunk, P.Owner(adm.slot, adm.owner, 0)))

    def _decode(self, step, out: StepResult) -> list:
        tokens = super()._decode(step, out)
        counts = np.bincount([self.owner[r.seq.seq_id] for r in step.rows], minlength=len(self.pools)).tolist()
        slots = tuple(r.slot for r in step.rows)
        out.frames.append((step, P.DecodeDp(slots, tuple(int(t) for t in step.tokens), tuple(counts))))
        return tokens
