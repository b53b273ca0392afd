"""Adversarial inputs to ``eprt serve``, ``eprt run`` and the engine's request checks.

The property everywhere: a bad input gets a 4xx (or a per-line error) whose message names
the problem, never a 500, a traceback or a hung connection; the other requests go on; and
afterwards every KV block is free. One module-wide server runs the real engine in this
process (the tiny qwen3_moe checkpoint plus a word-level tokenizer whose token i reads
``t<i>``, and a chat template that refuses non-alternating roles); the socket-level tests
use tests/fake_engine.py, whose timing is predictable.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import socket
import threading
import time

import httpx
import pytest
from fake_engine import FakeEngine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import running_server
from test_server_mpi_real import _with_id_tokenizer, scrape

from eprt.api import GenerationRequest, RequestError, SamplingParams
from eprt.engine.config import EngineConfig
from eprt.engine.engine import launch_engine
from eprt.scheduler.config import SchedulerConfig, validate_request
from eprt.serve.batch import run_batch

MAX_MODEL_LEN = 48  # bounds every generation, so a fuzzed max_tokens of 10**30 stays fast
# Roles must alternate user/assistant, as in Mixtral's template; a refusal must be a 400.
TEMPLATE = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "{{ m['content'] }} {% endfor %}"
)


@pytest.fixture(scope="module")
def real_url(checkpoint, tmp_path_factory):
    model = _with_id_tokenizer(os.path.abspath(checkpoint("qwen3_moe")), str(tmp_path_factory.mktemp("fuzz")))
    with open(os.path.join(model, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": TEMPLATE}, f)
    cfg = EngineConfig(model=model, device="cpu", max_batch=4, block_size=4, max_model_len=MAX_MODEL_LEN)
    with launch_engine(cfg) as engine, running_server(engine) as url:
        yield url


def post(url: str, body, path="/v1/completions", timeout=30) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()  # ASCII: a lone surrogate goes as \ud800
    return httpx.post(url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=timeout)


def assert_all_blocks_free(url: str) -> None:
    deadline = time.monotonic() + 10
    while True:
        m = _metrics(url)
        if m["eprt_requests_running"] == 0 and m["eprt_kv_blocks_free"] == m["eprt_kv_blocks_capacity"]:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.05)
    assert not [k for k in m if 'status="5' in k], m


def _metrics(url: str) -> dict:
    with httpx.Client(base_url=url, timeout=10) as c:
        return scrape(c)


# ---- request bodies against the real engine ---------------------------------------------

EDGE_CASES = [
    # (what, path, body, expected status, the field named (400) or None)
    ("max_tokens 10**30", "/v1/completions", {"prompt": [5, 6], "max_tokens": 10**30}, 200, None),
    ("seed 2**70", "/v1/completions", {"prompt": [5], "seed": 2**70, "temperature": 0.7}, 200, None),
    ("top_k 10**12", "/v1/completions", {"prompt": [5], "top_k": 10**12, "temperature": 1.0}, 200, None),
    ("temperature 1e308", "/v1/completions", {"prompt": [5], "temperature": 1e308}, 400, "temperature"),
    (
        "repetition_penalty 1e-320",
        "/v1/completions",
        {"prompt": [5], "repetition_penalty": 1e-320},
        400,
        "repetition_penalty",
    ),
    ("temperature 10**400", "/v1/completions", {"prompt": [5], "temperature": 10**400}, 400, "temperature"),
    ("temperature 1e-320", "/v1/completions", {"prompt": [5], "temperature": 1e-320}, 200, None),
    ("prompt with NUL", "/v1/completions", {"prompt": "t5\u0000t6"}, 200, None),
    ("temperature 'nan'", "/v1/completions", {"prompt": [5], "temperature": "nan"}, 400, "temperature"),
    ("top_p NaN", "/v1/completions", b'{"prompt": [5], "top_p": NaN}', 400, "top_p"),
    ("negative seed", "/v1/completions", {"prompt": [5], "seed": -1}, 400, "seed"),
    ("lone surrogate prompt", "/v1/completions", {"prompt": "t5 \ud800"}, 400, "prompt"),
    ("lone surrogate stop", "/v1/completions", {"prompt": [5], "stop": ["\udc80"]}, 400, "stop"),
    ("prompt of no tokens", "/v1/completions", {"prompt": "   "}, 400, "prompt"),
    ("token ids as floats", "/v1/completions", {"prompt": [5.0]}, 400, "prompt"),
    ("token ids as bools", "/v1/completions", {"prompt": [True]}, 400, "prompt"),
    ("token id 10**30", "/v1/completions", {"prompt": [10**30]}, 400, "prompt"),
    ("10k stop strings", "/v1/completions", {"prompt": [5], "stop": ["x"] * 10_000}, 400, "stop"),
    ("JSON nested 100k deep", "/v1/completions", b"[" * 100_000, 400, "body"),
    ("prompt nested 100k deep", "/v1/completions", b'{"prompt": ' + b"[" * 100_000, 400, "body"),
    ("5000-digit integer", "/v1/completions", b'{"prompt": [5], "seed": ' + b"9" * 5000 + b"}", 400, "body"),
    (
        "surrogate in message",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "\ud800"}]},
        400,
        "messages",
    ),
    (
        "template refuses roles",
        "/v1/chat/completions",
        {"messages": [{"role": "assistant", "content": "t5"}]},
        400,
        "messages",
    ),
    ("message without role", "/v1/chat/completions", {"messages": [{"content": "t5"}]}, 400, "messages"),
    (
        "chat that the template takes",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "t5 t6"}], "max_completion_tokens": 3},
        200,
        None,
    ),
]


@pytest.mark.parametrize("what,path,body,status,param", EDGE_CASES, ids=[c[0] for c in EDGE_CASES])
def test_edge_values_on_the_real_engine(real_url, what, path, body, status, param):
    r = post(real_url, body, path)
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["param"] == param, r.text


_TEXT = st.lists(st.sampled_from(["t5", " ", "\u0000", "\ud800", "é", "\U0001f600", "\n"]), max_size=6).map("".join)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
# A body of plausible fields (edge values included), then up to two fields set to any JSON value.
_PROMPTS = {
    "prompt": st.lists(st.integers(-3, 300), max_size=5) | _TEXT,
    "messages": st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "x"]), "content": _TEXT}), max_size=3
    ),
}
_FIELDS = {
    "max_tokens": st.sampled_from([1, 3, 10**30, 0, -1]),
    "temperature": st.sampled_from([0, 0.7, 1e308]),
    "top_p": st.sampled_from([0.5, 1, 0]),
    "top_k": st.sampled_from([0, 5, 10**12]),
    "seed": st.sampled_from([0, 2**70, -5]),
    "stop": _TEXT | st.lists(_TEXT | st.integers(-1, 300), max_size=3),
    "stream": st.booleans(),
    "stream_options": st.just({"include_usage": True}),
    "n": st.just(1),
    "timeout": st.sampled_from([5, 1e-320, 1e308]),
    "model": st.just("model"),
}
_BODY = st.builds(
    lambda body, wrong: {**body, **wrong},
    st.fixed_dictionaries(_PROMPTS, optional=_FIELDS),
    st.dictionaries(st.sampled_from([*_PROMPTS, *_FIELDS]), _JSON, max_size=2),
)


@pytest.mark.slow
@settings(
    max_examples=120,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=_BODY | _JSON, chat=st.booleans())
def test_fuzzed_bodies_are_answered_200_or_4xx(real_url, body, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = post(real_url, body, path)
    assert r.status_code == 200 or 400 <= r.status_code < 500, r.text
    if r.status_code != 200:
        assert r.json()["error"]["message"]


def test_the_real_engine_ends_with_every_block_free(real_url):
    """Runs after the fuzz above (tests run in file order): nothing leaked, no 500 answered."""
    assert_all_blocks_free(real_url)


# ---- the socket level (fake engine) -----------------------------------------------------


def exchange(url: str, data: bytes, timeout: float = 10.0, half_close: bool = False) -> bytes:
    """Send raw bytes (then EOF, with ``half_close``), read until the server closes the connection."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    return reply


