"""Compile a CUDA source for cusim and launch its kernels from Python.

``build(code, include_dirs)`` rewrites the source (and the ``.cuh`` headers of the include
folders) so it compiles as C++ with ``include/cusim.h``, finds every ``extern "C"
__global__`` entry point in the preprocessed text, appends one C launcher per entry point,
and builds a shared library with g++ (cached by content under ``$CUSIM_CACHE`` or
``~/.cache/eprt-cusim``). ``Module.kernel(name)`` returns a ``Kernel`` whose call checks
its arguments the way a GPU launch would fail on them, then runs it.

Rewrites: ``extern __shared__ T a[];`` -> a pointer to the launch's dynamic shared memory;
``__shared__ T a[N];`` and ``__shared__ T a;`` -> the block's own copy (fresh, 0xFF-filled, per
block and template instance); ``asm volatile("ptx" : outputs : inputs : clobbers)`` -> a call of
cusim's PTX interpreter (``include/cusim_ptx.h``) with the same text and operands. Comments are
blanked first; ``static __shared__`` is refused.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
INCLUDE = HERE / "include"
CXX = os.environ.get("CXX", "g++")
CXXFLAGS = (
    "-std=c++17",
    "-O2",
    "-fPIC",
    "-shared",
    "-fno-strict-aliasing",
    "-U_FORTIFY_SOURCE",
    "-Wall",
    "-Wno-unknown-pragmas",
    "-Wno-unused-function",
    "-Wno-unused-variable",
)

_TYPE = r"((?:(?:unsigned|signed|long|short)\s+)*[\w:]+)"
_EXTERN_SHARED = re.compile(
    r"extern\s+__shared__\s+(?:volatile\s+)?(?:__align__\(\d+\)\s+)?" + _TYPE + r"\s+(\w+)\s*\[\s*\]\s*;"
)
_SHARED = re.compile(
    r"__shared__\s+(?:volatile\s+)?(?:__align__\(\d+\)\s+)?" + _TYPE + r"\s+(\w+)\s*((?:\[[^\]]+\])*)\s*;"
)
_STATIC_SHARED = re.compile(r"\bstatic\s+__shared__|__shared__\s+static\b")
_ENTRY = re.compile(
    r'extern\s+"C"\s+__cusim_global__\s+void\s+(?:__cusim_bounds__\s*\(([^)]*)\)\s*)?'
    r"(\w+)\s*\(([^)]*)\)"
)
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_ASM = re.compile(r"\b(?:asm|__asm__)\s*(?:volatile\s*|__volatile__\s*)?\(")
_CONSTRAINT = re.compile(r'^"([=+&]*)([a-zA-Z]+)"\s*\((.*)\)$', re.S)

# C parameter type -> (ctypes type, numpy dtype CuPy must be given for it)
_I32, _U32, _I64, _U64 = np.int32, np.uint32, np.int64, np.uint64
SCALARS = {
    "int": (ctypes.c_int32, _I32),
    "int32_t": (ctypes.c_int32, _I32),
    "signed": (ctypes.c_int32, _I32),
    "unsigned": (ctypes.c_uint32, _U32),
    "unsigned int": (ctypes.c_uint32, _U32),
    "uint32_t": (ctypes.c_uint32, _U32),
    "long long": (ctypes.c_int64, _I64),
    "long long int": (ctypes.c_int64, _I64),
    "int64_t": (ctypes.c_int64, _I64),
    "long": (ctypes.c_int64, _I64),
    "long int": (ctypes.c_int64, _I64),
    "ptrdiff_t": (ctypes.c_int64, _I64),
    "unsigned long long": (ctypes.c_uint64, _U64),
    "unsigned long": (ctypes.c_uint64, _U64),
    "uint64_t": (ctypes.c_uint64, _U64),
    "size_t": (ctypes.c_uint64, _U64),
    "short": (ctypes.c_int16, np.int16),
    "unsigned short": (ctypes.c_uint16, np.uint16),
    "char": (ctypes.c_int8, np.int8),
    "signed char": (ctypes.c_int8, np.int8),
    "unsigned char": (ctypes.c_uint8, np.uint8),
    "float": (ctypes.c_float, np.float32),
    "double": (ctypes.c_double, np.float64),
    "bool": (ctypes.c_bool, np.bool_),
}
# pointee type -> numpy dtypes an array passed for it may have (bf16 lives in uint16 arrays);
# vector types (uint4, float4, ...) reinterpret any array; other pointees are not checked
POINTEES = {"bf16": (np.uint16,), "__nv_bfloat16": (np.uint16,), "__half": (np.float16,), "half": (np.float16,)}
POINTEES.update({name: (dtype,) for name, (_, dtype) in SCALARS.items()})
POINTEES.update({name: None for name in ("uint4", "uint2", "float4", "float2", "void")})


class BuildError(RuntimeError):
    pass


class LaunchError(RuntimeError):
    pass


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str  # as written, without const/__restrict__
    pointer: bool


def _strip_comments(text: str) -> str:
    """Comments blanked (newlines kept, so compiler messages keep their line numbers)."""
    return _COMMENT.sub(lambda m: "\n" * m[0].count("\n") or " ", text)


def _scan(text: str, start: int, stop: str) -> int:
    """The index of the first ``stop`` character at nesting depth 0 from ``start`` (strings and
    character literals skipped), or len(text)."""
    depth, i = 0, start
    while i < len(text):
        c = text[i]
        if c in "\"'":
            j = i + 1
            while j < len(text) and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            i = j + 1
            continue
        if depth == 0 and c in stop:
            return i
        depth += c in "([{"
        depth -= c in ")]}"
        i += 1
    return len(text)


def _split(text: str, sep: str) -> list[str]:
    parts, i = [], 0
    while i <= len(text):
        j = _scan(text, i, sep)
        parts.append(text[i:j])
        i = j + 1
    return parts


def _asm_operands(section: str, outputs: bool) -> list[str]:
    calls = []
    for op in (p.strip() for p in _split(section, ",") if p.strip()):
        m = _CONSTRAINT.match(op)
        if not m:
            raise BuildError(f"cusim cannot read this inline asm operand: {op}")
        if outputs != ("=" in m[1] or "+" in m[1]):
            raise BuildError(f"cusim: inline asm operand {op} is in the wrong section")
        rw = "true" if "+" in m[1] else "false"
        calls.append(f"cusim::ptx_out({m[3]}, {rw})" if outputs else f"cusim::ptx_in({m[3]})")
    return calls


def rewrite_asm(text: str) -> str:
    """Every GNU inline asm statement replaced by a call of cusim::ptx with its template and operands."""
    out, pos = [], 0
    while m := _ASM.search(text, pos):
        end = _scan(text, m.end(), ")")
        if end == len(text):
            raise BuildError("cusim: an inline asm statement has no closing parenthesis")
        sections = _split(text[m.end() : end], ":")
        template = sections[0].strip()
        if not template.startswith('"'):
            raise BuildError(f"cusim: inline asm template must be string literals, got {template[:60]}")
        outs = _asm_operands(sections[1], True) if len(sections) > 1 else []
        ins = _asm_operands(sections[2], False) if len(sections) > 2 else []
        call = f"cusim::ptx({template}, {{{', '.join(outs)}}}, {{{', '.join(ins)}}})"
        statement = text[m.start() : end]  # its newlines follow the call (a macro's keep their backslash)
        out.append(text[pos : m.start()] + call + ("\\\n" if "\\\n" in statement else "\n") * statement.count("\n"))
        pos = end + 1
    return "".join(out) + text[pos:]


def rewrite(text: str, site_base: int) -> str:
    """The source with its __shared__ declarations and inline asm replaced (see the module docstring)."""
    text = rewrite_asm(_strip_comments(text))
    if _STATIC_SHARED.search(text):
        raise BuildError("cusim does not support `static __shared__` variables")
    text = _EXTERN_SHARED.sub(lambda m: f"{m[1]}* {m[2]} = reinterpret_cast<{m[1]}*>(cusim::dynamic_shared());", text)
    counter = iter(range(site_base, site_base + 10_000))
    text = _SHARED.sub(lambda m: f"auto& {m[2]} = cusim::shared_array<{m[1]}{m[3]}>({next(counter)});", text)
    if "__shared__" in text:
        line = next(ln for ln in text.splitlines() if "__shared__" in ln)
        raise BuildError(f"cusim cannot rewrite this __shared__ declaration: {line.strip()}")
    return text


def parse_params(text: str) -> list[Param]:
    params = []
    for i, raw in enumerate(p.strip() for p in text.split(",") if p.strip()):
        pointer = "*" in raw
        words = raw.replace("*", " * ").split()
        name = words[-1] if words[-1] != "*" else f"arg{i}"
        base = " ".join(w for w in words[:-1] if w not in ("const", "__restrict__", "*"))
        params.append(Param(name, base, pointer))
    return params


def _launcher(name: str, params: list[Param]) -> str:
    decl = ", ".join(f"{'void*' if p.pointer else p.ctype} cusim_a{i}" for i, p in enumerate(params))
    fields = "".join(f"{'void*' if p.pointer else p.ctype} cusim_a{i}; " for i, p in enumerate(params))
    call = ", ".join(
        f"({p.ctype}*)cusim_s_->cusim_a{i}" if p.pointer else f"cusim_s_->cusim_a{i}" for i, p in enumerate(params)
    )
    names = ", ".join(f"cusim_a{i}" for i in range(len(params)))
    return (
        f"namespace {{ struct cusim_args_{name} {{ {fields}}};\n"
        f"void cusim_body_{name}(void* cusim_p_) {{ auto* cusim_s_ = (cusim_args_{name}*)cusim_p_; "
        f"(void)cusim_s_; {name}({call}); }} }}\n"
        f'extern "C" const char* cusim_launch_{name}(unsigned cusim_gx, unsigned cusim_gy, unsigned cusim_gz, '
        f"unsigned cusim_bx, unsigned cusim_by, unsigned cusim_bz, size_t cusim_smem, unsigned long long cusim_seed"
        f"{', ' + decl if decl else ''}) {{\n"
        f"  cusim_args_{name} cusim_v_{{{names}}};\n"
        f"  return cusim_launch(dim3{{cusim_gx, cusim_gy, cusim_gz}}, dim3{{cusim_bx, cusim_by, cusim_bz}}, "
        f"cusim_smem, cusim_seed, cusim_body_{name}, &cusim_v_);\n}}\n"
    )


def _bounds(text: str | None) -> int | None:
    """The max threads per block of a __launch_bounds__ argument list (preprocessed)."""
    if not text:
        return None
    first = text.split(",")[0]
    if not re.fullmatch(r"[\d\s()+\-*/]+", first):
        return None
    return int(eval(first.replace("/", "//")))  # digits and arithmetic only


def _cache_dir() -> Path:
    path = Path(os.environ.get("CUSIM_CACHE") or Path.home() / ".cache" / "eprt-cusim")
    path.mkdir(parents=True, exist_ok=True)
    return path


def build(code: str, include_dirs: list[Path], defines: list[str] = ()) -> Module:
    """Compile ``code`` for cusim; headers are looked up in ``include_dirs``."""
    if shutil.which(CXX) is None:
        raise BuildError(f"cusim needs a C++ compiler ({CXX}) on PATH")
    work = Path(tempfile.mkdtemp(prefix="cusim-"))
    try:
        headers = work / "include"
        headers.mkdir()
        site = 1
        digest = hashlib.sha256(b"".join(h.read_bytes() for h in sorted(INCLUDE.glob("*.h"))))
        for folder in include_dirs:  # the project's headers, rewritten like the source
            if (folder / "cuda_bf16.h").exists():
                continue  # a CUDA toolkit's headers: cusim brings its own
            for h in sorted(folder.glob("*.cuh")):
                out = rewrite(h.read_text(), site * 10_000)
                site += 1
                (headers / h.name).write_text(out)
                digest.update(h.name.encode() + out.encode())
        source = rewrite(code, 0)
        flags = [f"-D{d}" for d in defines]
        include = ["-I", str(INCLUDE), "-I", str(headers)]
        pre = subprocess.run(
            [
                CXX,
                "-E",
                "-P",
                "-x",
                "c++",
                "-std=c++17",
                "-D__global__=__cusim_global__",
                "-D__launch_bounds__(...)=__cusim_bounds__(__VA_ARGS__)",
                *flags,
                "-include",
                str(INCLUDE / "cusim.h"),
                *include,
                "-",
            ],
            input=source,
            capture_output=True,
            text=True,
        )
        if pre.returncode:
            raise BuildError(f"cusim: preprocessing failed:\n{pre.stderr}")
        entries = {m[2]: parse_params(m[3]) for m in _ENTRY.finditer(pre.stdout)}
        bounds = {m[2]: _bounds(m[1]) for m in _ENTRY.finditer(pre.stdout)}
        if not entries:
            raise BuildError('cusim: no extern "C" __global__ entry point in the source')
        full = source + "\n// ---- cusim launchers ----\n" + "".join(_launcher(n, p) for n, p in entries.items())
        digest.update(full.encode() + " ".join(CXXFLAGS + tuple(flags)).encode())
        lib = _cache_dir() / f"{digest.hexdigest()[:24]}.so"
        if not lib.exists():
            (work / "module.cpp").write_text(full)
            tmp = lib.with_name(f".{lib.name}.{os.getpid()}.tmp")  # same filesystem: atomic rename
            cc = subprocess.run(
                [
                    CXX,
                    *CXXFLAGS,
                    *flags,
                    "-include",
                    str(INCLUDE / "cusim.h"),
                    *include,
                    "-o",
                    str(tmp),
                    str(work / "module.cpp"),
                ],
                capture_output=True,
                text=True,
            )
            if cc.returncode:
                raise BuildError(f"cusim: g++ failed:\n{cc.stderr[-6000:]}")
            os.replace(tmp, lib)
        return Module(ctypes.CDLL(str(lib)), entries, bounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)


class Module:
    def __init__(self, lib: ctypes.CDLL, entries: dict[str, list[Param]], bounds: dict[str, int | None]):
        self.lib, self.entries, self.bounds = lib, entries, bounds
        self.lib.cusim_set_max_dynamic_shared.argtypes = [ctypes.c_long]

    def kernel(self, name: str) -> Kernel:
        if name not in self.entries:
            raise AttributeError(f"no kernel named {name!r}; the module exports {sorted(self.entries)}")
        return Kernel(self, name, self.entries[name])


def _dim3(v, what: str) -> tuple[int, int, int]:
    if not isinstance(v, tuple) or not 1 <= len(v) <= 3 or not all(isinstance(d, (int, np.integer)) for d in v):
        raise LaunchError(f"{what} must be a tuple of 1-3 ints (as CuPy requires), got {v!r}")
    return tuple(int(d) for d in v) + (1,) * (3 - len(v))


class Kernel:
    """One entry point. ``launch(grid, block, args, smem, seed, pointer_of)`` checks, then runs."""

    launches = 0  # a global counter: each launch shuffles its threads with a fresh seed
    _lock = threading.Lock()  # one launch at a time: the simulator's state is global

    def __init__(self, module: Module, name: str, params: list[Param]):
        self.name, self.params = name, params
        self.module, self.max_threads = module, module.bounds.get(name)
        unknown = [p for p in params if not p.pointer and p.ctype not in SCALARS]
        if unknown:
            raise LaunchError(
                f"{name}: cusim does not know the C type {unknown[0].ctype!r} of "
                f"argument {unknown[0].name} (add it to SCALARS in tests/cusim/build.py)"
            )
        fn = getattr(module.lib, f"cusim_launch_{name}")
        fn.restype = ctypes.c_char_p
        fn.argtypes = (
            [ctypes.c_uint] * 6
            + [ctypes.c_size_t, ctypes.c_ulonglong]
            + [ctypes.c_void_p if p.pointer else SCALARS[p.ctype][0] for p in params]
        )
        self._fn = fn

    def check_scalar(self, i: int, p: Param, value):
        want = np.dtype(SCALARS[p.ctype][1])
        if isinstance(value, np.generic):
            if value.dtype != want:
                raise LaunchError(
                    f"{self.name}: argument {i} ({p.name}) is a {p.ctype}; got a numpy "
                    f"{value.dtype} scalar ({value.dtype.itemsize} bytes), want {want}"
                )
            return value.item()
        kinds = {int: "int64 (8 bytes)", float: "float64 (8 bytes)"}
        got = kinds.get(type(value), "something else")
        raise LaunchError(
            f"{self.name}: argument {i} ({p.name}) is a {p.ctype}, but a Python "
            f"{type(value).__name__} would be passed as {got}: pass np.{want}(...)"
        )

    def launch(self, grid, block, args, smem: int, pointer_of, max_smem: int, max_dynamic: int = -1):
        """``max_smem``: the device's opt-in limit; ``max_dynamic``: the kernel's
        max_dynamic_shared_size_bytes attribute (-1: not set, CUDA's default applies)."""
        grid, block = _dim3(grid, "grid"), _dim3(block, "block")
        threads = block[0] * block[1] * block[2]
        if not 1 <= threads <= 1024 or block[2] > 64:
            raise LaunchError(f"{self.name}: block {block} is not a valid CUDA block (1-1024 threads)")
        if self.max_threads is not None and threads > self.max_threads:
            raise LaunchError(f"{self.name}: {threads} threads exceed its __launch_bounds__({self.max_threads})")
        if not (1 <= grid[0] < 2**31 and 1 <= grid[1] <= 65535 and 1 <= grid[2] <= 65535):
            raise LaunchError(f"{self.name}: grid {grid} is out of CUDA's limits")
        if smem > max_smem:
            raise LaunchError(f"{self.name}: {smem} bytes of dynamic shared memory exceed the device's {max_smem}")
        if len(args) != len(self.params):
            raise LaunchError(f"{self.name} takes {len(self.params)} arguments, got {len(args)}")
        values = []
        for i, (p, a) in enumerate(zip(self.params, args)):
            if p.pointer:
                if a is None or (isinstance(a, int) and not isinstance(a, bool)):  # NULL, or a raw address
                    values.append(a)
                    continue
                ptr, dtype = pointer_of(self.name, i, p, a)
                ok = POINTEES.get(p.ctype)
                if ok is not None and dtype not in [np.dtype(d) for d in ok]:
                    raise LaunchError(
                        f"{self.name}: argument {i} ({p.name}) points to {p.ctype}, got an array of {dtype}"
                    )
                values.append(ptr)
            else:
                values.append(self.check_scalar(i, p, a))
        with Kernel._lock:
            Kernel.launches += 1
            self.module.lib.cusim_set_max_dynamic_shared(max_dynamic)
            err = self._fn(*grid, *block, smem, Kernel.launches, *values)
        if err:
            raise LaunchError(f"{self.name} grid={grid} block={block}: {err.decode()}")
