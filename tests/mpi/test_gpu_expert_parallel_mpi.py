"""Expert parallelism on the CuPy backend, at every world size (skipped without a GPU; CI runs
it on cusim, the CPU CUDA simulator: tests/cusim/README.md):

    mpiexec -n 1|2|3 python -m pytest --with-mpi -m gpu tests/mpi/test_gpu_expert_parallel_mpi.py

Each rank runs its experts' kernels on its GPU and the partial MoE outputs are summed through
pinned host buffers (eprt/comm/cuda_staging.py), or on the device after an NCCL all-gather
(eprt/comm/device_combine.py); with ``--moe-exchange alltoall`` and the NCCL combine the rows and
partials move by NCCL send/recv on the device (``DeviceCombine.alltoall_rows``), else through the
host. The tokens must equal a single-rank CuPy run. On cusim the ranks
get a device each for the NCCL tests (cusim's NCCL, tests/cusim/fake_nccl.py); on a GPU machine
whose ranks share one GPU (NCCL refuses that) those tests use ``MpiNccl``, an MPI stand-in.
"""

import logging
import os
import tempfile

import numpy as np
import pytest
from checkpoints import EXPERT_KEY, build_checkpoint

from eprt.api import GenerationRequest, SamplingParams
from eprt.comm.transport import LocalTransport
from eprt.engine.engine import EngineConfig, launch_engine
from eprt.ops.device import cuda_usable

MPI = pytest.importorskip("mpi4py.MPI")
COMM = MPI.COMM_WORLD
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_usable(), reason="no usable CUDA device")]
PROMPTS = [[5, 77, 3], [140, 9, 9, 31, 200, 17, 64, 12, 250, 11], list(range(90, 130))]


def shared_checkpoint(arch):
    path = None
    if COMM.rank == 0:
        root = os.environ.get("EPRT_TEST_CKPT_DIR") or os.path.join(tempfile.gettempdir(), "eprt-mpi-ckpt")
        n = 9 if arch == "deepseek_v3" else 7  # uneven over 2 ranks; deepseek_v3's 3 expert groups divide it
        key = EXPERT_KEY.get(arch, "num_experts")
        path = build_checkpoint(arch, os.path.join(root, f"{arch}-{n}experts-bf16"), dtype="bfloat16", **{key: n})
    return COMM.bcast(path, root=0)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral", "deepseek_v3"])
def test_cuda_tokens_equal_single_rank(arch):
    cfg = EngineConfig(model=shared_checkpoint(arch), device="cuda", max_batch=4, block_size=16, max_model_len=96)
    assert_tokens_equal_single_rank(cfg, cfg)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("attention,exchange", [("replicated", "alltoall"), ("dp", "alltoall"), ("dp", "allgather")])
def test_cuda_moe_exchanges_tokens_equal_single_rank(attention, exchange):
    """--moe-exchange alltoall on the CuPy backend (the rows and partials staged through the host:
    eprt/comm/alltoall.py), and dp attention's all-gather of rows with their routing, the experts'
    kernels on the device."""
    path = shared_checkpoint("deepseek_v3")
    kw = dict(model=path, device="cuda", max_batch=4, block_size=16, max_model_len=96)
    assert_tokens_equal_single_rank(EngineConfig(**kw, attention=attention, moe_exchange=exchange), EngineConfig(**kw))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("attention", ["replicated", "dp"])
def test_cuda_alltoall_through_nccl_equals_allgather_bitwise(attention, nccl_job, monkeypatch):
    """--moe-exchange alltoall with the NCCL combine: the rows and the float32 partials move by NCCL
    send/recv on the device (DeviceCombine.alltoall_rows, no host copy); the tokens and every token's
    logprobs equal the all-gather exchange's bit for bit (which equals one rank's tokens:
    test_cuda_tokens_with_the_device_combine_equal_single_rank). Short, and at 2 ranks only, to keep
    CI's cusim lane quick (11 s more at -n 3): the bits at 3 ranks, where the order of the adds shows,
    are test_device_alltoall_exchange_is_the_allgather_combine_bitwise's."""
    if COMM.size != 2:
        pytest.skip("at 2 ranks only (CI time); the bits at 3: the exchange_is_the_allgather_combine test")
    monkeypatch.setenv("EPRT_COMBINE", "nccl")
    path = shared_checkpoint("deepseek_v3")
    kw = dict(model=path, device="cuda", max_batch=4, block_size=16, max_model_len=96, cuda_graphs=False)
    runs = {x: _generated(EngineConfig(**kw, attention=attention, moe_exchange=x)) for x in ("alltoall", "allgather")}
    if COMM.rank == 0:
        assert runs["alltoall"][2] == ("NCCL send/recv" if nccl_job != "MpiNccl (the ranks share a GPU)" else "host")
        assert runs["allgather"][2] is None and runs["alltoall"][:2] == runs["allgather"][:2]
    COMM.Barrier()


