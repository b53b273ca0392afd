"""One request's life inside the scheduler, and the handle its client holds.

The model (``interface.py``) reads a documented subset of ``Sequence``; the client sees
only ``RequestHandle``. Everything here is mutated by the scheduler thread alone, except
the cancel and done events, which are how other threads talk to it.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from eprt.api import GenerationResult, SamplingParams
from eprt.scheduler import thinking

# Finish reasons (docs/scenarios.md, "One run").
STOP = "stop"  # EOS or a stop id, a client cancel, shutdown
LENGTH = "length"  # token budget, context limit, or a guard other than the deadline
TIMEOUT = "timeout"  # the request_timeout guard
ERROR = "error"  # the request can never be served (named in result().error)

# Guard names (printed as guard=Some("name")).
GUARD_TIMEOUT = "request_timeout"
GUARD_KV_CAPACITY = "kv_capacity"  # a lone sequence outgrew the whole KV pool


class SeqState(enum.Enum):
    QUEUED = "queued"  # in the inbox or the waiting queue: no slot, no blocks
    PREFILLING = "prefilling"  # holds a slot; prompt KV partly computed (chunked prefill)
    RUNNING = "running"  # holds a slot; decoding
    FINISHED = "finished"  # done; still holds its slot until the end-of-tick release


@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_ids: tuple  # the client's prompt, never changes
    params: SamplingParams
    request_id: str | None = None
    adapter: int = -1
    image_embeds: object = None  # numpy [n, D] float32 or None
    deadline: float | None = None  # on the scheduler's clock
    stream: bool = False  # streaming client: on_token per token
    on_token: Callable[[int], None] | None = None
    on_finish: Callable[[GenerationResult], None] | None = None
    # -- state read by the model (interface.py) --------------------------------------
    token_ids: list = field(init=False)  # prompt, then every generated token
    num_prompt: int = field(init=False)  # grows on re-admission after a preemption
    len: int = 0  # tokens whose KV is stored
    slot: int = -1
    cached: int = 0  # prefix-cache hit of the current admission
    model_state: object = None  # the model's own (e.g. its sampler); never read here
    choice: int = 0  # which choice of its prompt (n, best_of): 0, or a fork's index
    cumulative_logprob: float | None = None  # the model may sum its tokens' logprobs here (best_of)
    logprobs: list | None = None  # written by the model: TokenLogprobs per generated token, when asked for
    prompt_logprobs: list | None = None  # written by the model: [None, TokenLogprobs...] of the prompt
    # -- scheduler bookkeeping -----------------------------------------------------------
    state: SeqState = SeqState.QUEUED
    cached_tokens: int | None = None  # reported hit: that of the first admission
    forks: list = field(default_factory=list, repr=False)  # further choices, forked when the prefill ends
    admit_order: int = -1  # larger: admitted more recently
    accepted_tokens: int | None = None  # speculative drafts accepted (None: speculation off)
    draft_stats: object = None  # speculation.DraftStats: its acceptance estimate (speculation on)
    think: thinking.ThinkState | None = field(init=False, default=None)  # its thinking block (read by the model)
    finish_reason: str | None = None
    guard: str | None = None
    error: str | None = None
    cancel_event: threading.Event = field(default_factory=threading.Event, repr=False)
    done_event: threading.Event = field(default_factory=threading.Event, repr=False)
    _result: GenerationResult | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.prompt_ids = tuple(self.prompt_ids)
        self.token_ids = list(self.prompt_ids)
        self.num_prompt = len(self.prompt_ids)
        self.think = thinking.begin(getattr(self.params, "thinking", None), self.prompt_ids)

    @property
    def output_ids(self) -> list:
        return self.token_ids[len(self.prompt_ids) :]

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.state is SeqState.FINISHED

    def result(self) -> GenerationResult:
        """The request's result; once it has finished, always the same object, built by the
        scheduler when it notifies the client (so text the engine decoded for on_finish is
        not decoded again for the handle)."""
        if self._result is not None:
            return self._result
        result = GenerationResult(
            request_id=self.request_id,
            prompt_ids=list(self.prompt_ids),
            token_ids=self.output_ids,
            finish_reason=self.finish_reason or "",
            cached_tokens=self.cached_tokens or 0,
            error=self.error,
            accepted_tokens=self.accepted_tokens,
            index=self.choice,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
            reasoning_tokens=None if self.think is None else self.think.count,
        )
        if self.finished:
            self._result = result
        return result


class RequestHandle:
    """What ``Scheduler.submit`` returns: cancel the request or wait for its result."""

    def __init__(self, seq: Sequence):
        self._seq = seq

    @property
    def seq_id(self) -> int:
        return self._seq.seq_id

    @property
    def request_id(self) -> str | None:
        return self._seq.request_id

    @property
    def guard(self) -> str | None:
        """The guard that ended the request (None when none did or before it ends)."""
        return self._seq.guard if self.done() else None

    @property
    def logprobs(self) -> list | None:
        """The generated tokens' TokenLogprobs so far (a live list, one entry per token the client
        has been given and possibly one more), or None when the request did not ask for them."""
        return self._seq.logprobs

    @property
    def prompt_logprobs(self) -> list | None:
        """The prompt's [None, TokenLogprobs...] once computed (complete when the first token is)."""
        return self._seq.prompt_logprobs

    def cancel(self) -> None:
        """Ask the scheduler to stop the request; it ends (``stop``) at the end of the tick."""
        self._seq.cancel_event.set()

    @property
    def started(self) -> bool:
        """Whether the request has left the queue: admitted (now or before a preemption) or ended."""
        return self._seq.state is not SeqState.QUEUED or bool(self._seq.output_ids)

    def done(self) -> bool:
        return self._seq.done_event.is_set()

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Block until the request ends (or ``timeout`` seconds pass: TimeoutError)."""
        if not self._seq.done_event.wait(timeout):
            raise TimeoutError(f"request s{self.seq_id} still running after {timeout} s")
        return self._seq.result()
