"""Logprobs (generated and prompt) against transformers, and vLLM's logits processing
(penalties, logit_bias, min_tokens, bad words, allowed ids) against a reference of its
formulas, end to end on tiny checkpoints."""

import numpy as np
import pytest
import torch
from checkpoints import load_reference

from eprt.api import GenerationRequest, SamplingParams
from eprt.engine.engine import EngineConfig, launch_engine

PROMPT = [140, 9, 9, 31, 200, 17, 64, 12, 250, 11]
EOS = 2


def engine_config(path, **kw):
    return EngineConfig(model=path, device="cpu", max_batch=8, block_size=4, max_model_len=128, **kw)


def hf_logits(path, ids):
    """transformers' float32 logits [len(ids), V] of a full forward over ids."""
    with torch.no_grad():
        return load_reference(path)(torch.tensor([list(ids)])).logits[0].numpy().astype(np.float64)


def log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    top = x.max(axis=-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(axis=-1, keepdims=True))


def check_record(rec, lp_row, token, top_n):
    assert rec.token_id == token
    assert abs(rec.logprob - lp_row[token]) < 1e-4
    assert rec.rank == 1 + int(np.sum(lp_row > lp_row[token] + 1e-6))
    want = np.argsort(-lp_row, kind="stable")[:top_n]
    assert [t for t, _ in rec.top] == [int(t) for t in want]
    values = [v for _, v in rec.top]
    assert values == sorted(values, reverse=True)
    np.testing.assert_allclose(values, lp_row[want], atol=1e-4)


def test_greedy_and_prompt_logprobs_equal_transformers_log_softmax(checkpoint):
    path = checkpoint("qwen3_moe")
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    with launch_engine(engine_config(path)) as engine:
        res = engine.generate([GenerationRequest(PROMPT, params)])[0]
    lp = log_softmax(hf_logits(path, PROMPT + res.token_ids))
    assert len(res.logprobs) == len(res.token_ids) == 8
    for i, (rec, token) in enumerate(zip(res.logprobs, res.token_ids)):
        assert token == int(np.argmax(lp[len(PROMPT) - 1 + i]))  # greedy
        check_record(rec, lp[len(PROMPT) - 1 + i], token, 5)
    assert len(res.prompt_logprobs) == len(PROMPT) and res.prompt_logprobs[0] is None
    for i, rec in enumerate(res.prompt_logprobs[1:], start=1):
        check_record(rec, lp[i - 1], PROMPT[i], 3)


def test_prompt_logprobs_bypass_a_prefix_hit_and_survive_chunking(checkpoint):
    path = checkpoint("qwen3_moe")
    want = log_softmax(hf_logits(path, PROMPT))
    asked = SamplingParams(max_tokens=2, prompt_logprobs=0)
    with launch_engine(engine_config(path, max_prefill_tokens=3)) as engine:
        warm = engine.generate([GenerationRequest(PROMPT, SamplingParams(max_tokens=2))])[0]
        again = engine.generate([GenerationRequest(PROMPT, SamplingParams(max_tokens=2))])[0]
        res = engine.generate([GenerationRequest(PROMPT, asked)])[0]
    assert warm.cached_tokens == 0 and again.cached_tokens > 0  # the prompt is in the prefix cache
    assert res.cached_tokens == 0 and res.token_ids == again.token_ids
    got = [rec.logprob for rec in res.prompt_logprobs[1:]]
    np.testing.assert_allclose(got, [want[i - 1, PROMPT[i]] for i in range(1, len(PROMPT))], atol=1e-4)
    assert all(rec.top == () for rec in res.prompt_logprobs[1:])


def test_sampled_logprobs_are_raw_or_processed(checkpoint):
    path = checkpoint("qwen3_moe")
    params = SamplingParams(max_tokens=4, temperature=0.5, seed=7, logprobs=2, ignore_eos=True)
    results = {}
    for mode in ("raw", "processed"):
        with launch_engine(engine_config(path, logprobs_mode=mode)) as engine:
            results[mode] = engine.generate([GenerationRequest(PROMPT, params)])[0]
    assert results["raw"].token_ids == results["processed"].token_ids  # the mode changes reports only
    logits = hf_logits(path, PROMPT + results["raw"].token_ids)
    for i, token in enumerate(results["raw"].token_ids):
        row = logits[len(PROMPT) - 1 + i]
        assert abs(results["raw"].logprobs[i].logprob - log_softmax(row)[token]) < 1e-4
        assert abs(results["processed"].logprobs[i].logprob - log_softmax(row / 0.5)[token]) < 1e-4


# ---- vLLM's logits processing, re-implemented one token at a time ----------------------------