def _generated(cfg: EngineConfig):
    """Rank 0: (token ids, every token's logprobs as text, how the all-to-all moved rows); workers None."""
    requests = [GenerationRequest(p, SamplingParams(max_tokens=5, logprobs=2)) for p in PROMPTS[1:]]
    try:
        with launch_engine(cfg) as engine:
            results = engine.generate(requests)
            a2a = engine.runner.executor.model.alltoall
            how = None if a2a is None else "host" if a2a.device is None else "NCCL send/recv"
            return [r.token_ids for r in results], [repr([lp.to_json() for lp in r.logprobs]) for r in results], how
    except SystemExit as e:  # worker ranks leave the engine at SHUTDOWN
        assert e.code == 0, f"worker rank {COMM.rank} exited with {e.code}"
        return None


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("per_choice", [False, True], ids=["experts", "eplb"])
def test_device_alltoall_exchange_is_the_allgather_combine_bitwise(nccl_job, monkeypatch, per_choice):
    """One MoE layer's exchange under replicated attention, rows and partials by NCCL on the device:
    float32 bits equal to the NCCL all-gather combine of every rank's partial (each rank's experts'
    weighted outputs added in choice order, the ranks' partials in rank order); EPLB (per choice):
    a row's k choices added in choice order. Values over 8 decades, so any other order shows."""
    import cupy

    from eprt.comm.alltoall import AllToAllExchange
    from eprt.comm.device_combine import DeviceCombine
    from eprt.comm.mpi_transport import MpiTransport
    from eprt.engine import startup
    from eprt.ops.cupy_ops import CupyOps

    monkeypatch.setenv("EPRT_COMBINE", "nccl")
    P, me, (N, D, k, E) = COMM.size, COMM.rank, (11, 6, 3, 7)
    g = np.random.default_rng(5)  # the same rows and routing on every rank
    x = (g.standard_normal((N, D)) * 10.0 ** g.uniform(-4, 4, (N, D))).astype(np.float32)
    weights, ids = g.random((N, k)).astype(np.float32), np.argsort(g.random((N, E)), axis=1)[:, :k]
    expert_rank = np.arange(E) * P // E  # [E]

    def outputs(xs, w, i):  # [m, c, D] each choice's weighted expert output, zeros off this rank's experts
        xs, w, i = (np.asarray(a.get()) for a in (xs, w, i))
        here = np.full(i.shape, True) if per_choice else expert_rank[i] == me
        return np.where(here[..., None], w[..., None] * np.tanh(xs[:, None, :] * (1.0 + i[..., None])), 0.0)

    def compute(xs, w, i):  # the experts' partial [m, D]: this rank's choices added in choice order
        each, out = outputs(xs, w, i).astype(np.float32), np.zeros((xs.shape[0], D), np.float32)
        for j in range(each.shape[1]):
            out = out + each[:, j]
        return cupy.asarray(out)

    t = MpiTransport(timeout=60)
    ops = CupyOps()
    combine, _ = startup._combine(t, ops)
    try:
        assert isinstance(combine, DeviceCombine) and hasattr(combine.comm, "send"), nccl_job
        a2a = AllToAllExchange(t, cupy, None, combine)
        dest = (np.arange(N * k).reshape(N, k) + 1) % P if per_choice else expert_rank[ids]  # EPLB: any replica
        got = a2a.run(cupy.asarray(x), weights, ids, dest, compute, per_choice).get()
        if per_choice:
            each = outputs(*(cupy.asarray(a) for a in (x, weights, ids))).astype(np.float32)  # [N, k, D]
            want = each[:, 0]
            for j in range(1, k):
                want = want + each[:, j]
        else:
            want = combine(compute(cupy.asarray(x), cupy.asarray(weights), cupy.asarray(ids))).get()
    finally:
        closed(t)
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.mpi(min_size=2)
def test_device_alltoall_rows_is_the_host_alltoall(nccl_job, monkeypatch):
    """NCCL send/recv in one group: uneven counts (none from rank 1 to rank 0, none to rank 1 itself),
    bf16 rows (moved as bytes) and float32 ones, equal to Transport.alltoall_rows; bytes counted alike."""
    import cupy

    from eprt.comm.device_combine import DeviceCombine
    from eprt.comm.mpi_transport import MpiTransport
    from eprt.engine import startup
    from eprt.ops.cupy_ops import CupyOps

    monkeypatch.setenv("EPRT_COMBINE", "nccl")
    P, me = COMM.size, COMM.rank
    send = [0 if (me, r) in ((1, 0), (1, 1)) else 1 + (me + 2 * r) % 3 for r in range(P)]
    recv = [0 if (r, me) in ((1, 0), (1, 1)) else 1 + (r + 2 * me) % 3 for r in range(P)]
    t = MpiTransport(timeout=60)
    ops = CupyOps()
    combine, _ = startup._combine(t, ops)
    if not hasattr(combine.comm, "send"):
        closed(t)
        pytest.skip(f"{nccl_job} has no send/recv")
    assert isinstance(combine, DeviceCombine), nccl_job
    for dtype, shape in ((np.uint16, (5,)), (np.float32, (2, 3))):
        rows = np.random.default_rng(me).integers(0, 60000, (sum(send), *shape)).astype(dtype)
        before = t.stats.copy()
        host = t.alltoall_rows(rows, send, recv)
        by_host, before = t.stats - before, t.stats.copy()
        device = combine.alltoall_rows(cupy.asarray(rows), send, recv).get()
        by_nccl = t.stats - before
        assert device.dtype == dtype and device.shape == host.shape and np.array_equal(device, host)
        assert (by_nccl.moe_sent_bytes, by_nccl.moe_recv_bytes) == (by_host.moe_sent_bytes, by_host.moe_recv_bytes)
    closed(t)


