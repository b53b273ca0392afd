"""Reasoning and tool calls of each model family through the server, with the official ``openai``
client: the real engine on a tiny checkpoint whose chat template and tokenizer follow the family
(tests/chat_checkpoints.py), the server in this process with the family's parsers. A random model
writes neither thinking blocks nor calls, so the template opens the block (or a logit bias does)
and the budget ends it, and ``tool_choice`` auto is steered by a grammar into the family's own
call, its tags as their own tokens; the parsing and the streaming are the server's real ones.
Streamed deltas must add up to the non-streamed answer."""

import json
import re
import subprocess
import sys

import pytest
from chat_checkpoints import TAGS, build_chat_checkpoint
from test_server import running_server

from eprt.engine.engine import EngineConfig, launch_engine
from eprt.serve.tool_calls import ToolSettings

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}
CITY, DAYS = "[a-z]{1,5}", "[1-9]"


def grammar(*parts) -> str:
    """A Lark grammar (llguidance's) of one call: ``<tag>`` parts are the tag's own token (as the
    family's models write it: the parser sees the tag's text), ``/re/`` parts regexes, the others
    literal text."""

    def one(part: str) -> str:
        if part.startswith("<") and part.endswith(">") and part in TAGS:
            return f"<[{256 + TAGS.index(part)}]>"
        if part.startswith("/") and part.endswith("/"):
            return part
        return json.dumps(part, ensure_ascii=False)

    return "start: " + " ".join(one(p) for p in parts)


JSON_ARGS = ('{"city": "', f"/{CITY}/", '", "days": ', f"/{DAYS}/", "}")
# family -> (tool-call parser, grammar of one call in its format, request extras)
FAMILIES = {
    "qwen3": (
        "hermes",
        grammar("<tool_call>", '\n{"name": "get_weather", "arguments": ', *JSON_ARGS, "}\n", "</tool_call>"),
        {},
    ),
    "deepseek_v3": (
        "deepseek_v31",
        grammar(
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁call▁begin｜>",
            "get_weather",
            "<｜tool▁sep｜>",
            *JSON_ARGS,
            "<｜tool▁call▁end｜>",
            "<｜tool▁calls▁end｜>",
        ),
        {"chat_template_kwargs": {"thinking": True}},
    ),
    "glm45": (
        "glm45",
        grammar(
            "<tool_call>",
            "get_weather\n",
            "<arg_key>",
            "city",
            "</arg_key>",
            "\n",
            "<arg_value>",
            f"/{CITY}/",
            "</arg_value>",
            "\n",
            "<arg_key>",
            "days",
            "</arg_key>",
            "\n",
            "<arg_value>",
            f"/{DAYS}/",
            "</arg_value>",
            "\n",
            "</tool_call>",
        ),
        {"logit_bias": {"258": 100}},  # GLM-4.5 opens its own block: the bias makes the random model do so
    ),
    "kimi_k2": (
        "kimi_k2",
        grammar(
            "<|tool_calls_section_begin|>",
            "<|tool_call_begin|>",
            "functions.get_weather:0",
            "<|tool_call_argument_begin|>",
            *JSON_ARGS,
            "<|tool_call_end|>",
            "<|tool_calls_section_end|>",
        ),
        {},
    ),
    "qwen3_coder": (
        "qwen3_coder",
        grammar(
            "<tool_call>",
            "\n<function=get_weather>\n<parameter=city>\n",
            f"/{CITY}/",
            "\n</parameter>\n<parameter=days>\n",
            f"/{DAYS}/",
            "\n</parameter>\n</function>\n",
            "</tool_call>",
        ),
        {},
    ),
}
THINKS = {"qwen3", "deepseek_v3", "glm45", "kimi_k2"}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, checkpoint, tmp_path_factory):
    name = request.param
    model = build_chat_checkpoint(checkpoint, str(tmp_path_factory.mktemp("chat")), name)
    parser = FAMILIES[name][0]
    with launch_engine(EngineConfig(model=model, device="cpu", max_batch=4, max_model_len=512)) as engine:
        with running_server(engine, reasoning_parser="auto", tools=ToolSettings(True, parser)) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
            yield name, client, engine.model_name


def ask(family, stream: bool, **kw):
    name, client, model = family
    _, lark, extra = FAMILIES[name]
    body = {"structured_outputs": {"grammar": lark}, "max_thinking_tokens": 3, **extra}
    if name not in THINKS:
        body.pop("max_thinking_tokens")
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        max_tokens=200,
        stream=stream,
        extra_body=body,
        **({"stream_options": {"include_usage": True}} if stream else {}),
        **kw,
    )


