"""The OpenAI API shapes: request bodies -> ``ApiRequest``, results -> response dicts.

No I/O here (``eprt.serve.http`` does the HTTP). A body is size-checked against the context
first (before any tokenizing), then type-checked by the pydantic models below, then
value-checked by ``eprt.serve.params``; every problem is a ``FieldError`` naming the field
(answered 400). A field OpenAI or vLLM defines is honoured, or refused when it asks for what
is not supported (tools, ...); unknown fields are named in a warning log line. Table:
docs/serving.md, "Request fields".
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from eprt.api import GenerationRequest, GenerationResult, SamplingParams
from eprt.serve import chat_output
from eprt.serve.adapters import model_entries, pick_model
from eprt.serve.guided import GUIDED_FIELDS, compile_guide, parse_guide
from eprt.serve.media import MediaPolicy, image_part_bytes, image_text
from eprt.serve.params import (
    PROCESSING,
    FieldError,
    check_text,
    context_room,
    encode_prompt,
    fit_to_context,
    parse_choices,
    parse_options,
    parse_token_ids,
)
from eprt.serve.reasoning import BUDGET_FIELDS
from eprt.serve.tool_calls import TOOL_FIELDS, message_fields

log = logging.getLogger("eprt.serve")
MAX_CHARS_PER_TOKEN = 32  # text longer than max_model_len * this cannot fit the context: refused untokenized


def _set(v) -> bool:
    return v not in (None, False, 0, "", [], {})


# field -> (value that asks for something unsupported?, what to tell the client); OpenAI's and
# vLLM's fields of both routes (chat-only ones in CHAT_UNSUPPORTED, completions-only ones below)
UNSUPPORTED = {
    "suffix": (_set, "suffix is not supported"),
    "functions": (_set, "functions (OpenAI's deprecated form) are not supported: send tools"),
    "function_call": (lambda v: v not in (None, "none", "auto"), "function_call is not supported: send tool_choice"),
    "audio": (_set, "audio output is not supported"),
    "modalities": (lambda v: v not in (None, ["text"]), 'only modalities ["text"] are supported'),
    "prediction": (_set, "prediction (predicted outputs) is not supported"),
    "web_search_options": (_set, "web_search_options is not supported"),
    "reasoning_effort": (_set, "reasoning_effort is not supported: the model has no reasoning budget"),
    "verbosity": (_set, "verbosity is not supported"),
    "use_beam_search": (_set, "use_beam_search is not supported"),
    "length_penalty": (lambda v: v not in (None, 1, 1.0), "length_penalty needs beam search, which is not supported"),
    "include_stop_str_in_output": (_set, "include_stop_str_in_output is not supported"),
    "skip_special_tokens": (lambda v: v is False, "skip_special_tokens false is not supported"),
    "spaces_between_special_tokens": (lambda v: v is False, "spaces_between_special_tokens false is not supported"),
    "truncate_prompt_tokens": (_set, "truncate_prompt_tokens is not supported"),
    "logits_processors": (_set, "logits_processors are not supported"),
    "vllm_xargs": (_set, "vllm_xargs is not supported"),
    "guided_decoding_backend": (_set, "guided_decoding_backend is not supported"),
    "guided_whitespace_pattern": (_set, "guided_whitespace_pattern is not supported"),
    "structural_tag": (_set, "structural_tag is not supported"),
    "add_special_tokens": (_set, "add_special_tokens is not supported"),
    "return_tokens_as_token_ids": (_set, "return_tokens_as_token_ids is not supported"),
    "cache_salt": (_set, "cache_salt is not supported"),
    "kv_transfer_params": (_set, "kv_transfer_params is not supported"),
    "mm_processor_kwargs": (_set, "mm_processor_kwargs is not supported"),
    "prompt_embeds": (_set, "prompt_embeds is not supported"),
    "priority": (_set, "priority is not supported: requests are served first come, first served"),
}
CHAT_UNSUPPORTED = {
    "echo": (_set, "echo (of the last message) is not supported on chat completions"),
    "add_generation_prompt": (lambda v: v is False, "add_generation_prompt false is not supported"),
    "continue_final_message": (_set, "continue_final_message is not supported"),
    "documents": (_set, "documents are not supported"),
    "chat_template": (_set, "chat_template is not supported: the model's own template is used"),
}
# chat's fields that completions refuse (parallel_tool_calls: accepted, no effect)
COMPLETION_UNSUPPORTED = {
    "tools": (_set, "tools need /v1/chat/completions"),
    "tool_choice": (lambda v: v not in (None, "none"), "tool_choice needs tools, on /v1/chat/completions"),
    **{
        name: (lambda v: v is not None, f"{name} needs /v1/chat/completions (its thinking block)")
        for name in BUDGET_FIELDS
    },
}
# accepted and honoured (PROCESSING: eprt.serve.params), or accepted without effect on the output
# (metadata OpenAI and vLLM also only record)
HONOURED = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop"}
HONOURED |= {"timeout", "echo", "top_logprobs", "return_token_ids", "request_id", *PROCESSING}
HONOURED |= {"n", "best_of", "response_format", "structured_outputs", *GUIDED_FIELDS}
HONOURED |= {*TOOL_FIELDS, *BUDGET_FIELDS, "chat_template_kwargs"}
NO_EFFECT = {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}
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
    n: StrictInt | None = None
    best_of: StrictInt | None = None


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
    echo: bool = False  # completions: the prompt's text (and logprobs) lead the answer
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs as asked (None: not reported)
    tokenizer: Any = None  # token strings of logprobs (None: "token_id:<id>")
    output: Any = None  # chat: each choice's ChatOutput factory (reasoning, tool calls); None: plain text
    streamed_chars: dict = field(default_factory=dict)  # choice -> text_offset of its next streamed token

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


def _message(m, i: int, on_image=None) -> dict:
    """One chat message with its content as text; ``on_image(part, where)`` gives the text that
    stands for an ``image_url`` part (None: image parts are refused)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise FieldError("messages", f"{where} must be an object with role and content")
    role, content = m.get("role"), m.get("content")
    if role not in CHAT_ROLES:
        raise FieldError("messages", f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
    if isinstance(content, list):  # content parts: text, and image_url ones for a vision model
        texts = []
        for j, p in enumerate(content):
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                texts.append(p["text"])
            elif isinstance(p, dict) and p.get("type") == "image_url" and on_image is not None:
                texts.append(on_image(p, f"{where}.content[{j}]"))
            else:
                kinds = '{"type": "text", "text": ...}' + (' or {"type": "image_url", ...}' if on_image else "")
                raise FieldError("messages", f"{where}.content: only {kinds} parts are supported")
        content = "".join(texts)
    extra = message_fields(m, where)  # tool calls and results, earlier reasoning
    if content is None and "tool_calls" in extra:
        return {"role": role, "content": None, **extra}
    if not isinstance(content, str):
        raise FieldError("messages", f"{where}.content must be a string or a list of text parts, got {content!r}")
    try:
        check_text(content, "messages")
    except FieldError as e:
        raise FieldError("messages", f"{where}.content: {e}") from None
    return {"role": role, "content": content, **extra}


def _chat_prompt(
    messages, engine, media: MediaPolicy | None = None, images: list | None = None, template_args: dict | None = None
) -> list:
    """The prompt ids of a chat; ``images``: a list that collects the bytes of its image parts in
    order (None: image parts are refused); ``template_args``: the template's other variables (tools,
    chat_template_kwargs)."""
    if not isinstance(messages, list) or not messages:
        raise FieldError("messages", "messages must be a non-empty list of {role, content} objects")

    def on_image(part: dict, where: str) -> str:
        images.append(image_part_bytes(part, media or MediaPolicy(), "messages", where))
        return image_text(engine, "messages")

    msgs = [_message(m, i, None if images is None else on_image) for i, m in enumerate(messages)]
    if engine.tokenizer is None:
        raise FieldError(
            "messages", "this model has no tokenizer (so no chat template): use /v1/completions with token ids"
        )
    try:
        text = engine.tokenizer.apply_chat_template(msgs, **(template_args or {}))
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


def parse_request(
    body,
    engine,
    chat: bool,
    model_name: str | None = None,
    media: MediaPolicy | None = None,
    features: chat_output.ChatFeatures | None = None,
) -> ApiRequest:
    """Validate one request body of /v1/chat/completions (chat) or /v1/completions;
    ``model_name``: the name clients use (``--served-model-name``), else the engine's;
    ``media``: where image parts may come from (data: URLs only by default); ``features``: the
    server's reasoning parser and tool settings."""
    if not isinstance(body, dict):
        raise FieldError("body", f"the request body must be a JSON object, got {type(body).__name__}")
    model_name = model_name or engine.model_name
    model = body.get("model", model_name)
    if not isinstance(model, str):
        raise FieldError("model", f"model must be a string, got {type(model).__name__}")
    adapter = pick_model(engine, model, model_name)
    _check_size(body, chat, engine.max_model_len)
    _check_types(body, chat)
    refused = {**UNSUPPORTED, **(CHAT_UNSUPPORTED if chat else COMPLETION_UNSUPPORTED)}
    for name, (unsupported, message) in refused.items():
        if unsupported(body.get(name)):
            raise FieldError(name, message)
    known = HONOURED | NO_EFFECT | set(UNSUPPORTED) | ({"messages", "max_completion_tokens"} if chat else {"prompt"})
    unknown = sorted(set(body) - known - set(CHAT_UNSUPPORTED if chat else ()))
    if unknown:
        log.warning("%s request: unknown fields ignored: %s", "chat" if chat else "completions", ", ".join(unknown))
    stream = _flag(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise FieldError("stream_options", "stream_options must be an object")
    include_usage = _flag(options, "include_usage")
    setup = chat_output.prepare(body, features) if chat else None
    if chat:
        images: list = []
        prompt_ids, image_rows = _chat_prompt(body.get("messages"), engine, media, images, setup.template_args), None
        if images:  # expanded to the placeholders of each image (and encoded) before the context is sized
            expanded = GenerationRequest(prompt_ids, images=images)
            engine.images.apply(expanded)
            prompt_ids, image_rows = expanded.prompt_ids, expanded.image_embeds
        room = context_room(prompt_ids, engine.max_model_len, "messages")
        # Chat answers run to the end of the context unless told otherwise, as in OpenAI's API.
        default_max = room
        max_field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    else:
        if "prompt" not in body:
            raise FieldError("prompt", "prompt is required")
        prompt_ids, image_rows = _completion_prompt(body["prompt"], engine), None
        room = context_room(prompt_ids, engine.max_model_len, "prompt")
        default_max, max_field = SamplingParams().max_tokens, "max_tokens"
    opts = parse_options(
        body, engine.vocab_size, default_max, max_tokens_field=max_field, tokenizer=engine.tokenizer, chat=chat
    )
    guide, guide_field = parse_guide(body)
    compile_guide(engine, guide, guide_field)
    params = dataclasses.replace(fit_to_context(parse_choices(body, opts.params, stream), room), guide=guide)
    if setup is not None:  # tool_choice required / named: a guide of their own; the thinking block
        params = setup.apply(params, engine, guide_field)
    echo = not chat and _flag(body, "echo")
    shown = params.prompt_logprobs  # vLLM's prompt_logprobs field, reported as such
    if echo and params.logprobs is not None:  # the prompt's logprobs lead the completion's
        params.prompt_logprobs = max(params.prompt_logprobs or 0, params.logprobs)
    api = ApiRequest(
        chat,
        GenerationRequest(prompt_ids, params, timeout_s=opts.timeout_s, image_embeds=image_rows, adapter=adapter),
        opts.stop_strings,
        stream,
        include_usage,
        model,
    )
    api.request.request_id = api.id
    api.echo, api.prompt_logprobs, api.tokenizer = echo, shown, engine.tokenizer
    api.output = None if setup is None else setup.output(prompt_ids)
    return api


# ---- responses ------------------------------------------------------------------------


def usage(result) -> dict:
    """Token counts of a result, or of the choices of one prompt (the prompt counted once)."""
    results = result if isinstance(result, list) else [result]
    result = results[0]
    prompt, completion = len(result.prompt_ids), sum(len(r.token_ids) for r in results)
    counts = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
    }
    thought = [r.reasoning_tokens for r in results if r.reasoning_tokens is not None]
    if thought:  # the tokens inside the choices' thinking blocks (a reasoning parser is on)
        counts["completion_tokens_details"] = {"reasoning_tokens": sum(thought)}
    return counts


def _envelope(api: ApiRequest, obj: str, choices: list) -> dict:
    return {"id": api.id, "object": obj, "created": api.created, "model": api.model, "choices": choices}


def prompt_text(api: ApiRequest, result: GenerationResult) -> str:
    """The prompt's text that ``echo`` puts before the completion ("" without it)."""
    if not api.echo or api.tokenizer is None:
        return ""
    return api.tokenizer.decode(list(result.prompt_ids))


def response_body(api: ApiRequest, result: GenerationResult) -> dict:
    """The whole answer of a non-streaming request of one choice."""
    return choices_body(api, [result])


def choices_body(api: ApiRequest, results: list, outputs: dict | None = None) -> dict:
    """The whole answer of a non-streaming request, one choice per result (``result.index``).
    ``token_ids`` (an eprt extension) lists the generated ids, so a model without a tokenizer
    still shows what it generated; ``outputs``: each choice's ChatOutput by index (reasoning,
    tool calls)."""
    choices = [_choice(api, result, (outputs or {}).get(result.index)) for result in results]
    body = _envelope(api, "chat.completion" if api.chat else "text_completion", choices)
    if api.prompt_logprobs is not None:
        shown = vllm_prompt_logprobs(api, results[0])
        if api.chat:
            body["prompt_logprobs"] = shown
        else:
            for choice in choices:
                choice["prompt_logprobs"] = shown
    body["usage"] = usage(results)
    return body


def _choice(api: ApiRequest, result: GenerationResult, output=None) -> dict:
    records = None if result.logprobs is None else result.logprobs[: len(result.token_ids)]
    if api.chat:
        choice = {
            "index": result.index,
            "message": {"role": "assistant", "content": result.text} if output is None else output.message(),
            "logprobs": None if records is None else chat_logprobs(api, records),
            "finish_reason": chat_output.finish_reason(result.finish_reason, output),
        }
    else:
        echoed, echoed_ids = prompt_text(api, result), list(result.prompt_ids) + list(result.token_ids)
        if records is not None and api.echo:
            records = list(result.prompt_logprobs or [None] * len(result.prompt_ids)) + records
        choice = {
            "index": result.index,
            "text": echoed + result.text,
            "logprobs": None if records is None else completion_logprobs(api, records, 0, echoed_ids),
            "finish_reason": result.finish_reason,
        }
    choice["token_ids"] = list(result.token_ids)
    return choice


# ---- logprobs in OpenAI's shapes ------------------------------------------------------------


def token_text(api: ApiRequest, token: int) -> str:
    return f"token_id:{token}" if api.tokenizer is None else api.tokenizer.decode([token])


def chat_logprobs(api: ApiRequest, records: list) -> dict:
    """Chat's ``logprobs``: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""

    def entry(token: int, logprob: float) -> dict:
        text = token_text(api, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**entry(r.token_id, r.logprob), "top_logprobs": [entry(t, lp) for t, lp in r.top]} for r in records
        ]
    }


def completion_logprobs(api: ApiRequest, records: list, offset: int, ids=None) -> dict:
    """Completions' ``logprobs``: tokens, token_logprobs, top_logprobs (the top alternatives and
    the token itself, as vLLM reports them) and text_offset from ``offset``; a None record (the
    first echoed prompt token, whose id is ids[i]) has null logprobs."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for i, r in enumerate(records):
        text = token_text(api, ids[i] if r is None else r.token_id)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if r is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(r.logprob)
        top = {token_text(api, t): lp for t, lp in r.top}
        top.setdefault(text, r.logprob)
        out["top_logprobs"].append(top)
    return out