def assert_tokens_equal_single_rank(multi_cfg: EngineConfig, single_cfg: EngineConfig) -> None:
    """The greedy tokens of PROMPTS on every rank of this job under ``multi_cfg`` equal those of one
    rank (rank 0, a local transport) under ``single_cfg``."""
    requests = lambda: [GenerationRequest(p, SamplingParams(max_tokens=10)) for p in PROMPTS]  # noqa: E731
    try:
        with launch_engine(multi_cfg) as engine:
            multi = engine.generate(requests())
    except SystemExit as e:  # worker ranks leave the engine at SHUTDOWN
        assert e.code == 0, f"worker rank {COMM.rank} exited with {e.code}"
        multi = None
    if COMM.rank == 0:
        with launch_engine(single_cfg, transport=LocalTransport()) as engine:
            single = engine.generate(requests())
        assert [r.token_ids for r in multi] == [r.token_ids for r in single]
    COMM.Barrier()


class MpiNccl:
    """NCCL's allGather over MPI, for ranks that share a GPU: the device data reaches the host
    through the runtime's copies (in stream order), never through a host read of a device pointer."""

    def allGather(self, send_ptr, recv_ptr, count, datatype, stream_ptr):  # noqa: N802 - NCCL's name
        import cupy

        from eprt.comm.device_combine import NCCL_FLOAT32

        assert datatype == NCCL_FLOAT32
        rt = cupy.cuda.runtime
        mine, every = np.empty(count, np.float32), np.empty(count * COMM.size, np.float32)
        rt.memcpyAsync(mine.ctypes.data, send_ptr, mine.nbytes, rt.memcpyDeviceToHost, stream_ptr)
        rt.streamSynchronize(stream_ptr)
        COMM.Allgather(mine, every)
        rt.memcpyAsync(recv_ptr, every.ctypes.data, every.nbytes, rt.memcpyHostToDevice, stream_ptr)
        rt.streamSynchronize(stream_ptr)  # `every` goes when this returns


