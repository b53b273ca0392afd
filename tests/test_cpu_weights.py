"""CPU weights at the checkpoint's precision (``--cpu-weights``, eprt/ops/cpu_weights.py) and on
several threads: bf16 and FP8 resident weights give every architecture the logits (bit for bit)
and tokens of the float32 path, with 1 and 2 threads; int8 weights (and activations) are the
quantization they say, exactly, and close to float32."""

import os

import numpy as np
import pytest
from checkpoints import (
    ARCHS,
    HYBRID_ARCHS,
    build_bf16_copy,
    build_fp8_copy,
    build_gptoss_checkpoint,
    build_vl_checkpoint,
)

from eprt.engine.executor import ShardExecutor
from eprt.model.loader import load_model
from eprt.ops import cpu_threads, cpu_weights
from eprt.ops.bf16 import f32_to_bf16_bits
from eprt.ops.cpu_weights import ScaledPanels
from eprt.ops.numpy_ops import NumpyOps, numba_available

pytestmark = pytest.mark.skipif(not numba_available(), reason="resident bf16 / FP8 / int8 need numba (the cpu extra)")

PROMPTS = [[5, 77, 3, 140, 9, 9, 31, 200, 17, 64, 2, 250, 11], [200, 100, 50, 25]]
STEPS = 5


@pytest.fixture
def shared(monkeypatch):
    """Every product shared out over the threads asked for, however small (the test models' are)."""
    from eprt.ops import cpu_pool

    monkeypatch.setattr(cpu_pool, "THREAD_MIN_BYTES", 1)


@pytest.fixture(scope="module")
def resident(checkpoint, ckpt_root):
    """arch, kind ("bf16", "fp8"; gpt_oss: "mxfp4" too) -> a checkpoint of that precision."""

    def source_of(arch):
        if arch == "qwen3_vl_moe":
            return build_vl_checkpoint(os.path.join(ckpt_root, arch))
        if arch == "gpt_oss":  # (test_gptoss's float32 checkpoint)
            return build_gptoss_checkpoint(os.path.join(ckpt_root, "gpt_oss-f32"), dtype="float32")
        return checkpoint(arch)

    def make(arch, kind):
        if kind == "mxfp4":  # bf16, the experts MXFP4 as released (test_gptoss's)
            return build_gptoss_checkpoint(os.path.join(ckpt_root, "gpt_oss-mxfp4"), dtype="bfloat16", mxfp4=True)
        source = source_of(arch)
        if kind == "bf16":
            return build_bf16_copy(source, f"{source}-bf16copy")
        return build_fp8_copy(source, f"{source}-fp8-16x32", (16, 32))[0]

    return make


def greedy_logits(path, ops, steps=STEPS):
    """Prefill each prompt, then batched greedy decode: logits [P, steps, V]."""
    lm = load_model(path, ops, max_len=512)
    ex = ShardExecutor(lm.model, 64, 4, 8, prefix_cache=False)
    logits = []
    for s, p in enumerate(PROMPTS):
        ex.allocate(s, p)
        logits.append([ex.prefill(s, p, 0, len(p))[0]])
    for _ in range(steps - 1):
        step = ex.decode([0, 1], [int(np.argmax(rows[-1])) for rows in logits])
        for s in (0, 1):
            logits[s].append(step[s])
    return np.array(logits), lm


RESIDENT = [(a, k) for a in (*ARCHS, *HYBRID_ARCHS, "qwen3_vl_moe", "gpt_oss") for k in ("bf16", "fp8")]


