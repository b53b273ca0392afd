"""cusim, the CPU simulator the GPU tests run on in CI (tests/cusim): it must reproduce the
CUDA semantics the kernels rely on and report the mistakes a GPU would punish.

Small kernels here exercise each rule; the mutation tests at the end edit real kernels
(dropping one barrier, mixing up a tensor-core fragment) and check the GPU tests, run on cusim, then fail.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from cusim import fake_cupy  # noqa: E402
from cusim.build import LaunchError  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="cusim needs g++")
ROOT = Path(__file__).resolve().parents[1]

HEADER = """
#include <cuda_bf16.h>
#define FULL 0xffffffffu
"""


def module(body: str):
    return fake_cupy.RawModule(HEADER + body)


def dev(a):
    return fake_cupy.asarray(np.asarray(a))


def test_block_barrier_and_warp_shuffles():
    m = module(r"""
extern "C" __global__ void reverse_and_sum(const float* x, float* out, float* total) {
    __shared__ float buf[256];
    const int t = threadIdx.x;
    buf[t] = x[blockIdx.x * blockDim.x + t];
    __syncthreads();
    out[blockIdx.x * blockDim.x + t] = buf[blockDim.x - 1 - t];
    float v = buf[t];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    if (t % 32 == 0) atomicAdd(total + blockIdx.x, v);
}""")
    x = np.arange(512, dtype=np.float32)
    out, total = fake_cupy.empty(512, np.float32), fake_cupy.zeros(2, np.float32)
    m.get_function("reverse_and_sum")((2,), (256,), (dev(x), out, total))
    np.testing.assert_array_equal(out.get(), np.concatenate([x[255::-1], x[:255:-1]]))
    np.testing.assert_array_equal(total.get(), [x[:256].sum(), x[256:].sum()])


def test_a_race_gives_launch_dependent_results():
    # thread t reads its neighbour's write without a barrier: on a GPU the result depends
    # on timing; cusim shuffles the run order per launch so the answer changes too
    m = module(r"""
extern "C" __global__ void racy(float* out) {
    __shared__ float buf[128];
    buf[threadIdx.x] = threadIdx.x;
    out[threadIdx.x] = buf[(threadIdx.x + 1) % 128];
}""")
    results = set()
    for _ in range(4):
        out = fake_cupy.empty(128, np.float32)
        m.get_function("racy")((1,), (128,), (out,))
        results.add(out.get().tobytes())
    assert len(results) > 1


def test_a_race_between_warps_is_exposed():
    # common.cuh's block_sum without its trailing barrier, called twice: a fast warp can
    # overwrite the scratch slot of the second sum before a slow warp read the first
    m = module(r"""
__device__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}
__device__ float racy_block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_sum(lane < blockDim.x / 32 ? scratch[lane] : 0.0f);   // no barrier after reading
}
extern "C" __global__ void two_sums(float* out) {
    __shared__ float scratch[32];
    const float a = racy_block_sum(1.0f, scratch);
    const float b = racy_block_sum(2.0f, scratch);
    out[threadIdx.x] = a + b;   // 128 + 256 when nothing raced
}""")
    wrong = 0
    for _ in range(20):
        out = fake_cupy.empty(128, np.float32)
        m.get_function("two_sums")((1,), (128,), (out,))
        wrong += int((out.get() != 384).any())
    assert wrong > 0


def test_shuffles_follow_cudas_lane_rules():
    m = module(r"""
extern "C" __global__ void lanes(int* out) {
    const int lane = threadIdx.x;
    out[lane] = __shfl_sync(FULL, lane, lane + 33);                  // srcLane modulo 32
    out[32 + lane] = __shfl_xor_sync(FULL, lane, 16, 16);            // earlier group ok, later: own
    out[64 + lane] = __shfl_up_sync(FULL, lane, 3, 8);               // below the segment: own
    out[96 + lane] = __shfl_down_sync(FULL, lane, 3, 8);             // past the segment: own
    out[128 + lane] = (int)max(1.0f, __int_as_float(0x7fc00000));    // fmaxf: NaN ignored
}""")
    out = fake_cupy.zeros(160, np.int32)
    m.get_function("lanes")((1,), (32,), (out,))
    lane = np.arange(32)
    got = out.get().reshape(5, 32)
    np.testing.assert_array_equal(got[0], (lane + 1) % 32)
    np.testing.assert_array_equal(got[1], np.where(lane ^ 16 < (lane & ~15) + 16, lane ^ 16, lane))
    np.testing.assert_array_equal(got[2], np.where(lane % 8 >= 3, lane - 3, lane))
    np.testing.assert_array_equal(got[3], np.where(lane % 8 < 5, lane + 3, lane))
    np.testing.assert_array_equal(got[4], 1)


def test_shared_memory_per_template_instance_and_limits():
    m = module(r"""