def on_cusim() -> bool:
    import cupy

    return bool(getattr(cupy, "__cusim__", False))


def shared_gpu() -> bool:
    """Whether this job's ranks share a GPU (on cusim: as many devices as there are ranks)."""
    from eprt.comm.device_combine import shared_devices
    from eprt.ops.device import device_key

    return bool(shared_devices(COMM.allgather(device_key())))


@pytest.fixture
def nccl_job(monkeypatch):
    """NCCL for this job: on cusim a device per rank and cusim's NCCL; on a GPU machine the real
    one, or MpiNccl where the ranks share a GPU. Yields the name of what runs."""
    from eprt.comm import device_combine
    from eprt.ops.device import bind_local_gpu

    if on_cusim():
        from cusim import fake_cupy

        fake_cupy.set_device_count(COMM.size)
        bind_local_gpu()
        yield "cusim's NCCL"
        fake_cupy.runtime.setDevice(0)
        fake_cupy.set_device_count(1)
        return
    bind_local_gpu()
    if shared_gpu():
        monkeypatch.setattr(device_combine, "nccl_communicator", lambda transport: MpiNccl())
        monkeypatch.setattr(device_combine, "device_key", lambda: f"MpiNccl rank {COMM.rank}")
        yield "MpiNccl (the ranks share a GPU)"
        return
    yield "NCCL"


def closed(t) -> None:
    if t.rank == 0:
        t.shutdown()
    else:
        t.recv_frame()
    t.close()


@pytest.mark.mpi(min_size=2)
def test_device_combine_is_the_host_sum_bitwise_on_every_rank(nccl_job, monkeypatch):
    import cupy

    from eprt.comm.device_combine import DeviceCombine
    from eprt.comm.mpi_transport import MpiTransport
    from eprt.engine import startup
    from eprt.ops.cupy_ops import CupyOps

    monkeypatch.setenv("EPRT_COMBINE", "nccl")
    g = np.random.default_rng(100 + COMM.rank)
    partial = (g.standard_normal((7, 33)) * 10.0 ** g.uniform(-4, 4, (7, 33))).astype(np.float32)  # [T, D]
    t = MpiTransport(timeout=60)
    host = t.allsum(partial)
    ops = CupyOps()
    combine, _ = startup._combine(t, ops)
    assert isinstance(combine, DeviceCombine), nccl_job
    device = ops.to_host(combine(cupy.asarray(partial)))
    every = np.empty((COMM.size,) + device.shape, np.float32)
    COMM.Allgather(device, every)
    closed(t)
    assert np.array_equal(device.view(np.uint32), host.view(np.uint32))
    assert all(np.array_equal(every[r].view(np.uint32), device.view(np.uint32)) for r in range(COMM.size))


@pytest.mark.mpi(min_size=2)
def test_device_gather_rows_is_every_ranks_rows_in_rank_order(nccl_job, monkeypatch):
    """EPLB's combine on the device: uneven counts (rank 1 sends none), the padding dropped."""
    import cupy

    from eprt.comm.device_combine import DeviceCombine
    from eprt.comm.mpi_transport import MpiTransport
    from eprt.engine import startup
    from eprt.ops.cupy_ops import CupyOps

    monkeypatch.setenv("EPRT_COMBINE", "nccl")
    counts = [3 + 2 * r if r != 1 else 0 for r in range(COMM.size)]
    rows = np.random.default_rng(7 + COMM.rank).standard_normal((counts[COMM.rank], 5)).astype(np.float32)
    t = MpiTransport(timeout=60)
    host = t.allgather_rows(rows, counts)
    ops = CupyOps()
    combine, gather_rows = startup._combine(t, ops)
    assert isinstance(combine, DeviceCombine), nccl_job
    device = ops.to_host(gather_rows(cupy.asarray(rows), counts))
    closed(t)
    assert device.shape == (sum(counts), 5) and np.array_equal(device, host)


@pytest.mark.mpi(min_size=2)
def test_cuda_eplb_tokens_with_the_device_combine_equal_single_rank(nccl_job, monkeypatch):
    """EPLB with redundant slots and its row gather through the device combine."""
    from eprt.engine.config import EplbConfig

    monkeypatch.setenv("EPRT_COMBINE", "nccl")
    path = shared_checkpoint("qwen2_moe")
    eplb = EplbConfig(num_redundant_experts=3)
    cfg = EngineConfig(model=path, device="cuda", max_batch=4, block_size=16, max_model_len=96, eplb=eplb)
    plain = EngineConfig(model=path, device="cuda", max_batch=4, block_size=16, max_model_len=96)
    assert_tokens_equal_single_rank(cfg, plain)


