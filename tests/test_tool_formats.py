"""The tool-call formats, reasoning parsers and request fields of eprt/serve/{tool_formats,
tool_calls,reasoning,chat_output}.py, without a model: each family's output parses into its
content and calls, every prefix of a streamed output gives content and arguments that the whole
output's parse extends (so a stream's deltas add up to the answer), and bad fields are named."""

import json

import pytest
from chat_checkpoints import HARMONY, TEMPLATES
from hypothesis import given, settings
from hypothesis import strategies as st

from eprt.serve import reasoning
from eprt.serve.chat_output import ChatFeatures, ChatOutput, prepare
from eprt.serve.params import FieldError
from eprt.serve.tool_calls import NamedFormat, RequiredFormat, ToolSettings, message_fields, parse_tools
from eprt.serve.tool_formats import TOOL_PARSERS, Call

TYPES = {"get_weather": {"city": "string", "days": "integer", "hot": "boolean"}}
ARGS = {"city": 'Pa "ris"', "days": 3, "hot": False}
DS_CALL = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"
OUTPUTS = {
    "hermes": 'Sure.<tool_call>\n{"name": "get_weather", "arguments": ARGS}\n</tool_call>\n'
    '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>',
    "qwen3_coder": 'Sure.<tool_call>\n<function=get_weather>\n<parameter=city>\nPa "ris"\n</parameter>\n'
    "<parameter=days>\n3\n</parameter>\n<parameter=hot>\nfalse\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=noop>\n</function>\n</tool_call>",
    "glm45": 'Sure.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Pa "ris"</arg_value>\n'
    "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>hot</arg_key>\n<arg_value>false</arg_value>\n"
    "</tool_call><tool_call>noop\n</tool_call>",
    "deepseek_v3": "Sure.<｜tool▁calls▁begin｜>"
    + DS_CALL.format(name="get_weather", args="ARGS")
    + DS_CALL.format(name="noop", args="{}")
    + "<｜tool▁calls▁end｜>",
    "deepseek_v31": "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>"
    "<｜tool▁call▁begin｜>noop<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "kimi_k2": "Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    "<|tool_call_argument_begin|>ARGS<|tool_call_end|><|tool_call_begin|>functions.noop:1"
    "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
}


def streamed(fmt, text: str):
    """Parse every prefix as a stream would; check each is extended by the next and by the whole."""
    whole = fmt.parse(text, True)
    content, args = "", {}
    for n in range(len(text) + 1):
        part = fmt.parse(text[:n], False)
        assert part.content.startswith(content) and whole.content.startswith(part.content), text[:n]
        content = part.content
        for i, call in enumerate(part.calls):
            assert whole.calls[i].arguments.startswith(call.arguments) and call.arguments.startswith(args.get(i, ""))
            assert call.name in (None, whole.calls[i].name)
            args[i] = call.arguments
    return whole


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_each_format_parses_its_calls_and_streams_prefix_stable(name):
    text = OUTPUTS[name].replace("ARGS", json.dumps(ARGS))
    out = streamed(TOOL_PARSERS[name](TYPES), text)
    assert out.content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("get_weather", ARGS), ("noop", {})]
    assert all(c.complete for c in out.calls)
    if name == "kimi_k2":
        assert [c.id for c in out.calls] == ["functions.get_weather:0", "functions.noop:1"]


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_text_without_calls_is_content_and_a_partial_tag_is_held_back(name):
    fmt = TOOL_PARSERS[name]({})
    assert fmt.parse("just text < and >", True).content == "just text < and >"
    first_tag = OUTPUTS[name][len("Sure.") :][:6]
    assert fmt.parse("text" + first_tag, False).content == "text"  # may still become a call
    assert fmt.parse("text" + first_tag, True).content == "text" + first_tag


