"""--overlap at every world size: rank 0's forward pass (its MoE combines included) runs on the
helper thread while it plans, and tokens equal those without the overlap; run at mpiexec -n 1, 2 and 3."""

import pytest
from test_expert_parallel_mpi import COMM, engine_config, shared_checkpoint

from eprt.api import GenerationRequest, SamplingParams
from eprt.engine.engine import launch_engine

PROMPTS = [[5, 77, 3, 19], list(range(40, 71)), [8, 8], [140, 9, 9, 31, 200, 17]]


def requests() -> list:
    """Rows that end at different steps (so slots are released and compacted), greedy and seeded."""
    return [
        GenerationRequest(PROMPTS[0], SamplingParams(max_tokens=9, ignore_eos=True)),
        GenerationRequest(PROMPTS[1], SamplingParams(max_tokens=3, ignore_eos=True)),
        GenerationRequest(PROMPTS[2], SamplingParams(max_tokens=12, stop_token_ids=(11, 12, 13))),
        GenerationRequest(PROMPTS[3], SamplingParams(max_tokens=7, temperature=0.9, top_p=0.9, seed=5)),
        GenerationRequest(PROMPTS[0], SamplingParams(max_tokens=6, temperature=1.0, seed=9, logprobs=2)),
    ]


def run(cfg) -> tuple | None:
    """(tokens, whether rank 0 ran its passes on the helper thread) on rank 0; None on workers."""
    try:
        with launch_engine(cfg) as engine:
            threaded = engine.runner.overlap is not None and engine.runner.overlap.threaded
            return [(r.token_ids, r.finish_reason) for r in engine.generate(requests())], threaded
    except SystemExit as e:  # worker ranks leave the engine at SHUTDOWN
        assert e.code == 0, f"worker rank {COMM.rank} exited with {e.code}"
        return None


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2", "qwen3_next"])
def test_tokens_with_overlap_equal_those_without(arch):
    path = shared_checkpoint(arch)
    for budget in (0, 8):  # whole prompts, chunks of 8 tokens
        off = run(engine_config(path, overlap=False, max_prefill_tokens=budget))
        on = run(engine_config(path, overlap=True, max_prefill_tokens=budget))
        if COMM.rank == 0:
            assert on[1] and not off[1]
            assert on[0] == off[0], (arch, budget)
            assert len({len(t) for t, _ in on[0]}) > 2


@pytest.mark.mpi(min_size=2)
def test_overlap_is_off_under_dp_attention():
    cfg = engine_config(shared_checkpoint("qwen3_moe"), overlap=True, attention="dp")
    try:
        with launch_engine(cfg) as engine:
            assert engine.runner.overlap is None
            engine.generate([GenerationRequest([5, 6], SamplingParams(max_tokens=3, ignore_eos=True))])
    except SystemExit as e:
        assert e.code == 0