def vllm_prompt_logprobs(api: ApiRequest, result: GenerationResult) -> list:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then {token id: {logprob, rank,
    decoded_token}} of the prompt token and its top alternatives."""
    out = []
    for r in result.prompt_logprobs or [None] * len(result.prompt_ids):
        if r is None:
            out.append(None)
            continue
        ranked = {r.token_id: (r.logprob, r.rank)}
        for i, (t, lp) in enumerate(r.top[: api.prompt_logprobs]):
            ranked.setdefault(t, (lp, i + 1))
        out.append(
            {
                str(t): {"logprob": lp, "rank": rank, "decoded_token": token_text(api, t)}
                for t, (lp, rank) in ranked.items()
            }
        )
    return out


def echo_chunk(api: ApiRequest, prompt_ids: list, prompt_logprobs: list | None, index: int = 0) -> dict:
    """The streamed prompt of an ``echo`` completion, with its logprobs when they are asked for."""
    text = "" if api.tokenizer is None else api.tokenizer.decode(list(prompt_ids))
    records = None
    if api.request.params.logprobs is not None:
        records = list(prompt_logprobs or [None] * len(prompt_ids))
    return chunk(api, text, records=records, ids=list(prompt_ids), index=index)


def chunk(
    api: ApiRequest,
    text: str = "",
    finish_reason: str | None = None,
    first: bool = False,
    records=None,
    ids=None,
    index: int = 0,
    delta: dict | None = None,
) -> dict:
    """One streamed chunk of choice ``index``: new text, or (with finish_reason) its last one;
    ``records``: the TokenLogprobs of the tokens it brings (logprobs asked for; None entries,
    the first echoed prompt token, take their id from ``ids``); ``delta``: a chat delta's
    fields instead of text (reasoning, tool calls: eprt/serve/chat_output.py)."""
    if api.chat:
        if delta is None:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        shown = None if records is None else chat_logprobs(api, records)
        choice = {"index": index, "delta": delta, "logprobs": shown, "finish_reason": finish_reason}
    else:
        shown = None if records is None else completion_logprobs(api, records, api.streamed_chars.get(index, 0), ids)
        if shown and shown["tokens"]:
            api.streamed_chars[index] = shown["text_offset"][-1] + len(shown["tokens"][-1])
        choice = {"index": index, "text": text, "logprobs": shown, "finish_reason": finish_reason}
    body = _envelope(api, "chat.completion.chunk" if api.chat else "text_completion", [choice])
    if api.include_usage:
        body["usage"] = None
    return body


def usage_chunk(api: ApiRequest, result) -> dict:
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
