"""Expert parallelism on the CuPy backend, at every world size (skipped without a GPU; CI runs
it on cusim, the CPU CUDA simulator: tests/cusim/README.md):

    mpiexec -n 1|2|3 python -m pytest --with-mpi -m gpu tests/mpi/test_gpu_expert_parallel_mpi.py

Each rank runs its experts' kernels on its GPU and the partial MoE outputs are summed through
pinned host buffers (eprt/comm/cuda_staging.py). The tokens must equal a single-rank CuPy run.
"""

import os
import tempfile

import pytest
from checkpoints import EXPERT_KEY, build_checkpoint

from eprt.api import GenerationRequest, SamplingParams
from eprt.comm.transport import LocalTransport
from eprt.engine.engine import EngineConfig, launch_engine
from eprt.ops.device import cuda_usable

MPI = pytest.importorskip("mpi4py.MPI")
COMM = MPI.COMM_WORLD
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_usable(), reason="no usable CUDA device")]
PROMPTS = [[5, 77, 3], [140, 9, 9, 31, 200, 17, 64, 12, 250, 11], list(range(90, 130))]


def shared_checkpoint(arch):
    path = None
    if COMM.rank == 0:
        root = os.environ.get("EPRT_TEST_CKPT_DIR") or os.path.join(tempfile.gettempdir(), "eprt-mpi-ckpt")
        n = 9 if arch == "deepseek_v3" else 7  # uneven over 2 ranks; deepseek_v3's 3 expert groups divide it
        key = EXPERT_KEY.get(arch, "num_experts")
        path = build_checkpoint(arch, os.path.join(root, f"{arch}-{n}experts-bf16"), dtype="bfloat16", **{key: n})
    return COMM.bcast(path, root=0)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral", "deepseek_v3"])
def test_cuda_tokens_equal_single_rank(arch):
    cfg = EngineConfig(model=shared_checkpoint(arch), device="cuda", max_batch=4, block_size=16, max_model_len=96)
    requests = lambda: [GenerationRequest(p, SamplingParams(max_tokens=10)) for p in PROMPTS]  # noqa: E731
    try:
        with launch_engine(cfg) as engine:
            multi = engine.generate(requests())
    except SystemExit as e:  # worker ranks leave the engine at SHUTDOWN
        assert e.code == 0, f"worker rank {COMM.rank} exited with {e.code}"
        multi = None
    if COMM.rank == 0:
        with launch_engine(cfg, transport=LocalTransport()) as engine:
            single = engine.generate(requests())
        assert [r.token_ids for r in multi] == [r.token_ids for r in single]
    COMM.Barrier()