@pytest.mark.mpi(min_size=2)
def test_cuda_tokens_with_the_device_combine_equal_single_rank(nccl_job, monkeypatch):
    monkeypatch.setenv("EPRT_COMBINE", "nccl")
    test_cuda_tokens_equal_single_rank("qwen2_moe")


@pytest.mark.mpi(min_size=2)
def test_nccl_communicator_takes_rank0s_unique_id_as_bytes(nccl_job):
    """CuPy 14's NcclCommunicator takes the 128-byte id (a tuple is a TypeError), one per id."""
    from eprt.comm.device_combine import nccl_communicator
    from eprt.comm.mpi_transport import MpiTransport

    t = MpiTransport(timeout=60)
    try:
        comm = nccl_communicator(t)
        if nccl_job != "MpiNccl (the ranks share a GPU)":
            assert comm.size() == COMM.size and comm.rank_id() == COMM.rank
    finally:
        closed(t)


@pytest.mark.mpi(min_size=2)
def test_auto_combine_goes_through_the_host_when_ranks_share_a_gpu(monkeypatch):
    """NCCL refuses two ranks on one GPU (ncclInvalidUsage): ``auto`` takes the host path and
    says why; an explicit ``nccl`` is a start-up error naming the ranks."""
    from eprt.comm.device_combine import DeviceCombine
    from eprt.comm.mpi_transport import MpiTransport
    from eprt.engine import startup
    from eprt.ops.cupy_ops import CupyOps

    if not shared_gpu():
        pytest.skip("this job's ranks have a GPU each")
    t = MpiTransport(timeout=60)
    try:
        ops = CupyOps()
        monkeypatch.setenv("EPRT_COMBINE", "auto")
        lines, log = [], logging.getLogger("eprt.engine")
        handler = logging.Handler()
        handler.emit = lambda record: lines.append(record.getMessage())
        log.addHandler(handler)
        level, log.level = log.level, logging.INFO
        try:
            combine, _ = startup._combine(t, ops)
        finally:
            log.removeHandler(handler)
            log.setLevel(level)
        monkeypatch.setenv("EPRT_COMBINE", "nccl")
        with pytest.raises(ValueError, match=r"EPRT_COMBINE=nccl, but ranks 0 and 1 share GPU"):
            startup._combine(t, ops)  # (a collective: before any assertion that one rank alone could fail)
    finally:
        closed(t)
    assert not isinstance(combine, DeviceCombine) and combine.blocks_host
    said = any("share GPU" in line and "NCCL refuses duplicate GPUs" in line for line in lines)
    assert said or COMM.rank != 0, lines  # the workers' log may be quiet (--log-all-ranks off)


@pytest.mark.mpi(min_size=2)
def test_cusim_nccl_refuses_a_reused_unique_id_and_a_shared_gpu():
    """cusim's NCCL as the H200 showed the real one: a second communicator from one id hung
    (refused here), and ranks on one GPU get ncclInvalidUsage on every rank."""
    if not on_cusim():
        pytest.skip("the real NCCL hangs on a reused id; cusim's stand-in is checked here")
    from cupy.cuda import nccl
    from cusim import fake_cupy

    uid = COMM.bcast(nccl.get_unique_id() if COMM.rank == 0 else None, root=0)
    with pytest.raises(nccl.NcclError, match="Duplicate GPU detected : rank 0 and rank 1"):
        nccl.NcclCommunicator(COMM.size, uid, COMM.rank)  # every rank on device 0
    with pytest.raises(TypeError, match=r"expected bytes, got tuple"):
        nccl.NcclCommunicator(COMM.size, tuple(uid), COMM.rank)
    fake_cupy.set_device_count(COMM.size)
    try:
        fake_cupy.runtime.setDevice(COMM.rank)
        uid = COMM.bcast(nccl.get_unique_id() if COMM.rank == 0 else None, root=0)
        comm = nccl.NcclCommunicator(COMM.size, uid, COMM.rank)
        assert comm.size() == COMM.size
        with pytest.raises(nccl.NcclError, match="already made a communicator"):
            nccl.NcclCommunicator(COMM.size, uid, COMM.rank)
        comm.destroy()
    finally:
        fake_cupy.runtime.setDevice(0)
        fake_cupy.set_device_count(1)