def test_a_call_cut_short_stays_a_call_with_the_arguments_so_far():
    fmt = TOOL_PARSERS["hermes"]({})
    cut = fmt.parse('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2', True)
    assert cut.content == "" and [(c.name, c.arguments, c.complete) for c in cut.calls] == [("f", '{"a": [1, 2', False)]
    not_json = fmt.parse("<tool_call>\nhello</tool_call>", True)
    assert not_json.content == "<tool_call>\nhello</tool_call>" and not not_json.calls


def test_required_and_named_answers():
    text = '[{"name": "get_weather", "parameters": {"city": "x"}}, {"name": "noop", "parameters": {}}]'
    out = streamed(RequiredFormat(), text)
    assert [(c.name, c.arguments) for c in out.calls] == [("get_weather", '{"city": "x"}'), ("noop", "{}")]
    named = streamed(NamedFormat("get_weather"), '{"city": "x", "n": {"a": "}"}}')
    assert [(c.name, c.arguments, c.complete) for c in named.calls] == [
        ("get_weather", '{"city": "x", "n": {"a": "}"}}', True)
    ]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {"type": "function", "function": {"name": "noop"}},
]


def test_tool_choice_guides():
    req = parse_tools({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, ToolSettings())
    schema = json.loads(req.guide().spec)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["noop"]]
    named = parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "noop"}}}, None)
    assert json.loads(named.guide().spec) == {"type": "object"} and named.choice == "noop"
    assert parse_tools({"tools": TOOLS, "tool_choice": "none"}, ToolSettings()).guide() is None


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"tools": TOOLS}, "tool_choice", "--enable-auto-tool-choice"),
        ({"tools": [{"type": "function"}]}, "tools", "tools[0]"),
        ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "tools", "two functions"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": 1}, "parallel_tool_calls", "true or false"),
        ({"max_thinking_tokens": -1}, "max_thinking_tokens", ">= 0"),
        ({"max_thinking_tokens": 3, "thinking_token_budget": 4}, "thinking_token_budget", "differ"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "messages"),
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs", "an object"),
    ],
)
def test_bad_fields_are_named(body, param, words):
    with pytest.raises(FieldError) as e:
        prepare(body, ChatFeatures(reasoning.ReasoningParser("qwen3", 1, 2)))
    assert e.value.param == param and words in str(e.value)


def test_a_budget_needs_a_reasoning_parser():
    with pytest.raises(FieldError, match="--reasoning-parser"):
        prepare({"thinking_token_budget": 5}, ChatFeatures())
    setup = prepare(
        {"thinking_token_budget": 5, "chat_template_kwargs": {"enable_thinking": False}},
        ChatFeatures(reasoning.ReasoningParser("qwen3", 1, 2)),
    )
    assert (setup.thinking.start, setup.thinking.end, setup.thinking.budget) == (1, 2, 5)
    assert setup.template_args == {"enable_thinking": False}


def test_messages_carry_calls_and_results():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    got = message_fields({"role": "assistant", "tool_calls": [call], "reasoning": "hm"}, "messages[1]")
    assert got == {
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}],
        "reasoning_content": "hm",
        "thinking": "hm",  # (gpt-oss's template reads it so)
    }
    assert message_fields({"role": "tool", "tool_call_id": "c1", "content": "2"}, "m") == {"tool_call_id": "c1"}
    with pytest.raises(FieldError, match="messages\\[2\\].tool_calls"):
        message_fields({"role": "user", "tool_calls": [call]}, "messages[2]")


def test_reasoning_parsers_from_templates():
    assert [reasoning.detect(TEMPLATES[f]) for f in ("qwen3", "deepseek_v3", "glm45", "kimi_k2", "qwen3_coder")] == [
        "qwen3",
        "deepseek_v3",
        "glm45",
        "kimi_k2",
        None,
    ]
    assert reasoning.detect("<｜Assistant｜><think>\n") == "deepseek_r1"
    assert reasoning.detect("<think>{{ x }}</think>") is None  # no family to tell
    with pytest.raises(ValueError, match="choose"):
        reasoning.check_name("deepseek")
    reasoning.check_name("openai_gptoss")  # gpt-oss's harmony: served since issue 44 (tests/test_harmony.py)
    assert reasoning.detect(HARMONY) == "openai_gptoss"


