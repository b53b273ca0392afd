"""The NumPy backend's batched attention and grouped expert GEMMs against their definitions
in eprt/ops/base.py, written here one row, one head and one (token, expert) at a time."""

import numpy as np
import pytest

from eprt.ops import numpy_ops
from eprt.ops.numpy_ops import EXPERT_ROWS_AS_GEMV, LINEAR_KERNEL_ROWS, NumpyOps, numba_available

# the expert paths: the compiled kernel (numba, the cpu extra) where it imports, and the NumPy fallback
EXPERT_PATHS = [
    pytest.param("numba", marks=pytest.mark.skipif(not numba_available(), reason="numba not installed")),
    "numpy",
]


def in_k_order(x, wt):
    """x[1, K] @ wt[K, N] as cpu_kernels.row_product sums it: acc += x[k] * wt[k] for k in order,
    float32, each product rounded before its add (NumPy's float32 multiply, then add)."""
    acc = np.zeros((1, wt.shape[1]), np.float32)
    for k in range(wt.shape[0]):
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


@pytest.mark.parametrize("pad", [0, -1])
@pytest.mark.parametrize("hk, group", [(1, 4), (2, 2), (3, 1)])
def test_attention_decode_matches_rows(pad, hk, group):
    rng = np.random.default_rng(hk * 10 + group)
    lens, bs, dh = [1, 16, 17, 50, 3], 16, 8
    kc, vc, tables = paged(rng, lens, bs, hk, dh, pad)
    q = rng.standard_normal((len(lens), hk * group, dh), dtype=np.float32)
    got = NumpyOps().attention_decode(q, kc, vc, tables, np.asarray(lens, dtype=np.int32), 0.3)
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
    whichever rows share its group (EPLB splits groups only above that). A single row runs a GEMV:
    OpenBLAS's, or on the compiled path row_product's, k in order (the kernel's bits hold from 2
    rows up); above the limit, one GEMM."""
    rng = np.random.default_rng(3)
    ops = NumpyOps(path)
    n, K, N = EXPERT_ROWS_AS_GEMV + 3, 37, 21  # K % 4 != 0: the kernel's remainder terms too
    xs = rng.standard_normal((n, K), dtype=np.float32)
    w = ops.weight(rng.standard_normal((2, N, K), dtype=np.float32))  # [El, N, K]
    R = EXPERT_ROWS_AS_GEMV
    full = ops.expert_products(xs[:R], w, np.array([0, 0, R]))  # all rows on expert 1
    for lo, hi in [(0, 2), (0, 3), (1, 5), (4, 9), (3, 16)] + ([(5, 6)] if path == "numpy" else []):
        y = ops.expert_products(xs[lo:hi], w, np.array([0, 0, hi - lo]))
        assert np.array_equal(y, full[lo:hi]), (lo, hi)
    want = xs.astype(np.float64) @ w[1].T.astype(np.float64)
    np.testing.assert_allclose(full, want[:R], rtol=1e-5, atol=1e-5)
    one = ops.expert_products(xs[:1], w, np.array([0, 1, 1]))  # one row, on expert 0: a GEMV
    np.testing.assert_array_equal(one, in_k_order(xs[:1], w[0].T) if path == "numba" else xs[:1] @ w[0].T)
    whole = ops.expert_products(xs, w, np.array([0, 0, n]))  # above the limit: one GEMM
    np.testing.assert_allclose(whole, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", EXPERT_PATHS)
def test_linear_of_a_few_rows(path):
    """2..LINEAR_KERNEL_ROWS rows (a verify step, a small batch) run the compiled product on the
    numba path: x @ w.T within float32 rounding, each row's bits whatever rows share the call;
    one row runs row_product (k in order) up to its ROW_COLUMNS, more rows stay with OpenBLAS."""
    rng = np.random.default_rng(5)
    ops = NumpyOps(path)
    K, N = 37, 70  # K % 4 != 0: the kernel's remainder terms too
    x = rng.standard_normal((LINEAR_KERNEL_ROWS + 2, K), dtype=np.float32)
    w = ops.weight(rng.standard_normal((N, K), dtype=np.float32))  # [N, K]
    bias = rng.standard_normal(N, dtype=np.float32)
    want = x.astype(np.float64) @ w.T.astype(np.float64) + bias
    for rows in (1, 2, 5, LINEAR_KERNEL_ROWS, LINEAR_KERNEL_ROWS + 2):
        np.testing.assert_allclose(ops.linear(x[:rows], w, bias), want[:rows], rtol=1e-5, atol=1e-5)
    if path == "numba":
        full = ops.linear(x[:LINEAR_KERNEL_ROWS], w)
        for lo, hi in [(0, 2), (1, 4), (3, 8)]:
            assert np.array_equal(ops.linear(x[lo:hi], w), full[lo:hi]), (lo, hi)
        np.testing.assert_array_equal(ops.linear(x[:1], w), in_k_order(x[:1], w.T))
        wide = ops.weight(rng.standard_normal((ops.kernels.ROW_COLUMNS + 1, K), dtype=np.float32))
        np.testing.assert_array_equal(ops.linear(x[:1], wide), x[:1] @ wide.T)  # past ROW_COLUMNS: OpenBLAS


@pytest.mark.parametrize("path", EXPERT_PATHS)
def test_moe_one_token_path_equals_the_grouped_path(path):
    """Decode at batch 1 takes moe_experts' one-token path; the grouped path gives each token's
    row the same bits when its experts have one row each (the rest of a batch elsewhere)."""
    rng = np.random.default_rng(5)
    ops = NumpyOps(path)
    T, k, E, D, inter = 3, 2, 6, 16, 12
    x = rng.standard_normal((T, D), dtype=np.float32)
    ids = np.array([[4, 1], [0, 2], [3, 5]], dtype=np.int32)  # every expert chosen once
    w = rng.random((T, k), dtype=np.float32)
    wgu = ops.weight(rng.standard_normal((E, 2 * inter, D), dtype=np.float32))
    wd = ops.weight(rng.standard_normal((E, D, inter), dtype=np.float32))
    for start in (0, 2):  # all experts local; some another rank's
        grouped = ops.moe_experts(x, w, ids, wgu[: E - start], wd[: E - start], start)
        one = [
            ops.moe_experts(x[t : t + 1], w[t : t + 1], ids[t : t + 1], wgu[: E - start], wd[: E - start], start)
            for t in range(T)
        ]
        assert np.array_equal(np.concatenate(one), grouped)


@pytest.mark.skipif(not numba_available(), reason="numba not installed")
@pytest.mark.parametrize("T", [2, 5, 9, EXPERT_ROWS_AS_GEMV])  # an expert has at most T rows
def test_small_experts_rows_have_the_bits_of_one_token_whatever_their_group(T):
    """On the compiled path, experts of small matrices run every group of up to EXPERT_ROWS_AS_GEMV
    rows, one row included, in the fused kernel: a token's output has the same bits in a step of T
    tokens (a verify step, experts shared between tokens) as alone (a decode step at batch 1), and
    stays close to the float64 reference. Larger matrices run a lone row in row_product's order."""
    rng = np.random.default_rng(11)
    k, E, D, inter = 2, 6, 40, 24  # E small: most experts get several rows
    ops = NumpyOps("numba")
    wgu = ops.weight(rng.standard_normal((E, 2 * inter, D), dtype=np.float32))
    wd = ops.weight(rng.standard_normal((E, D, inter), dtype=np.float32))
    assert not ops._rows_alone(wgu, wd) and ops._rows_alone(np.empty((E, 1024, 512), np.float32), wd)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    x = rng.standard_normal((T, D), dtype=np.float32)
    w = rng.random((T, k), dtype=np.float32)
    for start in (0, 2):  # all experts local; some another rank's
        got = ops.moe_experts(x, w, ids, wgu[: E - start], wd[: E - start], start)
        for t in range(T):
            one = ops.moe_experts(x[t : t + 1], w[t : t + 1], ids[t : t + 1], wgu[: E - start], wd[: E - start], start)
            np.testing.assert_array_equal(got[t], one[0])
    np.testing.assert_allclose(
        ops.moe_experts(x, w, ids, wgu, wd, 0), moe_reference(x, w, ids, wgu, wd), rtol=1e-4, atol=1e-4
    )


