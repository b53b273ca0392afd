import os
import signal

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


@pytest.fixture(autouse=True)
def _restore_signal_handlers():
    """A test that runs a CLI command in-process (its SIGINT/SIGTERM drain handlers) must not leave
    them installed in this process, a pytest-xdist worker included."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        if signal.getsignal(s) is not handler and handler is not None:
            signal.signal(s, handler)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist's --dist loadgroup (tests/run_all.sh), the tests that share a module- or
    class-scoped fixture (a server, an engine, a compile) stay on one worker, so it is set up once;
    one group per parameter of such a fixture. Every other test goes to whichever worker is free."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        shared = sorted(
            name
            for name, defs in info.name2fixturedefs.items()
            if defs and defs[-1].scope in ("module", "class", "package")
        )
        if shared:
            params = getattr(getattr(item, "callspec", None), "params", {})
            key = [item.nodeid.split("::")[0]] + [f"{n}={params[n]}" for n in shared if n in params]
            item.add_marker(pytest.mark.xdist_group(",".join(key)))