template <typename T, int N>
__device__ T fill_and_sum() {
    __shared__ T buf[N];
    for (int i = threadIdx.x; i < N; i += blockDim.x) buf[i] = (T)1;
    __syncthreads();
    T s = 0;
    for (int i = 0; i < N; ++i) s += buf[i];
    __syncthreads();
    return s;
}
extern "C" __global__ void two_sizes(double* out) {
    out[threadIdx.x] = fill_and_sum<float, 4>() + fill_and_sum<double, 4096>();
}
extern "C" __global__ void __launch_bounds__(64) big_static(float* out) {
    __shared__ float s[10240];   // 40 KiB
    extern __shared__ float d[];
    s[threadIdx.x] = d[0] = 1.0f;
    out[threadIdx.x] = s[threadIdx.x];
}""")
    out = fake_cupy.zeros(32, np.float64)
    m.get_function("two_sizes")((1,), (32,), (out,))
    np.testing.assert_array_equal(out.get(), 4100)
    k, buf = m.get_function("big_static"), fake_cupy.zeros(64, np.float32)
    k((1,), (64,), (buf,), shared_mem=4096)  # 40 + 4 KiB: fits the default 48
    with pytest.raises(LaunchError, match="40960 bytes of static and 16384 of dynamic"):
        k((1,), (64,), (buf,), shared_mem=16384)  # 56 KiB: needs the opt-in
    k.max_dynamic_shared_size_bytes = 16384
    k((1,), (64,), (buf,), shared_mem=16384)
    with pytest.raises(LaunchError, match=r"128 threads exceed its __launch_bounds__\(64\)"):
        k((1,), (128,), (fake_cupy.zeros(128, np.float32),), shared_mem=4096)


def test_async_copies_land_at_synchronize():
    # eprt/comm/cuda_staging.py synchronizes before MPI reads a staged buffer; without it the
    # host buffer still holds garbage here, as it may on a GPU
    src = fake_cupy.arange(4, dtype=np.float32)
    host = np.zeros(4, np.float32)
    rt = fake_cupy.runtime
    rt.memcpyAsync(host.ctypes.data, src.data.ptr, 16, rt.memcpyDeviceToHost, 0)
    assert np.isnan(host).all()
    fake_cupy.streams.Stream().synchronize()
    np.testing.assert_array_equal(host, [0, 1, 2, 3])


def test_host_code_reading_a_device_pointer_faults_as_on_a_gpu():
    # the MpiNccl stand-in once did this (ctypes over a.data.ptr): a segfault on a real device
    code = (
        "import ctypes, numpy as np; from cusim import fake_cupy as cp; a = cp.arange(4, dtype=np.float32); "
        "print(ctypes.c_float.from_address(a.data.ptr).value)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -11, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    with pytest.raises(LaunchError, match="a host address, not a device pointer"):
        fake_cupy._find(np.zeros(4).ctypes.data, 16, "test")


def test_freed_memory_stays_in_the_pool_until_free_all_blocks():
    # CuPy's pool keeps freed blocks: the device's free memory does not come back (the first
    # fp8 byte test measured 0 B on the H200 this way), and the pool's used bytes are the measure
    import gc

    pool, rt = fake_cupy.get_default_memory_pool(), fake_cupy.runtime
    gc.collect()
    pool.free_all_blocks()
    free0, used0 = rt.memGetInfo()[0], pool.used_bytes()
    a = fake_cupy.empty(1 << 20, np.uint8)
    assert rt.memGetInfo()[0] == free0 - (1 << 20) and pool.used_bytes() == used0 + (1 << 20)
    del a
    gc.collect()
    assert rt.memGetInfo()[0] == free0 - (1 << 20)  # kept by the pool
    assert pool.used_bytes() == used0 and pool.free_bytes() >= 1 << 20 and pool.total_bytes() >= used0 + (1 << 20)
    b = fake_cupy.empty(1000, np.uint8)  # reuses a kept block: the device sees nothing new
    assert rt.memGetInfo()[0] == free0 - (1 << 20) and pool.used_bytes() == used0 + 1024
    del b
    gc.collect()
    pool.free_all_blocks()
    assert rt.memGetInfo()[0] == free0 and pool.free_bytes() == 0


def test_kv_pool_blocks_counts_the_pools_kept_blocks_as_free():
    import gc

    from eprt.ops import device

    saved = {k: v for k, v in sys.modules.items() if k == "cupy" or k.startswith(("cupy.", "cupy_backends"))}
    fake_cupy.install()  # kv_pool_blocks imports cupy
    pool, rt = fake_cupy.get_default_memory_pool(), fake_cupy.runtime
    try:
        gc.collect()
        pool.free_all_blocks()
        before = device.kv_pool_blocks(1 << 20, 0.5)
        a = fake_cupy.empty(64 << 20, np.uint8)
        assert device.kv_pool_blocks(1 << 20, 0.5) == before - 64
        del a
        gc.collect()
        assert rt.memGetInfo()[0] < fake_cupy.MEMORY_TOTAL - (60 << 20)  # the device still sees it taken
        assert device.kv_pool_blocks(1 << 20, 0.5) == before  # but the KV pool may reuse it
    finally:
        pool.free_all_blocks()
        for k in [k for k in sys.modules if k == "cupy" or k.startswith(("cupy.", "cupy_backends"))]:
            del sys.modules[k]
        sys.modules.update(saved)


def test_the_current_device_is_per_thread_and_launches_check_it():
    import threading

    m = module(r"""
