"""A stand-in for the parts of CuPy eprt uses, backed by host memory and cusim.

``install()`` puts it in ``sys.modules`` as ``cupy`` (and ``cupy_backends...cublas``), so
``eprt.ops.cupy_ops.CupyOps`` runs unchanged: its kernels are compiled from ``kernels/*.cu``
by cusim, its cuBLAS GEMMs are evaluated from the raw pointers and leading dimensions it
passes, and its arrays are "device" arrays that behave as strictly as CuPy's:

- ``ndarray`` is not a NumPy array: ``np.asarray(dev)`` raises (use ``cupy.asnumpy``), and
  mixing device and host arrays in arithmetic or assignment raises, as CuPy does;
- every allocation is 256-byte aligned (like CuPy's pool), starts filled with 0xFF bytes
  (NaN floats, -1 ints: an output element a kernel forgot to write shows up), and is fenced
  by 0xFF canaries that are checked after each launch and GEMM touching it;
- kernel arguments are checked against the kernel's C signature (scalar dtypes, pointee
  dtypes, device pointers), and launch shapes against CUDA's limits;
- device pointers (``a.data.ptr``) are not host addresses: host code that reads device memory
  through one (``ctypes.from_address(a.data.ptr)``) faults, as on a GPU;
- the current device is per host thread (0 in a new thread, as in CUDA), every allocation
  remembers its device, and a launch, GEMM, copy or collective on another thread's device is
  an error (``CUSIM_DEVICES`` or ``set_device_count`` gives more than one device);
- freed memory stays in CuPy's pool (``get_default_memory_pool()``): the device's free memory
  (``runtime.memGetInfo``) comes back only at ``free_all_blocks()``, and new allocations reuse
  the pool's blocks first;
- ``cupy.cuda.nccl`` is an NCCL stand-in with CuPy 14's signatures (``fake_nccl.py``).

Device properties are those of the H200 the project measured (132 SMs, 227 KiB opt-in shared memory).
"""

from __future__ import annotations

import bisect
import ctypes
import os
import sys
import threading
import types
import weakref
from pathlib import Path

import numpy as np

from . import build as _build
from . import fake_nccl, streams
from .streams import CaptureError, counters, reset_counters  # noqa: F401 - cusim's API for tests and the bench

PAD = 256
FILL = 0xFF  # fresh memory: NaN floats, -1 ints
GUARD = 0xFE  # the canaries around each allocation (differ from FILL: -1 / NaN writes show)
SM_COUNT = 132
SMEM_OPTIN = 232448
MEMORY_TOTAL = 4 << 30
POOL_ROUND = 512  # CuPy's pool rounds every allocation up to a multiple of 512 bytes
# A device pointer is the host address of the simulated memory plus this: an address no host
# mapping has (bit 47 set: non-canonical on x86-64), so a host read through it faults.
DEVICE_OFFSET = 1 << 47
# The H200's limits (the project's first-contact probe); the SM's register file and the block's.
DEVICE_PROPERTIES = {
    "major": 9,
    "minor": 0,
    "multiProcessorCount": SM_COUNT,
    "regsPerBlock": 65536,
    "regsPerMultiprocessor": 65536,
    "sharedMemPerBlock": 49152,
    "sharedMemPerBlockOptin": SMEM_OPTIN,
    "sharedMemPerMultiprocessor": 233472,
    "maxThreadsPerBlock": 1024,
    "l2CacheSize": 62914560,
    "totalGlobalMem": MEMORY_TOTAL,
    "warpSize": 32,
}

_live: dict[int, weakref.ref[_Allocation]] = {}
_device_count = int(os.environ.get("CUSIM_DEVICES", "1"))


def set_device_count(n: int) -> None:
    """How many devices cusim shows (CUSIM_DEVICES, default 1: the H200 machine)."""
    global _device_count
    if n < 1:
        raise ValueError(f"cusim needs at least one device, got {n}")
    _device_count = n


class _DevicePool:
    """CuPy's memory pool on one device: blocks in use, and freed blocks it keeps (still taken
    from the device's point of view) until ``free_all_blocks``; a new allocation takes the
    smallest kept block that fits (splitting it) before asking the device for more."""

    def __init__(self):
        self.used = 0
        self.cached: list[int] = []  # sizes of the kept blocks, sorted

    def acquire(self, n: int, device: int) -> None:
        i = bisect.bisect_left(self.cached, n)
        if i < len(self.cached):
            rest = self.cached.pop(i) - n
            if rest:
                bisect.insort(self.cached, rest)
        elif self.used + sum(self.cached) + n > MEMORY_TOTAL:
            self.cached.clear()  # CuPy frees its kept blocks and retries before failing
            if self.used + n > MEMORY_TOTAL:
                raise OutOfMemoryError(f"Out of memory allocating {n:,} bytes on device {device}")
        self.used += n

    def release(self, n: int) -> None:
        self.used -= n
        bisect.insort(self.cached, n)


