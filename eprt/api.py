"""Shared types at the bottom of the import graph: requests, results and the checks of
their fields, used by every layer above (clients, engine, scheduler).

T prompt tokens, N generated tokens, D hidden size.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

TOKEN_ID_LIMIT = 0xFFFFFFE0  # token ids stay below the protocol's command words (docs/protocol.md)
MAX_CHOICES = 64  # n and best_of: choices of one prompt
MAX_LOGPROBS = 20  # top alternatives reported per token at most (OpenAI's top_logprobs limit, vLLM's default)


EXIT_BAD_INPUT = 2  # every command's exit status for input it cannot take: flags, files, a request, a checkpoint


class RequestError(ValueError):
    """A request that cannot be served as given; the message names the problem."""


class EngineClosed(RequestError):
    """The engine is shutting down (or broke) and takes no new requests: not the request's fault."""


class JobFailure(RuntimeError):
    """A failure of what every request shares (a rank, the transport, the KV pool's invariants): it
    ends the job, and a per-request stage never takes it for its own request's failure
    (eprt/engine/isolation.py)."""


def as_float(v) -> float | None:
    """``v`` as a finite float; None when it is not a real number (bools are not), or not finite
    as a float: NaN, an infinity, an integer too large for a float (10**400)."""
    if not is_real(v):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


@dataclass(frozen=True)
class Range:
    """The values a numeric field takes: [low, high], (low, high] with ``low_open``."""

    low: float
    high: float = math.inf
    low_open: bool = False

    def __str__(self) -> str:
        if self.high == math.inf:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"

    def check(self, name: str, v) -> float:
        """``v`` as a float, or RequestError naming the field, the value and the range."""
        f = as_float(v)
        if f is None or not (f > self.low if self.low_open else f >= self.low) or f > self.high:
            raise RequestError(f"{name} must be a finite number {self}, got {v!r:.40}")
        return f


