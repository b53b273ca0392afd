"""Tool-call formats of the model families (``--tool-call-parser NAME``, vLLM's names): a model's
output text -> its content and its calls, for a finished output or one still streaming.

``parse(text, final)`` gives the content outside the calls (a tail that may still become a tag
held back while streaming) and each call's name (None until complete) and arguments text, which
only grows as the text does: a stream sends what is new, and the parse of the whole output gives
the same strings (eprt/serve/chat_output.py). JSON-bodied formats give their arguments object's
own text; XML-bodied ones (Qwen3-Coder, GLM-4.5) build it one parameter at a time, each value
typed by the tool's schema. docs/serving.md, "Reasoning and tool calls".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

WS = " \t\r\n"


@dataclass
class Call:
    name: str | None  # None until the name is complete
    arguments: str = ""  # the arguments object's text so far
    complete: bool = False
    id: str | None = None  # the model's own call id (Kimi-K2), else one is made


@dataclass
class Parsed:
    content: str
    calls: list = field(default_factory=list)


# ---- a partial JSON scanner ------------------------------------------------------------------
def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WS:
        i += 1
    return i


def value_end(text: str, i: int, final: bool) -> int | None:
    """End (exclusive) of the JSON value starting at ``text[i]``, None while it may still grow."""
    if i >= len(text):
        return None
    if text[i] == '"':
        j = i + 1
        while j < len(text):
            if text[j] == "\\":
                j += 2
            elif text[j] == '"':
                return j + 1
            else:
                j += 1
        return None
    if text[i] in "{[":
        depth, j, in_str = 0, i, False
        while j < len(text):
            c = text[j]
            if in_str:
                j += 2 if c == "\\" else 1
                in_str = in_str and c != '"'
                continue
            if c == '"':
                in_str = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}]" + WS:
        j += 1
    return j if j < len(text) or final else None


def loads(text: str):
    """``text``'s JSON value, None when it is not JSON (a model's output may be anything)."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def object_fields(text: str, i: int, final: bool) -> tuple[dict, int | None]:
    """The top-level fields of the JSON object at ``text[i]`` as {key: (value start, value end or
    None while incomplete)}, and the object's end (None while incomplete)."""
    fields: dict = {}
    if i >= len(text) or text[i] != "{":
        return fields, None
    j = skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "}":
            return fields, j + 1
        if text[j] == ",":
            j = skip_ws(text, j + 1)
            continue
        key_end = value_end(text, j, final) if text[j] == '"' else None
        if key_end is None:
            break
        colon = skip_ws(text, key_end)
        if colon >= len(text) or text[colon] != ":":
            break
        start = skip_ws(text, colon + 1)
        end = value_end(text, start, final)
        key = loads(text[j:key_end])
        if not isinstance(key, str):
            break
        fields[key] = (start, end)
        if end is None:
            break
        j = skip_ws(text, end)
    return fields, None


def json_call(text: str, i: int, final: bool, name_key: str = "name", args_keys=("arguments", "parameters")) -> tuple:
    """(Call, end of its object or None) of a {"name": ..., "arguments": {...}} object at ``text[i]``;
    (None, None) when the text there is not such an object."""
    fields, end = object_fields(text, i, final)
    name = None
    if name_key in fields and fields[name_key][1] is not None:
        name = loads(text[slice(*fields[name_key])])
        if not isinstance(name, str):
            return None, None
    key = next((k for k in args_keys if k in fields), None)
    args = ""
    if key is not None:
        start, stop = fields[key]
        if text[start : start + 1] == "{":
            args = text[start:stop] if stop is not None else text[start:].rstrip(WS)
        elif stop is not None:  # arguments sent as a JSON string holding the object
            args = loads(text[start:stop]) if text[start] == '"' else text[start:stop]
            args = args if isinstance(args, str) else text[start:stop]
    if end is not None and name is None:
        return None, None
    return Call(name, args or ("{}" if end is not None else ""), end is not None), end


def held(text: str, tags, final: bool) -> str:
    """``text`` without a tail that may still become one of ``tags`` (nothing held when final)."""
    if final:
        return text
    for k in range(min(len(text), max(len(t) for t in tags) - 1), 0, -1):
        if any(t.startswith(text[-k:]) for t in tags):
            return text[:-k]
    return text