def reference_process(logits, prompt, output, p: SamplingParams, eos=(EOS,)):
    """vLLM's order: allowed ids, bad words, min_tokens, logit_bias, repetition, frequency, presence."""
    x = np.array(logits, dtype=np.float64)
    if p.allowed_token_ids:
        keep = np.full(x.shape, False)
        keep[list(p.allowed_token_ids)] = True
        x[~keep] = -np.inf
    for word in p.bad_words_ids:
        if len(word) == 1 or (
            len(output) >= len(word) - 1 and list(output[len(output) - len(word) + 1 :]) == list(word[:-1])
        ):
            x[word[-1]] = -np.inf
    if len(output) < p.min_tokens:
        for t in list(eos) + list(p.stop_token_ids):
            x[t] = -np.inf
    for t, b in p.logit_bias:
        x[t] += b
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x


def reference_generate(path, prompt, p: SamplingParams):
    """Greedy decoding of the processed transformers logits (full forward per step)."""
    model, ids = load_reference(path), list(prompt)
    with torch.no_grad():
        for _ in range(p.max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].numpy()
            token = int(np.argmax(reference_process(logits, prompt, ids[len(prompt) :], p)))
            ids.append(token)
            if token == EOS and not p.ignore_eos:
                break
    return ids[len(prompt) :]


CASES = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=1.2),
    "repetition": dict(repetition_penalty=1.8),
    "negative presence": dict(presence_penalty=-2.0, frequency_penalty=0.3),
    "bias": dict(logit_bias=((7, 3.0), (31, -5.0), (100, 4.5))),
    "bad words": dict(bad_words_ids=((9,), (221, 221), (64, 12))),
    "allowed": dict(allowed_token_ids=(2, 5, 9, 17, 31, 64, 140, 200)),
    "min_tokens": dict(min_tokens=6, allowed_token_ids=(2, 5, 9)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_processing_follows_the_vllm_reference(checkpoint, case):
    path = checkpoint("qwen3_moe")
    params = SamplingParams(max_tokens=12, **CASES[case])
    plain = SamplingParams(max_tokens=12)
    with launch_engine(engine_config(path)) as engine:
        got, free = engine.generate([GenerationRequest(PROMPT, params), GenerationRequest(PROMPT, plain)])
    assert got.token_ids == reference_generate(path, PROMPT, params)
    assert got.token_ids != free.token_ids  # the option changes this output


def test_logit_bias_100_forces_the_token(checkpoint):
    path = checkpoint("qwen3_moe")
    forced = SamplingParams(max_tokens=6, temperature=1.0, seed=3, logit_bias=((123, 100.0),), logprobs=1)
    with launch_engine(engine_config(path)) as engine:
        res = engine.generate([GenerationRequest(PROMPT, forced)])[0]
    assert res.token_ids == [123] * 6
    assert all(rec.token_id == 123 for rec in res.logprobs)


def test_min_p_keeps_only_likely_tokens(checkpoint):
    path = checkpoint("qwen3_moe")
    with launch_engine(engine_config(path)) as engine:
        reqs = [
            GenerationRequest(PROMPT, SamplingParams(max_tokens=1, temperature=3.0, seed=s, min_p=0.5))
            for s in range(40)
        ]
        firsts = {r.token_ids[0] for r in engine.generate(reqs)}
    probs = np.exp(log_softmax(hf_logits(path, PROMPT)[-1] / 3.0))
    assert firsts <= set(np.flatnonzero(probs >= 0.5 * probs.max()).tolist())


# ---- the command-line entry points ----------------------------------------------------------


def cli(*args):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "eprt.cli", *args, "--device", "cpu", "--max-model-len", "128"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)


def test_generate_json_and_run_report_logprobs(checkpoint, tmp_path):
    import json

    path = checkpoint("qwen3_moe")
    ids = ",".join(map(str, PROMPT))
    out = cli("generate", "--model", path, "--json", "--prompt-ids", ids, "--max-tokens", "4", "--logprobs", "2")
    row = json.loads(out.stdout.splitlines()[0])
    lp = log_softmax(hf_logits(path, PROMPT + row["token_ids"]))
    assert [r["token_id"] for r in row["logprobs"]] == row["token_ids"]
    for i, r in enumerate(row["logprobs"]):
        assert abs(r["logprob"] - lp[len(PROMPT) - 1 + i, r["token_id"]]) < 1e-4 and r["rank"] == 1
        assert [t for t, _ in r["top"]] == [int(t) for t in np.argsort(-lp[len(PROMPT) - 1 + i])[:2]]
    lines = tmp_path / "in.jsonl"
    lines.write_text(json.dumps({"id": "a", "prompt_ids": PROMPT, "max_tokens": 2, "prompt_logprobs": 1}) + "\n")
    cli("run", "--model", path, "--input", str(lines), "--output", str(tmp_path / "out.jsonl"))
    rec = json.loads((tmp_path / "out.jsonl").read_text().splitlines()[0])
    assert rec["prompt_logprobs"][0] is None and len(rec["prompt_logprobs"]) == len(PROMPT)
    assert abs(rec["prompt_logprobs"][3]["logprob"] - lp[2, PROMPT[3]]) < 1e-4
