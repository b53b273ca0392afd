"""The runner under dp attention (docs/design.md, "dp attention"): rank 0 chooses each new
sequence's owner (``OwnerPools.choose``), names it in an OWNER frame ahead of its PREFILL, and
decodes with DECODE_DP frames carrying the rows per rank. Greedy rows take their owner's token;
a step with sampled rows computes their logits here from the gathered hidden states.
"""

from __future__ import annotations

import numpy as np

from eprt.comm import protocol as P
from eprt.engine.dp_executor import DpOutput, DpShardExecutor
from eprt.engine.runner import ModelRunner, needs_host_sampler, wants_prompt_logprobs


class DpModelRunner(ModelRunner):
    executor: DpShardExecutor

    # ---- KV memory: one pool per owner rank --------------------------------------------------
    def num_free_blocks(self) -> int:
        return self.executor.pools.num_free_blocks()

    def pool_of(self, seq) -> int:
        """The owner rank whose pool holds the sequence's blocks."""
        return int(self.executor.owners[seq.slot])

    def free_blocks_in(self, pool: int) -> int:
        return self.executor.pools.pools[pool].num_free_blocks()

    def _owner_for(self, seq) -> int | None:
        return self.executor.pools.choose(seq.token_ids[: seq.num_prompt], seq.adapter, self._state(seq).salt)

    def _room_for(self, seq) -> bool:
        """Whether some rank's pool has the blocks for seq's prompt."""
        return self._owner_for(seq) is not None

    def _allocate(self, seq) -> int:
        """Choose the owner, name it (OWNER ahead of the PREFILL, in the same frame) and allocate
        in its pool; at admission or ahead of it (``admit_ahead``, for a batched prefill)."""
        owner, slot = self._owner_for(seq), self.executor.slots.lowest_free()
        if owner is None:
            raise RuntimeError(f"alloc_sequence for s{seq.seq_id}: no rank has room for its prompt")
        if slot is not None:  # (the base call below refuses a full table)
            prompt_hidden = wants_prompt_logprobs(seq)
            self.transport.send(P.Owner(slot, owner, int(prompt_hidden)))
            self.executor.assign_owner(slot, owner, prompt_hidden)
        return super()._allocate(seq)

    # ---- compute ---------------------------------------------------------------------------
    def _prompt_logprobs(self, seq, start: int, n: int, hidden) -> None:
        if not self.executor.prompt_hidden.get(self._slot_and_cached(seq)[0]):  # (admitted ahead: held)
            raise RuntimeError(f"prompt logprobs of s{seq.seq_id}: its OWNER frame did not ask for its hidden states")
        super()._prompt_logprobs(seq, start, n, self.executor.ops.activation(hidden))

    def decode_batch(self, tokens, seqs, stream: int = 0) -> None:
        slots = [s.slot for s in seqs]
        tokens = [int(t) for t in tokens]
        counts = np.bincount(self.executor.owners[slots], minlength=len(self.executor.pools)).tolist()
        self.transport.send(P.DecodeDp(slots=tuple(slots), tokens=tuple(tokens), counts=tuple(counts)))
        self.transport.flush()
        self._logits = self.executor.decode(slots, tokens, counts)
        self._rows = list(seqs)
        self.decode_steps += 1
        self.decode_rows += len(slots)

    def argmax_batch(self, row: int = 0, n: int = 1, stream: int = 0) -> list[int]:
        """Greedy rows: their owners' tokens. With a sampled row among them, the pass's logits are
        computed here, once, from the gathered hidden states, and sampled as on one rank (so are
        rows with logprobs, penalties or a grammar)."""
        out = self._logits
        if isinstance(out, DpOutput):
            if all(_plain_greedy(s) for s in self._rows[row : row + n]):
                return [int(t) for t in out.tokens[row : row + n]]
            ops = self.executor.ops
            self._logits = self.executor.model.logits(ops.activation(out.hidden))  # [N, V]
        return super().argmax_batch(row, n, stream)

    def _position_targets(self) -> list[int]:
        out = self._logits
        return [int(t) for t in out.tokens] if isinstance(out, DpOutput) else super()._position_targets()

    def _position_logits(self, positions: list) -> np.ndarray:
        out = self._logits
        if isinstance(out, DpOutput):  # the sampled rows' logits, from their gathered hidden states
            ops = self.executor.ops
            return ops.to_host(self.executor.model.logits(ops.activation(out.hidden[positions])))  # [n, V]
        return super()._position_logits(positions)


def _plain_greedy(seq) -> bool:
    """A greedy row nothing but the argmax decides (its owner's token is the answer), not failed."""
    state = seq.model_state
    return not needs_host_sampler(seq.params) and (state is None or (state.matcher is None and state.failure is None))
