"""One rank's model state under dp attention (docs/design.md, "dp attention"): the slot table of
every slot, a mirror of every rank's block manager, and KV only for the slots this rank owns. Every
forward pass joins the MoE exchange (``eprt.comm.dp_combine``), with rows or without; its output,
each row's greedy token and final hidden state, reaches rank 0 in one small gather.
N rows in a forward pass, D hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eprt.cache.block_manager import BlockManager
from eprt.cache.owners import OwnerPools
from eprt.comm.dp_combine import DpExchange
from eprt.comm.slots import SlotError
from eprt.engine.executor import ExecutorError, ShardExecutor
from eprt.model.moe_model import MoEModel


@dataclass(frozen=True)
class DpOutput:
    """A forward pass's rows on rank 0, in the pass's row order."""

    tokens: np.ndarray  # [N] int64: each row's greedy token, from its owner's LM head
    hidden: np.ndarray  # [N, D] float32: each row's final hidden state (the sampled rows' logits come from it)

    def __getitem__(self, rows: slice) -> DpOutput:
        return DpOutput(self.tokens[rows], self.hidden[rows])


class DpShardExecutor(ShardExecutor):
    dp = True  # the worker loop runs OWNER and DECODE_DP on it

    def __init__(
        self,
        model: MoEModel,
        pool_sizes: list[int],
        block_size: int,
        max_slots: int,
        exchange: DpExchange,
        prefix_cache: bool = True,
        image_token_id: int | None = None,
        lora=None,
        prefill_tokens: int = 0,
    ):
        if model.cfg.is_hybrid:
            raise ValueError(
                f"--attention dp does not serve {model.cfg.model_type} (recurrent state per owner is not built); "
                "use --attention replicated"
            )
        self.rank = exchange.transport.rank
        if len(pool_sizes) != exchange.transport.size:
            raise ValueError(f"{len(pool_sizes)} pool sizes for a world of {exchange.transport.size} ranks")
        super().__init__(
            model,
            pool_sizes[self.rank],
            block_size,
            max_slots,
            prefix_cache,
            image_token_id,
            lora=lora,
            prefill_tokens=prefill_tokens,
        )
        self.pools = OwnerPools(pool_sizes, block_size, prefix_cache, window=self.window)
        self.pools.pools[self.rank] = self.blocks  # this rank's own pool: the blocks its KV lives in
        self.owners = np.full(max_slots, -1, dtype=np.int64)  # [slots] owner rank of each occupied slot
        self._pending: dict[int, tuple] = {}  # slot -> (owner, prompt_hidden) named by OWNER, for its next PREFILL
        self.prompt_hidden: dict[int, bool] = {}  # slot -> its prefill returns every position's hidden state
        self.exchange = exchange
        model.exchange = exchange
        self.compute_logits = True  # every owner runs the LM head on its rows

    # ---- slot bookkeeping, in the owner's pool -------------------------------------------
    def assign_owner(self, slot: int, owner: int, prompt_hidden: bool = False) -> None:
        """OWNER: the sequence the next PREFILL puts into the empty ``slot`` lives on rank ``owner``;
        ``prompt_hidden``: its prefill chunks return every position's hidden state (prompt logprobs)."""
        if not 0 <= owner < len(self.pools):
            raise ExecutorError(f"OWNER slot {slot}: rank {owner} is outside the world [0, {len(self.pools)})")
        if self.slots.get(slot) is not None:
            raise SlotError(f"OWNER slot {slot}: the slot is occupied")
        self._pending[slot] = (owner, bool(prompt_hidden))

    def _blocks_for_new(self, slot: int) -> BlockManager:
        """The pool of the owner OWNER named for the slot's next PREFILL."""
        owner, prompt_hidden = self._pending.pop(slot, (None, False))
        if owner is None:
            raise ExecutorError(f"PREFILL slot {slot}: under dp attention an OWNER frame must name its rank first")
        self.owners[slot] = owner
        self.prompt_hidden[slot] = prompt_hidden
        return self.pools.pools[owner]

    def _blocks_of(self, slot: int) -> BlockManager:
        return self.pools.pools[self.owners[slot]]

    def _holds_kv(self, slot: int) -> bool:
        return self.owners[slot] == self.rank

    def fork(self, slot: int, new_slot: int) -> None:
        """FORK: the copy lives with the original, in its owner's pool (every rank mirrors it; the
        owner copies the partial last block's KV)."""
        super().fork(slot, new_slot)
        self.owners[new_slot] = self.owners[slot]

    def free(self, slot: int) -> int:
        blocks = super().free(slot)
        self.owners[slot] = -1
        self.prompt_hidden.pop(slot, None)
        return blocks

    def compact(self, slot: int, new_slot: int) -> None:
        super().compact(slot, new_slot)
        self.owners[new_slot], self.owners[slot] = self.owners[slot], -1
        if slot in self.prompt_hidden:
            self.prompt_hidden[new_slot] = self.prompt_hidden.pop(slot)

    # ---- compute --------------------------------------------------------------------------
    def _prefill_chunks(self, chunks: list, keep_hidden: bool = False):
        """A prefill pass (one PREFILL / PREFILL_NEXT or a batched run of them): every rank mirrors
        every chunk's bookkeeping, each owner runs its own chunks as one forward, and every rank
        joins each MoE layer over all the chunks' tokens, in the run's order. Returns a DpOutput of
        each chunk's last token on rank 0, in the run's order (None elsewhere). The chunks of slots
        whose OWNER asked for prompt hidden states return every position's in a second gather:
        rank 0 keeps them in ``prefill_hidden`` [T, D], the run's tokens in order (``keep_hidden``,
        rank 0's request for them, must match)."""
        named = [c.slot for c in chunks]
        if len(set(named)) != len(named):
            raise ExecutorError(f"a prefill group names a slot twice: slots {named}")
        self._allocate_new(chunks)  # first chunks: in the owner's pool, exactly as rank 0 did
        owners = self.owners[np.asarray(named, dtype=np.int64)]  # [G] each chunk's owner
        self.exchange.begin(np.repeat(owners, [c.chunk_len for c in chunks]))  # [N] each token's owner
        self._exchange_lora([self.slots.get(c.slot).adapter for c in chunks], [c.chunk_len for c in chunks])
        others = []  # the other owners' chunks: mirrored bookkeeping, their tokens stored after the pass
        for c, owner in zip(chunks, owners):
            if owner != self.rank:
                tokens, end = [int(t) for t in c.tokens], c.chunk_start + c.chunk_len
                st = self.slots.check_chunk(c.slot, tokens, c.chunk_start, c.chunk_len)
                self.pools.pools[owner].grow(st.key, end, first=c.chunk_start)
                others.append((st, tokens[c.chunk_start : end]))
        kept = np.fromiter((self.prompt_hidden.get(c.slot, False) for c in chunks), dtype=bool, count=len(chunks))
        if self.rank == 0 and keep_hidden != bool(kept.any()):
            raise ExecutorError(
                f"prefill of slots {named}: prompt hidden states asked for {keep_hidden}, but OWNER named "
                f"{[c.slot for c, k in zip(chunks, kept) if k]}"
            )
        mine = [c for c, owner in zip(chunks, owners) if owner == self.rank]
        hidden = None  # [T_mine, D] this rank's chunks' hidden states, when some are kept
        if mine:
            keep_mine = bool(kept[owners == self.rank].any())
            out = super()._prefill_chunks(mine, keep_hidden=keep_mine)  # [mine, 1 + D]
            hidden, self.prefill_hidden = self.prefill_hidden, None
        else:
            self.model.idle_pass()
            out = self._no_rows()
        for st, new in others:
            st.tokens.extend(new)
        every = self.exchange.collect(out, np.bincount(owners, minlength=len(self.pools)).tolist())
        if kept.any():
            self.prefill_hidden = self._collect_prompt_hidden(chunks, owners, kept, hidden)
        if every is None:
            return None
        ordered = np.empty_like(every)  # rank-major (each rank's chunks in run order) -> run order
        ordered[np.argsort(owners, kind="stable")] = every
        return DpOutput(ordered[:, 0].astype(np.int64), np.ascontiguousarray(ordered[:, 1:]).view(np.float32))

    def _collect_prompt_hidden(self, chunks: list, owners: np.ndarray, kept: np.ndarray, hidden):
        """The kept chunks' hidden states [T, D] on rank 0, the run's tokens in order (rows of the
        other chunks stay zero); None elsewhere. One gather: each rank sends its kept chunks' rows."""
        lengths = np.array([c.chunk_len for c in chunks], dtype=np.int64)  # [G]
        mine = owners == self.rank
        starts = np.cumsum(lengths[mine]) - lengths[mine]  # [mine] each chunk's first row in ``hidden``
        rows = [
            self.ops.to_host(hidden[int(start) : int(start + n)])
            for start, n, k in zip(starts, lengths[mine], kept[mine])
            if k
        ]
        D = self.cfg.hidden_size
        rows = np.concatenate(rows).astype(np.float32) if rows else np.zeros((0, D), np.float32)  # [n_mine, D]
        counts = np.bincount(owners[kept], weights=lengths[kept], minlength=len(self.pools)).astype(int).tolist()
        every = self.exchange.collect(rows, counts)  # [sum counts, D] rank-major on rank 0
        if every is None:
            return None
        out = np.zeros((int(lengths.sum()), D), dtype=np.float32)  # [T, D] in the run's order
        offsets = np.cumsum(lengths) - lengths  # [G]
        at = 0
        for rank in range(len(self.pools)):
            for g in np.flatnonzero((owners == rank) & kept):
                out[offsets[g] : offsets[g] + lengths[g]] = every[at : at + lengths[g]]
                at += int(lengths[g])
        return out

    def decode(self, slots: list, tokens: list, counts: list | None = None):
        """One step: row r appends tokens[r] to slots[r]; this rank runs the rows it owns. ``counts``:
        DECODE_DP's rows per rank, checked against this rank's owners. Returns a DpOutput on rank 0."""
        states = self.slots.check_decode(slots, tokens, "DECODE_DP")
        owners = self.owners[np.asarray(slots, dtype=np.int64)]  # [N]
        self.exchange.begin(owners)
        self._exchange_lora([st.adapter for st in states])
        if counts is not None and list(counts) != self.exchange.counts:
            raise ExecutorError(
                f"DECODE_DP rows per rank {list(counts)}, but the owners of slots {list(slots)} on this rank "
                f"give {self.exchange.counts}"
            )
        mine = np.flatnonzero(owners == self.rank)
        self._mirror(states, owners, [(int(t),) for t in tokens])
        if len(mine):
            out = super().decode([slots[r] for r in mine], [tokens[r] for r in mine])
        else:
            self.model.idle_pass()
            out = self._no_rows()
        return self._collect(out)

    def verify(self, slots: list, tokens: list, drafts: list):
        """VERIFY under dp: each owner runs its rows' positions (the verify of their own rank) and every
        rank joins the MoE layers over all positions, rows in order, each row's consecutive; the other
        owners' rows are mirrored (tokens, blocks in their pools) and pending as on their owner.
        Returns a DpOutput of every position on rank 0."""
        states = self.slots.check_verify(slots, tokens, drafts)
        counts = np.fromiter((len(d) for d in drafts), dtype=np.int64, count=len(slots))  # [B]
        owners = self.owners[np.asarray(slots, dtype=np.int64)]  # [B]
        self.exchange.begin(np.repeat(owners, counts + 1))  # [N] each position's owner
        self._exchange_lora([st.adapter for st in states], counts + 1)
        mine = np.flatnonzero(owners == self.rank).tolist()
        if mine:
            out = super().verify([slots[r] for r in mine], [tokens[r] for r in mine], [drafts[r] for r in mine])
        else:
            self.model.idle_pass()
            out = self._no_rows()
        self._mirror(states, owners, [(int(tok), *(int(t) for t in d)) for tok, d in zip(tokens, drafts)])
        self.slots.open(slots, drafts)  # every row pending, in the frame's order
        return self._collect(out)

    def _mirror(self, states: list, owners: np.ndarray, appended: list) -> None:
        """The other owners' rows of a step, as on their owner: row r's ``appended`` tokens stored
        and its blocks grown to hold them in its owner's pool."""
        for r in np.flatnonzero(owners != self.rank).tolist():
            st = states[r]
            self.pools.pools[owners[r]].grow(st.key, st.length + len(appended[r]), first=st.length)
            st.tokens.extend(appended[r])

    def _exchange_lora(self, adapters: list, repeats=None) -> None:
        """The adapters of every row the MoE layers of this pass see (all ranks', global order; each
        of ``adapters`` ``repeats`` times): the experts' LoRA deltas go by them; attention's by this
        rank's rows (``_lora_rows``)."""
        if self.lora is None:
            self.model.exchange_lora_rows = None
            return
        ids = np.asarray(adapters, dtype=np.int64) if repeats is None else np.repeat(adapters, repeats)
        self.model.exchange_lora_rows = self.lora.rows(ids)

    def _output(self, h):
        """This rank's rows of a pass as uint32 [n, 1 + D]: the greedy token, then the hidden state's bits."""
        tokens = np.asarray(self.ops.to_host(self.ops.argmax(self.model.logits(h))), dtype=np.uint32)  # [n]
        hidden = np.ascontiguousarray(self.ops.to_host(h), dtype=np.float32)  # [n, D]
        return np.concatenate([tokens[:, None], hidden.view(np.uint32)], axis=1)

    def _no_rows(self) -> np.ndarray:
        return np.zeros((0, 1 + self.cfg.hidden_size), dtype=np.uint32)

    def _collect(self, rows: np.ndarray) -> DpOutput | None:
        every = self.exchange.collect(rows)  # [N, 1 + D] on rank 0
        if every is None:
            return None
        return DpOutput(every[:, 0].astype(np.int64), np.ascontiguousarray(every[:, 1:]).view(np.float32))
