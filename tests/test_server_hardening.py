"""``eprt serve`` against hostile or unlucky clients and a failing engine (tests/fake_engine.py).

Auth before routing, OpenAI error bodies for every status, 400 (never 422) for bad types,
the body limit enforced before the body arrives, cost limits on prompts and stop strings,
slow-loris sockets closed at the header deadline, and an engine failure reaching every
client (an error answer, or an error event then [DONE]) with /health turning 503.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from fake_engine import FakeEngine
from test_server import ROOT, TESTS, ServerProcess, complete, events, running_server

from eprt.serve.settings import check_api_key

KEY = {"Authorization": "Bearer s3cret"}


def _address(url: str) -> tuple:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


# ---- auth -------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["", " ", "\t\n"])
def test_an_empty_or_blank_api_key_is_a_start_up_error(key):
    with pytest.raises(ValueError, match="empty key would turn authentication off"):
        check_api_key(key)
    out = subprocess.run(
        [sys.executable, "-m", "eprt.cli", "serve", "--model", "/nonexistent", "--api-key", key],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "empty key would turn authentication off" in out.stderr, out.stderr


def test_with_a_key_every_route_but_health_needs_it_before_routing():
    with running_server(FakeEngine(), api_key="s3cret") as url, httpx.Client(base_url=url) as c:
        for method, path in [
            ("GET", "/metrics"),
            ("GET", "/v1/models"),
            ("GET", "/nowhere"),
            ("PUT", "/v1/completions"),
            ("DELETE", "/v1/models"),
            ("OPTIONS", "/v1/completions"),
            ("POST", "/v1/completions"),
        ]:
            r = c.request(method, path, json={"prompt": "x"} if method == "POST" else None)
            assert _error(r, 401)["code"] == "invalid_api_key", (method, path)
            assert r.headers["www-authenticate"] == "Bearer"
        wrong = c.get("/v1/models", headers={"Authorization": "Bearer s3cret-not"})
        assert _error(wrong, 401)["code"] == "invalid_api_key"
        assert c.get("/health").status_code == 200
        assert c.get("/metrics", headers=KEY).status_code == 200
        assert _error(c.get("/nowhere", headers=KEY), 404)["code"] == "not_found"
        assert _error(c.put("/v1/completions", headers=KEY), 405)["code"] == "method_not_allowed"
        ok = c.post("/v1/completions", json={"prompt": "hi"}, headers=KEY)
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "hi"


# ---- error bodies, 400 not 422 ----------------------------------------------------------------


@pytest.mark.parametrize(
    "method,path,status",
    [
        ("GET", "/nowhere", 404),
        ("POST", "/v2/anything", 404),
        ("PUT", "/v1/completions", 405),
        ("DELETE", "/v1/completions", 405),
        ("OPTIONS", "/v1/completions", 405),
        ("HEAD", "/v1/completions", 405),
        ("PATCH", "/v1/models", 405),
        ("POST", "/health", 405),
    ],
)
def test_unknown_routes_and_methods_get_openai_error_bodies(method, path, status):
    with running_server(FakeEngine()) as url:
        r = httpx.request(method, url + path)
    assert r.status_code == status and "access-control-allow-origin" not in r.headers  # CORS off
    if method != "HEAD":  # a HEAD answer has no body by definition
        assert _error(r, status)["type"] == "invalid_request_error"
        assert b"<html" not in r.content.lower()


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "stream": 1}, "stream"),
        ({"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
        ({"prompt": "x", "stop": [1.5]}, "stop"),
        ({"prompt": "x", "stream_options": {"include_usage": "yes"}}, "stream_options"),
        ({"prompt": "x", "model": 7}, "model"),
    ],
)
def test_wrong_types_are_400_never_422(body, param):
    with running_server(FakeEngine()) as url:
        r = httpx.post(url + "/v1/completions", json=body)
    assert _error(r, 400)["param"] == param


def test_served_model_name():
    with running_server(FakeEngine(), served_model_name="my-moe") as url, httpx.Client(base_url=url) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["my-moe"]
        assert complete(c, prompt="ab", model="my-moe")["model"] == "my-moe"
        assert _error(c.post("/v1/completions", json={"prompt": "ab", "model": "fake-moe"}), 400)["param"] == "model"


# ---- cost limits ------------------------------------------------------------------------------


def _raw(url: str, data: bytes, timeout: float = 10.0, then=None) -> tuple:
    """Send ``data`` on a fresh socket (then call ``then(sock)``); (reply bytes, seconds to the reply)."""
    with socket.create_connection(_address(url), timeout=timeout) as s:
        t0 = time.monotonic()
        s.sendall(data)
        if then:
            then(s)
        reply = b""
        try:
            while chunk := s.recv(65536):
                reply += chunk
        except ConnectionResetError:
            pass
        return reply, time.monotonic() - t0


def test_an_oversized_body_is_refused_before_it_is_read():
    with running_server(FakeEngine(), max_body_bytes=4096) as url:
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 31457280\r\n\r\n"
        )  # 30 MB announced, none sent
        reply, _ = _raw(url, head)
        status, _, body = reply.partition(b"\r\n\r\n")
        assert status.split(b" ")[1] == b"413" and "4096 byte limit" in json.loads(body)["error"]["message"]

        def drip(s):  # chunked: no length announced
            try:
                for _ in range(20):
                    s.sendall(b"400\r\n" + b" " * 1024 + b"\r\n")
            except (
                BrokenPipeError,
                ConnectionResetError,
            ):  # the server refused the body and closed: its reply is read below
                pass

        chunked = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        reply, _ = _raw(url, chunked, then=drip)
        assert reply.split(b" ")[1] == b"413", reply[:200]


def test_prompts_that_cannot_fit_the_context_are_refused_before_tokenizing():
    engine = FakeEngine(max_model_len=512)
    calls = []
    encode = engine.tokenizer.encode
    engine.tokenizer = type(engine.tokenizer)()
    engine.tokenizer.encode = lambda text: calls.append(len(text)) or encode(text)
    with running_server(engine) as url, httpx.Client(base_url=url) as c:
        long_text = _error(c.post("/v1/completions", json={"prompt": "x" * (512 * 32 + 1)}), 400)
        long_ids = _error(c.post("/v1/completions", json={"prompt": [5] * 100_000}), 400)
        long_chat = _error(
            c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "y" * 20_000}]}), 400
        )
        no_room = _error(c.post("/v1/completions", json={"prompt": "z" * 512}), 400)
    assert long_text["param"] == "prompt" and "16385 characters" in long_text["message"]
    assert long_ids["param"] == "prompt" and "100000 tokens" in long_ids["message"]
    assert long_chat["param"] == "messages" and "20000 characters" in long_chat["message"]
    assert no_room["param"] == "prompt" and "512 tokens" in no_room["message"] and "room" in no_room["message"]
    assert calls == [512]  # only the prompt that could fit was tokenized


def test_max_tokens_past_the_context_is_clamped_to_it():
    engine = FakeEngine(max_model_len=64)
    with running_server(engine) as url, httpx.Client(base_url=url) as c:
        body = complete(c, prompt="a" * 60, max_tokens=10**12, stream=False)
        chat = complete(c, "/v1/chat/completions", messages=[{"role": "user", "content": "b" * 40}])
    assert engine.submitted[0].params.max_tokens == 4  # 64 - 60
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 4
    assert engine.submitted[1].params.max_tokens == 64 - len("<user>" + "b" * 40 + "\n<assistant>")
    assert chat["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    "stop,words",
    [(["s"] * 17, "at most 16"), (["q" * 600, "r" * 600], "1200 characters"), ("x" * 1025, "1025 characters")],
)
def test_stop_strings_are_limited_in_count_and_length(stop, words):
    with running_server(FakeEngine()) as url:
        err = _error(httpx.post(url + "/v1/completions", json={"prompt": "x", "stop": stop}), 400)
    assert err["param"] == "stop" and words in err["message"], err


# ---- slow clients -----------------------------------------------------------------------------


def test_slow_loris_sockets_are_closed_at_the_header_deadline_while_others_are_served():
    timeout, n = 1.0, 50
    closed_after, stop = [], threading.Event()

    def loris(url):
        with socket.create_connection(_address(url), timeout=30) as s:
            t0 = time.monotonic()
            try:
                for byte in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000:
                    s.sendall(bytes([byte]))
                    time.sleep(0.05)
                    if stop.is_set():
                        return
            except OSError:  # reset by the server: closed
                pass
            else:
                return
            closed_after.append(time.monotonic() - t0)

    with running_server(FakeEngine(token_delay=0.002), http_timeout_s=timeout) as url:
        threads = [threading.Thread(target=loris, args=(url,)) for _ in range(n)]
        for t in threads:
            t.start()
        with httpx.Client(base_url=url, timeout=10) as c:
            answers = [complete(c, prompt=f"ok {i}")["choices"][0]["text"] for i in range(10)]
        for t in threads:
            t.join(15)
        stop.set()
    assert answers == [f"ok {i}" for i in range(10)]
    assert len(closed_after) == n, f"only {len(closed_after)} of {n} slow sockets were closed"
    assert max(closed_after) < timeout + 5.0, closed_after  # the deadline, plus scheduling slack


def test_a_body_that_stalls_gets_408():
    with running_server(FakeEngine(), http_timeout_s=0.5) as url:
        head = b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"prompt"'
        reply, took = _raw(url, head)
    assert reply.split(b" ")[1] == b"408" and took < 5, reply[:200]
    assert "did not arrive within 0.5s" in json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["message"]


def test_a_silent_connection_is_closed_at_the_header_deadline():
    with running_server(FakeEngine(), http_timeout_s=0.5) as url:
        reply, took = _raw(url, b"")
    assert reply.split(b" ")[1] == b"408" and took < 5, reply


# ---- engine failures --------------------------------------------------------------------------


def test_an_engine_failure_reaches_every_client_and_health_turns_503():
    engine = FakeEngine(token_delay=0.01)
    results = {}

    def ask(i, url):
        body = {"prompt": f"request {i} " + "w" * 300, "max_tokens": 300}
        if i % 2:
            with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=20) as r:
                assert r.status_code == 200
                results[i] = events(r)
        else:
            results[i] = httpx.post(url + "/v1/completions", json=body, timeout=20)

    with running_server(engine) as url:
        threads = [threading.Thread(target=ask, args=(i, url)) for i in range(6)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while len(engine.submitted) < 6:  # all six in flight, then the crash
            assert time.monotonic() < deadline
            time.sleep(0.01)
        crash = httpx.post(url + "/v1/completions", json={"prompt": "CRASH"}, timeout=20)
        for t in threads:
            t.join(20)
        health = httpx.get(url + "/health")
        late = httpx.post(url + "/v1/completions", json={"prompt": "late"})
    assert len(results) == 6
    for i, res in results.items():
        if i % 2:
            assert res[-1] == "[DONE]" and "fake engine crash" in res[-2]["error"]["message"], res[-3:]
            assert len(res) > 2  # it had streamed some text first
        else:
            assert "fake engine crash" in _error(res, 503)["message"]
    assert "fake engine crash" in _error(crash, 503)["message"]
    assert health.status_code == 503 and health.json()["status"] == "failed"
    assert "fake engine crash" in _error(late, 503)["message"]


SERVE_CRASH = """
import sys
sys.path.insert(0, {tests!r})
from fake_engine import FakeEngine
from eprt.serve.server import serve
sys.exit(serve(FakeEngine(token_delay=0.01), "127.0.0.1", 0))
"""


def test_an_engine_failure_ends_the_server_non_zero_and_names_the_rank():
    server = ServerProcess([sys.executable, "-c", SERVE_CRASH.format(tests=str(TESTS))])
    try:
        url = server.wait_url(30)
        with httpx.stream(
            "POST", url + "/v1/completions", json={"prompt": "CRASH now", "stream": True}, timeout=20
        ) as r:
            evs = events(r)
        assert evs[-1] == "[DONE]" and "fake engine crash" in evs[-2]["error"]["message"]
        assert server.proc.wait(timeout=20) == 3
        time.sleep(0.1)
        assert "rank 0 failed: RuntimeError: fake engine crash" in "".join(server.log)
    finally:
        server.stop()


def test_health_is_503_while_work_is_pending_and_no_step_completes():
    engine = FakeEngine(token_delay=0.01)
    gate = threading.Event()
    step = engine.step
    engine.step = lambda: gate.wait() and step()  # the loop hangs in its next step
    with running_server(engine, stall_s=0.5) as url:
        assert httpx.get(url + "/health").status_code == 200
        t = threading.Thread(target=lambda: httpx.post(url + "/v1/completions", json={"prompt": "p"}, timeout=20))
        t.start()
        time.sleep(1.5)
        stalled = httpx.get(url + "/health")
        gate.set()
        t.join(20)
        time.sleep(0.6)
        healthy = httpx.get(url + "/health")
    assert stalled.status_code == 503 and stalled.json()["status"] == "stalled", stalled.text
    assert healthy.status_code == 200