_pools: dict[int, _DevicePool] = {}


def _pool_of(device: int) -> _DevicePool:
    return _pools.setdefault(device, _DevicePool())


def _freed(ptr: int, device: int, rounded: int) -> None:
    _live.pop(ptr, None)
    if rounded:
        _pool_of(device).release(rounded)


class OutOfMemoryError(MemoryError):
    pass


class _Allocation:
    """nbytes of fenced, aligned host memory standing in for a device allocation on the
    calling thread's current device."""

    def __init__(self, nbytes: int):
        streams.check_allocation(nbytes)
        self.nbytes = nbytes
        self.device = runtime.getDevice()
        rounded = -(-nbytes // POOL_ROUND) * POOL_ROUND
        _pool_of(self.device).acquire(rounded, self.device)
        self.root = np.full(nbytes + 3 * PAD, GUARD, np.uint8)
        base = self.root.__array_interface__["data"][0]
        self.offset = PAD + (-(base + PAD)) % PAD
        self.root[self.offset : self.offset + nbytes] = FILL
        self.ptr = base + self.offset  # the host address; device pointers are ptr + DEVICE_OFFSET
        _live[self.ptr] = weakref.ref(self)
        weakref.finalize(self, _freed, self.ptr, self.device, rounded)
        streams.allocated(self)

    def on_current_device(self, who: str) -> None:
        """The caller's thread runs on this allocation's device (CUDA's current device is per
        host thread: a thread that never set it runs on device 0)."""
        current = runtime.getDevice()
        if current != self.device:
            raise _build.LaunchError(
                f"{who}: a {self.nbytes}-byte allocation of device {self.device} used from thread "
                f"{threading.current_thread().name!r}, whose current device is {current} (a thread that "
                f"never called cupy.cuda.Device(n).use() runs on device 0)"
            )

    def buffer(self) -> np.ndarray:
        return self.root[self.offset : self.offset + self.nbytes]

    def check(self, who: str) -> None:
        before, after = self.root[: self.offset], self.root[self.offset + self.nbytes :]
        if (before != GUARD).any() or (after != GUARD).any():
            where = "before the start" if (before != GUARD).any() else "past the end"
            raise _build.LaunchError(f"{who} wrote {where} of a {self.nbytes}-byte allocation")

    def contains(self, ptr: int, nbytes: int) -> bool:
        return self.ptr <= ptr and ptr + nbytes <= self.ptr + self.nbytes


def host_address(device_ptr: int, who: str) -> int:
    """The host address cusim keeps device pointer ``device_ptr``'s bytes at (cusim itself
    plays the device; host code must not do this)."""
    if device_ptr < DEVICE_OFFSET:
        raise _build.LaunchError(f"{who}: {device_ptr:#x} is a host address, not a device pointer")
    return device_ptr - DEVICE_OFFSET


def _find(ptr: int, nbytes: int, who: str) -> _Allocation:
    """The allocation holding device range [ptr, ptr + nbytes), on the caller's current device."""
    host = host_address(ptr, who)
    for ref in list(_live.values()):
        a = ref()
        if a is not None and a.contains(host, nbytes):
            a.on_current_device(who)
            return a
    raise _build.LaunchError(
        f"{who}: [{ptr:#x}, +{nbytes}) is not inside one device allocation (a range running past the end, or freed)"
    )


class _Ptr:
    def __init__(self, ptr: int):
        self.ptr = ptr


class ndarray:
    """A device array: a NumPy view into an _Allocation, with CuPy's strictness."""

    __array_ufunc__ = None  # numpy_array + device_array raises TypeError, as with CuPy
    __array_priority__ = 100

    def __init__(self, view: np.ndarray, alloc: _Allocation):
        self._a, self._alloc = view, alloc

    # -- attributes
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    data = property(lambda self: _Ptr(self._a.__array_interface__["data"][0] + DEVICE_OFFSET))
    device = property(lambda self: Device(self._alloc.device))
    T = property(lambda self: ndarray(self._a.T, self._alloc))

    @property
    def __cuda_array_interface__(self):
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self.data.ptr, False),
            "version": 3,
            "strides": None if self.flags.c_contiguous else self.strides,
        }

    def __array__(self, *args, **kwargs):
        raise TypeError(
            "Implicit conversion to a NumPy array is not allowed. "
            "Please use `.get()` to construct a NumPy array explicitly."
        )

    def __repr__(self):
        return f"cusim.ndarray({self._a!r})"

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    # -- views and copies
    def _view(self, a: np.ndarray) -> ndarray:
        return ndarray(a, self._alloc)

    def reshape(self, *shape, **kw):
        return self._view(self._a.reshape(*shape, **kw))

    def view(self, dtype):
        return self._view(self._a.view(dtype))

    def ravel(self):
        return self._view(self._a.ravel()) if self.flags.c_contiguous else self.copy().ravel()

    def transpose(self, *axes):
        return self._view(self._a.transpose(*axes))

    def squeeze(self, axis=None):
        return self._view(self._a.squeeze(axis))

    def copy(self):
        return _op("copy", lambda: self._a, self)

    def astype(self, dtype, copy=True):
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        return _op("astype", lambda: self._a.astype(dtype), self)

    def _read(self, who: str) -> np.ndarray:
        """The host's read of the array: a device-to-host copy and a wait on the stream."""
        streams.refuse_sync(who)
        streams.refuse_copy(who, "d2h")
        _flush()
        return self._a

    def get(self) -> np.ndarray:
        return self._read("ndarray.get()").copy()  # CuPy's get() synchronizes the stream

    def item(self):
        return self._read("ndarray.item()").item()

    def fill(self, value):
        _inplace_op("fill", lambda: self._a.fill(value), self)

    def __getitem__(self, idx):
        _flush()
        r = self._a[_index(idx)]
        if isinstance(r, np.ndarray) and np.may_share_memory(r, self._a):
            return self._view(r)
        return _op("getitem", lambda: _gather(self._a, idx), self, idx)  # 0-d arrays too

    def __setitem__(self, idx, value):
        def run():
            self._a[_index(idx)] = _operand(value)

        if _host_index(idx):
            streams.refuse_copy("ndarray.__setitem__ with a host index array", "h2d")
        _inplace_op("setitem", run, self, idx, value)

    def __bool__(self):
        return bool(self._read("bool() of a device array"))

    def __int__(self):
        return int(self._read("int() of a device array"))

    def __float__(self):
        return float(self._read("float() of a device array"))

    def __index__(self):
        return self._read("a device array used as an index").__index__()

    # -- reductions and arithmetic (device operands or Python/NumPy scalars only)
    def sum(self, *a, **k):
        return _op("sum", lambda: self._a.sum(*a, **k), self)

    def max(self, *a, **k):
        return _op("max", lambda: self._a.max(*a, **k), self)

    def min(self, *a, **k):
        return _op("min", lambda: self._a.min(*a, **k), self)

    def any(self, *a, **k):
        return _op("any", lambda: self._a.any(*a, **k), self)

    def all(self, *a, **k):
        return _op("all", lambda: self._a.all(*a, **k), self)


