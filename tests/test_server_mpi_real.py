"""``eprt serve`` on the real engine under ``mpiexec -n 2``, driven over loopback HTTP.

One server process serves the whole module (started once, stopped by the last test with
SIGTERM). The checkpoint is the tiny random qwen3_moe one plus a word-level tokenizer
whose token ``i`` reads ``t<i>``, so the text the server returns spells out exactly which
token ids it generated (the OpenAI API has no field for them); prompts are token ids.
Expected tokens come from ``eprt generate`` on the same weights, run once as one batch.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from test_server import ROOT, ServerProcess, complete, events

pytestmark = pytest.mark.slow

ENGINE_FLAGS = ["--device", "cpu", "--max-batch", "4", "--block-size", "4", "--max-model-len", "512"]
MAX_MODEL_LEN = 512  # long good streams: the bad requests overlap them even on a loaded machine
EOS = 2  # the tiny checkpoints' eos_token_id

# Six prompts of different lengths (more than --max-batch 4, so some wait for a slot);
# (prompt ids, max_tokens, stream).
PROMPTS = [
    ([(7 * i + 3 * k) % 250 + 3 for k in range(n)], 8 + i % 5, i % 2 == 0) for i, n in enumerate((3, 5, 9, 14, 21, 30))
]
REFERENCE_MAX_TOKENS = max(mt for _, mt, _ in PROMPTS)


def _with_id_tokenizer(checkpoint_dir: str, out_dir: str) -> str:
    """``checkpoint_dir``'s files (linked) plus a tokenizer.json decoding id i as ``t<i>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    with open(os.path.join(checkpoint_dir, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(checkpoint_dir):
        os.symlink(os.path.join(checkpoint_dir, name), os.path.join(out_dir, name))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    return out_dir


def ids_of(text: str) -> list:
    """The token ids an answer's text spells (``"t5 t17"`` -> ``[5, 17]``)."""
    return [int(word[1:]) for word in text.split()]


def scrape(client) -> dict:
    """/metrics as {sample name with labels: value}."""
    r = client.get("/metrics")
    assert r.status_code == 200, r.text
    return {
        name: float(value)
        for name, value in (line.rsplit(" ", 1) for line in r.text.splitlines() if line and not line.startswith("#"))
    }


@pytest.fixture(scope="module")
def model_dir(checkpoint, tmp_path_factory):
    return _with_id_tokenizer(os.path.abspath(checkpoint("qwen3_moe")), str(tmp_path_factory.mktemp("idtok")))


@pytest.fixture(scope="module")
def reference(model_dir):
    """``eprt generate`` (one process, all prompts as one batch): one result dict per prompt."""
    cmd = [
        sys.executable,
        "-m",
        "eprt.cli",
        "generate",
        "--model",
        model_dir,
        *ENGINE_FLAGS,
        "--max-batch",
        str(len(PROMPTS)),
        "--json",
        "--max-tokens",
        str(REFERENCE_MAX_TOKENS),
    ]
    for prompt, _, _ in PROMPTS:
        cmd += ["--prompt-ids", ",".join(map(str, prompt))]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerProcess(
        [
            "mpiexec",
            "-n",
            "2",
            sys.executable,
            "-m",
            "eprt.cli",
            "serve",
            "--model",
            model_dir,
            "--port",
            "0",
            *ENGINE_FLAGS,
        ]
    )
    try:
        srv.wait_url(120)
        yield srv
    finally:
        if srv.proc.poll() is None:  # a test failed before the SIGTERM one
            srv.proc.send_signal(signal.SIGTERM)
            try:
                srv.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        srv.stop()


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def decoded(payloads: list) -> list:
    """SSE ``data:`` payloads as ``events()`` gives them: JSON decoded, ``[DONE]`` kept as text."""
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


def summary(evs: list) -> tuple:
    """A stream's decoded events (asked with include_usage) -> (text, finish_reason, completion_tokens)."""
    assert evs[-1] == "[DONE]" and evs[-2]["choices"] == [], evs[-3:]
    chunks = [e["choices"][0] for e in evs[:-2]]
    return "".join(c["text"] for c in chunks), chunks[-1]["finish_reason"], evs[-2]["usage"]["completion_tokens"]


def check_answer(answer: tuple, ref: dict, max_tokens: int) -> None:
    """A greedy answer agrees with ``eprt generate``'s run of the same prompt (``ref``)."""
    text, finish_reason, completion_tokens = answer
    ids = ids_of(text)
    assert completion_tokens == len(ids) + (finish_reason == "stop")  # the EOS is counted, never shown
    known = ref["token_ids"][:max_tokens]  # greedy: a shorter run is a prefix of a longer one
    if len(known) == max_tokens or ref["finish_reason"] == "stop":  # the reference covers the answer
        assert ids == [t for t in known if t != EOS]
        assert (finish_reason, completion_tokens) == ("stop" if known[-1] == EOS else "length", len(known))
    else:  # the answer runs past the reference's tokens
        assert ids[: len(known)] == known


