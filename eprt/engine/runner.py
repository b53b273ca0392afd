"""ModelRunner: the real model behind the scheduler's interface on rank 0.

It forwards every call to this rank's ShardExecutor and mirrors it to the worker ranks
as the broadcast frames of PROTOCOL.md. Words the scheduler emits one at a time
(``ep_broadcast_*``) are queued on the control link and flushed as one coalesced frame
right before the compute that needs them, so a decode step costs one broadcast plus
the MoE combines inside the forward pass.

B rows in a decode batch, V vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from eprt.comm import protocol as P
from eprt.engine.executor import ShardExecutor, vision_salt
from eprt.engine.sampling import make_rng, sample


@dataclass
class SeqModelState:
    """What the runner keeps on a sequence (``seq.model_state``)."""
    rng: np.random.Generator     # its sampler: a preempted sequence keeps its stream
    salt: bytes                  # prefix-cache salt of its vision rows, hashed once


class ModelRunner:
    def __init__(self, executor: ShardExecutor, link, seed: int = 0):
        self.ex = executor
        self.link = link                     # eprt.comm.transport.Transport (LocalTransport on one rank)
        self._rng = np.random.default_rng(seed)   # seeds requests that bring none
        self._logits: Optional[np.ndarray] = None   # [B, V] of the last forward
        self._rows: list = []                # the sequences behind those rows
        self.prompt_tokens_computed = 0
        self.decode_steps = 0
        self.decode_rows = 0

    # ---- start-up: launch_engine binds the GPU; ops run on its current stream ---------
    def bind_gpu_to_thread(self) -> None:
        pass

    def create_stream(self) -> int:
        return 1

    def create_event(self) -> int:
        return 2

    def adapter_id_for(self, adapter: int) -> int:
        return adapter

    def acquire_adapter_slot(self, adapter: int) -> None:
        if adapter != -1:
            raise ValueError(f"adapter {adapter} requested but this model serves no adapters")

    # ---- KV memory -------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        return self.ex.blocks.num_free_blocks()

    def _state(self, seq) -> "SeqModelState":
        """This runner's per-sequence state, made once (a preempted sequence keeps it)."""
        if seq.model_state is None:
            seq.model_state = SeqModelState(rng=make_rng(seq.params, self._rng), salt=vision_salt(seq.image_embeds))
        return seq.model_state

    def can_admit(self, seq) -> bool:
        return self.ex.blocks.can_allocate(seq.token_ids[: seq.num_prompt], seq.adapter, self._state(seq).salt)

    def alloc_sequence(self, seq) -> int:
        if seq.adapter != -1:   # PREFILL carries no adapter: workers could not mirror the allocation
            raise ValueError(f"adapter {seq.adapter} requested but this model serves no adapters")
        slot = next((s for s, st in enumerate(self.ex.slots) if st is None), None)
        if slot is None:
            raise RuntimeError("alloc_sequence with every slot occupied")
        seq.cached = self.ex.allocate(slot, seq.token_ids[: seq.num_prompt], seq.adapter, self._state(seq).salt)
        return slot

    def cache_sequence(self, seq) -> None:
        self.ex.cache(seq.slot)

    def free_sequence(self, seq) -> int:
        return self.ex.free(seq.slot)

    def compact_sequence(self, seq, new_slot: int) -> None:
        self.link.send_command(P.Compact(slot=seq.slot, new_slot=new_slot))
        self.ex.compact(seq.slot, new_slot)

    # ---- broadcast frame ---------------------------------------------------------------
    def ep_broadcast_cmd_for_seq(self, seq: int, cmd: int) -> None:
        self.link.send_words((seq, cmd))

    def ep_broadcast_cmd(self, word: int) -> None:
        self.link.send_word(word)

    def ep_broadcast_tokens(self, tokens) -> None:
        self.link.send_words(tokens)

    def ep_sync_vision_embeds(self, seq) -> None:
        self.link.send_vision(seq.image_embeds)

    def flush(self) -> None:
        self.link.flush()

    # ---- compute -------------------------------------------------------------------------
    def prefill(self, seq, start: int, n: int, stream: int = 0) -> None:
        self.flush()
        self._logits = self.ex.prefill(seq.slot, seq.token_ids[: seq.num_prompt], start, n, seq.image_embeds)
        self._rows = [seq]
        self.prompt_tokens_computed += n

    def argmax_on_device(self, row: int = 0, stream: int = 0) -> int:
        return self.argmax_batch(row, 1)[0]

    def decode_batch(self, tokens, seqs, stream: int = 0) -> None:
        slots = [s.slot for s in seqs]
        self.link.send_command(P.DecodeBatch(slots=tuple(slots), tokens=tuple(int(t) for t in tokens)))
        self.flush()
        self._logits = self.ex.decode(slots, list(tokens))
        self._rows = list(seqs)
        self.decode_steps += 1
        self.decode_rows += len(slots)

    def commit_ctx(self, seq, n: int, base: int, row: int) -> None:
        pass  # no drafter context to commit

    def argmax_batch(self, row: int = 0, n: int = 1, stream: int = 0) -> list[int]:
        """Greedy rows take one device argmax together; sampled rows come to the host in one
        copy (on a GPU, one transfer of [rows, V] rather than one per row)."""
        seqs = self._rows[row:row + n]
        logits = self._logits[row:row + n]                                   # [n, V]
        greedy = None
        if any(s.params.temperature == 0.0 for s in seqs):
            greedy = self.ex.ops.argmax(logits)
        rows = [i for i, s in enumerate(seqs) if s.params.temperature != 0.0]
        sampled = iter(self.ex.ops.to_host(logits[rows] if len(rows) < n else logits) if rows else ())  # [len(rows), V]
        return [int(greedy[i]) if s.params.temperature == 0.0 else sample(next(sampled), s.params, s.model_state.rng)
                for i, s in enumerate(seqs)]

    def decode_marconi_checkpoint(self, seq) -> None:
        pass  # no SSM layers in the supported architectures

    # ---- shutdown ----------------------------------------------------------------------
    def ep_shutdown(self) -> None:
        self.link.shutdown()

    def synchronize(self, stream: int = 0) -> None:
        self.ex.ops.synchronize()

    def teardown(self) -> None:
        self.ex.shutdown()
