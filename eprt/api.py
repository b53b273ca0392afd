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


class RequestError(ValueError):
    """A request that cannot be served as given; the message names the problem."""


class EngineClosed(RequestError):
    """The engine is shutting down (or broke) and takes no new requests: not the request's fault."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None  # per-request seed; None draws from the engine's generator
    stop_token_ids: tuple = ()  # extra stop ids besides the model's EOS ids
    ignore_eos: bool = False

    def validate(self, vocab_size: int) -> None:
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (is_real(self.temperature) and 0.0 <= self.temperature < math.inf):
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (is_real(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise RequestError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if self.seed is not None and (not is_int(self.seed) or self.seed < 0):
            raise RequestError(f"seed must be a non-negative integer, got {self.seed!r}")
        if not isinstance(self.stop_token_ids, (tuple, list)):
            raise RequestError(f"stop_token_ids must be a tuple of token ids, got {self.stop_token_ids!r}")
        for t in self.stop_token_ids:
            if not (is_int(t) and 0 <= t < vocab_size):
                raise RequestError(f"stop token id {t!r} is outside the vocabulary [0, {vocab_size})")


def is_int(v) -> bool:
    """An integer, NumPy's included, but not a bool (True would pass as 1)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


@dataclass
class GenerationRequest:
    prompt_ids: list  # [T] token ids
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None
    timeout_s: float | None = None  # deadline measured on the engine's clock
    image_embeds: np.ndarray | None = None  # [n, D] float32 rows for the n image placeholders
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
        return d


ENGINE_FAILED = "engine failed"  # how an error result's message begins when the engine broke, not the request
STOPPED = "not run"  # ... when the run was stopped (SIGTERM) before the request started


def is_engine_failure(result: GenerationResult) -> bool:
    """Whether ``result`` ended because the engine broke (a rank died, a model error), so the
    same request may well succeed when run again, rather than because of the request itself."""
    return result.finish_reason == "error" and (result.error or "").startswith(ENGINE_FAILED + ":")
