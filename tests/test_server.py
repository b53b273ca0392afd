"""``eprt serve``: the OpenAI-compatible HTTP server, over a real loopback socket.

Most tests run the real server code (eprt.serve.http, .openai, .stream, .metrics,
.loop) against tests/fake_engine.py, which echoes the prompt back one byte-token per
step, so every expected text is known exactly. The last test runs the real engine
under mpiexec.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from fake_engine import EOS, ByteTokenizer, FakeEngine
from hypothesis import given
from hypothesis import strategies as st

from eprt.serve.http import HttpServer, ServerState
from eprt.serve.loop import EngineLoop
from eprt.serve.server import serve
from eprt.serve.settings import HttpSettings
from eprt.serve.stream import TextStream

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


@contextmanager
def running_server(engine, api_key=None, stall_s=30.0, **settings):
    """The engine loop and the HTTP server on background threads; yields the base URL.
    ``settings``: fields of HttpSettings (http_timeout_s, max_body_bytes, ...)."""
    loop = EngineLoop(engine, stall_s)
    engine_thread = threading.Thread(target=_run_quietly, args=(loop,), daemon=True)
    engine_thread.start()
    http = HttpServer(ServerState(engine, loop, HttpSettings(api_key=api_key, **settings)), "127.0.0.1", 0)
    http.start()
    try:
        yield f"http://127.0.0.1:{http.port}"
    finally:
        loop.stop.set()
        engine_thread.join(10)
        http.stop()


def _run_quietly(loop: EngineLoop) -> None:
    try:
        loop.run()
    except Exception:  # recorded in loop.failure; the tests look there
        pass


@pytest.fixture
def engine():
    return FakeEngine(token_delay=0.002)


@pytest.fixture
def client(engine):
    with running_server(engine) as url, httpx.Client(base_url=url, timeout=20) as c:
        yield c


def events(response) -> list:
    """The SSE ``data:`` payloads of a streamed response, decoded (``[DONE]`` kept as text)."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def streamed_text(evs: list, chat: bool) -> str:
    key = (lambda c: c["delta"].get("content", "")) if chat else (lambda c: c["text"])
    return "".join(key(c) for e in evs if isinstance(e, dict) for c in e.get("choices", []))


def complete(client, path="/v1/completions", **body):
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


@given(
    text=st.text(alphabet="ab é東\n", max_size=24),
    stops=st.lists(st.text(alphabet="ab é東", min_size=1, max_size=3), max_size=3),
)
def test_text_stream_deltas_add_up_and_stop_at_the_first_stop_string(text, stops):
    tok = ByteTokenizer()  # multi-byte characters span several tokens
    stream = TextStream(tok, stops, hidden_ids=[EOS])
    deltas = [stream.feed(t) for t in tok.encode(text) + [EOS]]
    shown = "".join(deltas) + stream.finish()
    assert "\ufffd" not in shown  # never half a character
    # Generation stops where the first stop string is complete (earliest end, then earliest start).
    ends = sorted((text.find(s) + len(s), text.find(s)) for s in stops if s in text)
    expected = text[: ends[0][1]] if ends else text
    assert shown == stream.text == expected
    assert stream.stopped == bool(ends)


def test_health_models_and_unknown_routes(client):
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["fake-moe"]
    assert models["data"][0]["max_model_len"] == 512
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "no route" in r.json()["error"]["message"]
    assert client.get("/v1/completions").status_code == 405
    assert client.post("/v1/models", json={}).status_code == 405


def test_completion_text_usage_and_prefix_cache(client):
    first = complete(client, prompt="hello world!", max_tokens=50)
    assert first["object"] == "text_completion" and first["model"] == "fake-moe"
    assert first["choices"][0]["text"] == "hello world!"
    assert first["choices"][0]["finish_reason"] == "stop"
    # 12 echoed bytes plus the EOS; nothing cached the first time.
    assert first["usage"] == {
        "prompt_tokens": 12,
        "completion_tokens": 13,
        "total_tokens": 25,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    again = complete(client, prompt="hello world!", max_tokens=5)
    assert again["choices"][0] == {
        "index": 0,
        "text": "hello",
        "logprobs": None,
        "finish_reason": "length",
        "token_ids": list(b"hello"),
    }
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 8
    assert complete(client, prompt=[104, 105])["choices"][0]["text"] == "hi"


def test_sampling_fields_reach_the_engine(client, engine):
    complete(client, prompt="abc", max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, seed=11, stop=[98])
    params = engine.submitted[-1].params
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed) == (7, 0.5, 0.9, 3, 11)
    assert params.stop_token_ids == (98,)


