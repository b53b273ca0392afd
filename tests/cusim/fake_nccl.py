"""``cupy.cuda.nccl`` on cusim: CuPy 14's NCCL binding, signatures and refusals included.

What the real one does and this one checks (the H200's first contact, docs/gpu.md):
- ``get_unique_id()`` returns ``bytes`` of length 128; ``NcclCommunicator(ndev, commId, rank)``
  takes exactly that (a tuple id is CuPy 14's ``TypeError``);
- a unique id makes one communicator per process: a second one from the same id hangs NCCL,
  so it is refused here, loudly;
- two ranks of one communicator on the same GPU: ``ncclInvalidUsage`` (duplicate GPU), on
  every rank;
- collectives take raw device pointers, counts, an NCCL datatype and a stream pointer, all as
  ints; they are ordered on the stream (the result lands at the next synchronize or
  stream-ordered work) and run on the communicator's device only;
- point-to-point ``send(ptr, count, datatype, peer, stream)`` / ``recv(...)`` between
  ``groupStart()`` and ``groupEnd()``: the group runs at ``groupEnd`` (ordered on its stream), the
  i-th send from rank r to rank p meeting the i-th recv on p from r, which must have the same count
  and datatype (a real NCCL hangs or corrupts memory on a mismatch; here both ranks get an
  ``NcclError`` naming the calls). Ungrouped send/recv are refused (between two ranks that both
  send first they hang a real NCCL), and so is a group over two streams.

The ranks of a communicator are MPI processes (mpi4py, the job's COMM_WORLD; ``ndev`` must be
its size); a communicator of one rank needs no MPI.
"""

from __future__ import annotations

import ctypes
import os
import socket

import numpy as np

NCCL_UNIQUE_ID_BYTES = 128
NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = 0, 1, 2, 3, 4, 5
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4
_DTYPES = {
    NCCL_INT8: np.int8,
    NCCL_UINT8: np.uint8,
    NCCL_INT32: np.int32,
    NCCL_UINT32: np.uint32,
    NCCL_INT64: np.int64,
    NCCL_UINT64: np.uint64,
    NCCL_FLOAT16: np.float16,
    NCCL_FLOAT32: np.float32,
    NCCL_FLOAT64: np.float64,
    NCCL_BFLOAT16: np.uint16,  # moved, not reduced, here
}
available = True
_used_ids: set[bytes] = set()  # ids this process made a communicator from
_group: list[tuple] = []  # the open group's (communicator, kind, ptr, count, datatype, peer, stream) calls
_depth = [0]  # groupStart nesting: the group runs when it returns to 0
P2P_TAG = 7342  # cusim's NCCL's MPI tag: (kind, count, datatype) lists, then the data (P2P_TAG + 1 + i)


class NcclError(RuntimeError):
    pass


def get_version() -> int:
    return 22809


def get_unique_id() -> bytes:
    return os.urandom(NCCL_UNIQUE_ID_BYTES)


