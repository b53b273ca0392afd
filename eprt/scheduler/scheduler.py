"""The rank-0 scheduler: continuous batching over the model interface (``interface.py``).

Each tick is plan, prefill lane, decode lane, end of tick; the semantics (admission,
preemption, chunked prefill, guards, the client API) are in docs/scenarios.md.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque

from eprt.api import GenerationRequest, RequestError
from eprt.scheduler import guards, pools, speculation, thinking
from eprt.scheduler.clock import WallClock
from eprt.scheduler.config import SchedulerConfig, validate_request
from eprt.scheduler.effects import (
    DEFAULT_STREAM,
    CompactSlot,
    Decode,
    EffectRunner,
    EpShutdown,
    ForkSeq,
    MarconiCheckpoint,
    Quiesce,
    ReleaseSeq,
    Teardown,
    Tracer,
)
from eprt.scheduler.inbox import Inbox
from eprt.scheduler.interface import RowFailure
from eprt.scheduler.sequence import ERROR, GUARD_KV_CAPACITY, LENGTH, STOP, RequestHandle, SeqState, Sequence

log = logging.getLogger(__name__)


def _chunk_len(left: int, budget: int | None) -> int:
    """Prompt tokens of one prefill chunk: what is left of the prompt, within the tick's budget."""
    return left if budget is None else min(left, budget)


