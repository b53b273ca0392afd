"""GPU work on more than one host thread (skipped without a GPU; on cusim in CI): CUDA's current
device is per thread, and a new thread starts on device 0, so every thread that launches must set
the rank's device first. cusim shows two devices here and refuses a launch on another device's
arrays, as a multi-GPU node would misbehave."""

import threading

import numpy as np
import pytest

from eprt.ops.device import cuda_usable

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_usable(), reason="no usable CUDA device")]


@pytest.fixture
def second_device():
    """The main thread on device 1 (cusim: two devices; a GPU machine needs two)."""
    import cupy

    cusim = getattr(cupy, "__cusim__", False)
    if cusim:
        from cusim import fake_cupy

        fake_cupy.set_device_count(2)
    elif cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs (cusim has them)")
    cupy.cuda.runtime.setDevice(1)
    yield 1
    cupy.cuda.runtime.setDevice(0)
    if cusim:
        fake_cupy.set_device_count(1)


class _Transport:
    any_thread = True


class _Frames:
    """The runner's frame writer as DecodeOverlap.decode calls it: what was sent, for which plan item."""

    def __init__(self):
        self.sent = []

    def send(self, item, command):
        self.sent.append((item, command))

    def send_words(self, item, command, words):
        self.sent.append((item, command))

    def flush(self):
        pass


class _Executor:
    """A decode step's pass through the ops: an RMS norm of the uploaded rows, on the device the
    backend was made on; it records the thread it ran on."""

    def __init__(self, ops, combine):
        from types import SimpleNamespace

        self.ops, self.model = ops, SimpleNamespace(combine=combine)
        self.weight = ops.weight(np.ones(64, np.float32))
        self.ran_on = None

    def decode_inputs(self, slots, tokens):
        return self.ops.activation(np.arange(len(slots) * 64, dtype=np.float32).reshape(len(slots), 64) / 64)

    def decode_forward(self, x):
        self.ran_on = threading.current_thread().name
        return self.ops.to_host(self.ops.rms_norm(x, self.weight, 1e-6))


def test_overlap_runs_a_pass_with_host_combines_on_its_helper_thread_on_the_ranks_device(second_device):
    """--overlap on a GPU whose MoE combines wait on the host (ranks sharing a GPU): the pass runs
    on the helper thread, which computes on the rank's device (device 1 here, not the new thread's 0)."""
    from eprt.comm.device_combine import HostCombine
    from eprt.engine.overlap import DecodeOverlap
    from eprt.ops.cupy_ops import CupyOps

    ops = CupyOps()
    executor = _Executor(ops, HostCombine(_Transport()))
    overlap = DecodeOverlap(executor, _Transport())
    try:
        assert overlap.threaded
        frames = _Frames()
        overlap.decode(frames, "step", (0, 1), (5, 6), [0, 1], lambda rows: "plan", thread=True)
        logits = overlap.logits()
    finally:
        overlap.close()
    assert executor.ran_on.startswith("eprt-forward") and [item for item, _ in frames.sent] == ["step"]
    x = np.arange(128, dtype=np.float32).reshape(2, 64) / 64
    want = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(logits, want, rtol=2e-2, atol=2e-2)


def test_overlap_launches_inline_when_combines_stay_on_the_device(second_device):
    """One rank, or the NCCL combine: the pass returns once launched and runs inline."""
    from eprt.engine.overlap import DecodeOverlap
    from eprt.ops.cupy_ops import CupyOps

    executor = _Executor(CupyOps(), lambda partial: partial)
    overlap = DecodeOverlap(executor, _Transport())
    assert overlap.launched and not overlap.threaded
    frames = _Frames()
    overlap.decode(frames, "step", (0,), (5,), [0], lambda rows: "plan", thread=True)
    overlap.logits()
    assert executor.ran_on == threading.current_thread().name and [item for item, _ in frames.sent] == ["step"]


def test_a_thread_that_never_set_the_device_cannot_launch_on_the_ranks_arrays(second_device):
    """What the helper thread would do without ``Ops.bind_thread``: on cusim a launch error naming
    the devices (on a multi-GPU node the launch would run on GPU 0 against GPU 1's memory)."""
    import cupy

    from eprt.ops.cupy_ops import CupyOps

    ops = CupyOps()
    x, w = ops.activation(np.ones((2, 64), np.float32)), ops.weight(np.ones(64, np.float32))
    errors = []

    def launch(bind):
        try:
            if bind:
                ops.bind_thread()
            ops.to_host(ops.rms_norm(x, w, 1e-6))
        except Exception as e:  # noqa: BLE001 - reported to the test
            errors.append(e)

    for bind in (False, True):
        t = threading.Thread(target=launch, args=(bind,))
        t.start()
        t.join()
    if not getattr(cupy, "__cusim__", False):
        pytest.skip("only cusim names the mismatch; a GPU may run it through peer access")
    assert len(errors) == 1 and "current device is 0" in str(errors[0]), errors
