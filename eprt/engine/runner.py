"""ModelRunner: the real model behind the scheduler's interface on rank 0, and the only
writer of command frames: each call runs on this rank's ShardExecutor and queues the
matching frame, flushed right before the forward pass that needs it (docs/protocol.md).

B rows in a decode batch, V vocabulary.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from eprt.comm import protocol as P
from eprt.engine import adapter_slots
from eprt.engine.choices import choice_seed, token_logprobs
from eprt.engine.executor import ShardExecutor, vision_salt
from eprt.engine.isolation import one_by_one, per_row
from eprt.engine.overlap import DecodeOverlap
from eprt.engine.sampling import (
    LOGSOFTMAX_BLOCK,
    History,
    RowMasks,
    checked,
    request_seed,
    rows_logprobs,
    sample_on_device,
    sample_processed,
    sample_rows,
    token_uniform,
)
from eprt.engine.speculative import Drafter, SpeculativeRunner
from eprt.engine.structured import GuidedRows
from eprt.engine.thinking_masks import row_bits, skips_grammar
from eprt.scheduler import thinking
from eprt.scheduler.interface import RowFailure, TraceCalls
from eprt.scheduler.speculation import StepCosts

PREFILL_GROUP_TOKENS = 16384  # at most this many prompt tokens in one batched prefill forward


@dataclass
class SeqModelState:
    """What the runner keeps on a sequence (``seq.model_state``)."""

    seed: int  # its sampling key: token p's draw is token_uniform(seed, p), whatever the batch
    salt: bytes  # prefix-cache salt of its vision rows, hashed once
    checkpoints: tuple = ()  # hybrid models: token counts at which this admission's prefill snapshots
    matcher: object = None  # structured outputs: its grammar's llguidance matcher (eprt/engine/structured.py)
    held: tuple | None = None  # (slot, cached) allocated by admit_ahead for this tick's alloc_sequence
    history: History | None = None  # penalties and bad words: the prompt's ids and the generated counts
    failure: RowFailure | None = None  # its grammar's matcher or its prompt logprobs failed: its next token is this


class SamplingPlan(NamedTuple):
    """What sampling rows takes before their logits (``ModelRunner._sampling_plan``)."""

    guided: list  # rows whose grammar masks them (each host-sampled)
    masks: RowMasks | None  # their grammars' bitmasks, over positions in ``slow``
    slow: list  # host-sampled rows
    uniforms: np.ndarray  # [len(slow)] each request's seed at the row's position
    failed: dict  # row -> RowFailure: a stage before the logits failed for that request


def wants_prompt_logprobs(seq) -> bool:
    """Whether the sequence asks for prompt logprobs it does not have yet (then its prompt is
    computed whole: no prefix-cache hit, and the LM head runs over every prompt position)."""
    return seq.params.prompt_logprobs is not None and (
        seq.prompt_logprobs is None or len(seq.prompt_logprobs) < len(seq.prompt_ids)
    )


class ModelRunner(SpeculativeRunner, TraceCalls):
    def __init__(
        self,
        executor: ShardExecutor,
        transport,
        seed: int = 0,
        drafter: Drafter | None = None,
        batch_prefill: bool = True,
        adapters=None,
        overlap: bool = False,
    ):
        self.executor = executor
        self.adapters = adapters  # eprt.engine.adapters.AdapterRegistry, or None: no adapters served
        self.transport = transport  # eprt.comm.transport.Transport (LocalTransport on one rank)
        # a tick's prefill chunks as one forward (not for hybrid models: their snapshots are taken
        # between one sequence's prefill and the next one's allocation; not for MRoPE models, whose
        # 3-D positions and deepstack rows are per sequence)
        self.batch_prefill = batch_prefill and not executor.cfg.is_hybrid and not executor.cfg.mrope_section
        self._groups: list = []  # the lane's planned chunks not yet run, in forward-pass groups
        self._ran: dict = {}  # id(seq) -> (start, n, logits [G, V], row) of chunks run ahead of their call
        self._rng = np.random.default_rng(seed)  # seeds requests that bring none
        self.overlap = DecodeOverlap(executor, transport) if overlap else None  # --overlap (eprt/engine/overlap.py)
        self._logits: np.ndarray | None = None  # [B, V] of the last forward
        self._rows: list = []  # the sequences behind those rows
        self.prompt_tokens_computed = 0
        self.prefill_passes = 0  # prefill forward passes (one per group of chunks)
        self.decode_steps = 0
        self.decode_rows = 0
        self.drafter = drafter  # speculative decoding (eprt/engine/speculative.py); None: off
        self.step_costs = None if drafter is None else StepCosts()  # what a draft position costs here
        if drafter is not None and drafter.in_pass:
            executor.step_clock = self._step_clock  # the MTP layer's catch-up, timed apart (verify_readback)
        self.guides: GuidedRows | None = None  # structured outputs (set by launch_engine)
        self.eos_token_ids: tuple = ()  # min_tokens holds these back (the engine sets the model's)
        self.logprobs_mode = "raw"  # raw | processed (eprt.engine.sampling.LOGPROB_MODES)

    # ---- KV memory -------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        return self.executor.blocks.num_free_blocks()

    def _state(self, seq) -> SeqModelState:
        """This runner's per-sequence state, made once (a preempted sequence keeps it)."""
        if seq.model_state is None:
            seed = choice_seed(request_seed(seq.params, self._rng), seq.choice)
            seq.model_state = SeqModelState(seed=seed, salt=vision_salt(seq.image_embeds))
            if seq.params.guide is not None:  # compiled at submit; a matcher that fails fails its row
                (matcher,) = one_by_one(
                    [seq.params.guide], self.guides.compiler.matcher, "the structured-output grammar"
                )
                if isinstance(matcher, RowFailure):
                    seq.model_state.failure = matcher
                else:
                    seq.model_state.matcher = matcher
        return seq.model_state

    def can_admit(self, seq) -> bool:
        if self._state(seq).held is not None:
            return True
        if self.executor.slots.lowest_free() is None:
            return False  # every slot taken (by running sequences, forks, or the lane's plan)
        if seq.adapter != -1 and not adapter_slots.can_place(self, seq.adapter):
            return False  # every LoRA slot holds an adapter running sequences use
        return self._room_for(seq)

    def _room_for(self, seq) -> bool:
        """Whether the KV pool has the blocks for seq's prompt."""
        return self.executor.blocks.can_allocate(
            seq.token_ids[: seq.num_prompt], seq.adapter, self._state(seq).salt, max_hit=self._max_hit(seq)
        )

    @staticmethod
    def _max_hit(seq) -> int | None:
        return 0 if wants_prompt_logprobs(seq) else None

    def admit_ahead(self, seq) -> int | None:
        """Untraced, for the lane's plan: if ``can_admit``, allocate now what this tick's
        ``alloc_sequence(seq)`` will return, and give the cached length; None otherwise."""
        if not self.batch_prefill or seq.adapter != -1 or self.executor.slots.lowest_free() is None:
            return None
        if not self.can_admit(seq):
            return None
        state = self._state(seq)
        if state.held is None:
            state.held = (self._allocate(seq), seq.cached)
        return state.held[1]

    def alloc_sequence(self, seq) -> int:
        state = self._state(seq)
        if state.held is not None:
            (slot, seq.cached), state.held = state.held, None
            return slot
        return self._allocate(seq)

    def _allocate(self, seq) -> int:
        if seq.adapter != -1 and self.adapters is None:
            raise ValueError(f"adapter {seq.adapter} requested but this engine serves no adapters (--max-loras 0)")
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

    def can_fork(self, seq) -> bool:
        return self.executor.can_fork(seq.slot)

    def fork_sequence(self, seq, child) -> int:
        """FORK child off the just-prefilled seq; the last prefill's logits gain child's row."""
        slot = self.executor.slots.lowest_free()
        if slot is None:
            raise RuntimeError("fork_sequence with every slot occupied")
        self.executor.fork(seq.slot, slot)
        self.transport.send(P.Fork(seq.slot, slot))
        parent = self._state(seq)  # choice 0: its seed is the request's key
        child.model_state = SeqModelState(
            seed=choice_seed(parent.seed, child.choice), salt=parent.salt, failure=parent.failure
        )
        if parent.matcher is not None:  # the fork's grammar state starts where the parent's is: the prompt's end
            child.model_state.matcher = parent.matcher.deep_copy()
        self._rows.append(child)
        self._logits = self._logits[[0] * len(self._rows)]  # [rows, V]: the prompt's row for each
        return slot

    def compact_sequence(self, seq, new_slot: int) -> None:
        self.executor.compact(seq.slot, new_slot)
        self.transport.send(P.Compact(slot=seq.slot, new_slot=new_slot))

    # ---- compute -------------------------------------------------------------------------
    def plan_prefills(self, chunks: list) -> None:
        """Untraced: the (seq, start, n) chunks this tick's prefill lane will run, in call order
        (a waiting sequence among them was allocated by ``admit_ahead``). They run as one forward
        pass at the first of their ``prefill`` calls; a group ends after a PREFILL announcing
        vision rows (its frame is flushed with it) and at PREFILL_GROUP_TOKENS tokens."""
        self._groups, self._ran, group, size = [], {}, [], 0
        if not self.batch_prefill:
            return
        for seq, start, n in chunks:
            if group and size + n > PREFILL_GROUP_TOKENS:
                self._groups.append(group)
                group, size = [], 0
            group.append((seq, start, n))
            size += n
            if start == self._slot_and_cached(seq)[1] and seq.image_embeds is not None and len(seq.image_embeds):
                self._groups.append(group)
                group, size = [], 0
        if group:
            self._groups.append(group)

    def prefill(self, seq, start: int, n: int, stream: int = 0) -> None:
        """The chunk [start, start + n), split where a hybrid model snapshots its state (DECODE_CKPT
        between the pieces): the scheduler sees one chunk, the workers the same pieces as rank 0.
        A planned chunk runs with its group (``plan_prefills``), at the group's first call."""
        if self.batch_prefill:
            self._prefill_batched(seq, start, n)
        else:
            end, piece = start + n, start
            for stop in sorted({p for p in self._state(seq).checkpoints if start < p <= end} | {end}):
                if stop > piece:
                    self._run_group([(seq, piece, stop - piece)])
                if stop in self._state(seq).checkpoints:
                    self._checkpoint(seq.slot)
                piece = stop
            self._logits = self._ran.pop(id(seq))[2]
        self._rows = [seq]
        self.prompt_tokens_computed += n

    def _prefill_batched(self, seq, start: int, n: int) -> None:
        while id(seq) not in self._ran and any(s is seq for g in self._groups for s, _, _ in g):
            self._run_group(self._groups.pop(0))
        if id(seq) not in self._ran:  # not planned: alone
            self._run_group([(seq, start, n)])
        ran_start, ran_n, logits, row = self._ran.pop(id(seq))
        if (ran_start, ran_n) != (start, n):
            raise RuntimeError(
                f"prefill of s{seq.seq_id} [{start}, {start + n}) differs from the lane's plan "
                f"[{ran_start}, {ran_start + ran_n}), already run"
            )
        self._logits = logits[row : row + 1]

    def _slot_and_cached(self, seq) -> tuple[int, int]:
        held = self._state(seq).held
        return held if held is not None else (seq.slot, seq.cached)

    def _run_group(self, chunks: list) -> None:
        """Send the chunks' PREFILL / PREFILL_NEXT frames, flush once, run them as one forward."""
        commands, rows = [], []
        for seq, start, n in chunks:
            slot, cached = self._slot_and_cached(seq)
            prompt, vision = tuple(seq.token_ids[: seq.num_prompt]), seq.image_embeds
            if start == cached:  # the slot's first chunk: the whole prompt and its vision rows, once
                if seq.adapter != -1:  # ends a worker's run of prefills: such a chunk runs alone (admit_ahead)
                    self.transport.send(P.SlotAdapter(slot, self.executor.lora.slot_of(seq.adapter)))
                cmd = P.Prefill(slot, start, n, prompt, 0 if vision is None else len(vision))
                self.transport.send(cmd, vision)
                rows.append(vision)
            else:
                cmd = P.PrefillNext(slot, start, prompt[start : start + n])
                self.transport.send(cmd)
                rows.append(None)
            commands.append(cmd)
        self.transport.flush()
        keep = [wants_prompt_logprobs(seq) for seq, _, _ in chunks]
        logits = self.executor.prefill_group(commands, rows, keep_hidden=any(keep))
        self.prefill_passes += 1
        offset = 0
        for row, (seq, start, n) in enumerate(chunks):
            self._ran[id(seq)] = (start, n, logits, row)
            if keep[row] and self._state(seq).failure is None:
                chunk = (seq, start, n, self.executor.prefill_hidden[offset : offset + n])
                (done,) = one_by_one([chunk], lambda c: self._prompt_logprobs(*c), "prompt logprobs")
                if isinstance(done, RowFailure):
                    self._state(seq).failure = done
            offset += n
        self.executor.prefill_hidden = None

    def _prompt_logprobs(self, seq, start: int, n: int, hidden) -> None:
        """Raw logprobs of prompt tokens start+1 .. start+n (those inside the prompt) from the
        chunk's hidden states [n, D], LOGSOFTMAX_BLOCK positions per LM-head call."""
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None]  # the first token has no context
        ops = self.executor.ops
        last = min(start + n, len(seq.prompt_ids) - 1)  # positions whose next token is a prompt token
        first = max(start, len(seq.prompt_logprobs) - 1)  # a prefill redone after a preemption: only new ones
        for a in range(first, last, LOGSOFTMAX_BLOCK):
            b = min(a + LOGSOFTMAX_BLOCK, last)
            logits = ops.to_host(self.executor.model.logits(hidden[a - start : b - start]))  # [b - a, V]
            targets = seq.prompt_ids[a + 1 : b + 1]
            seq.prompt_logprobs.extend(rows_logprobs(logits, targets, [seq.params.prompt_logprobs] * (b - a)))

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
        self._decode_start = self._step_clock()
        slots = [s.slot for s in seqs]
        self._rows = list(seqs)
        if self.overlap is not None:  # the pass runs on while the rows' sampling is planned
            self._logits = None
            slow = [i for i, s in enumerate(self._rows) if host_sampled(s)]  # planning worth a thread hand-off
            plan = functools.partial(self._sampling_plan, slow=slow)
            self.overlap.decode(slots, [int(t) for t in tokens], self._rows, plan, thread=bool(slow))
        else:
            self.transport.send(P.DecodeBatch(slots=tuple(slots), tokens=tuple(int(t) for t in tokens)))
            self.transport.flush()
            self._logits = self.executor.decode(slots, list(tokens))
        self.decode_steps += 1
        self.decode_rows += len(slots)

    def argmax_batch(self, row: int = 0, n: int = 1, stream: int = 0) -> list:
        """Plain greedy rows take one device argmax together; the others (sampled, processed,
        masked or asking for logprobs) come to the host in one copy (on a GPU, one transfer of
        [rows, V] rather than one per row) and are sampled together, each with the uniform of
        its request's seed at the token's position. Logprobs go to ``seq.logprobs``. A row whose
        stage failed for its request alone (docs/design.md, "Failure isolation") answers a
        RowFailure; the others are what they would be without it."""
        seqs = self._rows[row : row + n]
        plan = None if self.overlap is None else self.overlap.plan_of(self._rows, row, n)
        plan = self._sampling_plan(seqs) if plan is None else plan
        if self._logits is None:  # an overlapped decode step: its pass ends now
            self._logits = self.overlap.logits()
        logits = self._logits[row : row + n]  # [n, V]
        tokens = self._greedy(logits, [i for i in range(len(seqs)) if i not in plan.slow and i not in plan.failed])
        if plan.slow:
            picked = [seqs[i] for i in plan.slow]
            for i, t in zip(plan.slow, self._sample_slow(logits, plan.slow, picked, plan.masks, plan.uniforms)):
                tokens[i] = t
        tokens = [plan.failed.get(i, t) for i, t in enumerate(tokens)]
        self._rank_tokens(seqs, logits, tokens)
        self._advance_grammars(seqs, plan.guided, tokens)
        if self.step_costs is not None and self._decode_start is not None and n == len(self._rows):
            self.step_costs.decode_step(n, self._step_clock() - self._decode_start)  # a whole decode step
        self._decode_start = None  # (a prefill's first tokens come through here too)
        return tokens

    def _sampling_plan(self, seqs: list, slow: list | None = None) -> SamplingPlan:
        """What sampling rows ``seqs`` takes before their logits (``SamplingPlan``; the host-sampled
        rows are ``slow`` when given); a row whose grammar's mask fails, or whose prompt logprobs
        did, is failed here and sampled no further."""
        if slow is None:
            slow = [i for i, s in enumerate(seqs) if host_sampled(s)]
        failed = {i: s.model_state.failure for i, s in enumerate(seqs) if s.model_state.failure is not None}
        guided = [i for i, s in enumerate(seqs) if s.model_state.matcher is not None and i not in failed]
        guided = [i for i in guided if not thinking.constrained(seqs[i])]  # (suspended inside a thinking block)
        kept = []
        if guided:  # every guided row is host-sampled
            matchers = [seqs[i].model_state.matcher for i in guided]
            allowed = per_row(matchers, self.guides.allowed, "the structured-output grammar")  # bits [W] each
            failed.update((i, a) for i, a in zip(guided, allowed) if isinstance(a, RowFailure))
            kept = [(i, a) for i, a in zip(guided, allowed) if not isinstance(a, RowFailure)]
            guided = [i for i, _ in kept]
        slow = [i for i in slow if i not in failed]
        bits = row_bits(seqs, kept, self.executor.cfg.vocab_size, self.eos_token_ids)  # grammars, thinking blocks
        masked = [i for i in slow if i in bits]
        masks = (
            RowMasks(np.asarray([slow.index(i) for i in masked], dtype=np.int32), np.stack([bits[i] for i in masked]))
            if masked
            else None
        )
        uniforms = np.array(
            [token_uniform(seqs[i].model_state.seed, self.executor.slots.get(seqs[i].slot).length) for i in slow]
        )
        return SamplingPlan(guided, masks, slow, uniforms, failed)

    def _greedy(self, logits, rows: list) -> list:
        """Tokens [n] of logits [n, V]: the argmax of each row in ``rows`` (one device argmax of
        every row), a RowFailure where its logit is not finite (``sampling.checked``), 0 elsewhere."""
        tokens = [0] * logits.shape[0]
        if rows:
            ops = self.executor.ops
            greedy = ops.argmax(logits)
            picked = [int(greedy[i]) for i in rows]
            for i, t in zip(rows, picked):
                tokens[i] = t
            checked(tokens, rows, ops.to_host(logits[ops.index(np.asarray(rows)), ops.index(np.asarray(picked))]))
        return tokens

    def _advance_grammars(self, seqs: list, guided: list, tokens: list) -> None:
        """The grammars of rows ``guided`` take their tokens; one that fails fails its row."""
        rows = [i for i in guided if not isinstance(tokens[i], RowFailure) and not skips_grammar(seqs[i], tokens[i])]
        done = one_by_one(
            rows,
            lambda i: self.guides.advance([seqs[i].model_state.matcher], [tokens[i]]),
            "the structured-output grammar",
        )
        for i, d in zip(rows, done):
            if isinstance(d, RowFailure):
                tokens[i] = d

    def _rank_tokens(self, seqs: list, logits, tokens: list) -> None:
        """best_of: add each sampled token's logprob to its sequence's cumulative logprob."""
        ranked = [i for i, s in enumerate(seqs) if s.params.best_of is not None]
        ranked = [i for i in ranked if not isinstance(tokens[i], RowFailure)]

        def logprobs(rows: list) -> np.ndarray:
            host = self.executor.ops.to_host(logits[rows])  # [m, V]
            temps = np.array([seqs[i].params.temperature for i in rows], dtype=np.float64)
            return token_logprobs(host, temps, np.array([tokens[i] for i in rows]))

        for i, lp in zip(ranked, per_row(ranked, logprobs, "best_of's logprob") if ranked else ()):
            if isinstance(lp, RowFailure):
                tokens[i] = lp
            else:
                seqs[i].cumulative_logprob = (seqs[i].cumulative_logprob or 0.0) + float(lp)

    # ---- expert-parallel load balancing ---------------------------------------------------
    def switch_placement(self, epoch: int, table: np.ndarray) -> int:
        """EPLB: every rank holds the experts of ``table`` [layers, slots] from the next forward pass
        (EPLB_PLACEMENT goes out with that pass's frame); returns the experts rank 0 read."""
        layers, slots = table.shape
        self.transport.send(P.EplbPlacement(epoch, layers, slots, tuple(int(v) for v in table.ravel())))
        return self.executor.switch_placement(epoch, table)

    def _sample_slow(self, logits, rows: list, seqs: list, masks: RowMasks | None, uniforms: np.ndarray) -> list:
        """Tokens of logits rows ``rows`` (sequences ``seqs``), sampled together (``_draw``); if that
        raises, row by row, a row whose sampling raises answering a RowFailure."""

        def draw(picked: list) -> list:
            sub = None if masks is None else masks.take(picked)
            return self._draw(logits, [rows[k] for k in picked], [seqs[k] for k in picked], sub, uniforms[picked])

        tokens = []
        for s, out in zip(seqs, per_row(list(range(len(rows))), draw, "sampling")):
            token, rec = (out, None) if isinstance(out, RowFailure) else out
            if rec is not None:
                if s.logprobs is None:
                    s.logprobs = []
                s.logprobs.append(rec)
            tokens.append(token)
        return tokens

    def _draw(self, logits, rows: list, seqs: list, masks: RowMasks | None, uniforms: np.ndarray) -> list:
        """(token, TokenLogprobs or None) of each of logits rows ``rows`` (sequences ``seqs``): on the
        host, or with the logits processing and the draw on the device (GPU backends: only rows
        with a top-k / top-p cut and rows asking for logprobs come to the host). No effects on the
        sequences (``per_row`` may run it again)."""
        ops, params = self.executor.ops, [s.params for s in seqs]
        whole = rows if len(rows) < logits.shape[0] else slice(None)
        plain = masks is None and all(p.logprobs is None and not p.processes_logits for p in params)
        if plain and ops.name == "cpu":  # temperature / top-k / top-p only
            return [(t, None) for t in sample_rows(ops.to_host(logits[whole]), params, uniforms)]
        histories = [self._history(s) if s.params.processes_logits else None for s in seqs]
        if ops.name == "cpu":
            tokens, records = sample_processed(
                ops.to_host(logits[whole]), params, uniforms, histories, self.eos_token_ids, masks, self.logprobs_mode
            )
        else:
            tokens, records = sample_on_device(
                ops, logits, rows, params, uniforms, histories, self.eos_token_ids, masks, self.logprobs_mode
            )
        return list(zip(tokens, records))

    def _history(self, seq) -> History:
        state = self._state(seq)
        if state.history is None:
            state.history = History.of(seq.prompt_ids)
        return state.history.sync(seq.output_ids)

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
    def check_state(self, step: int) -> None:
        """CHECK_STATE after a step (``--check-state``): every rank compares its mirrored state's digests."""
        step &= P.WORD_MAX
        self.transport.send(P.CheckState(step))
        self.transport.flush()
        self.executor.check_state(step, self.transport)

    def ep_shutdown(self) -> None:
        self.transport.shutdown()

    def synchronize(self, stream: int = 0) -> None:
        self.executor.ops.synchronize()

    def teardown(self) -> None:
        if self.overlap is not None:
            self.overlap.close()
        self.executor.shutdown()


def host_sampled(seq) -> bool:
    """Whether a row goes to the host sampler: ``needs_host_sampler`` or masked by its grammar."""
    return needs_host_sampler(seq.params) or seq.model_state.matcher is not None or thinking.constrained(seq)


def needs_host_sampler(params) -> bool:
    """Whether a row needs the host sampler: sampled, processed logits or logprobs."""
    return params.temperature != 0.0 or params.logprobs is not None or params.processes_logits