def _int(value, what: str) -> int:
    """Cython's conversion of an ``intptr_t`` / ``size_t`` / ``int`` argument."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what}: an integer is required, got {type(value).__name__}")
    return int(value)


def groupStart() -> None:  # noqa: N802 - CuPy's name
    if _depth[0] == 0:
        _group.clear()
    _depth[0] += 1


def groupEnd() -> None:  # noqa: N802
    """Run the group's sends and recvs, each communicator's in one stream-ordered step."""
    if _depth[0] == 0:
        raise NcclError("ncclInvalidUsage: groupEnd without groupStart")
    _depth[0] -= 1
    if _depth[0]:
        return
    calls, comms = list(_group), []
    _group.clear()
    for call in calls:
        if not any(c is call[0] for c in comms):
            comms.append(call[0])
    for comm in comms:
        comm._run_group([c[1:] for c in calls if c[0] is comm])


class NcclCommunicator:
    def __init__(self, ndev, commId, rank):  # noqa: N803 - CuPy's parameter names
        from . import fake_cupy

        ndev, rank = _int(ndev, "ndev"), _int(rank, "rank")
        if type(commId) is not bytes:
            raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got {type(commId).__name__})")
        if len(commId) != NCCL_UNIQUE_ID_BYTES:
            raise NcclError(f"ncclInvalidArgument: a unique id has {NCCL_UNIQUE_ID_BYTES} bytes, got {len(commId)}")
        if not 0 <= rank < ndev:
            raise NcclError(f"ncclInvalidArgument: rank {rank} of {ndev}")
        if commId in _used_ids:
            raise NcclError(
                "cusim: this unique id already made a communicator in this process; a second "
                "ncclCommInitRank from the same id hangs a real NCCL (get a new id for each communicator)"
            )
        _used_ids.add(commId)
        self._device = fake_cupy.runtime.getDevice()
        self._ndev, self._rank = ndev, rank
        where = f"{socket.gethostname()}:{fake_cupy.Device(self._device).pci_bus_id}"
        self._mpi = None
        every = [(commId, rank, where)]
        if ndev > 1:
            from mpi4py import MPI

            if MPI.COMM_WORLD.Get_size() != ndev:
                raise NcclError(f"cusim's NCCL: ndev {ndev} must be the MPI job's size {MPI.COMM_WORLD.Get_size()}")
            self._mpi = MPI.COMM_WORLD.Split(0, rank)  # ordered by NCCL rank
            every = self._mpi.allgather((commId, rank, where))
        if any(c != commId for c, _, _ in every) or sorted(r for _, r, _ in every) != list(range(ndev)):
            raise NcclError("cusim: the ranks passed different unique ids or ranks (a real NCCL hangs)")
        seen: dict[str, int] = {}
        for _, r, w in every:
            if w in seen:
                raise NcclError(
                    f"ncclInvalidUsage: Duplicate GPU detected : rank {seen[w]} and rank {r} both on CUDA device {w}"
                )
            seen[w] = r

    # -- queries
    def device_id(self) -> int:
        return self._device

    def rank_id(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._ndev

    def check_async_error(self) -> None:
        pass

    def destroy(self) -> None:
        if self._mpi is not None:
            self._mpi.Free()
            self._mpi = None

    abort = destroy

    # -- collectives
    def _buffer(self, ptr, count: int, datatype, who: str) -> np.ndarray:
        """A host view of device range ``ptr`` [count] of ``datatype`` (cusim plays the device)."""
        from . import fake_cupy

        if _int(datatype, "datatype") not in _DTYPES:
            raise NcclError(f"ncclInvalidArgument: {who}: datatype {datatype}")
        dtype = np.dtype(_DTYPES[datatype])
        current = fake_cupy.runtime.getDevice()
        if current != self._device:
            raise NcclError(
                f"{who}: the communicator is on device {self._device}, the calling thread's current device is {current}"
            )
        nbytes = count * dtype.itemsize
        if nbytes:
            fake_cupy._find(_int(ptr, who), nbytes, f"nccl {who}")
        host = fake_cupy.host_address(_int(ptr, who), who)
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(host)).view(dtype) if nbytes else None

    def _deliver(self, recv: np.ndarray | None, values: np.ndarray) -> None:
        """The result lands in stream order: garbage until the next synchronize."""
        from . import fake_cupy

        if recv is None:
            return
        recv.view(np.uint8)[:] = fake_cupy.FILL
        fake_cupy._pending.append(lambda: recv.__setitem__(slice(None), values))

    def _issue(self, who: str, stream, run, ptrs) -> None:
        """The collective ``run`` on ``stream`` (a pointer), in stream order: after the work before it
        (recorded instead while that stream captures: a CUDA graph replays NCCL's kernels)."""
        from . import fake_cupy, streams

        s = streams.by_ptr(_int(stream, "stream"))
        allocs = [a for a in (fake_cupy._maybe_find(_int(p, who)) for p in ptrs) if a is not None]

        def body():
            fake_cupy._flush()  # the work before it on the stream has run
            run()

        streams.enqueue(f"nccl {who}", body, allocs, (*(streams.pointer(p) for p in ptrs),), s)

    def _gathered(self, mine: np.ndarray) -> np.ndarray:
        if self._mpi is None:
            return mine.copy()
        every = np.empty(mine.size * self._ndev, mine.dtype)
        self._mpi.Allgather(mine, every)
        return every

    def _reduced(self, mine: np.ndarray, op) -> np.ndarray:
        if mine.dtype in (np.float16, np.uint16):
            raise NcclError("cusim's NCCL reduces integer, float32 and float64 data only")
        parts = self._gathered(mine).reshape(self._ndev, -1)
        ops = {NCCL_SUM: np.sum, NCCL_PROD: np.prod, NCCL_MAX: np.max, NCCL_MIN: np.min}
        if op == NCCL_AVG:
            return (parts.sum(axis=0) / self._ndev).astype(mine.dtype)
        if op not in ops:
            raise NcclError(f"ncclInvalidArgument: reduction op {op}")
        return ops[op](parts, axis=0).astype(mine.dtype)

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):  # noqa: N802 - CuPy's names
        count = _int(count, "count")

        def run():
            mine = self._buffer(sendbuf, count, datatype, "allGather sendbuf")
            recv = self._buffer(recvbuf, count * self._ndev, datatype, "allGather recvbuf")
            self._deliver(recv, self._gathered(mine.copy()) if count else None)

        self._issue("allGather", stream, run, (sendbuf, recvbuf))

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):  # noqa: N802
        count = _int(count, "count")

        def run():
            mine = self._buffer(sendbuf, count, datatype, "allReduce sendbuf")
            recv = self._buffer(recvbuf, count, datatype, "allReduce recvbuf")
            self._deliver(recv, self._reduced(mine.copy(), _int(op, "op")) if count else None)

        self._issue("allReduce", stream, run, (sendbuf, recvbuf))

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):  # noqa: N802
        count = _int(recvcount, "recvcount")

        def run():
            mine = self._buffer(sendbuf, count * self._ndev, datatype, "reduceScatter sendbuf")
            recv = self._buffer(recvbuf, count, datatype, "reduceScatter recvbuf")
            if count:
                part = self._reduced(mine.copy(), _int(op, "op"))[self._rank * count : (self._rank + 1) * count]
                self._deliver(recv, part)

        self._issue("reduceScatter", stream, run, (sendbuf, recvbuf))

    def broadcast(self, sendbuf, recvbuf, count, datatype, root, stream):
        count, root = _int(count, "count"), _int(root, "root")

        def run():
            send = self._buffer(sendbuf, count, datatype, "broadcast sendbuf") if self._rank == root else None
            recv = self._buffer(recvbuf, count, datatype, "broadcast recvbuf")
            if count:
                data = send.copy() if send is not None else np.empty(count, recv.dtype)
                if self._mpi is not None:
                    self._mpi.Bcast(data, root=root)
                self._deliver(recv, data)

        self._issue("broadcast", stream, run, (sendbuf, recvbuf))

    def bcast(self, buff, count, datatype, root, stream):
        self.broadcast(buff, buff, count, datatype, root, stream)

    # -- point to point (in groups only)
    def send(self, sendbuf, count, datatype, peer, stream):
        self._point("send", sendbuf, count, datatype, peer, stream)

    def recv(self, recvbuf, count, datatype, peer, stream):
        self._point("recv", recvbuf, count, datatype, peer, stream)

    def _point(self, kind: str, ptr, count, datatype, peer, stream) -> None:
        """Queue one send/recv in the open group, its arguments checked as CuPy converts them."""
        ptr, count, stream = _int(ptr, f"{kind} buffer"), _int(count, "count"), _int(stream, "stream")
        datatype, peer = _int(datatype, "datatype"), _int(peer, "peer")
        if datatype not in _DTYPES:
            raise NcclError(f"ncclInvalidArgument: {kind}: datatype {datatype}")
        if not 0 <= peer < self._ndev:
            raise NcclError(f"ncclInvalidArgument: {kind}: peer {peer} of {self._ndev} ranks")
        if _depth[0] == 0:
            raise NcclError(
                f"cusim: {kind} outside groupStart()/groupEnd() (cusim's NCCL runs point-to-point calls "
                "in groups only: two ranks that both send first hang a real NCCL)"
            )
        _group.append((self, kind, ptr, count, datatype, peer, stream))

    def _run_group(self, calls: list[tuple]) -> None:
        """This communicator's (kind, ptr, count, datatype, peer, stream) calls of one group, in
        stream order: the peers' calls checked against these, then the data moved."""
        streams_used = sorted({c[5] for c in calls})
        if len(streams_used) > 1:
            raise NcclError(f"cusim: one group's send/recv on {len(streams_used)} streams; cusim's NCCL takes one")

        def run():
            posted = {}  # peer -> [(kind, count, datatype)] in call order
            for kind, _, count, datatype, peer, _ in calls:
                posted.setdefault(peer, []).append((kind, count, datatype))
            theirs = self._swap(posted)
            for peer in posted:
                _matched(self._rank, peer, posted[peer], theirs[peer])
            self._move(calls)

        self._issue("send/recv group", streams_used[0], run, [c[1] for c in calls])

    def _swap(self, posted: dict) -> dict:
        """Each peer's calls toward this rank (a real NCCL's peers match them on the wire)."""
        out = {self._rank: posted[self._rank]} if self._rank in posted else {}
        others = [p for p in posted if p != self._rank]
        if not others:
            return out
        from mpi4py import MPI

        requests = [self._mpi.isend(posted[p], dest=p, tag=P2P_TAG) for p in others]
        out.update({p: self._mpi.recv(source=p, tag=P2P_TAG) for p in others})
        MPI.Request.Waitall(requests)
        return out

    def _move(self, calls: list[tuple]) -> None:
        """The data of matched calls: sent buffers copied now, received ones landing in stream order."""
        from mpi4py import MPI

        requests, landing, nth, own = [], [], {}, {}
        for kind, ptr, count, datatype, peer, _ in calls:
            i = nth[kind, peer] = nth.get((kind, peer), -1) + 1
            if count == 0:  # matched by a count of 0: nothing moves, the pointer is not read
                continue
            buffer = self._buffer(ptr, count, datatype, f"{kind} buffer")
            if peer == self._rank:
                own.setdefault(kind, []).append(buffer)
            elif kind == "send":
                requests.append(self._mpi.Isend(buffer.copy(), dest=peer, tag=P2P_TAG + 1 + i))
            else:
                data = np.empty_like(buffer)
                requests.append(self._mpi.Irecv(data, source=peer, tag=P2P_TAG + 1 + i))
                landing.append((buffer, data))
        landing += [(recv, send.copy()) for send, recv in zip(own.get("send", []), own.get("recv", []))]
        MPI.Request.Waitall(requests)
        for buffer, data in landing:
            self._deliver(buffer, data)


def _matched(rank: int, peer: int, mine: list, theirs: list) -> None:
    """The i-th send of one side toward the other meets the other's i-th recv, same count and datatype."""
    flip = {"send": "recv", "recv": "send"}
    for kind in ("send", "recv"):
        ours = [(n, d) for k, n, d in mine if k == kind]
        other = [(n, d) for k, n, d in theirs if k == flip[kind]]
        for i in range(max(len(ours), len(other))):
            a = ours[i] if i < len(ours) else None
            b = other[i] if i < len(other) else None
            if a != b:
                raise NcclError(
                    f"ncclInvalidUsage: rank {rank}'s {_call_text(kind, i, a)} with rank {peer} meets rank {peer}'s "
                    f"{_call_text(flip[kind], i, b)} with rank {rank} (a real NCCL hangs or corrupts memory)"
                )


def _call_text(kind: str, i: int, call: tuple | None) -> str:
    return f"no {kind} #{i}" if call is None else f"{kind} #{i} of {call[0]} (datatype {call[1]})"
