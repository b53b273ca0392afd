"""The built-in default model: shipped files, parity with transformers, readable output, chat."""

import configparser
import os
import re
import subprocess
import sys

import pytest
from checkpoints import load_reference

from eprt.api import GenerationRequest, SamplingParams
from eprt.engine.engine import EngineConfig, launch_engine
from eprt.model.config import load_config
from eprt.model.default import DEFAULT_MODEL_DIR, DEFAULT_MODEL_NAME
from eprt.model.tokenizer import ByteTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZE_BUDGET = 4 * 1024 * 1024  # bytes: all shipped files of the default model together
TURN_BOUND = 128  # tokens: a greedy chat reply of the built-in model ends its turn within this
QUESTIONS = ("What does json.dumps do?", "Hi! Who are you?", "Explain the socket module.", "How do I sort a list?")


def readme_command() -> tuple[str, int]:
    """(prompt, max tokens) of the README's first command."""
    with open(os.path.join(ROOT, "README.md")) as f:
        m = re.search(r'mpiexec -n 2 eprt generate --prompt "([^"]+)" --max-tokens (\d+)', f.read())
    assert m, "README's first command not found"
    return m.group(1), int(m.group(2))


def generate(prompts, max_tokens):
    with launch_engine(EngineConfig(model=None, device="cpu", max_batch=4)) as engine:
        return engine.generate([GenerationRequest(p, SamplingParams(max_tokens=max_tokens)) for p in prompts])


def looks_like_english(text: str) -> bool:
    """Words and spaces: printable ASCII, mostly letters, several words of ordinary length."""
    words = re.findall(r"[A-Za-z]+", text)
    letters = sum(len(w) for w in words)
    printable = text.isascii() and all(c.isprintable() or c in "\n\t" for c in text)
    return printable and len(words) >= 3 and letters >= 0.7 * len(text.strip()) and 2 <= letters / len(words) <= 10


def test_shipped_files_are_a_qwen3_moe_within_the_size_budget():
    files = sorted(os.listdir(DEFAULT_MODEL_DIR))
    assert files == ["config.json", "model.safetensors", "training.json"]
    size = sum(os.path.getsize(os.path.join(DEFAULT_MODEL_DIR, f)) for f in files)
    assert size <= SIZE_BUDGET, f"default model is {size} bytes, budget {SIZE_BUDGET}"
    cfg = load_config(DEFAULT_MODEL_DIR)
    assert cfg.model_type == "qwen3_moe" and cfg.num_experts >= 8 and cfg.top_k == 2 and all(cfg.sparse_layers)
    assert cfg.vocab_size == ByteTokenizer.vocab_size and list(cfg.eos_token_ids) == [ByteTokenizer.EOS]


def test_shipped_files_are_declared_package_data():
    """A wheel carries exactly the files setup.cfg lists: every shipped file must be listed."""
    parser = configparser.ConfigParser()
    parser.read(os.path.join(ROOT, "setup.cfg"))
    listed = [p.strip() for p in parser["options.package_data"]["eprt.model"].split(",")]
    assert sorted(listed) == sorted(f"default_model/{f}" for f in os.listdir(DEFAULT_MODEL_DIR))


@pytest.mark.slow
def test_greedy_tokens_match_transformers():
    import torch

    prompt, n = readme_command()
    prompts = [ByteTokenizer().encode(p) for p in (prompt, "Return the", "The socket module")]
    reference = load_reference(DEFAULT_MODEL_DIR)
    for ids, res in zip(prompts, generate(prompts, n)):
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([ids]),
                do_sample=False,
                max_new_tokens=n,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            )
        assert res.token_ids == out[0, len(ids) :].tolist()


def test_readme_command_prints_english():
    prompt, n = readme_command()
    out = subprocess.run(
        [sys.executable, "-m", "eprt", "generate", "--device", "cpu", "--prompt", prompt, "--max-tokens", str(n)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=ROOT,
    ).stdout  # the continuation, without the prompt
    assert looks_like_english(out), out


def test_chat_reply_is_text():
    """The byte tokenizer's template is the one the model saw in training: it answers in words."""
    tok = ByteTokenizer()
    chat = tok.apply_chat_template([{"role": "user", "content": "What does json.dumps do?"}])
    reply = tok.decode(generate([tok.encode(chat)], 40)[0].token_ids)
    assert looks_like_english(reply) and not reply.startswith("<|"), reply


def test_chat_template_ends_an_assistant_turn_with_the_models_eos():
    """The template's end of turn is config.json's eos_token_id: generation stops where a turn ends."""
    tok, cfg = ByteTokenizer(), load_config(DEFAULT_MODEL_DIR)
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    ids = tok.apply_chat_template([*turns, {"role": "user", "content": "Bye"}], tokenize=True)
    assert ids == [*b"<|user|>\nHi\n<|assistant|>\nHello.", tok.EOS, *b"<|user|>\nBye\n<|assistant|>\n"]
    assert tok.encode(tok.apply_chat_template(turns, add_generation_prompt=False))[-1] in cfg.eos_token_ids
    assert tok.encode("plain <eos> text") == list(b"plain <eos> text")  # only a rendered chat holds special tokens


def test_greedy_chat_replies_end_their_turn_within_the_bound():
    """Trained with <eos> after every assistant reply: a chat's greedy reply stops ("stop", EOS last),
    on questions like the training exchanges' and on others, well before TURN_BOUND tokens."""
    tok = ByteTokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True) for q in QUESTIONS]
    for q, res in zip(QUESTIONS, generate(prompts, TURN_BOUND)):
        assert res.finish_reason == "stop" and res.token_ids[-1] == tok.EOS, (q, res.finish_reason, res.text)
        assert looks_like_english(res.text) and "<|" not in res.text, (q, res.text)


def test_served_chat_without_max_tokens_ends_its_turn():
    """The issue's case: a chat request without max_tokens may run to the end of the context; the
    built-in model's reply ends with finish_reason "stop" within TURN_BOUND tokens instead."""
    import httpx
    from test_server import running_server

    body = {"messages": [{"role": "user", "content": "Hello"}]}
    with launch_engine(EngineConfig(model=None, device="cpu", max_batch=1)) as engine, running_server(engine) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
    assert r["choices"][0]["finish_reason"] == "stop", r
    assert 1 <= r["usage"]["completion_tokens"] <= TURN_BOUND, r["usage"]


def test_served_name_is_the_default_model_name():
    with launch_engine(EngineConfig(model=None, device="cpu", max_batch=1)) as engine:
        assert engine.model_name == DEFAULT_MODEL_NAME