@pytest.mark.parametrize("arch, kind", [*RESIDENT, ("gpt_oss", "mxfp4")])
def test_resident_weights_give_the_float32_bits(resident, shared, arch, kind):
    """The checkpoint's precision held (auto) on 2 threads: the logits of today's float32 upcast
    on 1 thread, bit for bit, so the same tokens. gpt-oss's MXFP4 experts are MXFP4 in both (kept
    as stored under every --cpu-weights), its other matrices bf16 against float32."""
    path = resident(arch, kind)
    want, _ = greedy_logits(path, NumpyOps("numba", weights="f32", threads=1))
    ops = NumpyOps("numba", weights="auto", threads=2)
    got, lm = greedy_logits(path, ops)
    np.testing.assert_array_equal(got, want)
    held = ops.describe().rsplit("weights ", 1)[1].split("+")
    assert kind in held and ("bf16" in held) == (kind != "fp8")  # held at the checkpoint's precision
    o = lm.model.w.layers[-1].o  # (fused experts stay float32 in the FP8 copies: it quantizes 2-D weights)
    assert isinstance(o, ScaledPanels) and o.kind == "fp8" if kind == "fp8" else o.dtype == np.uint16


@pytest.mark.parametrize("weights", ["f32", "bf16", "int8"])
def test_gpt_oss_mxfp4_experts_stay_mxfp4_under_every_cpu_weights(ckpt_root, weights):
    """--cpu-weights chooses the other matrices' precision; the MXFP4 experts are read as stored."""
    from eprt.ops.gptoss_ops import Mxfp4Weight

    path = build_gptoss_checkpoint(os.path.join(ckpt_root, "gpt_oss-mxfp4"), dtype="bfloat16", mxfp4=True)
    ops = NumpyOps("numba", weights=weights, threads=1)
    lm = load_model(path, ops, max_len=64)
    layer = lm.model.w.layers[0]
    assert isinstance(layer.w_gate_up, Mxfp4Weight) and isinstance(layer.w_down, Mxfp4Weight)
    assert ops.describe().endswith(f"weights {'+'.join(sorted({weights, 'mxfp4'}))}")


def test_float32_path_is_the_same_on_1_and_2_threads(checkpoint, shared):
    path = checkpoint("deepseek_v3")
    one, _ = greedy_logits(path, NumpyOps("numba", weights="f32", threads=1))
    two, _ = greedy_logits(path, NumpyOps("numba", weights="f32", threads=2))
    np.testing.assert_array_equal(one, two)


def int8_reference(x, p: ScaledPanels):
    """The int8 kernel's arithmetic in NumPy: rows quantized per group (max |x| / 127, rint), exact
    integer dot products per group, then acc += float32(dot) * (w scale * x scale), groups in order."""
    w = p.data.swapaxes(-3, -2).reshape(-1, p.data.shape[-3] * 4).astype(np.int64)  # [N', K']
    ws = p.scales.swapaxes(-1, -2).reshape(w.shape[0], -1)  # [N', G]
    G = p.block
    xp = np.pad(x, [(0, 0), (0, w.shape[1] - x.shape[1])])
    out = np.zeros((x.shape[0], w.shape[0]), np.float32)
    for g in range(ws.shape[1]):
        part = xp[:, g * G : (g + 1) * G]
        top = np.abs(part).max(axis=1)  # [T]
        inv = np.where(top > 0, np.float32(127) / np.where(top > 0, top, 1), np.float32(0)).astype(np.float32)
        q = np.rint(part * inv[:, None]).astype(np.int64)
        dots = (q @ w[:, g * G : (g + 1) * G].T).astype(np.float32)  # exact: |dot| < 2^24
        out += dots * (ws[None, :, g] * (top / np.float32(127))[:, None])
    return out[:, : p.rows]


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("N, K", [(48, 96), (40, 70)])  # 40, 70: padded to 48 rows and whole groups
def test_int8_products_are_the_quantization_they_say(shared, group, N, K):
    from eprt.ops import cpu_kernels

    rng = np.random.default_rng(group + N)
    w = rng.standard_normal((N, K)).astype(np.float32)
    x = rng.standard_normal((9, K)).astype(np.float32)
    p = cpu_weights.int8_panels(w, group)
    assert p.shape == (N, K) and p.data.dtype == np.int8
    scale = np.repeat(np.abs(np.pad(w, [(0, 0), (0, -K % group)])).reshape(N, -1, group).max(-1) / 127, group, 1)
    assert np.all(np.abs(cpu_weights.int8_dequantized(p) - w) <= scale[:, :K] / 2 * (1 + 1e-6))
    got = cpu_kernels.product(x, p, threads=1)
    np.testing.assert_array_equal(got, int8_reference(x, p))
    np.testing.assert_array_equal(cpu_kernels.product(x, p, threads=2), got)
    np.testing.assert_array_equal(cpu_kernels.product(x[3:4], p), got[3:4])  # a row's bits alone
    assert np.abs(got - x @ w.T).max() < 0.05 * np.abs(x @ w.T).max()