def _binary(op):
    def method(self, other):
        self._alloc.on_current_device("a device array operation")
        _operand(other)  # refused now, not at a replay
        return _op(op.__name__, lambda: op(self._a, _operand(other)), self, other)

    return method


def _rbinary(op):
    def method(self, other):
        _operand(other)
        return _op(op.__name__, lambda: op(_operand(other), self._a), self, other)

    return method


def _inplace(op):
    def method(self, other):
        _operand(other)
        _inplace_op(op.__name__, lambda: op(self._a, _operand(other), out=self._a), self, other)
        return self

    return method


for _name, _op in [
    ("add", np.add),
    ("sub", np.subtract),
    ("mul", np.multiply),
    ("truediv", np.true_divide),
    ("floordiv", np.floor_divide),
    ("mod", np.mod),
    ("pow", np.power),
    ("and", np.bitwise_and),
    ("or", np.bitwise_or),
    ("xor", np.bitwise_xor),
    ("lshift", np.left_shift),
    ("rshift", np.right_shift),
]:
    setattr(ndarray, f"__{_name}__", _binary(_op))
    setattr(ndarray, f"__r{_name}__", _rbinary(_op))
    setattr(ndarray, f"__i{_name}__", _inplace(_op))
for _name, _op in [
    ("eq", np.equal),
    ("ne", np.not_equal),
    ("lt", np.less),
    ("le", np.less_equal),
    ("gt", np.greater),
    ("ge", np.greater_equal),
]:
    setattr(ndarray, f"__{_name}__", _binary(_op))
ndarray.__neg__ = lambda self: _op("negative", lambda: -self._a, self)
ndarray.__abs__ = lambda self: _op("absolute", lambda: np.abs(self._a), self)
ndarray.__hash__ = None


def _operand(v):
    """A device array's data, or a scalar; host arrays are refused as CuPy refuses them."""
    _flush()  # array operations run after earlier copies on the stream
    if isinstance(v, ndarray):
        v._alloc.on_current_device("a device array operation")
        return v._a
    if isinstance(v, np.ndarray) and v.ndim > 0:
        raise TypeError(
            f"Unsupported type {type(v)}: a host numpy array cannot be mixed with device arrays (cupy.asarray it first)"
        )
    if isinstance(v, (list, tuple)):
        raise TypeError(f"Unsupported type {type(v)} in a device array operation")
    return v


def _index(idx):
    if isinstance(idx, tuple):
        return tuple(_index(i) for i in idx)
    if isinstance(idx, ndarray):
        return idx._a
    if isinstance(idx, np.ndarray) and idx.ndim > 0:
        return idx  # CuPy accepts host index arrays (it copies them to the device)
    return idx


