"""``eprt serve`` with n and best_of on the real default model (in process): n choices from one
prefill, reproducible with a seed, usage counting the prompt once; best_of's n most likely;
streamed choices by index; bad values answered 400 naming the field."""

from __future__ import annotations

import httpx
import pytest
from test_server import events, running_server

from eprt.engine.engine import EngineConfig, launch_engine

PROMPT = "Once upon a time, there was a"


@pytest.fixture(scope="module")
def url():
    with launch_engine(EngineConfig(model=None, device="cpu", max_batch=8, prefix_cache=False)) as engine:
        with running_server(engine) as base:
            yield base, engine


def _post(base, body, path="/v1/completions"):
    with httpx.Client(base_url=base, timeout=60) as c:
        return c.post(path, json=body)


def test_n4_choices_are_distinct_reproducible_and_share_one_prefill(url):
    base, engine = url
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0.8, "seed": 7, "n": 4}
    before = engine.stats()["prompt_tokens_computed"]
    first = _post(base, body).json()
    computed = engine.stats()["prompt_tokens_computed"] - before
    again = _post(base, body).json()
    assert computed == len(PROMPT)  # byte tokenizer: one token per byte
    assert [c["index"] for c in first["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in first["choices"]]
    assert len(set(texts)) == 4 and texts == [c["text"] for c in again["choices"]]
    u = first["usage"]
    assert u["prompt_tokens"] == len(PROMPT)
    assert u["completion_tokens"] == sum(len(c["token_ids"]) for c in first["choices"])


def test_chat_n2_gives_two_messages(url):
    base, _ = url
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 1.0, "seed": 3, "n": 2}
    r = _post(base, body, "/v1/chat/completions").json()
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert all(c["message"]["role"] == "assistant" for c in r["choices"])


def test_best_of_returns_the_n_most_likely_of_its_choices(url):
    base, _ = url
    common = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 11}
    every = _post(base, {**common, "n": 5, "best_of": 5}).json()["choices"]
    best = _post(base, {**common, "n": 2, "best_of": 5}).json()["choices"]
    assert [c["index"] for c in best] == [0, 1]
    assert [c["text"] for c in best] == [c["text"] for c in every[:2]]  # every is ranked too
    assert {c["text"] for c in best} <= {c["text"] for c in every}


def test_streamed_choices_arrive_by_index_and_equal_the_non_streamed_ones(url):
    base, _ = url
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.8, "seed": 5, "n": 3}
    whole = _post(base, body).json()["choices"]
    with (
        httpx.Client(base_url=base, timeout=60) as c,
        c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r,
    ):
        chunks = [e for e in events(r) if e != "[DONE]"]
    texts = ["", "", ""]
    finished = set()
    for e in chunks:
        for ch in e["choices"]:
            texts[ch["index"]] += ch["text"]
            if ch["finish_reason"] is not None:
                finished.add(ch["index"])
    assert finished == {0, 1, 2} and texts == [c["text"] for c in whole]


@pytest.mark.parametrize(
    "extra, param",
    [({"n": 0}, "n"), ({"n": 2, "best_of": 1}, "best_of"), ({"n": 1, "best_of": 3, "stream": True}, "best_of")],
)
def test_bad_choice_counts_are_400_naming_the_field(url, extra, param):
    base, _ = url
    r = _post(base, {"prompt": PROMPT, "max_tokens": 2, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_a_list_of_prompts_gives_each_prompt_its_own_choices(url):
    """vLLM's batched completions on the real engine: choice k of prompt p is choice p * n + k, the
    same text as prompt p sent alone (same seed), and usage counts each prompt once."""
    base, _ = url
    prompts = [PROMPT, "The cat", [72, 105]]
    common = {"max_tokens": 6, "temperature": 0.9, "seed": 5, "n": 2}
    batch = _post(base, {**common, "prompt": prompts}).json()
    assert [c["index"] for c in batch["choices"]] == list(range(6))
    alone = [_post(base, {**common, "prompt": p}).json() for p in prompts]
    assert [c["text"] for c in batch["choices"]] == [c["text"] for a in alone for c in a["choices"]]
    assert batch["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert batch["usage"]["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone)