class Scheduler:
    def __init__(self, model, config: SchedulerConfig, clock=None, tracer: Tracer | None = None):
        self.model = model
        self.config = config
        self.clock = clock if clock is not None else WallClock()
        self.tracer = tracer
        self.tick = 0
        self.free_blocks: int | None = None  # num_free_blocks() as read at the last plan
        self.preemptions = 0
        self.generated_tokens = 0  # tokens accepted so far, counted as they are generated (any thread reads it)
        self._fx = EffectRunner(model, tracer)
        self.drafting = speculation.DraftPolicy()  # the verify lane's (when speculation is on)
        self._inbox = Inbox()
        self._waiting: deque[Sequence] = deque()  # drained or preempted, no slot; front first
        self._live: list[Sequence] = []  # slot holders, in admission order
        self._admissions = itertools.count()
        self._ids_lock = threading.Lock()  # guards _live_ids and _next_id
        self._live_ids: set[int] = set()
        self._next_id = 1
        self._abort = False
        self._started = False
        self._stream = DEFAULT_STREAM
        self.is_shut_down = False

    # -- client side (any thread) ------------------------------------------------------------
    def submit(
        self, request: GenerationRequest, *, on_finish=None, seq_id: int | None = None, adapter: int = -1
    ) -> RequestHandle:
        """Queue one request of one choice (``submit_choices`` takes n / best_of)."""
        if getattr(request.params, "choices", 1) != 1:
            raise RequestError(f"{request.params.choices} choices asked for: submit them with submit_choices")
        return self.submit_choices(request, on_finish=on_finish, seq_id=seq_id, adapter=adapter)[0]

    def submit_choices(
        self,
        request: GenerationRequest,
        *,
        on_finish=None,
        seq_id: int | None = None,
        adapter: int = -1,
        on_tokens: list | None = None,
    ) -> list[RequestHandle]:
        """Queue a request and its further choices (``params.choices``: best_of, else n), one
        handle each; the further ones fork off the first when its prefill ends (docs/scenarios.md,
        "Choices"). ``on_finish`` is called once per choice; ``on_tokens[k]``, when given, streams
        choice k's tokens instead of ``request.on_token``."""
        prompt = validate_request(self.config, request)
        deadline = None if request.timeout_s is None else self.clock.now() + request.timeout_s
        count = getattr(request.params, "choices", 1)
        if on_tokens is not None and len(on_tokens) != count:
            raise RequestError(f"{len(on_tokens)} token callbacks for {count} choices")
        with self._ids_lock:
            if seq_id is None:  # above every id given so far: never live
                seq_id = self._next_id
            elif not isinstance(seq_id, int) or seq_id < 0 or seq_id in self._live_ids:
                raise RequestError(f"sequence id {seq_id!r} is invalid or already in use")
            ids = [seq_id] + list(range(max(self._next_id, seq_id + 1), max(self._next_id, seq_id + 1) + count - 1))
            self._next_id = max(self._next_id, ids[-1] + 1)
            self._live_ids.update(ids)
        seqs = [
            Sequence(
                i,
                tuple(prompt),
                request.params,
                request_id=request.request_id,
                adapter=adapter,
                image_embeds=request.image_embeds,
                deadline=deadline,
                stream=request.stream,
                on_token=request.on_token if on_tokens is None else on_tokens[k],
                on_finish=on_finish,
                choice=k,
            )
            for k, i in enumerate(ids)
        ]
        seqs[0].forks = seqs[1:]
        for seq in seqs:
            seq.accepted_tokens = 0 if self.config.num_speculative_tokens else None
        try:
            self._inbox.put(seqs[0])
        except RequestError:
            with self._ids_lock:
                self._live_ids.difference_update(ids)
            raise
        return [RequestHandle(seq) for seq in seqs]

    def cancel(self, handle: RequestHandle) -> None:
        handle.cancel()

    def close(self, cancel: bool = False) -> None:
        """Refuse new requests; with cancel, also end every request in flight (``stop``)."""
        if cancel:
            self._abort = True
        self._inbox.close()

    # -- the scheduler thread ------------------------------------------------------------------
    def run(self) -> None:
        """Tick until shut down, sleeping on the inbox while there is nothing to do."""
        while not self.is_shut_down:
            if not self.step() and not self.is_shut_down:
                self.wait_for_work()

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Block until a request is in the inbox or it is closed; False on timeout."""
        return self._inbox.wait(timeout)

    def in_flight(self) -> bool:
        return bool(len(self._inbox) or self._waiting or self._live)

    def stats(self) -> dict:
        return {
            "ticks": self.tick,
            "queued": len(self._inbox) + len(self._waiting),
            "running": len(self._live),
            "preemptions": self.preemptions,
            "generation_tokens": self.generated_tokens,
        }

    def step(self) -> bool:
        """One tick. True while more ticks are needed (requests in flight, or the inbox
        closed and the shutdown sequence still to run); False when idle or shut down."""
        if self.is_shut_down:
            return False
        if not self._started:
            self._startup()
        self.tick += 1
        self._plan()
        self.free_blocks = self.model.num_free_blocks()
        if self.tracer is not None:
            self.tracer.tick(self.tick)
        if self._inbox.closed and not self.in_flight():
            self._shutdown()
            return False
        self._prefill_lane()
        self._decode_lane()
        self._end_of_tick()
        return self.in_flight() or self._inbox.closed

    def _startup(self) -> None:
        self.model.bind_gpu_to_thread()
        self._stream = self.model.create_stream()
        self.model.create_event()
        self._started = True

    def _plan(self) -> None:
        held = sum(1 + len(s.forks) for s in itertools.chain(self._live, self._waiting))  # forks to come count
        room = self.config.max_batch - held
        drained = self._inbox.drain(room) if room > 0 else []
        if not drained:
            return
        self.model.adapter_id_for(-1)  # the cohort's active adapter
        for seq in drained:
            seq.adapter = self.model.adapter_id_for(seq.adapter)
            self._waiting.append(seq)

    # -- prefill lane ------------------------------------------------------------------------
    def _prefill_lane(self) -> None:
        budget = self.config.max_prefill_tokens or None  # None: unlimited
        self.model.plan_prefills(self._lane_plan(budget))
        for seq in [s for s in self._live if s.state is SeqState.PREFILLING]:
            if budget == 0:
                return
            budget = self._prefill_chunk(seq, budget)
        while self._waiting and budget != 0 and len(self._live) < self.config.max_batch:
            seq = self._waiting[0]  # (a fork that found no slot may wait for one)
            if not self.model.can_admit(seq):
                if self._live:
                    return  # wait for blocks to come back
                self._waiting.popleft()  # nothing will ever free enough
                self._finish(
                    seq,
                    ERROR,
                    error=f"the prompt ({seq.num_prompt} tokens) needs more KV blocks than the whole pool holds",
                )
                continue
            self._waiting.popleft()
            self._admit(seq)
            budget = self._prefill_chunk(seq, budget)

    def _lane_plan(self, budget: int | None) -> list:
        """The (seq, start, n) chunks the lane below will run, told to the model ahead (untraced)
        so it may run them as one forward: the same choices, with ``admit_ahead`` answering
        ``can_admit`` and holding the blocks. Stops early where the model cannot say (None)."""
        plan, room = [], self.config.max_batch - len(self._live)  # admissions and forks the lane may make
        for seq in [s for s in self._live if s.state is SeqState.PREFILLING]:
            if budget == 0:
                return plan
            n = _chunk_len(seq.num_prompt - seq.len, budget)
            plan.append((seq, seq.len, n))
            budget = None if budget is None else budget - n
            if seq.len + n == seq.num_prompt:  # its prompt ends: its further choices fork first
                room -= len(seq.forks)
        for seq in self._waiting:
            cached = None if budget == 0 or room < 1 else self.model.admit_ahead(seq)
            if cached is None:
                break
            n = _chunk_len(seq.num_prompt - cached, budget)
            plan.append((seq, cached, n))
            budget = None if budget is None else budget - n
            room -= 1 + (len(seq.forks) if cached + n == seq.num_prompt else 0)
        return plan

    def _admit(self, seq: Sequence) -> None:
        seq.slot = self.model.alloc_sequence(seq)
        seq.len = seq.cached
        if seq.cached_tokens is None:
            seq.cached_tokens = seq.cached
        seq.admit_order = next(self._admissions)
        seq.state = SeqState.PREFILLING
        self._live.append(seq)
        self.model.adapter_id_for(seq.adapter)
        self.model.acquire_adapter_slot(seq.adapter)

    def _prefill_chunk(self, seq: Sequence, budget: int | None) -> int | None:
        """Prefill one chunk of the prompt; returns the budget left."""
        full, start = seq.num_prompt, seq.len
        n = _chunk_len(full - start, budget)
        self.model.prefill(seq, start, n, stream=DEFAULT_STREAM)
        seq.len = start + n
        if seq.len == full:
            seq.state = SeqState.RUNNING
            rows = [seq] + self._fork(seq)
            if len(rows) == 1:
                tokens = [self.model.argmax_on_device(row=0, stream=DEFAULT_STREAM)]
            else:  # every choice samples its own first token from the prompt's logits
                tokens = self.model.argmax_batch(row=0, n=len(rows), stream=DEFAULT_STREAM)
            for s, token in zip(rows, tokens):
                self._accept(s, token, checkpoint=False)
        return None if budget is None else budget - n

    def _fork(self, parent: Sequence) -> list:
        """The parent's further choices, each forked into a slot of its own (FORK) while there is
        a slot and a block; the rest queue at the front to prefill their prompt themselves."""
        forked, children = [], parent.forks
        parent.forks = []
        for i, child in enumerate(children):
            if len(self._live) >= self.config.max_batch or not self.model.can_fork(parent):
                self._waiting.extendleft(reversed(children[i:]))
                break
            child.slot = self._fx.run(ForkSeq(parent, child))
            child.len = child.cached = parent.len
            child.cached_tokens = parent.cached_tokens
            child.admit_order = next(self._admissions)
            child.state = SeqState.RUNNING
            self._live.append(child)
            self.model.acquire_adapter_slot(child.adapter)
            forked.append(child)
        return forked

    # -- decode lane -------------------------------------------------------------------------
    def _decode_lane(self) -> None:
        rows = self._make_room(sorted((s for s in self._live if s.state is SeqState.RUNNING), key=lambda s: s.slot))
        if not rows:
            return
        if self.config.num_speculative_tokens and speculation.verify_lane(self, rows):
            return
        tokens = self._fx.run(Decode(tuple(rows)))
        for seq, token in zip(rows, tokens):
            self._accept(seq, token, checkpoint=True)

    def _make_room(self, rows: list) -> list:
        """Preempt until every row that crosses a block boundary can get its new block (within the
        short pool: one per owner rank under dp attention, ``pools.py``)."""
        while rows:
            pool = pools.short_pool(self.model, rows, self.config.block_size)
            if pool is None:
                return rows
            holders = [s for s in self._live if pools.in_pool(self.model, s, pool)]
            victim = max((s for s in holders if not s.finished), key=lambda s: s.admit_order)
            if len(holders) == 1:  # it has the whole pool and still cannot grow
                self._finish(victim, LENGTH, guard=GUARD_KV_CAPACITY)
            else:  # (if alone among finished ones: retry next tick)
                self._preempt(victim)
            rows = [s for s in rows if s is not victim]
        return rows

    def _preempt(self, seq: Sequence) -> None:
        self._fx.run(ReleaseSeq(seq, cache=True, finish=False))
        self.preemptions += 1
        self._live.remove(seq)
        seq.slot, seq.len = -1, 0
        seq.num_prompt = len(seq.token_ids)
        seq.state = SeqState.QUEUED
        self._waiting.appendleft(seq)

    def _accept(self, seq: Sequence, token: int | RowFailure, checkpoint: bool) -> None:
        """Take one generated token: keep it, apply the per-token guards, stream it. A RowFailure
        instead ends the sequence (``error``); its blocks go back at the end of the tick."""
        if isinstance(token, RowFailure):
            self._finish(seq, ERROR, error=token.reason)
            return
        token = int(token)
        if seq.think is not None:
            token = thinking.keep(seq, token, self.config.eos_token_ids)
            if token is None:
                return
        seq.token_ids.append(token)
        self.generated_tokens += 1
        if guards.is_stop_token(seq, token, self.config.eos_token_ids):
            self._finish(seq, STOP)
            return
        if checkpoint:
            self._fx.run(MarconiCheckpoint(seq))
        if seq.stream and seq.on_token is not None:
            self._call(seq, seq.on_token, token)
        reason = guards.limit_verdict(seq, self.config.max_model_len)
        if reason is not None:
            self._finish(seq, reason)

    # -- end of tick -------------------------------------------------------------------------
    def _end_of_tick(self) -> None:
        self.clock.end_tick()
        now = self.clock.now()

        def verdict(seq: Sequence):
            return guards.tick_verdict(seq, now, self._abort)

        for seq in self._live:
            if not seq.finished and verdict(seq) is not None:
                self._finish(seq, *verdict(seq))
        queued = [s for s in self._waiting if verdict(s) is not None]
        self._waiting = deque(s for s in self._waiting if s not in queued)
        queued += self._inbox.remove_if(lambda s: verdict(s) is not None)
        while queued:
            for seq in queued:  # never admitted (or preempted): no slot to free
                self._finish(seq, *verdict(seq))
            queued = [s for s in self._waiting if verdict(s) is not None]  # forks those ends let go
            self._waiting = deque(s for s in self._waiting if s not in queued)
        for seq in sorted((s for s in self._live if s.finished), key=lambda s: s.slot):
            self._fx.run(ReleaseSeq(seq, cache=True, finish=True))
            self._live.remove(seq)
            seq.slot = -1
            self._notify(seq)
        self._compact()

    def _compact(self) -> None:
        survivors = sorted(self._live, key=lambda s: s.slot)
        n = len(survivors)
        targets = sorted(set(range(n)) - {s.slot for s in survivors})
        for seq in survivors:
            if seq.slot >= n:
                target = targets.pop()
                self._fx.run(CompactSlot(seq, target))
                seq.slot = target

    def _shutdown(self) -> None:
        for fx in (EpShutdown(), Quiesce(DEFAULT_STREAM), Quiesce(self._stream), Teardown()):
            self._fx.run(fx)
        self.is_shut_down = True

    def fail_all(self, message: str) -> None:
        """The engine broke (a worker failed, a model error): close the inbox and end every
        request in flight, queued or live, with reason ``error`` and ``message``, without
        touching the model again. The scheduler is shut down afterwards."""
        self._inbox.close()
        pending = self._inbox.drain(len(self._inbox)) + list(self._waiting) + list(self._live)
        pending += [child for seq in pending for child in seq.forks]
        self._waiting.clear()
        self._live.clear()
        for seq in pending:
            if not seq.done_event.is_set():
                seq.state = SeqState.FINISHED
                seq.finish_reason, seq.error = ERROR, message
                self._notify(seq)
        self.is_shut_down = True

    # -- ending requests ---------------------------------------------------------------------
    def _finish(self, seq: Sequence, reason: str, guard: str | None = None, error: str | None = None) -> None:
        if seq.forks:  # ended before its prefill: its further choices go on by themselves
            self._waiting.extend(seq.forks)
            seq.forks = []
        seq.state = SeqState.FINISHED
        seq.finish_reason, seq.guard, seq.error = reason, guard or seq.guard, error
        if seq.slot < 0:  # holds nothing: tell the client now
            self._notify(seq)

    def _notify(self, seq: Sequence) -> None:
        with self._ids_lock:
            self._live_ids.discard(seq.seq_id)
        result = seq.result()  # built once, here, before anyone can see the request done
        if seq.on_finish is not None:
            self._call(seq, seq.on_finish, result)
        seq.done_event.set()

    def _call(self, seq: Sequence, fn, arg) -> None:
        try:
            fn(arg)
        except Exception:  # a client's bug must not stop the others
            log.exception("client callback of request s%d raised; cancelling it", seq.seq_id)
            seq.cancel_event.set()
