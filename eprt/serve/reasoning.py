"""Reasoning parsers (``--reasoning-parser NAME``, vLLM's names): which tokens delimit a model
family's thinking block, chosen by name or from the checkpoint's chat template where that is
unambiguous, and a request's thinking budget (``max_thinking_tokens``, vLLM's
``thinking_token_budget``). The scheduler counts and bounds the block (eprt/scheduler/thinking.py);
the answer's ``reasoning`` is the text of the tokens inside it (eprt/serve/chat_output.py).
docs/serving.md, "Reasoning and tool calls".
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from eprt.api import Thinking, is_int
from eprt.serve import harmony
from eprt.serve.params import FieldError

log = logging.getLogger("eprt.serve")

THINK, END_THINK = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    """A family's thinking block: its delimiters' texts (single tokens of its tokenizer) and the
    tokens that also end it (output after it)."""

    start: str = THINK
    end: str = END_THINK
    also_ends: tuple = ()


# vLLM's names: <think>...</think> whether the template writes the opening tag (DeepSeek-R1's
# newer templates, V3.1 with thinking=True) or the model does (Qwen3, GLM-4.5); Kimi-K2 may also
# end its thinking by opening its tool-call section
REASONING_PARSERS = {
    "deepseek_r1": ReasoningFormat(),
    "deepseek_v3": ReasoningFormat(),
    "qwen3": ReasoningFormat(),
    "glm45": ReasoningFormat(),
    "kimi_k2": ReasoningFormat(also_ends=("<|tool_calls_section_begin|>",)),
}
BUDGET_FIELDS = ("max_thinking_tokens", "thinking_token_budget")  # eprt's name, vLLM's


@dataclass(frozen=True)
class ReasoningParser:
    """A reasoning format resolved against one tokenizer: its name and token ids."""

    name: str
    start: int
    end: int
    also_ends: tuple = ()

    def thinking(self, budget: int | None = None) -> Thinking:
        return Thinking(self.start, self.end, budget, self.also_ends)


@dataclass(frozen=True)
class HarmonyParser:
    """gpt-oss's harmony format: its reasoning is the analysis channel's messages, parsed from the
    output (eprt/serve/harmony.py), not a block of delimiter tokens the scheduler tracks."""

    name: str = harmony.REASONING_NAMES[0]


def add_arguments(parser, budget: bool = False) -> None:
    """--reasoning-parser, and with ``budget`` --max-thinking-tokens (eprt generate's prompts)."""
    if budget:
        parser.add_argument(
            "--max-thinking-tokens",
            type=int,
            default=None,
            metavar="N",
            help="at most N tokens inside the thinking block, then its end is forced (needs a reasoning parser)",
        )
    parser.add_argument(
        "--reasoning-parser",
        default="auto",
        metavar="NAME",
        help="the model's thinking block, split into the answers' reasoning and counted as reasoning tokens: "
        f"{', '.join((*REASONING_PARSERS, *harmony.REASONING_NAMES))} (vLLM's names; harmony is gpt-oss's "
        "openai_gptoss), auto (default: from the chat template, when "
        "unambiguous) or none",
    )


def check_name(name: str | None) -> None:
    """ValueError naming the choices for an unknown ``--reasoning-parser``."""
    known = (*REASONING_PARSERS, *harmony.REASONING_NAMES)
    if name not in (None, "auto", "none", *known):
        raise ValueError(f"--reasoning-parser {name!r} is unknown; choose {', '.join(known)}, auto or none")


def detect(template: str | None) -> str | None:
    """The reasoning format a chat template writes, None when it writes no thinking block or the
    family is not clear (then a name must be given)."""
    if harmony.detect(template):
        return harmony.REASONING_NAMES[0]
    if not template or THINK not in template and END_THINK not in template:
        return None
    if "<|tool_calls_section_begin|>" in template:
        return "kimi_k2"
    if "[gMASK]" in template:
        return "glm45"
    if "<｜Assistant｜>" in template:  # DeepSeek: V3.1's template takes a `thinking` switch, R1's does not
        rest = template.replace(THINK, "").replace(END_THINK, "")
        return "deepseek_v3" if re.search(r"\bthinking\b", rest) else "deepseek_r1"
    if "<|im_start|>" in template:
        return "qwen3"
    return None


def resolve(name: str | None, tokenizer) -> ReasoningParser | HarmonyParser | None:
    """``--reasoning-parser`` for this model: None for none (or auto finding none); ValueError when
    the named format's delimiters are not single tokens of the tokenizer."""
    check_name(name)
    if name in (None, "none"):
        return None
    chosen = detect(getattr(tokenizer, "chat_template", None)) if name == "auto" else name
    if chosen is None:
        return None
    if chosen in harmony.REASONING_NAMES:
        return _harmony(name, tokenizer)
    fmt = REASONING_PARSERS[chosen]
    ids = [_token_id(tokenizer, text) for text in (fmt.start, fmt.end, *fmt.also_ends)]
    missing = [text for text, i in zip((fmt.start, fmt.end, *fmt.also_ends), ids) if i is None]
    if missing:
        if name == "auto":
            log.info("reasoning parser: the template writes %s, but %s is no single token: none", chosen, missing[0])
            return None
        raise ValueError(f"--reasoning-parser {chosen}: {missing[0]!r} is not a single token of this tokenizer")
    if name == "auto":
        log.info("reasoning parser: %s (from the chat template; --reasoning-parser none turns it off)", chosen)
    return ReasoningParser(chosen, ids[0], ids[1], tuple(ids[2:]))


def _harmony(name: str, tokenizer) -> HarmonyParser | None:
    missing = [tag for tag in harmony.TAGS if _token_id(tokenizer, tag) is None]
    if missing and name == "auto":
        log.info("reasoning parser: the template writes harmony, but %s is no single token: none", missing[0])
        return None
    if missing:
        raise ValueError(f"--reasoning-parser {name}: {missing[0]!r} is not a single token of this tokenizer")
    if name == "auto":
        log.info("reasoning parser: openai_gptoss (harmony, from the chat template; --reasoning-parser none: off)")
    return HarmonyParser()


def _token_id(tokenizer, text: str) -> int | None:
    find = getattr(tokenizer, "token_id", None)
    return None if find is None else find(text)


def parse_budget(body: dict) -> int | None:
    """The request's thinking budget (``max_thinking_tokens`` or vLLM's ``thinking_token_budget``)."""
    given = {name: body[name] for name in BUDGET_FIELDS if body.get(name) is not None}
    for name, v in given.items():
        if not is_int(v) or v < 0:
            raise FieldError(name, f"{name} must be an integer >= 0, got {v!r:.40}")
    if len(set(given.values())) > 1:
        raise FieldError(BUDGET_FIELDS[1], f"max_thinking_tokens and thinking_token_budget differ: {given}")
    return next(iter(given.values()), None)


def request_thinking(body: dict, parser: ReasoningParser | HarmonyParser | None) -> Thinking | None:
    """The Thinking of a request: the parser's block with the request's budget; FieldError for a
    budget without a known thinking block (harmony's analysis channel takes none yet)."""
    budget = parse_budget(body)
    if isinstance(parser, HarmonyParser):
        if budget is not None:
            name = next(n for n in BUDGET_FIELDS if body.get(n) is not None)
            raise FieldError(name, f"{name}: gpt-oss's analysis channel (harmony) takes no thinking budget yet")
        return None
    if parser is None:
        if budget is not None:
            name = next(n for n in BUDGET_FIELDS if body.get(n) is not None)
            raise FieldError(name, f"{name} needs the model's thinking block: start the server with --reasoning-parser")
        return None
    return parser.thinking(budget)
