"""ModelRunner: the real model behind the scheduler's interface on rank 0
(``eprt/scheduler/interface.py``), and the only writer of command frames. It is composed of
parts with one job each: ``kv``, rank 0's KV accounting, which the scheduler calls while it plans
a step (``eprt/engine/accounting.py``); ``pools``, where a sequence's KV lives (one replicated
pool, or one per owner rank under dp attention: ``eprt/engine/pools.py``); ``sampler``, the rows'
sampling (``eprt/engine/sampler.py``); ``drafts``, speculative decoding
(``eprt/engine/speculative.py``). ``execute(plan)`` writes a step's frames (each flushed right
before the forward pass that needs it: docs/protocol.md) and runs its passes on this rank's
ShardExecutor; it keeps nothing for a later call.

B rows in a decode batch, G chunks in a prefill group, V vocabulary.
"""

from __future__ import annotations

import functools

import numpy as np

from eprt.comm import protocol as P
from eprt.engine.accounting import Accounts, wants_prompt_logprobs
from eprt.engine.isolation import one_by_one
from eprt.engine.overlap import DecodeOverlap
from eprt.engine.pools import DpPools, SharedPool
from eprt.engine.sampler import RowSampler, host_sampled
from eprt.engine.sampling import LOGSOFTMAX_BLOCK, rows_logprobs
from eprt.engine.speculative import Drafter, Speculation
from eprt.scheduler.interface import RowFailure
from eprt.scheduler.step import StepPlan, StepResult

PREFILL_GROUP_TOKENS = 16384  # at most this many prompt tokens in one batched prefill forward


class FrameWriter:
    """A step's frames: each command queued on the transport and recorded in the step's result
    with the plan item that sent it."""

    def __init__(self, transport, result: StepResult):
        self.transport, self.result = transport, result

    def send(self, item, cmd, rows=None) -> None:
        self.transport.send(cmd, rows)
        self.result.frames.append((item, cmd))

    def send_words(self, item, cmd, words) -> None:
        """``cmd`` already encoded (``words``: its words)."""
        self.transport.send_words(words)
        self.result.frames.append((item, cmd))

    def flush(self) -> None:
        self.transport.flush()


