"""The official ``openai`` client against ``eprt serve`` on the real engine (one rank, CPU):
completions and chat with each sampling option, logprobs in plain and streamed answers,
refused and unknown fields. The checkpoint is the tiny qwen3_moe one with a word-level
tokenizer whose token ``i`` reads ``t<i>`` (tests/test_server_mpi_real.py), so texts spell
the generated ids; prompts are token ids or such words."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys

import pytest
from test_server import ServerProcess
from test_server_mpi_real import _with_id_tokenizer, ids_of

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

PROMPT = [140, 9, 9, 31, 200, 17, 64, 12, 250, 11]
PROMPT_TEXT = " ".join(f"t{i}" for i in PROMPT)
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    model_dir = _with_id_tokenizer(os.path.abspath(checkpoint("qwen3_moe")), str(tmp_path_factory.mktemp("oai")))
    with open(os.path.join(model_dir, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    srv = ServerProcess(
        [sys.executable, "-m", "eprt.cli", "serve", "--model", model_dir, "--port", "0", "--device", "cpu"]
        + ["--max-batch", "4", "--block-size", "4", "--max-model-len", "256", "--served-model-name", "tiny"]
    )
    try:
        srv.wait_url(120)
        yield srv
    finally:
        srv.proc.send_signal(signal.SIGTERM)
        try:
            srv.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def complete(client, **kw):
    return client.completions.create(model="tiny", prompt=PROMPT, **{"max_tokens": 8, **kw}).choices[0]


def test_completion_logprobs_are_ordered_and_consistent(client):
    choice = complete(client, logprobs=3)
    lp = choice.logprobs
    assert lp.tokens == choice.text.split() and len(lp.token_logprobs) == 8
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and math.isclose(value, max(top.values()), abs_tol=1e-6)  # greedy: the top one
        assert top[token] == value and 3 <= len(top) <= 4
        assert list(top.values())[:3] == sorted(top.values(), reverse=True)[:3]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_echo_with_logprobs_and_prompt_logprobs(client):
    choice = complete(client, echo=True, logprobs=1, max_tokens=3, extra_body={"prompt_logprobs": 2})
    assert choice.text.startswith(PROMPT_TEXT)
    lp = choice.logprobs
    assert ids_of(" ".join(lp.tokens))[: len(PROMPT)] == PROMPT and len(lp.tokens) == len(PROMPT) + 3
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    prompt_lp = choice.model_extra["prompt_logprobs"]
    assert prompt_lp[0] is None and len(prompt_lp) == len(PROMPT)
    for i, entry in enumerate(prompt_lp[1:], start=1):
        assert entry[str(PROMPT[i])]["logprob"] == pytest.approx(lp.token_logprobs[i], abs=1e-6)
        assert sorted(e["rank"] for e in entry.values())[0] == 1


def test_each_processing_option_changes_the_output(client):
    plain = ids_of(complete(client, max_tokens=12).text)
    options = {
        "presence_penalty": dict(presence_penalty=1.5),
        "frequency_penalty": dict(frequency_penalty=1.2),
        "repetition_penalty": dict(extra_body={"repetition_penalty": 1.8}),
        "bad_words": dict(extra_body={"bad_words": ["t221"]}),
        "allowed_token_ids": dict(extra_body={"allowed_token_ids": [5, 9, 17]}),
    }
    for name, kw in options.items():
        got = ids_of(complete(client, max_tokens=12, **kw).text)
        assert got != plain, name
    assert 221 not in ids_of(complete(client, max_tokens=12, extra_body={"bad_words": ["t221"]}).text)
    assert set(ids_of(complete(client, extra_body={"allowed_token_ids": [5, 9, 17]}).text)) <= {5, 9, 17}
    assert ids_of(complete(client, logit_bias={"123": 100}, temperature=1.0, seed=4).text) == [123] * 8


def test_min_tokens_holds_back_eos(client):
    eos_first = complete(client, logit_bias={"2": 100}, max_tokens=5)
    assert eos_first.finish_reason == "stop" and eos_first.model_extra["token_ids"] == [2]
    held = complete(client, logit_bias={"2": 100}, max_tokens=5, extra_body={"min_tokens": 3})
    assert held.model_extra["token_ids"][:3] != [2] * 3 and 2 not in held.model_extra["token_ids"][:3]
    assert held.model_extra["token_ids"][3] == 2


def test_sampling_options_are_reproducible(client):
    kw = dict(temperature=0.9, top_p=0.9, seed=11, max_tokens=10, extra_body={"top_k": 20, "min_p": 0.05})
    assert complete(client, **kw).text == complete(client, **kw).text
    assert complete(client, stop=["t221"], max_tokens=12).finish_reason == "stop"


def test_streamed_completion_logprobs_match_the_plain_answer(client):
    plain = complete(client, logprobs=2, max_tokens=6)
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, logprobs=2, stream=True)
    tokens, values = [], []
    for part in stream:
        for c in part.choices:
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
    assert tokens == plain.logprobs.tokens and values == plain.logprobs.token_logprobs


def chat(client, **kw):
    messages = [{"role": "user", "content": PROMPT_TEXT}]
    return client.chat.completions.create(model="tiny", messages=messages, **{"max_tokens": 6, **kw})


def test_chat_logprobs_top_logprobs_and_penalties(client):
    choice = chat(client, logprobs=True, top_logprobs=2).choices[0]
    content = choice.logprobs.content
    assert [c.token for c in content] == choice.message.content.split()
    for c in content:
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
        assert len(c.top_logprobs) == 2 and c.logprob == c.top_logprobs[0].logprob  # greedy
        assert c.bytes == list(c.token.encode())
    assert chat(client, logprobs=True).choices[0].logprobs.content[0].top_logprobs == []
    plain = chat(client, max_tokens=10).choices[0].message.content
    for kw in (dict(presence_penalty=2.0), dict(frequency_penalty=2.0), dict(logit_bias={"77": 100})):
        assert chat(client, max_tokens=10, **kw).choices[0].message.content != plain, kw
    stream = chat(client, logprobs=True, top_logprobs=1, stream=True)
    streamed = [c.token for part in stream for ch in part.choices if ch.logprobs for c in ch.logprobs.content]
    assert streamed == [c.token for c in content]


def test_refused_and_unknown_fields(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, extra_body={"use_beam_search": True})
    assert "use_beam_search" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, top_logprobs=2)
    assert "top_logprobs" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, extra_body={"min_p": 1.5})
    assert "min_p" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, logit_bias={"99999": 1})
    assert "logit_bias" in str(e.value)
    assert complete(client, extra_body={"frobnicate": 1}, user="u1").finish_reason in ("stop", "length")
    assert any("unknown fields ignored: frobnicate" in line for line in server.log)


def test_streamed_echo_leads_with_the_prompt_and_its_logprobs(client):
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, echo=True, logprobs=1, stream=True)
    text, tokens, values = "", [], []
    for part in stream:
        for c in part.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
    plain = complete(client, max_tokens=3)  # the prompt's text, then the completion's (decoded apart)
    assert text == PROMPT_TEXT + plain.text
    assert ids_of(" ".join(tokens)) == PROMPT + plain.model_extra["token_ids"]
    assert values[0] is None and all(v <= 0 for v in values[1:])


def test_vllm_conventions_through_the_client(client, server):
    """What vLLM users type (issue 36): a list of prompts with n (choice k of prompt p at p * n + k,
    each as the prompt sent alone), top_k=-1, include_stop_str_in_output, truncate_prompt_tokens,
    and the /tokenize, /detokenize and /version routes."""
    import httpx

    prompts = [PROMPT, PROMPT[3:], "t5 t6 t7"]
    kw = dict(model="tiny", max_tokens=5, n=2, temperature=0.8, seed=9)
    batch = client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in batch.choices] == list(range(6))
    alone = [client.completions.create(prompt=p, **kw) for p in prompts]
    assert [c.text for c in batch.choices] == [c.text for a in alone for c in a.choices]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert complete(client, extra_body={"top_k": -1}).text == complete(client).text  # greedy either way
    plain = ids_of(complete(client, max_tokens=12).text)
    stop = f"t{plain[2]}"
    cut = complete(client, max_tokens=12, stop=[stop]).text
    kept = complete(client, max_tokens=12, stop=[stop], extra_body={"include_stop_str_in_output": True}).text
    assert kept == cut + stop and stop not in cut
    short = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=3, extra_body={"truncate_prompt_tokens": 4}
    )
    last4 = client.completions.create(model="tiny", prompt=PROMPT[-4:], max_tokens=3)
    assert short.usage.prompt_tokens == 4 and short.choices[0].text == last4.choices[0].text
    r = httpx.post(server.url + "/tokenize", json={"model": "tiny", "prompt": PROMPT_TEXT}).json()
    assert r["tokens"][-len(PROMPT) :] == PROMPT and r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
    assert (
        httpx.post(server.url + "/detokenize", json={"tokens": PROMPT}).json()["prompt"].split() == PROMPT_TEXT.split()
    )
    assert httpx.get(server.url + "/version").json()["version"]
