"""One rank's model state: the slot table, block manager, paged KV and the forward pass.

Rank 0's runner and every worker's command loop feed an identical ShardExecutor the same
calls in the same order (docs/design.md, "One command stream").
B sequences in a decode batch, T tokens in a prefill chunk, D hidden, V vocabulary.
"""

from __future__ import annotations

import hashlib
import logging

import numpy as np

from eprt.cache.block_manager import BlockManager
from eprt.comm.slots import SlotError, SlotTable
from eprt.model.kv_cache import KVCache
from eprt.model.moe_model import AttnBatch, MoEModel
from eprt.model.recurrent_state import RecurrentState

log = logging.getLogger("eprt.engine")


class ExecutorError(RuntimeError):
    """A command this rank cannot execute (its state disagrees with the command)."""


def vision_salt(rows: np.ndarray | None) -> bytes:
    """Prefix-cache salt of a prompt's vision rows: image placeholders are one token id
    whatever the image, so KV after them depends on the rows too. Rank 0 hashes the
    float32 rows it broadcasts, so every rank computes the same salt."""
    if rows is None or len(rows) == 0:
        return b""
    return hashlib.blake2b(np.ascontiguousarray(rows, dtype=np.float32).tobytes(), digest_size=16).digest()


class ShardExecutor:
    def __init__(
        self,
        model: MoEModel,
        num_blocks: int,
        block_size: int,
        max_slots: int,
        prefix_cache: bool = True,
        image_token_id: int | None = None,
    ):
        self.model, self.ops, self.cfg = model, model.ops, model.cfg
        self.kv = KVCache(model.ops, model.cfg, num_blocks, block_size)
        # a hybrid model's recurrent state: one row per slot, beside the paged KV (docs/hybrid.md)
        self.state = RecurrentState(model.ops, model.cfg, max_slots) if model.cfg.is_hybrid else None
        if prefix_cache and self.state is not None:
            log.info(
                "prefix cache off for %s: a cached KV prefix would need the recurrent state saved at "
                "that boundary, which this build does not keep",
                model.cfg.model_type,
            )
            prefix_cache = False
        self.blocks = BlockManager(num_blocks, block_size, prefix_cache=prefix_cache)
        self.block_size = block_size
        self.slots = SlotTable(max_slots)
        self.image_token_id = image_token_id if image_token_id is not None else model.cfg.image_token_id
        self.compute_logits = True  # workers turn this off: only rank 0 samples

    @property
    def hidden_size(self) -> int:
        return self.cfg.hidden_size

    # ---- slot bookkeeping -------------------------------------------------------------
    def allocate(
        self, slot: int, tokens, adapter: int = -1, vision_rows: np.ndarray | None = None, salt: bytes | None = None
    ) -> int:
        """Occupy the empty ``slot`` with a prompt and its vision rows, reserving its blocks;
        returns the prefix-cache hit length. ``salt``: ``vision_salt(vision_rows)`` if known."""
        if self.slots.get(slot) is not None:
            raise SlotError(f"slot {slot} is already occupied")
        key = self.slots.next_key
        salt = vision_salt(vision_rows) if salt is None else salt
        cached = self.blocks.allocate(key, [int(t) for t in tokens], adapter, salt)
        self.slots.occupy(slot, tokens, cached, adapter, vision_rows)
        if self.state is not None:
            self.state.reset(slot)
        return cached

    def cache(self, slot: int) -> None:
        st = self.slots.held(slot, "cache")
        self.blocks.cache(st.key, st.tokens)

    def free(self, slot: int) -> int:
        return self.blocks.free(self.slots.vacate(slot).key)

    def release(self, slot: int) -> None:
        self.cache(slot)
        self.free(slot)

    def compact(self, slot: int, new_slot: int) -> None:
        self.slots.move(slot, new_slot)
        if self.state is not None:
            self.state.move(slot, new_slot)

    def shutdown(self) -> None:
        for slot in self.slots.occupied():
            self.free(slot)

    # ---- compute ----------------------------------------------------------------------
    def prefill(self, slot: int, tokens, chunk_start: int, chunk_len: int, vision_rows: np.ndarray | None = None):
        """Prefill tokens[chunk_start : chunk_start+chunk_len] of the full prompt ``tokens``.
        Returns the logits [1, V] of the chunk's last token (None when compute_logits is off)."""
        tokens = [int(t) for t in tokens]
        if self.slots.get(slot) is None:  # first chunk on a worker: allocate exactly as rank 0 did
            cached = self.allocate(slot, tokens, vision_rows=vision_rows)
            if cached != chunk_start:
                raise ExecutorError(
                    f"prefix cache diverged on slot {slot}: this rank reuses {cached} tokens, "
                    f"rank 0 sent chunk_start={chunk_start}"
                )
        st = self.slots.check_chunk(slot, tokens, chunk_start, chunk_len)
        end = chunk_start + chunk_len
        self.blocks.grow(st.key, end)
        ids = np.asarray(tokens[chunk_start:end], dtype=np.int32)  # [T]
        positions = np.arange(chunk_start, end, dtype=np.int32)  # [T]
        table = np.asarray(self.blocks.block_table(st.key), dtype=np.int32)
        rows, mask = self._vision_chunk(tokens, chunk_start, end, vision_rows)
        batch = AttnBatch(
            positions=positions,
            slot_mapping=self.kv.slots(table, positions),
            block_table=table,
            start_pos=chunk_start,
            state_slots=np.asarray([slot], dtype=np.int32),
        )
        h = self.model.hidden_states(self.model.embed(ids, rows, mask), batch, self.kv, self.state)  # [T, D]
        st.tokens.extend(tokens[chunk_start:end])
        return self.model.logits(h[-1:]) if self.compute_logits else None

    def prefill_next(self, slot: int, chunk_start: int, tokens):
        """The next chunk ``tokens`` of the prompt (and vision rows) the slot's PREFILL brought."""
        st = self.slots.check_next_chunk(slot, chunk_start, tokens)
        return self.prefill(slot, st.prompt, chunk_start, len(tokens), st.vision_rows)

    def decode(self, slots: list, tokens: list):
        """Append tokens[r] to slots[r] and run one step. Returns logits [B, V] (or None)."""
        states = self.slots.check_decode(slots, tokens, "decode")
        positions = np.asarray([st.length for st in states], dtype=np.int32)  # [B]
        for st in states:
            self.blocks.grow(st.key, st.length + 1)
        tables = [self.blocks.block_table(st.key) for st in states]
        width = max(len(t) for t in tables)
        block_tables = np.zeros((len(states), width), dtype=np.int32)  # [B, MB]
        for b, t in enumerate(tables):
            block_tables[b, : len(t)] = t
        slot_mapping = np.asarray(
            [self.kv.slots(t, positions[b : b + 1])[0] for b, t in enumerate(tables)], dtype=np.int32
        )
        batch = AttnBatch(
            positions=positions,
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            context_lens=positions + 1,
            state_slots=np.asarray(slots, dtype=np.int32),
        )
        ids = np.asarray(tokens, dtype=np.int32)
        h = self.model.hidden_states(self.model.embed(ids), batch, self.kv, self.state)  # [B, D]
        for st, tok in zip(states, tokens):  # the token's KV is stored now
            st.tokens.append(int(tok))
        return self.model.logits(h) if self.compute_logits else None

    def _vision_chunk(self, tokens, start: int, end: int, vision_rows):
        """Rows [n, D] and mask [T] of the image placeholders inside this chunk."""
        if vision_rows is None or len(vision_rows) == 0:
            return None, None
        if self.image_token_id is None:
            raise ExecutorError("vision rows were sent but the model has no image_token_id")
        where = np.asarray(tokens) == self.image_token_id  # [full]
        if int(where.sum()) != len(vision_rows):
            raise ExecutorError(f"{len(vision_rows)} vision rows for {int(where.sum())} image placeholders")
        before = int(where[:start].sum())
        mask = where[start:end]
        return vision_rows[before : before + int(mask.sum())], mask
