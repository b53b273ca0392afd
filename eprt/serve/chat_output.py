"""A chat request's reasoning and tool calls: what the server's flags resolve to
(``ChatFeatures``), what one request asks (``ChatSetup``: template variables, tools, thinking
budget), and one choice's generated tokens as a message (``ChatOutput``): the tokens inside a
thinking block are its ``reasoning``, the rest its ``content``, in which tool calls are parsed.
Streamed answers send what each step adds (``deltas``); the whole answer is the same parse of the
same text (``message``), so the deltas of a stream add up to the non-streamed answer.
docs/serving.md, "Reasoning and tool calls".
"""

from __future__ import annotations

import dataclasses
import functools
import uuid
from dataclasses import dataclass

from eprt.api import Thinking
from eprt.scheduler import thinking
from eprt.serve import harmony, reasoning
from eprt.serve.guided import compile_guide
from eprt.serve.params import FieldError
from eprt.serve.stream import TextStream
from eprt.serve.tool_calls import ToolRequest, ToolSettings, parse_tools
from eprt.serve.tool_formats import Parsed

RESERVED_KWARGS = ("messages", "tools", "documents", "add_generation_prompt")
MAX_KWARGS = 64
REASONING_EFFORTS = ("minimal", "low", "medium", "high")  # OpenAI's values; a template variable, as vLLM passes it


@dataclass(frozen=True)
class ChatFeatures:
    """The server's reasoning parser (resolved for its tokenizer) and tool settings."""

    reasoning: reasoning.ReasoningParser | None = None
    tools: ToolSettings = ToolSettings()

    @classmethod
    def resolve(cls, engine, reasoning_name: str | None, tools: ToolSettings) -> ChatFeatures:
        """ValueError naming the problem for a parser this model cannot have."""
        tok = engine.tokenizer
        if tools.parser is not None and tok is None:
            raise ValueError("--tool-call-parser needs the model's tokenizer, and this model has none")
        return cls(reasoning.resolve(reasoning_name, tok) if tok is not None else None, tools)


@dataclass
class ChatSetup:
    """What one chat request asks beyond its messages."""

    template_args: dict  # chat_template_kwargs and tools, the template's variables
    tools: ToolRequest | None = None
    thinking: Thinking | None = None
    harmony: bool = False  # gpt-oss's harmony format (its reasoning parser or tool-call parser)

    def apply(self, params, engine, guide_field: str | None):
        """``params`` with the thinking block and the guide of tool_choice required or named (compiled
        now: a 400 naming tools if it does not); FieldError when the request constrains its output
        otherwise too."""
        guide = None if self.tools is None else self.tools.guide()
        if guide is not None:
            if params.guide is not None:
                raise FieldError(guide_field, f"{guide_field} and tool_choice both constrain the output; give one")
            compile_guide(engine, guide, "tools")
        return dataclasses.replace(params, guide=guide or params.guide, thinking=self.thinking)

    def output(self, prompt: list):
        """The factory of each choice's ChatOutput (LiveRequest's ``output``), None for plain text."""
        parallel = self.tools is None or self.tools.parallel
        if self.harmony and (self.tools is None or not self.tools.guided):
            calls = self.tools is not None and self.tools.choice == "auto"
            return functools.partial(HarmonyOutput, prompt=prompt, parallel=parallel, calls=calls)
        fmt = None if self.tools is None else self.tools.output_format()
        if fmt is None and self.thinking is None:
            return None
        keep = self.tools is not None and self.tools.choice == "auto"  # the tags are text to parse
        return functools.partial(ChatOutput, prompt=prompt, spec=self.thinking, fmt=fmt, parallel=parallel, keep=keep)


