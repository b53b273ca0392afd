"""End-to-end generation against transformers: greedy tokens, batching, the CLI."""

import json
import subprocess
import sys

import pytest
import torch
from checkpoints import load_reference

from eprt.api import GenerationRequest, SamplingParams
from eprt.engine.engine import EngineConfig, launch_engine

PROMPTS = [
    [5, 77, 3],
    [140, 9, 9, 31, 200, 17, 64, 12, 250, 11],
    [8],
    [90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111],
]


def hf_greedy(path, prompt, n):
    """transformers' greedy tokens (stops at EOS like eprt; the EOS is included)."""
    with torch.no_grad():
        out = load_reference(path).generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=n,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return out[0, len(prompt) :].tolist()


def engine_config(path, **kw):
    return EngineConfig(model=path, device="cpu", max_batch=8, block_size=4, max_model_len=128, **kw)


def run(path, prompts, n=32, **kw):
    with launch_engine(engine_config(path, **kw)) as engine:
        return engine.generate([GenerationRequest(p, SamplingParams(max_tokens=n)) for p in prompts])


@pytest.mark.slow
def test_greedy_32_tokens_match_transformers(checkpoint, arch):
    path = checkpoint(arch)
    for prompt in PROMPTS[:2]:
        res = run(path, [prompt])[0]
        want = hf_greedy(path, prompt, 32)
        assert res.token_ids == want
        assert res.finish_reason == ("stop" if want[-1] == 2 else "length")


def test_batch_of_different_lengths_equals_each_alone(checkpoint, arch):
    path = checkpoint(arch)
    together = run(path, PROMPTS, n=20)
    for prompt, res in zip(PROMPTS, together):
        alone = run(path, [prompt], n=20)[0]
        assert res.token_ids == alone.token_ids
        assert res.prompt_ids == prompt


def test_bf16_checkpoint_greedy_matches(checkpoint):
    path = checkpoint("mixtral", dtype="bfloat16")
    assert run(path, [PROMPTS[1]])[0].token_ids == hf_greedy(path, PROMPTS[1], 32)


def test_sampling_is_reproducible_per_request_seed(checkpoint):
    path = checkpoint("qwen3_moe")
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    with launch_engine(engine_config(path)) as engine:
        a = engine.generate([GenerationRequest(PROMPTS[1], params)])[0]
        b = engine.generate([GenerationRequest(PROMPTS[0], params), GenerationRequest(PROMPTS[1], params)])[1]
        c = engine.generate([GenerationRequest(PROMPTS[1], SamplingParams(max_tokens=16, temperature=0.9, seed=99))])[0]
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_stop_token_ids_end_the_sequence(checkpoint):
    path = checkpoint("olmoe")
    free = run(path, [PROMPTS[1]], n=12)[0].token_ids
    stop = free[5]
    with launch_engine(engine_config(path)) as engine:
        res = engine.generate([GenerationRequest(PROMPTS[1], SamplingParams(max_tokens=12, stop_token_ids=(stop,)))])[0]
    assert res.token_ids == free[: free.index(stop) + 1]
    assert res.finish_reason == "stop"


def test_bad_request_is_an_error_result_and_others_complete(checkpoint):
    path = checkpoint("qwen2_moe")
    with launch_engine(engine_config(path)) as engine:
        good, bad_token, bad_len = engine.generate(
            [
                GenerationRequest(PROMPTS[0], SamplingParams(max_tokens=4)),
                GenerationRequest([1, 999999], SamplingParams(max_tokens=4)),
                GenerationRequest([1] * 200, SamplingParams(max_tokens=4)),
            ]
        )
    assert good.finish_reason == "length" and len(good.token_ids) == 4
    assert bad_token.finish_reason == "error" and "999999" in bad_token.error
    assert bad_len.finish_reason == "error" and "max_model_len" in bad_len.error


