"""Compile a CUDA source for cusim and launch its kernels from Python.

``build(code, include_dirs)`` rewrites the source (and the ``.cuh`` headers of the include
folders) so it compiles as C++ with ``include/cusim.h``, finds every ``extern "C"
__global__`` entry point in the preprocessed text, appends one C launcher per entry point,
and builds a shared library with g++ (cached by content under ``$CUSIM_CACHE`` or
``~/.cache/eprt-cusim``). ``Module.kernel(name)`` returns a ``Kernel`` whose call checks
its arguments the way a GPU launch would fail on them, then runs it.

Rewrites: ``extern __shared__ T a[];`` -> a pointer to the launch's dynamic shared memory;
``__shared__ T a[N];`` and ``__shared__ T a;`` -> the block's own copy (fresh, 0xFF-filled, per block).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
INCLUDE = HERE / "include"
CXX = os.environ.get("CXX", "g++")
CXXFLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-fno-strict-aliasing", "-U_FORTIFY_SOURCE", "-Wall",
            "-Wno-unknown-pragmas", "-Wno-unused-function", "-Wno-unused-variable")

_EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([\w:]+)\s+(\w+)\s*\[\s*\]\s*;")
_SHARED = re.compile(r"__shared__\s+([\w:]+)\s+(\w+)\s*((?:\[[^\]]+\])*)\s*;")
_ENTRY = re.compile(r'extern\s+"C"\s+__cusim_global__\s+void\s+(\w+)\s*\(([^)]*)\)')

# C parameter type -> (ctypes type, numpy dtype CuPy must be given for it)
SCALARS = {
    "int": (ctypes.c_int32, np.int32), "unsigned": (ctypes.c_uint32, np.uint32),
    "unsigned int": (ctypes.c_uint32, np.uint32), "long long": (ctypes.c_int64, np.int64),
    "long long int": (ctypes.c_int64, np.int64), "unsigned long long": (ctypes.c_uint64, np.uint64),
    "size_t": (ctypes.c_uint64, np.uint64), "float": (ctypes.c_float, np.float32),
    "double": (ctypes.c_double, np.float64), "bool": (ctypes.c_bool, np.bool_),
}
# pointee type -> numpy dtypes an array passed for it may have (bf16 lives in uint16 arrays)
POINTEES = {
    "bf16": (np.uint16,), "__nv_bfloat16": (np.uint16,), "float": (np.float32,),
    "int": (np.int32,), "unsigned": (np.uint32,), "long long": (np.int64,), "double": (np.float64,),
}


class BuildError(RuntimeError):
    pass


class LaunchError(RuntimeError):
    pass


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str          # as written, without const/__restrict__
    pointer: bool


def rewrite(text: str, site_base: int) -> str:
    """The source with its __shared__ declarations replaced (see the module docstring)."""
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
    decl = ", ".join(f"{'void*' if p.pointer else p.ctype} a{i}" for i, p in enumerate(params))
    fields = "".join(f"{'void*' if p.pointer else p.ctype} a{i}; " for i, p in enumerate(params))
    call = ", ".join(f"({p.ctype}*)s->a{i}" if p.pointer else f"s->a{i}" for i, p in enumerate(params))
    names = ", ".join(f"a{i}" for i in range(len(params)))
    return (f"namespace {{ struct cusim_args_{name} {{ {fields}}};\n"
            f"void cusim_body_{name}(void* p) {{ auto* s = (cusim_args_{name}*)p; (void)s; {name}({call}); }} }}\n"
            f'extern "C" const char* cusim_launch_{name}(unsigned gx, unsigned gy, unsigned gz, '
            f"unsigned bx, unsigned by, unsigned bz, size_t smem, unsigned long long seed"
            f"{', ' + decl if decl else ''}) {{\n"
            f"  cusim_args_{name} s{{{names}}};\n"
            f"  return cusim_launch(dim3{{gx, gy, gz}}, dim3{{bx, by, bz}}, smem, seed, cusim_body_{name}, &s);\n}}\n")


def _cache_dir() -> Path:
    path = Path(os.environ.get("CUSIM_CACHE") or Path.home() / ".cache" / "eprt-cusim")
    path.mkdir(parents=True, exist_ok=True)
    return path


def build(code: str, include_dirs: list[Path], defines: list[str] = ()) -> "Module":
    """Compile ``code`` for cusim; headers are looked up in ``include_dirs``."""
    if shutil.which(CXX) is None:
        raise BuildError(f"cusim needs a C++ compiler ({CXX}) on PATH")
    work = Path(tempfile.mkdtemp(prefix="cusim-"))
    try:
        headers = work / "include"
        headers.mkdir()
        site = 1
        digest = hashlib.sha256((INCLUDE / "cusim.h").read_bytes() + (INCLUDE / "cuda_bf16.h").read_bytes())
        for folder in include_dirs:   # the project's headers, rewritten like the source
            if (folder / "cuda_bf16.h").exists():
                continue               # a CUDA toolkit's headers: cusim brings its own
            for h in sorted(folder.glob("*.cuh")):
                out = rewrite(h.read_text(), site * 10_000)
                site += 1
                (headers / h.name).write_text(out)
                digest.update(h.name.encode() + out.encode())
        source = rewrite(code, 0)
        flags = [f"-D{d}" for d in defines]
        include = ["-I", str(INCLUDE), "-I", str(headers)]
        pre = subprocess.run([CXX, "-E", "-P", "-x", "c++", "-std=c++17", "-D__global__=__cusim_global__",
                              *flags, "-include", str(INCLUDE / "cusim.h"), *include, "-"],
                             input=source, capture_output=True, text=True)
        if pre.returncode:
            raise BuildError(f"cusim: preprocessing failed:\n{pre.stderr}")
        entries = {m[1]: parse_params(m[2]) for m in _ENTRY.finditer(pre.stdout)}
        if not entries:
            raise BuildError('cusim: no extern "C" __global__ entry point in the source')
        full = source + "\n// ---- cusim launchers ----\n" + "".join(_launcher(n, p) for n, p in entries.items())
        digest.update(full.encode() + " ".join(CXXFLAGS + tuple(flags)).encode())
        lib = _cache_dir() / f"{digest.hexdigest()[:24]}.so"
        if not lib.exists():
            (work / "module.cpp").write_text(full)
            tmp = work / "module.so"
            cc = subprocess.run([CXX, *CXXFLAGS, *flags, "-include", str(INCLUDE / "cusim.h"), *include,
                                 "-o", str(tmp), str(work / "module.cpp")], capture_output=True, text=True)
            if cc.returncode:
                raise BuildError(f"cusim: g++ failed:\n{cc.stderr[-6000:]}")
            shutil.move(str(tmp), lib)
        return Module(ctypes.CDLL(str(lib)), entries)
    finally:
        shutil.rmtree(work, ignore_errors=True)


class Module:
    def __init__(self, lib: ctypes.CDLL, entries: dict[str, list[Param]]):
        self.lib, self.entries = lib, entries

    def kernel(self, name: str) -> "Kernel":
        if name not in self.entries:
            raise AttributeError(f"no kernel named {name!r}; the module exports {sorted(self.entries)}")
        return Kernel(self, name, self.entries[name])


def _dim3(v, what: str) -> tuple[int, int, int]:
    v = (v,) if isinstance(v, (int, np.integer)) else tuple(v)
    if not 1 <= len(v) <= 3 or not all(isinstance(d, (int, np.integer)) for d in v):
        raise LaunchError(f"{what} must be an int or a tuple of 1-3 ints, got {v!r}")
    return tuple(int(d) for d in v) + (1,) * (3 - len(v))


class Kernel:
    """One entry point. ``launch(grid, block, args, smem, seed, pointer_of)`` checks, then runs."""

    launches = 0   # a global counter: each launch shuffles its threads with a fresh seed

    def __init__(self, module: Module, name: str, params: list[Param]):
        self.name, self.params = name, params
        fn = getattr(module.lib, f"cusim_launch_{name}")
        fn.restype = ctypes.c_char_p
        fn.argtypes = ([ctypes.c_uint] * 6 + [ctypes.c_size_t, ctypes.c_ulonglong]
                       + [ctypes.c_void_p if p.pointer else SCALARS[p.ctype][0] for p in params])
        self._fn = fn

    def check_scalar(self, i: int, p: Param, value):
        want = np.dtype(SCALARS[p.ctype][1])
        if isinstance(value, np.generic):
            if value.dtype != want:
                raise LaunchError(f"{self.name}: argument {i} ({p.name}) is a {p.ctype}; got a numpy "
                                  f"{value.dtype} scalar ({value.dtype.itemsize} bytes), want {want}")
            return value.item()
        kinds = {bool: "bool (1 byte)", int: "int64 (8 bytes)", float: "float64 (8 bytes)"}
        got = kinds.get(type(value), type(value).__name__)
        raise LaunchError(f"{self.name}: argument {i} ({p.name}) is a {p.ctype}, but a Python "
                          f"{type(value).__name__} would be passed as {got}: pass np.{want}(...)")

    def launch(self, grid, block, args, smem: int, pointer_of, max_smem: int):
        grid, block = _dim3(grid, "grid"), _dim3(block, "block")
        threads = block[0] * block[1] * block[2]
        if not 1 <= threads <= 1024 or block[2] > 64:
            raise LaunchError(f"{self.name}: block {block} is not a valid CUDA block (1-1024 threads)")
        if not (1 <= grid[0] < 2**31 and 1 <= grid[1] <= 65535 and 1 <= grid[2] <= 65535):
            raise LaunchError(f"{self.name}: grid {grid} is out of CUDA's limits")
        if smem > max_smem:
            raise LaunchError(f"{self.name}: {smem} bytes of dynamic shared memory exceed the {max_smem} "
                              f"allowed (set max_dynamic_shared_size_bytes first)")
        if len(args) != len(self.params):
            raise LaunchError(f"{self.name} takes {len(self.params)} arguments, got {len(args)}")
        values = []
        for i, (p, a) in enumerate(zip(self.params, args)):
            if p.pointer:
                ptr, dtype = pointer_of(self.name, i, p, a)
                ok = POINTEES.get(p.ctype)
                if ok is not None and dtype not in [np.dtype(d) for d in ok]:
                    raise LaunchError(f"{self.name}: argument {i} ({p.name}) points to {p.ctype}, "
                                      f"got an array of {dtype}")
                values.append(ptr)
            else:
                values.append(self.check_scalar(i, p, a))
        Kernel.launches += 1
        err = self._fn(*grid, *block, smem, Kernel.launches, *values)
        if err:
            raise LaunchError(f"{self.name} grid={grid} block={block}: {err.decode()}")
