"""Where a sequence's KV lives, as rank 0's runner sees it (a part of the runner): one pool
replicated on every rank, or under dp attention one pool per owner rank, rank 0 choosing each new
sequence's owner and naming it in an OWNER frame ahead of its PREFILL, decode steps sent as
DECODE_DP with the rows per rank, and a pass's rows coming back as each row's greedy token and
final hidden state (docs/design.md, "dp attention").
"""

from __future__ import annotations

import numpy as np

from eprt.comm import protocol as P
from eprt.engine.dp_executor import DpOutput
from eprt.engine.sampler import needs_host_sampler


class SharedPool:
    """Replicated attention: one KV pool, the same on every rank."""

    pooled = False  # the scheduler sees one pool

    def __init__(self, executor):
        self.executor = executor

    def num_free_blocks(self) -> int:
        return self.executor.blocks.num_free_blocks()

    def has_room(self, seq, salt: bytes, max_hit: int | None) -> bool:
        """Whether the pool has the blocks for seq's prompt."""
        return self.executor.blocks.can_allocate(seq.token_ids[: seq.num_prompt], seq.adapter, salt, max_hit=max_hit)

    def place(self, seq, salt: bytes, slot: int, prompt_hidden: bool) -> int | None:
        """The owner of seq, admitted into ``slot`` now (None: no owners)."""
        return None

    def admission_pool(self, seq, salt: bytes) -> int | None:
        """The pool seq's admission would take its blocks from: the one pool, 0."""
        return 0

    def owner_frames(self, admission) -> list:
        return []

    def decode_command(self, slots: tuple, tokens: tuple):
        return P.DecodeBatch(slots, tokens)

    def logits(self, out, index):
        """The logits [n, V] of a pass's rows ``index`` (rank 0's output of the pass)."""
        return out[index]

    def plain_tokens(self, out, index, rows: list) -> list | None:
        """The rows' tokens without their logits when the pass gave them (never here)."""
        return None

    def prompt_hidden(self, slot: int, hidden):
        """A chunk's hidden states [n, D] for its prompt logprobs."""
        return hidden


class DpPools(SharedPool):
    """dp attention: one pool per owner rank, every rank mirroring every pool."""

    pooled = True  # the scheduler sees one pool per owner rank

    def num_free_blocks(self) -> int:
        return self.executor.pools.num_free_blocks()

    def pool_of(self, seq) -> int:
        """The owner rank whose pool holds the sequence's blocks."""
        return int(self.executor.owners[seq.slot])

    def free_blocks_in(self, pool: int) -> int:
        return self.executor.pools.pools[pool].num_free_blocks()

    def _owner_for(self, seq, salt: bytes) -> int | None:
        prompt = seq.token_ids[: seq.num_prompt]
        return self.executor.pools.choose(prompt, seq.adapter, salt, queued=self.queued_prefill())

    def queued_prefill(self) -> list[int]:
        """Each rank's queued prefill tokens: the prompt tokens of the sequences it owns whose KV is
        not computed yet (those of the chunks planned for this step included)."""
        queued = [0] * len(self.executor.pools)
        for slot in self.executor.slots.occupied():
            st = self.executor.slots.get(slot)
            queued[int(self.executor.owners[slot])] += max(0, len(st.prompt) - st.length)
        return queued

    def admission_pool(self, seq, salt: bytes) -> int | None:
        """The owner ``place`` would choose for seq now (None: no rank has room for its prompt)."""
        return self._owner_for(seq, salt)

    def has_room(self, seq, salt: bytes, max_hit: int | None) -> bool:
        """Whether some rank's pool has the blocks for seq's prompt."""
        return self._owner_for(seq, salt) is not None

    def place(self, seq, salt: bytes, slot: int, prompt_hidden: bool) -> int:
        """Choose the owner and name it to rank 0's executor (the OWNER frame goes out with the PREFILL)."""
        owner = self._owner_for(seq, salt)
        if owner is None:
            raise RuntimeError(f"admission of s{seq.seq_id}: no rank has room for its prompt")
        self.executor.assign_owner(slot, owner, prompt_hidden)
        return owner

    def owner_frames(self, admission) -> list:
        return [P.Owner(admission.slot, admission.owner, int(admission.record.prompt_hidden))]

    def decode_command(self, slots: tuple, tokens: tuple):
        counts = np.bincount(self.executor.owners[list(slots)], minlength=len(self.executor.pools))
        return P.DecodeDp(slots, tokens, tuple(counts.tolist()))

    def logits(self, out, index):
        """A dp pass's rows come back as hidden states: their logits are computed here, on rank 0."""
        if not isinstance(out, DpOutput):
            return out[index]
        ops = self.executor.ops
        return self.executor.model.logits(ops.activation(out.hidden[index]))

    def plain_tokens(self, out, index, rows: list) -> list | None:
        """Plain greedy rows (nothing but the argmax decides them) take their owners' tokens."""
        if isinstance(out, DpOutput) and all(plain_greedy(s) for s in rows):
            return [int(t) for t in out.tokens[index]]
        return None

    def prompt_hidden(self, slot: int, hidden):
        if not self.executor.prompt_hidden.get(slot):
            raise RuntimeError(f"prompt logprobs of slot {slot}: its OWNER frame did not ask for its hidden states")
        return self.executor.ops.activation(hidden)


def plain_greedy(seq) -> bool:
    """A greedy row nothing but the argmax decides (its owner's token is the answer), not failed."""
    state = seq.model_state
    return not needs_host_sampler(seq.params) and (state is None or (state.matcher is None and state.failure is None))