def test_int8_rows_with_nan_give_nan():
    from eprt.ops import cpu_kernels

    p = cpu_weights.int8_panels(np.ones((16, 64), np.float32), 32)
    x = np.ones((2, 64), np.float32)
    x[1, 40] = np.nan
    y = cpu_kernels.product(x, p)
    assert np.isfinite(y[0]).all() and np.isnan(y[1]).all()


def test_int8_model_is_close_to_float32(checkpoint, shared):
    path = checkpoint("qwen3_moe")
    want, _ = greedy_logits(path, NumpyOps("numba", weights="f32", threads=1), steps=1)
    ops = NumpyOps("numba", weights="int8", threads=2)
    got, lm = greedy_logits(path, ops, steps=1)
    assert "weights int8" in ops.describe()
    assert isinstance(lm.model.w.lm_head, ScaledPanels)  # every linear, the 256-row head too
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()
    one, _ = greedy_logits(path, NumpyOps("numba", weights="int8", threads=1), steps=1)
    np.testing.assert_array_equal(one, got)


def test_precision_and_threads_are_checked(monkeypatch):
    with pytest.raises(ValueError, match="--cpu-weights must be one of auto, f32, bf16, int8, got 'fp16'"):
        NumpyOps("numba", weights="fp16")
    with pytest.raises(ValueError, match="--cpu-weights bf16 needs the compiled kernels"):
        NumpyOps("numpy", weights="bf16")
    with pytest.raises(ValueError, match=r"--cpu-threads must be in \[1, "):
        NumpyOps("numba", threads=10_000)
    monkeypatch.setenv("EPRT_CPU_INT8_GROUP", "48")
    with pytest.raises(ValueError, match=r"EPRT_CPU_INT8_GROUP must be one of \(32, 64\), got 48"):
        NumpyOps("numba", weights="int8")


def test_default_threads_share_the_node_among_its_ranks(monkeypatch):
    cores = cpu_threads.node_cores()
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert cpu_threads.default_threads({})[0] == cores
    assert cpu_threads.default_threads({"MPI_LOCALNRANKS": str(cores)})[0] == 1
    assert cpu_threads.default_threads({"OMPI_COMM_WORLD_LOCAL_SIZE": str(2 * cores)})[0] == 1
    assert cpu_threads.resolve_threads(0, {"OMP_NUM_THREADS": "1", "MPI_LOCALNRANKS": "1"}) == (1, "OMP_NUM_THREADS")
    monkeypatch.setattr(cpu_threads.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: {0, 1, 2})  # bound by the launcher
    assert cpu_threads.default_threads({"MPI_LOCALNRANKS": "4"}) == (3, "the 3 core(s) this rank is bound to")


def _take_chunks(chunks, counters, lock, work) -> None:
    """A compute thread's loop over a cpu_pool call: take the next chunk from ``counters[0]`` until
    none is left, ``work(j)`` it, then count it done in ``counters[1]``."""
    while True:
        with lock:
            j = int(counters[0])
            counters[0] += 1
        if j >= chunks:
            return
        work(j)
        with lock:
            counters[1] += 1


