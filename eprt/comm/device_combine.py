"""The MoE combine on the device: an NCCL all-gather of every rank's float32 partial, then the
rank-ordered sum on the device, the same float operations as the host path, so the same bits
on every rank (docs/design.md, "The MoE combine"). Host staging stays the fallback.
"""

from __future__ import annotations

import time

NCCL_FLOAT32 = 7  # ncclFloat32 in nccl.h
POLL_S = 1e-5


def nccl_communicator(transport):
    """An NCCL communicator over the transport's ranks, its unique id sent by rank 0 over MPI."""
    from cupy.cuda import nccl

    uid = nccl.get_unique_id() if transport.rank == 0 else ()
    text = bytes((x + 256) % 256 for x in uid).hex()  # the id's 128 chars, as hex
    rank0 = transport.allgather_text(text)[0]
    comm_id = tuple(b - 256 if b > 127 else b for b in bytes.fromhex(rank0))
    return nccl.NcclCommunicator(transport.size, comm_id, transport.rank)


class DeviceCombine:
    """``combine(partial)`` for the model: partial [T, D] float32 on the device -> the sum over
    ranks [T, D], identical on every rank. ``comm`` has NCCL's ``allGather(send_ptr, recv_ptr,
    count, datatype, stream_ptr)``."""

    def __init__(self, transport, ops, comm):
        self.transport, self.ops, self.comm = transport, ops, comm

    def __call__(self, partial):
        cupy, t = self.ops.xp, self.transport
        partial = cupy.ascontiguousarray(partial)
        gathered = cupy.empty((t.size,) + partial.shape, dtype=cupy.float32)  # [P, T, D]
        stream = cupy.cuda.get_current_stream()
        self.comm.allGather(partial.data.ptr, gathered.data.ptr, partial.size, NCCL_FLOAT32, stream.ptr)
        self._wait(stream)
        out = gathered[0]
        for r in range(1, t.size):  # in rank order, as the host path sums
            out = self.ops.add(out, gathered[r])
        t.stats.allsums += 1
        t.stats.allsum_bytes += partial.nbytes
        if t.recorder.payloads:  # the recorder writes host bytes
            t.recorder.combine(self.ops.to_host(partial), self.ops.to_host(out), t.collectives)
        else:
            t.recorder.combine(partial, out, t.collectives)
        return out

    def gather_rows(self, rows, counts: list[int]):
        """EPLB's combine: every rank's rows [counts[r], D] (float32 on the device), in rank order
        [sum(counts), D]. NCCL has no variable-length all-gather: each rank sends max(counts) rows
        (its own, then padding) and the padding is dropped."""
        cupy, t = self.ops.xp, self.transport
        most, width = max(counts), rows.shape[1]
        send = cupy.zeros((most, width), dtype=cupy.float32)  # [max(counts), D]
        send[: rows.shape[0]] = rows
        gathered = cupy.empty((t.size, most, width), dtype=cupy.float32)  # [P, max(counts), D]
        stream = cupy.cuda.get_current_stream()
        self.comm.allGather(send.data.ptr, gathered.data.ptr, send.size, NCCL_FLOAT32, stream.ptr)
        self._wait(stream)
        t.stats.allsums += 1
        t.stats.allsum_bytes += send.nbytes
        return cupy.concatenate([gathered[r, :c] for r, c in enumerate(counts)])  # [sum(counts), D]

    def _wait(self, stream) -> None:
        """Wait for the all-gather, watching the error channel; past the collective timeout the
        transport's watchdog reports the hang (an NCCL collective cannot be cancelled)."""
        if not hasattr(stream, "done"):
            stream.synchronize()
            return
        deadline = time.monotonic() + getattr(self.transport, "timeout", float("inf"))
        while not stream.done:
            self.transport._check_channel()
            if time.monotonic() > deadline:
                self.transport._watchdog("the MoE combine (NCCL)")
            time.sleep(POLL_S)
