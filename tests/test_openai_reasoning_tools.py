"""Reasoning and tool calling with the official ``openai`` client against ``eprt serve`` at
``-n 1`` and ``mpiexec -n 2`` (issue 40's checks): a Qwen3-style tiny checkpoint (byte-level
tokenizer, a template whose generation prefix opens the thinking block, Hermes tool calls:
tests/chat_checkpoints.py) served with ``--reasoning-parser auto --enable-auto-tool-choice
--tool-call-parser hermes``. A thinking answer splits into reasoning and content, streamed or not,
with ``reasoning_tokens`` the tokens inside the block (the budget ends it: a random model never
would); ``tool_choice`` required and named give calls whose arguments validate against their
schemas (jsonschema), and their streamed deltas add up to the same calls; a tool result fed back
is rendered by the template, token for token."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import jsonschema
import pytest
from chat_checkpoints import build_chat_checkpoint
from test_chat_families import reassembled
from test_server import ServerProcess

from eprt.model.tokenizer import compile_chat_template

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

THINK, END_THINK = 258, 259
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
TIME_SCHEMA = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}/[A-Z][a-z]{1,8}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_SCHEMA}},
]
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


@pytest.fixture(scope="module", params=[1, 2], ids=["n1", "mpiexec-n2"])
def server(request, checkpoint, tmp_path_factory):
    model = build_chat_checkpoint(checkpoint, str(tmp_path_factory.mktemp("oai-chat")), "qwen3")
    launcher = [] if request.param == 1 else ["mpiexec", "-n", "2"]
    cmd = [*launcher, sys.executable, "-m", "eprt.cli", "serve", "--model", model, "--port", "0", "--device", "cpu"]
    cmd += ["--max-batch", "4", "--max-model-len", "1536", "--served-model-name", "tiny"]
    cmd += ["--reasoning-parser", "auto", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    cmd += ["--check-state"] if request.param > 1 else []
    srv = ServerProcess(cmd)
    try:
        srv.wait_url(180)
        srv.model = model
        yield srv
    finally:
        srv.proc.send_signal(signal.SIGTERM)
        try:
            assert srv.proc.wait(timeout=60) == 0, "".join(srv.log[-20:])
        except subprocess.TimeoutExpired:
            srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def tokenizer(server):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(server.model, "tokenizer.json"))


def chat(client, **kw):
    return client.chat.completions.create(model="tiny", **{"messages": ASK, "max_tokens": 16, **kw})


def test_the_server_chose_the_qwen3_reasoning_parser(server):
    assert any("reasoning parser: qwen3 (from the chat template" in line for line in server.log)


def test_thinking_splits_into_reasoning_and_content_streamed_or_not(client, tokenizer):
    answer = chat(client, extra_body={"max_thinking_tokens": 6})
    choice = answer.choices[0]
    ids = choice.model_extra["token_ids"]  # the prompt opened the block: the budget ends it after 6 tokens
    assert ids[6] == END_THINK and THINK not in ids and END_THINK not in ids[:6]
    assert answer.usage.completion_tokens_details.reasoning_tokens == 6  # the tokens inside the block
    reasoning = choice.message.model_extra["reasoning"]
    assert reasoning == choice.message.model_extra["reasoning_content"] == tokenizer.decode(ids[:6])
    assert choice.message.content == tokenizer.decode([t for t in ids[7:] if t != 257])
    parts = reassembled(
        chat(client, stream=True, stream_options={"include_usage": True}, extra_body={"max_thinking_tokens": 6})
    )
    assert (parts["reasoning"], parts["content"]) == (reasoning, choice.message.content)
    assert parts["usage"].completion_tokens_details.reasoning_tokens == 6 and parts["finish"] == choice.finish_reason


def test_thinking_off_by_the_template_kwargs(client):
    answer = chat(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}, "max_thinking_tokens": 6})
    assert answer.choices[0].message.model_extra["reasoning"] is None
    assert answer.usage.completion_tokens_details.reasoning_tokens == 0
    assert END_THINK not in answer.choices[0].model_extra["token_ids"]


def test_required_calls_validate_and_stream_to_the_same_calls(client):
    kw = dict(tools=TOOLS, tool_choice="required", max_tokens=200, extra_body={"max_thinking_tokens": 2})
    answer = chat(client, **kw)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert calls and all(c.id.startswith("call_") for c in choice.message.tool_calls)
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    assert answer.usage.completion_tokens_details.reasoning_tokens == 2  # it thought before calling
    parts = reassembled(chat(client, stream=True, **kw))
    assert [(c["name"], c["arguments"]) for _, c in sorted(parts["calls"].items())] == calls
    assert parts["finish"] == "tool_calls" and parts["content"] == ""


def test_a_named_function_is_called(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    kw = dict(
        tools=TOOLS, tool_choice=named, max_tokens=120, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    answer = chat(client, **kw)
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME_SCHEMA)
    parts = reassembled(chat(client, stream=True, **kw))
    assert parts["calls"] == {
        0: {"id": parts["calls"][0]["id"], "name": "get_time", "arguments": call.function.arguments}
    }


def test_a_tool_result_fed_back_renders_through_the_template(client, server, tokenizer):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
    }
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "clear"}'},
    ]
    answer = chat(
        client, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=2, extra_body={"prompt_logprobs": 0}
    )
    prompt_ids = [int(next(iter(entry))) for entry in answer.model_extra["prompt_logprobs"][1:]]
    with open(os.path.join(server.model, "chat_template.jinja")) as f:
        template = compile_chat_template(f.read())
    rendered_call = {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}
    expected = template.render(
        messages=[ASK[0], {**messages[1], "tool_calls": [rendered_call]}, messages[2]],
        tools=TOOLS,
        add_generation_prompt=True,
    )
    first = tokenizer.encode(expected).ids[0]
    assert tokenizer.decode([first] + prompt_ids, skip_special_tokens=False) == expected
    assert '<tool_response>\n{"temp": 21, "sky": "clear"}\n</tool_response>' in expected
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>' in expected


def test_each_choice_calls_on_its_own(client):
    kw = dict(max_tokens=300, n=2, temperature=1.0, seed=7, extra_body={"max_thinking_tokens": 2})
    answer = chat(client, tools=TOOLS, tool_choice="required", **kw)
    assert [c.index for c in answer.choices] == [0, 1]
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_refusals_name_the_field(client):
    cases = [
        lambda: client.completions.create(model="tiny", prompt="hi", extra_body={"tools": TOOLS}),
        lambda: client.completions.create(model="tiny", prompt="hi", extra_body={"max_thinking_tokens": 3}),
        lambda: chat(client, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
        lambda: chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}}),
        lambda: chat(client, extra_body={"thinking_token_budget": -1}),
    ]
    params = []
    for call in cases:
        with pytest.raises(openai.BadRequestError) as e:
            call()
        params.append(e.value.body["param"])
    assert params == ["tools", "max_thinking_tokens", "response_format", "tool_choice", "thinking_token_budget"]
