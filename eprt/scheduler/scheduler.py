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
from eprt.scheduler import guards, pools
from eprt.scheduler.clock import WallClock
from eprt.scheduler.config import SchedulerConfig, validate_request
from eprt.scheduler.effects import (
    DEFAULT_STREAM,
    CompactSlot,
    Decode,
    EffectRunner,
    EpShutdown,
    MarconiCheckpoint,
    Quiesce,
    ReleaseSeq,
    Teardown,
    Tracer,
)
from eprt.scheduler.inbox import Inbox
from eprt.scheduler.sequence import ERROR, GUARD_KV_CAPACITY, LENGTH, STOP, RequestHandle, SeqState, Sequence

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, model, config: SchedulerConfig, clock=None, tracer: Tracer | None = None):
        self.model = model
        self.config = config
        self.clock = clock if clock is not None else WallClock()
        self.tracer = tracer
        self.tick = 0
        self.free_blocks: int | None = None  # num_free_blocks() as read at the last plan
        self.preemptions = 0
        self._fx = EffectRunner(model, tracer)
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
        prompt = validate_request(self.config, request)
        deadline = None if request.timeout_s is None else self.clock.now() + request.timeout_s
        with self._ids_lock:
            if seq_id is None:  # above every id given so far: never live
                seq_id = self._next_id
            elif not isinstance(seq_id, int) or seq_id < 0 or seq_id in self._live_ids:
                raise RequestError(f"sequence id {seq_id!r} is invalid or already in use")
            self._next_id = max(self._next_id, seq_id + 1)
            self._live_ids.add(seq_id)
        seq = Sequence(
            seq_id,
            tuple(prompt),
            request.params,
            request_id=request.request_id,
            adapter=adapter,
            image_embeds=request.image_embeds,
            deadline=deadline,
            stream=request.stream,
            on_token=request.on_token,
            on_finish=on_finish,
        )
        try:
            self._inbox.put(seq)
        except RequestError:
            with self._ids_lock:
                self._live_ids.discard(seq_id)
            raise
        return RequestHandle(seq)

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
        room = self.config.max_batch - len(self._live) - len(self._waiting)
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
        for seq in [s for s in self._live if s.state is SeqState.PREFILLING]:
            if budget == 0:
                return
            budget = self._prefill_chunk(seq, budget)
        while self._waiting and budget != 0:
            seq = self._waiting[0]
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
        n = full - start if budget is None else min(full - start, budget)
        self.model.prefill(seq, start, n, stream=DEFAULT_STREAM)
        seq.len = start + n
        if seq.len == full:
            seq.state = SeqState.RUNNING
            self._accept(seq, self.model.argmax_on_device(row=0, stream=DEFAULT_STREAM), checkpoint=False)
        return None if budget is None else budget - n

    # -- decode lane -------------------------------------------------------------------------
    def _decode_lane(self) -> None:
        rows = self._make_room(sorted((s for s in self._live if s.state is SeqState.RUNNING), key=lambda s: s.slot))
        if not rows:
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

    def _accept(self, seq: Sequence, token: int, checkpoint: bool) -> None:
        """Take one generated token: keep it, apply the per-token guards, stream it."""
        token = int(token)
        seq.token_ids.append(token)
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
        for seq in queued:  # never admitted (or preempted): no slot to free
            self._finish(seq, *verdict(seq))
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
        seq.state = SeqState.FINISHED
        seq.finish_reason, seq.guard, seq.error = reason, guard, error
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