extern "C" __global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }""")
    k = m.get_function("twice")
    fake_cupy.set_device_count(2)
    try:
        fake_cupy.runtime.setDevice(1)
        x = fake_cupy.ones(32, np.float32)
        seen = {}

        def other(bind):
            seen["device"] = fake_cupy.runtime.getDevice()
            try:
                if bind:
                    fake_cupy.Device(1).use()
                k((1,), (32,), (x,))
                seen[bind] = "ran"
            except LaunchError as e:
                seen[bind] = str(e)

        for bind in (False, True):
            t = threading.Thread(target=other, args=(bind,), name=f"helper-{bind}")
            t.start()
            t.join()
        assert "allocation of device 1 used from thread 'helper-False', whose current device is 0" in seen[False]
        assert seen[True] == "ran" and fake_cupy.runtime.getDevice() == 1
        np.testing.assert_array_equal(x.get(), 2.0)
        with pytest.raises(RuntimeError, match="cudaErrorInvalidDevice"):
            fake_cupy.runtime.setDevice(2)
    finally:
        fake_cupy.runtime.setDevice(0)
        fake_cupy.set_device_count(1)


def test_nccl_stand_in_has_cupy_14s_signatures():
    from cusim import fake_nccl as nccl

    uid = nccl.get_unique_id()
    assert type(uid) is bytes and len(uid) == 128
    with pytest.raises(TypeError, match=r"Argument 'commId' has incorrect type \(expected bytes, got tuple\)"):
        nccl.NcclCommunicator(1, tuple(b - 256 if b > 127 else b for b in uid), 0)
    comm = nccl.NcclCommunicator(1, uid, 0)
    with pytest.raises(nccl.NcclError, match="already made a communicator"):  # hung the H200's probe
        nccl.NcclCommunicator(1, bytes.fromhex(uid.hex()), 0)
    a, b = fake_cupy.arange(8, dtype=np.float32), fake_cupy.empty(8, np.float32)
    with pytest.raises(TypeError, match="an integer is required"):
        comm.allGather(a, b, 8, nccl.NCCL_FLOAT32, 0)
    host = np.zeros(8, np.float32)
    comm.allGather(a.data.ptr, b.data.ptr, 8, nccl.NCCL_FLOAT32, 0)
    rt = fake_cupy.runtime
    ctypes_free = b.get()  # get() synchronizes: the result has landed
    np.testing.assert_array_equal(ctypes_free, np.arange(8))
    rt.memcpyAsync(host.ctypes.data, b.data.ptr, 32, rt.memcpyDeviceToHost, 0)
    rt.streamSynchronize(0)
    np.testing.assert_array_equal(host, np.arange(8))
    with pytest.raises(LaunchError, match="not inside one device allocation"):
        comm.allGather(a.data.ptr, b.data.ptr, 9, nccl.NCCL_FLOAT32, 0)


def test_uninitialized_shared_memory_reads_nan():
    m = module(r"""
extern "C" __global__ void forgot(float* out) {
    extern __shared__ float s[];
    __shared__ float t[32];
    out[threadIdx.x] = s[threadIdx.x] + t[threadIdx.x];
}""")
    out = fake_cupy.zeros(32, np.float32)
    m.get_function("forgot")((1,), (32,), (out,), shared_mem=128)
    assert np.isnan(out.get()).all()


@pytest.mark.parametrize(
    "body,message",
    [
        (
            r"if (threadIdx.x % 32 < 16) __syncthreads(); else { float v = __shfl_xor_sync(FULL, 1.0f, 1); (void)v; }",
            "deadlock",
        ),
        (r"if (threadIdx.x == 3) return; float v = __shfl_xor_sync(FULL, 1.0f, 1); (void)v;", "has exited"),
        (
            r"if (threadIdx.x % 2) __syncwarp(); else { float v = __shfl_xor_sync(FULL, 1.0f, 1); (void)v; }",
            "different warp collectives",
        ),
        (r"float v = __shfl_xor_sync(FULL, 1.0f, 1); (void)v;", "beyond the block's threads"),
        (
            r"extern __shared__ float s[]; s[threadIdx.x + 8] = 1.0f;",
            "wrote past the 64 bytes of dynamic shared memory",
        ),
    ],
)
def test_collective_and_shared_memory_misuse_is_reported(body, message):
    m = module('extern "C" __global__ void k(float* out) { ' + body + " }")
    block = {"beyond": 48, "wrote": 32}.get(message.split()[0], 128)  # 48 threads: a partial 2nd warp
    with pytest.raises(LaunchError, match=message):
        m.get_function("k")((1,), (block,), (fake_cupy.zeros(4, np.float32),), shared_mem=64)


def test_faults_in_a_kernel_are_launch_errors_not_crashes():
    m = module(r"""