def between(text: str, pos: int) -> str:
    """Text after a call (``pos`` > 0) is content only once it is more than whitespace."""
    return text if pos == 0 or text.strip() else ""


# ---- arguments built parameter by parameter (XML formats) -------------------------------------
def typed_value(value: str, kind) -> str:
    """A parameter's text as JSON: parsed for a non-string schema type when it parses, else a string."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    kinds = kind if isinstance(kind, list) else [kind]
    if any(k in ("integer", "number", "boolean", "object", "array", "null") for k in kinds):
        try:
            return json.dumps(json.loads(value), ensure_ascii=False)
        except ValueError:
            pass
    return json.dumps(value, ensure_ascii=False)


def built_arguments(pairs: list, types: dict, closed: bool) -> str:
    """'{"k": v, ...' from the complete (key, value) pairs, '}' once the call is closed."""
    body = ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {typed_value(v, types.get(k))}" for k, v in pairs)
    return "{" + body + ("}" if closed else "")


# ---- the formats --------------------------------------------------------------------------------
class HermesFormat:
    """Hermes / Qwen2.5 / Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

    open, close = "<tool_call>", "</tool_call>"

    def __init__(self, types: dict | None = None):
        self.types = types or {}

    def parse(self, text: str, final: bool) -> Parsed:
        out, pos = Parsed(""), 0
        while True:
            k = text.find(self.open, pos)
            if k < 0:
                out.content += between(held(text[pos:], (self.open,), final), pos)
                return out
            out.content += between(text[pos:k], pos)
            call, end = self.body(text, k + len(self.open), final)
            if call is None:  # not a call after all: text
                out.content += text[k:] if final or end is not None else ""
                return out
            if not call.complete:  # (cut short by max_tokens when final: kept, as a stream sent it)
                if call.name is None and final:  # never sent as a call: text
                    out.content += text[k:]
                else:
                    out.calls.append(call)
                return out
            out.calls.append(call)
            close = -1 if end is None else text.find(self.close, end)  # (end None: closed by the text's end)
            pos = len(text) if close < 0 else close + len(self.close)

    def body(self, text: str, i: int, final: bool) -> tuple:
        """(Call, end) of the call body at text[i]; (None, end) when it is no call (end: None while
        that is not known yet)."""
        j = skip_ws(text, i)
        if j >= len(text):
            return (None, None) if final else (Call(None), None)
        if text[j] != "{":
            return None, j
        call, end = json_call(text, j, final)
        return (call, end) if call is not None else (None, j)


class Qwen3CoderFormat(HermesFormat):
    """Qwen3-Coder: ``<tool_call><function=NAME><parameter=K>V</parameter>...</function></tool_call>``."""

    def body(self, text: str, i: int, final: bool) -> tuple:
        j = skip_ws(text, i)
        head = "<function="
        if not text.startswith(head, j):
            return (None, j) if len(text) - j >= len(head) or final else (Call(None), None)
        gt = text.find(">", j)
        if gt < 0:
            return Call(None), None
        name, pairs, pos = text[j + len(head) : gt], [], gt + 1
        while True:
            p = skip_ws(text, pos)
            if text.startswith("</function>", p):
                end = p + len("</function>")
                return Call(name, built_arguments(pairs, self.types.get(name, {}), True), True), end
            k_end = text.find(">", p) if text.startswith("<parameter=", p) else -1
            v_end = text.find("</parameter>", k_end) if k_end >= 0 else -1
            if v_end < 0:
                closed = final and p >= len(text)
                return Call(name, built_arguments(pairs, self.types.get(name, {}), closed), closed), None
            pairs.append((text[p + len("<parameter=") : k_end], text[k_end + 1 : v_end]))
            pos = v_end + len("</parameter>")


