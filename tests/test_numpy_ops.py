"""The NumPy backend's batched attention and grouped expert GEMMs against their definitions
in eprt/ops/base.py, written here one row, one head and one (token, expert) at a time."""

import functools

import numpy as np
import pytest

from eprt.ops import numpy_ops
from eprt.ops.base import Ops
from eprt.ops.numpy_ops import EXPERT_ROWS_AS_GEMV, NumpyOps, numba_available

# the expert paths: the compiled kernel (numba, the cpu extra) where it imports, and the NumPy fallback
EXPERT_PATHS = [
    pytest.param("numba", marks=pytest.mark.skipif(not numba_available(), reason="numba not installed")),
    "numpy",
]


def in_quads(x, wt):
    """x[n, K] @ wt[K, N] as the compiled expert kernels sum it: acc = 0, then acc += (x0 w0 + x1 w1)
    + (x2 w2 + x3 w3) over k in fours, then the K % 4 rest one at a time, float32, each product
    rounded before its add."""
    acc = np.zeros((x.shape[0], wt.shape[1]), np.float32)
    K4 = wt.shape[0] - wt.shape[0] % 4
    for k in range(0, K4, 4):
        xs = [x[:, k + i : k + i + 1] for i in range(4)]
        acc = acc + ((xs[0] * wt[k] + xs[1] * wt[k + 1]) + (xs[2] * wt[k + 2] + xs[3] * wt[k + 3]))
    for k in range(K4, wt.shape[0]):
        acc = acc + x[:, k : k + 1] * wt[k]
    return acc