# Above it every realistic logit spread samples as flat; below it 1 / T stays a normal float32,
# so (logit - max) / T never meets 0 * -inf (a masked token): docs/serving.md, "Request fields".
MAX_TEMPERATURE = 1e4
# A logit is divided or multiplied by at most this: overflow would need a logit of 3.4e32 (a
# broken model, which the sampler's finite check catches; eprt/engine/sampling.py).
MAX_REPETITION_PENALTY = 1e6
RANGES = {  # the numeric sampling fields' ranges, for every entry point (docs/serving.md)
    "temperature": Range(0.0, MAX_TEMPERATURE),
    "top_p": Range(0.0, 1.0, low_open=True),
    "min_p": Range(0.0, 1.0),
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "repetition_penalty": Range(1.0 / MAX_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
    "logit_bias": Range(-100.0, 100.0),
    "timeout": Range(0.0, low_open=True),
}


GUIDE_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Guide:
    """Structured output: a grammar the generated text must follow (docs/serving.md,
    "Structured outputs"). ``spec``: a JSON schema (text), a regex, a JSON list of choices,
    a Lark/GBNF grammar, or "" for json_object."""

    kind: str
    spec: str = ""


@dataclass(frozen=True)
class Thinking:
    """A model's thinking block and one request's budget in it (docs/scenarios.md, "Thinking
    blocks"): ``start`` and ``end`` are the delimiters' token ids; ``also_ends`` are tokens that
    end a block too but are output outside it (Kimi-K2's tool-call section); ``budget``: at most
    this many tokens inside blocks, after which the ``end`` token is forced (None: no limit)."""

    start: int
    end: int
    budget: int | None = None
    also_ends: tuple = ()

    def validate(self, vocab_size: int) -> None:
        for name, t in (("start", self.start), ("end", self.end), *(("also_ends", a) for a in self.also_ends)):
            if not (is_int(t) and 0 <= t < vocab_size):
                raise RequestError(f"thinking {name} token {t!r} is outside the vocabulary [0, {vocab_size})")
        if self.start == self.end:
            raise RequestError(f"thinking start and end tokens must differ, got {self.start} for both")
        if self.budget is not None and (not is_int(self.budget) or self.budget < 0):
            raise RequestError(f"max_thinking_tokens must be a non-negative integer, got {self.budget!r}")


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut (-1 too, vLLM's "off": made 0)
    seed: int | None = None  # per-request seed; None draws from the engine's generator
    stop_token_ids: tuple = ()  # extra stop ids besides the model's EOS ids
    ignore_eos: bool = False
    n: int = 1  # choices returned (docs/design.md, "Choices")
    best_of: int | None = None  # choices generated, the n with the highest cumulative logprob returned
    guide: Guide | None = None  # structured output (a grammar the text must follow)
    # -- logits processing as vLLM applies it (docs/serving.md, "Sampling fields") -------------
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt+output tokens
    logit_bias: tuple = ()  # ((token id, bias), ...) added to the logits
    min_tokens: int = 0  # EOS and stop ids are masked until this many tokens are generated
    bad_words_ids: tuple = ()  # token-id sequences never generated (the last id masked after the others)
    allowed_token_ids: tuple = ()  # when non-empty, every other token is masked
    min_p: float = 0.0  # tokens below min_p * the top probability are cut (sampled rows)
    logprobs: int | None = None  # log-probabilities of each generated token and its top-N alternatives
    prompt_logprobs: int | None = None  # ... of each prompt token (from the second) and its top-N
    thinking: Thinking | None = None  # the model's thinking block: its tokens counted, its budget enforced

    def __post_init__(self):
        if is_int(self.top_k) and self.top_k == -1:  # vLLM's way of saying "no top-k cut"
            self.top_k = 0

    def validate(self, vocab_size: int) -> None:
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            RANGES[name].check(name, getattr(self, name))
        if not is_int(self.top_k) or self.top_k < 0:
            raise RequestError(f"top_k must be -1 or 0 (no cut) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and (not is_int(self.seed) or self.seed < 0):
            raise RequestError(f"seed must be a non-negative integer, got {self.seed!r}")
        if not isinstance(self.stop_token_ids, (tuple, list)):
            raise RequestError(f"stop_token_ids must be a tuple of token ids, got {self.stop_token_ids!r}")
        for t in self.stop_token_ids:
            if not (is_int(t) and 0 <= t < vocab_size):
                raise RequestError(f"stop token id {t!r} is outside the vocabulary [0, {vocab_size})")
        if not is_int(self.n) or not 1 <= self.n <= MAX_CHOICES:
            raise RequestError(f"n must be an integer in [1, {MAX_CHOICES}], got {self.n!r}")
        if self.best_of is not None and (not is_int(self.best_of) or not self.n <= self.best_of <= MAX_CHOICES):
            raise RequestError(f"best_of must be an integer in [n={self.n}, {MAX_CHOICES}], got {self.best_of!r}")

        guide = self.guide
        if guide is not None and not (
            isinstance(guide, Guide) and guide.kind in GUIDE_KINDS and isinstance(guide.spec, str)
        ):
            raise RequestError(f"guide must be a Guide of kind {', '.join(GUIDE_KINDS)}, got {self.guide!r:.80}")
        if self.thinking is not None:
            if not isinstance(self.thinking, Thinking):
                raise RequestError(f"thinking must be an eprt.api.Thinking, got {self.thinking!r:.80}")
            self.thinking.validate(vocab_size)

        self._validate_processing(vocab_size)

    @property
    def choices(self) -> int:
        """Choices generated: best_of when given, else n."""
        return self.n if self.best_of is None else self.best_of

    def _validate_processing(self, vocab_size: int) -> None:
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise RequestError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not (is_int(v) and 0 <= v <= MAX_LOGPROBS):
                raise RequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        for t, bias in self.logit_bias:
            if not (is_int(t) and 0 <= t < vocab_size):
                raise RequestError(f"logit_bias token id {t!r} is outside the vocabulary [0, {vocab_size})")
            RANGES["logit_bias"].check(f"logit_bias of token {t}", bias)
        for word in self.bad_words_ids:
            if not word or not all(is_int(t) and 0 <= t < vocab_size for t in word):
                raise RequestError(f"bad word {word!r} must be a non-empty sequence of ids in [0, {vocab_size})")
        for t in self.allowed_token_ids:
            if not (is_int(t) and 0 <= t < vocab_size):
                raise RequestError(f"allowed token id {t!r} is outside the vocabulary [0, {vocab_size})")

    @property
    def processes_logits(self) -> bool:
        """Whether anything but temperature, top-k and top-p touches the logits (else: the fast path)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
            or self.bad_words_ids
            or self.allowed_token_ids
            or self.min_p
        )


def is_int(v) -> bool:
    """An integer, NumPy's included, but not a bool (True would pass as 1)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


@dataclass(frozen=True)
class TokenLogprobs:
    """One token's log-probability, its rank (1: the most likely) and the top alternatives,
    best first (ties by token id): ``top`` holds (token id, logprob) pairs."""

    token_id: int
    logprob: float
    rank: int
    top: tuple = ()

    def to_json(self) -> dict:
        return {
            "token_id": self.token_id,
            "logprob": self.logprob,
            "rank": self.rank,
            "top": [[t, lp] for t, lp in self.top],
        }


@dataclass
class GenerationRequest:
    prompt_ids: list  # [T] token ids
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None
    timeout_s: float | None = None  # deadline measured on the engine's clock
    image_embeds: np.ndarray | None = None  # [n, D] float32 rows for the n image placeholders
    images: list | None = None  # encoded images (PNG/JPEG/WebP bytes), one per image placeholder (vision models)
    stream: bool = False
    on_token: Callable[[int], None] | None = None  # called for every streamed token
    adapter: str | None = None  # LoRA adapter name (the OpenAI ``model`` field); None: the base model


@dataclass
class GenerationResult:
    request_id: str | None
    prompt_ids: list
    token_ids: list  # every generated token, a terminating EOS included
    finish_reason: str  # "stop" | "length" | "timeout" | "error"
    cached_tokens: int = 0
    text: str = ""
    error: str | None = None
    accepted_tokens: int | None = None  # speculative drafts accepted; None when speculation is off
    index: int = 0  # which choice of its prompt (n, best_of)
    cumulative_logprob: float | None = None  # sum of its tokens' logprobs, when asked for (best_of)
    logprobs: list | None = None  # [N] TokenLogprobs of the generated tokens, when asked for
    prompt_logprobs: list | None = None  # [T] None for the first prompt token, then TokenLogprobs
    reasoning_tokens: int | None = None  # generated tokens inside thinking blocks (None: no thinking block known)

    def to_json(self) -> dict:
        d = {
            "prompt_ids": list(self.prompt_ids),
            "token_ids": list(self.token_ids),
            "text": self.text,
            "finish_reason": self.finish_reason,
            "cached_tokens": self.cached_tokens,
        }
        if self.request_id is not None:
            d["id"] = self.request_id
        if self.error is not None:
            d["error"] = self.error
        if self.accepted_tokens is not None:
            d["accepted_tokens"] = self.accepted_tokens
        if self.index:
            d["index"] = self.index
        if self.cumulative_logprob is not None:
            d["cumulative_logprob"] = self.cumulative_logprob
        if self.logprobs is not None:
            d["logprobs"] = [lp.to_json() for lp in self.logprobs]
        if self.prompt_logprobs is not None:
            d["prompt_logprobs"] = [None if lp is None else lp.to_json() for lp in self.prompt_logprobs]
        if self.reasoning_tokens is not None:
            d["reasoning_tokens"] = self.reasoning_tokens
        return d


ENGINE_FAILED = "engine failed"  # how an error result's message begins when the engine broke, not the request
STOPPED = "not run"  # ... when the run was stopped (SIGTERM) before the request started


def is_engine_failure(result: GenerationResult) -> bool:
    """Whether ``result`` ended because the engine broke (a rank died, a model error), so the
    same request may well succeed when run again, rather than because of the request itself."""
    return result.finish_reason == "error" and (result.error or "").startswith(ENGINE_FAILED + ":")
