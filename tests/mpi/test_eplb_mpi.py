"""EPLB under real MPI (docs/eplb.md): greedy tokens identical with EPLB off, with a static balanced
placement from a statistics file, and across live rebalances in the middle of generation:

    mpiexec -n 2|3|4 python -m pytest --with-mpi tests/mpi/test_eplb_mpi.py

deepseek_v3 routes by groups (3 groups of 2 experts, the best 2 compete; or 2 groups of 3 placed by
the hierarchical policy over 2 nodes); qwen2_moe has 7 experts, a shared expert and dense layers,
split unevenly over 2, 3 and 4 ranks.
"""

import os
import tempfile

import pytest
from checkpoints import build_checkpoint
from test_expert_parallel_mpi import PROMPTS, engine_config, run_single, shared_checkpoint

from eprt.api import GenerationRequest, SamplingParams
from eprt.engine.config import EplbConfig
from eprt.engine.engine import launch_engine
from eprt.engine.expert_load import write_stats

MPI = pytest.importorskip("mpi4py.MPI")
COMM = MPI.COMM_WORLD


def grouped_checkpoint(groups: int = 3):
    path = None
    if COMM.rank == 0:
        root = os.environ.get("EPRT_TEST_CKPT_DIR") or os.path.join(tempfile.gettempdir(), "eprt-mpi-ckpt")
        name = f"deepseek_v3-grouped{groups}"
        path = build_checkpoint("deepseek_v3", os.path.join(root, name), n_group=groups, topk_group=groups - 1)
    return COMM.bcast(path, root=0)


def requests():
    return [GenerationRequest(p, SamplingParams(max_tokens=14)) for p in PROMPTS]


def generate(cfg, stats_out=None):
    """Tokens (rank 0), live rebalances done (rank 0); writes rank 0's expert counts to ``stats_out``."""
    try:
        with launch_engine(cfg) as engine:
            results = engine.generate(requests())
            if stats_out:
                write_stats(stats_out, engine.expert_load(refresh=True), engine.model_name, COMM.size)
            rebalances = 0 if engine.eplb is None else engine.eplb.rebalances
            return [r.token_ids for r in results], rebalances
    except SystemExit as e:  # worker ranks leave the engine at SHUTDOWN
        assert e.code == 0, f"worker rank {COMM.rank} exited with {e.code}"
        return None, None


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen2_moe", "deepseek_v3-hierarchical"])
def test_greedy_tokens_identical_eplb_off_static_and_live(arch):
    """deepseek_v3-hierarchical: 2 groups of 3 experts packed onto 2 nodes (--eplb-nodes 2), even worlds."""
    hierarchical = arch.endswith("hierarchical")
    if hierarchical and COMM.size % 2:
        pytest.skip("the hierarchical policy over 2 nodes needs an even number of ranks")
    path = shared_checkpoint(arch) if arch == "qwen2_moe" else grouped_checkpoint(2 if hierarchical else 3)
    policy = dict(policy="hierarchical", nodes=2) if hierarchical else {}
    stats = COMM.bcast(os.path.join(tempfile.mkdtemp(), "stats.json") if COMM.rank == 0 else None, root=0)
    off, _ = generate(engine_config(path), stats_out=stats)
    redundant = (-(7 if arch == "qwen2_moe" else 6)) % COMM.size or COMM.size  # slots a multiple of ranks
    static = EplbConfig(num_redundant_experts=redundant, init_expert_placement=stats, **policy)
    placed, _ = generate(engine_config(path, eplb=static))
    live = EplbConfig(num_redundant_experts=redundant + (2 if hierarchical else 1), interval=3, window=3, **policy)
    switched, rebalances = generate(engine_config(path, eplb=live))
    single = run_single(engine_config(path), requests)
    if COMM.rank == 0:
        assert placed == off and switched == off and [r.token_ids for r in single] == off
        assert all(len(t) > 0 for t in off)
        assert rebalances >= (1 if COMM.size > 1 else 0), "no live rebalance happened during generation"


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen2_moe"])
def test_eplb_under_dp_attention_keeps_the_tokens(arch):
    """dp attention (each owner's rows) with EPLB: every rank gets every row's routed sum from the
    own-rows combine and keeps its rows; static and live placements give a single rank's tokens."""
    path = shared_checkpoint(arch) if arch == "qwen2_moe" else grouped_checkpoint(3)
    stats = COMM.bcast(os.path.join(tempfile.mkdtemp(), "stats.json") if COMM.rank == 0 else None, root=0)
    off, _ = generate(engine_config(path, attention="dp"), stats_out=stats)
    redundant = (-(7 if arch == "qwen2_moe" else 6)) % COMM.size or COMM.size
    static = EplbConfig(num_redundant_experts=redundant, init_expert_placement=stats)
    placed, _ = generate(engine_config(path, attention="dp", eplb=static))
    live = EplbConfig(num_redundant_experts=redundant + 1, interval=3, window=3)
    switched, rebalances = generate(engine_config(path, attention="dp", eplb=live))
    single = run_single(engine_config(path), requests)
    if COMM.rank == 0:
        assert off == [r.token_ids for r in single] and placed == off and switched == off
        assert rebalances >= (1 if COMM.size > 1 else 0), "no live rebalance happened during generation"