def _gather(a: np.ndarray, idx):
    """``a[idx]`` as a copy; one integer index array wraps around (CuPy does not check bounds, and a
    capture's buffers hold garbage: the real gather runs at the replay)."""
    if isinstance(idx, ndarray) and idx.dtype.kind in "iu" and a.ndim:
        return np.take(a, idx._a, axis=0, mode="wrap")
    return np.asarray(a[_index(idx)])


def _host_index(idx) -> bool:
    idx = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(i, np.ndarray) and i.ndim > 0 for i in idx)


def _device(a) -> ndarray:
    """A new device allocation holding a copy of host data ``a`` (cusim's own placement)."""
    _flush()
    a = np.asarray(a)
    alloc = _Allocation(a.nbytes)
    view = alloc.buffer().view(a.dtype).reshape(a.shape) if a.size else np.empty(a.shape, a.dtype)
    if a.size:
        view[...] = a
    return ndarray(view, alloc)


def _upload(a, who: str) -> ndarray:
    """Host data ``a`` copied to a new device allocation: a host-to-device copy."""
    streams.refuse_copy(who, "h2d")
    return _device(a)


def _signature(values) -> tuple:
    """What an array operation was issued with, for ``Graph.check_replay``: its operands' buffers,
    shapes and dtypes, Python scalars by value."""
    out = []
    for v in values:
        if isinstance(v, ndarray):
            out.append((streams.pointer(v._a.__array_interface__["data"][0]), v.shape, str(v.dtype)))
        elif isinstance(v, tuple):
            out.append(_signature(v))
        elif isinstance(v, (int, float, bool, np.generic, str, type(None), slice)):
            out.append(v)
        else:
            out.append(type(v).__name__)
    return tuple(out)


def _allocs(values) -> list:
    found = []
    for v in values:
        if isinstance(v, ndarray):
            found.append(v._alloc)
        elif isinstance(v, (tuple, list)):
            found.extend(_allocs(v))
    return found


def _op(who: str, compute, *operands) -> ndarray:
    """A CuPy array operation (an elementwise or copy kernel on a GPU): its result in a new device
    array, computed on the stream; recorded, with the output's buffer, while the stream captures."""
    _flush()
    with np.errstate(all="ignore"):  # a capture's buffers hold garbage: only the shape matters then
        out = _device(np.asarray(compute()))
    if streams.capturing_current():
        out._alloc.buffer()[:] = FILL  # nothing ran: the replay computes it

        def run():
            _flush()
            out._a[...] = compute()

        streams.enqueue(who, run, _allocs(operands) + [out._alloc], _signature(operands) + _signature((out,)))
    else:
        streams.enqueue(who, lambda: None)
    return out


def _inplace_op(who: str, run, *operands) -> None:
    """An in-place CuPy operation on device arrays: run on the stream, recorded while it captures."""

    def step():
        _flush()
        run()

    streams.enqueue(who, step, _allocs(operands), _signature(operands))


def _unwrap(v):
    if isinstance(v, ndarray):
        return v._a
    if isinstance(v, np.ndarray) and v.ndim > 0:
        raise TypeError(f"Unsupported type {type(v)}: pass device arrays to cupy functions")
    if isinstance(v, (list, tuple)):
        return type(v)(_unwrap(x) for x in v)
    return v


# ---- module-level functions -----------------------------------------------------------------
def empty(shape, dtype=np.float64, order="C"):
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    alloc = _Allocation(n)
    view = alloc.buffer().view(dtype).reshape(shape) if n else np.empty(shape, dtype)
    return ndarray(view, alloc)


def zeros(shape, dtype=np.float64):  # a memset on the stream
    a = empty(shape, dtype)
    a.fill(0)
    return a


def ones(shape, dtype=np.float64):
    a = empty(shape, dtype)
    a.fill(1)
    return a


def full(shape, value, dtype=None):
    a = empty(shape, dtype if dtype is not None else np.asarray(value).dtype)
    a.fill(value)
    return a


def empty_like(a, dtype=None):
    return empty(a.shape, dtype or a.dtype)


def zeros_like(a, dtype=None):
    return zeros(a.shape, dtype or a.dtype)


def arange(*args, dtype=None):
    return _op("arange", lambda: np.arange(*args, dtype=dtype))


def asarray(a, dtype=None):
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    return _upload(np.asarray(a, dtype=dtype), "cupy.asarray of host data")


array = asarray


def ascontiguousarray(a, dtype=None):
    if not isinstance(a, ndarray):
        return _upload(np.ascontiguousarray(a, dtype=dtype), "cupy.ascontiguousarray of host data")
    if a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    return _op("ascontiguousarray", lambda: np.ascontiguousarray(a._a, dtype=dtype), a)


def asnumpy(a):
    return a.get() if isinstance(a, ndarray) else np.asarray(a)


