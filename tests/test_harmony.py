"""gpt-oss's harmony format (eprt/serve/harmony.py): the output's messages parsed into reasoning,
content and tool calls, prefix-stable as a stream; then through the server with the official
``openai`` client on the tiny gpt_oss checkpoint with a harmony chat template (tests/chat_checkpoints.py):
a random model writes no harmony, so a grammar makes it write the analysis channel then a final answer,
or then a call to functions.get_weather; the parsing, the stops (<|return|>, <|call|>: EOS) and the
streaming are the server's real ones, and the streamed deltas add up to the whole answer."""

import json
import re

import pytest
from chat_checkpoints import HARMONY_TAGS, build_harmony_checkpoint
from test_chat_families import CITY, DAYS, JSON_ARGS, WEATHER, reassembled
from test_server import running_server
from test_tool_formats import streamed

from eprt.engine.engine import EngineConfig, launch_engine
from eprt.serve import reasoning
from eprt.serve.chat_output import ChatFeatures, HarmonyOutput, prepare
from eprt.serve.harmony import HarmonyFormat
from eprt.serve.params import FieldError
from eprt.serve.tool_calls import ToolSettings, message_fields
from eprt.serve.tool_formats import Call

openai = pytest.importorskip("openai")

OUTPUT = (
    "<|channel|>analysis<|message|>The user asks about Paris.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city": "Paris", "days": 2}<|end|>'
    "<|start|>assistant to=functions.noop<|channel|>commentary json<|message|>{}<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Sunny.<|end|>"
)


def test_harmony_messages_parse_into_reasoning_content_and_calls_prefix_stable():
    whole = streamed(HarmonyFormat(), OUTPUT)  # every prefix extended by the next and the whole
    assert whole.reasoning == "The user asks about Paris."
    assert whole.content == "Checking.Sunny."  # a commentary preamble and the final answer
    assert whole.calls == [Call("get_weather", '{"city": "Paris", "days": 2}', True), Call("noop", "{}", True)]
    open_call = HarmonyFormat().parse(OUTPUT[: OUTPUT.index("2}<|end|>")], False)
    assert open_call.calls == [Call("get_weather", '{"city": "Paris", "days": ', False)]
    assert HarmonyFormat().parse("<|channel|>final<|message|>Hi <|", False).content == "Hi "  # a tag held back
    assert HarmonyFormat().parse("<|channel|>analysis<|mess", False).reasoning == ""  # a header still coming


def test_the_harmony_parsers_are_found_named_and_refuse_a_budget():
    with pytest.raises(ValueError, match="unknown"):
        reasoning.check_name("harmonic")
    for name in ("openai_gptoss", "harmony"):
        reasoning.check_name(name)
    ToolSettings(True, "openai"), ToolSettings(True, "harmony")  # vLLM's name and ours
    assert reasoning.detect("<|start|>assistant<|channel|>final<|message|>") == "openai_gptoss"
    features = ChatFeatures(reasoning.HarmonyParser(), ToolSettings(True, "openai"))
    with pytest.raises(FieldError, match="max_thinking_tokens: gpt-oss's analysis channel"):
        prepare({"max_thinking_tokens": 3}, features)
    setup = prepare({"tools": [WEATHER]}, features)
    assert setup.harmony and setup.thinking is None and setup.output([]).func is HarmonyOutput
    assert message_fields({"role": "assistant", "reasoning": "r"}, "m")["thinking"] == "r"  # the template's field


def grammar(*parts) -> str:
    """A Lark grammar of one output: harmony tags as their own tokens, ``/re/`` regexes, text."""

    def one(part: str) -> str:
        if part in HARMONY_TAGS:
            return f"<[{256 + HARMONY_TAGS.index(part)}]>"
        return part if part.startswith("/") and part.endswith("/") else json.dumps(part)

    return "start: " + " ".join(one(p) for p in parts)


ANALYSIS = (
    "<|channel|>",
    "analysis",
    "<|message|>",
    "/[a-z]{2,6}( [a-z]{2,6}){0,2}/",
    "<|end|>",
    "<|start|>",
    "assistant",
)
ANSWER = grammar(*ANALYSIS, "<|channel|>", "final", "<|message|>", "/[a-z]{2,6}( [a-z]{2,6}){0,2}/", "<|return|>")
CALL = grammar(
    *ANALYSIS,
    "<|channel|>",
    "commentary to=functions.get_weather ",
    "<|constrain|>",
    "json",
    "<|message|>",
    *JSON_ARGS,
    "<|call|>",
)


@pytest.fixture(scope="module")
def harmony_server(ckpt_root):
    model = build_harmony_checkpoint(ckpt_root)
    with launch_engine(EngineConfig(model=model, device="cpu", max_batch=4, max_model_len=768)) as engine:
        with running_server(engine, reasoning_parser="auto", tools=ToolSettings(True, "openai")) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
            yield client, engine.model_name