class _Tok:
    """Token i decodes as chr(i + 64); 1 and 2 are <think> / </think>; 3 Kimi's section."""

    def decode(self, ids, skip_special_tokens=True):
        names = {1: "<think>", 2: "</think>", 3: "<|tool_calls_section_begin|>"}
        return "".join(names.get(i, chr(i + 64)) for i in ids)


def test_chat_output_splits_on_the_scheduler_rules():
    spec = reasoning.ReasoningParser("kimi_k2", 1, 2, (3,)).thinking()
    out = ChatOutput(_Tok(), prompt=[9, 1], spec=spec)  # the prompt opened the block
    pieces = []
    for t in (8, 9, 2, 10, 11):
        out.feed(t)
        pieces += out.deltas()
    out.finish()
    pieces += out.deltas()
    assert out.message() == {"role": "assistant", "content": "JK", "reasoning": "HI", "reasoning_content": "HI"}
    assert (
        "".join(p.get("reasoning", "") for p in pieces) == "HI"
        and "".join(p.get("content", "") for p in pieces) == "JK"
    )
    kimi = ChatOutput(_Tok(), prompt=[1], spec=spec, fmt=TOOL_PARSERS["kimi_k2"]({}), keep=True)
    for t in (8, 3):  # the tool-call section ends the block and is content
        kimi.feed(t)
    kimi.finish()
    assert kimi.message()["reasoning"] == "H" and kimi.text == "<|tool_calls_section_begin|>"  # (no call in it)


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_ends_the_reasoning_or_the_content_with_include_stop_str_in_output(include):
    """vLLM's include_stop_str_in_output holds in both channels: the stop string that matched ends
    the text it stopped (the reasoning's, or the content's), or is cut with what follows."""
    spec = reasoning.ReasoningParser("qwen3", 1, 2).thinking()
    in_reasoning = ChatOutput(_Tok(), ["IJ"], (), include, prompt=[1], spec=spec)  # (IJ: tokens 9, 10)
    for t in (8, 9, 10, 11, 2, 12):
        in_reasoning.feed(t)
    in_reasoning.finish()
    assert in_reasoning.stopped and in_reasoning.message()["reasoning"] == ("HIJ" if include else "H")
    in_content = ChatOutput(_Tok(), ["IJ"], (), include, prompt=[1], spec=spec)
    for t in (8, 2, 9, 10, 11):
        in_content.feed(t)
    in_content.finish()
    assert in_content.message()["reasoning"] == "H" and in_content.text == ("IJ" if include else "")


def test_a_call_closed_by_the_end_of_the_text_after_a_stray_close_tag_ends_the_parse():
    """Found by the test below: a call that the text's end closes (no end position) made the parse
    look for the next call from the start again, after a stray close tag: a loop without end."""
    text = "a</tool_call><tool_call><function=x>"
    assert TOOL_PARSERS["qwen3_coder"]({}).parse(text, True).calls == [Call("x", "{}", True)]
    assert TOOL_PARSERS["qwen3_coder"]({}).parse(text, False).calls == [Call("x", "{", False)]


@pytest.mark.parametrize("name", sorted(OUTPUTS))
@settings(max_examples=150, deadline=None)
@given(cut=st.integers(0, 400), noise=st.text(alphabet='{}[]":,\\ \nabtrue0<>/=', max_size=30), at=st.integers(0, 400))
def test_any_output_parses_without_raising(name, cut, noise, at):
    """A model may write anything: a malformed call is content or a call cut short, never an exception."""
    text = OUTPUTS[name].replace("ARGS", json.dumps(ARGS))
    text = text[:at] + noise + text[at:cut]
    for final in (False, True):
        out = TOOL_PARSERS[name](TYPES).parse(text, final)
        assert isinstance(out.content, str) and all(isinstance(c.arguments, str) for c in out.calls)
    for fmt in (RequiredFormat(), NamedFormat("f")):
        fmt.parse(noise + text, True)