def broadcast_to(a, shape):
    return a._view(np.broadcast_to(a._a, shape))


def take(a, indices, axis=None):
    _unwrap(indices)
    return _op("take", lambda: np.take(_unwrap(a), _unwrap(indices), axis=axis, mode="wrap"), a, indices)


def concatenate(arrays, axis=0):
    arrays = tuple(arrays)
    return _op("concatenate", lambda: np.concatenate([_unwrap(a) for a in arrays], axis=axis), arrays)


def stack(arrays, axis=0):
    arrays = tuple(arrays)
    return _op("stack", lambda: np.stack([_unwrap(a) for a in arrays], axis=axis), arrays)


class _Random:
    """cupy.random: draws from NumPy's generator (seeded), stored on the "device"."""

    def __init__(self):
        self._rng = np.random.default_rng(0)

    def seed(self, seed=None):
        self._rng = np.random.default_rng(seed)

    def standard_normal(self, size=None, dtype=np.float64):
        return _upload(self._rng.standard_normal(size, dtype=dtype), "cupy.random (drawn on the host here)")

    def random(self, size=None, dtype=np.float64):
        return _upload(self._rng.random(size, dtype=dtype), "cupy.random (drawn on the host here)")


random = _Random()


def __getattr__(name):  # dtypes and other NumPy names used as cupy.<name>
    value = getattr(np, name)
    if isinstance(value, type) and issubclass(value, np.generic):
        return value
    raise AttributeError(f"cusim's cupy stand-in has no {name!r} (add it to tests/cusim/fake_cupy.py)")


# ---- cupy.cuda -----------------------------------------------------------------------------
class _Runtime:
    cudaDevAttrMultiProcessorCount = 16
    cudaDevAttrComputeCapabilityMajor = 75
    cudaDevAttrComputeCapabilityMinor = 76
    cudaDevAttrMaxSharedMemoryPerBlockOptin = 97
    memcpyHostToDevice, memcpyDeviceToHost, memcpyDeviceToDevice = 1, 2, 3
    _local = threading.local()  # the current device, per host thread as in CUDA

    def getDeviceCount(self):
        return _device_count

    def getDevice(self):
        return getattr(self._local, "device", 0)

    def setDevice(self, device):
        if not 0 <= device < _device_count:
            raise RuntimeError(f"cudaErrorInvalidDevice: cusim has {_device_count} device(s), got setDevice({device})")
        self._local.device = device

    def _check(self, device):
        if not 0 <= device < _device_count:
            raise RuntimeError(f"cudaErrorInvalidDevice: device {device} of {_device_count}")

    def deviceGetAttribute(self, attr, device):
        self._check(device)
        major, minor = DEVICE_PROPERTIES["major"], DEVICE_PROPERTIES["minor"]
        return {16: SM_COUNT, 75: major, 76: minor, 97: SMEM_OPTIN}[attr]

    def getDeviceProperties(self, device):
        self._check(device)
        return {"name": b"cusim (CUDA simulated on the CPU)", **DEVICE_PROPERTIES}

    def runtimeGetVersion(self):
        return 13000

    def memGetInfo(self):
        """(free, total) bytes of the current device: the pool's kept blocks are not free."""
        pool = _pool_of(self.getDevice())
        return max(MEMORY_TOTAL - pool.used - sum(pool.cached), 0), MEMORY_TOTAL

    def streamSynchronize(self, stream):
        streams.refuse_sync("runtime.streamSynchronize")
        _flush()

    def streamIsCapturing(self, stream):
        return streams.stream_is_capturing(stream)

    def memcpyAsync(self, dst, src, nbytes, kind, stream):
        """Queued on the stream: the bytes move at the next synchronize (or stream-ordered
        work), reading ``src`` then, and ``dst`` holds garbage (0xFF) until then."""
        who = "memcpyAsync"
        if kind not in (self.memcpyDeviceToHost, self.memcpyHostToDevice, self.memcpyDeviceToDevice):
            raise ValueError(f"memcpyAsync: unsupported kind {kind}")
        if kind != self.memcpyDeviceToDevice:
            streams.refuse_copy(who, "d2h" if kind == self.memcpyDeviceToHost else "h2d")
        if kind in (self.memcpyDeviceToHost, self.memcpyDeviceToDevice):
            _find(src, nbytes, who + " src")
            src = host_address(src, who)
        elif src >= DEVICE_OFFSET:
            raise _build.LaunchError(f"{who}: src {src:#x} is a device pointer, but kind is host to device")
        if kind in (self.memcpyHostToDevice, self.memcpyDeviceToDevice):
            _find(dst, nbytes, who + " dst")
            dst = host_address(dst, who)
        elif dst >= DEVICE_OFFSET:
            raise _build.LaunchError(f"{who}: dst {dst:#x} is a device pointer, but kind is device to host")
        if kind == self.memcpyDeviceToDevice:
            allocs = [_find(src + DEVICE_OFFSET, nbytes, who), _find(dst + DEVICE_OFFSET, nbytes, who)]
            sig = (streams.pointer(src), streams.pointer(dst), nbytes)
            streams.enqueue(who, lambda: ctypes.memmove(dst, src, nbytes), allocs, sig, streams.by_ptr(stream))
            return
        ctypes.memset(dst, FILL, nbytes)
        _pending.append(lambda: ctypes.memmove(dst, src, nbytes))