def test_concurrent_streaming_and_non_streaming():
    engine = FakeEngine(token_delay=0.003, max_batch=3)  # fewer slots than requests: some queue
    prompts = [f"request {i}: grüße, 東京 #{i}" for i in range(8)]
    results = {}

    def run(i, url):
        with httpx.Client(base_url=url, timeout=30) as c:
            body = {"prompt": prompts[i], "max_tokens": 100, "stream": i % 2 == 0}
            if body["stream"]:
                with c.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                    evs = events(r)
                assert evs[-1] == "[DONE]" and evs[-2]["choices"][0]["finish_reason"] == "stop"
                assert len(evs) > 10  # really streamed, not one blob
                results[i] = streamed_text(evs, chat=False)
            else:
                results[i] = complete(c, **body)["choices"][0]["text"]

    with running_server(engine) as url:
        threads = [threading.Thread(target=run, args=(i, url)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert results == dict(enumerate(prompts))


def test_chat_template_streaming_and_usage(client):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
    ]
    expected = "<system>be brief\n<user>hi there\n<assistant>"
    body = complete(client, "/v1/chat/completions", messages=messages, model="fake-moe")
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": expected}
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={"messages": messages, "stream": True, "stream_options": {"include_usage": True}},
    ) as r:
        evs = events(r)
    assert evs[0]["object"] == "chat.completion.chunk"
    assert evs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert streamed_text(evs, chat=True) == expected
    assert evs[-3]["choices"][0]["finish_reason"] == "stop"
    assert evs[-2]["choices"] == [] and evs[-2]["usage"]["completion_tokens"] == len(expected) + 1
    assert evs[-1] == "[DONE]"


def test_chat_without_template_is_a_400():
    with running_server(FakeEngine(tokenizer=ByteTokenizer(chat_template=False))) as url:
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages" and "chat template" in r.json()["error"]["message"]


