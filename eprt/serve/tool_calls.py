"""Tool calling on /v1/chat/completions: ``tools``, ``tool_choice`` (none, auto, required, a named
function), ``parallel_tool_calls``, and the messages that carry calls and their results.

``required`` and a named function are enforced with the structured-output engine, as vLLM does:
a named function's output is its arguments object, valid for its ``parameters`` schema; a
required call's output is a JSON array of ``{"name", "parameters"}`` objects, one per call, each
valid for its function's schema (at most one without ``parallel_tool_calls``). ``auto`` leaves the
model free and parses its calls after the fact in its family's format (``--enable-auto-tool-choice
--tool-call-parser NAME``: eprt/serve/tool_formats.py). docs/serving.md, "Reasoning and tool calls".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from eprt.api import Guide
from eprt.serve import harmony
from eprt.serve.params import FieldError
from eprt.serve.tool_formats import TOOL_PARSERS as FAMILY_PARSERS
from eprt.serve.tool_formats import Call, Parsed, json_call, skip_ws, value_end

TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
TOOL_PARSERS = {**FAMILY_PARSERS, **{name: harmony.HarmonyFormat for name in harmony.TOOL_NAMES}}
MAX_TOOLS = 128
ANY_OBJECT = {"type": "object"}


def add_arguments(parser) -> None:
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto" (the default with tools): the model calls tools as it likes, its calls parsed '
        "by --tool-call-parser",
    )
    parser.add_argument(
        "--tool-call-parser",
        metavar="NAME",
        default=None,
        help=f"the model's tool-call format: {', '.join(TOOL_PARSERS)} (vLLM's names)",
    )


@dataclass(frozen=True)
class ToolSettings:
    """The server's flags: ``--enable-auto-tool-choice`` and ``--tool-call-parser``."""

    auto: bool = False
    parser: str | None = None

    def __post_init__(self):
        if self.parser is not None and self.parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser {self.parser!r} is unknown; choose {', '.join(TOOL_PARSERS)}")
        if self.auto and self.parser is None:
            raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(TOOL_PARSERS)})")


