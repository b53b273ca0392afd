"""cusim's streams, stream capture and CUDA graphs, as CuPy 14 exposes them, and the step counters.

- ``Stream(null=False, non_blocking=False)``: each has its own non-zero ``ptr``; ``Stream.null`` is
  the legacy default stream (ptr 0). ``use()`` / ``with stream:`` make it the calling thread's current
  stream (``get_current_stream()``; the legacy one until then), as in CuPy.
- ``stream.begin_capture()`` ... ``stream.end_capture()`` -> ``Graph``; ``graph.launch(stream)``
  replays; ``runtime.streamIsCapturing(ptr)``. While a stream captures, the work issued on it (kernel
  launches, cuBLAS, CuPy's array operations, device-to-device copies, NCCL collectives) is recorded,
  not run. It is refused, naming the call (``CaptureError``): a host synchronisation (a stream,
  device or event synchronize, ``.get()``, ``asnumpy``, ``item()``, ``int()`` / ``float()`` /
  ``bool()`` of a device array), a device-to-host or host-to-device copy (the host bytes would be
  read at each replay: stale), an allocation not made through a ``MemoryPool`` of its own (the
  graph's pool, ``using_allocator(pool.malloc)``: the default pool would hand the graph's
  buffers to later work), and any work issued on the legacy default stream meanwhile.
- ``graph.launch()`` re-executes the recorded work on the buffers' current contents (the graph
  keeps every allocation it touches alive). ``graph.check_replay(fresh)``: a capture of the same
  step made now (``fresh``, never launched) must issue the same work with the same Python scalar
  arguments and the same persistent buffers; a difference is what a GPU would silently replay
  stale, and is refused naming the launch and argument.
- ``counters()`` / ``reset_counters()``: kernel launches issued by the host, graph launches,
  host-to-device and device-to-host copies, host synchronisations.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from dataclasses import dataclass, field


class CaptureError(RuntimeError):
    """Work a stream capture cannot take (cudaErrorStreamCaptureUnsupported and friends)."""


DEVICE_OFFSET = 1 << 47  # fake_cupy.DEVICE_OFFSET: device pointers are host addresses plus this
COUNTERS = ("launches", "graph_launches", "h2d_copies", "d2h_copies", "host_syncs")
_counts = dict.fromkeys(COUNTERS, 0)
_local = threading.local()  # the current stream and allocator, per host thread (as in CuPy)
_ptrs = itertools.count(0x5000)
_streams: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # ptr -> Stream
flush = None  # fake_cupy._flush: run the queued copies (set by fake_cupy)
default_pool = None  # fake_cupy's default memory pool (set by fake_cupy)
_dry = [False]  # count_only(): work is counted (and captured), never run


def count_only(on: bool = True) -> None:
    """Count (and capture) the work issued without running any of it: launch counts of models too
    large for the simulator to execute (benchmarks/bench_gpu.py --count); outputs hold garbage."""
    _dry[0] = on


def counters() -> dict:
    """What the host issued since ``reset_counters()``: kernel launches (kernels, cuBLAS calls,
    CuPy array operations, NCCL collectives; not those a graph replays), graph launches,
    host-to-device and device-to-host copies, host synchronisations."""
    return dict(_counts)


def reset_counters() -> None:
    for k in _counts:
        _counts[k] = 0


def count(name: str, n: int = 1) -> None:
    if not getattr(_local, "replaying", False):
        _counts[name] += n


@dataclass
class _Capture:
    stream: Stream
    ops: list = field(default_factory=list)  # (signature, run)
    allocations: list = field(default_factory=list)  # made during the capture (through the graph's pool)
    kept: dict = field(default_factory=dict)  # id -> every allocation the recorded work touches


_capture: _Capture | None = None  # one capturing stream at a time (a process plays one device)


class Stream:
    """cupy.cuda.Stream."""

    null: Stream  # the legacy default stream, set below

    def __init__(self, null=False, non_blocking=False, ptr=0):
        self.ptr = 0 if null else (ptr or next(_ptrs))
        self.non_blocking = non_blocking
        self._previous = []
        _streams[self.ptr] = self

    def use(self):
        _local.stream = self
        return self

    def __enter__(self):
        self._previous.append(current_stream())
        return self.use()

    def __exit__(self, *exc):
        self._previous.pop().use()

    def synchronize(self):
        refuse_sync(f"Stream.synchronize() of stream {self.ptr:#x}")
        flush()

    @property
    def done(self):
        refuse_sync("Stream.done (a query of a stream)")
        flush()
        return True

    def record(self, event=None):
        from . import fake_cupy

        event = event or fake_cupy.Event()
        event.record(self)
        return event

    def wait_event(self, event):
        pass

    def is_capturing(self) -> bool:
        return _capture is not None and _capture.stream is self

    def begin_capture(self, mode=None):
        global _capture
        if self.ptr == 0:
            raise CaptureError("begin_capture on the legacy default stream (cudaErrorStreamCaptureUnsupported)")
        if _capture is not None:
            raise CaptureError(f"begin_capture: stream {_capture.stream.ptr:#x} is already capturing")
        flush()
        _capture = _Capture(self)

    def end_capture(self) -> Graph:
        global _capture
        if _capture is None or _capture.stream is not self:
            raise CaptureError(f"end_capture: stream {self.ptr:#x} is not capturing")
        cap, _capture = _capture, None
        return Graph(cap)


Stream.null = Stream(null=True)


def by_ptr(ptr) -> Stream:
    """The stream of a raw pointer a library call was given (NCCL, cuBLAS's handle)."""
    stream = _streams.get(int(ptr))
    if stream is None:
        raise CaptureError(f"stream pointer {int(ptr):#x} is no stream cusim made")
    return stream


def current_stream() -> Stream:
    return getattr(_local, "stream", Stream.null)


def stream_is_capturing(ptr) -> int:
    """runtime.streamIsCapturing: cudaStreamCaptureStatusActive (1) or None (0)."""
    return int(_capture is not None and _capture.stream.ptr == int(ptr))


def refuse_sync(what: str) -> None:
    """A host synchronisation: refused while a stream captures; counted."""
    if _capture is not None:
        raise CaptureError(
            f"{what} while stream {_capture.stream.ptr:#x} is capturing: a host synchronisation "
            f"inside a CUDA graph capture (cudaErrorStreamCaptureUnsupported)"
        )
    count("host_syncs")


def refuse_copy(what: str, kind: str) -> None:
    """A host<->device copy: refused while a stream captures; counted (kind: h2d or d2h)."""
    if _capture is not None:
        raise CaptureError(
            f"{what} while stream {_capture.stream.ptr:#x} is capturing: a "
            f"{'host-to-device' if kind == 'h2d' else 'device-to-host'} copy inside a CUDA graph capture "
            f"(its host bytes would be those of the capture at every replay)"
        )
    count(f"{kind}_copies")


def check_allocation(nbytes: int) -> None:
    """A new allocation: while capturing, only through a MemoryPool of the graph's own."""
    allocator = getattr(_local, "allocator", None)
    if _capture is not None and getattr(allocator, "__self__", default_pool) is default_pool:
        raise CaptureError(
            f"an allocation of {nbytes} bytes from the default memory pool while stream {_capture.stream.ptr:#x} "
            f"is capturing: a graph's buffers must come from its own pool (cupy.cuda.using_allocator(pool.malloc)), "
            f"or later work would be handed memory the graph writes at each replay"
        )


def allocated(alloc) -> None:
    if _capture is not None:
        _capture.allocations.append(alloc)


def enqueue(who: str, run, allocations=(), signature=(), stream: Stream | None = None) -> None:
    """Work on ``stream`` (default: the current one): run now, or recorded while that stream
    captures. ``signature``: the Python values it was issued with (scalars, shapes, pointers),
    compared by ``Graph.check_replay``. Counts one launch when issued, none when captured."""
    stream = current_stream() if stream is None else stream
    if _capture is not None and stream is not _capture.stream:
        if stream.ptr == 0:
            raise CaptureError(
                f"{who} on the legacy default stream while stream {_capture.stream.ptr:#x} is capturing "
                f"(cudaErrorStreamCaptureImplicit)"
            )
    if _capture is not None and stream is _capture.stream:  # recorded: issued by the graph's launches
        for a in allocations:
            _capture.kept[id(a)] = a
        _capture.ops.append(((who, *[_identity(v) for v in signature]), run))
        return
    count("launches")
    if not _dry[0]:
        run()


def _identity(v):
    """A pointer to memory allocated during the capture is compared by its place in the capture's
    allocations (a fresh capture allocates anew); everything else by value."""
    if isinstance(v, tuple):
        return tuple(_identity(x) for x in v)
    if isinstance(v, _Pointer) and _capture is not None:
        for i, a in enumerate(_capture.allocations):
            if a.contains(v.host, 1):
                return ("captured buffer", i, v.host - a.ptr)
        return ("buffer", v.host)
    return v


@dataclass(frozen=True)
class _Pointer:
    host: int


def pointer(address: int) -> _Pointer:
    """A buffer argument, by its host address (a device pointer is mapped to it)."""
    address = int(address)
    return _Pointer(address - DEVICE_OFFSET if address >= DEVICE_OFFSET else address)


class Graph:
    """cupy.cuda.Graph: the work a capture recorded."""

    def __init__(self, cap: _Capture):
        self._ops = cap.ops
        self._kept = list(cap.kept.values()) + cap.allocations
        self.nbytes = sum(a.nbytes for a in cap.allocations)  # what the capture allocated (its pool's share)

    def __len__(self) -> int:
        return len(self._ops)

    def upload(self, stream=None):
        pass

    def launch(self, stream=None):
        stream = current_stream() if stream is None else stream
        if _capture is not None:
            raise CaptureError("Graph.launch while a stream is capturing")
        count("graph_launches")
        flush()
        _local.replaying = True
        try:
            for _, run in [] if _dry[0] else self._ops:
                run()
        finally:
            _local.replaying = False

    def check_replay(self, fresh: Graph) -> None:
        """Refuse a replay whose step, captured now (``fresh``), issues other work: another kernel,
        launch shape, Python scalar argument or persistent buffer than this graph recorded."""
        if len(fresh._ops) != len(self._ops):
            raise CaptureError(
                f"replay: the step now issues {len(fresh._ops)} launches, the graph recorded {len(self._ops)}"
            )
        for n, ((then, _), (now, _)) in enumerate(zip(self._ops, fresh._ops)):
            if then != now:
                where = next(i for i, (a, b) in enumerate(zip(then, now)) if a != b) if len(then) == len(now) else None
                detail = f"value {where}: captured {then[where]!r}, now {now[where]!r}" if where else f"{then} vs {now}"
                raise CaptureError(
                    f"replay: launch {n} ({then[0]}) differs from its capture, {detail}; the graph would "
                    f"replay the captured value (a Python scalar or buffer fixed at capture)"
                )


@contextlib.contextmanager
def using_allocator(allocator=None):
    """cupy.cuda.using_allocator: allocations on this thread through ``allocator`` (a MemoryPool's malloc)."""
    previous = getattr(_local, "allocator", None)
    _local.allocator = allocator
    try:
        yield
    finally:
        _local.allocator = previous


def capturing_current() -> bool:
    """Whether the calling thread's current stream is capturing."""
    return _capture is not None and _capture.stream is current_stream()
