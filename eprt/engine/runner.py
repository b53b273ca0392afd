"""ModelRunner: the real model behind the scheduler's interface on rank 0, and the only
writer of command frames: each call runs on this rank's ShardExecutor and queues the
matching frame, flushed right before the forward pass that needs it (docs/protocol.md).

B rows in a decode batch, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from eprt.comm import protocol as P
from eprt.engine.executor import ShardExecutor, vision_salt
from eprt.engine.sampling import (
    LOGSOFTMAX_BLOCK,
    History,
    request_seed,
    rows_logprobs,
    sample_on_device,
    sample_processed,
    sample_rows,
    token_uniform,
)
from eprt.scheduler.interface import TraceCalls


@dataclass
class SeqModelState:
    """What the runner keeps on a sequence (``seq.model_state``)."""

    seed: int  # its sampling key: token p's draw is token_uniform(seed, p), whatever the batch
    salt: bytes  # prefix-cache salt of its vision rows, hashed once
    checkpoints: tuple = ()  # hybrid models: token counts at which this admission's prefill snapshots
    history: History | None = None  # penalties and bad words: the prompt's ids and the generated counts


def wants_prompt_logprobs(seq) -> bool:
    """Whether the sequence asks for prompt logprobs it does not have yet (then its prompt is
    computed whole: no prefix-cache hit, and the LM head runs over every prompt position)."""
    return seq.params.prompt_logprobs is not None and (
        seq.prompt_logprobs is None or len(seq.prompt_logprobs) < len(seq.prompt_ids)
    )


class ModelRunner(TraceCalls):
    def __init__(self, executor: ShardExecutor, transport, seed: int = 0):
        self.executor = executor
        self.transport = transport  # eprt.comm.transport.Transport (LocalTransport on one rank)
        self._rng = np.random.default_rng(seed)  # seeds requests that bring none
        self._logits: np.ndarray | None = None  # [B, V] of the last forward
        self._rows: list = []  # the sequences behind those rows
        self.prompt_tokens_computed = 0
        self.decode_steps = 0
        self.decode_rows = 0
        self.eos_token_ids: tuple = ()  # min_tokens holds these back (the engine sets the model's)
        self.logprobs_mode = "raw"  # raw | processed (eprt.engine.sampling.LOGPROB_MODES)
        # Structured outputs: seq -> allowed-token mask bool [V] (True: allowed) or None; applied
        # before penalties and sampling (eprt.engine.sampling.process_logits).
        self.token_mask_for: Callable[[object], np.ndarray | None] | None = None

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
        return self.executor.blocks.can_allocate(
            seq.token_ids[: seq.num_prompt], seq.adapter, self._state(seq).salt, max_hit=self._max_hit(seq)
        )

    @staticmethod
    def _max_hit(seq) -> int | None:
        return 0 if wants_prompt_logprobs(seq) else None

    def alloc_sequence(self, seq) -> int:
        if seq.adapter != -1:  # PREFILL carries no adapter: workers could not mirror the allocation
            raise ValueError(f"adapter {seq.adapter} requested but this model serves no adapters")
        slot = self.executor.slots.lowest_free()
        if slot is None:
            raise RuntimeError("alloc_sequence with every slot occupied")
        seq.cached = self.executor.allocate(
            slot,
            seq.token_ids[: seq.num_prompt],
            seq.adapter,
            seq.image_embeds,
            self._state(seq).salt,
            max_hit=self._max_hit(seq),
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
            self.transport.send(P.Prefill(seq.slot, start, n, prompt, 0 if rows is None else len(rows)), rows)
        else:
            self.transport.send(P.PrefillNext(seq.slot, start, prompt[start : start + n]))
        self.transport.flush()
        keep = wants_prompt_logprobs(seq)
        self._logits = self.executor.prefill(seq.slot, prompt, start, n, rows, keep_hidden=keep)
        if keep:
            self._prompt_logprobs(seq, start, n)

    def _prompt_logprobs(self, seq, start: int, n: int) -> None:
        """Raw logprobs of prompt tokens start+1 .. start+n (those inside the prompt) from the
        chunk's hidden states, LOGSOFTMAX_BLOCK positions per LM-head call."""
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None]  # the first token has no context
        hidden, ops = self.executor.prefill_hidden, self.executor.ops
        last = min(start + n, len(seq.prompt_ids) - 1)  # positions whose next token is a prompt token
        first = max(start, len(seq.prompt_logprobs) - 1)  # a prefill redone after a preemption: only new ones
        for a in range(first, last, LOGSOFTMAX_BLOCK):
            b = min(a + LOGSOFTMAX_BLOCK, last)
            logits = ops.to_host(self.executor.model.logits(hidden[a - start : b - start]))  # [b - a, V]
            targets = seq.prompt_ids[a + 1 : b + 1]
            seq.prompt_logprobs.extend(rows_logprobs(logits, targets, [seq.params.prompt_logprobs] * (b - a)))
        self.executor.prefill_hidden = None

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
        """Plain greedy rows take one device argmax together; the others (sampled, processed,
        masked or asking for logprobs) come to the host in one copy (on a GPU, one transfer of
        [rows, V] rather than one per row) and are sampled together, each with the uniform of
        its request's seed at the token's position. Logprobs go to ``seq.logprobs``."""
        seqs = self._rows[row : row + n]
        logits = self._logits[row : row + n]  # [n, V]
        masks = [None] * len(seqs) if self.token_mask_for is None else [self.token_mask_for(s) for s in seqs]
        slow = [i for i, s in enumerate(seqs) if _off_fast_path(s.params) or masks[i] is not None]
        tokens = [0] * len(seqs)
        if len(slow) < len(seqs):
            greedy = self.executor.ops.argmax(logits)
            tokens = [int(t) for t in greedy]
        if slow:
            picked = [seqs[i] for i in slow]
            uniforms = np.array(
                [token_uniform(s.model_state.seed, self.executor.slots.get(s.slot).length) for s in picked]
            )
            for i, t in zip(slow, self._sample_slow(logits, slow, picked, [masks[i] for i in slow], uniforms)):
                tokens[i] = t
        return tokens

    def _sample_slow(self, logits, rows: list, seqs: list, masks: list, uniforms: np.ndarray) -> list[int]:
        """Tokens of logits rows ``rows`` (sequences ``seqs``): on the host, or with the logits
        processing and the draw on the device (GPU backends: only rows with a top-k / top-p cut
        and rows asking for logprobs come to the host)."""
        ops, params = self.executor.ops, [s.params for s in seqs]
        whole = rows if len(rows) < logits.shape[0] else slice(None)
        plain = all(p.logprobs is None and not p.processes_logits for p in params) and all(m is None for m in masks)
        if plain and ops.name == "cpu":
            return sample_rows(ops.to_host(logits[whole]), params, uniforms)  # temperature / top-k / top-p only
        histories = [self._history(s) if s.params.processes_logits else None for s in seqs]
        if ops.name == "cpu":
            tokens, records = sample_processed(
                ops.to_host(logits[whole]), params, uniforms, histories, self.eos_token_ids, masks, self.logprobs_mode
            )
        else:
            tokens, records = sample_on_device(
                ops, logits, rows, params, uniforms, histories, self.eos_token_ids, masks, self.logprobs_mode
            )
        for s, rec in zip(seqs, records):
            if rec is not None:
                if s.logprobs is None:
                    s.logprobs = []
                s.logprobs.append(rec)
        return tokens

    def _history(self, seq) -> History:
        state = self._state(seq)
        if state.history is None:
            state.history = History.of(seq.prompt_ids)
        return state.history.sync(seq.output_ids)

    # ---- shutdown ----------------------------------------------------------------------
    def ep_shutdown(self) -> None:
        self.transport.shutdown()

    def synchronize(self, stream: int = 0) -> None:
        self.executor.ops.synchronize()

    def teardown(self) -> None:
        self.executor.shutdown()


def _off_fast_path(params) -> bool:
    """Whether a row needs the host sampler: sampled, processed logits or logprobs."""
    return params.temperature != 0.0 or params.logprobs is not None or params.processes_logits