class Glm45Format(HermesFormat):
    """GLM-4.5: ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>``."""

    def body(self, text: str, i: int, final: bool) -> tuple:
        stops = [p for p in (text.find("\n", i), text.find("<arg_key>", i), text.find(self.close, i)) if p >= 0]
        if not stops:
            return (Call(text[i:].strip(), "{}", True), len(text)) if final else (Call(None), None)
        name, pairs, pos = text[i : min(stops)].strip(), [], min(stops)
        while True:
            p = skip_ws(text, pos)
            if text.startswith(self.close, p) or final and p >= len(text):
                return Call(name, built_arguments(pairs, self.types.get(name, {}), True), True), p
            k_end = text.find("</arg_key>", p) if text.startswith("<arg_key>", p) else -1
            v_start = skip_ws(text, k_end + len("</arg_key>")) if k_end >= 0 else -1
            v_end = text.find("</arg_value>", v_start) if text.startswith("<arg_value>", v_start) else -1
            if v_end < 0:
                return Call(name, built_arguments(pairs, self.types.get(name, {}), False)), None
            pairs.append((text[p + len("<arg_key>") : k_end], text[v_start + len("<arg_value>") : v_end]))
            pos = v_end + len("</arg_value>")


class SectionFormat(HermesFormat):
    """Calls inside a section of special tokens: ``SECTION (CALL header SEP {args} CALL_END)* SECTION_END``
    (DeepSeek-V3, V3.1, Kimi-K2); ``header`` gives the name (and Kimi's call id)."""

    section, section_end, call_open, sep, call_end = "", "", "", "", ""

    def parse(self, text: str, final: bool) -> Parsed:
        k = min((p for p in (text.find(self.section), text.find(self.call_open)) if p >= 0), default=-1)
        if k < 0:
            return Parsed(held(text, (self.section, self.call_open), final))
        out, pos = Parsed(text[:k]), k
        while True:
            c = text.find(self.call_open, pos)
            end_of_section = text.find(self.section_end, pos)
            if c < 0 or 0 <= end_of_section < c:
                if end_of_section >= 0:
                    out.content += between(text[end_of_section + len(self.section_end) :], 1)
                return out
            call, pos = self.one_call(text, c + len(self.call_open), final)
            if call is None:
                return out
            if not call.complete and final and call.name is None:  # never sent as a call: text
                out.content += text[c:]
                return out
            out.calls.append(call)
            if not call.complete:
                return out

    def one_call(self, text: str, i: int, final: bool) -> tuple:
        s = text.find(self.sep, i)
        if s < 0:
            return (None, len(text)) if final else (Call(None), len(text))
        name, call_id = self.header(text[i:s])
        j = self.args_start(text, s + len(self.sep))
        end = value_end(text, j, final) if j < len(text) and text[j] == "{" else None
        args = text[j:end] if end is not None else text[j:].rstrip(WS)
        if end is None:
            return Call(name, args if args.startswith("{") else "", id=call_id), len(text)
        stop = text.find(self.call_end, end)
        return Call(name, args, True, call_id), len(text) if stop < 0 else stop + len(self.call_end)

    def header(self, text: str) -> tuple:
        return text.strip(), None

    def args_start(self, text: str, i: int) -> int:
        return skip_ws(text, i)


class DeepSeekV31Format(SectionFormat):
    section, section_end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    call_open, sep, call_end = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


class DeepSeekV3Format(DeepSeekV31Format):
    """``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``."""

    sep = "<｜tool▁sep｜>"

    def one_call(self, text: str, i: int, final: bool) -> tuple:
        s = text.find(self.sep, i)
        line = text.find("\n", s) if s >= 0 else -1
        if line < 0:
            return (None, len(text)) if final else (Call(None), len(text))
        name = text[s + len(self.sep) : line].strip()
        fence = text.find("```json", line)
        j = skip_ws(text, fence + len("```json")) if fence >= 0 else len(text)
        end = value_end(text, j, final) if j < len(text) and text[j] == "{" else None
        if end is None:
            args = text[j:].rstrip(WS)
            return Call(name, args if args.startswith("{") else ""), len(text)
        stop = text.find(self.call_end, end)
        return Call(name, text[j:end], True), len(text) if stop < 0 else stop + len(self.call_end)


class KimiK2Format(SectionFormat):
    """``<|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}<|tool_call_end|>``."""

    section, section_end = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    call_open, sep, call_end = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"

    def header(self, text: str) -> tuple:
        call_id = text.strip()
        name = call_id.split(".", 1)[-1].rsplit(":", 1)[0]
        return name, call_id


TOOL_PARSERS = {
    "hermes": HermesFormat,
    "qwen3_coder": Qwen3CoderFormat,
    "glm45": Glm45Format,
    "deepseek_v3": DeepSeekV3Format,
    "deepseek_v31": DeepSeekV31Format,
    "kimi_k2": KimiK2Format,
}
