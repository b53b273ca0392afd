"""``eprt serve`` of issue 36's tiny qwen3_vl_moe (vl_checkpoint "qwen3_vl_moe-issue36") under
``mpiexec -n 2``: a chat request with a base64 96 x 128 PNG (transparent, EXIF-rotated) answers
transformers' greedy tokens for the same picture (its own PIL image processor and model), with
its prompt token count; the same image again is a prefix-cache hit, and bad images get a 400
naming the problem while a good request streams on. The tokenizer reads token i as ``t<i>``
(the answer's text spells its ids) and names the vision tokens as Qwen3-VL does."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest
from checkpoints import VL_END, VL_IMAGE, VL_START, png_bytes, vl_checkpoint, vl_reference
from test_qwen3_vl_moe import BAD
from test_server import ServerProcess

pytestmark = pytest.mark.slow

ENGINE_FLAGS = ["--device", "cpu", "--max-batch", "4", "--block-size", "4", "--max-model-len", "256"]
SPECIAL = {VL_START: "<|vision_start|>", VL_END: "<|vision_end|>", VL_IMAGE: "<|image_pad|>"}
TEXT_BEFORE, TEXT_AFTER = [5, 17], [9, 31]
MAX_TOKENS = 8


def _vl_model_dir(checkpoint_dir: str, out_dir: str) -> str:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(checkpoint_dir):
        os.symlink(os.path.join(checkpoint_dir, name), os.path.join(out_dir, name))
    vocab = {SPECIAL.get(i, f"t{i}"): i for i in range(256)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIAL.values()])
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
        f.write("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    return out_dir


def ids_of(text: str) -> list:
    return [int(word[1:]) for word in text.split()]


def image_url(data: bytes, mime: str = "image/png") -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{base64.b64encode(data).decode()}"}}


def chat_body(data: bytes, max_tokens: int = MAX_TOKENS, **kw) -> dict:
    before, after = " ".join(f"t{i}" for i in TEXT_BEFORE), " ".join(f"t{i}" for i in TEXT_AFTER)
    content = [{"type": "text", "text": before + " "}, image_url(data), {"type": "text", "text": " " + after}]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **kw}


IMAGE = png_bytes(11, 96, 128, alpha=True, orientation=6)  # shown 128 x 96: 4 x 3 placeholders, no resize
EOS = 2


@pytest.fixture(scope="module")
def model_dir(ckpt_root, tmp_path_factory):
    ckpt = os.path.abspath(vl_checkpoint(ckpt_root, "qwen3_vl_moe-issue36"))
    return _vl_model_dir(ckpt, str(tmp_path_factory.mktemp("vltok")))


@pytest.fixture(scope="module")
def reference(model_dir):
    """transformers on the prompt the chat renders to: (expanded prompt, greedy tokens up to and
    with the first end of sequence)."""
    prompt = [*TEXT_BEFORE, VL_START, VL_IMAGE, VL_END, *TEXT_AFTER]
    expanded, tokens, _ = vl_reference(model_dir, prompt, [IMAGE], MAX_TOKENS)
    return expanded, tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerProcess(
        ["mpiexec", "-n", "2", sys.executable, "-m", "eprt.cli", "serve", "--model", model_dir, "--port", "0"]
        + ENGINE_FLAGS
    )
    try:
        srv.wait_url(180)
        yield srv
    finally:
        if srv.proc.poll() is None:
            srv.proc.send_signal(signal.SIGTERM)
            try:
                srv.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        srv.stop()


def test_base64_png_chat_equals_transformers_and_repeats_hit_the_cache(server, reference):
    prompt, tokens = reference
    with httpx.Client(base_url=server.url, timeout=120) as client:
        first = client.post("/v1/chat/completions", json=chat_body(IMAGE, temperature=0))
        assert first.status_code == 200, first.text
        again = client.post("/v1/chat/completions", json=chat_body(IMAGE, temperature=0)).json()
    first = first.json()
    stopped = first["choices"][0]["finish_reason"] == "stop"
    assert ids_of(first["choices"][0]["message"]["content"]) + ([EOS] if stopped else []) == tokens
    assert first["usage"]["prompt_tokens"] == len(prompt) == len(TEXT_BEFORE + TEXT_AFTER) + 2 + 12
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_bad_images_get_400_naming_the_problem_while_a_good_request_streams(server, reference):
    streamed: list = []

    def good():
        body = chat_body(png_bytes(12, 30, 30), max_tokens=64, stream=True)
        with (
            httpx.Client(base_url=server.url, timeout=120) as c,
            c.stream("POST", "/v1/chat/completions", json=body) as r,
        ):
            streamed.append(r.status_code)
            streamed.extend(line for line in r.iter_lines() if line.startswith("data:"))

    thread = threading.Thread(target=good)
    thread.start()
    bad = {**{k: (v, m) for k, (v, m) in BAD.items()}, "http URL": (None, "remote image URLs are not fetched")}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for name, (data, message) in bad.items():
            body = chat_body(data if data is not None else b"")
            if data is None:
                body["messages"][0]["content"][1] = {"type": "image_url", "image_url": {"url": "http://x/a.png"}}
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, (name, r.text)
            assert message in r.json()["error"]["message"], (name, r.text)
        r = client.post(
            "/v1/chat/completions",
            json={
                **chat_body(IMAGE),
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}
                ],
            },
        )
        assert r.status_code == 400 and "--allowed-local-media-path" in r.text
    thread.join(120)
    assert streamed[0] == 200 and streamed[-1] == "data: [DONE]" and len(streamed) > 10
