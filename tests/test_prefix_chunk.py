"""Prefix caching and chunked prefill with the real model: outputs never change, and
``cached_tokens`` counts exactly the reused prompt tokens."""

import json
import subprocess
import sys

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eprt.api import GenerationRequest, SamplingParams
from eprt.engine.engine import EngineConfig, launch_engine

SYSTEM = list(range(30, 70))  # a 40-token shared system prompt


def config(path, **kw):
    base = dict(model=path, device="cpu", max_batch=4, block_size=16, max_model_len=160)
    base.update(kw)
    return EngineConfig(**base)


def waves(path, prompt_waves, n=6, **kw):
    """Generate each wave after the previous one finished; returns the results of all waves."""
    with launch_engine(config(path, **kw)) as engine:
        out = []
        for wave in prompt_waves:
            out += engine.generate([GenerationRequest(p, SamplingParams(max_tokens=n)) for p in wave])
        return out, engine.stats()


def test_same_prompt_after_the_first_finished_reuses_two_blocks(checkpoint):
    path = checkpoint("qwen3_moe")
    (first, second), _ = waves(path, [[SYSTEM], [SYSTEM]])
    assert (first.cached_tokens, second.cached_tokens) == (0, 32)
    assert first.token_ids == second.token_ids


def test_shared_system_prompt_outputs_identical_with_cache_and_chunking_on_or_off(checkpoint):
    path = checkpoint("qwen2_moe")
    prompts = [[SYSTEM + [i, i + 7] for i in range(1)], [SYSTEM + [i, i + 7, i] for i in range(1, 7)]]
    ref, _ = waves(path, prompts, prefix_cache=False, max_prefill_tokens=0)
    for cache in (True, False):
        for chunk in (0, 7, 16):
            got, stats = waves(path, prompts, prefix_cache=cache, max_prefill_tokens=chunk)
            assert [r.token_ids for r in got] == [r.token_ids for r in ref], (cache, chunk)
            hits = [r.cached_tokens for r in got]
            assert hits == ([0] + [32] * 6 if cache else [0] * 7), (cache, chunk)
            assert stats["prompt_tokens_computed"] == sum(len(p) for w in prompts for p in w) - sum(hits)


def test_multi_turn_chat_reuses_the_previous_turn(checkpoint):
    path = checkpoint("olmoe")
    with (
        launch_engine(config(path, block_size=8)) as cached,
        launch_engine(config(path, block_size=8, prefix_cache=False)) as plain,
    ):
        history = SYSTEM[:20]
        for turn in range(4):
            history = history + [100 + turn, 101 + turn, 102 + turn]
            a = cached.generate([GenerationRequest(history, SamplingParams(max_tokens=5))])[0]
            b = plain.generate([GenerationRequest(history, SamplingParams(max_tokens=5))])[0]
            assert a.token_ids == b.token_ids
            if turn:  # everything of the last turn's prompt+answer that fills whole blocks is reused
                assert a.cached_tokens == (len(history) - 3 - 1) // 8 * 8
            history = history + a.token_ids


def test_generate_json_reports_cached_tokens(checkpoint):
    path = checkpoint("mixtral")
    ids = ",".join(map(str, SYSTEM))
    out = subprocess.run(
        [
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
            "3",
            "--max-batch",
            "1",
            "--prompt-ids",
            ids,
            "--prompt-ids",
            ids,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.splitlines()
    rows = [json.loads(line) for line in out]
    # max_batch 1: the second prompt is admitted after the first released its blocks to the cache
    assert [r["cached_tokens"] for r in rows] == [0, 32]
    assert rows[0]["token_ids"] == rows[1]["token_ids"]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_eviction_under_memory_pressure_never_changes_outputs(checkpoint, data):
    path = checkpoint("qwen3_moe")
    n_prompts = data.draw(st.integers(3, 7))
    prompts = []
    for _ in range(n_prompts):
        base = data.draw(st.sampled_from([SYSTEM[:8], SYSTEM[:16], SYSTEM[8:24], []]))
        tail = data.draw(st.lists(st.integers(3, 250), min_size=1, max_size=12))
        prompts.append(base + tail)
    num_blocks = data.draw(st.integers(12, 24))
    chunk = data.draw(st.sampled_from([0, 5]))
    cut = data.draw(st.integers(1, n_prompts))
    ref, _ = waves(
        path, [prompts[:cut], prompts[cut:]], n=5, block_size=4, max_model_len=44, prefix_cache=False, num_blocks=400
    )
    got, stats = waves(
        path,
        [prompts[:cut], prompts[cut:]],
        n=5,
        block_size=4,
        max_model_len=44,  # the longest prompt (36) and its 5 tokens; the smallest pool holds 47
        max_batch=3,
        num_blocks=num_blocks,
        max_prefill_tokens=chunk,
    )
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert stats["free_blocks"] == num_blocks  # nothing referenced at the end; cached blocks count free
