"""vLLM's utility routes, in vLLM's request and response shapes (no I/O here; eprt.serve.http
routes them): ``POST /tokenize`` {prompt | messages} -> {count, max_model_len, tokens,
token_strs}, ``POST /detokenize`` {tokens} -> {prompt}, ``GET /version`` -> {version}. Every
problem is a FieldError naming the field (answered 400). Table: docs/serving.md.
"""

from __future__ import annotations

import logging

from eprt import __version__
from eprt.api import is_int
from eprt.serve import openai
from eprt.serve.adapters import pick_model
from eprt.serve.chat_output import template_kwargs
from eprt.serve.params import FieldError, check_text, parse_token_ids
from eprt.serve.tool_calls import ToolSettings, parse_tools

log = logging.getLogger("eprt.serve")

TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs"}
TOKENIZE_FIELDS |= {
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "reasoning_effort",
    "mm_processor_kwargs",
    "tools",
}


def _flag(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise FieldError(name, f"{name} must be true or false, got {v!r:.40}")
    return v


def _checked(body, engine, model_name: str) -> None:
    """A JSON object naming the served model (or one of its adapters, whose tokenizer is the
    base model's) or none, for a model with a tokenizer."""
    if not isinstance(body, dict):
        raise FieldError("body", f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise FieldError("model", f"model must be a string, got {type(model).__name__}")
        pick_model(engine, model, model_name)
    if engine.tokenizer is None:
        raise FieldError("body", "this model has no tokenizer (tokenizer.json): there is nothing to tokenize with")


def _token_strs(tokenizer, ids: list) -> list:
    """Each token's vocabulary string (vLLM's convert_ids_to_tokens); its text when the tokenizer
    has no vocabulary strings (the byte tokenizer)."""
    token_text = getattr(tokenizer, "token_text", None)
    return [(token_text(t) if token_text is not None else None) or tokenizer.decode([t]) for t in ids]


def _warn_unknown(route: str, body: dict, known: set) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        log.warning("%s request: unknown fields ignored: %s", route, ", ".join(unknown))


def _template_args(body: dict) -> dict:
    """A chat's ``tools`` and ``chat_template_kwargs``, the template's variables as a chat request
    gives them (so the count is the chat's prompt_tokens); FieldError naming a bad one."""
    if "prompt" in body:
        for name in ("tools", "chat_template_kwargs", "reasoning_effort"):
            if body.get(name) not in (None, {}, []):
                raise FieldError(name, f"{name} goes with messages (a chat), not prompt")
        return {}
    args = template_kwargs(body)
    tools = parse_tools({"tools": body.get("tools"), "tool_choice": "none"}, ToolSettings())
    if tools is not None:
        args["tools"] = tools.tools
    return args


def tokenize_body(engine, body, model_name: str) -> dict:
    """POST /tokenize: a ``prompt`` (add_special_tokens, default true) or chat ``messages`` through
    the chat template as a chat request renders them (``tools`` and ``chat_template_kwargs`` too;
    add_generation_prompt default true, add_special_tokens default false), as vLLM's."""
    _checked(body, engine, model_name)
    if ("prompt" in body) == ("messages" in body):
        raise FieldError("prompt", "give exactly one of prompt (text) or messages (a chat)")
    for name in ("continue_final_message", "chat_template", "mm_processor_kwargs"):
        if body.get(name) not in (None, False, {}, []):
            raise FieldError(name, f"{name} is not supported by /tokenize")
    template_args = _template_args(body)
    _warn_unknown("tokenize", body, TOKENIZE_FIELDS)
    tokenizer = engine.tokenizer
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise FieldError("prompt", f"prompt must be a string, got {type(prompt).__name__}")
        ids = tokenizer.encode(check_text(prompt, "prompt"), add_special_tokens=_flag(body, "add_special_tokens", True))
    else:
        generation = _flag(body, "add_generation_prompt", True)
        special = _flag(body, "add_special_tokens", False)
        ids = openai._chat_prompt(
            body["messages"],
            engine,
            add_generation_prompt=generation,
            add_special_tokens=special,
            template_args=template_args,
        )
    ids = [int(t) for t in ids]
    return {
        "count": len(ids),
        "max_model_len": engine.max_model_len,
        "tokens": ids,
        "token_strs": _token_strs(tokenizer, ids) if _flag(body, "return_token_strs", False) else None,
    }


def detokenize_body(engine, body, model_name: str) -> dict:
    """POST /detokenize: ``tokens`` (ids inside the vocabulary; [] is "") -> {"prompt": their text}."""
    _checked(body, engine, model_name)
    _warn_unknown("detokenize", body, {"model", "tokens"})
    tokens = body.get("tokens")
    if tokens == []:
        return {"prompt": ""}
    if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
        raise FieldError("tokens", f"tokens must be a list of integer token ids, got {tokens!r:.60}")
    return {"prompt": engine.tokenizer.decode(parse_token_ids(tokens, "tokens", engine.vocab_size))}


def version_body() -> dict:
    return {"version": __version__}