def request(body: bytes, headers: bytes = b"", version: bytes = b"HTTP/1.1", length: bool = True) -> bytes:
    head = b"POST /v1/completions " + version + b"\r\nHost: x\r\n" + headers
    return head + (b"Content-Length: %d\r\n" % len(body) if length else b"") + b"\r\n" + body


def statuses(reply: bytes) -> list:
    """The status codes of the responses in ``reply`` (pipelined ones follow a body directly)."""
    return [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", reply)]


BODY = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
CLOSE = b"Connection: close\r\n"


def test_chunked_bodies_and_framing_errors():
    with running_server(FakeEngine()) as url:
        chunked = b"%x\r\n%s\r\n" % (5, BODY[:5]) + b"%x;ext=1\r\n%s\r\n0\r\nX-Trailer: 1\r\n\r\n" % (
            len(BODY) - 5,
            BODY[5:],
        )
        ok = exchange(url, request(chunked, b"Transfer-Encoding: chunked\r\n" + CLOSE, length=False))
        assert statuses(ok) == [200] and b'"text":"hi"' in ok
        bad_size = exchange(url, request(b"zz\r\n", b"Transfer-Encoding: chunked\r\n", length=False))
        assert statuses(bad_size) == [400] and b"illegal chunk header" in bad_size
        gzip = exchange(url, request(BODY, b"Transfer-Encoding: gzip\r\n", length=False))
        assert statuses(gzip) == [501]
        two = exchange(url, request(BODY, b"Content-Length: 3\r\n"))
        assert statuses(two) == [400] and b"conflicting Content-Length" in two
        short = exchange(
            url, request(BODY).replace(b"Content-Length: %d" % len(BODY), b"Content-Length: 9999"), half_close=True
        )  # EOF before the body is whole
        assert statuses(short) in ([], [400])  # a client gone: no answer owed
        assert statuses(exchange(url, request(BODY, CLOSE))) == [200]


def test_pipelined_keep_alive_http10_and_get_with_a_body():
    with running_server(FakeEngine(), keep_alive_s=2.0) as url:  # the GET's connection: closed when idle
        three = exchange(url, request(BODY) + request(BODY) + request(BODY, CLOSE))
        assert statuses(three) == [200, 200, 200]
        stream = json.dumps({"prompt": "abc", "stream": True}).encode()
        old = exchange(url, request(stream, version=b"HTTP/1.0"))  # the server must close it
        head, _, rest = old.partition(b"\r\n\r\n")
        assert b"Transfer-Encoding" not in head and rest.startswith(b"data: ") and rest.endswith(b"[DONE]\n\n")
        get = exchange(url, b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nGET /")
        assert statuses(get) == [200]  # answered, then closed


def test_a_stalled_client_gets_408_and_frees_its_thread():
    with running_server(FakeEngine(), http_timeout_s=0.5) as url:
        t0 = time.monotonic()
        reply = exchange(url, request(BODY).replace(b"Content-Length: %d" % len(BODY), b"Content-Length: 9999"))
        assert statuses(reply) == [408] and time.monotonic() - t0 < 5
        assert statuses(exchange(url, request(BODY, CLOSE))) == [200]


def test_random_disconnects_and_a_reader_that_never_reads_do_not_disturb_others():
    engine = FakeEngine(token_delay=0.002, max_batch=16, max_model_len=4096)
    rnd = random.Random(0)
    with running_server(engine) as url:
        host, port = url.removeprefix("http://").split(":")
        never_reads = socket.create_connection((host, int(port)))
        never_reads.sendall(request(json.dumps({"prompt": "s" * 2000, "max_tokens": 4000, "stream": True}).encode()))

        def drop(i):
            with socket.create_connection((host, int(port))) as s:
                s.sendall(request(json.dumps({"prompt": "d" * 300, "max_tokens": 300, "stream": i % 3 > 0}).encode()))
                time.sleep(rnd.random() * 0.3)
                if i % 2:  # an abortive close (RST) instead of FIN
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")

        droppers = [threading.Thread(target=drop, args=(i,)) for i in range(10)]
        for t in droppers:
            t.start()
        t0 = time.monotonic()
        for i in range(3):
            r = httpx.post(url + "/v1/completions", json={"prompt": f"good {i}", "max_tokens": 20}, timeout=20)
            assert r.json()["choices"][0]["text"] == f"good {i}"
        assert time.monotonic() - t0 < 10
        for t in droppers:
            t.join(10)
        never_reads.close()
        deadline = time.monotonic() + 10
        while (s := engine.stats())["running"] or s["waiting"] or s["free_blocks"] != s["total_blocks"]:
            assert time.monotonic() < deadline, s
            time.sleep(0.02)
        assert len(engine.cancelled) >= 8  # the dropped ones were cancelled, not run to the end


# ---- eprt run, the engine's checks and eprt generate's flags ------------------------------


def test_batch_jsonl_fuzz_records_every_line(tmp_path):
    rnd = random.Random(1)
    good = [json.dumps({"id": f"g{i}", "prompt": f"ok {i}", "max_tokens": 4}).encode() for i in range(3)]
    bad = [
        b'{"id": "u", "prompt": "\xff"}',
        b"[" * 100_000,
        b'{"id": "\\ud800", "prompt": "x"}',
        b'{"id": "s", "prompt": "\\udc80"}',
        b'{"id": "r", "prompt": "a"}\r{"id": "r2", "prompt": "b"}',
        b'{"id": "n", "prompt_ids": [1], "seed": -1}',
        b'{"id": "k", "prompt": "x", "stop": ' + json.dumps(["y"] * 10_000).encode() + b"}",
        b'{"id": "f", "prompt_ids": [1.0]}',
        b"\x00\x01",
    ]
    rows = good + bad
    rnd.shuffle(rows)
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(rows) + b"\n")
    log = io.StringIO()
    rc = run_batch(FakeEngine(), str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), progress_stream=log)
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text("utf-8").splitlines()]
    assert rc == 0 and sorted(r["line"] for r in records) == list(range(1, len(rows) + 1))
    texts = {r["id"]: r["text"] for r in records if "text" in r}
    assert texts == {f"g{i}": f"ok {i}" for i in range(3)}
    errors = [r["error"] for r in records if "error" in r]
    assert len(errors) == len(bad) and all(errors)
    for words in ("UTF-8", "nested too deeply", "lone surrogate", "seed", "at most 16"):
        assert any(words in e for e in errors), (words, errors)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(seed=-1),
        SamplingParams(seed=1.5),
        SamplingParams(max_tokens=True),
        SamplingParams(temperature="0.5"),
        SamplingParams(temperature=float("nan")),
        SamplingParams(top_p=None),
        SamplingParams(top_k=2.0),
        SamplingParams(stop_token_ids=5),
        SamplingParams(stop_token_ids=(True,)),
    ],
)
def test_sampling_params_of_wrong_type_are_request_errors(params):
    with pytest.raises(RequestError):
        params.validate(vocab_size=100)


@pytest.mark.parametrize("prompt,timeout", [(5, None), ("abc", None), (None, None), ([1], "1"), ([1], float("nan"))])
def test_validate_request_names_bad_prompts_and_timeouts(prompt, timeout):
    with pytest.raises(RequestError):
        validate_request(SchedulerConfig(vocab_size=100), GenerationRequest(prompt, timeout_s=timeout))


@pytest.mark.parametrize(
    "flags", [["--seed", "-1"], ["--temperature", "nan"], ["--top-p", "inf"], ["--top-k", "-2"], ["--max-tokens", "0"]]
)
def test_generate_flags_are_checked_before_the_engine_runs(flags):
    import argparse

    from eprt.entry.generate import add_arguments, check_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(RequestError, match=flags[0].removeprefix("--").replace("-", "_")):
        check_args(parser.parse_args(["--prompt-ids", "1,2", *flags]))  # (since issue 36: before any rank loads)