def test_model_without_tokenizer_takes_token_ids():
    with running_server(FakeEngine(tokenizer=None)) as url, httpx.Client(base_url=url) as c:
        ok = complete(c, prompt=[104, 105], max_tokens=5)
        text_prompt = c.post("/v1/completions", json={"prompt": "hi"})
        stop_string = c.post("/v1/completions", json={"prompt": [104, 105], "stop": "i"})
        stop_id = complete(c, prompt=[104, 105], stop=[105])
    assert ok["choices"][0]["text"] == "" and ok["usage"]["completion_tokens"] == 3
    assert text_prompt.status_code == 400 and text_prompt.json()["error"]["param"] == "prompt"
    assert stop_string.status_code == 400 and stop_string.json()["error"]["param"] == "stop"
    assert stop_id["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_text_and_cancels_the_sequence(client, engine, stream):
    body = {"prompt": "one two. three four", "max_tokens": 100, "stop": ["nothing", ". th"], "stream": stream}
    if stream:
        with client.stream("POST", "/v1/completions", json=body) as r:
            evs = events(r)
        text, reason = streamed_text(evs, chat=False), evs[-2]["choices"][0]["finish_reason"]
    else:
        choice = complete(client, **body)["choices"][0]
        text, reason = choice["text"], choice["finish_reason"]
    assert (text, reason) == ("one two", "stop")
    assert engine.cancelled == [engine.submitted[-1].request_id]  # generation stopped early


def test_stop_token_id_ends_generation_in_the_engine(client, engine):
    choice = complete(client, prompt="hello world", stop=[ord(" ")])["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("hello", "stop")
    assert engine.cancelled == []


def test_timeout_and_engine_error():
    with running_server(FakeEngine(token_delay=0.01)) as url, httpx.Client(base_url=url, timeout=20) as c:
        choice = complete(c, prompt="x" * 300, max_tokens=300, timeout=0.1)["choices"][0]
        assert choice["finish_reason"] == "timeout" and 0 < len(choice["text"]) < 300
        r = c.post("/v1/completions", json={"prompt": "FAIL now"})
        assert r.status_code == 500 and "fake engine failure" in r.json()["error"]["message"]
        with c.stream("POST", "/v1/completions", json={"prompt": "FAIL now", "stream": True}) as r:
            evs = events(r)
        assert "fake engine failure" in evs[-2]["error"]["message"] and evs[-1] == "[DONE]"


BAD_REQUESTS = [
    # (what, path, raw body, the field the error must name)
    ("malformed JSON", "/v1/completions", b'{"prompt": "x",', "body"),
    ("body not an object", "/v1/completions", b"[1, 2]", "body"),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, "prompt"),
    ("prompt of wrong type", "/v1/completions", {"prompt": 42}, "prompt"),
    ("token id outside vocabulary", "/v1/completions", {"prompt": [1, 5000]}, "prompt"),
    ("max_tokens as a string", "/v1/completions", {"prompt": "x", "max_tokens": "10"}, "max_tokens"),
    ("negative max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("negative temperature", "/v1/completions", {"prompt": "x", "temperature": -0.5}, "temperature"),
    ("top_p of zero", "/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("seed as a float", "/v1/completions", {"prompt": "x", "seed": 1.5}, "seed"),
    ("stop of wrong type", "/v1/completions", {"prompt": "x", "stop": {"a": 1}}, "stop"),
    ("stream not a bool", "/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("negative timeout", "/v1/completions", {"prompt": "x", "timeout": -1}, "timeout"),
    ("n < 1", "/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("unknown model", "/v1/completions", {"prompt": "x", "model": "gpt-17"}, "model"),
    ("prompt longer than the context", "/v1/completions", {"prompt": "x" * 600}, "prompt"),
    ("messages missing", "/v1/chat/completions", {"model": "fake-moe"}, "messages"),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
]


@pytest.mark.parametrize("what,path,body,names", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_is_a_400_and_does_not_disturb_others(what, path, body, names):
    engine = FakeEngine(token_delay=0.005)
    good = {}
    with running_server(engine) as url, httpx.Client(base_url=url, timeout=20) as c:

        def good_request():
            with c.stream("POST", "/v1/completions", json={"prompt": "still fine", "stream": True}) as r:
                good["evs"] = events(r)

        t = threading.Thread(target=good_request)
        t.start()
        while not engine.submitted:  # the good request is in flight
            time.sleep(0.001)
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(url + path, content=raw, headers={"Content-Type": "application/json"})
        t.join(20)
        assert engine.stats()["running"] == 0
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == names or names in err["message"], err
    assert streamed_text(good["evs"], chat=False) == "still fine" and good["evs"][-1] == "[DONE]"


@pytest.mark.parametrize("length", [b"\xb2", b"\xb9", b"1e3", b"-1"])  # '\xb2' is '\u00b2' in latin-1
def test_bad_content_length_is_a_400_not_a_500(engine, length):
    with running_server(engine) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: " + length + b"\r\nConnection: close\r\n\r\n"
            )
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"400", reply
    assert "malformed HTTP request" in json.loads(body)["error"]["message"]


def _wait_for(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_dropped_stream_cancels_the_sequence():
    engine = FakeEngine(token_delay=0.01)
    with running_server(engine) as url:
        with httpx.Client(base_url=url, timeout=20) as c:
            body = {"prompt": "y" * 400, "max_tokens": 400, "stream": True}
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
        # The client is gone after a few tokens: the server must cancel, freeing the blocks.
        _wait_for(lambda: engine.cancelled == [engine.submitted[0].request_id])
        stats = engine.stats()
        assert stats["running"] == 0 and stats["free_blocks"] == stats["total_blocks"]


def test_abandoned_non_streaming_request_is_cancelled():
    engine = FakeEngine(token_delay=0.01)
    with running_server(engine) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json={"prompt": "z" * 400, "max_tokens": 400}, timeout=0.2)
        _wait_for(lambda: len(engine.cancelled) == 1)
        assert engine.stats()["running"] == 0


def test_api_key(engine):
    with running_server(engine, api_key="s3cret") as url, httpx.Client(base_url=url) as c:
        r = c.get("/v1/models")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert (
            c.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer wrong"}).status_code
            == 401
        )
        ok = c.post("/v1/completions", json={"prompt": "ok"}, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "ok"
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert len(engine.submitted) == 1


_SAMPLE = re.compile(r'^[a-z_]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? -?[0-9.e+-]+$')


def test_metrics_prometheus_text(client):
    complete(client, prompt="abcd", max_tokens=3)
    client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0})
    r = client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    lines = r.text.splitlines()
    samples = {name: float(v) for name, v in (line.rsplit(" ", 1) for line in lines if not line.startswith("#"))}
    assert all(_SAMPLE.match(line) for line in lines if not line.startswith("#")), r.text
    assert samples['eprt_http_requests_total{route="/v1/completions",status="200"}'] == 1
    assert samples['eprt_http_requests_total{route="/v1/completions",status="400"}'] == 1
    assert samples["eprt_request_latency_seconds_count"] == 1
    assert samples['eprt_request_latency_seconds_bucket{le="+Inf"}'] == 1
    assert samples["eprt_time_to_first_token_seconds_count"] == 1
    assert samples["eprt_generation_tokens_total"] == 3
    assert samples["eprt_prompt_tokens_total"] == 4
    assert samples["eprt_kv_blocks_free"] == samples["eprt_kv_blocks_capacity"] == 1024
    assert samples["eprt_requests_running"] == 0


def test_port_in_use_is_a_clear_error(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert serve(FakeEngine(), "127.0.0.1", taken.getsockname()[1]) == 2
    assert "cannot listen on 127.0.0.1:" in capsys.readouterr().err


class ServerProcess:
    """``eprt serve`` in a subprocess; stderr is drained on a thread (so the pipe never fills)."""

    def __init__(self, cmd: list, env: dict | None = None):
        self.proc = subprocess.Popen(
            cmd,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"},
        )
        self.log: list = []
        self._url = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.proc.stderr:
            self.log.append(line)
            m = re.search(r"(http://127\.0\.0\.1:\d+)/v1", line)
            if m:
                self.url = m.group(1)
                self._url.set()

    def wait_url(self, timeout: float) -> str:
        assert self._url.wait(timeout), "the server never announced its address:\n" + "".join(self.log)
        return self.url

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


SERVE_FAKE = """
import sys
sys.path.insert(0, {tests!r})
from fake_engine import FakeEngine
from eprt.serve.server import serve
sys.exit(serve(FakeEngine(token_delay=0.01), "127.0.0.1", 0))
"""


def test_sigterm_finishes_in_flight_requests_then_exits_0():
    server = ServerProcess([sys.executable, "-c", SERVE_FAKE.format(tests=str(TESTS))])
    try:
        url = server.wait_url(30)
        prompt = "graceful " * 12
        with httpx.Client(base_url=url, timeout=20) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 200, "stream": True}) as r:
                lines = r.iter_lines()
                first = next(lines)
                server.proc.send_signal(signal.SIGTERM)
                health = httpx.get(url + "/health", timeout=5)
                refused = httpx.post(url + "/v1/completions", json={"prompt": "late"}, timeout=5)
                rest = list(lines)
        evs = [json.loads(first[6:])] + [
            json.loads(l[6:]) if l != "data: [DONE]" else "[DONE]" for l in rest if l.startswith("data: ")
        ]
        assert streamed_text(evs, chat=False) == prompt and evs[-1] == "[DONE]"
        assert health.status_code == 503
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        assert server.proc.wait(timeout=20) == 0
        time.sleep(0.1)  # let the drain thread read the last line
        assert "eprt serve: stopped" in "".join(server.log)
    finally:
        server.stop()


# ---- the real engine under MPI --------------------------------------------------------


@pytest.mark.slow
def test_real_engine_server_under_mpiexec(checkpoint):
    server = ServerProcess(
        [
            "mpiexec",
            "-n",
            "2",
            sys.executable,
            "-m",
            "eprt.cli",
            "serve",
            "--model",
            checkpoint("mixtral"),
            "--device",
            "cpu",
            "--port",
            "0",
        ]
    )
    try:
        prompt = list(range(3, 43))  # 40 tokens: two whole 16-token KV blocks
        with httpx.Client(base_url=server.wait_url(120), timeout=120) as c:
            body = complete(c, prompt=prompt, max_tokens=8)
            with c.stream(
                "POST",
                "/v1/completions",
                json={"prompt": prompt, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}},
            ) as r:
                evs = events(r)
            bad = c.post("/v1/completions", json={"prompt": [1] * 10_000})
        assert body["usage"]["prompt_tokens"] == len(prompt)
        assert evs[-2]["usage"]["completion_tokens"] == body["usage"]["completion_tokens"]  # greedy: same run
        assert evs[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the same prompt again
        assert bad.status_code == 400 and "10000 tokens" in bad.json()["error"]["message"]
        server.proc.send_signal(signal.SIGTERM)  # mpiexec forwards it to every rank
        assert server.proc.wait(timeout=60) == 0, "".join(server.log)
    finally:
        server.stop()
