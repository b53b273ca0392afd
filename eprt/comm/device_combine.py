"""The MoE combine of GPU ranks, chosen once at start-up (docs/gpu.md, "MPI with device buffers"):
an NCCL all-gather of every rank's float32 partial, then the rank-ordered sum on the device (the
float operations of the host path, so the same bits on every rank), or, where NCCL cannot run
(not on every rank, or ranks sharing a GPU, which NCCL refuses), the partials through pinned host
memory and the transport's host sum.
"""

from __future__ import annotations

import json
import logging
import time

import numpy as np

from eprt.comm.cuda_staging import Staging
from eprt.comm.transport import row_bytes
from eprt.ops.device import device_key

log = logging.getLogger("eprt.engine")

NCCL_UINT8, NCCL_FLOAT32 = 1, 7  # ncclUint8, ncclFloat32 in nccl.h
NCCL_UNIQUE_ID_BYTES = 128
POLL_S = 1e-5
COMBINES = ("auto", "nccl", "host")


def nccl_importable() -> bool:
    try:
        from cupy.cuda import nccl

        return bool(nccl.available) if hasattr(nccl, "available") else True
    except Exception:  # no NCCL in this CuPy build, or no libnccl
        return False


def nccl_communicator(transport):
    """An NCCL communicator over the transport's ranks: rank 0's unique id (CuPy 14: 128 bytes)
    reaches every rank in the start-up exchange, and each makes its one communicator from it."""
    from cupy.cuda import nccl

    mine = _id_bytes(nccl.get_unique_id()) if transport.rank == 0 else b""
    uid = bytes.fromhex(transport.allgather_text(mine.hex())[0])
    if len(uid) != NCCL_UNIQUE_ID_BYTES:
        raise RuntimeError(f"NCCL unique id from rank 0 has {len(uid)} bytes, expected {NCCL_UNIQUE_ID_BYTES}")
    return nccl.NcclCommunicator(transport.size, uid, transport.rank)


def _id_bytes(uid) -> bytes:
    """CuPy 14 gives bytes; older CuPy a tuple of signed chars."""
    return uid if isinstance(uid, bytes) else bytes(b % 256 for b in uid)


def shared_devices(keys: list[str]) -> list[tuple[int, int]]:
    """(first rank, rank) for every rank whose device (``device_key``) an earlier rank has."""
    first: dict[str, int] = {}
    pairs = []
    for rank, key in enumerate(keys):
        if key in first:
            pairs.append((first[key], rank))
        first.setdefault(key, rank)
    return pairs


def choose_combine(transport, ops, choice: str):
    """(combine, gather_rows) for GPU ranks (``choice``: EPRT_COMBINE), logged. ``auto`` takes NCCL
    when every rank's CuPy has it and no two ranks share a GPU; ``nccl`` where that does not hold
    is an error naming why. Every rank decides the same from the same gathered facts."""
    if choice not in COMBINES:
        raise ValueError(f"EPRT_COMBINE must be one of {', '.join(COMBINES)}, got {choice!r}")
    every = [json.loads(t) for t in transport.allgather_text(json.dumps([nccl_importable(), device_key()]))]
    why = ""
    if choice != "host":
        lacking = [r for r, (usable, _) in enumerate(every) if not usable]
        shared = shared_devices([key for _, key in every])
        if lacking:
            why = f"NCCL is not usable on rank(s) {', '.join(map(str, lacking))} (cupy.cuda.nccl)"
        elif shared:
            r, s = shared[0]
            why = f"ranks {r} and {s} share GPU {every[s][1]} (NCCL refuses duplicate GPUs)"
        else:
            log.info("MoE combine: NCCL all-gather and a rank-ordered sum on the device")
            device = DeviceCombine(transport, ops, nccl_communicator(transport))
            return device, device.gather_rows
        if choice == "nccl":
            raise ValueError(f"EPRT_COMBINE=nccl, but {why}; use EPRT_COMBINE=auto or host")
    log.info("MoE combine: through pinned host memory (EPRT_COMBINE=%s%s)", choice, f": {why}" if why else "")
    host = HostCombine(transport)
    return host, host.gather_rows


class HostCombine:
    """The combine through reused pinned host buffers and ``Transport.allsum`` (any MPI); the
    host waits for every layer's partial (``blocks_host``)."""

    blocks_host = True

    def __init__(self, transport):
        self.transport, self.staging = transport, Staging()

    def __call__(self, partial):
        return self.staging.to_device(self.transport.allsum(self.staging.send_buffer(partial)))

    def gather_rows(self, rows, counts: list[int]):
        return self.staging.to_device(self.transport.allgather_rows(self.staging.send_buffer(rows), counts))


