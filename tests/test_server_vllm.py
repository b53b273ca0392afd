"""What vLLM users type, with vLLM's meaning (issue 36): ``top_k=-1``, a list of prompts on
/v1/completions (choice k of prompt p at index p * n + k), ``include_stop_str_in_output``,
``truncate_prompt_tokens``, ``/tokenize``, ``/detokenize``, ``/version``; the chat default of
max_tokens; and docs/serving.md's field table held to what the server does. Against
tests/fake_engine.py, which echoes the prompt back one byte-token per step, then EOS."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from fake_engine import EOS, FakeEngine
from test_server import events, running_server, streamed_text

import eprt
from eprt.serve.params import DEFAULT_CHAT_MAX_TOKENS

DOCS = Path(__file__).resolve().parent.parent / "docs" / "serving.md"
CHAT = [{"role": "user", "content": "hi"}]


class GuidedFakeEngine(FakeEngine):
    """The fake takes structured-output guides (and, being a fake, does not follow them)."""

    def compile_guide(self, guide) -> None:
        pass


@pytest.fixture
def engine():
    return GuidedFakeEngine(token_delay=0.001)


@pytest.fixture
def client(engine):
    with running_server(engine) as url, httpx.Client(base_url=url, timeout=20) as c:
        yield c


@pytest.fixture
def thinking_client(engine):
    """A server with a reasoning parser (the fake tokenizer's <think> and </think>): a thinking
    budget is honoured there."""
    with running_server(engine, reasoning_parser="deepseek_r1") as url, httpx.Client(base_url=url, timeout=20) as c:
        yield c


def _by_index(choices: list) -> list:
    return [c["text"] for c in sorted(choices, key=lambda c: c["index"])]


def test_a_list_of_prompts_answers_each_n_times_at_p_times_n_plus_k(client, engine):
    r = client.post("/v1/completions", json={"prompt": ["ab", [99, 100, 101]], "n": 2, "max_tokens": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert _by_index(body["choices"]) == ["ab", "ab", "cde", "cde"]  # "ab" then EOS; "cde" cut at 3
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "stop", "length", "length"]
    assert body["usage"]["prompt_tokens"] == 2 + 3 and body["usage"]["completion_tokens"] == 2 * 3 + 2 * 3
    assert [req.prompt_ids for req in engine.submitted] == [[97, 98], [99, 100, 101]]
    assert engine.submitted[0].request_id.endswith("-0") and engine.submitted[1].request_id.endswith("-1")


def test_a_list_of_prompts_streams_each_choice_under_its_index(client):
    body = {"prompt": ["ab", "xyz"], "n": 2, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as r:
        evs = events(r)
    texts: dict = {}
    for ev in evs[:-1]:
        for c in ev["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {0: "ab", 1: "ab", 2: "xyz", 3: "xyz"} and evs[-1] == "[DONE]"
    assert evs[-2]["usage"]["prompt_tokens"] == 5 and evs[-2]["usage"]["completion_tokens"] == 2 * 3 + 2 * 4


def test_best_of_over_a_list_of_prompts_keeps_n_per_prompt(client):
    r = client.post("/v1/completions", json={"prompt": ["ab", "cd"], "n": 1, "best_of": 2, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert _by_index(r.json()["choices"]) == ["ab", "cd"]


@pytest.mark.parametrize(
    "prompt, says",
    [
        ([[]], "prompt[0] is empty"),
        (["ab", 5], "prompt[1] must be a string or a list of token ids"),
        (["ab", [97, 999]], "prompt[1] has token id 999 outside the vocabulary"),
        (["ab", [97] * 600], "prompt[1] has 600 tokens but max_model_len=512"),
        (["ab"] * 257, "at most 256 are accepted"),
    ],
)
def test_a_bad_prompt_of_a_list_is_a_400_naming_it(client, engine, prompt, says):
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "prompt" and engine.submitted == []


def test_top_k_minus_one_is_vllms_off(client, engine):
    assert client.post("/v1/completions", json={"prompt": "ab", "top_k": -1, "max_tokens": 2}).status_code == 200
    assert engine.submitted[-1].params.top_k == 0
    r = client.post("/v1/completions", json={"prompt": "ab", "top_k": -2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output(client, stream):
    def text(**kw) -> str:
        body = {"prompt": "hello world", "max_tokens": 20, "stop": ["wor", "o w"], "stream": stream, **kw}
        if not stream:
            return client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        with client.stream("POST", "/v1/completions", json=body) as r:
            return "".join(c["text"] for ev in events(r)[:-1] for c in ev["choices"])

    assert text() == "hell"  # "o w" matches first
    assert text(include_stop_str_in_output=True) == "hello w"
    assert text(include_stop_str_in_output=False) == "hell"


def test_truncate_prompt_tokens_keeps_the_last_k(client, engine):
    r = client.post("/v1/completions", json={"prompt": "abcd", "truncate_prompt_tokens": 2, "max_tokens": 2})
    assert r.json()["usage"]["prompt_tokens"] == 2 and r.json()["choices"][0]["text"] == "cd"
    long = [97] * 590 + [98, 99]  # longer than the context (512): cut before it is refused
    r = client.post("/v1/completions", json={"prompt": long, "truncate_prompt_tokens": 3, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "abc", r.text
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "truncate_prompt_tokens": 4, "max_tokens": 1})
    assert r.status_code == 200 and engine.submitted[-1].prompt_ids == list(b"sistant>"[-4:])
    for bad in (0, -2, 513, "2"):
        r = client.post("/v1/completions", json={"prompt": "abcd", "truncate_prompt_tokens": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", (bad, r.text)
    r = client.post("/v1/completions", json={"prompt": long, "truncate_prompt_tokens": -1})  # 512: no room left
    assert r.status_code == 400 and "max_model_len=512" in r.json()["error"]["message"]


def test_tokenize_detokenize_and_version(client):
    r = client.post("/tokenize", json={"prompt": "hi!", "return_token_strs": True}).json()
    assert r == {"count": 3, "max_model_len": 512, "tokens": [104, 105, 33], "token_strs": ["h", "i", "!"]}
    chat = client.post("/tokenize", json={"model": "fake-moe", "messages": CHAT}).json()
    assert bytes(chat["tokens"]) == b"<user>hi\n<assistant>" and chat["token_strs"] is None
    bare = client.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert bytes(bare["tokens"]) == b"<user>hi\n"
    assert client.post("/detokenize", json={"tokens": [104, 105]}).json() == {"prompt": "hi"}
    assert client.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}
    assert client.get("/version").json() == {"version": eprt.__version__}
    refused = [
        ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
        ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
        ("/detokenize", {"tokens": [104, 9999]}, "tokens"),
        ("/detokenize", {"tokens": "hi"}, "tokens"),
    ]
    for path, body, param in refused:
        r = client.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output_on_a_chat_with_a_reasoning_parser(thinking_client, stream):
    """A chat answered through its reasoning / content split (issue 40) honours the flag too."""

    def content(**kw) -> str:
        body = {"messages": CHAT, "max_tokens": 30, "stop": ["i\n"], "stream": stream, **kw}
        if not stream:
            message = thinking_client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
            assert message["reasoning"] is None  # (the fake never thinks)
            return message["content"]
        with thinking_client.stream("POST", "/v1/chat/completions", json=body) as r:
            return streamed_text(events(r), chat=True)

    assert content() == "<user>h"  # the fake echoes the prompt "<user>hi\n<assistant>"
    assert content(include_stop_str_in_output=True) == "<user>hi\n"


def test_tools_and_the_thinking_budget_with_a_list_of_prompts_are_refused(thinking_client, engine):
    """A list of prompts is a completion: chat's tools and thinking budget are named as chat's."""
    for field, value in (("tools", [TOOL]), ("tool_choice", "required"), ("max_thinking_tokens", 4)):
        r = thinking_client.post("/v1/completions", json={"prompt": ["ab", "cd"], field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert "/v1/chat/completions" in r.json()["error"]["message"]
    assert engine.submitted == []


def test_tokenize_renders_a_chat_with_its_tools_and_template_kwargs(client):
    extra = {"tools": [TOOL], "chat_template_kwargs": {"enable_thinking": False}}
    counted = client.post("/tokenize", json={"messages": CHAT, **extra}).json()
    assert bytes(counted["tokens"]) == b"<tool f><enable_thinking=False><user>hi\n<assistant>"
    chat = client.post("/v1/chat/completions", json={"messages": CHAT, "tool_choice": "none", "max_tokens": 1, **extra})
    assert chat.json()["usage"]["prompt_tokens"] == counted["count"]
    for body, param in (
        ({"prompt": "a", "tools": [TOOL]}, "tools"),
        ({"messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
        ({"messages": CHAT, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ):
        r = client.post("/tokenize", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_a_chat_without_max_tokens_stops_at_the_default():
    engine = FakeEngine(max_model_len=2048)  # echoes the 700-byte message, which would take 700+ tokens
    messages = [{"role": "user", "content": "x" * 700}]
    with running_server(engine) as url, httpx.Client(base_url=url, timeout=30) as c:
        r = c.post("/v1/chat/completions", json={"messages": messages}).json()
    assert r["usage"]["completion_tokens"] == DEFAULT_CHAT_MAX_TOKENS == 512
    assert r["choices"][0]["finish_reason"] == "length"
    with running_server(FakeEngine(), chat_max_tokens=5) as url, httpx.Client(base_url=url, timeout=30) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "abcdefgh"}]})
        assert r.json()["usage"]["completion_tokens"] == 5
        r = c.post("/v1/completions", json={"prompt": "abcdefghijklmnopqrstuvwxyz"})  # completions: OpenAI's 16
        assert r.json()["usage"]["completion_tokens"] == 16
    with running_server(FakeEngine(), chat_max_tokens=0) as url, httpx.Client(base_url=url, timeout=30) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "abcdefgh"}]}).json()
    assert r["usage"]["completion_tokens"] == len("<user>abcdefgh\n<assistant>") + 1  # to its EOS
    assert r["choices"][0]["token_ids"][-1] == EOS


# ---- docs/serving.md's field table, held to the server ------------------------------------------

# How each field the table says is honoured, or accepted without effect, is set in a request that
# the fake engine can serve: the same fields on both routes, or {route: fields} for the routes that
# take it.
BOTH = ("completions", "chat")
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
SAMPLES = {
    "model": {"model": "fake-moe"},
    "prompt": {"completions": {"prompt": "ab"}},
    "messages": {"chat": {"messages": CHAT}},
    "max_tokens": {"max_tokens": 3},
    "max_completion_tokens": {"chat": {"max_completion_tokens": 3}},
    "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
    "temperature": {"temperature": 0.5, "seed": 1},
    "top_p": {"top_p": 0.9},
    "top_k": {"top_k": -1},
    "seed": {"seed": 3},
    "stop": {"stop": ["zz", 7]},
    "timeout": {"timeout": 30},
    "include_stop_str_in_output": {"stop": ["b"], "include_stop_str_in_output": True},
    "truncate_prompt_tokens": {"truncate_prompt_tokens": 2},
    "presence_penalty": {"presence_penalty": 0.5},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "repetition_penalty": {"repetition_penalty": 1.2},
    "logit_bias": {"logit_bias": {"97": 1.0}},
    "min_tokens": {"min_tokens": 1},
    "bad_words": {"bad_words": ["zz"]},
    "allowed_token_ids": {"allowed_token_ids": [97, 98, EOS]},
    "min_p": {"min_p": 0.1},
    "ignore_eos": {"ignore_eos": True},
    "stop_token_ids": {"stop_token_ids": [5]},
    "logprobs": {"completions": {"logprobs": 2}, "chat": {"logprobs": True}},
    "top_logprobs": {"chat": {"logprobs": True, "top_logprobs": 2}},
    "echo": {"completions": {"echo": True}},
    "prompt_logprobs": {"prompt_logprobs": 1},
    "user": {"user": "u1"},
    "metadata": {"metadata": {"k": "v"}},
    "store": {"store": False},
    "service_tier": {"service_tier": "auto"},
    "prompt_cache_key": {"prompt_cache_key": "k"},
    "safety_identifier": {"safety_identifier": "s"},
    "return_token_ids": {"return_token_ids": True},
    "request_id": {"request_id": "r1"},
    "parallel_tool_calls": {
        "completions": {"parallel_tool_calls": False},
        "chat": {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False},
    },
    "tools": {"chat": {"tools": [TOOL], "tool_choice": "none"}},
    "tool_choice": {"chat": {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}}},
    "chat_template_kwargs": {"chat": {"chat_template_kwargs": {"enable_thinking": False}}},
    "reasoning_effort": {"chat": {"reasoning_effort": "low"}},
    "max_thinking_tokens": {"chat": {"max_thinking_tokens": 8}},
    "thinking_token_budget": {"chat": {"thinking_token_budget": 8}},
    "n": {"n": 2},
    "best_of": {"n": 1, "best_of": 2},
    "response_format": {"response_format": {"type": "json_object"}},
    "guided_json": {"guided_json": {"type": "object"}},
    "guided_regex": {"guided_regex": "[ab]+"},
    "guided_choice": {"guided_choice": ["a", "b"]},
    "guided_grammar": {"guided_grammar": 'start: "a"'},
    "structured_outputs": {"structured_outputs": {"regex": "[ab]+"}},
}
# A value asking for what a refused field asks for (default: true).
REFUSED_VALUES = {
    "tool_choice": "required",
    "function_call": {"name": "f"},
    "modalities": ["audio"],
    "length_penalty": 2.0,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "add_generation_prompt": False,
    "chat_template": "{{ messages }}",
    "tools": [TOOL],
    "max_thinking_tokens": 8,
    "thinking_token_budget": 8,
}


def field_table() -> dict:
    """status ("honoured", "no effect", "refused") -> {field: {routes}} from docs/serving.md's
    "Request fields" table (a field's routes: the first column's "(completions..."/"(chat..."
    after its name, or "chat only:", else both)."""
    text = DOCS.read_text()
    table = text[text.index("### Request fields") :].split("\n\n")[2]
    out: dict = {"honoured": {}, "no effect": {}, "refused": {}}
    for row in table.splitlines()[2:]:
        fields, status = (cell.strip() for cell in row.strip("|").split("|")[:2])
        kind = "refused" if status.startswith("refused") else "no effect" if "no effect" in status else "honoured"
        assert status in ("honoured", "refused when set", "refused when set (vLLM)", "refused (vLLM)") or kind == (
            "no effect"
        ), row
        for name, after in re.findall(r"`([a-z_.]+)`([^`]*)", fields):
            routes = ("chat",) if fields.startswith("chat only") else BOTH
            if after.lstrip().startswith("(completions"):
                routes = ("completions",)
            elif after.lstrip().startswith("(chat"):
                routes = ("chat",)
            out[kind][name.split(".")[0]] = out[kind].get(name.split(".")[0], set()) | set(routes)
    return out


def _post(c, route: str, fields: dict):
    base = {"prompt": "ab"} if route == "completions" else {"messages": CHAT}
    return c.post(f"/v1/{'chat/' if route == 'chat' else ''}completions", json={"max_tokens": 4, **base, **fields})


def test_every_field_the_table_honours_is_accepted_and_every_refused_one_refused(thinking_client):
    client, table = thinking_client, field_table()
    honoured, no_effect = table["honoured"], table["no effect"]
    accepted = {name: honoured.get(name, set()) | no_effect.get(name, set()) for name in {*honoured, *no_effect}}
    assert set(accepted) == set(SAMPLES), "a field in the table without a sample here, or the reverse"
    pairs = lambda fields: {(name, route) for name, routes in fields.items() for route in routes}  # noqa: E731
    assert not pairs(accepted) & pairs(table["refused"]), "a field both honoured and refused on a route"
    for name, sample in SAMPLES.items():
        per_route = sample if set(sample) <= set(BOTH) else dict.fromkeys(BOTH, sample)
        assert set(per_route) == accepted[name], name
        for route, fields in per_route.items():
            r = _post(client, route, fields)
            assert r.status_code == 200, (name, route, r.text)
    for name, routes in table["refused"].items():
        for route in routes:
            r = _post(client, route, {name: REFUSED_VALUES.get(name, True)})
            assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, route, r.text)
