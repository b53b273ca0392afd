"""gpt-oss under expert parallelism, written once and run at every world size:

    mpiexec -n 1|2|3 python -m pytest --with-mpi tests/mpi/test_gptoss_mpi.py

The tiny gpt_oss checkpoints (bf16, and MXFP4 experts whose reference transformers computes on the
dequantized weights) have 7 experts, so 2 and 3 ranks split them unevenly. Prompts are longer than
the sliding window (8), prefill chunks (6) cross it, the prefix cache is on (a shared system prompt),
and the sliding layers' KV is windowed: greedy tokens equal transformers', under replicated and dp
attention, with and without ngram speculation (the verify path forced, as in test_speculative_mpi).
"""

import os
import tempfile

import pytest
from checkpoints import build_gptoss_checkpoint, reference_greedy
from test_expert_parallel_mpi import COMM

from eprt.api import GenerationRequest, SamplingParams
from eprt.engine.engine import EngineConfig, launch_engine
from eprt.scheduler.speculation import StepCosts

SYSTEM = [(13 * i + 7) % 240 + 10 for i in range(20)]
PROMPTS = [
    SYSTEM + [1, 2, 3],
    SYSTEM + [4, 5],
    [11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11, 12, 13],  # repeats: ngram drafts
    list(range(60, 90)),
    [8, 9],
]
STEPS = 14
VARIANTS = {"bf16": dict(dtype="bfloat16"), "mxfp4": dict(dtype="bfloat16", mxfp4=True)}


def gptoss_checkpoint(variant):
    """Rank 0 builds the checkpoint (7 experts) and transformers' greedy tokens once; every rank gets both."""
    out = None
    if COMM.rank == 0:
        root = os.environ.get("EPRT_TEST_CKPT_DIR") or os.path.join(tempfile.gettempdir(), "eprt-mpi-ckpt")
        path = os.path.join(root, f"gpt_oss-7experts-{variant}")
        build_gptoss_checkpoint(path, num_local_experts=7, **VARIANTS[variant])
        out = path, [reference_greedy(path, p, STEPS)[0] for p in PROMPTS]
    return COMM.bcast(out, root=0)


def engine_config(path, **kw):
    return EngineConfig(**{**dict(model=path, device="cpu", max_batch=4, block_size=4, max_model_len=96), **kw})


def run_waves(cfg):
    """The first prompt alone, then the others together (the second hits the system prompt the first
    left in the prefix cache). Rank 0 returns the results in prompt order, workers None."""
    reqs = [GenerationRequest(p, SamplingParams(max_tokens=STEPS, ignore_eos=True)) for p in PROMPTS]
    try:
        with launch_engine(cfg) as engine:
            return engine.generate(reqs[:1]) + engine.generate(reqs[1:])
    except SystemExit as e:  # worker ranks leave the engine at SHUTDOWN
        assert e.code == 0, f"worker rank {COMM.rank} exited with {e.code}"
        return None


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("attention", ["replicated", "dp"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_equal_transformers(variant, attention):
    path, want = gptoss_checkpoint(variant)
    out = run_waves(engine_config(path, attention=attention, check_state=True, max_prefill_tokens=6))
    if COMM.rank == 0:
        assert [r.token_ids for r in out] == want
        assert out[1].cached_tokens == 20  # the system prompt's blocks and the window's before position 20


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("attention", ["replicated", "dp"])
def test_ngram_speculation_gives_transformers_tokens(attention, monkeypatch):
    monkeypatch.setattr(StepCosts, "draft_cost", lambda self, rows: 0.0)
    monkeypatch.setattr(StepCosts, "verify_overhead", lambda self, rows: 0.0)
    path, want = gptoss_checkpoint("mxfp4")
    cfg = engine_config(
        path, attention=attention, speculative_method="ngram", num_speculative_tokens=4, check_state=True
    )
    out = run_waves(cfg)
    if COMM.rank == 0:
        assert [r.token_ids for r in out] == want
        assert sum(r.accepted_tokens for r in out) > 0


@pytest.mark.mpi(min_size=1)
def test_whole_prompts_equal_transformers():
    """--max-prefill-tokens 0: with windowed KV a tick still prefills in one pass (at most 16384 tokens),
    its window blocks taken after its admissions on every rank (--check-state)."""
    path, want = gptoss_checkpoint("bf16")
    out = run_waves(engine_config(path, check_state=True, max_prefill_tokens=0))
    if COMM.rank == 0:
        assert [r.token_ids for r in out] == want