_pending: list = []  # queued async copies, in stream order


def _flush() -> None:
    """Run the queued copies: a synchronize, or work ordered after them on the stream."""
    while _pending:
        _pending.pop(0)()


class Event:
    """cupy.cuda.Event: recorded on the stream; done once the work before it has run (cusim
    runs queued work when asked, so a poll of ``done`` always ends)."""

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.recorded = False

    def record(self, stream=None):
        self.recorded = True

    @property
    def done(self):
        if streams.capturing_current():
            raise CaptureError("Event.done (a query of an event) while the stream captures")
        _flush()
        return True

    def synchronize(self):
        streams.refuse_sync("Event.synchronize()")
        _flush()


class Device:
    def __init__(self, device=None):
        self.id = runtime.getDevice() if device is None else int(device)
        runtime._check(self.id)
        self.pci_bus_id = f"0000:{self.id + 1:02x}:00.0"

    def use(self):
        runtime.setDevice(self.id)

    def synchronize(self):
        streams.refuse_sync("Device.synchronize()")
        _flush()

    def __enter__(self):
        self._previous = runtime.getDevice()
        runtime.setDevice(self.id)
        return self

    def __exit__(self, *exc):
        runtime.setDevice(self._previous)


class PinnedMemory(bytearray):
    def size(self):
        return len(self)


class CompileException(Exception):
    pass


class RawKernel:
    def __init__(self, kernel: _build.Kernel):
        self._kernel = kernel
        self.max_dynamic_shared_size_bytes = None  # unset: CUDA's default (48 KiB - static)

    def __call__(self, grid, block, args, *, shared_mem=0):
        if self.max_dynamic_shared_size_bytes is not None and not 0 <= self.max_dynamic_shared_size_bytes <= SMEM_OPTIN:
            raise _build.LaunchError(
                f"max_dynamic_shared_size_bytes={self.max_dynamic_shared_size_bytes} exceeds the device's {SMEM_OPTIN}"
            )
        limit = self.max_dynamic_shared_size_bytes
        args = tuple(args)

        def run():
            touched = []

            def pointer_of(name, i, p, a):
                if not isinstance(a, ndarray):
                    raise _build.LaunchError(
                        f"{name}: argument {i} ({p.name}) must be a device array, "
                        f"got {type(a).__module__}.{type(a).__name__}"
                    )
                a._alloc.on_current_device(f"{name}: argument {i} ({p.name})")
                touched.append(a._alloc)
                return a._a.__array_interface__["data"][0], a.dtype  # the launcher gets host addresses

            _flush()  # earlier copies on the stream complete before the kernel runs
            self._kernel.launch(
                grid, block, args, int(shared_mem), pointer_of, SMEM_OPTIN, -1 if limit is None else limit
            )
            for alloc in touched:
                alloc.check(self._kernel.name)

        sig = (tuple(grid), tuple(block), int(shared_mem), limit, *_kernel_args(args))
        streams.enqueue(self._kernel.name, run, _allocs(args), sig)


def _kernel_args(args) -> list:
    """A launch's arguments as ``Graph.check_replay`` compares them: buffers by identity, Python and
    NumPy scalars by type and value (the value a GPU graph keeps from its capture)."""
    out = []
    for a in args:
        if isinstance(a, ndarray):
            out.append(streams.pointer(a._a.__array_interface__["data"][0]))
        elif isinstance(a, np.generic):
            out.append((a.dtype.str, a.item()))
        else:
            out.append(a)
    return out


class RawModule:
    def __init__(self, code: str, options=(), **kwargs):
        self.code, self.options = code, tuple(options)
        self._module = None

    def compile(self, log_stream=None):
        if self._module is None:
            dirs = [Path(o[2:]) for o in self.options if o.startswith("-I")]
            defines = [o[2:] for o in self.options if o.startswith("-D")]
            try:
                self._module = _build.build(self.code, dirs, defines)
            except _build.BuildError as e:
                raise CompileException(str(e)) from None
        return self

    def get_function(self, name: str) -> RawKernel:
        return RawKernel(self.compile()._module.kernel(name))


