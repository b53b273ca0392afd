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
from eprt.cache.snapshots import WORD64, SnapshotIndex, prefill_points, prefix_hash64
from eprt.comm.slots import SlotError, SlotTable
from eprt.model.kv_cache import KVCache
from eprt.model.moe_model import AttnBatch, MoEModel
from eprt.model.recurrent_state import RecurrentState

log = logging.getLogger("eprt.engine")


class ExecutorError(RuntimeError):
    """A command this rank cannot execute (its state disagrees with the command)."""


SNAPSHOT_POOL_SHARE = 4  # recurrent-state snapshots may take at most 1/4 of the KV pool's memory


def snapshot_budget(cfg, num_blocks: int, block_size: int, itemsize: int, wanted: int) -> tuple[int, int]:
    """(snapshot rows, KV blocks they replace): ``wanted`` rows of the recurrent state, within
    1/SNAPSHOT_POOL_SHARE of the pool's memory, paid for in KV blocks."""
    per_block = KVCache.bytes_per_block(cfg, block_size, itemsize)
    per_row = RecurrentState.bytes_per_slot(cfg)
    rows = min(wanted, num_blocks // SNAPSHOT_POOL_SHARE * per_block // per_row)
    return rows, -(-rows * per_row // per_block)


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
        snapshot_rows: int | None = None,
    ):
        self.model, self.ops, self.cfg = model, model.ops, model.cfg
        self.pool_blocks = num_blocks  # as given: KV blocks plus what snapshots take of them
        # a hybrid model's recurrent state: one row per slot beside the paged KV, and snapshots of it
        # at block boundaries for the prefix cache, paid for in KV blocks (docs/hybrid.md)
        rows, reserved = 0, 0
        if model.cfg.is_hybrid and prefix_cache:
            wanted = max_slots if snapshot_rows is None else snapshot_rows
            rows, reserved = snapshot_budget(model.cfg, num_blocks, block_size, model.ops.kv_itemsize, wanted)
            if rows:
                log.info(
                    "%s: %d recurrent-state snapshots of %d bytes for the prefix cache, in place of %d KV blocks",
                    model.cfg.model_type,
                    rows,
                    RecurrentState.bytes_per_slot(model.cfg),
                    reserved,
                )
            else:
                log.info(
                    "prefix cache off for %s: no room for a recurrent-state snapshot, without which a cached "
                    "KV prefix cannot be resumed",
                    model.cfg.model_type,
                )
                prefix_cache = False
        self.kv = KVCache(model.ops, model.cfg, num_blocks - reserved, block_size)
        self.state = RecurrentState(model.ops, model.cfg, max_slots, rows) if model.cfg.is_hybrid else None
        self.blocks = BlockManager(num_blocks - reserved, block_size, prefix_cache=prefix_cache)
        self.snapshots = SnapshotIndex(rows) if rows else None
        if self.snapshots is not None:
            self.blocks.hit_filter = self.snapshots.usable_blocks
        self._salts: dict[int, bytes] = {}  # slot key -> prefix-cache salt (snapshot hashes)
        self.block_size = block_size
        self.slots = SlotTable(max_slots)
        self.image_token_id = image_token_id if image_token_id is not None else model.cfg.image_token_id
        self.compute_logits = True  # workers turn this off: only rank 0 samples
        self._tables = np.zeros((max_slots, 8), dtype=np.int32)  # [slots, MB] block table of each decoding slot
        self._table_key = np.full(max_slots, -1, dtype=np.int64)  # block-manager key each row was built for
        self._table_len = np.zeros(max_slots, dtype=np.int64)  # blocks in each row

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
        self._salts[key] = salt
        if self.state is not None and cached:  # the hit ends at a snapshot (hit_filter)
            prefix = self.blocks.chain_hashes([int(t) for t in tokens[:cached]], adapter, salt)[-1]
            self.state.restore(self.snapshots.lookup(prefix), slot)
        elif self.state is not None:
            self.state.reset(slot)
        return cached

    def cache(self, slot: int) -> None:
        st = self.slots.held(slot, "cache")
        self.blocks.cache(st.key, st.tokens)

    def free(self, slot: int) -> int:
        key = self.slots.vacate(slot).key
        self._salts.pop(key, None)
        if self.snapshots is not None:
            self.snapshots.forget(key)
        return self.blocks.free(key)

    def release(self, slot: int) -> None:
        self.cache(slot)
        self.free(slot)

    def compact(self, slot: int, new_slot: int) -> None:
        self.slots.move(slot, new_slot)
        if self.state is not None:
            self.state.move(slot, new_slot)

    # ---- recurrent-state snapshots (DECODE_CKPT) ----------------------------------------------
    def prefill_checkpoints(self, slot: int) -> tuple[int, ...]:
        """Rank 0's choice of where the slot's prompt prefill snapshots its state (token counts;
        empty without snapshots): ``eprt.cache.snapshots.prefill_points``."""
        if self.snapshots is None:
            return ()
        st = self.slots.held(slot, "prefill_checkpoints")
        branch = self.blocks.cached_prefix_blocks(st.prompt, st.adapter, self._salts[st.key]) * self.block_size
        return prefill_points(st.length, len(st.prompt), branch, self.block_size)

    def checkpoint_due(self, slot: int) -> bool:
        """Whether the slot sits at a block boundary worth a snapshot now (after a decode step)."""
        st = self.slots.get(slot)
        return self.snapshots is not None and st is not None and st.length > 0 and st.length % self.block_size == 0

    def checkpoint_words(self, slot: int) -> tuple[int, int, int, int]:
        """DECODE_CKPT's fields for the slot's state now: (snapshot tokens, end block, session hash,
        adapter id) as docs/protocol.md defines them."""
        st = self.slots.held(slot, "DECODE_CKPT")
        prefix = self.blocks.chain_hashes(st.tokens, st.adapter, self._salts[st.key])[-1]
        return st.length, st.length // self.block_size, prefix_hash64(prefix), st.adapter & WORD64

    def checkpoint(self, slot: int, snapshot_tokens: int, end_block: int, session_hash: int, adapter_id: int) -> None:
        """DECODE_CKPT: save the slot's recurrent state, which ends the block-aligned prefix of its
        first ``snapshot_tokens`` stored tokens, as that prefix's snapshot."""
        if self.snapshots is None:
            raise ExecutorError(
                f"DECODE_CKPT slot {slot}: this executor keeps no recurrent-state snapshots "
                f"({self.cfg.model_type}{'' if self.cfg.is_hybrid else ' has no recurrent state'}, "
                f"prefix cache {'on' if self.blocks.enabled else 'off'})"
            )
        st = self.slots.held(slot, "DECODE_CKPT")
        bs = self.block_size
        if snapshot_tokens != st.length or snapshot_tokens % bs or snapshot_tokens == 0:
            raise SlotError(
                f"DECODE_CKPT slot {slot}: snapshot of {snapshot_tokens} tokens, but the slot holds {st.length}; "
                f"a snapshot is taken at a block boundary (a positive multiple of {bs}) the slot has just reached"
            )
        if end_block != snapshot_tokens // bs or adapter_id != st.adapter & WORD64:
            raise SlotError(
                f"DECODE_CKPT slot {slot}: end block {end_block} / adapter {adapter_id} do not match "
                f"{snapshot_tokens // bs} / {st.adapter & WORD64} of the slot"
            )
        prefix = self.blocks.chain_hashes(st.tokens, st.adapter, self._salts[st.key])[-1]
        if prefix_hash64(prefix) != session_hash:
            raise ExecutorError(
                f"snapshot diverged on slot {slot}: rank 0 names prefix {session_hash:#018x}, "
                f"this rank holds {prefix_hash64(prefix):#018x}"
            )
        turn = snapshot_tokens >= len(st.prompt) // bs * bs  # the prompt's end or decoded tokens
        self.state.save(slot, self.snapshots.save(prefix, owner=st.key if turn else None))

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
        return self._output(h[-1:])

    def prefill_next(self, slot: int, chunk_start: int, tokens):
        """The next chunk ``tokens`` of the prompt (and vision rows) the slot's PREFILL brought."""
        st = self.slots.check_next_chunk(slot, chunk_start, tokens)
        return self.prefill(slot, st.prompt, chunk_start, len(tokens), st.vision_rows)

    def decode(self, slots: list, tokens: list):
        """Append tokens[r] to slots[r] and run one step. Returns logits [B, V] (or None)."""
        states = self.slots.check_decode(slots, tokens, "decode")
        B, bs = len(states), self.block_size
        lengths = np.fromiter((st.length for st in states), dtype=np.int64, count=B)  # [B] new tokens' positions
        block_tables = self._decode_tables(slots, states, lengths)  # [B, MB]
        slot_mapping = block_tables[np.arange(B), lengths // bs] * bs + (lengths % bs).astype(np.int32)  # [B]
        positions = lengths.astype(np.int32)
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
        return self._output(h)

    def _output(self, h):
        """What a forward pass returns for its last hidden rows h [n, D]: logits [n, V] (None when
        compute_logits is off)."""
        return self.model.logits(h) if self.compute_logits else None

    def _decode_tables(self, slots: list, states: list, lengths: np.ndarray) -> np.ndarray:
        """Block tables [B, MB] (zero-padded) of a decode step's rows, with room for one more
        token each. Rows come from a per-slot array; only a row whose slot changed hands or
        whose sequence needs a new block goes back to the block manager."""
        rows = np.asarray(slots, dtype=np.int64)  # [B]
        keys = np.fromiter((st.key for st in states), dtype=np.int64, count=len(states))
        need = (lengths + 1) // self.block_size + 1  # blocks for length + 1 tokens (BlockManager.blocks_for)
        for r in np.flatnonzero((self._table_key[rows] != keys) | (self._table_len[rows] < need)):
            st = states[r]
            self.blocks.grow(st.key, st.length + 1)
            self._store_table(int(rows[r]), st.key)
        return self._tables[rows, : int(self._table_len[rows].max())]

    def _store_table(self, slot: int, key: int) -> None:
        table = self.blocks.block_table(key)
        width = self._tables.shape[1]
        if len(table) > width:
            grown = np.zeros((self._tables.shape[0], max(len(table), 2 * width)), dtype=np.int32)
            grown[:, :width] = self._tables
            self._tables = grown
        self._tables[slot, : len(table)] = table
        self._tables[slot, len(table) :] = 0
        self._table_key[slot], self._table_len[slot] = key, len(table)

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
