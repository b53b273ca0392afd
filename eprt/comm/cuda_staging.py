"""MPI on GPU arrays, correct with and without a CUDA-aware MPI.

Two rules, both enforced here:
1. The stream that produced a GPU array is synchronized before MPI touches it: MPI knows
   nothing of CUDA streams, and a CUDA-aware MPI would otherwise read unfinished results.
2. Without CUDA-aware MPI the data goes through page-locked ("pinned") host buffers: MPI
   only ever sees host memory, and the copies run at full PCIe/NVLink-C2C speed.

The transport asks ``Staging`` for the buffers to hand to an MPI call:
    send = staging.send_buffer(partial)              # device array, or pinned host copy
    recv = staging.recv_buffer(shape, np.float32)    # device array, or pinned host array
    ...MPI call on (send, recv), then wait for it...
    result = staging.to_device(recv)                 # a CuPy array either way
Host NumPy arrays pass through untouched, so the CPU backend can use the same code.

Whether MPI is CUDA-aware comes from EPRT_CUDA_AWARE_MPI (1/0), or by default ("auto")
from ``MPIX_Query_cuda_support()``, exported by Open MPI and MPICH builds, looked up in the
MPI library this process has loaded. No such symbol means "not aware": staging is always
correct, only slower.
"""
from __future__ import annotations

import ctypes

import numpy as np

from eprt import env

_MPI_LIB_NAMES = ("libmpi", "libmpich", "libmpi_mt")


def _loaded_mpi_libraries() -> list[str]:
    """Paths of the MPI shared libraries mapped into this process (Linux /proc)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if line.rstrip().endswith(".so") or ".so." in line}
    except OSError:
        return []
    return sorted(p for p in paths if p.rsplit("/", 1)[-1].startswith(_MPI_LIB_NAMES))


def query_cuda_support() -> bool:
    """``MPIX_Query_cuda_support()`` of the loaded MPI library; False when it has none.
    Call it after MPI is initialised (the answer may depend on runtime configuration)."""
    for path in _loaded_mpi_libraries():
        try:
            query = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support")
        except (OSError, AttributeError):
            continue
        query.restype, query.argtypes = ctypes.c_int, []
        return bool(query())
    return False


def cuda_aware_mpi() -> bool:
    """Whether MPI may be handed GPU buffers: EPRT_CUDA_AWARE_MPI, else the MPI's own answer."""
    setting = str(env.CUDA_AWARE_MPI.get()).strip().lower()
    if setting == "auto":
        return query_cuda_support()
    if setting in ("1", "true", "yes", "on"):
        return True
    if setting in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"EPRT_CUDA_AWARE_MPI must be auto, 1 or 0, got {setting!r}")


def _is_device_array(a) -> bool:
    return hasattr(a, "__cuda_array_interface__")


class Staging:
    """Buffers for MPI calls on GPU arrays. One per communicator user; not thread-safe.
    Pinned buffers are kept and reused (grown on demand), one for sends, one for receives,
    so a send and a receive of the same call never share memory."""

    def __init__(self, cuda_aware: bool | None = None):
        self.cuda_aware = cuda_aware_mpi() if cuda_aware is None else bool(cuda_aware)
        self._pinned: dict[str, object] = {}   # role -> cupy PinnedMemoryPointer

    @staticmethod
    def synchronize() -> None:
        """Wait for the current CUDA stream: call before any MPI call on device data."""
        import cupy

        cupy.cuda.get_current_stream().synchronize()

    def _host(self, role: str, shape: tuple, dtype) -> np.ndarray:
        import cupy

        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        mem = self._pinned.get(role)
        if mem is None or mem.size() < nbytes:
            mem = cupy.cuda.alloc_pinned_memory(max(nbytes, 1))
            self._pinned[role] = mem
        return np.frombuffer(mem, dtype=dtype, count=nbytes // dtype.itemsize).reshape(shape)

    def send_buffer(self, a):
        """What to pass to MPI as the send buffer of ``a``. Device data: the stream is
        synchronized, then ``a`` itself (CUDA-aware) or a pinned host copy is returned."""
        if not _is_device_array(a):
            return a
        import cupy

        if not a.flags.c_contiguous:
            a = cupy.ascontiguousarray(a)
        if self.cuda_aware:
            self.synchronize()
            return a
        host = self._host("send", a.shape, a.dtype)
        stream = cupy.cuda.get_current_stream()
        cupy.cuda.runtime.memcpyAsync(host.ctypes.data, a.data.ptr, a.nbytes,
                                      cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
        stream.synchronize()
        return host

    def recv_buffer(self, shape: tuple, dtype):
        """A receive buffer of ``shape``: a device array (CUDA-aware) or pinned host memory.
        Valid until the next ``recv_buffer`` call; pass it to ``to_device`` after the wait."""
        import cupy

        if self.cuda_aware:
            self.synchronize()   # MPI must not write into memory queued work still reads
            return cupy.empty(shape, dtype=dtype)
        return self._host("recv", shape, dtype)

    def to_device(self, buf):
        """The received data as a CuPy array (a fresh copy when it came through the host)."""
        import cupy

        if _is_device_array(buf):
            return buf
        out = cupy.empty(buf.shape, dtype=buf.dtype)
        stream = cupy.cuda.get_current_stream()
        cupy.cuda.runtime.memcpyAsync(out.data.ptr, buf.ctypes.data, buf.nbytes,
                                      cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
        stream.synchronize()  # the pinned buffer is reused by the next call
        return out