class ModelRunner:
    def __init__(
        self,
        executor,
        transport,
        seed: int = 0,
        drafter: Drafter | None = None,
        batch_prefill: bool = True,
        adapters=None,
        overlap: bool = False,
        tokens=None,
    ):
        """``tokens``: the token source (default: the sampler, ``RowSampler``; the scenarios' is
        scripted, eprt/engine/scripted.py)."""
        self.executor = executor
        self.transport = transport  # eprt.comm.transport.Transport (LocalTransport on one rank)
        self.pools = (DpPools if getattr(executor, "dp", False) else SharedPool)(executor)
        self.kv = Accounts(executor, self.pools, np.random.default_rng(seed), adapters)  # seeds requests with none
        vocab = executor.cfg.vocab_size
        self.sampler = RowSampler(executor.ops, self.pools, vocab) if tokens is None else tokens  # the token source
        self.drafts = Speculation(executor, self.sampler, drafter)
        # a tick's prefill chunks as one forward (not for hybrid models: a snapshot falls between a
        # chunk's pieces; not for MRoPE models, whose 3-D positions and deepstack rows are per sequence)
        self.batch_prefill = batch_prefill and not executor.cfg.is_hybrid and not executor.cfg.mrope_section
        self.overlap = DecodeOverlap(executor, transport) if overlap else None  # --overlap (eprt/engine/overlap.py)
        self.prompt_tokens_computed = 0
        self.prefill_passes = 0  # prefill forward passes (one per group of chunks)
        self.decode_steps = 0
        self.decode_rows = 0

    @property
    def adapters(self):
        """The LoRA adapter registry (eprt/engine/adapters.py), or None: no adapters served."""
        return None if self.kv.adapters is None else self.kv.adapters.registry

    def set_guides(self, guides) -> None:
        """Structured outputs: the grammars' rows (eprt/engine/structured.GuidedRows)."""
        self.kv.guides = self.sampler.guides = guides

    # ---- a step ------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        """Send the plan's frames and run its passes, in the plan's order (eprt/scheduler/step.py)."""
        out = StepResult()
        frames = FrameWriter(self.transport, out)
        if plan.start is not None:
            for cmd in plan.start.record or ():
                frames.send(plan.start, cmd)  # LORA_UNLOAD
        for item in plan.checkpoints:
            if item.record is not None:
                frames.send(item, item.record)
        if plan.accept is not None:
            accepted = tuple(n - 1 for n in plan.accept.kept)
            frames.send(plan.accept, P.Accept(tuple(r.slot for r in plan.accept.rows), accepted))
        for item in plan.rollbacks:
            frames.send(item, P.Rollback(item.row.slot, item.n))
        for item in plan.all_releases():
            frames.send(item, P.Release(item.row.slot))
        for group in self._groups(plan.chunks):
            self._prefill(group, frames, out)
        if plan.decode is not None:
            self.executor.seqs.check_lengths(plan.decode.rows)
            out.tokens = self._decode(plan.decode, frames, out)
        if plan.verify is not None:
            self.executor.seqs.check_lengths(plan.verify.rows)
            out.emitted = self.drafts.verify(plan.verify, frames)
            self.decode_steps += 1
            self.decode_rows += len(plan.verify.rows)
        for item in plan.compactions:
            frames.send(item, P.Compact(slot=item.row.slot, new_slot=item.target))
        if plan.shutdown:
            self._shutdown(plan, out)
        return out

    # ---- prefill ---------------------------------------------------------------------------
    def _groups(self, chunks: tuple) -> list:
        """The chunks as forward passes: (index, chunk) runs of at most PREFILL_GROUP_TOKENS tokens.
        A run ends after a PREFILL announcing vision rows (its frame is flushed with it), after a
        chunk with forks (FORK ends a worker's run), before an admission with an adapter (its
        SLOT_ADAPTER does), and after every chunk without batched prefill."""
        groups, group, size = [], [], 0
        for i, chunk in enumerate(chunks):
            adapter = chunk.admission is not None and chunk.row.seq.adapter != -1
            if group and (size + chunk.n > PREFILL_GROUP_TOKENS or adapter):
                groups.append(group)
                group, size = [], 0
            group.append((i, chunk))
            size += chunk.n
            vision = chunk.admission is not None and chunk.row.seq.image_embeds is not None
            if not self.batch_prefill or chunk.forks or (vision and len(chunk.row.seq.image_embeds)):
                groups.append(group)
                group, size = [], 0
        return groups + ([group] if group else [])

    def _prefill(self, group: list, frames: FrameWriter, out: StepResult) -> None:
        """One run of prefill chunks: their admissions' frames, then their PREFILL / PREFILL_NEXT
        frames flushed together and one forward pass (a hybrid model's chunk: a pass per piece, a
        DECODE_CKPT between them); then their forks, their prompt logprobs, their first tokens."""
        for _, chunk in group:
            self._admission_frames(chunk, frames)
        if len(group) == 1 and any(p.snapshot is not None for p in group[0][1].record or ()):
            logits = self._pieces(group[0][1], frames, out)
        else:
            logits = self._run_group([(c, c.row.length, c.n) for _, c in group], frames, out)
        for g, (i, chunk) in enumerate(group):
            for fork in chunk.forks:
                frames.send(fork, P.Fork(chunk.row.slot, fork.slot))
                self.executor.fork_data(chunk.row.slot, fork.slot, fork.record)
            if chunk.last:
                seqs = [chunk.row.seq] + [f.child for f in chunk.forks]
                out.first[i] = self.sampler.draw(seqs, logits, [g] * len(seqs), [chunk.end] * len(seqs), out)
            self.prompt_tokens_computed += chunk.n

    def _admission_frames(self, chunk, frames: FrameWriter) -> None:
        """OWNER (dp attention), LORA_LOAD and SLOT_ADAPTER (an adapter) ahead of an admission's PREFILL."""
        adm = chunk.admission
        if adm is None:
            return
        for cmd in (*self.pools.owner_frames(adm), *adm.record.adapter_frames):
            frames.send(chunk, cmd)

    def _pieces(self, chunk, frames: FrameWriter, out: StepResult):
        """A hybrid model's chunk, a pass per piece, its state saved into each snapshot row taken
        when the chunk was planned (DECODE_CKPT). Returns the last piece's logits."""
        logits = None
        for piece in chunk.record:
            if piece.n:
                logits = self._run_group([(chunk, piece.start, piece.n)], frames, out)
            if piece.snapshot is not None:
                frames.send(chunk, piece.snapshot)
                self.executor.hybrid.save(chunk.row.slot, piece.row)
        return logits

    def _run_group(self, parts: list, frames: FrameWriter, out: StepResult):
        """Send the (chunk, start, n) parts' PREFILL / PREFILL_NEXT frames, flush once, run them as one
        forward; their prompt logprobs go into ``out``. Returns the pass's output (logits [G, V])."""
        commands, rows = [], []
        for chunk, start, n in parts:
            seq, slot = chunk.row.seq, chunk.row.slot
            prompt, vision = tuple(seq.token_ids[: chunk.prompt_len]), seq.image_embeds
            if start == seq.cached:  # the slot's first chunk: the whole prompt and its vision rows, once
                cmd = P.Prefill(slot, start, n, prompt, 0 if vision is None else len(vision))
                rows.append(vision)
            else:
                cmd = P.PrefillNext(slot, start, prompt[start : start + n])
                rows.append(None)
            frames.send(chunk, cmd, rows[-1])
            commands.append(cmd)
        frames.flush()
        keep = [wants_prompt_logprobs(c.row.seq) for c, _, _ in parts]
        logits = self.executor.prefill_group(commands, rows, keep_hidden=any(keep))
        self.prefill_passes += 1
        offset = 0
        for (chunk, start, n), k in zip(parts, keep):
            if k and chunk.row.seq.model_state.failure is None:
                self._prompt_logprobs(chunk, start, n, self.executor.prefill_hidden[offset : offset + n], out)
            offset += n
        self.executor.prefill_hidden = None
        return logits

    def _prompt_logprobs(self, chunk, start: int, n: int, hidden, out: StepResult) -> None:
        """The raw logprobs of prompt tokens start+1 .. start+n (those inside the prompt) from the
        chunk's hidden states [n, D], LOGSOFTMAX_BLOCK positions per LM-head call; a failure fails
        the row at its first token."""
        seq = chunk.row.seq
        hidden = self.pools.prompt_hidden(chunk.row.slot, hidden)

        def compute(_) -> list:
            have = 1 if seq.prompt_logprobs is None else len(seq.prompt_logprobs)  # [None, ...] so far
            last = min(start + n, len(seq.prompt_ids) - 1)  # positions whose next token is a prompt token
            first = max(start, have - 1)  # a prefill redone after a preemption: only new ones
            records = []
            for a in range(first, last, LOGSOFTMAX_BLOCK):
                b = min(a + LOGSOFTMAX_BLOCK, last)
                logits = self.executor.ops.to_host(self.executor.model.logits(hidden[a - start : b - start]))
                targets = seq.prompt_ids[a + 1 : b + 1]
                records.extend(rows_logprobs(logits, targets, [seq.params.prompt_logprobs] * (b - a)))
            return records

        (done,) = one_by_one([chunk], compute, "prompt logprobs")
        if isinstance(done, RowFailure):
            seq.model_state.failure = done
        else:
            out.prompt_logprobs[seq.seq_id] = done

    # ---- decode -----------------------------------------------------------------------------
    def _decode(self, step, frames: FrameWriter, out: StepResult) -> list:
        """One decode step: its frame, its pass (launched under --overlap while the rows' sampling
        is planned), then its rows' tokens."""
        started = self.drafts.clock()
        seqs, slots = [r.seq for r in step.rows], tuple(r.slot for r in step.rows)
        tokens, positions = tuple(int(t) for t in step.tokens), [r.length + 1 for r in step.rows]
        plan = None
        if self.overlap is not None:  # the pass runs on while the rows' sampling is planned
            slow = [i for i, s in enumerate(seqs) if host_sampled(s)]  # planning worth a thread hand-off
            planner = functools.partial(self.sampler.plan, positions=positions, slow=slow)
            self.overlap.decode(frames, step, slots, tokens, seqs, planner, thread=bool(slow))
            plan = self.overlap.plan_of(seqs, 0, len(seqs))
            logits = self.overlap.logits()
        else:
            cmd = self.pools.decode_command(slots, tokens)
            frames.send(step, cmd)
            frames.flush()
            logits = self.executor.decode(*_decode_args(cmd))
        self.decode_steps += 1
        self.decode_rows += len(slots)
        picked = self.sampler.draw(seqs, logits, slice(None), positions, out, plan)
        if self.drafts.step_costs is not None:
            self.drafts.step_costs.decode_step(len(slots), self.drafts.clock() - started)
        return picked

    # ---- between steps (the engine's) and shutdown ---------------------------------------------
    def switch_placement(self, epoch: int, table: np.ndarray) -> int:
        """EPLB: every rank holds the experts of ``table`` [layers, slots] from the next forward pass
        (EPLB_PLACEMENT goes out with that pass's frame); returns the experts rank 0 read."""
        layers, slots = table.shape
        self.transport.send(P.EplbPlacement(epoch, layers, slots, tuple(int(v) for v in table.ravel())))
        return self.executor.switch_placement(epoch, table)

    def check_state(self, step: int) -> None:
        """CHECK_STATE after a step (``--check-state``): every rank compares its mirrored state's digests."""
        step &= P.WORD_MAX
        self.transport.send(P.CheckState(step))
        self.transport.flush()
        self.executor.check_state(step, self.transport)

    def mean_accepted_length(self) -> float:
        """Tokens emitted per row that had drafts (accepted drafts + 1), over every verify step."""
        rows = self.drafts.verify_rows
        return (rows + self.kv.accepted_tokens) / rows if rows else 0.0

    def _shutdown(self, plan: StepPlan, out: StepResult) -> None:
        """SHUTDOWN to the workers, then this rank's device work ends and everything is freed."""
        out.frames.append((plan, P.Shutdown()))
        self.transport.shutdown()
        self.executor.ops.synchronize()
        if self.overlap is not None:
            self.overlap.close()
        self.executor.shutdown()


def _decode_args(cmd) -> tuple:
    """The executor's decode call for a DECODE_BATCH or DECODE_DP."""
    if isinstance(cmd, P.DecodeDp):
        return list(cmd.slots), list(cmd.tokens), list(cmd.counts)
    return list(cmd.slots), list(cmd.tokens)
