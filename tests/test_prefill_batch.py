"""Batched prefill: the prompts and prompt chunks of one tick run as one forward pass, with the
greedy tokens of one pass per sequence and of transformers."""

import numpy as np
import pytest
from checkpoints import reference_greedy

from eprt.api import GenerationRequest, SamplingParams
from eprt.engine.engine import EngineConfig, launch_engine

SYSTEM = list(range(30, 62))  # two 16-token blocks: a prefix-cache hit for the second wave
SECOND_WAVE = [
    SYSTEM + [7, 8],  # a prefix hit: 32 of 34 tokens cached
    [5, 77, 3],
    list(range(90, 150)),  # 60 tokens: chunked by the 48-token budget
    [140, 9, 9, 31, 200, 17, 64, 12, 11],
]


def run(path, batch_prefill: bool, budget: int):
    cfg = EngineConfig(
        model=path, device="cpu", max_batch=6, block_size=16, max_model_len=128,
        max_prefill_tokens=budget, batch_prefill=batch_prefill,
    )  # fmt: skip
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with launch_engine(cfg) as engine:
        first = engine.generate([GenerationRequest(SYSTEM + [1], params)])
        second = engine.generate([GenerationRequest(p, params) for p in SECOND_WAVE])
        return [r.token_ids for r in first + second], [r.cached_tokens for r in second], engine.runner.prefill_passes


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v2", "glm4_moe"])
def test_batched_prefill_gives_the_tokens_of_one_pass_per_sequence_in_fewer_passes(checkpoint, arch):
    path = checkpoint(arch)
    for budget in (0, 48):
        alone, alone_hits, alone_passes = run(path, batch_prefill=False, budget=budget)
        batched, hits, passes = run(path, batch_prefill=True, budget=budget)
        assert batched == alone, (arch, budget)
        assert hits == alone_hits and hits[0] == 32
        if budget == 0:  # one pass for the first wave, one for the whole second wave
            assert (alone_passes, passes) == (5, 2)
        else:  # ticks of 2 + 3 + 43 and 17 + 9 tokens, after the first wave's 33: 3 passes instead of 6
            assert (alone_passes, passes) == (6, 3)


@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3"])
def test_batched_prefill_matches_transformers(checkpoint, arch):
    path = checkpoint(arch)
    prompts = [[5, 77, 3, 19], list(range(40, 71)), [8, 8]]
    cfg = EngineConfig(model=path, device="cpu", max_batch=4, max_model_len=64, max_prefill_tokens=0)
    with launch_engine(cfg) as engine:
        got = engine.generate([GenerationRequest(p, SamplingParams(max_tokens=5, ignore_eos=True)) for p in prompts])
        assert engine.runner.prefill_passes == 1
    for prompt, result in zip(prompts, got):
        want, _ = reference_greedy(path, prompt, 5)
        assert result.token_ids == want, (arch, prompt)


def test_batched_prefill_logits_equal_per_sequence_passes(checkpoint):
    """The executor's group call against one call per chunk, on two fresh executors."""
    from eprt.comm.protocol import Prefill
    from eprt.engine.executor import ShardExecutor
    from eprt.model.loader import load_model
    from eprt.ops.numpy_ops import NumpyOps

    path = checkpoint("olmoe")
    prompts = [[5, 77, 3, 19, 4], list(range(40, 61)), [8]]

    def executor():
        return ShardExecutor(load_model(path, NumpyOps(), 64).model, num_blocks=32, block_size=4, max_slots=4)

    one = executor()
    alone = np.concatenate([one.prefill(s, p, 0, len(p)) for s, p in enumerate(prompts)])  # [3, V]
    group = executor().prefill_group([Prefill(s, 0, len(p), tuple(p)) for s, p in enumerate(prompts)])
    np.testing.assert_allclose(group, alone, rtol=1e-5, atol=1e-5)
    assert (group.argmax(-1) == alone.argmax(-1)).all()
