"""Expert parallelism on the CuPy backend, at every world size (skipped without a GPU; CI runs
it on cusim, the CPU CUDA simulator: tests/cusim/README.md):

    mpiexec -n 1|2|3 python -m pytest --with-mpi -m gpu tests/mpi/test_gpu_expert_parallel_mpi.py

Each rank runs its experts' kernels on its GPU and the partial MoE outputs are summed through
pinned host buffers (eprt/comm/cuda_staging.py), or on the device after an NCCL all-gather
(eprt/comm/device_combine.py; here with an MPI stand-in for NCCL). The tokens must equal a
single-rank CuPy run.
"""

import ctypes
import os
import tempfile

import numpy as np
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
    assert_tokens_equal_single_rank(cfg, cfg)


def assert_tokens_equal_single_rank(multi_cfg: EngineConfig, single_cfg: EngineConfig) -> None:
    """The greedy tokens of PROMPTS on every rank of this job under ``multi_cfg`` equal those of one
    rank (rank 0, a local transport) under ``single_cfg``."""
    requests = lambda: [GenerationRequest(p, SamplingParams(max_tokens=10)) for p in PROMPTS]  # noqa: E731
    try:
        with launch_engine(multi_cfg) as engine:
            multi = engine.generate(requests())
    except SystemExit as e:  # worker ranks leave the engine at SHUTDOWN
        assert e.code == 0, f"worker rank {COMM.rank} exited with {e.code}"
        multi = None
    if COMM.rank == 0:
        with launch_engine(single_cfg, transport=LocalTransport()) as engine:
            single = engine.generate(requests())
        assert [r.token_ids for r in multi] == [r.token_ids for r in single]
    COMM.Barrier()


class MpiNccl:
    """A stand-in for NCCL's communicator on the simulator: its allGather done over MPI on the
    device memory (host memory under cusim), in rank order as NCCL lays it out."""

    def allGather(self, send_ptr, recv_ptr, count, datatype, stream_ptr):  # noqa: N802 - NCCL's name
        from eprt.comm.device_combine import NCCL_FLOAT32

        assert datatype == NCCL_FLOAT32
        mine = np.ctypeslib.as_array((ctypes.c_float * count).from_address(send_ptr)).copy()
        every = np.empty(count * COMM.size, np.float32)
        COMM.Allgather(mine, every)
        np.ctypeslib.as_array((ctypes.c_float * (count * COMM.size)).from_address(recv_ptr))[:] = every


@pytest.mark.mpi(min_size=2)
def test_device_combine_is_the_host_sum_bitwise_on_every_rank():
    import cupy

    from eprt.comm.device_combine import DeviceCombine
    from eprt.comm.mpi_transport import MpiTransport
    from eprt.ops.cupy_ops import CupyOps

    g = np.random.default_rng(100 + COMM.rank)
    partial = (g.standard_normal((7, 33)) * 10.0 ** g.uniform(-4, 4, (7, 33))).astype(np.float32)  # [T, D]
    t = MpiTransport(timeout=60)
    host = t.allsum(partial)
    ops = CupyOps()
    device = ops.to_host(DeviceCombine(t, ops, MpiNccl())(cupy.asarray(partial)))
    every = np.empty((COMM.size,) + device.shape, np.float32)
    COMM.Allgather(device, every)
    if t.rank == 0:
        t.shutdown()
    else:
        t.recv_frame()
    t.close()
    assert np.array_equal(device.view(np.uint32), host.view(np.uint32))
    assert all(np.array_equal(every[r].view(np.uint32), device.view(np.uint32)) for r in range(COMM.size))


@pytest.mark.mpi(min_size=2)
def test_device_gather_rows_is_every_ranks_rows_in_rank_order():
    """EPLB's combine on the device: uneven counts (rank 1 sends none), the padding dropped."""
    import cupy

    from eprt.comm.device_combine import DeviceCombine
    from eprt.comm.mpi_transport import MpiTransport
    from eprt.ops.cupy_ops import CupyOps

    counts = [3 + 2 * r if r != 1 else 0 for r in range(COMM.size)]
    rows = np.random.default_rng(7 + COMM.rank).standard_normal((counts[COMM.rank], 5)).astype(np.float32)
    t = MpiTransport(timeout=60)
    host = t.allgather_rows(rows, counts)
    ops = CupyOps()
    device = ops.to_host(DeviceCombine(t, ops, MpiNccl()).gather_rows(cupy.asarray(rows), counts))
    if t.rank == 0:
        t.shutdown()
    else:
        t.recv_frame()
    t.close()
    assert device.shape == (sum(counts), 5) and np.array_equal(device, host)


@pytest.mark.mpi(min_size=2)
def test_cuda_eplb_tokens_with_the_device_combine_equal_single_rank(monkeypatch):
    """EPLB with redundant slots and its row gather through the device combine (NCCL's stand-in)."""
    from eprt.engine import startup
    from eprt.engine.config import EplbConfig

    monkeypatch.setenv("EPRT_COMBINE", "nccl")
    monkeypatch.setattr(startup, "_nccl_importable", lambda: True)
    monkeypatch.setattr(startup, "nccl_communicator", lambda transport: MpiNccl())
    path = shared_checkpoint("qwen2_moe")
    eplb = EplbConfig(num_redundant_experts=3)
    cfg = EngineConfig(model=path, device="cuda", max_batch=4, block_size=16, max_model_len=96, eplb=eplb)
    plain = EngineConfig(model=path, device="cuda", max_batch=4, block_size=16, max_model_len=96)
    assert_tokens_equal_single_rank(cfg, plain)


@pytest.mark.mpi(min_size=2)
def test_cuda_tokens_with_the_device_combine_equal_single_rank(monkeypatch):
    from eprt.engine import startup

    monkeypatch.setenv("EPRT_COMBINE", "nccl")
    monkeypatch.setattr(startup, "_nccl_importable", lambda: True)
    monkeypatch.setattr(startup, "nccl_communicator", lambda transport: MpiNccl())
    test_cuda_tokens_equal_single_rank("qwen2_moe")
