"""One rank's model state and its commands: ShardExecutor, composed of parts with one job each:
``seqs``, the sequence state (the slot table, each sequence's blocks in its pool, the block-table
rows: ``sequences.py``, ``block_pools.py``); ``passes``, the forward passes (``passes.py``:
replicated attention, or dp attention's owner rows and exchange); ``adapters``, the LoRA slots
(``slot_adapters.py``); ``vision``, a prompt's vision rows (``vision_inputs.py``); ``hybrid``, a
hybrid model's recurrent state and snapshots (``recurrent.py``); ``mtp_layer``, DeepSeek's MTP
layer (``mtp.py``). dp attention is a configuration of these parts (``dp_executor``), not another
class.

Rank 0's runner and every worker's command loop feed an identical ShardExecutor the same
commands in the same order (docs/design.md, "One command stream"): a worker runs each command
here, accounting and compute at once; rank 0 runs a command's accounting while it plans the step
and its passes when it executes it (docs/design.md, "One step").
B sequences in a decode batch, T tokens in a prefill chunk, D hidden, V vocabulary.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from eprt.cache.block_manager import BlockManager
from eprt.cache.window import WindowSpec
from eprt.comm.protocol import MAX_DRAFTS, Prefill
from eprt.comm.slots import SlotError
from eprt.engine.block_pools import SharedBlocks
from eprt.engine.mtp import MtpLayer
from eprt.engine.passes import Passes
from eprt.engine.recurrent import HybridState, snapshot_budget
from eprt.engine.sequences import ExecutorError, Sequences, prefix_tokens, vision_salt
from eprt.engine.slot_adapters import SlotAdapters
from eprt.engine.state_check import check_state
from eprt.engine.vision_inputs import VisionInputs
from eprt.model.kv_cache import KVCache
from eprt.model.moe_model import MoEModel
from eprt.model.mrope import vision_row_width
from eprt.model.placement import switch_model_placement
from eprt.model.recurrent_state import RecurrentState

__all__ = ["ExecutorError", "PrefillChunk", "ShardExecutor", "prefix_tokens", "vision_salt", "window_spec"]

log = logging.getLogger("eprt.engine")


@dataclass(frozen=True)
class PrefillChunk:
    """Prefill ``tokens[chunk_start : chunk_start + chunk_len]`` of the whole prompt ``tokens`` into ``slot``."""

    slot: int
    tokens: object  # the whole prompt (sequence of ints)
    chunk_start: int
    chunk_len: int
    vision_rows: np.ndarray | None = None  # float32 [rows, D] of the prompt's image placeholders


def window_spec(cfg, prefill_tokens: int) -> WindowSpec | None:
    """The sliding layers' window for the block manager (None without sliding-window layers): a
    prefill chunk is at most ``prefill_tokens`` positions (0: a whole prompt), a decode or verify
    row 1 + MAX_DRAFTS."""
    if not cfg.windowed_kv:
        return None
    return WindowSpec(cfg.sliding_window, prefill_tokens=prefill_tokens, decode_tokens=1 + MAX_DRAFTS)


def _snapshot_rows(model, num_blocks: int, block_size: int, max_slots: int, wanted, paid: bool) -> tuple:
    """(snapshot rows, KV blocks they take): a hybrid model's recurrent-state snapshots for the prefix
    cache (default: one per slot), paid for in KV blocks (``snapshot_budget``) unless ``paid`` is off."""
    wanted = max_slots if wanted is None else wanted
    if not paid:
        return wanted, 0
    rows, reserved = snapshot_budget(model.cfg, num_blocks, block_size, model.ops.kv_itemsize, wanted)
    if rows:
        per_row = RecurrentState.bytes_per_slot(model.cfg)
        log.info(
            "%s: %d recurrent-state snapshots of %d bytes for the prefix cache, in place of %d KV blocks",
            model.cfg.model_type,
            rows,
            per_row,
            reserved,
        )
    else:
        log.info(
            "prefix cache off for %s: no room for a recurrent-state snapshot, without which a cached "
            "KV prefix cannot be resumed",
            model.cfg.model_type,
        )
    return rows, reserved


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
        snapshot_pool: bool = True,
        *,
        prefill_tokens: int = 0,
        pools=None,
        passes=None,
    ):
        """``snapshot_rows``: a hybrid model's recurrent-state snapshots (default: one per slot), paid
        for in KV blocks within 1/SNAPSHOT_POOL_SHARE of the pool, or, without ``snapshot_pool``,
        exactly that many beside the ``num_blocks`` blocks. ``prefill_tokens``: the largest prefill
        chunk (0: whole prompts), what a sliding window reserves (``window_spec``). ``pools``: where
        sequences' blocks live (default: one pool of ``num_blocks``, ``block_pools.SharedBlocks``);
        ``passes(executor)``: the forward passes (default: replicated attention's)."""
        self.model, self.ops, self.cfg = model, model.ops, model.cfg
        self.pool_blocks, self.block_size = num_blocks, block_size  # as given: KV blocks plus what snapshots take
        rows, reserved = 0, 0
        if model.cfg.is_hybrid and prefix_cache and pools is None:
            rows, reserved = _snapshot_rows(model, num_blocks, block_size, max_slots, snapshot_rows, snapshot_pool)
            prefix_cache = bool(rows)
        self.window = window_spec(model.cfg, prefill_tokens)
        if pools is None:
            pools = SharedBlocks(
                BlockManager(num_blocks - reserved, block_size, prefix_cache=prefix_cache, window=self.window)
            )
        self.dp = pools.dp
        self.seqs = Sequences(max_slots, block_size, pools)
        self.slots, self.blocks = self.seqs.slots, pools.blocks  # the slot table; this rank's own pool
        self.pools = getattr(pools, "pools", None)  # dp attention: every rank's pool (OwnerPools)
        self.mtp = model.w.mtp is not None  # DeepSeek's MTP layer drafts (VERIFY_MTP): its KV is one more layer
        self.kv = KVCache(model.ops, model.cfg, self.blocks.num_blocks, block_size, extra_layers=int(self.mtp))
        self.hybrid = HybridState(model.ops, model.cfg, max_slots, rows, self.seqs) if model.cfg.is_hybrid else None
        self.state = None if self.hybrid is None else self.hybrid.state  # RecurrentState
        self.snapshots = None if self.hybrid is None else self.hybrid.snapshots  # SnapshotIndex
        self.mtp_layer = MtpLayer(model, self.kv, self.seqs) if self.mtp else None
        self.lora = model.lora = lora  # LoraSlots (eprt/model/lora.py) or None: no adapters served
        self.adapters = SlotAdapters(lora, model, self.seqs)
        self.image_token_id = image_token_id if image_token_id is not None else model.cfg.image_token_id
        self.vision = VisionInputs(model.cfg, self.image_token_id, getattr(model, "inv_freq", None))
        self.hidden_size = vision_row_width(model.cfg)  # width of one vision row (mrope.py)
        self.compute_logits = True  # workers turn this off: only rank 0 samples
        self.prefill_hidden = None  # [T, D] of the last prefill chunk, when asked to keep it
        self.passes = Passes(self) if passes is None else passes(self)

    # ---- slots ---------------------------------------------------------------------------------
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
        salt = vision_salt(vision_rows) if salt is None else salt
        st, cached = self.seqs.allocate(slot, tokens, adapter, vision_rows, salt, max_hit)
        _copy_blocks(self, slot, self.seqs.window_copies(slot))  # a hit's window: cached KV copied now
        self.vision.allocated(st.key, tokens, vision_rows)
        if self.hybrid is not None:  # its state starts with its first prefill pass
            self.hybrid.allocated(slot, st, cached)
        return cached

    def free(self, slot: int) -> int:
        """Empty the slot and free its blocks; returns how many it held."""
        key, blocks = self.seqs.free(slot)
        self.vision.freed(key)
        if self.mtp_layer is not None:
            self.mtp_layer.held.pop(key, None)
        if self.hybrid is not None:
            self.hybrid.freed(slot, key)
        return blocks

    def release(self, slot: int) -> int:
        """RELEASE: offer the slot's full blocks to the prefix cache (with an MTP layer only those whose
        MTP KV was computed too), then free it; returns how many blocks it held."""
        st = self.slots.held(slot, "RELEASE")
        self.seqs.cache(slot, None if self.mtp_layer is None else self.mtp_layer.cached_upto(st.key))
        return self.free(slot)

    def fork(self, slot: int, new_slot: int) -> None:
        """FORK: occupy the empty ``new_slot`` with a copy of the prefilled sequence in ``slot``, sharing
        its full KV blocks and copying the partial last one, and its recurrent state on a hybrid model
        (docs/protocol.md, "FORK")."""
        st = self.slots.held(slot, "FORK")
        if not st.prefilled:
            raise SlotError(f"FORK slot {slot}: prefill incomplete ({st.length} of {len(st.prompt)} prompt tokens)")
        self.fork_data(slot, new_slot, self.fork_slots(slot, new_slot, st.length))

    def fork_slots(self, slot: int, new_slot: int, length: int) -> list:
        """FORK's accounting (``Sequences.fork``; rank 0 runs it while planning): the (source, copy)
        blocks whose KV ``fork_data`` copies."""
        return self.seqs.fork(slot, new_slot, length)

    def fork_data(self, slot: int, new_slot: int, copies: list) -> None:
        """FORK's data, once the parent's pass has run: the partial block's KV (and with windowed KV
        its window's), the MTP layer's held rows and a hybrid model's recurrent state, copied."""
        _copy_blocks(self, slot, copies)
        parent, child = self.slots.held(slot, "FORK"), self.slots.held(new_slot, "FORK")
        if self.mtp_layer is not None:
            self.mtp_layer.forked(parent.key, child.key)
        if self.hybrid is not None:  # a hybrid model: the recurrent state at the prompt's end, copied
            self.state.move(slot, new_slot)

    def compact(self, slot: int, new_slot: int) -> None:
        self.seqs.move(slot, new_slot)
        if self.hybrid is not None:
            self.state.move(slot, new_slot)

    def assign_owner(self, slot: int, owner: int, prompt_hidden: bool = False) -> None:
        """OWNER (dp attention): the sequence the next PREFILL puts into the empty ``slot`` lives on rank
        ``owner``; ``prompt_hidden``: its prefill chunks return every position's hidden state."""
        self.seqs.pools.assign(slot, owner, prompt_hidden, self.slots.get(slot) is not None)

    # ---- recurrent-state snapshots (DECODE_CKPT) ----------------------------------------------
    def checkpoint_words(self, slot: int, length: int | None = None) -> tuple[int, int, int, int]:
        """DECODE_CKPT's fields for a snapshot of the slot's first ``length`` tokens (default: those
        stored): (snapshot tokens, end block, session hash, adapter id) as docs/protocol.md defines them."""
        st = self.slots.held(slot, "DECODE_CKPT")
        return self.hybrid.words(st, st.length if length is None else length)

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
        self.hybrid.check(slot, st, (snapshot_tokens, end_block, session_hash, adapter_id))
        self.hybrid.save(slot, self.hybrid.row(st, snapshot_tokens))

    # ---- passes ---------------------------------------------------------------------------------
    def prefill(self, slot: int, tokens, chunk_start: int, chunk_len: int, vision_rows=None, keep_hidden=False):
        """Prefill tokens[chunk_start : chunk_start+chunk_len] of the full prompt ``tokens``.
        Returns the logits [1, V] of the chunk's last token (None when compute_logits is off);
        ``keep_hidden`` keeps the chunk's hidden states [T, D] in ``self.prefill_hidden``
        (prompt logprobs: the LM head runs over them only for the requests that ask)."""
        chunk = PrefillChunk(slot, tokens, chunk_start, chunk_len, vision_rows)
        return self._prefill_chunks([chunk], keep_hidden=keep_hidden)

    def prefill_next(self, slot: int, chunk_start: int, tokens):
        """The next chunk ``tokens`` of the prompt (and vision rows) the slot's PREFILL brought."""
        return self.prefill_group([_Next(slot, chunk_start, tokens)])

    def prefill_group(self, commands: list, vision_rows: list | None = None, keep_hidden: bool = False):
        """PREFILL / PREFILL_NEXT commands of one frame as one forward pass over all their tokens
        (docs/protocol.md, "Batched prefill"); ``vision_rows[i]``: the rows PREFILL i announced.
        Returns the logits [G, V] of each chunk's last token (None when compute_logits is off)."""
        rows = vision_rows if vision_rows is not None else [None] * len(commands)
        chunks = []
        for cmd, r in zip(commands, rows):
            if isinstance(cmd, Prefill):
                chunks.append(PrefillChunk(cmd.slot, cmd.tokens, cmd.chunk_start, cmd.chunk_len, r))
            else:
                st = self.slots.check_next_chunk(cmd.slot, cmd.chunk_start, cmd.tokens)
                chunks.append(PrefillChunk(cmd.slot, st.prompt, cmd.chunk_start, len(cmd.tokens), st.vision_rows))
        if self.cfg.mrope_section and len(chunks) > 1:  # MRoPE models: one pass per sequence
            if keep_hidden:
                raise ExecutorError("prompt logprobs of a prefill group: MRoPE models prefill one sequence per pass")
            outs = [self._prefill_chunks([c]) for c in chunks]
            return None if outs[0] is None else self.ops.xp.concatenate(outs, axis=0)
        return self._prefill_chunks(chunks, keep_hidden=keep_hidden)

    def _prefill_chunks(self, chunks: list, keep_hidden: bool = False):
        """The chunks' accounting (a worker allocates a slot's first chunk as rank 0 did), then one pass."""
        named = [c.slot for c in chunks]
        if len(set(named)) != len(named):
            raise ExecutorError(f"a prefill group names a slot twice: slots {named}")

        def allocate(c, adapter: int) -> int:
            return self.allocate(c.slot, [int(t) for t in c.tokens], adapter, c.vision_rows, max_hit=c.chunk_start)

        accounted = [self.seqs.chunk(c, allocate) for c in chunks]
        return self.passes.prefill(chunks, accounted, keep_hidden)

    def decode(self, slots: list, tokens: list, *counts):
        """One decode step: row r appends tokens[r] to slots[r] (DECODE_BATCH; under dp attention
        DECODE_DP's rows per rank too). Returns the pass's output (logits [B, V], or None)."""
        return self.passes.decode(slots, tokens, *counts)

    def decode_inputs(self, slots: list, tokens: list) -> tuple:
        """The host half of ``decode`` (``Passes.decode_inputs``; rank 0 may run the other on a thread)."""
        return self.passes.decode_inputs(slots, tokens)

    def decode_forward(self, inputs: tuple):
        """The device half of ``decode``: the forward pass of ``decode_inputs``'s batch."""
        return self.passes.decode_forward(inputs)

    def verify(self, slots: list, tokens: list, drafts: list):
        """VERIFY (``Passes.verify``): every position's output, row r's consecutive."""
        return self.passes.verify(slots, tokens, drafts)

    def verify_mtp(self, slots: list, tokens: list, counts: list):
        """VERIFY_MTP: the MTP layer drafts ``counts[r]`` tokens for row r on this rank (every rank
        computes the same), then the VERIFY of ``tokens`` and those drafts runs. Returns (drafts,
        the VERIFY's logits or None)."""
        if self.mtp_layer is None:
            raise ExecutorError("VERIFY_MTP: this rank has no MTP layer (it runs without --speculative-method mtp)")
        states = self.slots.check_verify(slots, tokens, [(0,) * int(k) for k in counts])
        lengths = np.fromiter((st.length for st in states), dtype=np.int64, count=len(states))
        counts = [int(k) for k in counts]
        self.seqs.tables(slots, states, (lengths + np.asarray(counts) + 1) // self.block_size + 1)  # MTP KV room
        drafts = self.mtp_layer.drafts(slots, states, tokens, counts)
        return drafts, self.verify(slots, tokens, drafts)

    def accept(self, slots: list, accepted: list) -> None:
        """ACCEPT: close the last VERIFY; row r keeps accepted[r] drafts, the rest of its KV rolls back
        (tokens and tail blocks beyond what the kept length needs, and their MTP rows)."""
        for _, st, dropped in self.seqs.accept(slots, accepted):
            if dropped and self.mtp_layer is not None:
                self.mtp_layer.accepted(st.key, st.length)

    def rollback(self, slot: int, n: int) -> None:
        """ROLLBACK: drop the slot's last ``n`` stored tokens (generated ones: a token the scheduler
        discarded gives its step back) and the tail blocks beyond what the kept length needs."""
        if self.hybrid is not None:
            raise ExecutorError(f"ROLLBACK on {self.cfg.model_type}: a model with recurrent state cannot roll back")
        st = self.seqs.rollback(slot, n)
        if self.mtp_layer is not None:
            self.mtp_layer.accepted(st.key, st.length)

    # ---- the job ---------------------------------------------------------------------------
    def switch_placement(self, epoch: int, table: np.ndarray) -> int:
        """EPLB_PLACEMENT (docs/eplb.md): hold the experts of ``table`` [layers, slots] from the next
        forward pass; returns how many experts were read from the checkpoint."""
        return switch_model_placement(self.model, epoch, table)

    def check_state(self, step: int, transport) -> None:
        """CHECK_STATE: this rank's digests of what it mirrors against every rank's (state_check)."""
        check_state(self, transport, step)

    def shutdown(self) -> None:
        self.slots.open_verify = None  # a run that ends mid-verify frees its slots all the same
        for slot in self.slots.occupied():
            self.free(slot)


def _copy_blocks(ex: ShardExecutor, slot: int, copies: list) -> None:
    """The KV block copies (source, destination) of the slot's sequence, where this rank holds its KV."""
    if copies and ex.seqs.pools.holds_kv(slot):
        for src, dst in copies:
            ex.kv.copy_block(src, dst)


@dataclass(frozen=True)
class _Next:
    """A PREFILL_NEXT as ``prefill_group`` takes it."""

    slot: int
    chunk_start: int
    tokens: object
