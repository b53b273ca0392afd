"""The MTP drafter (DeepSeek's multi-token prediction layer, VERIFY_MTP) across world sizes:

    mpiexec -n 1|2|3 python -m pytest --with-mpi tests/mpi/test_mtp_mpi.py

Every rank runs the MTP layer with its share of the layer's 7 experts and drafts the same tokens;
greedy and seeded sampled tokens with it equal a single-rank run without speculation. The echo
checkpoint's MTP layer drafts what the model decodes, so drafts are accepted and the multi-token
paths (several accepted drafts, the bonus token, rollback after a rejection) run on every rank.
"""

import os
import tempfile

import pytest
from checkpoints import build_mtp_checkpoint
from test_expert_parallel_mpi import COMM, PROMPTS, engine_config, run_everywhere, run_single
from test_speculative_mpi import REPEATING

from eprt.api import GenerationRequest, SamplingParams


def shared_mtp_checkpoint(echo: bool) -> str:
    """Rank 0 builds the deepseek_v3 checkpoint with its MTP layer once (7 experts: 4+3, 3+2+2)."""
    path = None
    if COMM.rank == 0:
        root = os.environ.get("EPRT_TEST_CKPT_DIR") or os.path.join(tempfile.gettempdir(), "eprt-mpi-ckpt")
        name = f"deepseek_v3-7experts-mtp{'-echo' if echo else ''}"
        path = build_mtp_checkpoint(os.path.join(root, name), echo=echo, n_routed_experts=7, n_group=1, topk_group=1)
    return COMM.bcast(path, root=0)


def mtp(path, k=3, **kw):
    return engine_config(path, speculative_method="mtp", num_speculative_tokens=k, **kw)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("echo", [False, True])
def test_greedy_mtp_equals_plain_decoding(echo):
    path = shared_mtp_checkpoint(echo)
    reqs = lambda: [GenerationRequest(p, SamplingParams(max_tokens=20, ignore_eos=True)) for p in REPEATING + PROMPTS]  # noqa: E731
    multi = run_everywhere(mtp(path), reqs)
    single = run_single(engine_config(path), reqs)
    if COMM.rank == 0:
        assert [r.token_ids for r in multi] == [r.token_ids for r in single]
        if echo:
            assert sum(r.accepted_tokens for r in multi) > len(multi) * 20 // 2


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("k", [1, 4])
def test_mtp_with_chunks_prefix_cache_and_a_tight_pool(k):
    """Chunked prefill (the held hidden rows span chunks), prefix hits (only blocks with MTP KV are
    cached) and a pool so small that sequences are preempted and drafts cut to the free blocks."""
    path = shared_mtp_checkpoint(echo=True)
    system = list(range(20, 44))
    reqs = lambda: [  # noqa: E731
        GenerationRequest(system + [i, i + 1] * 3, SamplingParams(max_tokens=24, ignore_eos=True)) for i in range(6)
    ]
    multi = run_everywhere(mtp(path, k=k, max_prefill_tokens=6, num_blocks=40), reqs)
    single = run_single(engine_config(path, prefix_cache=False), reqs)
    if COMM.rank == 0:
        assert [r.token_ids for r in multi] == [r.token_ids for r in single]
        assert sum(r.accepted_tokens for r in multi) > 0


@pytest.mark.mpi(min_size=1)
def test_sampled_mtp_emits_the_tokens_of_plain_sampling():
    path = shared_mtp_checkpoint(echo=True)
    reqs = lambda: [  # noqa: E731
        GenerationRequest(p, SamplingParams(max_tokens=16, temperature=0.7, top_k=20, seed=i, ignore_eos=True))
        for i, p in enumerate(REPEATING + PROMPTS)
    ]
    multi = run_everywhere(mtp(path), reqs)
    single = run_single(engine_config(path), reqs)
    if COMM.rank == 0:
        assert [r.token_ids for r in multi] == [r.token_ids for r in single]
        assert sum(r.accepted_tokens for r in multi) > 0
