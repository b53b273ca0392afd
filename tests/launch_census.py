"""What a CuPy forward pass asks of the GPU, counted on cusim: kernel launches (the raw
``kernels/*.cu`` ones, cuBLAS GEMMs and the kernels CuPy launches itself for a copy of a strided
view, ``take``, ``concatenate``, ``arange``, a memset, an indexed assignment or array arithmetic)
and host<->device copies, per decoder layer and per step (issue 39: a launch budget per layer).

    with census() as c:
        layers = per_layer(model, lambda: executor.decode([0], [token]))
    c.total.launches, [layer.launches for layer in layers]

Only under the cusim plugin (``cupy`` is tests/cusim/fake_cupy's stand-in); the counters patch
its functions for the duration of the ``with`` block and nothing else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from cusim import fake_cupy  # noqa: E402
from cusim.build import Kernel  # noqa: E402


@dataclasses.dataclass
class Counts:
    kernels: int = 0  # raw kernels of kernels/*.cu
    gemms: int = 0  # cuBLAS calls
    cupy: int = 0  # kernels CuPy launches itself (copies of strided views, take, concatenate, memsets...)
    h2d: int = 0  # host -> device copies
    d2h: int = 0  # device -> host copies

    @property
    def launches(self) -> int:
        return self.kernels + self.gemms + self.cupy

    def __sub__(self, other: Counts) -> Counts:
        return Counts(*(getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self)))


class Census:
    def __init__(self):
        self._kernels0 = Kernel.launches
        self._other = Counts()

    def now(self) -> Counts:
        """The counts since the census began."""
        return dataclasses.replace(self._other, kernels=Kernel.launches - self._kernels0)

    @property
    def total(self) -> Counts:
        return self.now()

    def bump(self, field: str) -> None:
        setattr(self._other, field, getattr(self._other, field) + 1)


def _counted(census: Census, fn, field_of):
    def wrapper(*args, **kwargs):
        field = field_of(*args, **kwargs)
        if field:
            census.bump(field)
        return fn(*args, **kwargs)

    return wrapper


def _from_host(a, *_, **__) -> bool:
    return not isinstance(a, fake_cupy.ndarray)


def _patches(census: Census) -> list:
    """(owner, attribute, replacement) for every call that launches or copies."""
    cupy, nd, cublas = sys.modules["cupy"], fake_cupy.ndarray, sys.modules["cupy_backends.cuda.libs.cublas"]
    always = {name: "cupy" for name in ("take", "concatenate", "stack", "arange")}
    mod = [(cupy, name, _counted(census, getattr(cupy, name), lambda *a, f=f, **k: f)) for name, f in always.items()]
    mod.append((cupy, "asarray", _counted(census, cupy.asarray, lambda a, *_, **__: "h2d" if _from_host(a) else None)))
    mod.append((cupy, "array", _counted(census, cupy.array, lambda a, *_, **__: "h2d" if _from_host(a) else None)))

    def contiguous(a, dtype=None):
        if _from_host(a):
            return "h2d"
        same = dtype is None or np.dtype(dtype) == a.dtype
        return None if a.flags.c_contiguous and same else "cupy"

    mod.append((cupy, "ascontiguousarray", _counted(census, cupy.ascontiguousarray, contiguous)))
    mod.append((cupy, "asnumpy", _counted(census, cupy.asnumpy, lambda a: None if _from_host(a) else "d2h")))
    for name in ("gemmEx", "gemmStridedBatchedEx"):
        mod.append((cublas, name, _counted(census, getattr(cublas, name), lambda *a, **k: "gemms")))
    kinds = {fake_cupy.runtime.memcpyHostToDevice: "h2d", fake_cupy.runtime.memcpyDeviceToHost: "d2h"}
    memcpy = fake_cupy.runtime.memcpyAsync
    mod.append((fake_cupy.runtime, "memcpyAsync", _counted(census, memcpy, lambda d, s, n, kind, st: kinds.get(kind))))
    for name in ("fill", "__setitem__", "copy", "astype"):
        mod.append((nd, name, _counted(census, getattr(nd, name), lambda *a, **k: "cupy")))
    mod.append((nd, "get", _counted(census, nd.get, lambda *a: "d2h")))
    mod.append((nd, "__getitem__", _counted(census, nd.__getitem__, lambda a, idx: "cupy" if _gathers(idx) else None)))
    for name in [n for n in vars(nd) if n.startswith("__") and n[2:-2].lstrip("ri") in _ARITHMETIC]:
        mod.append((nd, name, _counted(census, getattr(nd, name), lambda *a, **k: "cupy")))
    return mod


def _gathers(idx) -> bool:
    """An index that makes __getitem__ gather (a kernel) rather than return a view."""
    parts = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(p, (fake_cupy.ndarray, np.ndarray, list)) for p in parts)


_ARITHMETIC = {"add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift"}
_ARITHMETIC |= {"eq", "ne", "lt", "le", "gt", "ge", "neg", "abs"}


@contextlib.contextmanager
def census():
    """Count launches and copies on cusim for the duration of the block."""
    c = Census()
    patches = _patches(c)
    saved = [
        (owner, name, owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name))
        for owner, name, _ in patches
    ]
    try:
        for owner, name, fn in patches:
            setattr(owner, name, fn)
        yield c
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def per_layer(c: Census, model, run) -> tuple[list[Counts], Counts]:
    """Run ``run()`` (one forward pass of ``model``, an eprt MoEModel) under census ``c``: the
    counts of each decoder layer (from the end of the previous layer's MLP, so its input norm
    counts, to the end of its own MLP, or of ``ops.decode_layer`` for a layer run as that op; layer 0
    from the start of ``hidden_states``) and of the whole call. One forward pass per call: a second
    one's marks would run on."""
    marks, start = [], c.now()
    names = ((model, "_mlp"), (model, "hidden_states"), (model.ops, "decode_layer"))  # _mlp: a layer's MLP
    originals = {(owner, name): getattr(owner, name) for owner, name in names}

    def marking(fn):
        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            marks.append(c.now())
            return out

        return wrapper

    def starting(fn):  # layer 0 starts where the layers do (its input norm; the embedding is the step's)
        def wrapper(*args, **kwargs):
            marks.append(c.now())
            return fn(*args, **kwargs)

        return wrapper

    for (owner, name), fn in originals.items():
        setattr(owner, name, starting(fn) if name == "hidden_states" else marking(fn))
    try:
        run()
    finally:
        for owner, name in originals:
            delattr(owner, name)
    return [b - a for a, b in zip(marks, marks[1:])], c.now() - start