def template_kwargs(body: dict) -> dict:
    """chat_template_kwargs, and reasoning_effort as the template's variable of that name (gpt-oss's
    template reads it; a template that does not ignores it, as with vLLM)."""
    args = _kwargs(body.get("chat_template_kwargs"))
    effort = body.get("reasoning_effort")
    if effort is None:
        return args
    if effort not in REASONING_EFFORTS:
        raise FieldError(
            "reasoning_effort", f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}"
        )
    if args.setdefault("reasoning_effort", effort) != effort:
        raise FieldError("reasoning_effort", "reasoning_effort differs from chat_template_kwargs' reasoning_effort")
    return args


def _kwargs(value) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_KWARGS or not all(isinstance(k, str) for k in value):
        raise FieldError(
            "chat_template_kwargs", f"chat_template_kwargs must be an object of at most {MAX_KWARGS} names"
        )
    bad = [k for k in value if k in RESERVED_KWARGS or k.startswith("_")]
    if bad:
        raise FieldError("chat_template_kwargs", f"chat_template_kwargs may not set {bad[0]!r}")
    return dict(value)


def prepare(body: dict, features: ChatFeatures | None) -> ChatSetup:
    """A chat request's ChatSetup; FieldError names a bad field."""
    features = features or ChatFeatures()
    tools = parse_tools(body, features.tools)
    args = template_kwargs(body)
    if tools is not None:
        args["tools"] = tools.tools
    uses = isinstance(features.reasoning, reasoning.HarmonyParser) or features.tools.parser in harmony.TOOL_NAMES
    return ChatSetup(args, tools, reasoning.request_thinking(body, features.reasoning), uses)


class _KeepSpecial:
    """A tokenizer whose text keeps special tokens (a tool-call format's tags may be special)."""

    def __init__(self, tok):
        self._tok = tok

    def decode(self, ids) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


