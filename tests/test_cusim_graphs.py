"""cusim's streams, stream capture and CUDA graph replay (tests/cusim/streams.py): what a capture
records, what it refuses (naming the call), what a replay computes and what it refuses, and the
step counters the GPU bench reads."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from cusim import fake_cupy  # noqa: E402
from cusim.streams import CaptureError, Stream, counters, reset_counters, using_allocator  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="cusim needs g++")

SCALE = r"""
extern "C" __global__ void scale(const float* x, float* out, float s, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] * s;
}
"""


@pytest.fixture(scope="module")
def kernel():
    return fake_cupy.RawModule(SCALE).get_function("scale")


@pytest.fixture
def stream():
    s = Stream(non_blocking=True)
    with s:
        yield s


def scaled(kernel, x, out, s=2.0):
    kernel((1,), (32,), (x, out, np.float32(s), np.int32(x.size)))


def capture(stream, fn):
    """fn() captured on ``stream`` with a graph pool of its own; returns the graph."""
    pool = fake_cupy.cuda_pool = fake_cupy._MemoryPool()
    with using_allocator(pool.malloc):
        stream.begin_capture()
        try:
            fn()
        finally:
            graph = stream.end_capture()
    return graph


def test_replay_runs_the_recorded_launches_on_the_current_contents(kernel, stream):
    x = fake_cupy.asarray(np.arange(8, dtype=np.float32))
    out = fake_cupy.zeros(8, dtype=np.float32)
    stream.synchronize()
    graph = capture(stream, lambda: scaled(kernel, x, out))
    assert len(graph) == 1
    assert (out.get() == 0).all(), "a capture records its work and runs none of it"
    graph.launch(stream)
    np.testing.assert_array_equal(out.get(), np.arange(8) * 2)
    x[...] = 10.0  # new contents of the same buffer: the replay reads them
    graph.launch(stream)
    np.testing.assert_array_equal(out.get(), np.full(8, 20.0))


def test_array_operations_are_recorded_and_replayed(stream):
    x = fake_cupy.asarray(np.arange(4, dtype=np.float32))
    holder = {}

    def step():
        holder["y"] = fake_cupy.concatenate([x, x * 3])

    graph = capture(stream, step)
    graph.launch(stream)
    np.testing.assert_array_equal(holder["y"].get(), [0, 1, 2, 3, 0, 3, 6, 9])
    x.fill(1.0)
    graph.launch(stream)
    np.testing.assert_array_equal(holder["y"].get(), [1, 1, 1, 1, 3, 3, 3, 3])


@pytest.mark.parametrize(
    "planted, named",
    [
        (lambda s, x: s.synchronize(), "Stream.synchronize()"),
        (lambda s, x: x.get(), "ndarray.get()"),
        (lambda s, x: fake_cupy.asnumpy(x), "ndarray.get()"),
        (lambda s, x: int(x[0]), "int() of a device array"),
        (lambda s, x: bool(x[0] > 0), "bool() of a device array"),
        (lambda s, x: x[0].item(), "ndarray.item()"),
        (lambda s, x: fake_cupy.Device().synchronize(), "Device.synchronize()"),
        (lambda s, x: fake_cupy.asarray(np.ones(2, np.float32)), "cupy.asarray of host data"),
    ],
)
def test_a_planted_host_sync_or_copy_inside_the_capture_is_refused(kernel, stream, planted, named):
    x = fake_cupy.asarray(np.arange(8, dtype=np.float32))
    out = fake_cupy.empty(8, dtype=np.float32)

    def step():
        scaled(kernel, x, out)
        planted(stream, out)

    with pytest.raises(CaptureError, match=named.replace("(", r"\(").replace(")", r"\)")):
        capture(stream, step)
    assert not fake_cupy.runtime.streamIsCapturing(stream.ptr)


def test_allocations_outside_the_graph_pool_and_legacy_stream_work_are_refused(kernel, stream):
    x = fake_cupy.asarray(np.arange(8, dtype=np.float32))
    stream.begin_capture()
    try:
        assert fake_cupy.runtime.streamIsCapturing(stream.ptr) == 1
        with pytest.raises(CaptureError, match="default memory pool"):
            fake_cupy.empty(8, dtype=np.float32)
        with using_allocator(fake_cupy._MemoryPool().malloc):
            out = fake_cupy.empty(8, dtype=np.float32)
        with Stream.null, pytest.raises(CaptureError, match="scale on the legacy default stream"):
            scaled(kernel, x, out)
    finally:
        stream.end_capture()
    with pytest.raises(CaptureError, match="legacy default stream"):
        Stream.null.begin_capture()


def test_a_replay_whose_scalar_or_buffer_differs_from_the_capture_is_refused(kernel, stream):
    x = fake_cupy.asarray(np.arange(8, dtype=np.float32))
    out = fake_cupy.empty(8, dtype=np.float32)
    graph = capture(stream, lambda: scaled(kernel, x, out, 2.0))
    graph.check_replay(capture(stream, lambda: scaled(kernel, x, out, 2.0)))  # the same step: fine
    with pytest.raises(CaptureError, match=r"launch 0 \(scale\).*captured \('<f4', 2.0\), now \('<f4', 3.0\)"):
        graph.check_replay(capture(stream, lambda: scaled(kernel, x, out, 3.0)))
    other = fake_cupy.asarray(np.arange(8, dtype=np.float32))  # a new input buffer: the graph reads the old one
    with pytest.raises(CaptureError, match=r"launch 0 \(scale\)"):
        graph.check_replay(capture(stream, lambda: scaled(kernel, other, out, 2.0)))


def test_counters_count_what_the_host_issues(kernel, stream):
    x = fake_cupy.asarray(np.arange(8, dtype=np.float32))
    out = fake_cupy.empty(8, dtype=np.float32)
    graph = capture(stream, lambda: [scaled(kernel, x, out), scaled(kernel, out, out)])
    reset_counters()
    scaled(kernel, x, out)
    fake_cupy.asarray(np.ones(3, np.float32))
    graph.launch(stream)
    out.get()
    assert counters() == dict(launches=1, graph_launches=1, h2d_copies=1, d2h_copies=1, host_syncs=1)