def moe_reference(x, weights, ids, w_gate_up, w_down):
    """[T, D] float64: sum over each token's choices of weights[t, j] * down(silu(g) * u) through
    expert ids[t, j], all experts local."""
    want = np.zeros(x.shape)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            g, u = np.split(w_gate_up[ids[t, j]].astype(np.float64) @ x[t], 2)
            want[t] += weights[t, j] * (w_down[ids[t, j]].astype(np.float64) @ (g / (1 + np.exp(-g)) * u))
    return want


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def paged(rng, lens, bs, hk, dh, pad):
    """A shuffled KV pool and block tables [B, MB] padded with ``pad`` past each row's blocks."""
    need = [-(-n // bs) for n in lens]
    nb = sum(need) + 3
    kc = rng.standard_normal((nb, bs, hk, dh), dtype=np.float32)
    vc = rng.standard_normal((nb, bs, hk, dh), dtype=np.float32)
    free = list(rng.permutation(nb))
    tables = np.full((len(lens), max(need) + 2), pad, dtype=np.int32)
    for b, n in enumerate(need):
        tables[b, :n] = [free.pop() for _ in range(n)]
    return kc, vc, tables


def attend_one(q, kc, vc, table, n, scale):
    """q[H, Dh] over positions [0, n) of one sequence, head by head."""
    H, Dh = q.shape
    hk, bs = kc.shape[2], kc.shape[1]
    out = np.empty_like(q)
    for h in range(H):
        g = h // (H // hk)
        k = np.stack([kc[table[p // bs], p % bs, g] for p in range(n)])  # [n, Dh]
        v = np.stack([vc[table[p // bs], p % bs, g] for p in range(n)])
        out[h] = softmax(k @ q[h] * scale) @ v
    return out


@pytest.mark.parametrize("path", EXPERT_PATHS)
@pytest.mark.parametrize("pad", [0, -1])
@pytest.mark.parametrize("hk, group", [(1, 4), (2, 2), (3, 1)])
@pytest.mark.parametrize("dh", [8, 32])  # 32: the compiled kernel on the numba path
def test_attention_decode_matches_rows(pad, hk, group, dh, path):
    rng = np.random.default_rng(hk * 10 + group)
    lens, bs = [1, 16, 17, 50, 3], 16
    kc, vc, tables = paged(rng, lens, bs, hk, dh, pad)
    q = rng.standard_normal((len(lens), hk * group, dh), dtype=np.float32)
    ops = NumpyOps(path)
    assert ops._compiled_attention(q, kc, vc) == (path == "numba" and dh == 32)
    got = ops.attention_decode(q, kc, vc, tables, np.asarray(lens, dtype=np.int32), 0.3)
    for b, n in enumerate(lens):
        np.testing.assert_allclose(got[b], attend_one(q[b], kc, vc, tables[b], n, 0.3), rtol=1e-5, atol=1e-6)


def test_attention_decode_in_gathers_of_a_few_rows(monkeypatch):
    rng = np.random.default_rng(5)
    lens = [40, 1, 33, 7, 64, 2, 19]
    kc, vc, tables = paged(rng, lens, 8, 2, 4, 0)
    q = rng.standard_normal((len(lens), 4, 4), dtype=np.float32)
    args = (q, kc, vc, tables, np.asarray(lens, dtype=np.int32), 0.5)
    whole = NumpyOps().attention_decode(*args)
    monkeypatch.setattr(numpy_ops, "DECODE_GATHER_BYTES", 1)  # one row per gather
    np.testing.assert_allclose(NumpyOps().attention_decode(*args), whole, rtol=1e-6, atol=1e-7)


def verify_rows(rng, ends, qlens, bs):
    """A verify step's rows: sequence b's qlens[b] positions end at ends[b]; per row its table
    (its sequence's) and its context length. Returns (tables [N, MB], lens [N], pool)."""
    need = [-(-n // bs) for n in ends]
    nb = sum(need) + 2
    tables = np.zeros((len(ends), max(need) + 1), dtype=np.int32)
    free = list(rng.permutation(nb))
    for b, n in enumerate(need):
        tables[b, :n] = [free.pop() for _ in range(n)]
    rows = np.repeat(np.arange(len(ends)), qlens)  # [N]
    lens = np.concatenate([np.arange(e - t, e) + 1 for e, t in zip(ends, qlens)]).astype(np.int32)
    return tables[rows], lens, nb


@pytest.mark.parametrize("gather_bytes", [None, 1])  # 1: one sequence per gather
@pytest.mark.parametrize("qlens", [[5, 1, 3, 2], [1, 1, 1, 1], [2, 4, 2, 3]])  # 1: a sequence without drafts
def test_attention_verify_matches_decode_rows(monkeypatch, gather_bytes, qlens):
    """attention_verify gathers each sequence's KV once; each row attends as a decode row would."""
    if gather_bytes is not None:
        monkeypatch.setattr(numpy_ops, "DECODE_GATHER_BYTES", gather_bytes)
    rng = np.random.default_rng(11)
    ends, bs, hk, dh = [17, 5, 40, 16], 8, 2, 4
    tables, lens, nb = verify_rows(rng, ends, qlens, bs)
    kc = rng.standard_normal((nb, bs, hk, dh), dtype=np.float32)
    vc = rng.standard_normal((nb, bs, hk, dh), dtype=np.float32)
    q = rng.standard_normal((len(lens), 2 * hk, dh), dtype=np.float32)
    ops = NumpyOps()
    got = ops.attention_verify(q, kc, vc, tables, lens, np.asarray(qlens), 0.4)
    np.testing.assert_allclose(got, ops.attention_decode(q, kc, vc, tables, lens, 0.4), rtol=1e-5, atol=1e-6)


def test_mla_attention_verify_matches_decode_rows():
    rng = np.random.default_rng(12)
    ends, qlens, bs, H, L, C = [9, 30, 4], [4, 2, 1], 4, 3, 12, 8
    tables, lens, nb = verify_rows(rng, ends, qlens, bs)
    cache = rng.standard_normal((nb, bs, L), dtype=np.float32)
    q = rng.standard_normal((len(lens), H, L), dtype=np.float32)
    ops = NumpyOps()
    got = ops.mla_attention_verify(q, cache, tables, lens, np.asarray(qlens), 0.3, C)
    want = ops.mla_attention_decode(q, cache, tables, lens, 0.3, C)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_attention_prefill_is_causal_from_start_pos():
    rng = np.random.default_rng(7)
    start, T, bs, hk, dh = 21, 6, 8, 2, 4
    kc, vc, tables = paged(rng, [start + T], bs, hk, dh, 0)
    q = rng.standard_normal((T, 2 * hk, dh), dtype=np.float32)
    got = NumpyOps().attention_prefill(q, kc, vc, tables[0], start, 0.4)
    for t in range(T):
        want = attend_one(q[t], kc, vc, tables[0], start + t + 1, 0.4)
        np.testing.assert_allclose(got[t], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", EXPERT_PATHS)
@pytest.mark.parametrize("uploaded", [False, True])  # True: the weights in NumpyOps.weight's layout
@pytest.mark.parametrize("expert_start, local, T", [(0, 6, 15), (2, 3, 15), (5, 4, 15), (9, 2, 15), (0, 3, 40)])
def test_moe_experts_matches_pairs(expert_start, local, T, uploaded, path):
    rng = np.random.default_rng(expert_start + T)
    k, E, D, inter = 3, 9, 8, 5  # experts get 1 to 9 tokens (15) or up to 40 (40): by-row groups and GEMMs
    x = rng.standard_normal((T, D), dtype=np.float32)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    w = rng.random((T, k), dtype=np.float32)
    wgu = rng.standard_normal((local, 2 * inter, D), dtype=np.float32)
    wd = rng.standard_normal((local, D, inter), dtype=np.float32)
    ops = NumpyOps(path)
    got = ops.moe_experts(x, w, ids, *((ops.weight(wgu), ops.weight(wd)) if uploaded else (wgu, wd)), expert_start)
    want = np.zeros((T, D), dtype=np.float64)
    for t in range(T):
        for j in range(k):
            e = ids[t, j] - expert_start
            if 0 <= e < local:
                g, u = np.split(wgu[e] @ x[t], 2)
                want[t] += w[t, j] * (wd[e] @ (g / (1 + np.exp(-g)) * u))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not got[
        [t for t in range(T) if not ((ids[t] >= expert_start) & (ids[t] < expert_start + local)).any()]
    ].any()


@pytest.mark.parametrize("path", EXPERT_PATHS)
def test_expert_rows_do_not_depend_on_their_group(path):
    """Up to EXPERT_ROWS_AS_GEMV rows an expert computes each row alone: a row's bits are the same
    whichever rows share its group (EPLB splits groups only above that); above, one GEMM. Stacks
    whose width is not a multiple of 16 run this NumPy path on the compiled path too."""
    rng = np.random.default_rng(3)
    ops = NumpyOps(path)
    n, K, N = EXPERT_ROWS_AS_GEMV + 3, 37, 21
    xs = rng.standard_normal((n, K), dtype=np.float32)
    w, _ = ops.expert_weights(rng.standard_normal((2, N, K), dtype=np.float32), np.zeros((2, 16, 16), np.float32))
    assert w.shape == (2, N, K)  # N % 16 != 0: never panels
    R = EXPERT_ROWS_AS_GEMV
    full = ops.expert_products(xs[:R], w, np.array([0, 0, R]))  # all rows on expert 1
    for lo, hi in [(0, 2), (0, 3), (1, 5), (4, 9), (3, 16), (5, 6)]:
        y = ops.expert_products(xs[lo:hi], w, np.array([0, 0, hi - lo]))
        assert np.array_equal(y, full[lo:hi]), (lo, hi)
    want = xs.astype(np.float64) @ w[1].T.astype(np.float64)
    np.testing.assert_allclose(full, want[:R], rtol=1e-5, atol=1e-5)
    whole = ops.expert_products(xs, w, np.array([0, 0, n]))  # above the limit: one GEMM
    np.testing.assert_allclose(whole, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not numba_available(), reason="numba not installed")
def test_panel_experts_sum_in_quads_whatever_their_group():
    """On the compiled path, stacks of widths that are multiples of 16 are stored as panels and
    every group of rows, of any size, sums in the quad order (in_quads): a row's bits never depend
    on its batch-mates, so EPLB may split any group."""
    rng = np.random.default_rng(4)
    ops = NumpyOps("numba")
    n, K, N = 2 * EXPERT_ROWS_AS_GEMV + 3, 37, 48  # K % 4 != 0: the remainder terms too
    host = rng.standard_normal((3, N, K), dtype=np.float32)
    w, _ = ops.expert_weights(host, np.zeros((3, 16, 16), np.float32))
    assert w.shape == (3, N // 16, K, 16) and np.array_equal(w[2, 1], host[2, 16:32].T)
    xs = rng.standard_normal((n, K), dtype=np.float32)
    full = ops.expert_products(xs, w, np.array([0, 0, n, n]))  # every row on expert 1
    np.testing.assert_array_equal(full, in_quads(xs, host[1].T))
    for lo, hi in [(0, 1), (0, 2), (1, 5), (4, 9), (3, 20), (5, 6), (0, n)]:
        y = ops.expert_products(xs[lo:hi], w, np.array([0, 0, hi - lo, hi - lo]))
        assert np.array_equal(y, full[lo:hi]), (lo, hi)
    split = ops.expert_products(xs[:7], w, np.array([0, 3, 3, 7]))  # experts 0 and 2
    np.testing.assert_array_equal(split[:3], in_quads(xs[:3], host[0].T))
    np.testing.assert_array_equal(split[3:], in_quads(xs[3:7], host[2].T))


@pytest.mark.parametrize("path", EXPERT_PATHS)
def test_linear_rows_do_not_depend_on_their_batch(path):
    """On the compiled path a linear weight of a width that is a multiple of 16 is stored as panels
    and every row count sums in the quad order (in_quads): a row's bits are the same alone, in a
    verify step's few rows or in a batch. Other widths, and the NumPy path, run OpenBLAS."""
    rng = np.random.default_rng(5)
    ops = NumpyOps(path)
    K = 37  # K % 4 != 0: the kernel's remainder terms too
    x = rng.standard_normal((40, K), dtype=np.float32)
    bias = rng.standard_normal(64, dtype=np.float32)
    for N in (64, 70):
        host = rng.standard_normal((N, K), dtype=np.float32)
        w = ops.linear_weight(host)
        panels = path == "numba" and N % 16 == 0
        assert w.shape == ((N // 16, K, 16) if panels else (N, K))
        want = x.astype(np.float64) @ host.T.astype(np.float64)
        full = ops.linear(x, w)
        np.testing.assert_allclose(full, want, rtol=1e-5, atol=1e-5)
        if panels:
            np.testing.assert_array_equal(full, in_quads(x, host.T))
            for lo, hi in [(0, 1), (0, 2), (1, 4), (3, 8), (5, 21), (0, 40)]:
                assert np.array_equal(ops.linear(x[lo:hi], w), full[lo:hi]), (lo, hi)
        got = ops.linear(x[:3], w, bias[:N] if N <= 64 else None)
        np.testing.assert_allclose(got, want[:3] + (bias[:N] if N <= 64 else 0), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not numba_available(), reason="numba not installed")
@pytest.mark.parametrize("weights", ["f32", "bf16"])
def test_one_row_through_a_large_matrix_sums_in_quads(weights):
    """One row through a matrix past the panels' prefetch distance (the one-row pass's prefetching
    and plain loops, their bound inside a panel at k % 4 != 0; K % 4 != 0: the rest too) sums in the
    quad order (in_quads) of the float32 weights the panels hold, as rows in fours do."""
    from eprt.ops import cpu_weights

    rng = np.random.default_rng(31)
    ops = NumpyOps("numba", weights=weights, threads=1)
    host = rng.standard_normal((256, 509), dtype=np.float32)  # [N, K]
    held = host if weights == "f32" else cpu_weights.float32(cpu_weights.f32_to_bf16_bits(host))
    w = ops.linear_weight(host)
    x = rng.standard_normal((5, 509), dtype=np.float32)
    want = in_quads(x, held.T)
    np.testing.assert_array_equal(ops.linear(x[:1], w), want[:1])
    np.testing.assert_array_equal(ops.linear(x, w), want)  # four rows, then the fifth alone


@pytest.mark.parametrize("path", EXPERT_PATHS)
def test_moe_one_token_path_equals_the_grouped_path(path):
    """Decode at batch 1 takes moe_experts' one-token path; the grouped path gives each token's
    row the same bits when its experts have one row each (the rest of a batch elsewhere)."""
    rng = np.random.default_rng(5)
    ops = NumpyOps(path)
    T, k, E = 3, 2, 6
    x = rng.standard_normal((T, 16), dtype=np.float32)
    ids = np.array([[4, 1], [0, 2], [3, 5]], dtype=np.int32)  # every expert chosen once
    w = rng.random((T, k), dtype=np.float32)
    for D, inter in ((16, 12), (16, 16)):  # 2I = 24: NumPy's products everywhere; 32: panels on numba
        wgu, wd = ops.expert_weights(
            rng.standard_normal((E, 2 * inter, D), dtype=np.float32),
            rng.standard_normal((E, D, inter), dtype=np.float32),
        )
        for start in (0, 2):  # all experts local; some another rank's
            share = ops.take_experts(wgu, wd, list(range(E - start)))
            grouped = ops.moe_experts(x, w, ids, *share, start)
            one = [ops.moe_experts(x[t : t + 1], w[t : t + 1], ids[t : t + 1], *share, start) for t in range(T)]
            assert np.array_equal(np.concatenate(one), grouped)


@pytest.mark.skipif(not numba_available(), reason="numba not installed")
@pytest.mark.parametrize("T", [2, 5, 9, EXPERT_ROWS_AS_GEMV, 40])  # an expert has at most T rows
def test_panel_experts_give_a_token_the_bits_of_one_token_whatever_their_group(T):
    """On the compiled path every group of rows runs in the fused kernel: a token's output has the
    same bits in a step of T tokens (a verify step, experts shared between tokens, groups past
    EXPERT_ROWS_AS_GEMV) as alone (a decode step at batch 1), on every share of the experts, and
    stays close to the float64 reference."""
    rng = np.random.default_rng(11)
    k, E, D, inter = 2, 6, 48, 24  # E small: most experts get several rows
    ops = NumpyOps("numba")
    host_gu = rng.standard_normal((E, 2 * inter, D), dtype=np.float32)
    host_d = rng.standard_normal((E, D, inter), dtype=np.float32)
    wgu, wd = ops.expert_weights(host_gu, host_d)
    assert wgu.ndim == wd.ndim == 4  # panels
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    x = rng.standard_normal((T, D), dtype=np.float32)
    w = rng.random((T, k), dtype=np.float32)
    for start in (0, 2):  # all experts local; some another rank's
        share = ops.take_experts(wgu, wd, list(range(E - start)))
        got = ops.moe_experts(x, w, ids, *share, start)
        for t in range(T):
            one = ops.moe_experts(x[t : t + 1], w[t : t + 1], ids[t : t + 1], *share, start)
            np.testing.assert_array_equal(got[t], one[0])
    np.testing.assert_allclose(
        ops.moe_experts(x, w, ids, wgu, wd, 0), moe_reference(x, w, ids, host_gu, host_d), rtol=1e-4, atol=1e-4
    )


@pytest.mark.skipif(not numba_available(), reason="numba not installed")
def test_take_experts_keeps_each_layout():
    """EPLB's restack (take_experts) picks experts in order and keeps the layout they were stored
    in: panels on the compiled path, input-major stacks otherwise."""
    rng = np.random.default_rng(12)
    host_gu = rng.standard_normal((4, 32, 16), dtype=np.float32)
    host_d = rng.standard_normal((4, 16, 16), dtype=np.float32)
    for ops in (NumpyOps("numba"), NumpyOps("numpy")):
        wgu, wd = ops.expert_weights(host_gu, host_d)
        gu, d = ops.take_experts(np.concatenate([wgu, wgu[:1]]), np.concatenate([wd, wd[:1]]), [4, 2, 2])
        want_gu, want_d = ops.expert_weights(host_gu[[0, 2, 2]], host_d[[0, 2, 2]])
        for got, want in ((gu, want_gu), (d, want_d)):
            assert got.shape == want.shape and got.strides == want.strides and np.array_equal(got, want)


@pytest.mark.skipif(not numba_available(), reason="numba not installed")
def test_compiled_rms_norm_and_rope_have_the_numpy_bits():
    """The compiled path's rms_norm (NumPy's pairwise float32 sum: blocks of 8 accumulators up to
    128 items, halves above) and rope give the NumPy expressions' bits at every width."""
    rng = np.random.default_rng(17)
    compiled, plain = NumpyOps("numba"), NumpyOps("numpy")
    for T, D in [(1, 7), (3, 64), (2, 129), (5, 300), (1, 512), (2, 1000), (1, 7168)]:
        x = rng.standard_normal((T, D), dtype=np.float32) * 3
        w = rng.standard_normal(D, dtype=np.float32)
        np.testing.assert_array_equal(compiled.rms_norm(x, w, 1e-6), plain.rms_norm(x, w, 1e-6))
        r = rng.standard_normal((T, D), dtype=np.float32)
        for got, want in zip(compiled.add_rms_norm(x, r, w, 1e-5), plain.add_rms_norm(x, r, w, 1e-5)):
            np.testing.assert_array_equal(got, want)
    for T, H, Dh in [(1, 8, 64), (4, 2, 6), (3, 5, 128)]:
        x = rng.standard_normal((T, H, Dh), dtype=np.float32)
        table = rng.standard_normal((40, Dh), dtype=np.float32)  # [P, Dh]: cos | sin
        positions = rng.integers(0, 40, T).astype(np.int32)
        np.testing.assert_array_equal(compiled.rope(x, positions, table), plain.rope(x, positions, table))


@pytest.mark.skipif(not numba_available(), reason="numba not installed")
def test_compiled_attention_prologue_has_the_bits_of_the_ops_apart():
    """NumpyOps.qk_rope_kv_write on the compiled path (one call: per-head q/k norm, rope, KV write)
    gives the bits of rms_norm, rope and kv_write apart and of the NumPy path: q, and the caches (a
    negative slot not written), with and without q/k norms, q/k/v as row views of one product or apart;
    on 2 threads (8 rows and up: rows shared out) too."""
    rng = np.random.default_rng(23)
    compiled, plain, two = NumpyOps("numba"), NumpyOps("numpy"), NumpyOps("numba", threads=2)
    cases = [(1, 8, 4, 64, True), (5, 4, 2, 16, False), (3, 6, 2, 128, True), (2, 2, 1, 6, True), (13, 4, 2, 16, True)]
    for T, H, Hk, Dh, normed in cases:
        qkv = rng.standard_normal((T, (H + 2 * Hk) * Dh), dtype=np.float32) * 3
        views = [
            qkv[:, a:b].reshape(T, -1, Dh) for a, b in ((0, H * Dh), (H * Dh, (H + Hk) * Dh), ((H + Hk) * Dh, None))
        ]
        norms = tuple(rng.standard_normal(Dh, dtype=np.float32) for _ in range(2)) if normed else None
        table = rng.standard_normal((40, Dh), dtype=np.float32)  # [P, Dh]: cos | sin
        positions = rng.integers(0, 40, T).astype(np.int32)
        slots = rng.permutation(24)[:T].astype(np.int32)
        slots[-1] = -1 if T > 1 else slots[-1]
        outs = []
        for run, (q, k, v) in [
            (compiled.qk_rope_kv_write, views),
            (compiled.qk_rope_kv_write, [np.ascontiguousarray(a) for a in views]),
            (two.qk_rope_kv_write, views),
            (plain.qk_rope_kv_write, views),
        ]:
            k_cache, v_cache = np.zeros((3, 8, Hk, Dh), np.float32), np.zeros((3, 8, Hk, Dh), np.float32)
            outs.append((run(q, k, v, norms, 1e-6, positions, table, k_cache, v_cache, slots), k_cache, v_cache))
        want = _prologue_apart(plain, views, norms, positions, table, slots, Hk)
        for got in outs:
            for a, b in zip(want, got):
                np.testing.assert_array_equal(a, b)
        assert np.count_nonzero(outs[0][2].any(axis=(2, 3))) == np.count_nonzero(slots >= 0)


@pytest.mark.skipif(not numba_available(), reason="numba not installed")
@pytest.mark.parametrize("weights", ["f32", "bf16", "int8"])
def test_compiled_attention_block_has_the_bits_of_its_ops_apart(weights):
    """NumpyOps.attention_decode_block on the compiled path (qkv product, prologue, decode attention
    and o product in one call) gives the bits of Ops' composition of the same ops (each its own
    call): the output and both caches, with and without q/k norms, a padding slot not written; on
    2 threads (one row: the same one call; 8 rows and up: each step's rows shared out) too."""
    rng = np.random.default_rng(29)
    cases = [(1, 8, 4, 64, 512, True), (3, 4, 2, 16, 48, False), (2, 2, 1, 32, 32, True), (12, 8, 4, 64, 512, True)]
    for T, H, Hk, Dh, D, normed in cases:
        host_qkv = rng.standard_normal(((H + 2 * Hk) * Dh, D), dtype=np.float32) * 0.1
        host_o = rng.standard_normal((D, H * Dh), dtype=np.float32) * 0.1
        norms = tuple(rng.standard_normal(Dh, dtype=np.float32) for _ in range(2)) if normed else None
        table = rng.standard_normal((40, Dh), dtype=np.float32)  # [P, Dh]: cos | sin
        positions = rng.integers(0, 40, T).astype(np.int32)
        slots = (np.arange(T, dtype=np.int32) * 5 + 1) % 24  # distinct, some read by other rows
        slots[-1] = -1 if T > 1 else slots[-1]
        tables, lens = np.tile(np.array([[2, 0, 1]], np.int32), (T, 1)), rng.integers(1, 24, T).astype(np.int32)
        x = rng.standard_normal((T, D), dtype=np.float32)
        before = [rng.standard_normal((3, 8, Hk, Dh), dtype=np.float32) for _ in range(2)]  # k, v caches
        outs = []
        for threads, fused in ((1, True), (2, True), (1, False)):
            ops = NumpyOps("numba", weights=weights, threads=threads)
            qkv, o = ops.linear_weight(host_qkv), ops.linear_weight(host_o)
            k_cache, v_cache = (c.copy() for c in before)
            assert ops._compiled_block(x, qkv, o, norms, table, k_cache, v_cache) == (threads == 1 or T >= 8)
            run = ops.attention_decode_block if fused else functools.partial(Ops.attention_decode_block, ops)
            args = (norms, 1e-6, positions, table, k_cache, v_cache, slots, tables, lens, 0.125)
            outs.append((run(x, qkv, o, H, *args), k_cache, v_cache))
        for got in outs[:2]:
            for a, b in zip(outs[2], got):
                np.testing.assert_array_equal(a, b)
        assert not np.array_equal(outs[2][1], before[0])  # the step's keys were written


@pytest.mark.skipif(not numba_available(), reason="numba not installed")
@pytest.mark.parametrize("weights", ["f32", "bf16", "int8"])
def test_compiled_route_rows_has_the_bits_of_linear_then_route(weights):
    """NumpyOps.route_rows on the compiled path (the router's product and shift in one call) gives the
    bits of Ops' linear then route: weights, ids and the counts; 20 experts (no panels, or padded
    int8 panels) take the two ops apart."""
    rng = np.random.default_rng(37)
    ops = NumpyOps("numba", weights=weights, threads=1)
    for T, E, D, k in [(1, 16, 512, 2), (5, 64, 48, 8), (3, 32, 32, 1), (2, 20, 32, 2)]:
        w = ops.linear_weight(rng.standard_normal((E, D), dtype=np.float32))
        compiled = numpy_ops._panelled(w, 2) and ops.kernels.exact_columns(w) == E  # one call
        assert compiled == (E % 16 == 0)
        x = rng.standard_normal((T, D), dtype=np.float32)
        for renormalize in (True, False):
            counts = [np.full(E, 3, np.int32) for _ in range(2)]
            got = ops.route_rows(x, w, None, k, renormalize, None, counts[0], (0, E))
            want = Ops.route_rows(ops, x, w, None, k, renormalize, None, counts[1], (0, E))
            np.testing.assert_array_equal(got[0].view(np.int32), want[0].view(np.int32))
            np.testing.assert_array_equal(got[1], want[1])
            np.testing.assert_array_equal(counts[0], counts[1])
            assert got[2] is want[2] is None and counts[0].sum() == 3 * E + T * k


def _decode_layer_case(rng, ops, T, E, normed, start):
    """(DecodeLayer, meta, caches) of random weights: H 4, Hk 2, Dh 16, D 64, I 32, this rank's 8
    experts from ``start`` of E, top 2."""
    H, Hk, Dh, D, I, El = 4, 2, 16, 64, 32, 8
    host = lambda *shape: rng.standard_normal(shape, dtype=np.float32) * 0.2  # noqa: E731
    norms = (host(Dh) + 1, host(Dh) + 1) if normed else None
    experts = ops.expert_weights(host(El, 2 * I, D), host(El, D, I))
    mats = [ops.linear_weight(host(*shape)) for shape in (((H + 2 * Hk) * Dh, D), (D, H * Dh), (E, D))]
    weights = (host(D) + 1, *mats[:2], norms, host(D) + 1, mats[2], *experts)
    constants = dict(heads=H, eps=1e-6, scale=0.25, top_k=2, renormalize=normed, local=(start, El))
    layer = ops.decode_layer_weights(*weights, **constants)
    positions = rng.integers(0, 40, T).astype(np.int32)
    slots = (np.arange(T, dtype=np.int32) * 5 + 1) % 24  # distinct, some read by other rows
    tables, lens = np.tile(np.array([[2, 0, 1]], np.int32), (T, 1)), rng.integers(1, 24, T).astype(np.int32)
    meta = (positions, host(40, Dh), slots, tables, lens)  # cos_sin [P, Dh]
    return layer, meta, [host(3, 8, Hk, Dh) for _ in range(2)]


@pytest.mark.skipif(not numba_available(), reason="numba not installed")
@pytest.mark.parametrize("weights", ["f32", "bf16", "int8"])
def test_compiled_decode_layer_has_the_bits_of_its_ops_apart(weights):
    """NumpyOps.decode_layer on the compiled path (norms, attention block, router and experts in two
    calls) gives the bits of Ops' composition of the ops one by one: the MoE partial, the residual,
    both caches and the expert counts, at layer 0 (no residual) and after, with and without q/k norms
    and counts, for this rank's experts among others'; 20 experts (no exact router panels) and 2
    threads take the ops apart."""
    rng, served = np.random.default_rng(41), 0
    for T, E, normed, start, threads in [
        (1, 16, True, 0, 1),
        (3, 32, False, 8, 1),
        (2, 20, True, 0, 1),
        (5, 16, True, 4, 2),
    ]:
        ops = NumpyOps("numba", weights=weights, threads=threads)
        layer, meta, caches = _decode_layer_case(rng, ops, T, E, normed, start)
        assert (layer.compiled is not None) == (E % 16 == 0)
        h, residual = rng.standard_normal((T, 64), dtype=np.float32), rng.standard_normal((T, 64), dtype=np.float32)
        for res, counted in ((None, True), (residual, False)):
            outs = []
            for run in (ops.decode_layer, functools.partial(Ops.decode_layer, ops)):
                kv, counts = [c.copy() for c in caches], np.full(E, 3, np.int32) if counted else None
                outs.append((*run(h, res, layer, *kv, meta, counts), *kv, counts))
            for a, b in zip(*outs):
                np.testing.assert_array_equal(a, b)
            served += np.count_nonzero(outs[0][0].any(axis=1))  # rows with a choice among this rank's experts
            assert not np.array_equal(outs[0][2], caches[0]) and (not counted or outs[0][4].sum() == 3 * E + 2 * T)
    assert served >= 6


def _prologue_apart(ops, views, norms, positions, table, slots, Hk):
    """(q, k_cache, v_cache) from rms_norm, rope and kv_write called one by one."""
    q, k, v = (np.ascontiguousarray(a) for a in views)
    if norms is not None:
        q, k = (ops.rms_norm(a.reshape(-1, a.shape[-1]), w, 1e-6).reshape(a.shape) for a, w in zip((q, k), norms))
    q, k = ops.rope(q, positions, table), ops.rope(k, positions, table)
    Dh = q.shape[-1]
    k_cache, v_cache = np.zeros((3, 8, Hk, Dh), np.float32), np.zeros((3, 8, Hk, Dh), np.float32)
    ops.kv_write(k_cache, v_cache, k, v, slots)
    return q, k_cache, v_cache


def test_numpy_path_runs_without_the_compiled_kernels():
    """The NumPy fallback (no cpu extra) never imports cpu_kernels, which needs numba: expert stacks
    of panel-sized widths, one row and a few, norms and rope."""
    rng = np.random.default_rng(19)
    ops = NumpyOps("numpy")
    wgu, wd = ops.expert_weights(
        rng.standard_normal((4, 2 * 256, 160), dtype=np.float32), rng.standard_normal((4, 160, 256), dtype=np.float32)
    )
    assert wgu.shape == (4, 512, 160) and wd.shape == (4, 160, 256)
    x = rng.standard_normal((3, 160), dtype=np.float32)
    ids, w = np.array([[0, 1], [2, 3], [0, 2]], dtype=np.int32), rng.random((3, 2), dtype=np.float32)
    ops.moe_experts(x[:1], w[:1], ids[:1], wgu, wd, 0)
    ops.moe_experts(x, w, ids, wgu, wd, 0)
    ops.linear(x[:1], ops.linear_weight(rng.standard_normal((512, 160), dtype=np.float32)))  # [1, 160] -> [1, 512]
    ops.rms_norm(x, np.ones(160, np.float32), 1e-6)
    ops.rope(x.reshape(3, 2, 80), np.arange(3), rng.standard_normal((5, 80), dtype=np.float32))
    assert "kernels" not in vars(ops)  # never imported


def test_expert_path_choice(monkeypatch):
    monkeypatch.setenv("EPRT_CPU_EXPERTS", "numpy")
    assert NumpyOps().experts == "numpy" and NumpyOps().describe() == "experts NumPy, weights f32"
    monkeypatch.setenv("EPRT_CPU_EXPERTS", "auto")
    assert NumpyOps().experts == ("numba" if numba_available() else "numpy")
    with pytest.raises(ValueError, match="must be one of"):
        NumpyOps("fortran")
    if not numba_available():
        with pytest.raises(ValueError, match="numba is not installed"):
            NumpyOps("numba")


@pytest.mark.parametrize("path", EXPERT_PATHS)
@pytest.mark.parametrize("T", [3, 5, 9])  # 9: grouped by expert; 3, 5: token by token on the NumPy path
def test_moe_experts_rows_have_the_bits_of_one_token(T, path):
    """A few tokens (a verify step's at batch 1) run token by token where that gives the grouped
    path's bits, and an expert's row has the bits of the one-token path: a verify step's positions
    compute their experts as decode steps do (on the NumPy path, every expert with at most
    EXPERT_ROWS_AS_GEMV rows runs a GEMV per row; on the compiled path, the panels' order)."""
    rng = np.random.default_rng(7)
    k, D, inter, E = 2, 64, 48, 8
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    x = rng.standard_normal((T, D), dtype=np.float32)
    w = rng.random((T, k), dtype=np.float32)
    ops = NumpyOps(path)
    wgu, wd = ops.expert_weights(
        rng.standard_normal((E, 2 * inter, D), dtype=np.float32), rng.standard_normal((E, D, inter), dtype=np.float32)
    )
    got = ops.moe_experts(x, w, ids, wgu, wd, 0)
    for t in range(T):
        one = ops.moe_experts(x[t : t + 1], w[t : t + 1], ids[t : t + 1], wgu, wd, 0)  # [1, D]
        np.testing.assert_array_equal(got[t], one[0])


def test_decode_block_tables_follow_compaction_and_slot_reuse(checkpoint):
    """The executor keeps decode block tables per slot: a slot that changes hands (RELEASE and a
    new PREFILL, or COMPACT) must decode as a fresh executor does."""
    from test_model_parity import executor_for

    path = checkpoint("qwen3_moe")
    a, b = [5, 77, 3, 140, 9, 9, 31], [8, 21, 4, 99, 100, 3, 7, 7, 12]
    ex = executor_for(path, block_size=4, num_blocks=32, max_slots=3)
    ex.allocate(0, a)
    ex.prefill(0, a, 0, len(a))
    ex.allocate(1, b)
    ex.prefill(1, b, 0, len(b))
    for t in range(5):  # crosses block edges; caches both rows
        ex.decode([0, 1], [10 + t, 20 + t])
    ex.free(0)
    ex.allocate(0, b)  # slot 0 changes hands
    ex.prefill(0, b, 0, len(b))
    ex.compact(1, 2)  # and slot 1's sequence moves to slot 2
    got = ex.decode([0, 2], [30, 31])
    fresh = executor_for(path, block_size=4, num_blocks=32, max_slots=3)
    fresh.allocate(0, b)
    fresh.prefill(0, b, 0, len(b))
    fresh.allocate(1, b)
    fresh.prefill(1, b, 0, len(b))
    for t in range(5):
        fresh.decode([1], [20 + t])
    want = fresh.decode([0, 1], [30, 31])
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_weight_keeps_shape_and_values():
    host = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    for a in (host, host[0], host[0, 0]):
        w = NumpyOps().weight(a)
        assert w.shape == a.shape and np.array_equal(w, a) and w.dtype == np.float32


def test_compute_identity_names_the_expert_path():
    """Ranks compare compute identities at start-up: ranks on different expert paths round
    differently (and would split EPLB groups differently), so the identity names the path."""
    from eprt.ops import device

    what = device.compute_identity(NumpyOps("numpy"))[0]
    assert "experts NumPy" in what
    if numba_available():
        assert "experts numba" in device.compute_identity(NumpyOps("numba"))[0]