def test_pool_threads_take_each_chunk_whole_and_once():
    """cpu_pool: the caller and a helper take chunks from one counter until none is left; the call
    returns when every chunk is done (a slow chunk gives the helper time to join)."""
    import threading
    import time

    from eprt.ops.cpu_pool import ChunkPool, new_counters

    pool, lock, taken = ChunkPool(), threading.Lock(), []

    def work(j):
        time.sleep(0.02)
        taken.append((j, threading.current_thread().name))

    def chunk_work(chunks, counters):
        _take_chunks(chunks, counters, lock, work)

    for _ in range(3):
        taken.clear()
        pool.run(chunk_work, (8,), new_counters(), 8, 2)
        assert sorted(j for j, _ in taken) == list(range(8))
    assert {name for _, name in taken} == {threading.current_thread().name, "eprt-cpu"}


@pytest.mark.parametrize("units", [1, 2, 7, 64, 1000])
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_chunks_cover_every_unit_once_and_shrink(units, threads):
    """cpu_pool.spans: edges from 0 to units, every chunk at least one unit; shrinking chunks (the
    first the largest, the last one unit where there are enough), or ``even`` equal ones."""
    from eprt.ops.cpu_pool import spans

    edges = spans(units, threads)
    sizes = np.diff(edges)
    assert edges[0] == 0 and edges[-1] == units and (sizes >= 1).all()
    assert (np.diff(sizes) <= 0).all() and (threads == 1 or len(sizes) == units or len(sizes) > threads)
    assert threads == 1 or units < 4 * threads or sizes[-1] == 1
    even = np.diff(spans(units, threads, even=2))
    assert even.sum() == units and len(even) == (1 if threads == 1 else min(units, 2 * threads))
    assert even.max() - even.min() <= 1


@pytest.mark.parametrize("kind", ["f32", "bf16", "int8"])
def test_moe_shared_out_in_one_call_gives_the_one_thread_bits(shared, kind):
    """cpu_kernels.moe on 2 and 3 threads (``_moe_team``: gate_up, SiLU rows, down, weighted sums as
    one call, each step's chunks done before the next) gives the one-thread call's bits: 1 to 33
    tokens, other ranks' experts (ids outside [0, El)) and experts without rows."""
    from eprt.ops import cpu_kernels

    rng = np.random.default_rng(9)
    El, D, inter = 6, 64, 48
    pack = (
        (lambda w: cpu_weights.int8_panels(w, 32)) if kind == "int8" else (lambda w: cpu_weights.float_panels(w, kind))
    )
    gate_up = pack(rng.standard_normal((El, 2 * inter, D)).astype(np.float32))
    down = pack(rng.standard_normal((El, D, inter)).astype(np.float32))
    for T in (1, 2, 7, 33):
        x = rng.standard_normal((T, D)).astype(np.float32)
        local = rng.integers(-2, El + 2, (T, 2)).astype(np.int32)  # some outside: another rank's
        weights = rng.random((T, 2)).astype(np.float32)
        one = cpu_kernels.moe(x, local, weights, gate_up, down, threads=1)
        for threads in (2, 3):
            got = cpu_kernels.moe(x, local, weights, gate_up, down, threads=threads)
            np.testing.assert_array_equal(got.view(np.int32), one.view(np.int32))