def _ask(url: str, prompt: list, max_tokens: int, stream: bool, start: threading.Barrier) -> tuple:
    """One greedy completion -> (generated text, finish_reason, completion_tokens)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    with httpx.Client(base_url=url, timeout=60) as c:
        start.wait()
        if not stream:
            answer = complete(c, **body)
            choice = answer["choices"][0]
            return choice["text"], choice["finish_reason"], answer["usage"]["completion_tokens"]
        with c.stream(
            "POST", "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
        ) as r:
            assert r.status_code == 200
            return summary(events(r))


ANCHOR = [100, 101, 102, 103]  # greedy: no EOS in its first 500 tokens


def _anchor_stream(url: str, started: threading.Event, stop: threading.Event) -> None:
    """A long stream that keeps the engine decoding until ``stop``; leaving cancels it."""
    body = {"prompt": ANCHOR, "max_tokens": 480, "stream": True}
    with httpx.Client(base_url=url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                started.set()
            if stop.is_set():
                return


def test_concurrent_requests_match_generate_and_are_batched(server, client, reference):
    """Six concurrent requests (more than the free slots) join a long stream that is already
    decoding, so every decode step of theirs is batched with it: the engine's counters then
    add up exactly, however the six arrive on a loaded machine."""
    answers, started, stop = {}, threading.Event(), threading.Event()
    anchor = threading.Thread(target=_anchor_stream, args=(server.url, started, stop))
    anchor.start()
    assert started.wait(60), "the long stream never started"
    start = threading.Barrier(len(PROMPTS))
    before = scrape(client)

    def ask(i):
        prompt, max_tokens, stream = PROMPTS[i]
        answers[i] = _ask(server.url, prompt, max_tokens, stream, start)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    after = scrape(client)
    stop.set()
    anchor.join(60)

    assert sorted(answers) == list(range(len(PROMPTS))), "some requests got no answer"
    for i, (prompt, max_tokens, _) in enumerate(PROMPTS):
        assert reference[i]["prompt_ids"] == prompt
        check_answer(answers[i], reference[i], max_tokens)
    assert after["eprt_requests_running"] >= 1, "the long stream ended before the six did"
    steps = after["eprt_decode_steps_total"] - before["eprt_decode_steps_total"]
    rows = after["eprt_decode_rows_total"] - before["eprt_decode_rows_total"]
    # each step decodes the long stream plus whichever of the six are running; a request of
    # n tokens is decoded n - 1 times (its first token comes from the prefill)
    assert rows - steps == sum(tokens - 1 for _, _, tokens in answers.values()), (rows, steps)
    deadline = time.monotonic() + 20  # the cancelled long stream frees its blocks
    while time.monotonic() < deadline:
        now = scrape(client)
        if now["eprt_requests_running"] == 0 and now["eprt_kv_blocks_free"] == now["eprt_kv_blocks_capacity"]:
            break
        time.sleep(0.05)
    assert now["eprt_requests_running"] == 0
    assert now["eprt_kv_blocks_free"] == now["eprt_kv_blocks_capacity"]


BAD_REQUESTS = [
    # (what, raw body, the error's param (None: engine-side check), words the message must contain)
    ("malformed JSON", b'{"prompt": [5, 6', "body", "not valid JSON"),
    ("max_tokens as a word", {"prompt": [5, 6], "max_tokens": "ten"}, "max_tokens", "max_tokens"),
    ("temperature as a word", {"prompt": [5, 6], "temperature": "hot"}, "temperature", "temperature"),
    ("prompt longer than the context", {"prompt": [5] * 600}, "prompt", "600 tokens"),
    ("negative max_tokens", {"prompt": [5, 6], "max_tokens": -3}, "max_tokens", "max_tokens"),
]


def test_bad_requests_are_400s_while_a_good_stream_runs(server, client, reference):
    prompt, max_tokens = PROMPTS[2][0], MAX_MODEL_LEN - len(PROMPTS[2][0]) - 4  # long enough to overlap
    good, first_token, finished_at = {}, threading.Event(), []

    def good_request():
        body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
            evs = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    evs.append(line[6:])
                    first_token.set()
            finished_at.append(time.monotonic())
            good["answer"] = summary(decoded(evs))

    t = threading.Thread(target=good_request)
    t.start()
    assert first_token.wait(60), "the good request never started streaming"
    answers = []
    for what, body, _param, _words in BAD_REQUESTS:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        answers.append(
            (what, client.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"}))
        )
    bad_done_at = time.monotonic()
    t.join(60)

    for (what, _, param, words), (_, r) in zip(BAD_REQUESTS, answers):
        assert r.status_code == 400, (what, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, (what, err)
        assert words in err["message"], (what, err)
    assert "answer" in good, "the good request failed (see the thread's exception above)"
    assert bad_done_at < finished_at[0], "the bad requests did not overlap the good one"
    check_answer(good["answer"], reference[2], max_tokens)


def test_dropped_stream_frees_its_blocks(server, client):
    before = scrape(client)
    prompt = [9, 8, 7, 6, 5, 4, 3]
    max_tokens = MAX_MODEL_LEN - len(prompt) - 1
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        next(lines), next(lines)  # two tokens, then hang up
    deadline = time.monotonic() + 20
    while True:
        now = scrape(client)
        if (
            now["eprt_requests_finished_total"] > before["eprt_requests_finished_total"]
            and now["eprt_kv_blocks_free"] == now["eprt_kv_blocks_capacity"]
        ):
            break
        assert time.monotonic() < deadline, f"blocks not freed within 20 s: {now}"
        time.sleep(0.05)
    assert now["eprt_requests_running"] == 0
    assert now["eprt_requests_finished_total"] == before["eprt_requests_finished_total"] + 1
    generated = now["eprt_generation_tokens_total"] - before["eprt_generation_tokens_total"]
    assert 2 <= generated < max_tokens, "the sequence ran to the end instead of being cancelled"


BURST = 200  # concurrent requests, half streamed
BURST_PROMPTS = [[(11 * i + 5 * k) % 240 + 3 for k in range(3 + i)] for i in range(20)]
BURST_MAX_TOKENS = 6


async def _burst_one(c: httpx.AsyncClient, prompt: list, stream: bool) -> tuple:
    body = {"prompt": prompt, "max_tokens": BURST_MAX_TOKENS, "temperature": 0}
    if not stream:
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        answer = r.json()
        return answer["choices"][0]["text"], answer["choices"][0]["finish_reason"], answer["usage"]["completion_tokens"]
    payloads = []
    async with c.stream(
        "POST", "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
    ) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                payloads.append(line[6:])
    return summary(decoded(payloads))


async def _burst(url: str) -> list:
    limits = httpx.Limits(max_connections=BURST + 10, max_keepalive_connections=BURST + 10)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as c:
        jobs = [_burst_one(c, BURST_PROMPTS[i % len(BURST_PROMPTS)], i % 2 == 1) for i in range(BURST)]
        return await asyncio.wait_for(asyncio.gather(*jobs, return_exceptions=True), 400)


def test_200_concurrent_mixed_requests_equal_the_sequential_greedy_run(server, client):
    sequential = []
    for prompt in BURST_PROMPTS:  # one at a time: nothing else in the batch
        answer = complete(client, prompt=prompt, max_tokens=BURST_MAX_TOKENS, temperature=0)
        choice = answer["choices"][0]
        sequential.append((choice["text"], choice["finish_reason"], answer["usage"]["completion_tokens"]))
    t0 = time.monotonic()
    answers = asyncio.run(_burst(server.url))
    took = time.monotonic() - t0
    failures = [(i, a) for i, a in enumerate(answers) if isinstance(a, BaseException)]
    assert not failures, failures[:3]
    for i, answer in enumerate(answers):
        assert answer == sequential[i % len(BURST_PROMPTS)], (i, answer, sequential[i % len(BURST_PROMPTS)])
    print(f"{BURST} concurrent requests answered in {took:.1f}s")


def test_prompt_logprobs_cut_the_prefix_hit_on_every_rank(client):
    """A request asking for prompt logprobs computes its whole prompt: rank 0 cuts its prefix hit to
    zero and the worker, told chunk_start 0, cuts its own, so neither reports a divergence."""
    prompt = list(range(3, 43))
    first = complete(client, prompt=prompt, max_tokens=4)
    again = complete(client, prompt=prompt, max_tokens=4)
    asked = complete(client, prompt=prompt, max_tokens=4, prompt_logprobs=1, logprobs=2)
    after = complete(client, prompt=prompt, max_tokens=4)
    cached = [b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in (first, again, asked, after)]
    assert cached[1] > 0 and cached[2] == 0 and cached[3] > 0
    assert len({tuple(b["choices"][0]["token_ids"]) for b in (first, again, asked, after)}) == 1
    shown = asked["choices"][0]["prompt_logprobs"]
    assert shown[0] is None and len(shown) == len(prompt)
    assert all(str(t) in entry for t, entry in zip(prompt[1:], shown[1:]))
    assert len(asked["choices"][0]["logprobs"]["token_logprobs"]) == 4


def test_sigterm_finishes_the_stream_in_flight_and_exits_0(server, reference):
    """Runs last: it stops the module's server."""
    prompt, max_tokens = PROMPTS[1][0], 100
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
        lines = (line[6:] for line in r.iter_lines() if line.startswith("data: "))
        first = next(lines)
        server.proc.send_signal(signal.SIGTERM)  # mpiexec forwards it to both ranks
        evs = [first, *lines]
    check_answer(summary(decoded(evs)), reference[1], max_tokens)
    assert server.proc.wait(timeout=60) == 0, "".join(server.log)
    time.sleep(0.1)  # let the drain thread read the last line
    assert "eprt serve: stopped" in "".join(server.log)
