"""The package layers of docs/design.md ("Layers"): no module import cycle, and the
import-linter contracts in setup.cfg catch an upward import."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp")
ROOT = Path(__file__).resolve().parents[1]


def test_no_module_import_cycles():
    graph = grimp.build_graph("eprt", exclude_type_checking_imports=True)
    cycles = sorted(
        (a, b)
        for a in graph.modules
        for b in graph.find_modules_directly_imported_by(a)
        if graph.chain_exists(importer=b, imported=a)
    )
    assert cycles == []


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
    )


@pytest.mark.parametrize(
    "module, upward",
    [
        ("eprt/scheduler/sequence.py", "import eprt.engine.runner"),  # scheduler -> engine
        ("eprt/model/weights.py", "import eprt.comm.protocol"),  # model -> comm (siblings)
        ("eprt/scheduler/guards.py", "import eprt.ops.base"),  # scheduler -> ops (forbidden)
        ("eprt/api.py", "import eprt.scheduler.config"),  # the bottom layer -> anything
    ],
)
def test_an_upward_import_breaks_the_contracts(tmp_path, module, upward):
    shutil.copytree(ROOT / "eprt", tmp_path / "eprt", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "setup.cfg", tmp_path / "setup.cfg")
    assert lint_imports(tmp_path).returncode == 0
    with open(tmp_path / module, "a") as f:
        f.write(f"\n{upward}  # noqa: E402\n")
    out = lint_imports(tmp_path)
    assert out.returncode != 0 and "BROKEN" in out.stdout, out.stdout + out.stderr
