"""The package's shape limits (docs/design.md, "Code shape"): no function of eprt/ over 60 lines,
no class of eprt/engine or eprt/comm over 25 methods (its package bases' methods counted), checked
with ``ast`` by scripts/code_shape.py; and the checker finds a planted breach of either. And the
compiled kernels' modules name the cpu_simd.py they were built from (numba's cache keys)."""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import re
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "code_shape.py"
spec = importlib.util.spec_from_file_location("code_shape", SCRIPT)
code_shape = importlib.util.module_from_spec(spec)
spec.loader.exec_module(code_shape)


def test_no_function_over_60_lines_in_the_package():
    assert code_shape.long_functions(code_shape.modules()) == []


def test_no_engine_or_comm_class_over_25_methods():
    assert code_shape.big_classes(code_shape.modules()) == []


def _function(name: str, lines: int) -> str:
    return f"def {name}():\n" + "    x = 1\n" * (lines - 1)


def test_the_checker_finds_a_long_function_and_a_big_class_with_its_bases():
    base = "class Base:\n" + "".join(f"    def b{i}(self):\n        pass\n" for i in range(20))
    sub = "from eprt.engine.base import Base\n\nclass Big(Base):\n" + "".join(
        f"    def m{i}(self):\n        pass\n" for i in range(6)
    )
    fits = "class Fits(Base):\n    def b0(self):\n        pass\n"  # an override counts once
    trees = {
        "eprt.engine.base": ast.parse(base + fits),
        "eprt.engine.sub": ast.parse(sub),
        "eprt.serve.long": ast.parse(_function("long", 61) + _function("short", 60)),
        "eprt.serve.big": ast.parse("class Elsewhere:\n" + "".join(f"    def m{i}(self): pass\n" for i in range(30))),
    }
    assert code_shape.long_functions(trees) == [(61, "eprt.serve.long:1 long")]
    assert code_shape.big_classes(trees) == [(26, "eprt.engine.sub.Big:3")]  # not eprt.serve's class


def test_compiled_kernel_modules_name_the_simd_source_they_compile():
    """numba keys a module's cached kernels on that module's text alone, and cpu_simd.py's
    intrinsics are compiled into them: each such module writes cpu_simd.py's digest, so an edit of
    cpu_simd.py must change them too and their stale kernels are rebuilt (an edit there alone kept
    the old kernels, silently, in a cache next to the sources or a user's)."""
    ops = Path(__file__).resolve().parents[1] / "eprt" / "ops"
    digest = hashlib.sha256((ops / "cpu_simd.py").read_bytes()).hexdigest()[:16]
    users = sorted(
        p.name for p in ops.glob("*.py") if re.search(r"^from eprt\.ops import cpu_simd", p.read_text(), re.M)
    )
    assert users == ["cpu_kernels.py", "mxfp4_cpu.py"]
    for name in users:
        named = re.findall(r'^SIMD_SOURCE = "([0-9a-f]{16})"$', (ops / name).read_text(), re.M)
        assert named == [digest], f"{name}: write SIMD_SOURCE = {digest!r} (cpu_simd.py changed)"
