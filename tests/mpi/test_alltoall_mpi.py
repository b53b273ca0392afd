"""The all-to-all MoE exchange (--moe-exchange alltoall; docs/design.md, "All-to-all MoE exchange"),
written once and run at several world sizes:

    mpiexec -n 1|2|3 python -m pytest --with-mpi tests/mpi/test_alltoall_mpi.py

Greedy tokens with alltoall equal the all-gather exchange's and a single rank's, for three
architectures at top-3 (deepseek_v3 with grouped routing: 3 groups of 2 experts, the best 2 compete), both
attention modes, EPLB off and on (redundant experts; the live rebalances switch placements mid-run),
and every token's logprobs equal bit for bit. -n 4 runs from a plain ``pytest`` (CI's -n 1 lane):
``test_four_ranks`` launches its own ``mpiexec -n 4`` job of the same tests.
"""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from checkpoints import EXPERT_KEY, build_checkpoint
from test_expert_parallel_mpi import COMM, PROMPTS, engine_config, run_single

from eprt.api import GenerationRequest, SamplingParams
from eprt.comm.world import launcher_world_size
from eprt.engine.config import EplbConfig
from eprt.engine.engine import launch_engine

ARCHS = {"qwen3_moe": 7, "mixtral": 7, "deepseek_v3": 6}  # experts in the test checkpoint
TOP_K = 3  # a row's partials on up to 3 ranks: the order they are added in shows in the bits (k = 2 would not)


def checkpoint(arch: str) -> str:
    """Rank 0 builds it (top-3; deepseek_v3: 3 groups of 2 experts, the best 2 compete); every rank gets its path."""
    path = None
    if COMM.rank == 0:
        root = os.environ.get("EPRT_TEST_CKPT_DIR") or os.path.join(tempfile.gettempdir(), "eprt-mpi-ckpt")
        groups = dict(n_group=3, topk_group=2) if arch == "deepseek_v3" else {}
        experts = {EXPERT_KEY.get(arch, "num_experts"): ARCHS[arch]}
        path = build_checkpoint(
            arch, os.path.join(root, f"{arch}-top{TOP_K}"), num_experts_per_tok=TOP_K, **experts, **groups
        )
    return COMM.bcast(path, root=0)


def requests():
    return [GenerationRequest(p, SamplingParams(max_tokens=10, logprobs=2)) for p in PROMPTS]


def generate(cfg):
    """Rank 0: (token ids, every token's logprobs, MoE bytes sent per exchanged layer, exchange used); workers None."""
    try:
        with launch_engine(cfg) as engine:
            results = engine.generate(requests())
            s = engine.stats()
            assert s["moe_layers"] > 0 and (s["moe_sent_bytes"] > 0) == (COMM.size > 1), s
            assert ("MoE exchange" in engine.stats_line()) == (COMM.size > 1)
            sent = s["moe_sent_bytes"] / s["moe_layers"]
            return [r.token_ids for r in results], [_logprobs(r) for r in results], sent, s["moe_exchange"]
    except SystemExit as e:  # worker ranks leave the engine at SHUTDOWN
        assert e.code == 0, f"worker rank {COMM.rank} exited with {e.code}"
        return None


def agree(check) -> None:
    """Run ``check`` on rank 0; every rank fails with its message, so ``pytest -x`` stops every rank
    together (a rank going on to the next test alone would wait for the others forever)."""
    error = None
    if COMM.rank == 0:
        try:
            check()
        except AssertionError as e:
            error = str(e) or repr(e)
    error = COMM.bcast(error, root=0)
    if error is not None:
        pytest.fail(error)


def _logprobs(result) -> str:
    """Every generated token's logprobs and top-2 alternatives, as text: equal text, equal bits."""
    return repr([lp.to_json() for lp in result.logprobs])


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("attention", ["replicated", "dp"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_alltoall_tokens_equal_allgather_and_single_rank(arch, attention):
    """Tokens equal everywhere; logprobs equal bit for bit between the exchanges (EPLB off: the ranks'
    partials added in rank order; EPLB on, with live rebalances: a row's k choices added in choice
    order), and under replicated attention EPLB's to the single rank's (the same choice order; dp
    attention runs attention and the router over each owner's rows: its bits are its own, its tokens not)."""
    path = checkpoint(arch)
    redundant = (-ARCHS[arch]) % COMM.size or COMM.size  # physical slots a multiple of the ranks
    eplb = EplbConfig(num_redundant_experts=redundant + 1, interval=3, window=3)
    runs = {
        (exchange, balanced): generate(
            engine_config(path, attention=attention, moe_exchange=exchange, eplb=eplb if balanced else EplbConfig())
        )
        for exchange in ("alltoall", "allgather")
        for balanced in (False, True)
    }
    single = run_single(engine_config(path, moe_exchange="allgather"), requests)

    def check():
        assert all(run[3] == exchange for (exchange, _), run in runs.items())
        tokens = [r.token_ids for r in single]
        assert all(len(t) > 0 for t in tokens)
        for key, run in runs.items():
            assert run[0] == tokens, key
        for balanced in (False, True):  # the same bits
            assert runs["alltoall", balanced][1] == runs["allgather", balanced][1], f"EPLB {balanced}"
        if attention == "replicated":
            assert runs["alltoall", True][1] == [_logprobs(r) for r in single]
        if COMM.size > 1:
            a2a, gather = runs["alltoall", False][2], runs["allgather", False][2]
            assert 0 < a2a < gather, f"alltoall sent {a2a:.0f} B a layer, allgather {gather:.0f} B"

    agree(check)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("attention", ["replicated", "dp"])
def test_gpt_oss_experts_through_the_alltoall(attention):
    """gpt-oss's biased experts and clamped SwiGLU (moe_experts_swiglu; EPLB does not serve it): the
    same tokens and bits as the all-gather exchange."""
    from checkpoints import build_gptoss_checkpoint
    from test_gptoss_mpi import engine_config as gptoss_config

    path = None
    if COMM.rank == 0:  # test_gptoss_mpi.py's checkpoint (built once), without its transformers reference
        path = os.path.join(
            os.environ.get("EPRT_TEST_CKPT_DIR") or os.path.join(tempfile.gettempdir(), "eprt-mpi-ckpt"),
            "gpt_oss-7experts-bf16",
        )
        build_gptoss_checkpoint(path, num_local_experts=7, dtype="bfloat16")
    path = COMM.bcast(path, root=0)
    a2a = generate(gptoss_config(path, attention=attention, moe_exchange="alltoall"))
    gather = generate(gptoss_config(path, attention=attention, moe_exchange="allgather"))

    def check():
        assert (a2a[3], gather[3]) == ("alltoall", "allgather")
        assert a2a[0] == gather[0] and a2a[1] == gather[1] and all(len(t) > 0 for t in a2a[0])

    agree(check)


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not on PATH")
@pytest.mark.skipif(launcher_world_size() > 1, reason="launches its own -n 4 job; run once, not per rank")
def test_four_ranks():
    """The same comparison at -n 4 (CI's MPI lanes run -n 1, 2 and 3): one job of 4 ranks."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "OMPI_"))}
    here = Path(__file__)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--with-mpi", str(here)]
    out = subprocess.run(
        ["mpiexec", "-n", "4", *cmd, "-k", "equal_allgather"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=here.parent,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout.split("passed")[0][-40:], out.stdout[-2000:]