class _MemoryPool:
    """cupy.get_default_memory_pool(), for the current device; ``cupy.cuda.MemoryPool()`` another
    (cusim keeps one device-wide account): a graph's pool, ``using_allocator(pool.malloc)``."""

    def malloc(self, nbytes):
        raise NotImplementedError("cusim allocates through cupy.empty; pass pool.malloc to using_allocator")

    def used_bytes(self):
        return _pool_of(runtime.getDevice()).used

    def free_bytes(self):
        return sum(_pool_of(runtime.getDevice()).cached)

    def total_bytes(self):
        return self.used_bytes() + self.free_bytes()

    def free_all_blocks(self, stream=None):
        _pool_of(runtime.getDevice()).cached.clear()


runtime = _Runtime()
_pool = _MemoryPool()
streams.flush = _flush
streams.default_pool = _pool


def get_default_memory_pool():
    return _pool


# ---- cuBLAS gemmEx, evaluated on the host from what cupy_ops passes ---------------------------
_CUBLAS_TYPES = {0: np.float32, 14: "bf16"}  # CUDA_R_32F, CUDA_R_16BF


def _read(ptr: int, count: int, kind) -> np.ndarray:
    ctype = ctypes.c_float if kind is np.float32 else ctypes.c_uint16
    raw = np.ctypeslib.as_array((ctype * count).from_address(ptr)).copy()
    return raw if kind is np.float32 else (raw.astype(np.uint32) << 16).view(np.float32)


def _col_major(ptr, rows, cols, ld, kind, who) -> np.ndarray:
    """A rows x cols column-major matrix with leading dimension ld, as a NumPy [rows, cols]."""
    if ld < max(1, rows):
        raise _build.LaunchError(f"{who}: leading dimension {ld} < rows {rows} (CUBLAS_STATUS_INVALID_VALUE)")
    count = ld * (cols - 1) + rows
    size = 4 if kind is np.float32 else 2
    _find(ptr, count * size, who)
    flat = _read(host_address(ptr, who), count, kind)
    return flat[np.arange(rows)[:, None] + ld * np.arange(cols)[None, :]]


_handle_streams: dict[int, int] = {}  # cuBLAS handle -> the stream pointer set on it (0: legacy)


def setStream(handle, stream):  # noqa: N802 - cuBLAS's name
    _handle_streams[int(handle)] = int(stream)


def getStream(handle):  # noqa: N802
    return _handle_streams.get(int(handle), 0)


def gemmEx(
    handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc, computeType, algo
):
    """On the handle's stream; alpha and beta read from the host now (CUBLAS_POINTER_MODE_HOST: a
    graph keeps the values of its capture)."""
    who = "cublas.gemmEx"
    alpha_v, beta_v = ctypes.c_float.from_address(alpha).value, ctypes.c_float.from_address(beta).value
    args = (transa, transb, m, n, k, alpha_v, A, Atype, lda, B, Btype, ldb, beta_v, C, Ctype, ldc, computeType)
    allocs = [a for a in (_maybe_find(p) for p in (A, B, C)) if a is not None]
    sig = tuple(streams.pointer(v) if i in (6, 9, 13) else v for i, v in enumerate(args))
    stream = streams.by_ptr(getStream(handle))
    streams.enqueue(who, lambda: _gemm_now(*args), allocs, sig, stream)


def _maybe_find(ptr):
    host = ptr - DEVICE_OFFSET
    return next((a for a in (r() for r in list(_live.values())) if a is not None and a.contains(host, 1)), None)


def _gemm_now(transa, transb, m, n, k, alpha_v, A, Atype, lda, B, Btype, ldb, beta_v, C, Ctype, ldc, computeType):
    who = "cublas.gemmEx"
    _flush()
    if (Atype, Btype, Ctype) not in ((14, 14, 14), (14, 14, 0), (0, 0, 0)):
        raise _build.LaunchError(
            f"{who}: cuBLAS does not support A/B/C types {(Atype, Btype, Ctype)} "
            f"with CUBLAS_COMPUTE_32F here (CUBLAS_STATUS_NOT_SUPPORTED)"
        )
    if computeType != 68:
        raise _build.LaunchError(f"{who}: cusim implements CUBLAS_COMPUTE_32F only, got {computeType}")
    kinds = [_CUBLAS_TYPES.get(t) for t in (Atype, Btype, Ctype)]
    if None in kinds:
        raise _build.LaunchError(f"{who}: unsupported data types {(Atype, Btype, Ctype)}")
    a = _col_major(A, *((m, k) if transa == 0 else (k, m)), lda, kinds[0], who + " A")
    b = _col_major(B, *((k, n) if transb == 0 else (n, k)), ldb, kinds[1], who + " B")
    a = a if transa == 0 else a.T
    b = b if transb == 0 else b.T
    c = alpha_v * (a.astype(np.float64) @ b.astype(np.float64))
    if beta_v != 0.0:
        c = c + beta_v * _col_major(C, m, n, ldc, kinds[2], who + " C")
    c = c.astype(np.float32)
    if ldc < max(1, m):
        raise _build.LaunchError(f"{who}: ldc {ldc} < m {m}")
    size = 4 if kinds[2] is np.float32 else 2
    count = ldc * (n - 1) + m
    alloc = _find(C, count * size, who + " C")
    dst = np.ctypeslib.as_array(
        ((ctypes.c_float if size == 4 else ctypes.c_uint16) * count).from_address(host_address(C, who))
    )
    dst[np.arange(m)[:, None] + ldc * np.arange(n)[None, :]] = c if size == 4 else _f32_to_bf16(c)
    alloc.check(who)


