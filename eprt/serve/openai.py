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
    DEFAULT_CHAT_MAX_TOKENS,
    PROCESSING,
    FieldError,
    check_text,
    context_room,
    encode_prompt,
    fit_to_context,
    parse_choices,
    parse_options,
    parse_token_ids,
    parse_truncation,
    truncate_prompt,
)
from eprt.serve.reasoning import BUDGET_FIELDS
from eprt.serve.tool_calls import TOOL_FIELDS, message_fields

log = logging.getLogger("eprt.serve")
MAX_CHARS_PER_TOKEN = 32  # text longer than max_model_len * this cannot fit the context: refused untokenized
MAX_PROMPTS = 256  # prompts of one batched /v1/completions request


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
    "verbosity": (_set, "verbosity is not supported"),
    "use_beam_search": (_set, "use_beam_search is not supported"),
    "length_penalty": (lambda v: v not in (None, 1, 1.0), "length_penalty needs beam search, which is not supported"),
    "skip_special_tokens": (lambda v: v is False, "skip_special_tokens false is not supported"),
    "spaces_between_special_tokens": (lambda v: v is False, "spaces_between_special_tokens false is not supported"),
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
    "reasoning_effort": (_set, "reasoning_effort needs /v1/chat/completions (a chat template's variable)"),
    "tool_choice": (lambda v: v not in (None, "none"), "tool_choice needs tools, on /v1/chat/completions"),
    **{
        name: (lambda v: v is not None, f"{name} needs /v1/chat/completions (its thinking block)")
        for name in BUDGET_FIELDS
    },
}
# accepted and honoured (PROCESSING: eprt.serve.params), or accepted without effect on the output
# (metadata OpenAI and vLLM also only record)
HONOURED = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop"}
HONOURED |= {"timeout", "echo", "top_logprobs", "return_token_ids", "request_id", "truncate_prompt_tokens", *PROCESSING}
HONOURED |= {"n", "best_of", "response_format", "structured_outputs", *GUIDED_FIELDS}
HONOURED |= {*TOOL_FIELDS, *BUDGET_FIELDS, "chat_template_kwargs", "reasoning_effort"}
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
    """Refuse prompts that cannot fit the context before tokenizing or checking every id (with
    truncate_prompt_tokens a prompt may be longer: the body limit bounds the work)."""
    if body.get("truncate_prompt_tokens") is not None:
        return
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
    batch = isinstance(prompt, list) and any(isinstance(p, (str, list)) for p in prompt)
    for i, one in enumerate(prompt if batch else [prompt]):
        name = f"prompt[{i}]" if batch else "prompt"
        if isinstance(one, str) and len(one) > max_chars:
            raise FieldError(
                "prompt",
                f"{name} has {len(one)} characters; at most {max_chars} "
                f"({MAX_CHARS_PER_TOKEN} per token of max_model_len={max_model_len}) are accepted",
            )
        if isinstance(one, list) and len(one) >= max_model_len:
            raise FieldError(
                "prompt",
                f"{name} has {len(one)} tokens but max_model_len={max_model_len} "
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
    include_stop: bool = False  # include_stop_str_in_output: a matched stop string ends the text
    batch: list = field(default_factory=list)  # completions of several prompts: each one's request, in order

    @property
    def requests(self) -> list:
        """The GenerationRequest of each prompt (one, unless a completion sent a list of prompts);
        choice k of prompt p is the answer's choice p * n + k, as in OpenAI's and vLLM's."""
        return self.batch or [self.request]

    def __post_init__(self):
        if not self.id:
            self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex


def _flag(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if not isinstance(v, bool):
        raise FieldError(name, f"{name} must be true or false, got {v!r}")
    return v


def _completion_prompts(prompt, engine) -> list:
    """/v1/completions' ``prompt`` -> each prompt's token ids: a string or a list of token ids (one
    prompt), or a list of strings and/or token-id lists (a batch, as OpenAI and vLLM take)."""
    if isinstance(prompt, str):
        return [encode_prompt(engine.tokenizer, prompt, "prompt")]
    if not isinstance(prompt, list):
        raise FieldError("prompt", f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    if not any(isinstance(p, (str, list)) for p in prompt):
        return [parse_token_ids(prompt, "prompt", engine.vocab_size)]
    if len(prompt) > MAX_PROMPTS:
        raise FieldError("prompt", f"prompt is a list of {len(prompt)} prompts; at most {MAX_PROMPTS} are accepted")
    out = []
    for i, one in enumerate(prompt):
        name = f"prompt[{i}]"
        try:
            if isinstance(one, str):
                out.append(encode_prompt(engine.tokenizer, one, name))
            elif isinstance(one, list):
                out.append(parse_token_ids(one, name, engine.vocab_size))
            else:
                raise FieldError(name, f"{name} must be a string or a list of token ids, got {one!r:.40}")
        except FieldError as e:
            raise FieldError("prompt", str(e)) from None
    return out


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
    messages,
    engine,
    media: MediaPolicy | None = None,
    images: list | None = None,
    add_generation_prompt: bool = True,
    add_special_tokens: bool | None = None,
    template_args: dict | None = None,
) -> list:
    """The prompt ids of a chat; ``images``: a list that collects the bytes of its image parts in
    order (None: image parts are refused); ``add_generation_prompt`` and ``add_special_tokens`` as
    vLLM's /tokenize takes them; ``template_args``: the template's other variables (tools,
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
        text = engine.tokenizer.apply_chat_template(
            msgs, add_generation_prompt=add_generation_prompt, **(template_args or {})
        )
    except _template_errors() as e:  # no template, or one that refuses these messages
        raise FieldError("messages", f"the chat template cannot render these messages: {e}") from None
    return encode_prompt(engine.tokenizer, text, "messages", add_special_tokens)


def _template_errors() -> tuple:
    """What rendering a chat template raises for messages it refuses (its raise_exception
    calls, or an undefined name in it); jinja2 is only imported once a chat comes in."""
    try:
        from jinja2 import TemplateError
    except ImportError:
        return (ValueError,)
    return (ValueError, TemplateError)


def _check_body(body, engine, chat: bool, model_name: str | None) -> tuple:
    """The checks before any prompt is read: the model (-> (model, LoRA adapter or None)), the
    prompt's size, the field types, the fields asking for what eprt does not do; unknown fields
    are named in a warning line."""
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
    return model, adapter


def _chat_prompts(body: dict, engine, media: MediaPolicy | None, template_args: dict) -> tuple:
    """([the chat's prompt ids], its image rows or None): the messages through the chat template
    (``template_args``: tools, chat_template_kwargs), cut by truncate_prompt_tokens, each image
    expanded to its placeholders (and encoded)."""
    images: list = []
    prompt_ids = _chat_prompt(body.get("messages"), engine, media, images, template_args=template_args)
    prompt_ids = truncate_prompt(prompt_ids, parse_truncation(body, engine.max_model_len, bool(images)))
    if not images:
        return [prompt_ids], None
    expanded = GenerationRequest(prompt_ids, images=images)  # before the context is sized
    engine.images.apply(expanded)
    return [expanded.prompt_ids], expanded.image_embeds


def parse_request(
    body,
    engine,
    chat: bool,
    model_name: str | None = None,
    media: MediaPolicy | None = None,
    chat_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS,
    features: chat_output.ChatFeatures | None = None,
) -> ApiRequest:
    """Validate one request body of /v1/chat/completions (chat) or /v1/completions;
    ``model_name``: the name clients use (``--served-model-name``), else the engine's;
    ``media``: where image parts may come from (data: URLs only by default);
    ``chat_max_tokens``: a chat's max_tokens when it sets none (0: the rest of the context);
    ``features``: the server's reasoning parser and tool settings."""
    model, adapter = _check_body(body, engine, chat, model_name)
    stream = _flag(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise FieldError("stream_options", "stream_options must be an object")
    include_usage = _flag(options, "include_usage")
    setup = chat_output.prepare(body, features) if chat else None
    if chat:
        prompts, image_rows = _chat_prompts(body, engine, media, setup.template_args)
        default_max = chat_max_tokens or engine.max_model_len  # then cut to what the context leaves
        max_field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    else:
        if "prompt" not in body:
            raise FieldError("prompt", "prompt is required")
        keep = parse_truncation(body, engine.max_model_len)
        prompts = [truncate_prompt(ids, keep) for ids in _completion_prompts(body["prompt"], engine)]
        image_rows, default_max, max_field = None, SamplingParams().max_tokens, "max_tokens"
    rooms = [context_room(ids, engine.max_model_len, "messages" if chat else "prompt") for ids in prompts]
    opts = parse_options(
        body, engine.vocab_size, default_max, max_tokens_field=max_field, tokenizer=engine.tokenizer, chat=chat
    )
    guide, guide_field = parse_guide(body)
    compile_guide(engine, guide, guide_field)
    params = dataclasses.replace(parse_choices(body, opts.params, stream), guide=guide)
    if setup is not None:  # tool_choice required / named: a guide of their own; the thinking block
        params = setup.apply(params, engine, guide_field)
    echo = not chat and _flag(body, "echo")
    shown = params.prompt_logprobs  # vLLM's prompt_logprobs field, reported as such
    if echo and params.logprobs is not None:  # the prompt's logprobs lead the completion's
        params.prompt_logprobs = max(params.prompt_logprobs or 0, params.logprobs)
    requests = [
        GenerationRequest(
            ids, fit_to_context(params, room), timeout_s=opts.timeout_s, image_embeds=image_rows, adapter=adapter
        )
        for ids, room in zip(prompts, rooms)
    ]
    api = ApiRequest(chat, requests[0], opts.stop_strings, stream, include_usage, model, include_stop=opts.include_stop)
    api.batch = requests if len(requests) > 1 else []
    for p, req in enumerate(requests):
        req.request_id = api.id if len(requests) == 1 else f"{api.id}-{p}"
    api.echo, api.prompt_logprobs, api.tokenizer = echo, shown, engine.tokenizer
    api.output = None if setup is None else setup.output(requests[0].prompt_ids)  # (a chat: one prompt)
    return api


# ---- responses ------------------------------------------------------------------------


def usage(result) -> dict:
    """Token counts of a result, of the choices of one prompt, or of the choices of each prompt of
    a batch (a list of such lists); each prompt is counted once."""
    if not isinstance(result, list):
        result = [result]
    groups = result if isinstance(result[0], list) else [result]
    prompt = sum(len(g[0].prompt_ids) for g in groups)
    completion = sum(len(r.token_ids) for g in groups for r in g)
    counts = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(g[0].cached_tokens for g in groups)},
    }
    thought = [r.reasoning_tokens for g in groups for r in g if r.reasoning_tokens is not None]
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


def choices_body(api: ApiRequest, results: list, outputs: dict | None = None) -> dict:
    """The whole answer of a non-streaming request, one choice per result (``result.index``).
    ``token_ids`` (an eprt extension) lists the generated ids, so a model without a tokenizer
    still shows what it generated; ``outputs``: each choice's ChatOutput, in order (reasoning, tool
    calls; None: plain text)."""
    return batch_body(api, [results], None if outputs is None else [outputs])


def batch_body(api: ApiRequest, groups: list, outputs: list | None = None) -> dict:
    """The whole answer to the prompts of a request (``groups``: each prompt's results, in order;
    ``outputs``: their ChatOutputs, alike): choice k of prompt p is choice ``p * n + k``, as in
    OpenAI's and vLLM's batched completions."""
    choices, n = [], api.request.params.n
    for p, results in enumerate(groups):
        shown = None if api.prompt_logprobs is None else vllm_prompt_logprobs(api, results[0])
        for k, result in enumerate(results):
            output = None if outputs is None else outputs[p][k]
            choices.append(_choice(api, dataclasses.replace(result, index=p * n + result.index), output))
            if shown is not None and not api.chat:
                choices[-1]["prompt_logprobs"] = shown
    body = _envelope(api, "chat.completion" if api.chat else "text_completion", choices)
    if api.prompt_logprobs is not None and api.chat:
        body["prompt_logprobs"] = vllm_prompt_logprobs(api, groups[0][0])
    body["usage"] = usage(groups)
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
