"""qwen3_vl_moe with the vision encoder on rank 0 only: at every world size the tokens of
text-only, one-image and two-image prompts equal transformers' greedy tokens (the workers
get the main, deepstack and position columns of the vision rows through the vision sync).

    mpiexec -n 1|2|3 python -m pytest --with-mpi tests/mpi/test_vision_mpi.py
"""

import os
import tempfile

import pytest
from checkpoints import VL_END, VL_IMAGE, VL_START, build_vl_checkpoint, png_bytes, vl_reference_greedy

from eprt.api import GenerationRequest, SamplingParams
from eprt.engine.engine import EngineConfig, launch_engine

MPI = pytest.importorskip("mpi4py.MPI")
COMM = MPI.COMM_WORLD
STEPS = 8
CASES = [
    ([5, 17, 33, 9, 100, 7, 8, 9, 10], []),
    ([5, VL_START, VL_IMAGE, VL_END, 9, 31, 44], [png_bytes(1, 40, 56)]),
    ([5, 17, VL_IMAGE, 9, 100, VL_IMAGE, 7, 8], [png_bytes(2, 64, 30), png_bytes(3, 24, 24)]),
]


def shared_vl_checkpoint():
    path = None
    if COMM.rank == 0:
        root = os.environ.get("EPRT_TEST_CKPT_DIR") or os.path.join(tempfile.gettempdir(), "eprt-mpi-ckpt")
        path = build_vl_checkpoint(os.path.join(root, "qwen3_vl_moe"))
    return COMM.bcast(path, root=0)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("attention", ["replicated", "dp"])
@pytest.mark.parametrize("chunk", [0, 5])
def test_images_tokens_equal_transformers_at_every_world_size(chunk, attention):
    path = shared_vl_checkpoint()
    cfg = EngineConfig(
        model=path,
        device="cpu",
        max_batch=4,
        block_size=4,
        max_model_len=160,
        max_prefill_tokens=chunk,
        attention=attention,
    )
    params = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    try:
        with launch_engine(cfg) as engine:
            results = engine.generate([GenerationRequest(list(p), params, images=imgs or None) for p, imgs in CASES])
    except SystemExit as e:  # worker ranks leave the engine at SHUTDOWN
        assert e.code == 0, f"worker rank {COMM.rank} exited with {e.code}"
        return
    for res, (_, imgs) in zip(results, CASES):
        assert res.finish_reason == "length", res.error
        assert res.token_ids == vl_reference_greedy(path, res.prompt_ids, imgs, STEPS)