class ChatOutput:
    """One choice's generated tokens as a chat message; LiveRequest feeds it as its TextStream."""

    def __init__(
        self,
        tokenizer,
        stop_strings=(),
        hidden_ids=(),
        include_stop: bool = False,
        *,
        prompt=(),
        spec=None,
        fmt=None,
        parallel=True,
        keep=False,
    ):
        """TextStream's arguments (``include_stop``: a matched stop string ends the text it stops,
        include_stop_str_in_output), then the prompt (a thinking block may open in it), the thinking
        block, the tool-call format, parallel_tool_calls, and ``keep``: special tokens kept in the content."""
        self._state = thinking.begin(spec, prompt)
        self._reasons = self._state is not None  # the message carries reasoning
        self._reasoning = TextStream(tokenizer, stop_strings, hidden_ids, include_stop)
        content_tok = _KeepSpecial(tokenizer) if keep and tokenizer else tokenizer
        self._content = TextStream(content_tok, stop_strings, hidden_ids, include_stop)
        self._fmt, self._parallel = fmt, parallel
        self._final = False
        self._sent = {"reasoning": 0, "content": 0}
        self._sent_args: list = []  # arguments characters sent, per call
        self._ids: list = []  # each call's id

    # ---- TextStream's interface (LiveRequest) ----
    def feed(self, token: int) -> str:
        channel = self._channel(int(token))
        if channel is not None:
            channel.feed(token)
        return ""

    def finish(self) -> str:
        self._reasoning.finish()
        self._content.finish()
        self._final = True
        return ""

    @property
    def stopped(self) -> bool:
        return self._reasoning.stopped or self._content.stopped

    @property
    def text(self) -> str:
        return self._content.text

    def _channel(self, token: int):
        """The stream a token belongs to: reasoning inside a block, none for a delimiter."""
        state = self._state
        if state is None:
            return self._content
        inside = state.inside
        thinking.take(state, token, ())  # (the scheduler's own rules, on the tokens it kept)
        if inside:
            if state.inside:
                return self._reasoning
            return self._content if token in state.spec.also_ends else None
        return None if state.inside else self._content

    # ---- the answer ----
    def _parsed(self) -> Parsed:
        text = self._content.shown  # (all of it once finished)
        parsed = Parsed(text) if self._fmt is None else self._fmt.parse(text, self._final)
        if not self._parallel:
            parsed.calls = parsed.calls[:1]
        return parsed

    def _call_id(self, i: int, call) -> str:
        while len(self._ids) <= i:
            self._ids.append(None)
        if self._ids[i] is None:
            self._ids[i] = call.id or "call_" + uuid.uuid4().hex[:24]
        return self._ids[i]

    @property
    def reasoning(self) -> str | None:
        return None if self._state is None else self._reasoning.shown

    def deltas(self) -> list:
        """The message's pieces new since the last call: reasoning text, content text, then each
        call's id and name (once complete) and its arguments as they grow."""
        out = []
        parsed = self._parsed()
        for key, text in (("reasoning", self.reasoning or ""), ("content", parsed.content)):
            new = text[self._sent[key] :]
            if new:
                self._sent[key] = len(text)
                out.append({"reasoning": new, "reasoning_content": new} if key == "reasoning" else {"content": new})
        for i, call in enumerate(parsed.calls):
            if i == len(self._sent_args):
                if call.name is None:
                    break
                self._sent_args.append(0)
                head = {"name": call.name, "arguments": ""}
                out.append(
                    {"tool_calls": [{"index": i, "id": self._call_id(i, call), "type": "function", "function": head}]}
                )
            new = call.arguments[self._sent_args[i] :]
            if new:
                self._sent_args[i] = len(call.arguments)
                out.append({"tool_calls": [{"index": i, "function": {"arguments": new}}]})
        return out

    def message(self) -> dict:
        """The whole message: content (None when empty beside reasoning or calls), reasoning and its
        older name reasoning_content (with a reasoning parser), tool_calls (when made)."""
        parsed = self._parsed()
        calls = [
            {"id": self._call_id(i, c), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(parsed.calls)
        ]
        reasoning_text = self.reasoning or None
        msg = {"role": "assistant", "content": parsed.content or (None if calls or reasoning_text else "")}
        if self._reasons:
            msg["reasoning"] = msg["reasoning_content"] = reasoning_text
        if calls:
            msg["tool_calls"] = calls
        return msg

    @property
    def called(self) -> bool:
        """Whether the answer holds tool calls (its finish_reason is then tool_calls)."""
        return bool(self._sent_args) or bool(self._parsed().calls)


class HarmonyOutput(ChatOutput):
    """gpt-oss's harmony messages (eprt/serve/harmony.py): every token goes to the text, the tags kept;
    the analysis channel is the reasoning, final the content, messages to functions the tool calls
    (dropped unless tool_choice is auto)."""

    def __init__(
        self, tokenizer, stop_strings=(), hidden_ids=(), include_stop=False, *, prompt=(), parallel=True, calls=True
    ):
        super().__init__(
            tokenizer,
            stop_strings,
            hidden_ids,
            include_stop,
            prompt=prompt,
            fmt=harmony.HarmonyFormat(),
            parallel=parallel,
            keep=True,
        )
        self._reasons, self._calls = True, calls

    def _parsed(self):
        parsed = super()._parsed()
        parsed.calls = parsed.calls if self._calls else []
        return parsed

    @property
    def reasoning(self) -> str:
        return self._parsed().reasoning


def split(tokenizer, prompt, token_ids, spec: Thinking, hidden_ids=()) -> tuple[str, str]:
    """(reasoning, content): the texts of a finished answer's tokens inside and outside its
    thinking blocks (``eprt run`` records, ``eprt generate --json``)."""
    out = ChatOutput(tokenizer, (), hidden_ids, prompt=prompt, spec=spec)
    for token in token_ids:
        out.feed(token)
    out.finish()
    return out.reasoning, out.text


def finish_reason(reason: str, output) -> str:
    return "tool_calls" if reason == "stop" and output is not None and output.called else reason