@pytest.mark.mpi(min_size=1)
def test_cuda_gpt_oss_mxfp4_tokens_equal_transformers():
    """gpt_oss with MXFP4 experts (kept MXFP4 on every rank's device, 7 experts split unevenly), windowed
    KV in blocks of 4, prompts longer than the window (8) prefilled in chunks of 5 that cross it, a prefix
    hit: the greedy tokens equal transformers' on the dequantized weights at every world size (prompts
    whose top-2 gaps are all > 0.25, so bf16 activations cannot move them)."""
    from checkpoints import build_gptoss_checkpoint, reference_greedy

    system = [(4 * i + 5) % 240 + 10 for i in range(14)]
    prompts, steps, out = [system + [1, 2], system + [3]], 4, None
    if COMM.rank == 0:
        root = os.environ.get("EPRT_TEST_CKPT_DIR") or os.path.join(tempfile.gettempdir(), "eprt-mpi-ckpt")
        path = build_gptoss_checkpoint(
            os.path.join(root, "gpt_oss-7experts-mxfp4"), "bfloat16", mxfp4=True, num_local_experts=7
        )
        refs = [reference_greedy(path, p, steps) for p in prompts]
        assert min(np.diff(np.sort(logits, axis=1)[:, -2:], axis=1).min() for _, logits in refs) > 0.25
        out = path, [tokens for tokens, _ in refs]
    path, want = COMM.bcast(out, root=0)
    cfg = EngineConfig(model=path, device="cuda", max_batch=2, block_size=4, max_model_len=64, max_prefill_tokens=5)
    params = SamplingParams(max_tokens=steps, ignore_eos=True)
    try:
        with launch_engine(cfg) as engine:
            got = [engine.generate([GenerationRequest(p, params)])[0] for p in prompts]
    except SystemExit as e:  # worker ranks leave the engine at SHUTDOWN
        assert e.code == 0, f"worker rank {COMM.rank} exited with {e.code}"
        got = None
    if COMM.rank == 0:
        assert [r.token_ids for r in got] == want and got[1].cached_tokens == 12
    COMM.Barrier()


@pytest.mark.mpi(min_size=2)
def test_cuda_graph_tokens_with_the_device_combine_equal_eager_single_rank(nccl_job, monkeypatch):
    """CUDA graphs with the NCCL combine captured in them, every rank replaying the same buckets:
    greedy and seeded-sampled tokens (even and odd requests) equal one rank's eager launches
    (--cuda-graphs off); 5 requests of different lengths on 4 slots, so rows join and leave and
    batches of 3 miss a bucket."""
    monkeypatch.setenv("EPRT_COMBINE", "nccl")
    path = shared_checkpoint("qwen2_moe")
    prompts = PROMPTS + [[7, 7, 7, 7], [250, 11]]
    params = [
        SamplingParams(max_tokens=n, temperature=0.8 * (i % 2), top_p=0.9 if i % 2 else 1.0, seed=3 + i)
        for i, n in enumerate([6, 3, 8, 5, 4])
    ]
    requests = [GenerationRequest(p, s) for p, s in zip(prompts, params)]
    config = lambda graphs: EngineConfig(  # noqa: E731
        model=path, device="cuda", max_batch=4, block_size=16, max_model_len=96, cuda_graphs=graphs
    )
    try:
        with launch_engine(config(True)) as engine:
            multi = [r.token_ids for r in engine.generate(requests)]
            replays = engine.runner.executor.passes.graphs.replays
    except SystemExit as e:  # worker ranks leave the engine at SHUTDOWN
        assert e.code == 0, f"worker rank {COMM.rank} exited with {e.code}"
        multi = None
    if COMM.rank == 0:
        assert replays > 0
        with launch_engine(config(False), transport=LocalTransport()) as engine:
            assert multi == [r.token_ids for r in engine.generate(requests)]
    COMM.Barrier()
