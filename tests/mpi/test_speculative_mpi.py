"""Speculative decoding (ngram drafts, VERIFY/ACCEPT) across world sizes:

    mpiexec -n 1|2|3 python -m pytest --with-mpi tests/mpi/test_speculative_mpi.py

Greedy tokens with speculation on equal a single-rank run with it off, under replicated and dp
attention; sampled tokens equal it too (a draft is accepted iff the token drawn at its position
with that position's uniform equals it). Drafts must be accepted somewhere, so the verify path
really ran on every rank: the cost of a draft is pinned to 0 here, so every row the drafter has
drafts for verifies them (which steps the adaptive policy speculates on depends on measured step
times otherwise).
"""

import pytest
from test_expert_parallel_mpi import COMM, PROMPTS, engine_config, run_everywhere, run_single, shared_checkpoint

from eprt.api import GenerationRequest, SamplingParams
from eprt.scheduler.speculation import StepCosts


@pytest.fixture(autouse=True)
def drafts_cost_nothing(monkeypatch):
    monkeypatch.setattr(StepCosts, "draft_cost", lambda self, rows: 0.0)
    monkeypatch.setattr(StepCosts, "verify_overhead", lambda self, rows: 0.0)


REPEATING = [
    [11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11, 12, 13],
    [40, 41, 42, 40, 41, 42, 40, 41],
    list(range(60, 80)) + list(range(60, 70)),
]


def requests(params):
    return lambda: [GenerationRequest(p, params) for p in REPEATING + PROMPTS]


def speculative(path, k=3, attention="replicated", **kw):
    return engine_config(path, speculative_method="ngram", num_speculative_tokens=k, attention=attention, **kw)


ATTENTION = pytest.mark.parametrize("attention", ["replicated", "dp"])


@pytest.mark.mpi(min_size=1)
@ATTENTION
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3"])
def test_greedy_speculation_equals_plain_decoding(arch, attention):
    path = shared_checkpoint(arch)
    reqs = requests(SamplingParams(max_tokens=20, ignore_eos=True))
    multi = run_everywhere(speculative(path, attention=attention), reqs)
    single = run_single(engine_config(path), reqs)
    if COMM.rank == 0:
        assert [r.token_ids for r in multi] == [r.token_ids for r in single]
        assert all(r.accepted_tokens is not None for r in multi) and single[0].accepted_tokens is None
        assert sum(r.accepted_tokens for r in multi) > 0


@pytest.mark.mpi(min_size=1)
@ATTENTION
@pytest.mark.parametrize("k", [1, 4])
def test_speculation_with_chunks_prefix_cache_and_a_tight_pool(k, attention):
    """Chunked prefill, prefix hits and a pool so small that sequences are preempted and drafts are
    cut to the free blocks (each owner's, under dp): still the tokens of plain decoding."""
    path = shared_checkpoint("qwen3_moe")
    system = list(range(20, 44))
    reqs = lambda: [  # noqa: E731
        GenerationRequest(system + [i, i + 1] * 3, SamplingParams(max_tokens=24, ignore_eos=True)) for i in range(6)
    ]
    multi = run_everywhere(speculative(path, k=k, attention=attention, max_prefill_tokens=6, num_blocks=40), reqs)
    single = run_single(engine_config(path, prefix_cache=False), reqs)
    if COMM.rank == 0:
        assert [r.token_ids for r in multi] == [r.token_ids for r in single]
        assert sum(r.accepted_tokens for r in multi) > 0


@pytest.mark.mpi(min_size=1)
@ATTENTION
def test_sampled_speculation_emits_the_tokens_of_plain_sampling(attention):
    path = shared_checkpoint("olmoe")
    reqs = lambda: [  # noqa: E731
        GenerationRequest(p, SamplingParams(max_tokens=16, temperature=0.7, top_k=20, seed=i, ignore_eos=True))
        for i, p in enumerate(REPEATING + PROMPTS)
    ]
    multi = run_everywhere(speculative(path, attention=attention), reqs)
    single = run_single(engine_config(path), reqs)
    if COMM.rank == 0:
        assert [r.token_ids for r in multi] == [r.token_ids for r in single]


@pytest.mark.mpi(min_size=1)
@ATTENTION
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_one_sequence_verify_equals_plain_decoding(arch, attention):
    """A verify of one sequence runs as a causal chunk at its end (the prefill's attention)."""
    path = shared_checkpoint(arch)
    reqs = lambda: [GenerationRequest(REPEATING[0], SamplingParams(max_tokens=30, ignore_eos=True))]  # noqa: E731
    multi = run_everywhere(speculative(path, k=4, attention=attention), reqs)
    single = run_single(engine_config(path), reqs)
    if COMM.rank == 0:
        assert multi[0].token_ids == single[0].token_ids and multi[0].accepted_tokens > 0
