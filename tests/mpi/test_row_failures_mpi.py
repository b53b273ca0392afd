"""Failure isolation at every world size (docs/design.md, "Failure isolation"; docs/protocol.md,
"Errors and shutdown"): requests failing in their own stage (tests/planted_faults.py) in the same
batches as good ones, in decode and verify steps. Only rank 0 samples, so a failed row adds
nothing to the stream: its RELEASE frees and caches the same blocks on every rank, which a later
request sharing its prompt proves (a worker checks every prefix-cache hit against rank 0's), the
good requests equal a single rank's, and every worker leaves with SHUTDOWN (exit 0). Run by
tests/run_all.sh at mpiexec -n 1, 2 and 3."""

import pytest
from planted_faults import PLANTED_SEED, plant
from test_expert_parallel_mpi import COMM, LocalTransport

from eprt.api import GenerationRequest, SamplingParams
from eprt.engine.engine import EngineConfig, launch_engine
from eprt.model.tokenizer import ByteTokenizer

PROMPT = ByteTokenizer().encode("the cat and the dog and the cat and the dog and the cat and the dog and the")
GOOD = [
    SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=12, ignore_eos=True),
    SamplingParams(max_tokens=12, ignore_eos=True, n=2, temperature=0.9, seed=8),
]
BAD = {  # what fails, and the words of its error
    None: [
        (SamplingParams(max_tokens=12, temperature=0.7, seed=PLANTED_SEED, presence_penalty=0.5), "logits processing"),
        (SamplingParams(max_tokens=12, allowed_token_ids=(5,), stop_token_ids=(5,), min_tokens=2), "no token is left"),
    ],
    "ngram": [  # every row verifiable (no processing), and the prompt repeats: the steps are verify steps
        (SamplingParams(max_tokens=12, temperature=0.7, seed=PLANTED_SEED, ignore_eos=True), "verify step"),
    ],
}


def _requests(speculative) -> list:
    params = GOOD + [p for p, _ in BAD[speculative]]
    return [GenerationRequest(PROMPT[: 40 + i], p) for i, p in enumerate(params)]


def _run(cfg, transport=None) -> list | None:
    """Two rounds of the same requests (the second hits the prefix cache the first left); the
    results on rank 0, None on workers."""
    try:
        with launch_engine(cfg, transport=transport) as engine:
            return [engine.generate_choices(_requests(cfg.speculative_method)) for _ in range(2)]
    except SystemExit as e:  # worker ranks leave the engine at SHUTDOWN
        assert e.code == 0, f"worker rank {COMM.rank} exited with {e.code}"
        return None


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_failed_rows_release_alike_on_every_rank_and_the_others_equal_one_rank(monkeypatch, speculative):
    plant(monkeypatch)
    cfg = EngineConfig(model=None, device="cpu", max_batch=8, block_size=4, speculative_method=speculative)
    multi = _run(cfg)
    single = _run(cfg, LocalTransport()) if COMM.rank == 0 else None
    if COMM.rank != 0:
        return
    for m, s in zip(multi, single):
        assert [[r.token_ids for r in c] for c in m[:3]] == [[r.token_ids for r in c] for c in s[:3]]
        assert all(r.finish_reason == "length" for c in m[:3] for r in c)
        for c, (_, words) in zip(m[3:], BAD[speculative]):
            assert c[0].finish_reason == "error" and words in c[0].error, c[0]
    assert all(c[0].cached_tokens > 0 for c in multi[1]), [c[0].cached_tokens for c in multi[1]]
