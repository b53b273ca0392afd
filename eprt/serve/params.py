"""Request fields shared by ``eprt serve`` and ``eprt run``: JSON values -> typed options.

Both entry points accept the same per-request fields (max_tokens, temperature, top_p,
top_k, seed, stop, timeout) with the same checks and the same error messages. Every
error is a ``FieldError`` that names the offending field, so the HTTP server can answer
400 with ``param`` set and the batch runner can record the message on the line.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from eprt.api import MAX_CHOICES, RequestError, SamplingParams, is_int, is_real

MAX_STOPS = 16  # stop strings and ids of one request (each string is searched for after every token)
MAX_STOP_CHARS = 1024  # characters of all the stop strings of one request together


class FieldError(RequestError):
    """A request field with a wrong type or value; ``param`` is the field's name."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class RequestOptions:
    params: SamplingParams
    stop_strings: tuple  # text stop sequences, matched on the decoded output
    timeout_s: float | None  # per-request deadline in seconds, None for no deadline


def _is_number(v) -> bool:
    return is_real(v) and math.isfinite(v)


def _get_int(body: dict, name: str, default, minimum: int) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not is_int(v) or v < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise FieldError(name, f"{name} must be {what}, got {v!r}")
    return v


def _get_number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    ok = _is_number(v) and (v > low if low_open else v >= low) and v <= high
    if not ok:
        where = f">= {low:g}" if high == math.inf else f"in {'(' if low_open else '['}{low:g}, {high:g}]"
        raise FieldError(name, f"{name} must be a number {where}, got {v!r}")
    return float(v)


def check_text(text: str, param: str) -> str:
    """``text`` itself, or FieldError if it cannot be UTF-8 encoded (JSON's ``"\\ud800"``
    escapes decode to lone surrogates, which tokenizers and the output file cannot take)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise FieldError(
            param, f"{param} has a lone surrogate {text[e.start]!r} at index {e.start}: send valid Unicode"
        ) from None
    return text


def encode_prompt(tokenizer, text, param: str) -> list:
    """A non-empty text prompt -> its token ids; FieldError when that cannot be done."""
    if not isinstance(text, str) or not text:
        raise FieldError(param, f"{param} must be a non-empty string, got {text!r}")
    if tokenizer is None:
        raise FieldError(param, f"this model has no tokenizer: send {param} as token ids")
    ids = tokenizer.encode(check_text(text, param))
    if not ids:
        raise FieldError(param, f"{param} {text[:40]!r} encodes to no tokens")
    return ids


def parse_token_ids(value, param: str, vocab_size: int) -> list:
    """A non-empty list of token ids inside the vocabulary."""
    if not isinstance(value, list) or not all(is_int(t) for t in value):
        raise FieldError(param, f"{param} must be a list of integer token ids")
    if not value:
        raise FieldError(param, f"{param} is empty")
    bad = [t for t in value if not 0 <= t < vocab_size]
    if bad:
        raise FieldError(param, f"{param} has token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    return list(value)


def parse_stop(value, vocab_size: int) -> tuple:
    """``stop``: a string or a list of strings and/or token ids -> (strings, token ids)."""
    if value is None:
        return (), ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise FieldError("stop", f"stop must be a string or a list of strings / token ids, got {value!r}")
    if len(items) > MAX_STOPS:  # each one is searched for after every token
        raise FieldError("stop", f"stop has {len(items)} entries; at most {MAX_STOPS} are allowed")
    strings, ids = [], []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise FieldError("stop", "stop strings must not be empty")
            strings.append(check_text(item, "stop"))
        elif is_int(item):
            if not 0 <= item < vocab_size:
                raise FieldError("stop", f"stop token id {item} is outside the vocabulary [0, {vocab_size})")
            ids.append(item)
        else:
            raise FieldError("stop", f"stop entries must be strings or token ids, got {item!r:.60}")
    total = sum(len(s) for s in strings)
    if total > MAX_STOP_CHARS:  # the held-back tail and the search grow with the longest one
        raise FieldError("stop", f"stop strings have {total} characters in all; at most {MAX_STOP_CHARS} are allowed")
    return tuple(strings), tuple(ids)


def parse_options(
    body: dict, vocab_size: int, default_max_tokens: int, max_tokens_field: str = "max_tokens"
) -> RequestOptions:
    """Sampling, stop and timeout fields of one request (an HTTP body or a batch line)."""
    max_tokens = _get_int(body, max_tokens_field, default_max_tokens, minimum=1)
    stop_strings, stop_ids = parse_stop(body.get("stop"), vocab_size)
    timeout = body.get("timeout")
    if timeout is not None and not (_is_number(timeout) and timeout > 0):
        raise FieldError("timeout", f"timeout must be a positive number of seconds, got {timeout!r}")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_get_number(body, "temperature", 0.0, 0.0, math.inf),
        top_p=_get_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=_get_int(body, "top_k", 0, minimum=0),
        seed=_get_int(body, "seed", None, minimum=0),
        stop_token_ids=stop_ids,
    )
    return RequestOptions(params, stop_strings, None if timeout is None else float(timeout))


def context_room(prompt_ids: list, max_model_len: int, param: str) -> int:
    """Tokens the context leaves for the completion; FieldError when it leaves none."""
    room = max_model_len - len(prompt_ids)
    if room < 1:
        raise FieldError(
            param,
            f"the prompt has {len(prompt_ids)} tokens but the context (max_model_len={max_model_len}) "
            f"leaves room for at most {max_model_len - 1}",
        )
    return room


def fit_to_context(params: SamplingParams, room: int) -> SamplingParams:
    """max_tokens past the context (10**12, say) cut to what the context leaves, as the engine
    would stop there anyway; the finish_reason is then "length"."""
    return dataclasses.replace(params, max_tokens=min(params.max_tokens, room))


def parse_choices(body: dict, params: SamplingParams, stream: bool = False) -> SamplingParams:
    """``n`` and ``best_of`` on ``params``; best_of > n cannot stream (the best are known at the end)."""
    n = body.get("n")
    n = 1 if n is None else n
    if not is_int(n) or not 1 <= n <= MAX_CHOICES:
        raise FieldError("n", f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}")
    best_of = body.get("best_of")
    if best_of is not None and (not is_int(best_of) or not n <= best_of <= MAX_CHOICES):
        raise FieldError("best_of", f"best_of must be an integer in [n={n}, {MAX_CHOICES}], got {best_of!r}")
    if best_of is not None and best_of > n and stream:
        raise FieldError("best_of", f"best_of={best_of} > n={n} cannot stream: the best choices are known at the end")
    return dataclasses.replace(params, n=n, best_of=best_of)