def gemmStridedBatchedEx(
    handle,
    transa,
    transb,
    m,
    n,
    k,
    alpha,
    A,
    Atype,
    lda,
    strideA,
    B,
    Btype,
    ldb,
    strideB,
    beta,
    C,
    Ctype,
    ldc,
    strideC,
    batchCount,
    computeType,
    algo,
):
    """``batchCount`` gemmEx calls, matrix i at element offset i * stride of A, B and C."""
    if batchCount < 0 or min(strideA, strideB, strideC) < 0:
        raise _build.LaunchError(f"cublas.gemmStridedBatchedEx: bad batch {batchCount} or strides")
    size = {0: 4, 14: 2}
    alpha_v, beta_v = ctypes.c_float.from_address(alpha).value, ctypes.c_float.from_address(beta).value
    calls = [
        (transa, transb, m, n, k, alpha_v,
         A + i * strideA * size.get(Atype, 0), Atype, lda,
         B + i * strideB * size.get(Btype, 0), Btype, ldb,
         beta_v, C + i * strideC * size.get(Ctype, 0), Ctype, ldc, computeType)
        for i in range(batchCount)
    ]  # fmt: skip
    allocs = [a for a in (_maybe_find(p) for p in (A, B, C)) if a is not None]
    sig = (transa, transb, m, n, k, alpha_v, beta_v, batchCount, strideA, strideB, strideC,
           *(streams.pointer(p) for p in (A, B, C)), Atype, Btype, Ctype, lda, ldb, ldc)  # fmt: skip
    stream = streams.by_ptr(getStream(handle))
    streams.enqueue("cublas.gemmStridedBatchedEx", lambda: [_gemm_now(*c) for c in calls], allocs, sig, stream)


def _f32_to_bf16(a: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(a, np.float32).view(np.uint32)
    out = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    out[np.isnan(a)] = 0x7FFF
    return out


def install() -> None:
    """Make ``import cupy`` (and cupy_backends' cuBLAS) resolve to this stand-in."""
    me = sys.modules[__name__]
    cuda = types.ModuleType("cupy.cuda")
    cuda.runtime = runtime
    cuda.Device = Device
    cuda.Event = Event
    cuda.Stream = streams.Stream
    cuda.Graph = streams.Graph
    cuda.MemoryPool = _MemoryPool
    cuda.using_allocator = streams.using_allocator
    cuda.nccl = fake_nccl
    cuda.memory = types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError)
    cuda.get_current_stream = streams.current_stream
    cuda.alloc_pinned_memory = lambda n: PinnedMemory(n)
    cuda.get_cuda_path = lambda: None
    cuda.compiler = types.SimpleNamespace(CompileException=CompileException)
    cuda.device = types.SimpleNamespace(get_cublas_handle=lambda: 0)
    cupy = types.ModuleType("cupy")
    for name in (
        "ndarray",
        "empty",
        "zeros",
        "ones",
        "full",
        "empty_like",
        "zeros_like",
        "arange",
        "asarray",
        "array",
        "ascontiguousarray",
        "asnumpy",
        "broadcast_to",
        "take",
        "concatenate",
        "stack",
        "get_default_memory_pool",
        "RawModule",
        "random",
    ):
        setattr(cupy, name, getattr(me, name))
    cupy.RawKernel = RawKernel
    cupy.cuda = cuda
    cupy.__getattr__ = __getattr__
    cupy.__cusim__ = True
    cupy.__version__ = "cusim"
    cublas = types.ModuleType("cupy_backends.cuda.libs.cublas")
    cublas.gemmEx = gemmEx
    cublas.gemmStridedBatchedEx = gemmStridedBatchedEx
    cublas.setStream = setStream
    cublas.getStream = getStream
    libs = types.ModuleType("cupy_backends.cuda.libs")
    libs.cublas = cublas
    backends_cuda = types.ModuleType("cupy_backends.cuda")
    backends_cuda.libs = libs
    backends = types.ModuleType("cupy_backends")
    backends.cuda = backends_cuda
    for mod in [m for m in sys.modules if m == "cupy" or m.startswith(("cupy.", "cupy_backends"))]:
        del sys.modules[mod]
    sys.modules.update(
        {
            "cupy": cupy,
            "cupy.cuda": cuda,
            "cupy.cuda.nccl": fake_nccl,
            "cupy_backends": backends,
            "cupy_backends.cuda": backends_cuda,
            "cupy_backends.cuda.libs": libs,
            "cupy_backends.cuda.libs.cublas": cublas,
        }
    )
