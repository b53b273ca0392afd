"""A test double of the engine contract (``eprt.engine.engine``) for fast serve/batch tests.

Same surface as the real engine: ``tokenizer``, ``model_name``, ``vocab_size``,
``max_model_len``, thread-safe ``submit`` -> handle (``result``/``done``/``cancel``),
``generate``, ``serve_forever(stop)`` and ``stats``; ``submit`` also takes the real
engine's ``on_finish`` callback. What it computes is trivial and
predictable so that tests can assert exact outputs:

- tokenizer: bytes. Id b < 256 is the byte b, 256 is EOS (vocabulary of 260), so a
  multi-byte character spans several tokens (exercises incremental decoding).
- model: echoes the prompt back, one token per step, then EOS. A prompt containing
  ``FAIL`` ends in an engine error after two tokens; one containing ``CRASH`` makes the
  engine loop itself raise after two tokens (a failed rank: every request in flight fails).
- scheduling: continuous batching on the thread that runs ``serve_forever``: each step
  admits waiting requests into free slots (``max_batch``), gives every running
  sequence one token, then sleeps ``token_delay`` seconds.
- prefix cache: ``cached_tokens`` is the longest prefix, in whole 4-token blocks,
  shared with an earlier prompt.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from eprt.api import GenerationRequest, GenerationResult, RequestError

EOS = 256
VOCAB = 260
SPECIAL = {"<think>": 257, "</think>": 258}  # never generated: the echo holds bytes only
BLOCK = 4


class ByteTokenizer:
    eos_token_ids = [EOS]

    def __init__(self, chat_template: bool = True):
        self.chat_template = chat_template

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list:
        return list(text.encode("utf-8"))  # no special tokens to add

    def decode(self, ids: list, skip_special_tokens: bool = True) -> str:  # (no special token has text)
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_id(self, text: str) -> int | None:
        """The id of a special token (a reasoning parser's delimiters: ids no prompt text encodes to)."""
        return SPECIAL.get(text)

    def apply_chat_template(self, messages: list, add_generation_prompt: bool = True, tools=None, **kwargs) -> str:
        """``tools`` (their names) and ``kwargs`` (chat_template_kwargs) lead the text when given."""
        if not self.chat_template:
            raise ValueError("the tokenizer has no chat_template")
        head = "".join(f"<tool {t['function']['name']}>" for t in tools or ()) + "".join(
            f"<{k}={v}>" for k, v in sorted(kwargs.items())
        )
        return (
            head
            + "".join(f"<{m['role']}>{m.get('content') or ''}\n" for m in messages)
            + ("<assistant>" if add_generation_prompt else "")
        )


@dataclass(eq=False)
class _Seq:
    request: GenerationRequest
    submitted: float
    on_finish: object = None  # called with the result once the request ends
    index: int = 0  # which choice of its request
    generated: list = field(default_factory=list)
    cached: int = 0
    result: GenerationResult | None = None
    done: threading.Event = field(default_factory=threading.Event)


class FakeHandle:
    logprobs = None  # the fake computes no logprobs
    prompt_logprobs = None

    def __init__(self, engine: FakeEngine, seq: _Seq):
        self._engine, self._seq = engine, seq

    def done(self) -> bool:
        return self._seq.done.is_set()

    def result(self, timeout: float | None = None) -> GenerationResult:
        if not self._seq.done.wait(timeout):
            raise TimeoutError(f"request {self._seq.request.request_id} still running")
        return self._seq.result

    def cancel(self) -> None:
        self._engine._cancel(self._seq)


BYTES = ByteTokenizer()  # the default tokenizer; None means a model without one


class FakeEngine:
    def __init__(
        self,
        *,
        max_model_len: int = 512,
        max_batch: int = 8,
        token_delay: float = 0.0,
        tokenizer=BYTES,
        total_blocks: int = 1024,
    ):
        self.tokenizer = tokenizer
        self.model_name = "fake-moe"
        self.vocab_size = VOCAB
        self.max_model_len = max_model_len
        self.max_batch = max_batch
        self.token_delay = token_delay
        self.total_blocks = total_blocks
        self.submitted: list = []  # every accepted GenerationRequest, in order
        self.cancelled: list = []  # request ids whose handle was cancelled before they finished
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._waiting: deque = deque()
        self._running: list = []
        self._prompts: list = []  # earlier prompts, for the prefix cache
        self.ticks = 0  # steps run (the engine's scheduler ticks)
        self._counts = dict(prompt_tokens=0, cached_tokens=0, generation_tokens=0, requests_finished=0)

    # ---- the contract ---------------------------------------------------------------------

    def submit(self, req: GenerationRequest, on_finish=None) -> FakeHandle:
        return self._enqueue(req, on_finish)

    def submit_choices(self, req: GenerationRequest, on_finish=None, on_tokens: list | None = None) -> list:
        """Each choice (n, best_of) as a sequence of its own (the fake shares no prefill and has
        no logprobs, so best_of keeps the first n); choice k streams to ``on_tokens[k]``."""
        handles = []
        for k in range(req.params.choices):
            one = dataclasses.replace(req, on_token=req.on_token if on_tokens is None else on_tokens[k])
            handles.append(self._enqueue(one, on_finish, index=k))
        return handles

    def _enqueue(self, req: GenerationRequest, on_finish=None, index: int = 0) -> FakeHandle:
        req.params.validate(self.vocab_size)
        if not req.prompt_ids:
            raise RequestError("the prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in req.prompt_ids):
            raise RequestError(f"prompt token ids must be in [0, {self.vocab_size})")
        if len(req.prompt_ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(req.prompt_ids)} tokens but the context holds {self.max_model_len}"
            )
        seq = _Seq(req, time.monotonic(), on_finish, index=index)
        with self._lock:
            self._waiting.append(seq)
            if index == 0:  # a request of several choices is listed once
                self.submitted.append(req)
        self._wake.set()
        return FakeHandle(self, seq)

    def generate(self, reqs: list) -> list:
        handles = [self.submit(r) for r in reqs]
        while not all(h.done() for h in handles):
            self.step()
        return [h.result() for h in handles]

    def serve_forever(self, stop: threading.Event) -> None:
        while True:
            with self._lock:
                idle = not self._waiting and not self._running
            if idle and stop.is_set():
                return
            if idle:
                self._wake.wait(0.01)
                self._wake.clear()
                continue
            self.step()
            time.sleep(self.token_delay)

    def fail(self, message: str) -> None:
        """End every request in flight with an error (the real engine's ``fail``)."""
        with self._lock:
            for seq in list(self._waiting) + list(self._running):
                self._finish(seq, "error", message)

    @property
    def generation_tokens(self) -> int:
        return self._counts["generation_tokens"]

    def stats(self) -> dict:
        with self._lock:
            held = sum((len(s.request.prompt_ids) + len(s.generated)) // BLOCK + 1 for s in self._running)
            return dict(
                running=len(self._running),
                waiting=len(self._waiting),
                ticks=self.ticks,
                free_blocks=self.total_blocks - held,
                cached_blocks=0,
                total_blocks=self.total_blocks,
                **self._counts,
            )

    # ---- the fake model -------------------------------------------------------------------

    def step(self) -> None:
        """Admit waiting requests into free slots, then give every running one a token."""
        with self._lock:
            self.ticks += 1
            while self._waiting and len(self._running) < self.max_batch:
                self._admit(self._waiting.popleft())
            for seq in list(self._running):
                self._advance(seq)

    def _admit(self, seq: _Seq) -> None:
        prompt = seq.request.prompt_ids
        shared = max((_common_prefix(prompt, p) for p in self._prompts), default=0)
        seq.cached = min(shared, len(prompt) - 1) // BLOCK * BLOCK
        self._prompts.append(list(prompt))
        self._counts["prompt_tokens"] += len(prompt)
        self._counts["cached_tokens"] += seq.cached
        self._running.append(seq)

    def _advance(self, seq: _Seq) -> None:
        req, prompt = seq.request, seq.request.prompt_ids
        if req.timeout_s is not None and time.monotonic() - seq.submitted > req.timeout_s:
            return self._finish(seq, "timeout")
        if b"CRASH" in bytes(t for t in prompt if t < 256) and len(seq.generated) == 2:
            raise RuntimeError("fake engine crash (the prompt says CRASH)")
        if b"FAIL" in bytes(t for t in prompt if t < 256) and len(seq.generated) == 2:
            return self._finish(seq, "error", "fake engine failure (the prompt says FAIL)")
        n = len(seq.generated)
        tok = prompt[n] if n < len(prompt) else EOS
        seq.generated.append(tok)
        self._counts["generation_tokens"] += 1
        if not req.params.ignore_eos and (tok == EOS or tok in req.params.stop_token_ids):
            return self._finish(seq, "stop")  # like the real engine: a stop id is kept, not streamed
        if req.on_token is not None:
            req.on_token(tok)
        if len(seq.generated) >= req.params.max_tokens or len(prompt) + len(seq.generated) >= self.max_model_len:
            self._finish(seq, "length")

    def _finish(self, seq: _Seq, reason: str, error: str | None = None) -> None:
        if seq in self._running:
            self._running.remove(seq)
        elif seq in self._waiting:
            self._waiting.remove(seq)
        self._counts["requests_finished"] += 1
        text = self.tokenizer.decode(seq.generated) if self.tokenizer else ""
        seq.result = GenerationResult(
            seq.request.request_id,
            list(seq.request.prompt_ids),
            list(seq.generated),
            reason,
            seq.cached,
            text,
            error,
            index=seq.index,
        )
        seq.done.set()
        if seq.on_finish is not None:
            seq.on_finish(seq.result)

    def _cancel(self, seq: _Seq) -> None:
        with self._lock:
            if not seq.done.is_set():
                self.cancelled.append(seq.request.request_id)
                self._finish(seq, "stop")


def _common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
