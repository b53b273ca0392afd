"""The OpenAI API shapes: request bodies -> ``ApiRequest``, results -> response dicts.

No I/O here (``eprt.serve.http`` does the HTTP). A body is size-checked against the context
first (before any tokenizing), then type-checked by the pydantic models below, then
value-checked by ``eprt.serve.params``; every problem is a ``FieldError`` naming the field
(answered 400). Unknown fields are ignored; unsupported ones (n > 1, tools, ...) are refused.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from eprt.api import GenerationRequest, GenerationResult, SamplingParams
from eprt.serve.adapters import model_entries, pick_model
from eprt.serve.params import (
    FieldError,
    check_text,
    context_room,
    encode_prompt,
    fit_to_context,
    parse_options,
    parse_token_ids,
)

MAX_CHARS_PER_TOKEN = 32  # text longer than max_model_len * this cannot fit the context: refused untokenized

# field -> (value that asks for something unsupported?, what to tell the client)
UNSUPPORTED = {
    "n": (lambda v: v not in (None, 1), "n must be 1: send one request per choice"),
    "best_of": (lambda v: v not in (None, 1), "best_of is not supported"),
    "logprobs": (lambda v: v not in (None, False, 0), "logprobs are not supported"),
    "top_logprobs": (lambda v: v not in (None, 0), "top_logprobs are not supported"),
    "echo": (lambda v: bool(v), "echo is not supported"),
    "suffix": (lambda v: bool(v), "suffix is not supported"),
    "tools": (lambda v: bool(v), "tools are not supported"),
    "response_format": (
        lambda v: v not in (None, {"type": "text"}),
        'only response_format {"type": "text"} is supported',
    ),
}
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


class _Body(BaseModel):
    """The typed fields both generation routes share; the values are checked by params.py."""

    model_config = ConfigDict(extra="allow")  # OpenAI clients send many optional fields
    model: StrictStr | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr | StrictInt] | None = None
    timeout: StrictFloat | None = None


class CompletionBody(_Body):
    prompt: StrictStr | list[Any]


class ChatCompletionBody(_Body):
    messages: list[Any]
    max_completion_tokens: StrictInt | None = None


def _check_types(body: dict, chat: bool) -> None:
    """FieldError for the first field of the wrong type (pydantic's message, with the value)."""
    try:
        (ChatCompletionBody if chat else CompletionBody).model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = str(err["loc"][0]) if err["loc"] else "body"
        where = ".".join(str(part) for part in err["loc"]) or "body"
        got = "" if err["type"] == "missing" else f", got {err.get('input')!r:.60}"
        raise FieldError(param, f"{where}: {err['msg']}{got}") from None


def _check_size(body: dict, chat: bool, max_model_len: int) -> None:
    """Refuse prompts that cannot fit the context before tokenizing or checking every id."""
    max_chars = max_model_len * MAX_CHARS_PER_TOKEN
    if chat:
        messages = body.get("messages")
        contents = [m.get("content") for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
        parts = [p.get("text") for c in contents if isinstance(c, list) for p in c if isinstance(p, dict)]
        chars = sum(len(t) for t in contents + parts if isinstance(t, str))
        if chars > max_chars:
            raise FieldError(
                "messages",
                f"the messages have {chars} characters; at most {max_chars} "
                f"({MAX_CHARS_PER_TOKEN} per token of max_model_len={max_model_len}) "
                f"are accepted",
            )
        return
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and len(prompt) > max_chars:
        raise FieldError(
            "prompt",
            f"the prompt has {len(prompt)} characters; at most {max_chars} "
            f"({MAX_CHARS_PER_TOKEN} per token of max_model_len={max_model_len}) are accepted",
        )
    if isinstance(prompt, list) and len(prompt) >= max_model_len:
        raise FieldError(
            "prompt",
            f"the prompt has {len(prompt)} tokens but max_model_len={max_model_len} "
            f"leaves room for at most {max_model_len - 1}",
        )


@dataclass
class ApiRequest:
    chat: bool  # /v1/chat/completions (else /v1/completions)
    request: GenerationRequest
    stop_strings: tuple
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with usage
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        if not self.id:
            self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex


def _flag(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if not isinstance(v, bool):
        raise FieldError(name, f"{name} must be true or false, got {v!r}")
    return v


def _completion_prompt(prompt, engine) -> list:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        return encode_prompt(engine.tokenizer, prompt, "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise FieldError("prompt", "batched prompts are not supported: send one prompt per request")
    if isinstance(prompt, list):
        return parse_token_ids(prompt, "prompt", engine.vocab_size)
    raise FieldError("prompt", f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")


def _message(m, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise FieldError("messages", f"{where} must be an object with role and content")
    role, content = m.get("role"), m.get("content")
    if role not in CHAT_ROLES:
        raise FieldError("messages", f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
    if isinstance(content, list):  # content parts: only text ones
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise FieldError(
                "messages", f'{where}.content: only text parts ({{"type": "text", "text": ...}}) are supported'
            )
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise FieldError("messages", f"{where}.content must be a string or a list of text parts, got {content!r}")
    try:
        check_text(content, "messages")
    except FieldError as e:
        raise FieldError("messages", f"{where}.content: {e}") from None
    return {"role": role, "content": content}


def _chat_prompt(messages, engine) -> list:
    if not isinstance(messages, list) or not messages:
        raise FieldError("messages", "messages must be a non-empty list of {role, content} objects")
    msgs = [_message(m, i) for i, m in enumerate(messages)]
    if engine.tokenizer is None:
        raise FieldError(
            "messages", "this model has no tokenizer (so no chat template): use /v1/completions with token ids"
        )
    try:
        text = engine.tokenizer.apply_chat_template(msgs)
    except _template_errors() as e:  # no template, or one that refuses these messages
        raise FieldError("messages", f"the chat template cannot render these messages: {e}") from None
    return encode_prompt(engine.tokenizer, text, "messages")


def _template_errors() -> tuple:
    """What rendering a chat template raises for messages it refuses (its raise_exception
    calls, or an undefined name in it); jinja2 is only imported once a chat comes in."""
    try:
        from jinja2 import TemplateError
    except ImportError:
        return (ValueError,)
    return (ValueError, TemplateError)


def parse_request(body, engine, chat: bool, model_name: str | None = None) -> ApiRequest:
    """Validate one request body of /v1/chat/completions (chat) or /v1/completions;
    ``model_name``: the name clients use (``--served-model-name``), else the engine's."""
    if not isinstance(body, dict):
        raise FieldError("body", f"the request body must be a JSON object, got {type(body).__name__}")
    model_name = model_name or engine.model_name
    model = body.get("model", model_name)
    if not isinstance(model, str):
        raise FieldError("model", f"model must be a string, got {type(model).__name__}")
    adapter = pick_model(engine, model, model_name)
    _check_size(body, chat, engine.max_model_len)
    _check_types(body, chat)
    for name, (unsupported, message) in UNSUPPORTED.items():
        if unsupported(body.get(name)):
            raise FieldError(name, message)
    stream = _flag(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise FieldError("stream_options", "stream_options must be an object")
    include_usage = _flag(options, "include_usage")
    if chat:
        prompt_ids = _chat_prompt(body.get("messages"), engine)
        room = context_room(prompt_ids, engine.max_model_len, "messages")
        # Chat answers run to the end of the context unless told otherwise, as in OpenAI's API.
        default_max = room
        max_field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    else:
        if "prompt" not in body:
            raise FieldError("prompt", "prompt is required")
        prompt_ids = _completion_prompt(body["prompt"], engine)
        room = context_room(prompt_ids, engine.max_model_len, "prompt")
        default_max, max_field = SamplingParams().max_tokens, "max_tokens"
    opts = parse_options(body, engine.vocab_size, default_max, max_tokens_field=max_field)
    params = fit_to_context(opts.params, room)
    api = ApiRequest(
        chat,
        GenerationRequest(prompt_ids, params, timeout_s=opts.timeout_s, adapter=adapter),
        opts.stop_strings,
        stream,
        include_usage,
        model,
    )
    api.request.request_id = api.id
    return api


# ---- responses ------------------------------------------------------------------------


def usage(result: GenerationResult) -> dict:
    prompt, completion = len(result.prompt_ids), len(result.token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
    }


def _envelope(api: ApiRequest, obj: str, choices: list) -> dict:
    return {"id": api.id, "object": obj, "created": api.created, "model": api.model, "choices": choices}


def response_body(api: ApiRequest, result: GenerationResult) -> dict:
    """The whole answer of a non-streaming request. ``token_ids`` (an eprt extension) lists the
    generated ids, so a model without a tokenizer still shows what it generated."""
    if api.chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": result.text},
            "logprobs": None,
            "finish_reason": result.finish_reason,
        }
    else:
        choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": result.finish_reason}
    choice["token_ids"] = list(result.token_ids)
    body = _envelope(api, "chat.completion" if api.chat else "text_completion", [choice])
    body["usage"] = usage(result)
    return body


def chunk(api: ApiRequest, text: str = "", finish_reason: str | None = None, first: bool = False) -> dict:
    """One streamed chunk: new text, or (with finish_reason) the last one of the choice."""
    if api.chat:
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    body = _envelope(api, "chat.completion.chunk" if api.chat else "text_completion", [choice])
    if api.include_usage:
        body["usage"] = None
    return body


def usage_chunk(api: ApiRequest, result: GenerationResult) -> dict:
    body = _envelope(api, "chat.completion.chunk" if api.chat else "text_completion", [])
    body["usage"] = usage(result)
    return body


def error_body(
    message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def models_body(engine, created: int, model_name: str | None = None) -> dict:
    return {
        "object": "list",
        "data": [
            {
                "id": model_name or engine.model_name,
                "object": "model",
                "created": created,
                "owned_by": "eprt",
                "max_model_len": engine.max_model_len,
            },
            *model_entries(engine, created, model_name or engine.model_name),
        ],
    }
