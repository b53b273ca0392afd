"""qwen3_vl_moe with the vision encoder on rank 0 only: at every world size, in both attention
modes, on the three VL_VARIANTS checkpoints, the expanded prompts and greedy tokens of text-only,
one-image (a transparent, EXIF-rotated PNG) and three-image prompts (one resized) equal
transformers' (its PIL image processor and its model); the workers get the main, deepstack and
position columns of the vision rows through the vision sync.

    mpiexec -n 1|2|3 python -m pytest --with-mpi tests/mpi/test_vision_mpi.py
"""

import os
import tempfile

import pytest
from checkpoints import VL_END, VL_IMAGE, VL_START, VL_VARIANTS, png_bytes, vl_checkpoint, vl_reference

from eprt.api import GenerationRequest, SamplingParams
from eprt.engine.engine import EngineConfig, launch_engine

MPI = pytest.importorskip("mpi4py.MPI")
COMM = MPI.COMM_WORLD
STEPS = 8
CASES = [
    ([5, 17, 33, 9, 100, 7, 8, 9, 10], []),
    ([5, VL_START, VL_IMAGE, VL_END, 9, 31, 44], [png_bytes(1, 40, 56, alpha=True, orientation=6)]),
    (
        [5, 17, VL_START, VL_IMAGE, VL_END, 9, VL_START, VL_IMAGE, VL_END, VL_START, VL_IMAGE, VL_END, 7, 8],
        [png_bytes(2, 64, 30), png_bytes(3, 24, 24), png_bytes(4, 150, 70)],
    ),
]
_REFERENCE: dict = {}


def shared_vl_checkpoint(name: str) -> str:
    path = None
    if COMM.rank == 0:
        root = os.environ.get("EPRT_TEST_CKPT_DIR") or os.path.join(tempfile.gettempdir(), "eprt-mpi-ckpt")
        path = vl_checkpoint(root, name)
    return COMM.bcast(path, root=0)


def reference(path: str, case: int) -> tuple:
    """transformers' (expanded prompt, greedy tokens) of CASES[case], once per checkpoint (rank 0)."""
    if (path, case) not in _REFERENCE:
        _REFERENCE[path, case] = vl_reference(path, *CASES[case], STEPS)[:2]
    return _REFERENCE[path, case]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("variant", list(VL_VARIANTS))
@pytest.mark.parametrize("attention", ["replicated", "dp"])
@pytest.mark.parametrize("chunk", [0, 5])
def test_images_tokens_equal_transformers_at_every_world_size(variant, chunk, attention):
    path = shared_vl_checkpoint(variant)
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
    for case, res in enumerate(results):
        assert res.finish_reason == "length", res.error
        assert (res.prompt_ids, res.token_ids) == reference(path, case), case