extern "C" __global__ void far(float* out, long long off) { out[threadIdx.x + off] = 1.0f; }
extern "C" __global__ void div0(int* out, int d) { out[threadIdx.x] = 7 / d; }
__device__ int deep(int n) { volatile char buf[4096]; buf[0] = (char)n; return n ? deep(n - 1) + buf[0] : 0; }
extern "C" __global__ void overflow(int* out) { out[threadIdx.x] = deep(1000); }""")
    ints = fake_cupy.zeros(32, np.int32)
    with pytest.raises(LaunchError, match=r"thread \(\d+,0,0\): invalid memory access \(SIGSEGV"):
        m.get_function("far")((1,), (32,), (fake_cupy.zeros(32, np.float32), np.int64(1 << 40)))
    with pytest.raises(LaunchError, match="SIGFPE"):
        m.get_function("div0")((1,), (32,), (ints, np.int32(0)))
    with pytest.raises(LaunchError, match="stack overflow"):  # into the fiber stack's guard page
        m.get_function("overflow")((1,), (32,), (ints,))
    m.get_function("div0")((1,), (32,), (ints, np.int32(7)))  # and the process carries on
    np.testing.assert_array_equal(ints.get(), 1)


def test_a_spin_wait_ends_in_an_error_not_a_hang():
    # fibers are not preempted, so a thread spinning on a flag hangs the launch (here nobody
    # sets it); the CPU-time watchdog, 120 s as compiled by default, is shortened by a define
    m = fake_cupy.RawModule(
        HEADER
        + r"""
extern "C" __global__ void spin(volatile int* flag) { while (flag[0] == 0) {} }
extern "C" __global__ void ok(int* out) { out[threadIdx.x] = 1; }""",
        options=("-DCUSIM_WATCHDOG_SECONDS=2",),
    )
    with pytest.raises(LaunchError, match="2 s of CPU time without finishing"):
        m.get_function("spin")((1,), (32,), (fake_cupy.zeros(1, np.int32),))
    out = fake_cupy.zeros(32, np.int32)
    m.get_function("ok")((1,), (32,), (out,))  # the next launch is unaffected
    np.testing.assert_array_equal(out.get(), 1)


def test_arguments_are_checked_against_the_signature():
    m = module(r"""
extern "C" __global__ void scale(const __nv_bfloat16* x, float* out, int n, float s) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = __bfloat162float(x[i]) * s;
}""")
    k = m.get_function("scale")
    x, out = fake_cupy.zeros(64, np.uint16), fake_cupy.zeros(64, np.float32)
    k((1,), (64,), (x, out, np.int32(64), np.float32(2)))
    with pytest.raises(LaunchError, match=r"argument 2 \(n\) is a int, but a Python int would be passed as int64"):
        k((1,), (64,), (x, out, 64, np.float32(2)))
    with pytest.raises(LaunchError, match=r"argument 3 \(s\) is a float; got a numpy float64"):
        k((1,), (64,), (x, out, np.int32(64), np.float64(2)))
    with pytest.raises(LaunchError, match=r"argument 1 \(out\) points to float, got an array of float16"):
        k((1,), (64,), (x, fake_cupy.zeros(64, np.float16), np.int32(64), np.float32(2)))
    with pytest.raises(LaunchError, match=r"argument 0 \(x\) must be a device array, got numpy.ndarray"):
        k((1,), (64,), (np.zeros(64, np.uint16), out, np.int32(64), np.float32(2)))
    with pytest.raises(LaunchError, match="takes 4 arguments"):
        k((1,), (64,), (x, out))
    with pytest.raises(LaunchError, match="not a valid CUDA block"):
        k((1,), (2048,), (x, out, np.int32(64), np.float32(2)))
    with pytest.raises(LaunchError, match=r"dynamic at most 49152 without raising max_dynamic_shared_size_bytes"):
        k((1,), (64,), (x, out, np.int32(64), np.float32(2)), shared_mem=64 * 1024)


def test_writes_past_an_allocation_are_caught():
    m = module(r"""
extern "C" __global__ void fill(float* out, int n) { out[threadIdx.x] = 1.0f; (void)n; }""")
    with pytest.raises(LaunchError, match="fill wrote past the end of a 124-byte allocation"):
        m.get_function("fill")((1,), (32,), (fake_cupy.zeros(31, np.float32), np.int32(31)))
    m2 = module(r"""
