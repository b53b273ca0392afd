"""Request fields shared by ``eprt serve`` and ``eprt run``: JSON values -> typed options.

Both entry points accept the same per-request fields (max_tokens, temperature, top_p,
top_k, seed, stop, timeout, and the logits processing and logprobs fields of ``PROCESSING``)
with the same checks and the same error messages (table: docs/serving.md). Every
error is a ``FieldError`` that names the offending field, so the HTTP server can answer
400 with ``param`` set and the batch runner can record the message on the line.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from eprt.api import MAX_CHOICES, MAX_LOGPROBS, RANGES, RequestError, SamplingParams, is_int

MAX_STOPS = 16  # stop strings and ids of one request (each string is searched for after every token)
# max_tokens of a chat request that sets none (eprt serve --default-max-tokens; 0: the rest of the
# context, vLLM's default): a model that never ends its turn then stops after this many tokens
DEFAULT_CHAT_MAX_TOKENS = 512
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
    include_stop: bool = False  # vLLM's include_stop_str_in_output: the matched stop string ends the text


def _get_int(body: dict, name: str, default, minimum: int) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not is_int(v) or v < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise FieldError(name, f"{name} must be {what}, got {v!r}")
    return v


def _get_bool(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise FieldError(name, f"{name} must be true or false, got {v!r}")
    return v


def _get_logprob_count(body: dict, name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not is_int(v) or not 0 <= v <= MAX_LOGPROBS:
        raise FieldError(name, f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
    return v


def _get_number(body: dict, name: str, default: float | None) -> float | None:
    """The field ``name`` as a float in its range (``eprt.api.RANGES``), ``default`` when absent."""
    v = body.get(name)
    if v is None:
        return default
    try:
        return RANGES[name].check(name, v)
    except RequestError as e:
        raise FieldError(name, str(e)) from None


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


def encode_prompt(tokenizer, text, param: str, add_special_tokens: bool | None = None) -> list:
    """A non-empty text prompt -> its token ids (special tokens: the tokenizer's default for None);
    FieldError when that cannot be done."""
    if not isinstance(text, str) or not text:
        raise FieldError(param, f"{param} must be a non-empty string, got {text!r}")
    if tokenizer is None:
        raise FieldError(param, f"this model has no tokenizer: send {param} as token ids")
    special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
    ids = tokenizer.encode(check_text(text, param), **special)
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


# the logits processing, logprobs and stop-string fields parse_options reads besides the basic ones
PROCESSING = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "bad_words",
    "allowed_token_ids",
    "min_p",
    "ignore_eos",
    "stop_token_ids",
    "logprobs",
    "prompt_logprobs",
    "include_stop_str_in_output",
)
MAX_BAD_WORDS = 128  # bad words of one request (each is matched against the output's tail every step)
MAX_TOKEN_LIST = 4096  # entries of logit_bias / allowed_token_ids


def parse_logit_bias(value, vocab_size: int) -> tuple:
    """``logit_bias``: {token id (as a string, JSON's only key type, or an int): bias in [-100, 100]}."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise FieldError("logit_bias", f"logit_bias must be an object of token id -> bias, got {value!r:.60}")
    if len(value) > MAX_TOKEN_LIST:
        raise FieldError("logit_bias", f"logit_bias has {len(value)} entries; at most {MAX_TOKEN_LIST} are allowed")
    out = []
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise FieldError("logit_bias", f"logit_bias key {key!r:.40} is not a token id") from None
        if not 0 <= token < vocab_size:
            raise FieldError("logit_bias", f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size})")
        try:
            out.append((token, RANGES["logit_bias"].check(f"logit_bias of token {token}", bias)))
        except RequestError as e:
            raise FieldError("logit_bias", str(e)) from None
    return tuple(out)


def parse_bad_words(value, tokenizer) -> tuple:
    """``bad_words`` (strings) -> token-id sequences as vLLM makes them: each word alone, and with
    a leading space when that gives a different first token and as many tokens."""
    if value is None or value == []:
        return ()
    if not isinstance(value, list) or not all(isinstance(w, str) and w.strip() for w in value):
        raise FieldError("bad_words", f"bad_words must be a list of non-empty strings, got {value!r:.60}")
    if len(value) > MAX_BAD_WORDS:
        raise FieldError("bad_words", f"bad_words has {len(value)} entries; at most {MAX_BAD_WORDS} are allowed")
    if tokenizer is None:
        raise FieldError("bad_words", "bad_words need a tokenizer and this model has none")
    out = []
    for word in value:
        plain = tuple(tokenizer.encode(check_text(word.lstrip(), "bad_words"), add_special_tokens=False))
        if plain:
            out.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(out)


def parse_allowed_ids(value, vocab_size: int) -> tuple:
    if value is None:
        return ()
    if isinstance(value, list) and len(value) > MAX_TOKEN_LIST:
        raise FieldError("allowed_token_ids", f"allowed_token_ids has more than {MAX_TOKEN_LIST} entries")
    return tuple(parse_token_ids(value, "allowed_token_ids", vocab_size))


def parse_logprobs(body: dict, chat: bool) -> int | None:
    """How many top alternatives each generated token reports, None for no logprobs: completions
    (and batch lines) send ``logprobs`` as that count; chat sends ``logprobs: true`` and
    ``top_logprobs``."""
    if not chat:
        v = body.get("logprobs")
        if v is None:
            return None
        if not is_int(v) or not 0 <= v <= MAX_LOGPROBS:
            raise FieldError("logprobs", f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        return v
    asked = body.get("logprobs")
    if asked is not None and not isinstance(asked, bool):
        raise FieldError("logprobs", f"logprobs must be true or false, got {asked!r}")
    top = body.get("top_logprobs")
    if top is not None and (not is_int(top) or not 0 <= top <= MAX_LOGPROBS):
        raise FieldError("top_logprobs", f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {top!r}")
    if top and not asked:
        raise FieldError("top_logprobs", "top_logprobs needs logprobs set to true")
    return (top or 0) if asked else None


def parse_options(
    body: dict,
    vocab_size: int,
    default_max_tokens: int,
    max_tokens_field: str = "max_tokens",
    tokenizer=None,
    chat: bool = False,
) -> RequestOptions:
    """Sampling, stop and timeout fields of one request (an HTTP body or a batch line), and the
    logits processing and logprobs fields (``PROCESSING``)."""
    max_tokens = _get_int(body, max_tokens_field, default_max_tokens, minimum=1)
    stop_strings, stop_ids = parse_stop(body.get("stop"), vocab_size)
    if body.get("stop_token_ids") not in (None, []):  # vLLM's extension: more stop ids
        stop_ids += tuple(parse_token_ids(body["stop_token_ids"], "stop_token_ids", vocab_size))
    timeout = _get_number(body, "timeout", None)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_get_number(body, "temperature", 0.0),
        top_p=_get_number(body, "top_p", 1.0),
        top_k=_get_int(body, "top_k", 0, minimum=-1),  # -1: vLLM's "no cut", as 0
        seed=_get_int(body, "seed", None, minimum=0),
        stop_token_ids=stop_ids,
        ignore_eos=_get_bool(body, "ignore_eos"),
        presence_penalty=_get_number(body, "presence_penalty", 0.0),
        frequency_penalty=_get_number(body, "frequency_penalty", 0.0),
        repetition_penalty=_get_number(body, "repetition_penalty", 1.0),
        logit_bias=parse_logit_bias(body.get("logit_bias"), vocab_size),
        min_tokens=_get_int(body, "min_tokens", 0, minimum=0),
        bad_words_ids=parse_bad_words(body.get("bad_words"), tokenizer),
        allowed_token_ids=parse_allowed_ids(body.get("allowed_token_ids"), vocab_size),
        min_p=_get_number(body, "min_p", 0.0),
        logprobs=parse_logprobs(body, chat),
        prompt_logprobs=_get_logprob_count(body, "prompt_logprobs"),
    )
    if params.min_tokens > params.max_tokens:
        raise FieldError(
            "min_tokens", f"min_tokens ({params.min_tokens}) must not exceed {max_tokens_field} ({params.max_tokens})"
        )
    return RequestOptions(params, stop_strings, timeout, _get_bool(body, "include_stop_str_in_output"))


def parse_truncation(body: dict, max_model_len: int, images: bool = False) -> int | None:
    """vLLM's ``truncate_prompt_tokens``: how many of the prompt's last tokens to keep (-1: as many
    as the context holds, max_model_len); None: the prompt is not cut. A prompt with images is
    never cut (its image placeholders must all stay)."""
    v = body.get("truncate_prompt_tokens")
    if v is None:
        return None
    if images:
        raise FieldError("truncate_prompt_tokens", "truncate_prompt_tokens cannot cut a prompt with images")
    if not is_int(v) or not (v == -1 or 1 <= v <= max_model_len):
        raise FieldError(
            "truncate_prompt_tokens",
            f"truncate_prompt_tokens must be -1 (max_model_len) or an integer in [1, max_model_len={max_model_len}], "
            f"got {v!r}",
        )
    return max_model_len if v == -1 else v


def truncate_prompt(prompt_ids: list, keep: int | None) -> list:
    """The prompt's last ``keep`` tokens (left truncation, as vLLM's); all of it for None."""
    return list(prompt_ids) if keep is None else list(prompt_ids)[-keep:]


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