def reassembled(stream) -> dict:
    """A stream's deltas added up: reasoning, content, each call by index, the finish reason, usage."""
    out = {"reasoning": "", "content": "", "calls": {}, "finish": None, "usage": None}
    for chunk in stream:
        if chunk.usage is not None:
            out["usage"] = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            out["reasoning"] += (delta.model_extra or {}).get("reasoning") or ""
            out["content"] += delta.content or ""
            for call in delta.tool_calls or []:
                got = out["calls"].setdefault(call.index, {"id": None, "name": None, "arguments": ""})
                if call.id is not None:
                    assert got["id"] is None and got["arguments"] == ""  # the id and name come first, once
                    got["id"], got["name"] = call.id, call.function.name
                got["arguments"] += call.function.arguments or ""
            out["finish"] = choice.finish_reason or out["finish"]
    return out


def test_a_call_in_the_familys_format_is_parsed_streamed_or_not(family):
    name = family[0]
    whole = ask(family, stream=False)
    choice = whole.choices[0]
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(args) == {"city", "days"}
    assert re.fullmatch(CITY, args["city"]) and 1 <= args["days"] <= 9
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    parts = reassembled(ask(family, stream=True))
    assert parts["calls"] == {
        0: {"id": parts["calls"][0]["id"], "name": "get_weather", "arguments": call.function.arguments}
    }
    assert parts["finish"] == "tool_calls" and parts["content"] == ""
    if name == "kimi_k2":  # the model's own call id
        assert call.id == parts["calls"][0]["id"] == "functions.get_weather:0"
    reasoning = (choice.message.model_extra or {}).get("reasoning")
    if name in THINKS:
        assert whole.usage.completion_tokens_details.reasoning_tokens == 3
        assert parts["usage"].completion_tokens_details.reasoning_tokens == 3
        assert reasoning == parts["reasoning"] == choice.message.model_extra["reasoning_content"]
    else:
        assert reasoning is None and whole.usage.completion_tokens_details is None


def test_a_tool_result_renders_through_the_familys_template(family):
    name, client, model = family
    call = {"id": "functions.get_weather:0", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"},
    ]
    answer = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=2,
        extra_body={"prompt_logprobs": 0},
    )
    prompt = "".join(next(iter(entry.values()))["decoded_token"] for entry in answer.model_extra["prompt_logprobs"][1:])
    assert "sunny, 21 C" in prompt and "Paris" in prompt and "get_weather" in prompt


PROMPT = (
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"  # the block opened, as Qwen3's template does
)


def test_generate_json_and_run_records_split_reasoning(checkpoint, tmp_path):
    """``eprt generate --json`` and ``eprt run`` records: ``reasoning_tokens``, ``reasoning`` (the
    block's text) and ``text`` (the rest); the reasoning parser chosen from the template."""
    from tokenizers import Tokenizer

    model = build_chat_checkpoint(checkpoint, str(tmp_path), "qwen3")
    tok = Tokenizer.from_file(f"{model}/tokenizer.json")
    cli = [sys.executable, "-m", "eprt.cli"]
    flags = ["--model", model, "--device", "cpu", "--max-batch", "2"]
    out = subprocess.run(
        [*cli, "generate", *flags, "--prompt", PROMPT, "--max-tokens", "9", "--max-thinking-tokens", "4", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    (rec,) = [json.loads(line) for line in out.stdout.splitlines()]
    ids = rec["token_ids"]
    assert rec["reasoning_tokens"] == 4 and ids[4] == 259
    assert rec["reasoning"] == tok.decode(ids[:4]) and rec["text"] == tok.decode([t for t in ids[5:] if t != 257])
    lines = tmp_path / "in.jsonl"
    lines.write_text(json.dumps({"id": "a", "prompt": PROMPT, "max_tokens": 9, "thinking_token_budget": 4}) + "\n")
    subprocess.run(
        [*cli, "run", *flags, "--input", str(lines), "--output", str(tmp_path / "out.jsonl")],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    (row,) = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert {k: row[k] for k in ("token_ids", "reasoning_tokens", "reasoning", "text")} == {
        k: rec[k] for k in ("token_ids", "reasoning_tokens", "reasoning", "text")
    }