extern "C" __global__ void minus_one(int* out) { out[threadIdx.x] = -1; }""")  # the fill pattern itself
    with pytest.raises(LaunchError, match="past the end"):
        m2.get_function("minus_one")((1,), (32,), (fake_cupy.zeros(31, np.int32),))


def test_device_arrays_are_as_strict_as_cupys():
    a = fake_cupy.arange(6, dtype=np.float32).reshape(2, 3)
    assert a.data.ptr % 256 == 0 and hasattr(a, "__cuda_array_interface__")
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array"):
        np.asarray(a)
    with pytest.raises(TypeError):
        a + np.ones((2, 3), np.float32)
    with pytest.raises(TypeError, match="host numpy array"):
        a[...] = np.ones((2, 3), np.float32)
    assert np.isnan(fake_cupy.empty(4, np.float32).get()).all()  # never-written memory is NaN
    assert fake_cupy.zeros(3).dtype == np.float64  # CuPy's default dtype
    np.testing.assert_array_equal((a * 2 + 1)[1].get(), [7, 9, 11])
    view = a[1]
    view.fill(0)  # views share memory
    np.testing.assert_array_equal(a.get(), [[0, 1, 2], [0, 0, 0]])


@pytest.mark.parametrize("transa,transb", [(1, 0), (0, 0), (0, 1), (1, 1)])
@pytest.mark.parametrize("c_type", [0, 14])
def test_gemmex_follows_cublas_column_major_rules(transa, transb, c_type):
    rng = np.random.default_rng(0)
    m, n, k = 5, 7, 16
    a = rng.standard_normal((m, k)).astype(np.float32)  # op(A), column-major view
    b = rng.standard_normal((k, n)).astype(np.float32)
    c0 = rng.standard_normal((m, n)).astype(np.float32)
    bf = lambda x: ((x.view(np.uint32) + 0x7FFF + ((x.view(np.uint32) >> 16) & 1)) >> 16).astype(np.uint16)  # noqa: E731
    to_f32 = lambda bits: (bits.astype(np.uint32) << 16).view(np.float32)  # noqa: E731
    # column-major storage of A (m x k, or k x m when transposed) is row-major of its transpose
    A = dev(bf(np.ascontiguousarray(a.T if transa == 0 else a)))
    B = dev(bf(np.ascontiguousarray(b.T if transb == 0 else b)))
    C = dev(np.ascontiguousarray(c0.T) if c_type == 0 else bf(np.ascontiguousarray(c0.T)))
    alpha, beta = np.array(2.0, np.float32), np.array(0.5, np.float32)
    fake_cupy.gemmEx(
        0,
        transa,
        transb,
        m,
        n,
        k,
        alpha.ctypes.data,
        A.data.ptr,
        14,
        m if transa == 0 else k,
        B.data.ptr,
        14,
        k if transb == 0 else n,
        beta.ctypes.data,
        C.data.ptr,
        c_type,
        m,
        68,
        -1,
    )
    c_in = c0 if c_type == 0 else to_f32(bf(c0))
    want = 2.0 * to_f32(bf(a)) @ to_f32(bf(b)) + 0.5 * c_in
    got = C.get().T if c_type == 0 else to_f32(C.get()).T
    np.testing.assert_allclose(got, want, rtol=1e-5 if c_type == 0 else 1e-2, atol=1e-5 if c_type == 0 else 3e-2)
    with pytest.raises(LaunchError, match="NOT_SUPPORTED"):
        fake_cupy.gemmEx(
            0,
            0,
            0,
            m,
            n,
            k,
            alpha.ctypes.data,
            A.data.ptr,
            14,
            m,
            B.data.ptr,
            0,
            k,
            beta.ctypes.data,
            C.data.ptr,
            c_type,
            m,
            68,
            -1,
        )
    with pytest.raises(LaunchError, match="leading dimension"):
        fake_cupy.gemmEx(
            0,
            0,
            0,
            m,
            n,
            k,
            alpha.ctypes.data,
            A.data.ptr,
            14,
            1,
            B.data.ptr,
            14,
            k,
            beta.ctypes.data,
            C.data.ptr,
            c_type,
            m,
            68,
            -1,
        )


# ---- tensor cores: inline PTX with the fragment layouts of the PTX ISA ----------------------------
TC_HEADER = '#include "tensor_core.cuh"\n'


def tc_module(body: str):
    return fake_cupy.RawModule(TC_HEADER + body, options=(f"-I{ROOT / 'kernels'}",))


MMA_KERNEL = r"""
// D [16, 8] = A [16, 16] (row-major) x B, B given as Bt [8, 16] ([n][k]), one warp, fragments
// loaded as documented (layout 0), with a1 and a2 swapped (1), or through ldmatrix from shared
// memory (2: A and Bt with ldmatrix, 3: B k-major [16][8] with ldmatrix.trans).
extern "C" __global__ void mma16816(const __nv_bfloat16* A, const __nv_bfloat16* Bt, float* D, int layout) {
    extern __shared__ __nv_bfloat16 s[];   // A | Bt | B, 16-byte rows
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    const u32* a32 = reinterpret_cast<const u32*>(A);
    const u32* b32 = reinterpret_cast<const u32*>(Bt);
    u32 a[4] = {a32[g * 8 + t], a32[(g + 8) * 8 + t], a32[g * 8 + t + 4], a32[(g + 8) * 8 + t + 4]};
    u32 b[2] = {b32[g * 8 + t], b32[g * 8 + t + 4]};
    if (layout == 1) { u32 x = a[1]; a[1] = a[2]; a[2] = x; }
    if (layout >= 2) {
        for (int i = lane; i < 256; i += 32) s[i] = A[i];
        for (int i = lane; i < 128; i += 32) { s[256 + i] = Bt[i]; s[384 + (i % 16) * 8 + i / 16] = Bt[i]; }
        __syncwarp();
        load_a(a, s, 16);
        u32 unused[2];
        if (layout == 2) load_b_nk(b, unused, s + 256, 16);   // rows 8-15 of the 16 read past Bt: ignored
        else load_b_kn(b, unused, s + 384, 8);
    }
    float c[4] = {0.5f, 0.5f, 0.5f, 0.5f};
    mma_bf16(c, a, b);
    D[g * 8 + 2 * t] = c[0]; D[g * 8 + 2 * t + 1] = c[1];
    D[(g + 8) * 8 + 2 * t] = c[2]; D[(g + 8) * 8 + 2 * t + 1] = c[3];
}
"""


@pytest.mark.parametrize("layout", [0, 2, 3])
def test_mma_follows_the_ptx_fragment_layout(layout):
    from eprt.ops.bf16 import bf16_bits_to_f32, f32_to_bf16_bits

    rng = np.random.default_rng(layout)
    a, bt = f32_to_bf16_bits(rng.standard_normal((16, 16))), f32_to_bf16_bits(rng.standard_normal((8, 16)))
    want = bf16_bits_to_f32(a).astype(np.float64) @ bf16_bits_to_f32(bt).astype(np.float64).T + 0.5
    d = fake_cupy.zeros((16, 8), np.float32)
    tc_module(MMA_KERNEL).get_function("mma16816")((1,), (32,), (dev(a), dev(bt), d, np.int32(layout)), shared_mem=2048)
    np.testing.assert_allclose(d.get(), want, rtol=1e-6, atol=1e-5)


def test_a_wrong_fragment_layout_computes_a_wrong_product():
    # the same kernel with two A registers swapped (rows g+8 and columns 2t+8 exchanged): a GPU
    # multiplies a permuted A, and so does cusim; the result must not pass for A x B
    from eprt.ops.bf16 import bf16_bits_to_f32, f32_to_bf16_bits

    rng = np.random.default_rng(0)
    a, bt = f32_to_bf16_bits(rng.standard_normal((16, 16))), f32_to_bf16_bits(rng.standard_normal((8, 16)))
    af, bf = bf16_bits_to_f32(a).astype(np.float64), bf16_bits_to_f32(bt).astype(np.float64)
    d = fake_cupy.zeros((16, 8), np.float32)
    tc_module(MMA_KERNEL).get_function("mma16816")((1,), (32,), (dev(a), dev(bt), d, np.int32(1)), shared_mem=2048)
    got = d.get()
    assert np.abs(got - (af @ bf.T + 0.5)).max() > 0.5
    swapped = af.copy()  # what the swap means: A[g+8][2t..] read for A[g][2t+8..] and back
    swapped[:8, 8:], swapped[8:, :8] = af[8:, :8], af[:8, 8:]
    np.testing.assert_allclose(got, swapped @ bf.T + 0.5, rtol=1e-6, atol=1e-5)


def test_fp8_mma_and_conversions_follow_the_ptx_isa():
    # m16n8k32 e4m3 (sm_89+): A [16, 32] and Bt [8, 32] bytes, fragments of 4 bytes per register
    # (A: rows g, g+8, columns 4t.. and 16+4t..; B: column g, rows 4t.. and 16+4t..); and the
    # hardware conversion e4m3x2 -> f16x2 (asm and intrinsic) against NumPy's decode
    from eprt.model.safetensors_io import fp8_e4m3_to_f32

    m = fake_cupy.RawModule(
        r"""