def ask(server, lark: str, stream: bool, **kw):
    client, model = server
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}],
        max_tokens=120,
        stream=stream,
        extra_body={"structured_outputs": {"grammar": lark}},
        **({"stream_options": {"include_usage": True}} if stream else {}),
        **kw,
    )


def test_a_harmony_answer_returns_reasoning_and_content(harmony_server):
    whole = ask(harmony_server, ANSWER, stream=False)
    choice = whole.choices[0]
    reasoning_text = choice.message.model_extra["reasoning"]
    assert re.fullmatch(r"[a-z]{2,6}( [a-z]{2,6}){0,2}", reasoning_text)
    assert re.fullmatch(r"[a-z]{2,6}( [a-z]{2,6}){0,2}", choice.message.content)
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None  # <|return|> stopped it
    parts = reassembled(ask(harmony_server, ANSWER, stream=True))
    assert (parts["reasoning"], parts["content"], parts["finish"]) == (reasoning_text, choice.message.content, "stop")


def test_a_harmony_tool_call_is_parsed_streamed_or_not(harmony_server):
    whole = ask(harmony_server, CALL, stream=False, tools=[WEATHER])
    choice = whole.choices[0]
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and re.fullmatch(CITY, args["city"]) and 1 <= args["days"] <= 9
    assert re.fullmatch(DAYS, str(args["days"])) and choice.finish_reason == "tool_calls"  # <|call|> stopped it
    assert choice.message.content is None and choice.message.model_extra["reasoning"]
    parts = reassembled(ask(harmony_server, CALL, stream=True, tools=[WEATHER]))
    assert parts["calls"] == {
        0: {"id": parts["calls"][0]["id"], "name": "get_weather", "arguments": call.function.arguments}
    }
    assert parts["finish"] == "tool_calls" and parts["reasoning"] == choice.message.model_extra["reasoning"]


def test_a_tool_result_and_earlier_analysis_render_in_harmony(harmony_server, ckpt_root):
    client, model = harmony_server
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning": "need the tool"},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    answer = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    from tokenizers import Tokenizer

    ids = [int(next(iter(e))) for e in answer.model_extra["prompt_logprobs"][1:]]  # the tags are special tokens:
    tok = Tokenizer.from_file(f"{build_harmony_checkpoint(ckpt_root)}/tokenizer.json")  # decoded with them
    prompt = tok.decode(ids, skip_special_tokens=False)
    assert "<|start|>assistant<|channel|>analysis<|message|>need the tool<|end|>" in prompt
    assert '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"' in prompt
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny, 21 C<|end|>" in prompt
    assert "# Instructions\n\nBe brief." in prompt and prompt.endswith("<|start|>assistant")


def test_reasoning_effort_is_the_templates_variable(harmony_server, ckpt_root):
    """vLLM's reasoning_effort reaches the template (gpt-oss's writes 'Reasoning: <effort>' into its
    system message; medium when absent); a value outside OpenAI's four, a clash with
    chat_template_kwargs and completions are refused naming the field."""
    import httpx
    from tokenizers import Tokenizer

    client, model = harmony_server
    url = str(client.base_url).removesuffix("/v1/")
    tok = Tokenizer.from_file(f"{build_harmony_checkpoint(ckpt_root)}/tokenizer.json")
    messages = [{"role": "user", "content": "Hi"}]

    def rendered(**kw) -> str:
        r = httpx.post(f"{url}/tokenize", json={"model": model, "messages": messages, **kw}, timeout=60)
        assert r.status_code == 200, r.text
        return tok.decode(r.json()["tokens"], skip_special_tokens=False)

    assert "Reasoning: high" in rendered(reasoning_effort="high") and "Reasoning: medium" in rendered()
    answer = client.chat.completions.create(model=model, messages=messages, max_tokens=1, reasoning_effort="low")
    assert answer.usage.prompt_tokens == len(tok.encode(rendered(reasoning_effort="low"), add_special_tokens=False).ids)
    for body, route, word in (
        ({"messages": messages, "reasoning_effort": "extreme"}, "chat/completions", "must be one of"),
        (
            {"messages": messages, "reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}},
            "chat/completions",
            "differs",
        ),
        ({"prompt": "Hi", "reasoning_effort": "low"}, "completions", "needs /v1/chat/completions"),
    ):
        r = httpx.post(f"{url}/v1/{route}", json={"model": model, "max_tokens": 1, **body}, timeout=60)
        assert r.status_code == 400 and "reasoning_effort" in r.text and word in r.text, (route, r.text)
