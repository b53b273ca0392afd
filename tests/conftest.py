import os

import pytest
from checkpoints import ARCHS, build_checkpoint


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory):
    """The test checkpoints' folder: $EPRT_TEST_CKPT_DIR, else one for the run (shared by the
    pytest-xdist workers: each checkpoint is built once, by one of them; checkpoints.building)."""
    root = os.environ.get("EPRT_TEST_CKPT_DIR")
    if not root:
        base = tmp_path_factory.getbasetemp()
        root = str((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "ckpt")
    os.makedirs(root, exist_ok=True)
    return root


@pytest.fixture(scope="session")
def checkpoint(ckpt_root):
    """checkpoint(arch, dtype="float32", **overrides) -> directory (built once per session)."""

    def make(arch: str, dtype: str = "float32", **overrides) -> str:
        tag = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
        return build_checkpoint(
            arch, os.path.join(ckpt_root, f"{arch}-{dtype}{('-' + tag) if tag else ''}"), dtype=dtype, **overrides
        )

    return make


@pytest.fixture(scope="session", params=ARCHS)
def arch(request):
    return request.param
