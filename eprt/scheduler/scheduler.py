"""The rank-0 scheduler: continuous batching over the model interface (``interface.py``).

Each tick is planned and run as steps (``step.py``): the tick's plan and prefill lane, its decode
lane, its end; each step is planned here and in ``lanes.py`` (through the model's accounting
calls: ``schedule() -> StepPlan``), executed by the model (``execute(plan) -> StepResult``) and
taken back here (``update(plan, result)``). The semantics (admission,
preemption, chunked prefill, guards, the client API) are in docs/scenarios.md.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque

from eprt.api import GenerationRequest, RequestError
from eprt.scheduler import guards, lanes, speculation, thinking
from eprt.scheduler.clock import WallClock
from eprt.scheduler.config import SchedulerConfig, validate_request
from eprt.scheduler.inbox import Inbox
from eprt.scheduler.interface import RowFailure
from eprt.scheduler.sequence import ERROR, STOP, RequestHandle, SeqState, Sequence
from eprt.scheduler.step import StepPlan, StepResult, TickStart

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, model, config: SchedulerConfig, clock=None, tracer=None):
        """``model``: its ``kv`` (the KV accounting calls), ``drafts`` (the verify lane's queries) and
        ``execute`` (``interface.py``). ``tracer``: the trace writer (``trace.TraceWriter``), given
        each step's plan and result."""
        self.model, self.kv, self.drafts = model, model.kv, model.drafts
        self.config = config
        self.clock = clock if clock is not None else WallClock()
        self.tracer = tracer
        self.tick = 0
        self.free_blocks: int | None = None  # num_free_blocks() as read at the last plan
        self.preemptions = 0
        self.generated_tokens = 0  # tokens accepted so far, counted as they are generated (any thread reads it)
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
        self._checkpoints: list[Sequence] = []  # rows whose decoded token the end of the tick snapshots
        self._acceptance = None  # the verify step the end of the tick closes (step.Acceptance)
        self._rollbacks: list[Sequence] = []  # rows whose token was discarded: their step's position goes back
        self.is_shut_down = False
        self._tick_plans = None  # the plans of the tick under way (a generator: each planned when asked)
        self._planned: StepPlan | None = None  # the plan schedule() returned, until update takes it

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
        """One tick: each of its steps planned (``schedule``), executed by the model, its result taken
        (``update``). True while more ticks are needed (requests in flight, or the inbox closed and the
        shutdown sequence still to run); False when idle or shut down."""
        if self.is_shut_down:
            return False
        try:
            while (plan := self.schedule()) is not None:
                self.update(plan, self.model.execute(plan))
        except BaseException:  # (the engine fails its requests): the tick is abandoned, not resumed
            self._tick_plans = self._planned = None
            raise
        return not self.is_shut_down and (self.in_flight() or self._inbox.closed)

    def schedule(self) -> StepPlan | None:
        """The next step's plan, of the tick under way or of a new one: the tick's start and its
        prefill lane, its decode lane (a decode or a verify step) when it has rows, its end (the
        shutdown instead, once the inbox is closed and nothing is in flight). None once the tick's
        last step was taken (the next call starts a tick) or after the shutdown. Each plan goes to
        the model's ``execute`` and its result to ``update`` before the next is asked for."""
        if self._tick_plans is None:
            if self.is_shut_down:
                return None
            self.tick += 1
            self._tick_plans = self._plans()
        self._planned = next(self._tick_plans, None)
        if self._planned is None:
            self._tick_plans = None
        return self._planned

    def _plans(self):
        """The tick's plans, each planned once the one before was taken."""
        start = self._drain()
        self.free_blocks = start.free_blocks
        if self._inbox.closed and not self.in_flight():
            self.is_shut_down = True
            yield StepPlan(start=start, shutdown=True)
            return
        yield lanes.plan_prefill(self, start)
        decode = lanes.plan_decode(self)
        if decode:
            yield decode
        yield lanes.plan_end(self)

    def _drain(self) -> TickStart:
        """The tick's plan: drain what the inbox has room for (forks to come count), then read the free blocks."""
        held = sum(1 + len(s.forks) for s in itertools.chain(self._live, self._waiting))
        room = self.config.max_batch - held
        drained = self._inbox.drain(room) if room > 0 else []
        record = self.kv.refresh_adapters() if drained else None
        self._waiting.extend(drained)
        startup, self._started = not self._started, True
        adapters = tuple(s.adapter for s in drained)
        return TickStart(self.tick, adapters, self.kv.num_free_blocks(), startup, record)

    def update(self, plan: StepPlan, result: StepResult) -> None:
        """Take an executed step's result: its trace lines (the trace writer, from the plan and the
        result), then its tokens, logprobs, accepted drafts and row failures."""
        if plan is not self._planned:
            raise RuntimeError("Scheduler.update takes the plan schedule() returned last, once")
        self._planned = None
        if self.tracer is not None:
            self.tracer.write(plan, result)
        self._take(plan, result)

    # -- taking a step's result ----------------------------------------------------------------
    def _take(self, plan: StepPlan, result: StepResult) -> None:
        for seq_id, records in result.prompt_logprobs.items():
            seq = self._seq_of(plan, seq_id)
            if seq.prompt_logprobs is None:
                seq.prompt_logprobs = [None]  # the first token has no context
            seq.prompt_logprobs.extend(records)
        for i, chunk in enumerate(plan.chunks):
            if chunk.last:
                rows = [chunk.row.seq] + [f.child for f in chunk.forks]
                for seq, token in zip(rows, result.first[i]):
                    self._accept(seq, token, result, checkpoint=False)
        if plan.decode is not None:
            for row in plan.decode.rows:
                row.seq.len += 1
            for row, token in zip(plan.decode.rows, result.tokens):
                self._accept(row.seq, token, result, checkpoint=True)
        if plan.verify is not None:
            self._acceptance = speculation.take_verify(self, plan.verify, result)
        for release in plan.releases:
            self._notify(release.row.seq)

    @staticmethod
    def _seq_of(plan: StepPlan, seq_id: int) -> Sequence:
        return next(c.row.seq for c in plan.chunks if c.row.seq.seq_id == seq_id)

    def _accept(self, seq: Sequence, token, result: StepResult, checkpoint: bool) -> None:
        """Take one generated token: keep it, apply the per-token guards, stream it. A RowFailure
        instead ends the sequence (``error``); its blocks go back at the end of the tick."""
        if isinstance(token, RowFailure):
            self._finish(seq, ERROR, error=token.reason)
            return
        token = int(token)
        if seq.think is not None:
            token = thinking.keep(seq, token, self.config.eos_token_ids)
            if token is None:  # an EOS inside its block: discarded, its step runs again
                self._rollbacks.append(seq)
                return
        self._record(seq, result)
        seq.token_ids.append(token)
        self.generated_tokens += 1
        if guards.is_stop_token(seq, token, self.config.eos_token_ids):
            self._finish(seq, STOP)
            return
        if checkpoint:
            self._checkpoints.append(seq)
        if seq.stream and seq.on_token is not None:
            self._call(seq, seq.on_token, token)
        reason = guards.limit_verdict(seq, self.config.max_model_len)
        if reason is not None:
            self._finish(seq, reason)

    @staticmethod
    def _record(seq: Sequence, result: StepResult) -> None:
        """The logprobs the step computed for seq's token (taken once: a verify row's tokens each have one)."""
        records = result.logprobs.get(seq.seq_id)
        if records:
            if seq.logprobs is None:
                seq.logprobs = []
            seq.logprobs.append(records.pop(0))
        added = result.cumulative.pop(seq.seq_id, None)
        if added is not None:
            seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + added

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