@pytest.mark.skipif(not numba_available(), reason="numba not installed")
def test_large_experts_run_a_lone_row_in_k_order_in_both_moe_paths():
    """On the compiled path experts of larger matrices run a lone row's products in row_product's
    order (k one at a time, the weights streamed in memory order), in the one-token kernel (decode
    at batch 1) and in a grouped step where the token's experts have one row each, with the same
    bits; their groups of 2 or more rows keep _product's; all within float32 rounding of float64."""
    rng = np.random.default_rng(13)
    k, E, D, inter = 2, 8, 160, 256  # gate/up [512, 160]: 320 KiB, past KERNEL_ONE_ROW_BYTES
    ops = NumpyOps("numba")
    wgu = ops.weight(rng.standard_normal((E, 2 * inter, D), dtype=np.float32))
    wd = ops.weight(rng.standard_normal((E, D, inter), dtype=np.float32))
    assert ops._rows_alone(wgu, wd)
    x = rng.standard_normal((4, D), dtype=np.float32)
    w = rng.random((4, k), dtype=np.float32)
    ids = np.array([[0, 1], [2, 3], [4, 5], [4, 6]], dtype=np.int32)  # experts 0-3, 6 alone; 4 twice
    for start in (0, 2):  # all experts local; some another rank's
        got = ops.moe_experts(x, w, ids, wgu[: E - start], wd[: E - start], start)
        for t in (0, 1):  # tokens whose experts have one row each
            one = ops.moe_experts(x[t : t + 1], w[t : t + 1], ids[t : t + 1], wgu[: E - start], wd[: E - start], start)
            np.testing.assert_array_equal(got[t], one[0])
    lone, quads = (
        ops.kernels.expert_ffn(x[:1], *ops._kernel_weights(wgu, wd), np.array([3]), np.array([0, 1]), alone)
        for alone in (True, False)
    )
    g, u = np.split(in_k_order(x[:1], wgu[3].T), 2, axis=1)
    np.testing.assert_allclose(lone, in_k_order(g / (1 + np.exp(-g)) * u, wd[3].T), rtol=1e-6, atol=1e-6)
    assert not np.array_equal(lone, quads)  # the lone row's order is row_product's, not _product's
    # wider than ROW_COLUMNS: products apart, a lone row on OpenBLAS's GEMV, the same bits either way
    wide_gu = ops.weight(rng.standard_normal((E, 2 * (ops.kernels.ROW_COLUMNS // 2 + 1), 40), dtype=np.float32))
    wide_d = ops.weight(rng.standard_normal((E, 40, ops.kernels.ROW_COLUMNS // 2 + 1), dtype=np.float32))
    assert ops._fused(wgu, wd) and not ops._fused(wide_gu, wide_d)
    x40 = rng.standard_normal((2, 40), dtype=np.float32)
    got = ops.moe_experts(x40, w[:2], ids[:2], wide_gu, wide_d, 0)
    for t in (0, 1):
        np.testing.assert_array_equal(
            got[t], ops.moe_experts(x40[t : t + 1], w[t : t + 1], ids[t : t + 1], wide_gu, wide_d, 0)[0]
        )
    np.testing.assert_allclose(
        ops.moe_experts(x, w, ids, wgu, wd, 0), moe_reference(x, w, ids, wgu, wd), rtol=1e-4, atol=1e-4
    )


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


def test_numpy_path_runs_without_the_compiled_kernels():
    """The NumPy fallback (no cpu extra) never imports cpu_kernels, which needs numba: experts of
    large matrices, one row and a few, norms and rope."""
    rng = np.random.default_rng(19)
    ops = NumpyOps("numpy")
    wgu = ops.weight(rng.standard_normal((4, 2 * 256, 160), dtype=np.float32))  # past KERNEL_ONE_ROW_BYTES
    wd = ops.weight(rng.standard_normal((4, 160, 256), dtype=np.float32))
    x = rng.standard_normal((3, 160), dtype=np.float32)
    ids, w = np.array([[0, 1], [2, 3], [0, 2]], dtype=np.int32), rng.random((3, 2), dtype=np.float32)
    ops.moe_experts(x[:1], w[:1], ids[:1], wgu, wd, 0)
    ops.moe_experts(x, w, ids, wgu, wd, 0)
    ops.linear(x[:1], wgu[0])  # [1, 160] @ [160, 512]
    ops.rms_norm(x, np.ones(160, np.float32), 1e-6)
    ops.rope(x.reshape(3, 2, 80), np.arange(3), rng.standard_normal((5, 80), dtype=np.float32))
    assert ops._kernels is None


def test_expert_path_choice(monkeypatch):
    monkeypatch.setenv("EPRT_CPU_EXPERTS", "numpy")
    assert NumpyOps().experts == "numpy" and NumpyOps().describe() == "experts NumPy"
    monkeypatch.setenv("EPRT_CPU_EXPERTS", "auto")
    assert NumpyOps().experts == ("numba" if numba_available() else "numpy")
    with pytest.raises(ValueError, match="must be one of"):
        NumpyOps("fortran")
    if not numba_available():
        with pytest.raises(ValueError, match="numba is not installed"):
            NumpyOps("numba")


@pytest.mark.parametrize("path", EXPERT_PATHS)
@pytest.mark.parametrize("T", [3, 5, 9])  # 9: grouped by expert; 3, 5: token by token
def test_moe_experts_gemv_rows_have_the_bits_of_one_token(T, path):
    """A few tokens (a verify step's at batch 1) run token by token where that gives the grouped
    path's bits, and an expert's row that runs as a GEMV has the bits of the one-token path: a verify
    step's positions compute their experts as decode steps do. On the NumPy path that is every
    expert with at most EXPERT_ROWS_AS_GEMV rows; the compiled kernel's rows (2 or more to an
    expert) have bits of their own, so on that path every expert here gets one row."""
    rng = np.random.default_rng(7)
    k, D, inter = 2, 64, 48
    if path == "numba":
        E = max(8, T * k)
        ids = rng.permutation(E)[: T * k].reshape(T, k).astype(np.int32)  # one row per expert
    else:
        E = 8
        ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
        while np.bincount(ids.ravel(), minlength=E).max() > EXPERT_ROWS_AS_GEMV:
            ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    x = rng.standard_normal((T, D), dtype=np.float32)
    w = rng.random((T, k), dtype=np.float32)
    ops = NumpyOps(path)
    wgu = ops.weight(rng.standard_normal((E, 2 * inter, D), dtype=np.float32))
    wd = ops.weight(rng.standard_normal((E, D, inter), dtype=np.float32))
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
