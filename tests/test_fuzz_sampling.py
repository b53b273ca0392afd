"""One request can never take down the job (issue 35; docs/design.md, "Failure isolation"):
``eprt serve`` on the built-in model at ``-n 1`` and under ``mpiexec -n 2``, with failures planted
in per-request stages (tests/planted_faults.py), while four long streams are in flight:

- the reproduction ``repetition_penalty=1e-320`` (which crashed the job) is a 400 naming the field;
- each planted failure (a logits processor, a structured-output mask or matcher, the detokenizer) and a
  request whose masks leave no token fail that request alone, with an error naming the cause;
- hypothesis-generated bodies with every numeric sampling field at its edges (denormals, 0,
  negative zero, 1e308, huge integers, NaN and infinities, their strings; mostly in range, so that
  the engine samples with them) are answered 200 or 4xx;

and every stream in flight finishes whole, the job stays up, and it stops cleanly (exit 0).
Bounded: one server per world size, 40 fuzzed bodies each.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planted_faults import PLANTED_MATCHER, PLANTED_REGEX, PLANTED_SEED, PLANTED_TOKEN
from test_server import ServerProcess

from eprt.comm.world import launcher_world_size

DRIVER = Path(__file__).with_name("planted_faults.py")
FLAGS = ["--device", "cpu", "--port", "0", "--max-batch", "8", "--max-model-len", "512"]
STREAMS, STREAM_TOKENS = 4, 300  # the streams in flight, each this long (ignore_eos)
REPRODUCTION = {"prompt": "aaaa", "max_tokens": 8, "repetition_penalty": 1e-320, "temperature": 1, "top_p": 0.5}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(launcher_world_size() > 1, reason="launches its own jobs; run once, not per rank"),
]


@pytest.fixture(scope="module", params=[1, 2], ids=["n1", "mpiexec-n2"])
def server(request):
    world = request.param
    if world > 1 and shutil.which("mpiexec") is None:
        pytest.skip("mpiexec not on PATH")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "OMPI_"))}
    launcher = [] if world == 1 else ["mpiexec", "-n", str(world)]
    srv = ServerProcess([*launcher, sys.executable, str(DRIVER), "serve", *FLAGS], env)
    try:
        srv.wait_url(120)
        yield srv
    finally:
        if srv.proc.poll() is None:
            srv.proc.send_signal(signal.SIGTERM)
            try:
                srv.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        srv.stop()


def post(url: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(url + "/v1/completions", content=json.dumps(body), timeout=timeout)


def stream_events(url: str, body: dict, on_first=None) -> list:
    """The ``data:`` payloads of a streamed completion (JSON decoded, ``[DONE]`` kept as text)."""
    out = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                payload = line[len("data: ") :]
                out.append(payload if payload == "[DONE]" else json.loads(payload))
                if on_first is not None and len(out) == 1:
                    on_first()
    return out


def stream_error(events: list) -> str | None:
    return next((e["error"]["message"] for e in events if isinstance(e, dict) and "error" in e), None)


class InFlight:
    """STREAMS streams of STREAM_TOKENS tokens on threads, in flight once entered (each has sent
    a chunk); with ``again`` each starts over as it ends until the block exits. ``check()``: every
    one finished whole (finish_reason length, every token, no error event, [DONE])."""

    def __init__(self, url: str, again: bool = False):
        self.url, self.again = url, again
        self.stop = threading.Event()
        self.started = [threading.Event() for _ in range(STREAMS)]
        self.runs: list = []  # (stream, its events or the exception it raised)
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(STREAMS)]

    def _run(self, i: int) -> None:
        body = {
            "prompt": f"stream {i}: ",
            "max_tokens": STREAM_TOKENS,
            "ignore_eos": True,
            "temperature": 0.8,
            "seed": i,
            "stream_options": {"include_usage": True},
        }
        while True:
            try:
                self.runs.append((i, stream_events(self.url, body, self.started[i].set)))
            except Exception as e:  # reported by check()
                self.runs.append((i, e))
                self.started[i].set()
            if not self.again or self.stop.is_set():
                return

    def __enter__(self) -> InFlight:
        for t in self.threads:
            t.start()
        for started in self.started:
            assert started.wait(60), "a stream never started"
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)

    def check(self) -> int:
        assert len(self.runs) >= STREAMS
        for i, events in self.runs:
            assert isinstance(events, list), f"stream {i}: {events!r}"
            assert stream_error(events) is None, f"stream {i}: {stream_error(events)}"
            finish = [c["finish_reason"] for e in events if isinstance(e, dict) for c in e.get("choices", ())]
            usage = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
            assert finish[-1] == "length" and usage[-1]["completion_tokens"] == STREAM_TOKENS, (i, events[-3:])
            assert events[-1] == "[DONE]"
        return len(self.runs)


def assert_healthy(url: str) -> None:
    r = httpx.get(url + "/health", timeout=10)
    assert r.status_code == 200, r.text


def test_the_reproduction_is_refused_while_four_streams_finish(server):
    with InFlight(server.url) as streams:
        r = post(server.url, REPRODUCTION)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "repetition_penalty" and "1e-320" in error["message"], error
        assert "[1e-06, 1e+06]" in error["message"]
    assert streams.check() == STREAMS
    assert_healthy(server.url)


PLANTED = {  # a request that fails alone, and the words its error names
    "logits processor": ({"seed": PLANTED_SEED, "presence_penalty": 0.5}, "planted failure in the logits processing"),
    "structured mask": ({"guided_regex": f"({PLANTED_REGEX})+"}, "planted failure in the structured-output mask"),
    "grammar matcher": ({"guided_regex": f"({PLANTED_MATCHER})+"}, "planted failure making the structured-output"),
    "detokenizer": ({"logit_bias": {str(PLANTED_TOKEN): 100}}, "detokenizing failed"),
    "no token left": ({"allowed_token_ids": [5], "stop_token_ids": [5], "min_tokens": 3}, "no token is left"),
}


@pytest.mark.parametrize("what", PLANTED)
def test_a_request_failing_in_its_own_stage_fails_alone(server, what):
    fields, words = PLANTED[what]
    body = {"prompt": "aaaa", "max_tokens": 8, **fields}
    with InFlight(server.url) as streams:
        r = post(server.url, body)
        assert r.status_code == 500 and words in r.json()["error"]["message"], r.text
        assert r.json()["error"]["type"] == "server_error"
        events = stream_events(server.url, body)
        assert words in (stream_error(events) or ""), events
        assert events[-1] == "[DONE]"
    assert streams.check() == STREAMS
    assert_healthy(server.url)


# In-range values at the numeric edges (None: the field left out), every field in every body...
IN_RANGE = {
    "temperature": [None, 0, -0.0, 5e-324, 1e-320, 1e-45, 0.7, 1, 2, 1e4],
    "top_p": [None, 5e-324, 1e-320, 0.5, 1],
    "top_k": [None, 0, 1, 5, 10**12, 2**63],
    "min_p": [None, 0, -0.0, 5e-324, 0.5, 1],
    "presence_penalty": [None, -2, -0.0, 5e-324, 2],
    "frequency_penalty": [None, -2, 1e-320, 2],
    "repetition_penalty": [None, 1e-320, 5e-324, 1e-6, 1, 2, 1e6],  # 1e-320: issue 35's crash
    "seed": [None, 0, 2**64, 2**70],
    "min_tokens": [None, 0, 1],
    "logprobs": [None, 0, 5, 20],
    "prompt_logprobs": [None, 0, 20],
    "timeout": [None, 5e-324, 1e-320, 30, 1e308],
    "max_tokens": [None, 1, 3, 8, 10**30],
    "n": [None, 1, 2],
    "logit_bias": [None, {"5": 100}, {"5": -100, "0": -0.0}, {"257": 5e-324}],
    "stream": [None, True, False],
}
# ... then up to two fields set to anything numeric-ish, in range or not
EDGES = [0, -0.0, 5e-324, 1e-320, 1e-45, 2.2250738585072014e-308, 0.5, 1, 2, 100, 1e4, 1e6, 3.4e38, 1e308, -1e308]
EDGES += [-1, 10**30, 2**64, -(2**63), 10**400, float("nan"), float("inf"), float("-inf")]
EDGES += ["NaN", "Infinity", "1e-320", "", None, True, [], {}, {"5": float("nan")}, {"x": 1}, {"258": 1}]
BODIES = st.builds(
    lambda prompt, fields, wrong: {"prompt": prompt, **{k: v for k, v in {**fields, **wrong}.items() if v is not None}},
    st.sampled_from(["aaaa", [97, 98, 99], "The cat"]),
    st.fixed_dictionaries({name: st.sampled_from(values) for name, values in IN_RANGE.items()}),
    st.dictionaries(st.sampled_from([*IN_RANGE, "best_of"]), st.sampled_from(EDGES), max_size=2),
)


def _answered(url: str, body: dict) -> None:
    """200 (a stream without an error event) or a 4xx naming its problem: never a 5xx."""
    if body.get("stream") is True:
        with httpx.stream("POST", url + "/v1/completions", content=json.dumps(body), timeout=120) as r:
            text = r.read().decode()
        if r.status_code == 200:
            assert '"error"' not in text and text.endswith("data: [DONE]\n\n"), (body, text[-300:])
            return
        status, error = r.status_code, json.loads(text)["error"]
    else:
        r = post(url, body, timeout=120)
        status, error = r.status_code, r.json().get("error")
        if status == 200:
            assert r.json()["choices"], (body, r.text)
            return
    assert 400 <= status < 500 and error["message"], (body, status, error)


def test_fuzzed_sampling_parameters_never_take_the_job_down(server):
    with InFlight(server.url, again=True) as streams:

        @settings(
            max_examples=40,
            derandomize=True,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        )
        @given(body=BODIES)
        def fuzz(body):
            _answered(server.url, body)

        fuzz()
        assert_healthy(server.url)
    assert streams.check() >= STREAMS
    assert_healthy(server.url)


def test_the_job_stayed_up_and_stops_cleanly(server):
    assert server.proc.poll() is None
    assert_healthy(server.url)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0, "".join(server.log[-30:])
    log = "".join(server.log)
    assert "engine failed" not in log and "eprt serve: stopped" in log