class DeviceCombine:
    """``combine(partial)`` for the model: partial [T, D] float32 on the device -> the sum over
    ranks [T, D], identical on every rank. ``comm`` has NCCL's ``allGather(send_ptr, recv_ptr,
    count, datatype, stream_ptr)``. Nothing waits per layer: the all-gather is ordered on the
    stream before the sums that read it. The host's next wait on the stream (``ops``' host-wait
    hook: at the latest the step's readback) first polls an event recorded after the last
    collective, watching the error channel, so a hung collective still meets the watchdog."""

    blocks_host = False

    def __init__(self, transport, ops, comm):
        self.transport, self.ops, self.comm = transport, ops, comm
        self._event = None  # recorded after the last collective not yet seen complete
        ops.add_host_wait(self.settle)
        ops.add_graph_launch(self.mark)

    def __call__(self, partial):
        cupy, t = self.ops.xp, self.transport
        partial = cupy.ascontiguousarray(partial)
        gathered = cupy.empty((t.size,) + partial.shape, dtype=cupy.float32)  # [P, T, D]
        self._all_gather(partial, gathered)
        out = self.ops.rank_sum(gathered) if t.size > 1 else gathered[0]  # rank order, as the host sums: one launch
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
        self._all_gather(send, gathered)
        t.stats.allsums += 1
        t.stats.allsum_bytes += send.nbytes
        return cupy.concatenate([gathered[r, :c] for r, c in enumerate(counts)])  # [sum(counts), D]

    def alltoall_rows(self, rows, send: list[int], recv: list[int]):
        """The all-to-all MoE exchange on the device (docs/gpu.md, "MPI with device buffers"): ``rows``
        [sum(send), ...] on the device, block r (``send[r]`` rows) meant for rank r -> the blocks meant
        for this rank in rank order [sum(recv), ...], on the device. NCCL send/recv to every other
        rank in one group on the rank's stream, as bytes (moved, never reduced: any dtype); the
        rank's own block is a device copy; blocks of no rows post nothing (the peer's count is 0 too)."""
        from cupy.cuda import nccl

        cupy, t = self.ops.xp, self.transport
        if len(send) != t.size or len(recv) != t.size or rows.shape[0] != sum(send):
            raise ValueError(f"alltoall_rows: {rows.shape[0]} rows, send counts {send}, receive counts {recv}")
        rows = cupy.ascontiguousarray(rows)
        width = row_bytes(rows)
        out = cupy.empty((sum(recv),) + rows.shape[1:], dtype=rows.dtype)  # [sum(recv), ...]
        at_send, at_recv = np.cumsum([0, *send]), np.cumsum([0, *recv])
        t.stats.wire((sum(send) - send[t.rank]) * width, (sum(recv) - recv[t.rank]) * width)
        stream = cupy.cuda.get_current_stream()
        nccl.groupStart()
        try:
            for r in (r for r in range(t.size) if r != t.rank):
                if send[r]:
                    self.comm.send(rows.data.ptr + int(at_send[r]) * width, send[r] * width, NCCL_UINT8, r, stream.ptr)
                if recv[r]:
                    self.comm.recv(out.data.ptr + int(at_recv[r]) * width, recv[r] * width, NCCL_UINT8, r, stream.ptr)
        finally:
            nccl.groupEnd()
        out[at_recv[t.rank] : at_recv[t.rank + 1]] = rows[at_send[t.rank] : at_send[t.rank + 1]]
        self._marked(stream)
        t.recorder.alltoall(list(send), list(recv), width, 0.0, t.collectives)  # device time: not measured
        return out

    def _all_gather(self, send, gathered) -> None:
        """NCCL's all-gather on the rank's stream (its bytes counted as the host path counts them; its
        time on the device is not in the exchange's seconds)."""
        cupy = self.ops.xp
        peers = self.transport.size - 1
        self.transport.stats.wire(peers * send.nbytes, peers * send.nbytes)
        stream = cupy.cuda.get_current_stream()  # the rank's own (CupyOps.stream), never the legacy one
        self.comm.allGather(send.data.ptr, gathered.data.ptr, send.size, NCCL_FLOAT32, stream.ptr)
        self._marked(stream)

    def _marked(self, stream) -> None:
        """``mark`` after collectives issued on ``stream``, unless it captures (a graph's: marked after its launch)."""
        if not self.ops.xp.cuda.runtime.streamIsCapturing(stream.ptr):
            self.mark(stream)

    def mark(self, stream) -> None:
        """Record the watchdog's event on ``stream``: after the collectives issued (or a graph
        launched) so far, in stream order."""
        if self._event is None:
            self._event = self.ops.xp.cuda.Event(disable_timing=True)
        self._event.record(stream)

    def settle(self) -> None:
        """Wait until the collectives enqueued so far have completed, watching the error
        channel; past the collective timeout the transport's watchdog reports the hang (an NCCL
        collective cannot be cancelled)."""
        event, self._event = self._event, None
        if event is None:
            return
        deadline = time.monotonic() + getattr(self.transport, "timeout", float("inf"))
        while not event.done:
            self.transport.link.check_channel()
            if time.monotonic() > deadline:
                self.transport.link.watchdog("the MoE combine (NCCL)")
            time.sleep(POLL_S)