def test_cli_json_matches_transformers_generate(checkpoint):
    path = checkpoint("qwen3_moe")
    cmd = [
        sys.executable,
        "-m",
        "eprt.cli",
        "generate",
        "--model",
        path,
        "--device",
        "cpu",
        "--json",
        "--max-tokens",
        "12",
        "--prompt-ids",
        ",".join(map(str, PROMPTS[1])),
        "--prompt-ids",
        ",".join(map(str, PROMPTS[0])),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout.splitlines()
    rows = [json.loads(line) for line in out]
    assert [r["prompt_ids"] for r in rows] == [PROMPTS[1], PROMPTS[0]]
    for r in rows:
        assert r["token_ids"] == hf_greedy(path, r["prompt_ids"], 12)
        assert r["finish_reason"] in ("stop", "length") and r["cached_tokens"] == 0


def test_cli_default_model_runs():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "eprt.cli",
            "generate",
            "--device",
            "cpu",
            "--prompt",
            "Hi",
            "--max-tokens",
            "5",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    row = json.loads(out.stdout)
    assert row["prompt_ids"] == [72, 105] and len(row["token_ids"]) == 5 and row["text"]


def test_cli_rejects_text_prompt_without_tokenizer(checkpoint):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "eprt.cli",
            "generate",
            "--model",
            checkpoint("mixtral"),
            "--device",
            "cpu",
            "--prompt",
            "hello",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and "tokenizer" in p.stderr


@pytest.mark.parametrize("bad", ["does-not-exist"])
def test_cli_missing_model_dir_is_clear(bad, tmp_path):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "eprt.cli",
            "generate",
            "--model",
            str(tmp_path / bad),
            "--device",
            "cpu",
            "--prompt-ids",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode != 0 and "config.json" in p.stderr


def test_16_prompts_through_the_scheduler_equal_each_alone(checkpoint):
    """More prompts than slots: continuous batching admits new ones as others finish."""
    path = checkpoint("qwen3_moe")
    prompts = [[(7 * i + j) % 250 + 3 for j in range(1 + (5 * i) % 23)] for i in range(16)]
    lengths = [4 + (3 * i) % 11 for i in range(16)]  # different budgets: slots free up at different ticks
    with launch_engine(EngineConfig(model=path, device="cpu", max_batch=5, block_size=4, max_model_len=64)) as engine:
        together = engine.generate(
            [GenerationRequest(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, lengths)]
        )
        alone = [
            engine.generate([GenerationRequest(p, SamplingParams(max_tokens=n, ignore_eos=True))])[0]
            for p, n in zip(prompts, lengths)
        ]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [len(r.token_ids) for r in together] == lengths


def test_seeded_sampling_survives_preemption(checkpoint):
    """A pool too small for every sequence forces preemptions; seeded samples do not change."""
    path = checkpoint("mixtral")
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    prompts = [[3 + i, 40, 41, 42, 43, 44] for i in range(4)]
    outs = []
    for blocks in (400, 14):
        cfg = EngineConfig(model=path, device="cpu", max_batch=4, block_size=4, max_model_len=48, num_blocks=blocks)
        with launch_engine(cfg) as engine:
            outs.append([r.token_ids for r in engine.generate([GenerationRequest(p, params) for p in prompts])])
            if blocks == 14:
                assert engine.stats()["preemptions"] > 0
    assert outs[0] == outs[1]


def test_engine_failure_fails_every_request_instead_of_hanging(checkpoint, monkeypatch):
    from eprt.engine.executor import ShardExecutor

    real, calls = ShardExecutor.decode, {"n": 0}

    def failing(self, slots, tokens):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected model failure")
        return real(self, slots, tokens)

    monkeypatch.setattr(ShardExecutor, "decode", failing)
    with pytest.raises(RuntimeError, match="injected"):
        with launch_engine(engine_config(checkpoint("olmoe"))) as engine:
            early = engine.submit(GenerationRequest(PROMPTS[0], SamplingParams(max_tokens=10)))
            engine.generate([GenerationRequest(PROMPTS[1], SamplingParams(max_tokens=10))])
    res = early.result(timeout=0)
    assert res.finish_reason == "error" and "injected model failure" in res.error
    assert len(res.token_ids) == 3  # prefill token + 2 decode steps before the failure: kept


def test_image_embeds_argument_splits_only_a_leading_index():
    from eprt.entry.generate import _embeds

    assert _embeds("1:/data/run:3/x.npy") == (1, "/data/run:3/x.npy")
    assert _embeds("/data/run:3/x.npy") == (0, "/data/run:3/x.npy")
    assert _embeds("x.npy") == (0, "x.npy")
    assert _embeds("²:x.npy") == (0, "²:x.npy")  # not an ASCII index: part of the name


def test_image_embeds_file_must_be_a_2d_float_npy(tmp_path):
    import argparse

    import numpy as np

    from eprt.api import RequestError
    from eprt.entry.generate import _requests, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def embeds_for(path):
        args = parser.parse_args(["--prompt-ids", "1,2", "--prompt-ids", "3", "--image-embeds", f"1:{path}"])
        return _requests(args, None)[1].image_embeds

    good = tmp_path / "rows.npy"
    np.save(good, np.arange(6, dtype=np.float64).reshape(2, 3))
    rows = embeds_for(good)
    assert rows.dtype == np.float32 and rows.tolist() == [[0, 1, 2], [3, 4, 5]]
    np.savez(tmp_path / "rows.npz", a=np.zeros((2, 3), np.float32))
    np.save(tmp_path / "flat.npy", np.zeros(3, np.float32))
    np.save(tmp_path / "ints.npy", np.zeros((2, 3), np.int64))
    np.save(tmp_path / "objects.npy", np.array([[{"a": 1}]], dtype=object), allow_pickle=True)
    (tmp_path / "junk.npy").write_bytes(b"not an array")
    for name, words in [
        ("rows.npz", "is an .npz archive"),
        ("flat.npy", "want a 2-D float array"),
        ("ints.npy", "want a 2-D float array"),
        ("objects.npy", "cannot read it"),
        ("junk.npy", "cannot read it"),
        ("missing.npy", "cannot read it"),
    ]:
        with pytest.raises(RequestError, match=f"{name}: {words}"):
            embeds_for(tmp_path / name)


def test_text_is_decoded_once_for_callback_and_handle():
    # the default model has a tokenizer; on_finish and handle.result() see one result object
    cfg = EngineConfig(model=None, device="cpu", max_batch=2)
    with launch_engine(cfg) as engine:
        calls, seen = [], []
        decode = engine.tokenizer.decode
        engine.tokenizer.decode = lambda ids: calls.append(list(ids)) or decode(ids)
        handle = engine.submit(GenerationRequest([72, 105], SamplingParams(max_tokens=5)), on_finish=seen.append)
        while not handle.done():
            engine.step()  # what generate() and serve_forever() do
        result = handle.result()
        assert result is seen[0] and result.text and len(calls) == 1
        assert handle.result() is result
