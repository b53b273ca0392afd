"""The server's LoRA routes and the ``model`` field choosing an adapter, on the fake engine with
eprt's adapter registry (the real engine's adapters: tests/test_lora.py)."""

import json
import os

import httpx
from fake_engine import FakeEngine
from test_server import running_server

from eprt.engine.adapters import AdapterRegistry
from eprt.model.lora import read_options


class LoraFakeEngine(FakeEngine):
    """FakeEngine whose requests may name an adapter registered as the real engine registers them."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.adapters = AdapterRegistry(2, validate=read_options)

    def adapter_names(self):
        return self.adapters.names()

    def load_adapter(self, name, path):
        self.adapters.register(name, path)

    def unload_adapter(self, name):
        self.adapters.unregister(name)

    def submit(self, req, on_finish=None):
        if req.adapter is not None:
            adapter = self.adapters.begin(req.adapter)

            def finished(result, user=on_finish):
                self.adapters.end(adapter)
                if user is not None:
                    user(result)

            on_finish = finished
        return super().submit(req, on_finish)


def adapter_dir(tmp_path, name):
    d = tmp_path / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    return str(d)


def test_load_pick_list_and_unload_an_adapter(tmp_path):
    engine = LoraFakeEngine()
    with (
        running_server(engine, lora_dir=os.path.realpath(tmp_path)) as url,
        httpx.Client(base_url=url, timeout=20) as c,
    ):
        r = c.post("/v1/completions", json={"prompt": "ab", "model": "french", "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
        assert "'french' is not served here" in r.json()["error"]["message"]
        bad = c.post("/v1/load_lora_adapter", json={"lora_name": "french", "lora_path": str(tmp_path / "none")})
        assert bad.status_code == 400 and "No such file or directory" in bad.json()["error"]["message"], bad.text
        (tmp_path / "empty").mkdir()
        bad = c.post("/v1/load_lora_adapter", json={"lora_name": "french", "lora_path": "empty"})
        assert bad.status_code == 400 and "no adapter_config.json" in bad.json()["error"]["message"], bad.text
        ok = c.post("/v1/load_lora_adapter", json={"lora_name": "french", "lora_path": adapter_dir(tmp_path, "fr")})
        assert ok.status_code == 200 and "french" in ok.text
        again = c.post("/v1/load_lora_adapter", json={"lora_name": "french", "lora_path": adapter_dir(tmp_path, "x")})
        assert again.status_code == 400 and "taken" in again.json()["error"]["message"]
        models = c.get("/v1/models").json()["data"]
        assert [(m["id"], m.get("parent")) for m in models] == [("fake-moe", None), ("french", "fake-moe")]
        body = c.post("/v1/completions", json={"prompt": "ab", "model": "french", "max_tokens": 2}).json()
        assert body["model"] == "french" and engine.submitted[-1].adapter == "french"
        c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2})
        assert engine.submitted[-1].adapter is None
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "french"}).status_code == 200
        gone = c.post("/v1/unload_lora_adapter", json={"lora_name": "french"})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["fake-moe"]
        r = c.post("/v1/completions", json={"prompt": "ab", "model": "french", "max_tokens": 2})
        assert r.status_code == 400


def test_an_adapter_in_use_is_not_unloaded(tmp_path):
    engine = LoraFakeEngine()
    with (
        running_server(engine, lora_dir=os.path.realpath(tmp_path)) as url,
        httpx.Client(base_url=url, timeout=20) as c,
    ):
        c.post("/v1/load_lora_adapter", json={"lora_name": "fr", "lora_path": adapter_dir(tmp_path, "fr")})
        adapter = engine.adapters.begin("fr")  # a request in flight
        busy = c.post("/v1/unload_lora_adapter", json={"lora_name": "fr"})
        assert busy.status_code == 400 and "in use by 1 request" in busy.json()["error"]["message"], busy.text
        engine.adapters.end(adapter)
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "fr"}).status_code == 200
        missing = c.post("/v1/load_lora_adapter", json={"lora_name": "x"})
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
