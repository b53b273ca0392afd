import os

import pytest
from checkpoints import ARCHS, build_checkpoint

# One compute thread per process unless a test asks for more (tests/test_cpu_weights.py runs 1 and 2):
# the suite shares a small machine, and the thread count never changes a bit.
os.environ.setdefault("EPRT_CPU_THREADS", "1")


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory):
    root = os.environ.get("EPRT_TEST_CKPT_DIR")
    if root:
        os.makedirs(root, exist_ok=True)
        return root
    return str(tmp_path_factory.mktemp("ckpt"))


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
