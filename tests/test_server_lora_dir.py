"""Runtime LoRA loading only from ``--lora-modules-dir``, paths outside it refused before anything
is opened, corrupt adapters and unexpected exceptions answered with OpenAI JSON error bodies."""

from __future__ import annotations

import builtins
import json
import os
import threading

import httpx
import numpy as np
import pytest
from test_server import running_server
from test_server_lora import LoraFakeEngine

from eprt.engine.adapters import AdapterRegistry
from eprt.model.config import load_config
from eprt.model.default import DEFAULT_MODEL_DIR
from eprt.model.lora import load_lora
from eprt.serve import openai
from eprt.serve.adapters import allowed_adapter_dir, check_adapters_dir
from eprt.serve.body import ApiError

CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}


def write_adapter(d, config=CONFIG, weights: bytes | None = None) -> str:
    """A PEFT adapter directory: its config, and a q_proj LoRA of the built-in model (or ``weights``)."""
    d.mkdir(parents=True)
    (d / "adapter_config.json").write_text(json.dumps(config) if isinstance(config, dict) else config)
    if weights is None:
        from safetensors.numpy import save_file

        cfg = load_config(DEFAULT_MODEL_DIR)
        q_out = cfg.num_heads * cfg.head_dim
        prefix = "base_model.model.model.layers.0.self_attn.q_proj"
        save_file(
            {
                f"{prefix}.lora_A.weight": np.full((2, cfg.hidden_size), 0.01, np.float32),
                f"{prefix}.lora_B.weight": np.full((q_out, 2), 0.01, np.float32),
            },
            str(d / "adapter_model.safetensors"),
        )
    else:
        (d / "adapter_model.safetensors").write_bytes(weights)
    return str(d)


class ReadingEngine(LoraFakeEngine):
    """LoraFakeEngine reading the whole adapter as rank 0's engine does (for the built-in model)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        cfg = load_config(DEFAULT_MODEL_DIR)
        self.adapters = AdapterRegistry(2, validate=lambda p: load_lora(p, cfg, 0, cfg.num_experts, 16))


@pytest.fixture
def opened(monkeypatch):
    """Every path the server process opens (builtins.open and os.open, any thread) while the test runs."""
    paths, lock = [], threading.Lock()
    real_open, real_os_open = builtins.open, os.open

    def spy(real):
        def wrapped(file, *args, **kw):
            if isinstance(file, (str, bytes, os.PathLike)):
                with lock:
                    paths.append(os.path.realpath(os.fsdecode(file)))
            return real(file, *args, **kw)

        return wrapped

    monkeypatch.setattr(builtins, "open", spy(real_open))
    monkeypatch.setattr(os, "open", spy(real_os_open))
    return paths


def _load(c, path, name="fr"):
    return c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


def _error(r, status=400) -> str:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err["message"]


def test_paths_outside_the_directory_are_refused_without_being_opened(tmp_path, opened):
    root, outside = tmp_path / "adapters", tmp_path / "outside"
    write_adapter(outside / "secret")
    write_adapter(root / "ok")
    (root / "escape").symlink_to(outside / "secret")  # a directory symlink leading out
    write_adapter(root / "file-escape", weights=b"")
    os.remove(root / "file-escape" / "adapter_config.json")
    os.symlink(outside / "secret" / "adapter_config.json", root / "file-escape" / "adapter_config.json")
    write_adapter(root / "fifo", weights=b"")
    os.remove(root / "fifo" / "adapter_model.safetensors")
    os.mkfifo(root / "fifo" / "adapter_model.safetensors")  # opening it would block the loader for ever
    write_adapter(root / "indexed")
    (root / "indexed" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../../x"}}))
    engine = ReadingEngine()
    with running_server(engine, lora_dir=check_adapters_dir(str(root))) as url, httpx.Client(base_url=url) as c:
        for path, why in [
            (str(outside / "secret"), "outside --lora-modules-dir"),
            ("../outside/secret", "outside --lora-modules-dir"),
            (f"{root}/../outside/secret", "outside --lora-modules-dir"),
            ("escape", "outside --lora-modules-dir"),
            ("file-escape", "adapter_config.json is not a regular file under --lora-modules-dir"),
            ("fifo", "adapter_model.safetensors is not a regular file"),
            ("indexed", "a PEFT adapter has none"),
            ("ok\0/x", "NUL character"),
            ("missing", "No such file or directory"),
        ]:
            assert why in _error(_load(c, path)), path
        assert engine.adapter_names() == []
        assert not [p for p in opened if p.startswith(str(outside)) or "fifo" in p], opened
        assert _load(c, "ok").status_code == 200  # relative to the directory
        assert any(p.endswith("ok/adapter_model.safetensors") for p in opened)  # the spy sees the reads
        assert _load(c, str(root / "ok"), "fr2").status_code == 200  # or absolute inside it
        assert engine.adapter_names() == ["fr", "fr2"]


def test_without_the_flag_nothing_is_loaded_at_run_time(tmp_path, opened):
    path = write_adapter(tmp_path / "ok")
    with running_server(ReadingEngine()) as url, httpx.Client(base_url=url) as c:
        assert "--lora-modules-dir" in _error(_load(c, path))
    assert not [p for p in opened if p.startswith(path)]


def test_the_directory_must_exist():
    with pytest.raises(ValueError, match="is not a directory"):
        check_adapters_dir("/nonexistent/adapters")
    with pytest.raises(ApiError, match="outside"):
        allowed_adapter_dir("/etc", "/srv/adapters")


@pytest.mark.parametrize(
    "config, weights, why",
    [
        (CONFIG, b"\xff" * 64, "is truncated or corrupt"),
        (CONFIG, b"\x08\x00\x00\x00\x00\x00\x00\x00{notjson", "corrupt safetensors header"),
        ('{"r": 2, "lora_alpha": "x"}', None, "ValueError: could not convert string to float"),
        ('{"r": 2, "rank_pattern": 5}', None, "TypeError"),
        (b"\xff\xfe".decode("latin-1"), None, "not valid JSON"),
    ],
)
def test_a_corrupt_adapter_gets_a_json_400(tmp_path, config, weights, why):
    root = tmp_path / "adapters"
    write_adapter(root / "bad", config, weights)
    with (
        running_server(ReadingEngine(), lora_dir=check_adapters_dir(str(root))) as url,
        httpx.Client(base_url=url) as c,
    ):
        assert why in _error(_load(c, "bad"))
        assert c.get("/v1/models").status_code == 200  # the server goes on


def test_an_unexpected_exception_is_a_json_500_and_the_server_goes_on(monkeypatch):
    def broken(*args, **kw):
        raise RuntimeError("a bug")

    monkeypatch.setattr(openai, "models_body", broken)
    with running_server(LoraFakeEngine()) as url, httpx.Client(base_url=url) as c:
        for path in ("/v1/models", "/v1/models/fake-moe"):
            assert "internal server error" in _error(c.get(path), 500)
        assert c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}).status_code == 200
        metrics = c.get("/metrics").text
        assert 'eprt_http_requests_total{route="/v1/models",status="500"} 1.0' in metrics, metrics