#include <cuda_fp8.h>
typedef unsigned int u32;
extern "C" __global__ void mma16832(const unsigned char* A, const unsigned char* Bt, float* D) {
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    const u32* a32 = reinterpret_cast<const u32*>(A);
    const u32* b32 = reinterpret_cast<const u32*>(Bt);
    u32 a[4] = {a32[g * 8 + t], a32[(g + 8) * 8 + t], a32[g * 8 + t + 4], a32[(g + 8) * 8 + t + 4]};
    u32 b[2] = {b32[g * 8 + t], b32[g * 8 + t + 4]};
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    D[g * 8 + 2 * t] = c[0]; D[g * 8 + 2 * t + 1] = c[1];
    D[(g + 8) * 8 + 2 * t] = c[2]; D[(g + 8) * 8 + 2 * t + 1] = c[3];
}
extern "C" __global__ void cvt(const unsigned short* x, unsigned int* hw, unsigned int* intrinsic) {
    const int i = threadIdx.x;
    u32 h;
    asm volatile("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h) : "h"(x[i]));
    hw[i] = h;
    const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(x[i], __NV_E4M3);
    intrinsic[i] = r.x | ((u32)r.y << 16);
}"""
    )
    rng = np.random.default_rng(5)
    a, bt = rng.integers(0, 256, (16, 32), dtype=np.uint8), rng.integers(0, 256, (8, 32), dtype=np.uint8)
    a[(a & 0x7F) == 0x7F] = 0x38  # no NaN
    bt[(bt & 0x7F) == 0x7F] = 0x38
    d = fake_cupy.zeros((16, 8), np.float32)
    m.get_function("mma16832")((1,), (32,), (dev(a), dev(bt), d))
    want = fp8_e4m3_to_f32(a).astype(np.float64) @ fp8_e4m3_to_f32(bt).astype(np.float64).T
    np.testing.assert_allclose(d.get(), want, rtol=0, atol=1e-6 * np.abs(want).max())  # fp32 sums of up to 1e5
    pairs = np.arange(0, 65536, 257, dtype=np.uint16)  # both bytes of 255 pairs, NaN included
    hw, intrinsic = fake_cupy.zeros(len(pairs), np.uint32), fake_cupy.zeros(len(pairs), np.uint32)
    m.get_function("cvt")((1,), (len(pairs),), (dev(pairs), hw, intrinsic))
    halves = np.stack([hw.get() & 0xFFFF, hw.get() >> 16], 1).astype(np.uint16).view(np.float16)
    decoded = fp8_e4m3_to_f32(np.stack([pairs & 0xFF, pairs >> 8], 1).astype(np.uint8))
    np.testing.assert_array_equal(halves.astype(np.float32), decoded)  # exact, NaN where NaN
    np.testing.assert_array_equal(intrinsic.get(), hw.get())


def test_mma_needs_the_whole_warp_and_ldmatrix_shared_memory():
    m = tc_module(r"""
extern "C" __global__ void partial(float* out) {
    if (threadIdx.x == 5) return;
    u32 a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
    float c[4] = {0, 0, 0, 0};
    mma_bf16(c, a, b);
    out[threadIdx.x] = c[0];
}
extern "C" __global__ void global_ldsm(const __nv_bfloat16* x, float* out) {
    u32 a[4];
    load_a(a, x, 16);
    out[threadIdx.x] = (float)a[0];
}""")
    out = fake_cupy.zeros(32, np.float32)
    with pytest.raises(LaunchError, match="has exited"):
        m.get_function("partial")((1,), (32,), (out,))
    with pytest.raises(LaunchError, match="not a pointer into the dynamic shared memory"):
        m.get_function("global_ldsm")((1,), (32,), (fake_cupy.zeros(256, np.uint16), out))


def test_cp_async_lands_at_issue_or_at_its_wait():
    m = tc_module(r"""
extern "C" __global__ void staged(const float* x, float* before, float* after) {
    extern __shared__ float s[];
    const int i = threadIdx.x;
    s[4 * i] = -1.0f;
    cp_async16(s + 4 * i, x + 4 * i, i % 2 == 0);   // odd threads: zero fill
    cp_async_commit();
    before[i] = s[4 * i];   // not waited for: still the old value
    cp_async_wait<0>();
    after[i] = s[4 * i];
}""")
    x = np.arange(128, dtype=np.float32) + 1
    landed = np.where(np.arange(32) % 2 == 0, x[::4], 0)
    seen = set()
    for _ in range(8):  # per launch, the copies land when issued or only at the wait: both happen
        before, after = fake_cupy.zeros(32, np.float32), fake_cupy.zeros(32, np.float32)
        m.get_function("staged")((1,), (32,), (dev(x), before, after), shared_mem=512)
        np.testing.assert_array_equal(after.get(), landed)
        assert (before.get() == -1).all() or (before.get() == landed).all()
        seen.add(float(before.get()[0]))
    assert seen == {-1.0, 1.0}


# ---- mutations of the real kernels (a missing barrier, a wrong fragment layout): the GPU tests
# on cusim must notice each ----------------------------------------------------------------------
MUTATIONS = {
    "permute: no barrier between reading and advancing the expert cursor": (
        "moe_permute.cuh",  # (moe_permute.cu's and router.cu's fused route_permute_* share it)
        "__syncwarp();  // all reads of the cursor precede the update",
        "",
        "moe_experts",
    ),
    "router: lanes read the scores before the winner is knocked out": (
        "router.cu",
        "if (lane == 0) p[best_i] = -1.0f;\n        __syncwarp();",
        "if (lane == 0) p[best_i] = -1.0f;",
        "router",
    ),
    "attention: the next chunk overwrites scores still being read": (
        "paged_attention.cu",
        "__syncthreads();  // s_s is overwritten by the next chunk",
        "",
        "attention_decode",
    ),
    "tensor cores: the weight fragments of two n8 tiles mixed up (a wrong fragment layout)": (
        "tensor_core.cuh",
        "b0[0] = r[0], b0[1] = r[1], b1[0] = r[2], b1[1] = r[3];",
        "b0[0] = r[0], b0[1] = r[2], b1[0] = r[1], b1[1] = r[3];",
        "moe_tc_against",
        "test_cupy_tensor_cores.py",
    ),
    "flash attention: a K/V stage refilled while other warps still read it": (
        "flash_attention.cu",
        "__syncthreads();  // done with the stage before it is refilled",
        "",
        "flash_attention_prefill",
        "test_cupy_tensor_cores.py",
    ),
    "flash attention: a window's tiles read keys from blocks the window has left": (
        "flash_attention.cu",
        "return k0 + r >= lo && k0 + r < end",
        "return k0 + r < end",
        "sinks",
        "test_cupy_tensor_cores.py",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MUTATIONS))
def test_gpu_tests_on_cusim_catch_a_mutation(tmp_path, name):
    file, old, new, selection, tests = (*MUTATIONS[name], "test_cupy_ops.py")[:5]
    kernels = tmp_path / "kernels"
    shutil.copytree(ROOT / "kernels", kernels)
    source = (kernels / file).read_text()
    assert source.count(old) == 1, f"the mutation no longer applies to {file}"
    (kernels / file).write_text(source.replace(old, new))
    env = dict(os.environ, EPRT_KERNEL_DIR=str(kernels), PYTHONPATH=str(ROOT / "tests"))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "cusim.plugin",
            "-p",
            "no:cacheprovider",
            "-m",
            "gpu",
            "-k",
            selection,
            str(ROOT / "tests" / tests),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1 and " failed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["auto", "gathered"])
def test_gpu_benchmark_script_runs_on_cusim(impl):
    # benchmarks/gpu_session.sh runs it on a GPU when one is lent; a crash there would waste
    # the device time, so its whole path (weights, KV, decode steps, byte count) runs here
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'tests'}{os.pathsep}{ROOT}")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cusim.run",
            str(ROOT / "benchmarks" / "bench_gpu.py"),
            "--tiny",
            "--context",
            "20",
            "--batches",
            "1,3",
            "--steps",
            "1",
            "--moe-impl",
            impl,
            "--attention-contexts",
            "300",
            "--prefill",
            "24" if impl == "auto" else "",  # the table beside torch once, at one length (it is slow here)
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.split() and line.split()[0].isdigit()]
    decode, attention = rows[:2], rows[2:]
    assert [r[0] for r in decode] == ["1", "3"] and all(float(r[2]) > 0 for r in decode), proc.stdout
    assert [r[:2] for r in attention] == [["1", "300"], ["8", "300"]], proc.stdout
    beside = [
        line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| ") and "tok/s" not in line
    ]
    if impl == "auto":  # prefill 24, decode batch 4, then the components (experts, attention, MLA); both measured
        assert [r[0].split(",")[0].strip() for r in beside[:2]] == ["prefill 24 tokens", "decode batch 4"]
        assert len(beside) == 7 and all(float(r[1].replace(",", "")) > 0 < float(r[2].replace(",", "")) for r in beside)
    else:
        assert not beside, proc.stdout


@pytest.mark.slow
def test_eprt_generate_on_the_cuda_backend_runs_on_cusim():
    # the CLI's GPU path (device binding, KV pool from free memory and
    # --gpu-memory-utilization, CuPy backend, text out) as a user runs it on a GPU node
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'tests'}{os.pathsep}{ROOT}")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cusim.run",
            "-m",
            "eprt",
            "generate",
            "--device",
            "cuda",
            "--prompt",
            "Hello, experts",
            "--max-tokens",
            "8",
            "--gpu-memory-utilization",
            "0.5",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "on cuda" in proc.stderr and "generated 8" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not on PATH")
@pytest.mark.parametrize("devices", [1, 2])
def test_combine_benchmark_runs_on_cusim_at_two_ranks(devices):
    # gpu_session.sh times the MoE combine at 2 ranks on the lent GPU (one device: host staging
    # only, NCCL refuses a shared GPU); with a device per rank the NCCL path is timed too
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "OMPI_"))}
    env["PYTHONPATH"] = f"{ROOT / 'tests'}{os.pathsep}{ROOT}"
    env["CUSIM_DEVICES"] = str(devices)
    cmd = [
        "mpiexec",
        "-n",
        "2",
        sys.executable,
        "-m",
        "cusim.run",
        str(ROOT / "benchmarks" / "bench_combine.py"),
        "--tiny",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| ") and "us" not in line]
    assert [r[0].strip() for r in rows] == ["1", "8"] and all(float(r[1]) > 0 for r in rows), proc.stdout
    if devices == 1:
        assert all("not run" in r[2] for r in rows), proc.stdout
    else:
        assert all(float(r[2]) > 0 for r in rows), proc.stdout


def test_nccl_stand_in_sends_and_receives_in_groups_and_refuses_a_mismatch():
    """send/recv as CuPy 14 has them (a rank may send to itself), matched at groupEnd: a recv of
    another count than the send is refused naming both calls, an ungrouped send too."""
    from cusim import fake_nccl as nccl

    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    a, b = fake_cupy.arange(6, dtype=np.float32), fake_cupy.zeros(6, np.float32)
    nccl.groupStart()
    comm.send(a.data.ptr + 8, 4, nccl.NCCL_FLOAT32, 0, 0)  # a[2:6] -> b[0:4]
    comm.recv(b.data.ptr, 4, nccl.NCCL_FLOAT32, 0, 0)
    comm.send(a.data.ptr, 0, nccl.NCCL_FLOAT32, 0, 0)  # a count of 0 moves nothing
    comm.recv(0, 0, nccl.NCCL_FLOAT32, 0, 0)
    nccl.groupEnd()
    np.testing.assert_array_equal(b.get(), [2, 3, 4, 5, 0, 0])
    nccl.groupStart()
    comm.send(a.data.ptr, 4, nccl.NCCL_FLOAT32, 0, 0)
    comm.recv(b.data.ptr, 3, nccl.NCCL_FLOAT32, 0, 0)
    with pytest.raises(nccl.NcclError, match=r"rank 0's send #0 of 4 \(datatype 7\) .* rank 0's recv #0 of 3"):
        nccl.groupEnd()
    nccl.groupStart()
    comm.send(a.data.ptr, 4, nccl.NCCL_FLOAT32, 0, 0)
    comm.recv(b.data.ptr, 4, nccl.NCCL_INT32, 0, 0)
    with pytest.raises(nccl.NcclError, match=r"send #0 of 4 \(datatype 7\) .* recv #0 of 4 \(datatype 2\)"):
        nccl.groupEnd()
    with pytest.raises(nccl.NcclError, match=r"send outside groupStart\(\)/groupEnd\(\)"):
        comm.send(a.data.ptr, 4, nccl.NCCL_FLOAT32, 0, 0)
    with pytest.raises(nccl.NcclError, match="groupEnd without groupStart"):
        nccl.groupEnd()
    with pytest.raises(TypeError, match="an integer is required"):
        comm.recv(b, 4, nccl.NCCL_FLOAT32, 0, 0)
