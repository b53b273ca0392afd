"""One rank's model state: the slot table, block manager, paged KV and the forward pass.

Rank 0's runner and every worker's command loop feed an identical ShardExecutor the same
calls in the same order (docs/design.md, "One command stream").
B sequences in a decode batch, T tokens in a prefill chunk, D hidden, V vocabulary.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import numpy as np

from eprt.api import JobFailure
from eprt.cache.block_manager import BlockManager
from eprt.cache.snapshots import WORD64, SnapshotIndex, prefill_points, prefix_hash64
from eprt.cache.window import WindowSpec
from eprt.comm.protocol import MAX_DRAFTS, Prefill
from eprt.comm.slots import SlotError, SlotTable
from eprt.engine.state_check import check_state
from eprt.engine.window_tables import WindowTables, prefill_window
from eprt.model.kv_cache import KVCache
from eprt.model.moe_model import AttnBatch, MoEModel, PrefillPart
from eprt.model.mrope import mrope_cos_sin, prompt_positions, split_vision_rows, vision_row_width
from eprt.model.placement import switch_model_placement
from eprt.model.recurrent_state import RecurrentState

log = logging.getLogger("eprt.engine")


class ExecutorError(JobFailure):
    """A command this rank cannot execute (its state disagrees with the command): shared state."""


SNAPSHOT_POOL_SHARE = 4  # recurrent-state snapshots may take at most 1/4 of the KV pool's memory


def snapshot_budget(cfg, num_blocks: int, block_size: int, itemsize: int, wanted: int) -> tuple[int, int]:
    """(snapshot rows, KV blocks they replace): ``wanted`` rows of the recurrent state, within
    1/SNAPSHOT_POOL_SHARE of the pool's memory, paid for in KV blocks."""
    per_block = KVCache.bytes_per_block(cfg, block_size, itemsize)
    per_row = RecurrentState.bytes_per_slot(cfg)
    rows = min(wanted, num_blocks // SNAPSHOT_POOL_SHARE * per_block // per_row)
    return rows, -(-rows * per_row // per_block)


def window_spec(cfg, prefill_tokens: int) -> WindowSpec | None:
    """The sliding layers' window for the block manager (None without sliding-window layers): a
    prefill chunk is at most ``prefill_tokens`` positions (0: a whole prompt), a decode or verify
    row 1 + MAX_DRAFTS."""
    if not cfg.windowed_kv:
        return None
    return WindowSpec(cfg.sliding_window, prefill_tokens=prefill_tokens, decode_tokens=1 + MAX_DRAFTS)


def _table_cache(max_slots: int, window: WindowSpec | None) -> tuple:
    """The decoding slots' cached block tables: [slots, MB] int32 of each slot's table, [slots] the
    block-manager key each row was built for, [slots] the blocks in each row, and with windowed KV its
    windows' (WindowTables)."""
    return (
        np.zeros((max_slots, 8), dtype=np.int32),
        np.full(max_slots, -1, dtype=np.int64),
        np.zeros(max_slots, dtype=np.int64),
        None if window is None else WindowTables(max_slots),
    )


def vision_salt(rows: np.ndarray | None) -> bytes:
    """Prefix-cache salt of a prompt's vision rows: image placeholders are one token id
    whatever the image, so KV after them depends on the rows too. Rank 0 hashes the
    float32 rows it broadcasts, so every rank computes the same salt."""
    if rows is None or len(rows) == 0:
        return b""
    return hashlib.blake2b(np.ascontiguousarray(rows, dtype=np.float32).tobytes(), digest_size=16).digest()


@dataclass(frozen=True)
class PrefillChunk:
    """Prefill ``tokens[chunk_start : chunk_start + chunk_len]`` of the whole prompt ``tokens`` into ``slot``."""

    slot: int
    tokens: object  # the whole prompt (sequence of ints)
    chunk_start: int
    chunk_len: int
    vision_rows: np.ndarray | None = None  # float32 [rows, D] of the prompt's image placeholders


class HeldRows:
    """A sequence's main-model hidden rows [m, D] of positions ``start`` to ``end`` - 1, which the MTP
    layer has not consumed: kept as the forward passes' pieces and joined when read (appending each
    decode step's row to one array would copy all of them every step)."""

    def __init__(self, start: int, chunks: list) -> None:
        self.start, self.chunks = start, chunks
        self.end = start + sum(len(c) for c in chunks)

    def append(self, rows) -> None:
        """The rows [n, D] of positions ``end`` on."""
        self.chunks.append(rows)
        self.end += len(rows)

    def rows(self, ops):
        """[m, D], the pieces joined (once: they are kept joined)."""
        if len(self.chunks) > 1:
            self.chunks = [ops.xp.concatenate(self.chunks, axis=0)]
        return self.chunks[0]

    def truncate(self, end: int) -> None:
        """Drop the rows of positions ``end`` on (an ACCEPT's rejected positions)."""
        keep, at = [], self.start
        for c in self.chunks:
            if at < end:
                keep.append(c[: end - at])
            at += len(c)
        self.chunks, self.end = keep, min(self.end, end)

    def copy(self) -> HeldRows:
        return HeldRows(self.start, list(self.chunks))


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
        lora=None,
        prefill_tokens: int = 0,  # the largest prefill chunk (0: whole prompts): what a window reserves
    ):
        self.model, self.ops, self.cfg = model, model.ops, model.cfg
        self.lora = model.lora = lora  # LoraSlots (eprt/model/lora.py) or None: no adapters served
        self._pending_adapter: dict[int, int] = {}  # slot -> adapter id its next PREFILL uses (SLOT_ADAPTER)
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
        self.mtp = model.w.mtp is not None  # DeepSeek's MTP layer drafts (VERIFY_MTP): its KV is one more layer
        self.kv = KVCache(model.ops, model.cfg, num_blocks - reserved, block_size, extra_layers=int(self.mtp))
        # slot key -> the main model's hidden rows the MTP layer has not consumed yet, for want of
        # the token after each position or of a draft to make (docs/protocol.md)
        self._mtp_rows: dict[int, HeldRows] = {}
        self.step_clock = None  # set (rank 0, step costs measured): VERIFY_MTP times its catch-up pass on it
        self.mtp_catch_up_seconds = 0.0  # the last VERIFY_MTP's catch-up pass, on step_clock
        self.mtp_caught_up = (0, 0)  # the rows and positions it ran
        self.state = RecurrentState(model.ops, model.cfg, max_slots, rows) if model.cfg.is_hybrid else None
        self.window = window_spec(model.cfg, prefill_tokens)
        self.blocks = BlockManager(num_blocks - reserved, block_size, prefix_cache=prefix_cache, window=self.window)
        self.snapshots = SnapshotIndex(rows) if rows else None
        if self.snapshots is not None:
            self.blocks.hit_filter = self.snapshots.usable_blocks
        self._salts: dict[int, bytes] = {}  # slot key -> prefix-cache salt (snapshot hashes)
        self._mrope: dict[int, tuple] = {}  # slot key -> (3-D prompt positions [3, P], rope delta): MRoPE models
        self.block_size = block_size
        self.slots = SlotTable(max_slots)
        self.image_token_id = image_token_id if image_token_id is not None else model.cfg.image_token_id
        self.compute_logits = True  # workers turn this off: only rank 0 samples
        self.prefill_hidden = None  # [T, D] of the last prefill chunk, when asked to keep it
        self._tables, self._table_key, self._table_len, self.wtables = _table_cache(max_slots, self.window)

    @property
    def hidden_size(self) -> int:
        """Width of one vision row: the hidden size, or for MRoPE models its vision row (mrope.py)."""
        return vision_row_width(self.cfg)

    # ---- slot bookkeeping -------------------------------------------------------------
    def allocate(
        self,
        slot: int,
        tokens,
        adapter: int = -1,
        vision_rows: np.ndarray | None = None,
        salt: bytes | None = None,
        max_hit: int | None = None,
    ) -> int:
        """Occupy the empty ``slot`` with a prompt and its vision rows, reserving its blocks;
        returns the prefix-cache hit length (at most ``max_hit`` tokens when given: rank 0 computes
        the whole prompt of a request asking for prompt logprobs). ``salt``: ``vision_salt(vision_rows)``."""
        if self.slots.get(slot) is not None:
            raise SlotError(f"slot {slot} is already occupied")
        key = self.slots.next_key
        salt = vision_salt(vision_rows) if salt is None else salt
        blocks = self._blocks_for_new(slot)
        cached = blocks.allocate(key, [int(t) for t in tokens], adapter, salt, max_hit=max_hit)
        self._window_copies(blocks, self._holds_kv_of_new(blocks))
        self.slots.occupy(slot, tokens, cached, adapter, vision_rows)
        self._salts[key] = salt
        if self.cfg.mrope_section:
            image_pos = None if vision_rows is None else split_vision_rows(self.cfg, vision_rows)[2]
            self._mrope[key] = prompt_positions(tokens, self.image_token_id, image_pos)
        if self.state is not None and cached:  # the hit ends at a snapshot (hit_filter)
            prefix = blocks.chain_hashes([int(t) for t in tokens[:cached]], adapter, salt)[-1]
            self.state.restore(self.snapshots.lookup(prefix), slot)
        elif self.state is not None:
            self.state.reset(slot)
        return cached

    def _blocks_for_new(self, slot: int) -> BlockManager:
        """The block manager a sequence allocated into the empty ``slot`` keeps its blocks in."""
        return self.blocks

    def _blocks_of(self, slot: int) -> BlockManager:
        """The block manager holding the blocks of the sequence in ``slot``."""
        return self.blocks

    def cache(self, slot: int) -> None:
        """Offer the slot's full blocks to the prefix cache; with an MTP layer only those whose MTP
        KV was computed too (positions before its first unconsumed hidden row)."""
        st = self.slots.held(slot, "cache")
        held = self._mtp_rows.get(st.key)
        self._blocks_of(slot).cache(st.key, st.tokens if held is None else st.tokens[: held.start])

    def free(self, slot: int) -> int:
        blocks = self._blocks_of(slot)
        key = self.slots.vacate(slot).key
        self._salts.pop(key, None)
        self._mtp_rows.pop(key, None)
        self._mrope.pop(key, None)
        if self.snapshots is not None:
            self.snapshots.forget(key)
        return blocks.free(key)

    def release(self, slot: int) -> None:
        self.cache(slot)
        self.free(slot)

    def fork(self, slot: int, new_slot: int) -> None:
        """FORK: occupy the empty ``new_slot`` with a copy of the prefilled sequence in ``slot``, sharing
        its full KV blocks and copying the partial last one, and its recurrent state on a hybrid model
        (docs/protocol.md, "FORK")."""
        st = self.slots.held(slot, "FORK")
        if not st.prefilled:
            raise SlotError(f"FORK slot {slot}: prefill incomplete ({st.length} of {len(st.prompt)} prompt tokens)")
        if self.slots.get(new_slot) is not None:
            raise SlotError(f"FORK slot {slot} -> {new_slot}: target slot is occupied")
        key = self.slots.next_key
        copy = self._blocks_of(slot).fork(st.key, key, st.length)
        if copy is not None and self._holds_kv(slot):
            self.kv.copy_block(*copy)
        self._window_copies(self._blocks_of(slot), self._holds_kv(slot))
        child = self.slots.occupy(new_slot, st.prompt, 0, st.adapter, st.vision_rows)
        child.tokens.extend(st.tokens)
        self._salts[key] = self._salts[st.key]
        if st.key in self._mtp_rows:
            self._mtp_rows[key] = self._mtp_rows[st.key].copy()
        if self.state is not None:  # a hybrid model: the recurrent state at the prompt's end, copied
            self.state.move(slot, new_slot)

    def can_fork(self, slot: int) -> bool:
        """Whether FORK of ``slot`` can run now: a free slot and a free block in its pool."""
        return self.slots.lowest_free() is not None and self._blocks_of(slot).can_fork()

    def _holds_kv(self, slot: int) -> bool:
        """Whether this rank stores the KV of the sequence in ``slot`` (every rank does, but under dp)."""
        return True

    def _holds_kv_of_new(self, blocks: BlockManager) -> bool:
        """Whether this rank stores the KV of the sequences in the pool ``blocks`` (its own pool)."""
        return blocks is self.blocks

    def _window_copies(self, blocks: BlockManager, holds_kv: bool) -> None:
        """The KV block copies the pool's window asked for (a prefix hit's or a fork's window)."""
        if blocks.window is not None:
            for src, dst in blocks.window.pop_copies():
                if holds_kv:
                    self.kv.copy_block(src, dst)

    def switch_placement(self, epoch: int, table: np.ndarray) -> int:
        """EPLB_PLACEMENT (docs/eplb.md): hold the experts of ``table`` [layers, slots] from the next
        forward pass; returns how many experts were read from the checkpoint."""
        return switch_model_placement(self.model, epoch, table)

    def check_state(self, step: int, transport) -> None:
        """CHECK_STATE: this rank's digests of what it mirrors against every rank's (state_check)."""
        check_state(self, transport, step)

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
        self.slots.open_verify = None  # a run that ends mid-verify frees its slots all the same
        for slot in self.slots.occupied():
            self.free(slot)

    # ---- compute ----------------------------------------------------------------------
    def prefill(
        self,
        slot: int,
        tokens,
        chunk_start: int,
        chunk_len: int,
        vision_rows: np.ndarray | None = None,
        keep_hidden: bool = False,
    ):
        """Prefill tokens[chunk_start : chunk_start+chunk_len] of the full prompt ``tokens``.
        Returns the logits [1, V] of the chunk's last token (None when compute_logits is off);
        ``keep_hidden`` keeps the chunk's hidden states [T, D] in ``self.prefill_hidden``
        (prompt logprobs: the LM head runs over them only for the requests that ask)."""
        chunk = PrefillChunk(slot, tokens, chunk_start, chunk_len, vision_rows)
        return self._prefill_chunks([chunk], keep_hidden=keep_hidden)

    def prefill_next(self, slot: int, chunk_start: int, tokens):
        """The next chunk ``tokens`` of the prompt (and vision rows) the slot's PREFILL brought."""
        return self._prefill_chunks([self._next_chunk(slot, chunk_start, tokens)])

    def prefill_group(self, commands: list, vision_rows: list | None = None, keep_hidden: bool = False):
        """PREFILL / PREFILL_NEXT commands of one frame as one forward pass over all their tokens
        (docs/protocol.md, "Batched prefill"); ``vision_rows[i]``: the rows PREFILL i announced.
        Returns the logits [G, V] of each chunk's last token (None when compute_logits is off)."""
        rows = vision_rows if vision_rows is not None else [None] * len(commands)
        chunks = [
            PrefillChunk(cmd.slot, cmd.tokens, cmd.chunk_start, cmd.chunk_len, r)
            if isinstance(cmd, Prefill)
            else self._next_chunk(cmd.slot, cmd.chunk_start, cmd.tokens)
            for cmd, r in zip(commands, rows)
        ]
        if self.cfg.mrope_section and len(chunks) > 1:  # MRoPE models: one pass per sequence
            if keep_hidden:
                raise ExecutorError("prompt logprobs of a prefill group: MRoPE models prefill one sequence per pass")
            outs = [self._prefill_chunks([c]) for c in chunks]
            return None if outs[0] is None else self.ops.xp.concatenate(outs, axis=0)
        return self._prefill_chunks(chunks, keep_hidden=keep_hidden)

    def _next_chunk(self, slot: int, chunk_start: int, tokens) -> PrefillChunk:
        st = self.slots.check_next_chunk(slot, chunk_start, tokens)
        return PrefillChunk(slot, st.prompt, chunk_start, len(tokens), st.vision_rows)

    def _prefill_chunks(self, chunks: list, keep_hidden: bool = False):
        """One forward over the chunks' tokens, each sequence at its own positions attending
        causally to its own paged KV. Returns logits [G, V] of each chunk's last token, or None;
        ``keep_hidden`` keeps the hidden states [T, D] of all the chunks' tokens, in order, in
        ``self.prefill_hidden``."""
        named = [c.slot for c in chunks]
        if len(set(named)) != len(named):
            raise ExecutorError(f"a prefill group names a slot twice: slots {named}")
        ids, positions, maps, parts, rows, masks = [], [], [], [], [], []
        offset, states = 0, []
        self._allocate_new(chunks)
        for c in chunks:
            tokens = [int(t) for t in c.tokens]
            st = self.slots.check_chunk(c.slot, tokens, c.chunk_start, c.chunk_len)
            end = c.chunk_start + c.chunk_len
            self.blocks.grow(st.key, end, first=c.chunk_start)
            pos = np.arange(c.chunk_start, end, dtype=np.int32)  # [T_i]
            table = np.asarray(self.blocks.block_table(st.key), dtype=np.int32)
            ids.append(np.asarray(tokens[c.chunk_start : end], dtype=np.int32))
            positions.append(pos)
            maps.append(self.kv.slots(table, pos))
            parts.append(PrefillPart(offset, c.chunk_len, table, c.chunk_start, c.slot))
            r, m = self._vision_chunk(tokens, c.chunk_start, end, c.vision_rows)
            rows.append(r)
            masks.append(np.zeros(c.chunk_len, dtype=bool) if m is None else m)
            states.append((st, tokens[c.chunk_start : end]))
            offset += c.chunk_len
        seen = [r for r in rows if r is not None]
        batch = AttnBatch(
            positions=np.concatenate(positions),  # [T]
            slot_mapping=np.concatenate(maps),
            state_slots=np.asarray(named, dtype=np.int32),
            parts=tuple(parts),
            window=prefill_window(self.blocks.window, self.kv, [st.key for st, _ in states], parts),
        )
        self._lora_rows([st.adapter for st, new in states for _ in new])  # each token's adapter
        deepstack = None
        if self.cfg.mrope_section:  # 3-D positions and deepstack rows: one sequence per pass (prefill_group)
            (st, _), c = states[0], chunks[0]
            mask = masks[0] if rows[0] is not None else None
            main, deepstack, batch.rope_cos_sin = self._mrope_chunk(
                st.key, c.chunk_start, c.chunk_start + c.chunk_len, rows[0], mask
            )
            seen = [] if main is None else [main]  # the main rows replace the vision rows
        embedded = self.model.embed(
            np.concatenate(ids), np.concatenate(seen) if seen else None, np.concatenate(masks) if seen else None
        )  # [T, D]
        h = self.model.hidden_states(embedded, batch, self.kv, self.state, deepstack)  # [T, D]
        self._mtp_keep([st for st, _ in states], [c.chunk_start for c in chunks], [c.chunk_len for c in chunks], h)
        for st, new in states:
            st.tokens.extend(new)
        self._mtp_prefill(named, [st for st, _ in states])
        self.prefill_hidden = h if keep_hidden else None
        last = np.asarray([p.offset + p.length - 1 for p in parts], dtype=np.int32)  # [G]
        return self._output(h[self.ops.index(last)])

    def _allocate_new(self, chunks: list) -> None:
        """A prefill group's first chunks on a worker: each new sequence allocated exactly as rank 0 did
        (its prefix hit must be its chunk_start), all before any chunk grows, as rank 0 admitted them
        before it ran the group (a window's blocks are taken as chunks grow)."""
        for c in chunks:
            if self.slots.get(c.slot) is None:
                adapter = self._pending_adapter.pop(c.slot, -1)
                tokens = [int(t) for t in c.tokens]
                cached = self.allocate(c.slot, tokens, adapter, vision_rows=c.vision_rows, max_hit=c.chunk_start)
                if cached != c.chunk_start:
                    raise ExecutorError(
                        f"prefix cache diverged on slot {c.slot}: this rank reuses {cached} tokens, "
                        f"rank 0 sent chunk_start={c.chunk_start}"
                    )

    def decode(self, slots: list, tokens: list):
        """Append tokens[r] to slots[r] and run one step. Returns logits [B, V] (or None)."""
        return self.decode_forward(self.decode_inputs(slots, tokens))

    def decode_inputs(self, slots: list, tokens: list) -> tuple:
        """The host half of ``decode``: check the rows, build the step's batch, store each token in
        its slot; returns what ``decode_forward`` runs (rank 0 may run that on another thread)."""
        states = self.slots.check_decode(slots, tokens, "decode")
        B, bs = len(states), self.block_size
        lengths = np.fromiter((st.length for st in states), dtype=np.int64, count=B)  # [B] new tokens' positions
        block_tables = self._decode_tables(slots, states, lengths)  # [B, MB]
        slot_mapping = block_tables[np.arange(B), lengths // bs] * bs + (lengths % bs).astype(np.int32)  # [B]
        positions = lengths.astype(np.int32)
        batch = AttnBatch(
            positions=positions + self._rope_deltas(states) if self.cfg.mrope_section else positions,
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            context_lens=positions + 1,
            state_slots=np.asarray(slots, dtype=np.int32),
        )
        if self.wtables is not None:  # the sliding layers' tables (windowed KV)
            batch.window = self.wtables.decode(batch, slots, lengths, bs)
        ids = np.asarray(tokens, dtype=np.int32)
        self._lora_rows([st.adapter for st in states])
        for st, tok in zip(states, tokens):  # the token's KV is stored by the forward pass
            st.tokens.append(int(tok))
        return ids, batch, states, lengths

    def decode_forward(self, inputs: tuple):
        """The device half of ``decode``: the forward pass of ``decode_inputs``'s batch; logits [B, V] (or None)."""
        ids, batch, states, lengths = inputs
        h = self.model.hidden_states(self.model.embed(ids), batch, self.kv, self.state)  # [B, D]
        self._mtp_keep(states, lengths, [1] * len(states), h)
        return self._output(h)

    def _output(self, h):
        """What a forward pass returns for its last hidden rows h [n, D]: logits [n, V] (None when
        compute_logits is off)."""
        return self.model.logits(h) if self.compute_logits else None

    def verify(self, slots: list, tokens: list, drafts: list):
        """VERIFY: row r appends tokens[r] and its drafts[r] (0..4) to slots[r] in one forward pass.
        Each of the sum(1 + k_r) positions attends like a decode row over its own sequence up to
        itself (ops.attention_verify: a backend may gather each sequence's KV once). The drafts' KV
        stays pending until ``accept``. Returns logits [sum(1 + k_r), V], row r's positions
        consecutive (or None)."""
        states = self.slots.check_verify(slots, tokens, drafts)
        if self.state is not None:
            raise ExecutorError(
                f"VERIFY on {self.cfg.model_type}: a model with recurrent state cannot roll back rejected drafts"
            )
        bs = self.block_size
        counts = np.fromiter((len(d) for d in drafts), dtype=np.int64, count=len(slots))  # [B]
        lengths = np.fromiter((st.length for st in states), dtype=np.int64, count=len(slots))  # [B]
        keys = np.fromiter((st.key for st in states), dtype=np.int64, count=len(slots))
        need = (lengths + counts + 1) // bs + 1  # blocks for all its positions (as _decode_tables)
        at = np.asarray(slots, dtype=np.int64)  # [B]
        for r in np.flatnonzero(self._stale_rows(at, keys, need, lengths)):
            st = states[r]
            self.blocks.grow(st.key, st.length + int(counts[r]) + 1, first=st.length)
            self._store_table(slots[r], st.key)
        rows = np.repeat(np.arange(len(slots)), counts + 1)  # [N] the batch row of each position
        starts = np.cumsum(counts + 1) - counts - 1  # [B] where each row's positions begin
        positions = lengths[rows] + np.arange(len(rows)) - starts[rows]  # [N]
        block_tables = self._tables[np.asarray(slots, dtype=np.int64)[rows], : int(self._table_len[slots].max())]
        batch = self._verify_batch(block_tables, positions, lengths, counts, slots)
        if self.wtables is not None:
            wt = self.wtables.rows(np.asarray(slots, dtype=np.int64)[rows], block_tables.shape[1])
            batch.window = self._verify_batch(wt, positions, lengths, counts, slots)
        ids = np.asarray([t for tok, d in zip(tokens, drafts) for t in (tok, *d)], dtype=np.int32)  # [N]
        self._lora_rows([st.adapter for st, d in zip(states, drafts) for _ in range(1 + len(d))])
        h = self.model.hidden_states(self.model.embed(ids), batch, self.kv, self.state)  # [N, D]
        self._mtp_keep(states, lengths, counts + 1, h)
        for st, tok, d in zip(states, tokens, drafts):
            st.tokens.extend((int(tok), *(int(t) for t in d)))
        self.slots.open(slots, drafts)
        return self._output(h)

    def _verify_batch(self, block_tables, positions, lengths, counts, slots) -> AttnBatch:
        """A verify step's batch over block_tables [N, MB] (a row per position)."""
        bs = self.block_size
        slot_mapping = block_tables[np.arange(len(positions)), positions // bs] * bs + (positions % bs).astype(np.int32)
        if len(slots) == 1:  # one sequence: a causal chunk at its end, its KV gathered once (a prefill's pass)
            table = block_tables[0, : self._table_len[slots[0]]]
            return AttnBatch(positions.astype(np.int32), slot_mapping, block_table=table, start_pos=int(lengths[0]))
        return AttnBatch(
            positions=positions.astype(np.int32),
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            context_lens=(positions + 1).astype(np.int32),
            query_lens=counts + 1,  # each sequence's KV gathered once for its positions
        )

    def accept(self, slots: list, accepted: list) -> None:
        """ACCEPT: close the last VERIFY; row r keeps accepted[r] drafts, the rest of its KV rolls back
        (tokens and tail blocks beyond what the kept length needs)."""
        for slot, (st, dropped) in zip(slots, self.slots.accept(slots, accepted)):
            if dropped and self._blocks_of(slot).shrink(st.key, st.length) and self._holds_kv(slot):
                self._store_table(slot, st.key)
            held = self._mtp_rows.get(st.key)
            if dropped and held is not None:  # the rejected positions' hidden rows go too
                held.truncate(st.length)

    # ---- multi-token prediction (VERIFY_MTP; docs/protocol.md) ---------------------------------
    def _mtp_keep(self, states: list, starts, lengths, h) -> None:
        """Hold the main model's hidden rows h [T, D] for the MTP layer: row r's ``lengths[r]`` rows,
        consecutive in h, are positions ``starts[r]`` on of ``states[r]``'s sequence."""
        if not self.mtp:
            return
        at = 0
        for st, start, n in zip(states, starts, lengths):
            start, n, rows = int(start), int(n), h[at : at + int(n)]
            at += n
            held = self._mtp_rows.get(st.key)
            if held is None:
                self._mtp_rows[st.key] = HeldRows(start, [rows])
            elif held.end != start:
                raise ExecutorError(
                    f"MTP rows of slot key {st.key}: positions {held.start}..{held.end - 1} held, "
                    f"the next rows start at {start}"
                )
            else:
                held.append(rows)

    def verify_mtp(self, slots: list, tokens: list, counts: list):
        """VERIFY_MTP: the MTP layer drafts ``counts[r]`` tokens for row r on this rank (every rank
        computes the same), then the VERIFY of ``tokens`` and those drafts runs. Returns (drafts,
        the VERIFY's logits or None)."""
        if not self.mtp:
            raise ExecutorError("VERIFY_MTP: this rank has no MTP layer (it runs without --speculative-method mtp)")
        states = self.slots.check_verify(slots, tokens, [(0,) * int(k) for k in counts])
        for slot, st, k in zip(slots, states, counts):  # the drafting steps write MTP KV up to L + k - 2
            self.blocks.grow(st.key, st.length + int(k) + 1, first=st.length)
            self._store_table(slot, st.key)
        drafts = self._mtp_drafts(slots, states, tokens, [int(k) for k in counts])
        return drafts, self.verify(slots, tokens, drafts)

    def _mtp_catch_up(self, slots: list, states: list, tokens: list) -> tuple:
        """The MTP layer over each row's held positions ``s .. L - 1``, position p fed the token
        after it (the stored ones, then ``tokens[r]`` after L - 1) and the main model's hidden row
        of p; the held rows are consumed. Returns (output [T, D], PrefillPart per row)."""
        rows = []
        for slot, st, tok in zip(slots, states, tokens):
            held = self._mtp_rows.pop(st.key, None)
            if held is None or held.end != st.length:
                raise ExecutorError(
                    f"VERIFY_MTP slot {slot}: no hidden rows held up to its {st.length} stored tokens for the MTP layer"
                )
            rows.append((slot, st, held.start, held.rows(self.ops), [*st.tokens[held.start + 1 : st.length], int(tok)]))
        return self._mtp_pass(rows)

    def _mtp_prefill(self, slots: list, states: list) -> None:
        """After a prefill chunk: the MTP layer over each sequence's held positions but the last,
        whose next tokens the prompt holds (so the first verify step's catch-up is one row)."""
        if not self.mtp:
            return
        rows = []
        for slot, st in zip(slots, states):
            held = self._mtp_rows[st.key]
            if held.end - held.start > 1:
                hidden = held.rows(self.ops)
                rows.append((slot, st, held.start, hidden[:-1], st.tokens[held.start + 1 : st.length]))
                self._mtp_rows[st.key] = HeldRows(st.length - 1, [hidden[-1:]])
        if rows:
            self._mtp_pass(rows)

    def _mtp_pass(self, rows: list) -> tuple:
        """One MTP forward over rows ``(slot, state, first position s, hidden rows [m, D], the m
        tokens after positions s .. s + m - 1)``, each a causal chunk over the slot's MTP KV, which
        it writes. Returns (output [T, D], PrefillPart per row)."""
        ops = self.ops
        self.model.lora_rows = None  # the MTP layer serves no adapter
        ids, prev, positions, maps, parts, offset = [], [], [], [], [], 0
        for slot, st, start, hidden, after in rows:
            table = np.asarray(self.blocks.block_table(st.key), dtype=np.int32)
            pos = np.arange(start, start + len(hidden), dtype=np.int32)  # [m]
            ids.append(np.asarray(after, dtype=np.int32))
            prev.append(hidden)
            positions.append(pos)
            maps.append(self.kv.slots(table, pos))
            parts.append(PrefillPart(offset, len(pos), table, start, slot))
            offset += len(pos)
        batch = AttnBatch(positions=np.concatenate(positions), slot_mapping=np.concatenate(maps), parts=tuple(parts))
        return self.model.mtp_hidden(np.concatenate(ids), ops.xp.concatenate(prev, axis=0), batch, self.kv), parts

    def _mtp_drafts(self, slots: list, states: list, tokens: list, counts: list) -> list:
        """One catch-up pass of the MTP layer over each drafting row's held positions ``s .. L - 1``
        (L the stored tokens; the token after L - 1 is ``tokens[r]``), whose last row drafts the
        token after ``tokens[r]``; then one pass per further draft at positions L, L + 1, .., each
        fed the previous draft and the MTP's own previous output (as vLLM drafts K > 1 with one
        layer). Drafts are the argmax of the MTP head. Row r's drafts: counts[r] tokens. A row
        without drafts keeps its held rows (a sequence that never drafts again never pays for them)."""
        ops, bs = self.ops, self.block_size
        rows = [r for r, k in enumerate(counts) if k > 0]
        self.mtp_caught_up, self.mtp_catch_up_seconds = (0, 0), 0.0
        if not rows:
            return [() for _ in slots]
        if self.step_clock is not None:
            ops.synchronize()
            start = self.step_clock()
        h, parts = self._mtp_catch_up([slots[r] for r in rows], [states[r] for r in rows], [tokens[r] for r in rows])
        if self.step_clock is not None:
            ops.synchronize()
            self.mtp_catch_up_seconds = self.step_clock() - start
        self.mtp_caught_up = (len(rows), int(h.shape[0]))
        last = h[ops.index(np.asarray([p.offset + p.length - 1 for p in parts], dtype=np.int32))]  # [b, D]
        drafts = [[] for _ in slots]
        lengths = np.asarray([st.length for st in states], dtype=np.int64)  # [B]
        for j in range(max(counts)):
            if j:  # position L + j - 1 of each row still drafting: the previous draft, the MTP's own output
                keep = [i for i, r in enumerate(rows) if counts[r] > j]
                rows, last = [rows[i] for i in keep], last[ops.index(np.asarray(keep, dtype=np.int32))]
                pos = lengths[rows] + j - 1  # [b]
                tables = self._tables[np.asarray(slots, dtype=np.int64)[rows], : int(self._table_len[slots].max())]
                batch = AttnBatch(
                    positions=pos.astype(np.int32),
                    slot_mapping=tables[np.arange(len(rows)), pos // bs] * bs + (pos % bs).astype(np.int32),
                    block_tables=tables,
                    context_lens=(pos + 1).astype(np.int32),
                )
                step = np.asarray([drafts[r][-1] for r in rows], dtype=np.int32)
                last = self.model.mtp_hidden(step, last, batch, self.kv)  # [b, D]
            for r, t in zip(rows, ops.argmax(self.model.mtp_logits(last))):
                drafts[r].append(int(t))
        return [tuple(d) for d in drafts]

    # ---- LoRA adapters (LORA_LOAD, LORA_UNLOAD, SLOT_ADAPTER; docs/lora.md) --------------------------
    def _lora_rows(self, adapters: list) -> None:
        """The forward pass's rows' adapter slots (None, the base path, when no row has an adapter)."""
        self.model.lora_rows = None if self.lora is None else self.lora.rows(adapters)

    def _lora_slots(self, what: str):
        if self.lora is None:
            raise ExecutorError(f"{what}: this executor serves no LoRA adapters (--max-loras 0)")
        return self.lora

    def load_adapter(self, lora_slot: int, adapter_id: int, path: str) -> None:
        """Read this rank's share of the adapter at ``path`` into ``lora_slot`` (its old adapter out)."""
        lora = self._lora_slots("LORA_LOAD")
        self._check_unused(lora, lora_slot, "LORA_LOAD")
        lora.load(lora_slot, adapter_id, lora.read(path))

    def unload_adapter(self, lora_slot: int) -> None:
        lora = self._lora_slots("LORA_UNLOAD")
        self._check_unused(lora, lora_slot, "LORA_UNLOAD")
        lora.unload(lora_slot)

    def _check_unused(self, lora, lora_slot: int, what: str) -> None:
        if not 0 <= lora_slot < lora.max_loras:
            raise SlotError(f"{what}: LoRA slot {lora_slot} out of range [0, {lora.max_loras})")
        held = lora.ids[lora_slot]
        users = [i for i in self.slots.occupied() if held >= 0 and self.slots.get(i).adapter == held]
        if users:
            raise SlotError(f"{what}: LoRA slot {lora_slot} holds adapter {held}, in use by slot(s) {users}")

    def set_slot_adapter(self, slot: int, lora_slot: int) -> None:
        """SLOT_ADAPTER: the next PREFILL into the empty ``slot`` uses the adapter in ``lora_slot``."""
        lora = self._lora_slots("SLOT_ADAPTER")
        if self.slots.get(slot) is not None:
            raise SlotError(f"SLOT_ADAPTER for occupied slot {slot}")
        if not 0 <= lora_slot < lora.max_loras or lora.ids[lora_slot] < 0:
            raise SlotError(f"SLOT_ADAPTER slot {slot}: LoRA slot {lora_slot} holds no adapter")
        self._pending_adapter[slot] = lora.ids[lora_slot]

    def _decode_tables(self, slots: list, states: list, lengths: np.ndarray) -> np.ndarray:
        """Block tables [B, MB] (zero-padded) of a decode step's rows, with room for one more
        token each. Rows come from a per-slot array; only a row whose slot changed hands or
        whose sequence needs a new block goes back to the block manager."""
        rows = np.asarray(slots, dtype=np.int64)  # [B]
        keys = np.fromiter((st.key for st in states), dtype=np.int64, count=len(states))
        need = (lengths + 1) // self.block_size + 1  # blocks for length + 1 tokens (BlockManager.blocks_for)
        for r in np.flatnonzero(self._stale_rows(rows, keys, need, lengths)):
            st = states[r]
            self.blocks.grow(st.key, st.length + 1, first=st.length)
            self._store_table(int(rows[r]), st.key)
        return self._tables[rows, : int(self._table_len[rows].max())]

    def _stale_rows(self, rows: np.ndarray, keys: np.ndarray, need: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """[B] bool: the rows whose cached tables must come from the block manager again: the slot
        changed hands, the sequence needs a new block, or its window moves on (first query: lengths)."""
        stale = (self._table_key[rows] != keys) | (self._table_len[rows] < need)
        if self.wtables is not None:
            stale |= self.wtables.moved(self.blocks.window, rows, lengths)
        return stale

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
        if self.wtables is not None:
            self.wtables.store(slot, self.blocks.window, key)

    def _mrope_chunk(self, key: int, start: int, end: int, rows, mask) -> tuple:
        """MRoPE prefill inputs of the chunk: (main rows [n, D], deepstack (mask, rows [K, n, D]) or
        None, per-token cos|sin [T, R] or None when the prompt has no image)."""
        positions, delta = self._mrope[key]
        if rows is None:
            return None, None, None
        main, deepstack, _ = split_vision_rows(self.cfg, rows)
        table = mrope_cos_sin(self.cfg, self.model.inv_freq, positions[:, start:end])
        return main, ((mask, deepstack) if len(main) and self.cfg.deepstack_layers else None), table

    def _rope_deltas(self, states) -> np.ndarray:
        """[B] rope deltas of a decode batch's sequences (0 for a text-only prompt)."""
        return np.fromiter((self._mrope[st.key][1] for st in states), dtype=np.int32, count=len(states))

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
