"""gpt-oss's harmony format on /v1/chat/completions (``--reasoning-parser openai_gptoss`` and
``--tool-call-parser openai``, vLLM's names; ``harmony`` names both): the model's output is a run of
messages, ``<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>FORMAT]<|message|>BODY`` ended by
``<|end|>`` (more follows, after ``<|start|>assistant``), ``<|call|>`` (a tool call) or ``<|return|>``
(the answer's end); ``<|call|>`` and ``<|return|>`` are the checkpoint's EOS ids, so generation stops
there. The ``analysis`` channel is the answer's ``reasoning``, ``final`` (and a ``commentary``
preamble without a recipient) its ``content``, and a message to ``functions.NAME`` a tool call whose
arguments are its body. The prompt side is the checkpoint's chat template (the ``thinking`` field of
an earlier assistant message carries its analysis: eprt/serve/tool_calls.py). The parse works on the
text with the special tokens kept, and while streaming holds back what may still become a tag, so the
deltas of a stream add up to the whole answer's parse (eprt/serve/chat_output.py).
docs/serving.md, "Reasoning and tool calls".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from eprt.serve.tool_formats import Call, Parsed, held

REASONING_NAMES = ("openai_gptoss", "harmony")  # --reasoning-parser
TOOL_NAMES = ("openai", "harmony")  # --tool-call-parser
START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
RETURN, CALL = "<|return|>", "<|call|>"
TAGS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
ENDS = (END, RETURN, CALL)
FUNCTIONS = "functions."
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass
class HarmonyParsed(Parsed):
    reasoning: str = ""
    messages: list = field(default_factory=list)  # (channel, recipient, body) of each message, in order


def detect(template: str | None) -> bool:
    """Whether a chat template writes the harmony format."""
    return bool(template) and CHANNEL in template and MESSAGE in template and START in template


def _header(text: str) -> tuple[str | None, str | None]:
    """(channel, recipient) of a message header: ``<|channel|>NAME`` and ``to=RECIPIENT`` in any order."""
    channel = None
    if CHANNEL in text:
        rest = text.split(CHANNEL, 1)[1]
        channel = re.split(r"[\s<]", rest.strip(), maxsplit=1)[0] or None
    recipient = _RECIPIENT.search(text)
    return channel, recipient.group(1) if recipient else None


class HarmonyFormat:
    """The harmony messages of an output's text (special tokens kept): ``parse(text, final)``."""

    def __init__(self, types: dict | None = None):
        self.types = types or {}

    def parse(self, text: str, final: bool) -> HarmonyParsed:
        out, pos = HarmonyParsed(""), 0
        if text.startswith(START):  # (the generation prompt normally opened the first message)
            pos = len(START)
        while pos < len(text):
            body_at = text.find(MESSAGE, pos)
            if body_at < 0:  # a header still being written (or, final, trailing text with none)
                if final and text[pos:].strip() and not any(t in text[pos:] for t in TAGS):
                    out.content += text[pos:]
                break
            channel, recipient = _header(text[pos:body_at])
            body_at += len(MESSAGE)
            ends = [(text.find(t, body_at), t) for t in ENDS]
            end, tag = min(((p, t) for p, t in ends if p >= 0), default=(-1, None))
            body = text[body_at:end] if end >= 0 else (text[body_at:] if final else held(text[body_at:], TAGS, False))
            self._add(out, channel, recipient, body, closed=end >= 0 or final)
            if end < 0:
                break
            pos = end + len(tag)
            if text.startswith(START, pos):
                pos += len(START)
        return out

    @staticmethod
    def _add(out: HarmonyParsed, channel, recipient, body: str, closed: bool) -> None:
        out.messages.append((channel, recipient, body))
        if recipient is not None and recipient.startswith(FUNCTIONS):
            out.calls.append(Call(recipient[len(FUNCTIONS) :], body.lstrip(), closed))  # (only grows as streamed)
        elif recipient is not None:  # a built-in tool (browser, python): not a function the client gave
            return
        elif channel == "analysis":
            out.reasoning += body
        else:  # final, or a commentary preamble
            out.content += body
