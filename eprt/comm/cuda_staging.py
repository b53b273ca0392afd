"""MPI on GPU arrays through pinned host memory, correct with any MPI: the producing stream is
synchronized before MPI touches the data, and MPI only sees reused page-locked host buffers.
``transport.allsum(staging.send_buffer(partial))`` then ``staging.to_device(summed)``; host
NumPy arrays pass through untouched (docs/gpu.md, "MPI with device buffers").
"""

from __future__ import annotations

import numpy as np


def _is_device_array(a) -> bool:
    return hasattr(a, "__cuda_array_interface__")


class Staging:
    """Buffers for MPI calls on GPU arrays. One per communicator user; not thread-safe.
    The pinned send buffer is kept and reused (grown on demand)."""

    def __init__(self):
        self._pinned: dict[str, object] = {}  # role -> cupy PinnedMemoryPointer

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
        """What to pass to MPI as the send buffer of ``a``: a pinned host copy of device data,
        made after the stream finished producing it; host data itself."""
        if not _is_device_array(a):
            return a
        import cupy

        if not a.flags.c_contiguous:
            a = cupy.ascontiguousarray(a)
        host = self._host("send", a.shape, a.dtype)
        if not a.nbytes:  # nothing to copy (an EPLB rank that computes no rows)
            return host
        stream = cupy.cuda.get_current_stream()
        cupy.cuda.runtime.memcpyAsync(
            host.ctypes.data, a.data.ptr, a.nbytes, cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr
        )
        stream.synchronize()
        return host

    def to_device(self, buf):
        """The received data as a CuPy array (a fresh copy when it came through the host)."""
        import cupy

        if _is_device_array(buf):
            return buf
        out = cupy.empty(buf.shape, dtype=buf.dtype)
        if not buf.nbytes:
            return out
        stream = cupy.cuda.get_current_stream()
        cupy.cuda.runtime.memcpyAsync(
            out.data.ptr, buf.ctypes.data, buf.nbytes, cupy.cuda.runtime.memcpyHostToDevice, stream.ptr
        )
        stream.synchronize()  # the pinned buffer is reused by the next call
        return out
