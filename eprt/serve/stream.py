"""Streamed token ids -> text, with stop strings (``TextStream``: never splits a multi-byte
character, holds back a tail that could still become a stop string), and one in-flight
request seen from a client thread (``LiveRequest``: the engine thread only queues ids; the
client pumps the queue and cancels the sequence once a stop string matched, or once its text
cannot be made: that request then ends with reason ``error`` naming the cause).
"""

from __future__ import annotations

import dataclasses
import queue
import time

from eprt.api import GenerationRequest
from eprt.engine.choices import ranked
from eprt.engine.isolation import one_by_one
from eprt.scheduler.interface import RowFailure
from eprt.serve.params import FieldError

_END = object()  # queued by on_finish, after every token


class TextStream:
    """Incremental detokenizer for one sequence. N generated ids."""

    def __init__(self, tokenizer, stop_strings=(), hidden_ids=(), include_stop: bool = False):
        self._tok = tokenizer
        self._stops = tuple(stop_strings)
        self._include_stop = include_stop  # the matched stop string ends the text (vLLM's include_stop_str_in_output)
        self._longest = max((len(s) for s in self._stops), default=0)
        self._hidden = frozenset(hidden_ids)  # EOS / stop ids: generated but never shown
        self._ids: list = []  # [N] visible ids
        self._prefix = 0  # ids[_prefix:_read] were decoded last time
        self._read = 0
        self._sent = 0  # len(text) already handed out
        self.text = ""
        self.stopped = False

    @property
    def shown(self) -> str:
        """The text handed out so far (all of it once finished)."""
        return self.text[: self._sent]

    def feed(self, token_id: int) -> str:
        """Add one generated id; return the new text that is safe to show."""
        if self.stopped or self._tok is None or token_id in self._hidden:
            return ""
        self._ids.append(token_id)
        return self._append(self._decode(final=False))

    def finish(self) -> str:
        """No more ids: flush any held-back text (an unfinished stop string did not match)."""
        if self.stopped or self._tok is None:
            return ""
        self._append(self._decode(final=True))
        out = self.text[self._sent :]
        self._sent = len(self.text)
        return out

    def _decode(self, final: bool) -> str:
        # Decode a short window rather than every id each step: ids[_prefix:_read] gives the
        # context (a leading-space token decodes differently alone), the rest is new.
        if self._read == len(self._ids):
            return ""
        old = self._tok.decode(self._ids[self._prefix : self._read])
        new = self._tok.decode(self._ids[self._prefix :])
        if len(new) > len(old) and (final or not new.endswith("\ufffd")):
            self._prefix, self._read = self._read, len(self._ids)
            return new[len(old) :]
        return ""

    def _append(self, delta: str) -> str:
        if not delta:
            return ""
        search_from = max(0, len(self.text) - self._longest + 1)
        self.text += delta
        hits = [(i, -len(s)) for s, i in ((s, self.text.find(s, search_from)) for s in self._stops) if i >= 0]
        if hits:
            at, minus_len = min(hits)  # the first match; at one place, the longest stop string
            self.text = self.text[: at - minus_len if self._include_stop else at]
            self.stopped = True
            safe = len(self.text)
        else:
            safe = len(self.text) - self._held_back()
        out = self.text[self._sent : safe]
        self._sent = max(self._sent, safe)
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        for k in range(min(self._longest - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0


class LiveRequest:
    """A submitted request whose tokens are consumed, as they come, on the caller's thread."""

    def __init__(
        self,
        engine,
        request: GenerationRequest,
        stop_strings=(),
        notify=None,
        submit: bool = True,
        include_stop: bool = False,
        output=None,
    ):
        tok = engine.tokenizer
        if stop_strings and tok is None:
            raise FieldError(
                "stop", "stop strings need a tokenizer and this model has none; give stop token ids instead"
            )
        self._tokens: queue.SimpleQueue = queue.SimpleQueue()
        self._notify = notify
        request.stream = True
        request.on_token = self._put
        hidden = set(request.params.stop_token_ids) | set(tok.eos_token_ids if tok else ())
        # the text of its tokens: plain, or a chat message's reasoning, content and tool calls
        self.text = (output or TextStream)(tok, stop_strings, hidden, include_stop)
        self.token_ids: list = []  # every id consumed so far, hidden ones included
        self.submitted_at = time.monotonic()
        self.first_token_at: float | None = None
        self.request_prompt = list(request.prompt_ids)
        self.wants_logprobs = request.params.logprobs is not None
        self._logprobs_taken = 0  # records of pumped tokens handed out by take_logprobs
        self._ended = False
        self._cancelled = False
        self._failure: RowFailure | None = None  # its text could not be made (detokenizing, stop strings)
        # Raises RequestError for a bad request. on_finish runs on the engine thread after
        # the last on_token, for every end (finished, stopped, cancelled, timed out, failed).
        self.handle = engine.submit(request, on_finish=lambda result: self._put(_END)) if submit else None

    @classmethod
    def choices(
        cls, engine, request: GenerationRequest, stop_strings=(), notify=None, include_stop: bool = False, output=None
    ) -> list:
        """One LiveRequest per choice of a request (``params.choices``: n, or best_of), submitted
        together so they share the prompt's prefill (``engine.submit_choices``)."""
        lives = [
            cls(engine, request, stop_strings, notify, submit=False, include_stop=include_stop, output=output)
            for _ in range(request.params.choices)
        ]
        request.on_token = None
        handles = engine.submit_choices(
            request,
            on_finish=lambda result: lives[result.index]._put(_END),
            on_tokens=[live._put for live in lives],
        )
        for live, handle in zip(lives, handles):
            live.handle = handle
        return lives

    def _put(self, item) -> None:
        self._tokens.put(item)
        if self._notify is not None:
            self._notify()

    def pump(self, timeout: float = 0.0) -> str:
        """Consume the queued ids (waiting up to ``timeout`` for the first); return new text."""
        out = []
        try:
            item = self._tokens.get(timeout=timeout) if timeout > 0 else self._tokens.get_nowait()
            while item is not _END:
                self._consume(item, out)
                item = self._tokens.get_nowait()
            self._ended = True
        except queue.Empty:
            pass
        return "".join(out)

    def _consume(self, tok: int, out: list) -> None:
        if self.text.stopped or self._failure is not None:
            return
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.token_ids.append(tok)
        out.append(self._text_of(self.text.feed, tok))
        if self.text.stopped or self._failure is not None:
            self.cancel()

    def _text_of(self, make, *args) -> str:
        """``make(*args)``, the text; "" when it raises, which fails this request (kept as its failure)."""
        (text,) = one_by_one([args], lambda a: make(*a), "detokenizing")
        if isinstance(text, RowFailure):
            self._failure = self._failure or text
            return ""
        return text

    def take_logprobs(self) -> list | None:
        """The TokenLogprobs of the tokens pumped since the last call (None: not asked for). The
        engine writes a token's record before queueing the token, so each pumped one has its own."""
        if not self.wants_logprobs:
            return None
        records = self.handle.logprobs or []
        new = records[self._logprobs_taken : len(self.token_ids)]
        self._logprobs_taken += len(new)
        return new

    def finished(self) -> bool:
        """Whether the engine is done with the request and every token has been pumped."""
        return self._ended

    def cancel(self) -> None:
        if not self._cancelled:
            self._cancelled = True
            self.handle.cancel()

    def result(self) -> tuple:
        """(the final result, the text not yet returned by ``pump``); call once finished."""
        res = self.handle.result()
        tail = "" if self._failure is not None else self._text_of(self.text.finish)
        if self._failure is not None:  # cancelled by us: the request failed here
            failed = {"finish_reason": "error", "error": self._failure.reason}
            return dataclasses.replace(res, token_ids=list(self.token_ids), text=self.text.text, **failed), ""
        if self.text.stopped:
            # The sequence was cancelled by us at a stop string: report it as a normal stop.
            res = dataclasses.replace(res, token_ids=list(self.token_ids), finish_reason="stop", error=None)
        return dataclasses.replace(res, text=self.text.text), tail


class LiveChoices:
    """The choices of one request (n, best_of) seen as one: pumped, finished and cancelled
    together; ``results()`` gives the n returned (best_of: the most likely, ranked)."""

    def __init__(
        self, engine, request: GenerationRequest, stop_strings=(), notify=None, include_stop: bool = False, output=None
    ):
        self.params = request.params
        self.lives = LiveRequest.choices(engine, request, stop_strings, notify, include_stop, output)

    @property
    def token_ids(self) -> list:
        return [t for live in self.lives for t in live.token_ids]

    def pump(self, timeout: float = 0.0) -> str:
        for live in self.lives:
            live.pump(timeout)
        return ""

    def finished(self) -> bool:
        return all(live.finished() for live in self.lives)

    def cancel(self) -> None:
        for live in self.lives:
            live.cancel()

    def results(self) -> list:
        return [result for result, _ in self.ranked()]

    def ranked(self) -> list:
        """(result, its LiveRequest) of each choice returned (best_of: the most likely, ranked)."""
        return ranked([(live.result()[0], live) for live in self.lives], self.params)
