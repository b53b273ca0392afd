"""The tensor-core kernels end to end, at every world size (skipped without a GPU; CI runs it on
cusim at 1 and 2 ranks, tests/cusim/README.md):

    mpiexec -n 1|2 python -m pytest --with-mpi -m gpu tests/mpi/test_gpu_tensor_cores_mpi.py

Every architecture generates on the CuPy backend with its experts split over the ranks, the
prompts' prefill going through the tensor-core kernels (the grouped expert GEMM, flash
attention or flash MLA: checked on every rank by the kernels it launched) and decode through
the CUDA-core ones (up to 2 ranks). qwen3_next's full-attention layers take flash attention
too; gpt_oss's attention with sinks takes it under a sliding window of 8 (the 35-token prompt
crosses it), its bf16 experts the tensor-core tiles with biases and the clamped SwiGLU, its MXFP4
experts the CUDA-core kernels (no tensor-core form yet).
Rank 0's tokens must follow the NumPy backend's up to the first difference, which must be a
near-tie (the rule of tests/test_gpu_end_to_end.py, docs/gpu.md).
"""

import os
import tempfile

import pytest
from checkpoints import ARCHS, HYBRID_ARCHS, build_checkpoint, build_gptoss_checkpoint

from eprt.api import GenerationRequest, SamplingParams
from eprt.comm.transport import LocalTransport
from eprt.engine.engine import EngineConfig, launch_engine
from eprt.ops.device import cuda_usable

MPI = pytest.importorskip("mpi4py.MPI")
COMM = MPI.COMM_WORLD
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_usable(), reason="no usable CUDA device")]
PROMPTS = [[5, 77, 3], [140, 9, 9, 31, 200, 17, 64, 12, 250, 11], list(range(40, 75))]
MLA_ARCHS = ("deepseek_v2", "deepseek_v3")
TC_EXPERTS = {"moe_tc_gate_up", "moe_tc_down"}
# the kernels each model's generation must launch on every rank (prefill), and its decode's CUDA-core experts
KERNELS = {arch: TC_EXPERTS | {"flash_mla" if arch in MLA_ARCHS else "flash_attention_d64"} for arch in ARCHS}
KERNELS.update({arch: TC_EXPERTS | {"flash_attention_d64"} for arch in HYBRID_ARCHS})
KERNELS["gpt_oss-bf16"] = {"flash_attention_d64", "moe_tc_gate_up_swiglu", "moe_tc_down_bias"}
KERNELS["gpt_oss-mxfp4"] = {"flash_attention_d64", "moe_gate_up_swiglu_mxfp4"}
DECODE_EXPERTS = {"gpt_oss-bf16": "moe_gate_up_swiglu_bf16", "gpt_oss-mxfp4": "moe_gate_up_swiglu_mxfp4"}


def shared_checkpoint(model):
    """tests/test_gpu_end_to_end.py's checkpoint (6 experts, bf16) or test_cupy_gptoss.py's, built on rank 0
    if missing: the ones benchmarks/gpu_prepare.sh carries to a GPU machine (which cannot build checkpoints)."""
    path = None
    if COMM.rank == 0:
        root = os.environ.get("EPRT_TEST_CKPT_DIR") or os.path.join(tempfile.gettempdir(), "eprt-mpi-ckpt")
        if model.startswith("gpt_oss-"):
            path = build_gptoss_checkpoint(os.path.join(root, model), "bfloat16", mxfp4=model.endswith("mxfp4"))
        else:
            path = build_checkpoint(model, os.path.join(root, f"{model}-bfloat16"), dtype="bfloat16")
    return COMM.bcast(path, root=0)


def generate(cfg, transport=None):
    requests = [GenerationRequest(p, SamplingParams(max_tokens=12)) for p in PROMPTS]
    with launch_engine(cfg, transport=transport) as engine:
        return [r.token_ids for r in engine.generate(requests)]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("arch", list(KERNELS))
def test_tensor_core_prefill_tokens_follow_numpy(monkeypatch, arch):
    from test_cupy_tensor_cores import launched
    from test_gpu_end_to_end import explain_divergence

    path = shared_checkpoint(arch)
    names = launched(monkeypatch)
    cfg = EngineConfig(model=path, device="cuda", max_batch=4, block_size=16, max_model_len=128)
    try:
        cuda = generate(cfg)
    except SystemExit as e:  # worker ranks leave the engine at SHUTDOWN
        assert e.code == 0, f"worker rank {COMM.rank} exited with {e.code}"
        cuda = None
    assert KERNELS[arch] <= set(names), f"rank {COMM.rank}: {sorted(set(names))}"
    if COMM.size <= 2:  # at 3 ranks, 3 sequences at top-3 give 9 slots for 2 local experts: tensor cores
        decode = DECODE_EXPERTS.get(arch, "moe_gate_up_silu")
        assert decode in names, "decode's few rows per expert take the CUDA-core kernel"
    if COMM.rank == 0:
        monkeypatch.undo()
        cpu = generate(
            EngineConfig(model=path, device="cpu", max_batch=4, block_size=16, max_model_len=128), LocalTransport()
        )
        for prompt, want, got in zip(PROMPTS, cpu, cuda):
            n = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
            if n is not None:
                why = explain_divergence(path, prompt, want[:n], want[n], got[n])
                assert why is None, f"{arch}, prompt {prompt}: token {n} differs ({got[n]} vs {want[n]}): {why}"
    COMM.Barrier()