@pytest.mark.parametrize("K", [2, 6, 16, 18, 96, 7])
def test_bf16_panels_pair_their_rows_and_give_the_float32_bits(K):
    """bf16 panels hold each panel's rows in pairs (one 64-byte line per two k); every row count (the
    4-row and 1-row passes) and K % 4 tail gives the bits of float32 panels of the same weights; an
    odd K is held as float32 panels."""
    from eprt.ops import cpu_kernels

    rng = np.random.default_rng(K)
    w = f32_to_bf16_bits(rng.standard_normal((32, K)).astype(np.float32))  # [N, K] bf16 bits
    packed = cpu_weights.float_panels(w, "bf16")
    plain = cpu_weights.panels(w)  # [2, K, 16] rows in order
    assert packed.dtype == (np.float32 if K % 2 else np.uint16)
    if K % 2 == 0:
        assert packed.shape == plain.shape and not (K > 2 and np.array_equal(packed, plain))
        np.testing.assert_array_equal(cpu_weights.unpair_rows(packed), plain)
        line = packed[0, 0:2].reshape(-1)  # the first 64-byte line: rows 0 and 1, as uint16 pairs
        np.testing.assert_array_equal(line[0::2], plain[0, 0])  # row 0 in the low halves
        np.testing.assert_array_equal(line[1::2], plain[0, 1])  # row 1 in the high halves
    wide = cpu_weights.float_panels(cpu_weights.float32(w), "f32")
    for T in (1, 3, 4, 5, 9):
        x = rng.standard_normal((T, K)).astype(np.float32)
        got, want = cpu_kernels.product(x, packed), cpu_kernels.product(x, wide)
        np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))


@pytest.mark.parametrize("kind", ["f32", "bf16", "int8"])
def test_grouped_chunks_cut_anywhere_give_the_one_chunk_bits(kind):
    """cpu_kernels._grouped_chunks lays the groups' panels end to end: chunks cut inside a group or
    across two give the bits of one chunk over everything (the order each element is summed in
    never depends on the cut)."""
    from eprt.ops import cpu_kernels
    from eprt.ops.cpu_pool import new_counters

    rng = np.random.default_rng(5)
    w = rng.standard_normal((5, 64, 96)).astype(np.float32)  # 5 experts [64, 96]: 4 panels each
    packed = cpu_weights.int8_panels(w, 32) if kind == "int8" else cpu_weights.float_panels(w, kind)
    data, scales, block = cpu_kernels._triple(packed)
    x = rng.standard_normal((11, 96)).astype(np.float32)
    experts, edges = np.array([0, 2, 3, 4], np.int64), np.array([0, 3, 3, 4, 4, 9, 9, 11], np.int64)
    op = cpu_kernels._operand_for_call(x, data, block)

    def run(cuts):
        y = np.zeros((11, 64), np.float32)
        cuts = np.array(cuts, np.int64)
        cpu_kernels._grouped_chunks(op, data, scales, block, y, experts, edges, cuts, new_counters())
        return y

    whole = run([0, 16])
    for cuts in ([0, 3, 9, 10, 16], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [0, 13, 16]):
        np.testing.assert_array_equal(run(cuts).view(np.int32), whole.view(np.int32))
    if kind != "int8":  # (the int8 arithmetic: test_int8_products_are_the_quantization_they_say)
        dense = cpu_weights.float32(f32_to_bf16_bits(w)) if kind == "bf16" else w  # the weights held
        for e, lo, hi in zip(experts, edges[0::2], edges[1::2]):
            np.testing.assert_allclose(whole[lo:hi], x[lo:hi] @ dense[e].T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["bf16", "fp8", "int8"])
def test_expert_parallel_placements_keep_the_bits_of_resident_weights(resident, checkpoint, monkeypatch, kind):
    """EPLB over 2 ranks with redundant slots and a switch in mid-decode (bf16 panels are indexed,
    FP8 and int8 ones read again) gives the one-rank logits bit for bit at every precision."""
    from test_eplb import balanced, contiguous, forward_logits, threaded_logits

    if kind == "int8":
        monkeypatch.setenv("EPRT_CPU_WEIGHTS", "int8")
    path = checkpoint("qwen3_moe") if kind == "int8" else resident("qwen3_moe", kind)
    want = forward_logits(path, 0, 1, lambda p: p, lambda c: None)
    cfg = load_model(path, NumpyOps("numba", weights="f32"), 64).config
    counts = np.random.default_rng(1).zipf(1.6, (cfg.num_layers, cfg.num_experts)) * 10
    placed = balanced(counts, cfg.num_experts + 2, 2)
    plain = contiguous(cfg.num_layers, cfg.num_experts, cfg.num_experts + 2, 2)
    for start, switch in [(placed, None), (plain, (2, placed.table))]:
        for rank_logits in threaded_logits(path, 2, start, switch):
            assert np.array_equal(rank_logits, want), switch is not None


