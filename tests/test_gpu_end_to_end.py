"""The CuPy backend end to end: greedy tokens equal the NumPy backend's (skipped without a GPU)."""
import pytest

from eprt.engine.api import GenerationRequest, SamplingParams
from eprt.engine.engine import EngineConfig, launch_engine
from eprt.ops.device import cuda_usable

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_usable(), reason="no usable CUDA device")]

PROMPTS = [[5, 77, 3], [140, 9, 9, 31, 200, 17, 64, 12, 250, 11], list(range(40, 75))]


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def test_cuda_greedy_tokens_equal_numpy(checkpoint, arch):
    # bf16 weights on disk, so both backends start from the same numbers
    path = checkpoint(arch, dtype="bfloat16")
    out = {}
    for device in ("cpu", "cuda"):
        cfg = EngineConfig(model=path, device=device, max_batch=4, block_size=16, max_model_len=128)
        with launch_engine(cfg) as engine:
            out[device] = [r.token_ids for r in engine.generate(
                [GenerationRequest(p, SamplingParams(max_tokens=12)) for p in PROMPTS])]
    assert out["cuda"] == out["cpu"]