@dataclass
class ToolRequest:
    """A request's tools and what it asks of them."""

    tools: list  # OpenAI's function tools, as given (the template renders them)
    choice: str  # "none", "auto", "required", or the name of the function it must call
    parallel: bool = True
    parser: str | None = None  # the auto format (--tool-call-parser)
    schemas: dict = field(default_factory=dict)  # name -> parameters schema

    @property
    def guided(self) -> bool:
        return self.choice not in ("none", "auto")

    def guide(self) -> Guide | None:
        """The structured output that enforces ``required`` or a named function."""
        if self.choice == "required":
            items = [
                {
                    "type": "object",
                    "properties": {"name": {"enum": [name]}, "parameters": schema},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for name, schema in self.schemas.items()
            ]
            array = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
            return Guide("json_schema", json.dumps({**array, **({} if self.parallel else {"maxItems": 1})}))
        if self.guided:
            return Guide("json_schema", json.dumps(self.schemas[self.choice]))
        return None

    def output_format(self):
        """The format the answer's content is parsed in (None: the content is plain text)."""
        if self.choice == "required":
            return RequiredFormat()
        if self.guided:
            return NamedFormat(self.choice)
        if self.choice == "auto":
            types = {name: _types(schema) for name, schema in self.schemas.items()}
            return TOOL_PARSERS[self.parser](types)
        return None


def _types(schema) -> dict:
    props = schema.get("properties") if isinstance(schema, dict) else None
    return {k: v.get("type") for k, v in props.items() if isinstance(v, dict)} if isinstance(props, dict) else {}


def _tool(t, i: int) -> tuple[str, dict]:
    where = f"tools[{i}]"
    fn = t.get("function") if isinstance(t, dict) else None
    if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
        raise FieldError("tools", f'{where} must be {{"type": "function", "function": {{"name": ..., ...}}}}')
    name = fn.get("name")
    if not isinstance(name, str) or not name or len(name) > 64:
        raise FieldError("tools", f"{where}.function.name must be a non-empty string of at most 64 characters")
    params = fn.get("parameters", ANY_OBJECT)
    if params is None:
        params = ANY_OBJECT
    if not isinstance(params, dict):
        raise FieldError("tools", f"{where}.function.parameters must be a JSON schema object")
    for key in ("description",):
        if fn.get(key) is not None and not isinstance(fn[key], str):
            raise FieldError("tools", f"{where}.function.{key} must be a string")
    return name, params


def _choice(value, schemas: dict) -> str:
    if value in ("none", "auto", "required"):
        return value
    fn = value.get("function") if isinstance(value, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(name, str):
        raise FieldError(
            "tool_choice",
            f'tool_choice must be "none", "auto", "required" or {{"type": "function", "function": {{"name": ...}}}}, '
            f"got {value!r:.80}",
        )
    if name not in schemas:
        raise FieldError("tool_choice", f"tool_choice names the function {name!r}, which is not in tools")
    return name


def parse_tools(body: dict, settings: ToolSettings) -> ToolRequest | None:
    """The request's ToolRequest (None without tools); FieldError names a bad field."""
    settings = settings or ToolSettings()
    tools, value = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if value not in (None, "none"):
            raise FieldError("tool_choice", f"tool_choice {value!r:.60} needs tools")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise FieldError("tools", f"tools must be a list of at most {MAX_TOOLS} function tools")
    schemas = dict(_tool(t, i) for i, t in enumerate(tools))
    if len(schemas) < len(tools):
        raise FieldError("tools", "tools has two functions of one name")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise FieldError("parallel_tool_calls", f"parallel_tool_calls must be true or false, got {parallel!r:.40}")
    choice = _choice("auto" if value is None else value, schemas)
    if choice == "auto" and not settings.auto:
        raise FieldError(
            "tool_choice",
            'tool_choice "auto" (the default with tools) needs the server started with --enable-auto-tool-choice '
            'and --tool-call-parser; "required" or a named function work without them',
        )
    return ToolRequest(list(tools), choice, parallel is not False, settings.parser, schemas)


# ---- the messages that carry calls and results ----------------------------------------------------
def message_fields(m: dict, where: str) -> dict:
    """An assistant message's ``tool_calls`` (arguments given to the template as objects, as vLLM
    does, so templates may iterate them), a tool message's ``tool_call_id``, and an assistant's
    earlier ``reasoning`` / ``reasoning_content``; FieldError for a malformed one."""
    out = {}
    if m.get("tool_calls") is not None:
        if m.get("role") != "assistant" or not isinstance(m["tool_calls"], list):
            raise FieldError("messages", f"{where}.tool_calls must be a list, on an assistant message")
        out["tool_calls"] = [_message_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(m["tool_calls"])]
    for key in ("tool_call_id", "name", "reasoning_content", "reasoning"):
        if m.get(key) is not None:
            if not isinstance(m[key], str):
                raise FieldError("messages", f"{where}.{key} must be a string")
            out["reasoning_content" if key == "reasoning" else key] = m[key]
    if "reasoning_content" in out:  # gpt-oss's template reads an assistant's analysis as ``thinking``
        out["thinking"] = out["reasoning_content"]
    return out


def _message_call(c, where: str) -> dict:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise FieldError(
            "messages", f'{where} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}'
        )
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass  # a template gets the text then
    return {"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


# ---- the guided answers' formats ------------------------------------------------------------------
class NamedFormat:
    """A named function's answer: the whole output is its arguments object."""

    def __init__(self, name: str):
        self.name = name

    def parse(self, text: str, final: bool) -> Parsed:
        i = skip_ws(text, 0)
        end = value_end(text, i, final) if i < len(text) else None
        args = text[i:end] if end is not None else text[i:].rstrip()
        if final and not args:
            return Parsed("", [Call(self.name, "{}", True)])
        return Parsed("", [Call(self.name, args, end is not None)])  # (cut short by max_tokens: as streamed)


class RequiredFormat:
    """A required call's answer: ``[{"name": ..., "parameters": {...}}, ...]``."""

    def parse(self, text: str, final: bool) -> Parsed:
        i = skip_ws(text, 0)
        if i >= len(text) or text[i] != "[":
            return Parsed(text if final else "")
        out, j = Parsed(""), skip_ws(text, i + 1)
        while j < len(text) and text[j] != "]":
            call, end = json_call(text, j, final, args_keys=("parameters", "arguments"))
            if call is None or call.name is None:  # (never sent as a call)
                return out
            out.calls.append(call)  # (cut short by max_tokens when final: as streamed)
            if end is None:
                return out
            j = skip_ws(text, end)
            j = skip_ws(text, j + 1) if text[j : j + 1] == "," else j
        return out
