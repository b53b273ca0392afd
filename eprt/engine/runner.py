"""ModelRunner: the real model behind the scheduler's interface on rank 0, and the only
writer of command frames: each call runs on this rank's ShardExecutor and queues the
matching frame, flushed right before the forward pass that needs it (docs/protocol.md).

B rows in a decode batch, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eprt.comm import protocol as P
from eprt.engine import adapter_slots
from eprt.engine.executor import ShardExecutor, vision_salt
from eprt.engine.sampling import request_seed, sample_rows, token_uniform
from eprt.scheduler.interface import TraceCalls


@dataclass
class SeqModelState:
    """What the runner keeps on a sequence (``seq.model_state``)."""

    seed: int  # its sampling key: token p's draw is token_uniform(seed, p), whatever the batch
    salt: bytes  # prefix-cache salt of its vision rows, hashed once
    checkpoints: tuple = ()  # hybrid models: token counts at which this admission's prefill snapshots


class ModelRunner(TraceCalls):
    def __init__(self, executor: ShardExecutor, transport, seed: int = 0, adapters=None):
        self.executor = executor
        self.adapters = adapters  # eprt.engine.adapters.AdapterRegistry, or None: no adapters served
        self.transport = transport  # eprt.comm.transport.Transport (LocalTransport on one rank)
        self._rng = np.random.default_rng(seed)  # seeds requests that bring none
        self._logits: np.ndarray | None = None  # [B, V] of the last forward
        self._rows: list = []  # the sequences behind those rows
        self.prompt_tokens_computed = 0
        self.decode_steps = 0
        self.decode_rows = 0

    # ---- KV memory -------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        return self.executor.blocks.num_free_blocks()

    def _state(self, seq) -> SeqModelState:
        """This runner's per-sequence state, made once (a preempted sequence keeps it)."""
        if seq.model_state is None:
            seq.model_state = SeqModelState(
                seed=request_seed(seq.params, self._rng), salt=vision_salt(seq.image_embeds)
            )
        return seq.model_state

    def can_admit(self, seq) -> bool:
        if seq.adapter != -1 and not adapter_slots.can_place(self, seq.adapter):
            return False  # every LoRA slot holds an adapter running sequences use
        return self.executor.blocks.can_allocate(seq.token_ids[: seq.num_prompt], seq.adapter, self._state(seq).salt)

    def alloc_sequence(self, seq) -> int:
        if seq.adapter != -1 and self.adapters is None:
            raise ValueError(f"adapter {seq.adapter} requested but this engine serves no adapters (--max-loras 0)")
        slot = self.executor.slots.lowest_free()
        if slot is None:
            raise RuntimeError("alloc_sequence with every slot occupied")
        seq.cached = self.executor.allocate(
            slot, seq.token_ids[: seq.num_prompt], seq.adapter, seq.image_embeds, self._state(seq).salt
        )
        self._state(seq).checkpoints = self.executor.prefill_checkpoints(slot)
        return slot

    def cache_sequence(self, seq) -> None:
        self.executor.cache(seq.slot)

    def free_sequence(self, seq) -> int:
        blocks = self.executor.free(seq.slot)
        self.transport.send(P.Release(seq.slot))
        return blocks

    def compact_sequence(self, seq, new_slot: int) -> None:
        self.executor.compact(seq.slot, new_slot)
        self.transport.send(P.Compact(slot=seq.slot, new_slot=new_slot))

    # ---- compute -------------------------------------------------------------------------
    def prefill(self, seq, start: int, n: int, stream: int = 0) -> None:
        """The chunk [start, start + n), split where a hybrid model snapshots its state (DECODE_CKPT
        between the pieces): the scheduler sees one chunk, the workers the same pieces as rank 0."""
        end, piece = start + n, start
        for stop in sorted({p for p in self._state(seq).checkpoints if start < p <= end} | {end}):
            if stop > piece:
                self._prefill_piece(seq, piece, stop - piece)
            if stop in self._state(seq).checkpoints:
                self._checkpoint(seq.slot)
            piece = stop
        self._rows = [seq]
        self.prompt_tokens_computed += n

    def _prefill_piece(self, seq, start: int, n: int) -> None:
        prompt, rows = tuple(seq.token_ids[: seq.num_prompt]), seq.image_embeds
        if start == seq.cached:  # the slot's first chunk: the whole prompt and its vision rows, once
            if seq.adapter != -1:
                self.transport.send(P.SlotAdapter(seq.slot, self.executor.lora.slot_of(seq.adapter)))
            self.transport.send(P.Prefill(seq.slot, start, n, prompt, 0 if rows is None else len(rows)), rows)
        else:
            self.transport.send(P.PrefillNext(seq.slot, start, prompt[start : start + n]))
        self.transport.flush()
        self._logits = self.executor.prefill(seq.slot, prompt, start, n, rows)

    def _checkpoint(self, slot: int) -> None:
        """Snapshot the slot's recurrent state here and on every worker (sent with the next frame)."""
        tokens, end_block, session, adapter = self.executor.checkpoint_words(slot)
        self.transport.send(P.DecodeCkpt(slot, tokens, end_block, session, adapter))
        self.executor.checkpoint(slot, tokens, end_block, session, adapter)

    def decode_marconi_checkpoint(self, seq) -> None:
        """After an accepted token: a hybrid model snapshots at each block boundary decoding reaches,
        the latest replacing the sequence's previous one (its turn end survives)."""
        if self.executor.checkpoint_due(seq.slot):
            self._checkpoint(seq.slot)

    def argmax_on_device(self, row: int = 0, stream: int = 0) -> int:
        return self.argmax_batch(row, 1)[0]

    def decode_batch(self, tokens, seqs, stream: int = 0) -> None:
        slots = [s.slot for s in seqs]
        self.transport.send(P.DecodeBatch(slots=tuple(slots), tokens=tuple(int(t) for t in tokens)))
        self.transport.flush()
        self._logits = self.executor.decode(slots, list(tokens))
        self._rows = list(seqs)
        self.decode_steps += 1
        self.decode_rows += len(slots)

    def argmax_batch(self, row: int = 0, n: int = 1, stream: int = 0) -> list[int]:
        """Greedy rows take one device argmax together; sampled rows come to the host in one
        copy (on a GPU, one transfer of [rows, V] rather than one per row) and are sampled
        together, each with the uniform of its request's seed at the token's position."""
        seqs = self._rows[row : row + n]
        logits = self._logits[row : row + n]  # [n, V]
        sampled = [i for i, s in enumerate(seqs) if s.params.temperature != 0.0]
        tokens = [0] * len(seqs)
        if len(sampled) < len(seqs):
            greedy = self.executor.ops.argmax(logits)
            tokens = [int(t) for t in greedy]
        if sampled:
            host = self.executor.ops.to_host(logits[sampled] if len(sampled) < len(seqs) else logits)  # [m, V]
            picked = [seqs[i] for i in sampled]
            uniforms = np.array(
                [token_uniform(s.model_state.seed, self.executor.slots.get(s.slot).length) for s in picked]
            )
            for i, t in zip(sampled, sample_rows(host, [s.params for s in picked], uniforms)):
                tokens[i] = t
        return tokens

    # ---- LoRA adapters (eprt/engine/adapter_slots.py) -----------------------------------------
    def acquire_adapter_slot(self, adapter: int) -> None:
        """Load the admitted sequence's adapter into a LoRA slot here and on every worker (LORA_LOAD)."""
        if adapter != -1:
            adapter_slots.acquire(self, adapter)

    def adapter_id_for(self, adapter: int) -> int:
        """Once per planning step (-1): empty the slots of adapters unregistered since (LORA_UNLOAD)."""
        if adapter == -1 and self.adapters is not None:
            adapter_slots.unload_orphans(self)
        return adapter

    # ---- shutdown ----------------------------------------------------------------------
    def ep_shutdown(self) -> None:
        self.transport.shutdown()

    def synchronize(self, stream: int = 0) -> None:
        self.executor.ops.synchronize()

    def teardown(self) -> None:
        self.executor.shutdown()
