"""``/metrics`` of the real engine (the built-in model, in this process): the expert-load series
show every routed token once the server is idle, also right after a short request."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families
from test_server import running_server

from eprt.engine.engine import EngineConfig, launch_engine


def _expert_tokens(text: str) -> dict:
    """{(layer, expert): tokens} of a /metrics page."""
    for family in text_string_to_metric_families(text):
        if family.name == "eprt_expert_tokens":
            return {(s.labels["layer"], s.labels["expert"]): s.value for s in family.samples}
    raise AssertionError("no eprt_expert_tokens family")


def test_the_expert_load_is_published_when_the_server_goes_idle():
    prompt = [5, 6, 7, 8, 9]
    with launch_engine(EngineConfig(model=None, device="cpu", max_batch=4)) as engine:
        time.sleep(1.1)  # past the engine's once-a-second read: the request's first step reads the counts
        top_k, sparse = engine.model_config.top_k, engine.model_config.sparse_layers
        with running_server(engine) as url, httpx.Client(base_url=url, timeout=60) as c:
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "ignore_eos": True})
            assert r.status_code == 200, r.text
            generated = len(r.json()["choices"][0]["token_ids"])
            # every prompt token and every fed-back generated token (not the last) passes each MoE layer
            expected = (len(prompt) + generated - 1) * top_k * sum(sparse)
            deadline, total = time.monotonic() + 3.0, None
            while time.monotonic() < deadline:  # idle: no step runs any more
                total = sum(_expert_tokens(c.get("/metrics").text).values())
                if total == expected:
                    break
                time.sleep(0.05)
            assert total == expected, f"{total} routed tokens shown, {expected} routed"