def test_pool_names_a_failed_helper():
    import threading
    import time

    from eprt.ops.cpu_pool import ChunkPool, new_counters

    pool, lock = ChunkPool(), threading.Lock()

    def work(j):
        if threading.current_thread().name == "eprt-cpu":
            raise MemoryError("planted")  # the helper's chunk is never done
        time.sleep(0.02)

    def chunk_work(chunks, counters):
        _take_chunks(chunks, counters, lock, work)

    with pytest.raises(RuntimeError, match="a compute thread failed: MemoryError"):
        for _ in range(50):  # until the helper takes a chunk
            pool.run(chunk_work, (4,), new_counters(), 4, 2)


def test_compiled_router_kv_write_and_counts_have_the_numpy_results():
    """The numba path's router (shift and pick compiled, NumPy's exp), kv_write and count_experts give
    the NumPy expressions' bits: ties to the lower id, NaN rows, padding slots."""
    compiled, plain = NumpyOps("numba", threads=1), NumpyOps("numpy", threads=1)
    rng = np.random.default_rng(0)
    for trial in range(300):
        T, E = int(rng.integers(1, 9)), int(rng.choice([2, 8, 16, 60, 128]))
        k = int(rng.integers(1, min(E, 8) + 1))
        x = (rng.standard_normal((T, E)) * rng.choice([0.01, 1, 30])).astype(np.float32)
        x[:, : E // 2] = x[:, :1] if trial % 3 == 0 else x[:, : E // 2]  # ties
        x[0, -1] = np.nan if trial % 10 == 0 else x[0, -1]
        for renormalize in (True, False):
            (w1, i1), (w2, i2) = compiled.router(x, k, renormalize), plain.router(x, k, renormalize)
            np.testing.assert_array_equal(i1, i2)
            np.testing.assert_array_equal(w1.view(np.int32), w2.view(np.int32))
        counts = [np.full(E, trial, np.int32), np.full(E, trial, np.int32)]  # route's count folded into the pick
        both = zip((compiled, plain), counts)
        (w1, i1, p1), (w2, i2, p2) = (ops.route(x, k, True, None, c, (0, E)) for ops, c in both)
        np.testing.assert_array_equal(i1, i2)
        np.testing.assert_array_equal(w1.view(np.int32), w2.view(np.int32))
        np.testing.assert_array_equal(counts[0], counts[1])
        assert p1 is p2 is None  # moe_experts groups its rows itself
    caches = [np.zeros((4, 4, 2, 16), np.float32) for _ in range(4)]  # [NB, BS, Hk, Dh]
    k, v = rng.standard_normal((2, 5, 2, 16)).astype(np.float32)
    slots = np.array([3, -1, 9, 15, 0], np.int32)
    compiled.kv_write(caches[0], caches[1], k, v, slots)
    plain.kv_write(caches[2], caches[3], k, v, slots)
    np.testing.assert_array_equal(caches[0], caches[2])
    np.testing.assert_array_equal(caches[1], caches[3])
    ids = rng.integers(-2, 10, (7, 2)).astype(np.int32)
    counts = [np.zeros(8, np.int32), np.zeros(8, np.int32)]
    compiled.count_experts(ids, counts[0])
    plain.count_experts(ids, counts[1])
    np.testing.assert_array_equal(counts[0], counts[1])


def test_mxfp4_experts_are_the_same_on_1_and_2_threads(shared):
    """gpt-oss's MXFP4 products (mxfp4_cpu) share output columns out over threads: the same bits."""
    from eprt.ops import mxfp4_cpu
    from eprt.ops.gptoss_ops import dequantize_mxfp4

    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, (3, 48, 4, 16), dtype=np.uint8)  # 3 experts [48, 128]
    scales = rng.integers(120, 126, (3, 48, 4), dtype=np.uint8)
    xs = rng.standard_normal((7, 128)).astype(np.float32)
    bounds = np.asarray([0, 3, 3, 7])  # expert 1 has no rows
    one = mxfp4_cpu.expert_rows(xs, blocks, scales, bounds, threads=1)
    np.testing.assert_array_equal(mxfp4_cpu.expert_rows(xs, blocks, scales, bounds, threads=2), one)
    dense = dequantize_mxfp4(blocks, scales)
    want = np.concatenate([xs[:3] @ dense[0].T, xs[3:] @ dense[2].T])
    np.testing.assert_allclose(one, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_one_op_decode_layers_give_the_bits_of_the_ops_apart(checkpoint, monkeypatch, shared, arch):
    """With 16 experts (the router in exact panels) each MoE layer of a decode step runs as
    Ops.decode_layer's compiled calls (MoEModel.decode_layers): the logits of the same model with
    every layer's ops apart, bit for bit, at each precision on 1 thread and on 2 (the experts shared
    out, however small: ``shared``), and at float32 the greedy tokens of transformers."""
    from test_generate import hf_greedy

    from eprt.model.moe_model import MoEModel

    path = checkpoint(arch, num_experts=16) if arch == "qwen3_moe" else checkpoint(arch, num_local_experts=16)
    sparse = {"qwen3_moe": 2, "mixtral": 3}[arch]  # (qwen3_moe's layer 1 is dense)
    for weights, threads in (("f32", 1), ("bf16", 1), ("int8", 1), ("bf16", 2)):
        ops = NumpyOps("numba", weights=weights, threads=threads)
        got, lm = greedy_logits(path, ops)
        assert sum(d is not None and d.compiled is not None for d in lm.model.decode_layers) == sparse
        with monkeypatch.context() as m:
            m.setattr(MoEModel, "_decode_layer", lambda self, lw, layer: None)  # the ops apart
            want, apart = greedy_logits(path, NumpyOps("numba", weights=weights, threads=threads))
        assert apart.model.decode_layers == [None] * len(lm.model.decode_layers)
        np.testing.assert_array_equal(got, want)
    with monkeypatch.context() as m:  # a run's decode steps through the one-op layers, against transformers
        m.setenv("EPRT_CPU_EXPERTS", "numba")
        from test_generate import run

        assert run(path, [PROMPTS[1]], n=16)[0].token_ids == hf_greedy(path, PROMPTS[1], 16)


@pytest.mark.parametrize(
    "env, first, want",
    [
        ({}, "", "20"),  # the compiled path: OpenBLAS's idle threads spin ~0.3 ms, not ~0.1 s
        ({"EPRT_CPU_EXPERTS": "numpy"}, "", None),  # the NumPy path's products are OpenBLAS's threads' work
        ({"OPENBLAS_THREAD_TIMEOUT": "5"}, "", "5"),  # the user's setting stays
        ({}, "import numpy; ", None),  # too late once OpenBLAS is loaded: left alone
    ],
)
def test_blas_spin_is_shortened_before_numpy_loads(env, first, want):
    """cpu_threads.limit_blas_spin, as the eprt command calls it first (eprt/cli.py), in a fresh process."""
    import subprocess
    import sys

    code = f"{first}import os; from eprt.ops import cpu_threads; cpu_threads.limit_blas_spin(); "
    code += "print(os.environ.get('OPENBLAS_THREAD_TIMEOUT'))"
    base = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_THREAD_TIMEOUT", "EPRT_CPU_EXPERTS")}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(want)
